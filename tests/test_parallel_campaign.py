"""A campaign on several cores (`--jobs`) or machines (`--shard` + `--merge`) is the campaign.

The set of runs is fixed by run index before anything runs, and coverage adds up run by run, so
the merged coverage digest is the one-process digest for any number of workers or shards; a
divergence found by a worker or a shard is the first failing run by index, shrunk and replayable
with the usual command.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign
from pagedkv.harness.swarm.parallel import (
    LayerFactory,
    campaign_indices,
    planned_runs,
    run_indices,
    shard_indices,
)

SEED = 2_025

LAYERS: dict[str, LayerFactory] = {
    "pool": functools.partial(pool_layer, pagedkv_pool),
    "manager": functools.partial(manager_layer, pagedkv_manager),
    "hybrid": functools.partial(manager_layer, pagedkv_manager, attention="hybrid"),
}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize(
    ("name", "steps"), [("pool", 4_000), ("manager", 4_000), ("hybrid", 2_000)]
)
def test_the_merged_digest_is_the_one_process_digest_for_any_number_of_workers(
    name: str, steps: int
) -> None:
    factory = LAYERS[name]
    layer = factory()
    whole = run_campaign(layer, seed=SEED, max_steps=steps)
    assert whole.failure is None
    assert whole.coverage.runs == planned_runs(layer, SEED, steps)
    for jobs in (1, 2, 3):
        indices = campaign_indices(layer, SEED, steps)
        merged = run_indices(layer, seed=SEED, indices=indices, jobs=jobs, factory=factory)
        assert merged.failure is None
        assert merged.coverage == whole.coverage, jobs
        assert merged.coverage.digest() == whole.coverage.digest()


def test_shards_are_a_partition_of_the_runs_by_index() -> None:
    shards = [list(shard_indices(range(10), k, 3)) for k in (1, 2, 3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    with pytest.raises(ValueError):
        list(shard_indices(range(10), 4, 3))


def test_coverage_survives_its_json_form() -> None:
    result = run_campaign(LAYERS["manager"](), seed=SEED, max_steps=1_000)
    coverage = result.coverage
    assert min(coverage.states) < 0 < max(coverage.states)  # signed hashes travel as they are
    assert Coverage.from_json(coverage.to_json()) == coverage
    with pytest.raises(ValueError):
        Coverage.from_json({**coverage.to_json(), "steps": -1})


def _line(report: str, label: str) -> str:
    match = re.search(rf"^  {label}\s+(.*)$", report, re.M)
    assert match, report
    return match.group(1)


def test_shards_merged_give_the_whole_campaign_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["verify", "--quiet", "--steps", "3000", "--seed", "9"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    paths = [str(tmp_path / f"report-{k}.json") for k in (1, 2, 3)]
    for k, path in enumerate(paths, start=1):
        assert main([*args, "--shard", f"{k}/3", "--json", path]) == 0
        shard = capsys.readouterr().out
        assert f"runs ran in            shard {k} of 3" in shard
        assert f"--seed 9 --steps 3000 --shard {k}/3" in shard
    assert main(["verify", "--merge", *reversed(paths)]) == 0
    merged = capsys.readouterr().out
    campaigns = whole.split("pagedkv verify — ")[1:]
    merged_campaigns = merged.split("pagedkv verify — ")[1:]
    # The CPU offload tier's campaign runs after the others in the calling process only (no
    # shards, no JSON report): the whole run has it, the merged report not.
    assert campaigns.pop().startswith("CPU offload tier: spec vs pagedkv.offload")
    assert len(merged_campaigns) == len(campaigns) == 3
    for one, combined in zip(campaigns, merged_campaigns, strict=True):
        for label in ("steps", "calls compared", "full checks", "distinct states"):
            assert _line(combined, label) == _line(one, label)
        assert _line(combined, "coverage digest") == _line(one, "coverage digest")
        assert "3 shards, merged" in combined
        # The coverage table and the replay command are the whole campaign's.
        assert combined.split("\n\n", 1)[1].rstrip() == one.split("\n\n", 1)[1].rstrip()


def test_merge_refuses_reports_that_are_not_every_shard_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["verify", "--quiet", "--layer", "pool", "--steps", "500", "--seed", "9"]
    first, other_seed = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert main([*args, "--shard", "1/2", "--json", first]) == 0
    assert main([*args[:-1], "10", "--shard", "2/2", "--json", other_seed]) == 0
    capsys.readouterr()
    assert main(["verify", "--merge", first]) == 2
    assert "need every shard of 2 once; got 1/2" in capsys.readouterr().err
    assert main(["verify", "--merge", first, other_seed]) == 2
    assert "different campaign seeds" in capsys.readouterr().err
    assert main(["verify", "--merge", first, first]) == 2
    assert "got 1/2, 1/2" in capsys.readouterr().err


BROKEN = ["verify", "--quiet", "--layer", "pool", "--impl", "broken_pools:touch_keeps_queued"]


def test_a_divergence_found_in_a_worker_is_the_first_by_index_shrunk_and_replayable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*BROKEN, "--seed", "3"]) == 1
    alone = capsys.readouterr().out
    assert main([*BROKEN, "--seed", "3", "--jobs", "2"]) == 1
    report = capsys.readouterr().out
    assert "runs ran in            2 worker processes" in report
    # The same failing run, the same counts up to it, shrunk to the same operations.
    for label in ("steps", "calls compared", "distinct states", "coverage digest"):
        assert _line(report, label) == _line(alone, label)
    assert report.split("Failing run", 1)[1] == alone.split("Failing run", 1)[1]
    replay = re.search(r"^Replay it: pagedkv verify (.*--replay-run \d+)$", report, re.M)
    assert replay, report
    assert main(["verify", *replay.group(1).split()]) == 1
    replayed = capsys.readouterr().out
    assert replayed.split("Failing run", 1)[1] == report.split("Failing run", 1)[1]


def test_a_divergence_found_by_a_shard_is_reported_by_the_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BROKEN, "--seed", "3"]) == 1
    alone = capsys.readouterr().out
    paths = [str(tmp_path / f"{k}.json") for k in (1, 2)]
    statuses = [
        main([*BROKEN, "--seed", "3", "--shard", f"{k}/2", "--json", path])
        for k, path in zip((1, 2), paths, strict=True)
    ]
    assert 1 in statuses
    capsys.readouterr()
    assert main(["verify", "--merge", *paths]) == 1
    merged = capsys.readouterr().out
    assert merged.split("Failing run", 1)[1] == alone.split("Failing run", 1)[1]
