"""vLLM's own code as the oracle: short derandomized conformance runs in CI.

Fetches the KV cache modules of vllm 0.8.5, 0.32.0 and 0.33.0 (a few hundred kilobytes of each
wheel, by range requests, cached in ~/.cache/pagedkv) and runs the pool's and the manager's swarm
campaigns against them under `vllm-0.8.5`, `vllm-0.32` and `vllm-0.33` semantics, on each
release's domain, each release in a process of its own (`tests/vllm_campaign.py`). Controls
show the runs are not vacuous. Only an unreachable package index with nothing cached skips, with
the reason in the test report (`-ra`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent
CAMPAIGN = TESTS / "vllm_campaign.py"
UNREACHABLE = 3
LAYERS = ("pool", "manager")
VLLM_0_33_SWITCHES = (
    "usage_excludes_null_block",
    "free_uncached_to_head",
    "free_tail_first_without_caching",
)
"""The switches whose flip the CI campaign finds; `lookup_hashes_every_full_block` needs a rarer
sequence (a preempted request whose accepted draft filled a block another request then
cached), replayed by `vllm_033_divergences.py` instead."""


def run(*args: str, what: str) -> subprocess.CompletedProcess[str]:
    """Run a Python script or `-c` program about `what` (a release); skip, saying so, if it
    found the package index unreachable with nothing cached."""
    completed = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, check=False
    )
    if completed.returncode == UNREACHABLE or (
        completed.returncode == 2 and "urlopen error" in completed.stderr
    ):
        pytest.skip(f"{what}: the package index is unreachable and nothing is cached")
    return completed


def campaign(
    against: str,
    steps: int,
    semantics: str | None = None,
    layers: str | None = None,
    settings: str | None = None,
    one_block_size: bool = False,
) -> tuple[int, Any]:
    """Exit status and JSON report of `vllm_campaign.py` (see there)."""
    extra = [semantics or "-", layers or "-", settings or "-"]
    if one_block_size:
        extra.append("one-block-size")
    completed = run(str(CAMPAIGN), against, str(steps), *extra, what=against)
    assert completed.stdout, completed.stderr
    return completed.returncode, json.loads(completed.stdout.splitlines()[-1])


@pytest.mark.slow
def test_vllm_0_8_5_conforms_to_the_spec_under_its_semantics() -> None:
    status, report = campaign("vllm==0.8.5", steps=20_000)
    assert status == 0, json.dumps(report, indent=1)
    assert report["semantics"] == "vllm-0.8.5"
    for layer in LAYERS:
        assert report[layer]["failure"] is None
        assert report[layer]["steps"] >= 20_000, report[layer]  # not vacuous: long runs
    # The runs reached the paths that matter: exhaustion, hits, refusals, preemption.
    manager = set(report["manager"]["outcomes"])
    assert {"allocate_slots: returned None", "get_computed_blocks: returned"} <= manager
    counts = report["manager"]["counts"]
    assert counts["prefix hits, sliding window"] > 0 and counts["prefix hits, full attention"] > 0
    assert "get_new_blocks: returned" in report["pool"]["outcomes"]


def test_the_campaign_tells_vllm_0_8_5_from_pagedkv_semantics() -> None:
    """Not vacuous: under pagedkv's semantics vLLM 0.8.5 must diverge (its null block is
    ref-counted and its capacity check counts null hits)."""
    status, report = campaign("vllm==0.8.5", 5_000, "pagedkv")
    assert status == 1, report
    failure = report["pool"]["failure"]["text"]
    assert "null" in failure or "ref_cnt" in failure, failure


def test_an_unreachable_index_is_reported_not_hidden(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PAGEDKV_CACHE": str(tmp_path),  # nothing cached
        "PAGEDKV_PYPI_INDEX": "http://127.0.0.1:9/simple",  # nothing listens on port 9
    }
    completed = subprocess.run(
        [sys.executable, str(CAMPAIGN), "vllm==0.8.5", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert completed.returncode == UNREACHABLE, completed.stdout + completed.stderr
    assert "cannot fetch vllm==0.8.5" in completed.stdout


@pytest.mark.slow
def test_vllm_0_33_conforms_to_the_spec_under_its_semantics_and_domain() -> None:
    status, report = campaign("vllm==0.33.0", steps=20_000)
    assert status == 0, json.dumps(report, indent=1)
    assert report["semantics"] == "vllm-0.33"
    for layer in (*LAYERS, "hybrid"):
        assert report[layer]["failure"] is None
        assert report[layer]["steps"] >= 20_000, report[layer]
    assert "allocate_slots: returned None" in report["manager"]["outcomes"]
    assert report["manager"]["counts"]["sliding-window hits with leading null blocks"] > 0
    # vLLM's own hybrid coordinator: hits one group cut short, all-or-nothing refusals.
    hybrid = report["hybrid"]["counts"]
    assert hybrid["hybrid hits cut short by one group"] > 0
    assert hybrid["hybrid refusals where each group alone would fit"] > 0
    assert hybrid["hybrid hits with leading null blocks, chunked group"] > 0
    # Built as the engine builds it: sparse retention (CacheConfig's default 0) in force.
    assert any(
        "prefix_cache_retention_interval=0 (CacheConfig default)" in note
        for note in report["notes"]
    ), report["notes"]
    for layer in ("manager", "hybrid"):
        assert report[layer]["counts"]["retention: hits under sparse retention"] > 0
        assert report[layer]["counts"]["retention: hits cut short by blocks not retained"] > 0


@pytest.mark.slow
def test_vllm_0_33_conforms_in_dense_retention_when_the_user_sets_it() -> None:
    """`--vllm-setting prefix_cache_retention_interval=None`: every block cached, no divergence;
    the report says the setting came from the user. Groups of one block size only: with
    several, a window below their LCM caches only the blocks an LCM-aligned hit can read even
    under dense retention (docs/design/mixed-block-sizes.md §6)."""
    status, report = campaign(
        "vllm==0.33.0",
        5_000,
        layers="hybrid",
        settings="prefix_cache_retention_interval=None",
        one_block_size=True,
    )
    assert status == 0, json.dumps(report, indent=1)
    assert any(
        "prefix_cache_retention_interval=None (--vllm-setting)" in note for note in report["notes"]
    ), report["notes"]
    counts = report["hybrid"]["counts"]
    assert report["hybrid"]["steps"] >= 5_000
    assert counts.get("retention: blocks left uncached", 0) == 0
    assert counts["hybrid hits with leading null blocks, windowed group"] > 0


def _is_layer(report: dict[str, Any], name: str) -> bool:
    return isinstance(report[name], dict) and "failure" in report[name]


SWITCH_SHOWS_IN = {
    "usage_excludes_null_block": ("usage",),
    # The free queue's order shows when blocks are next handed out.
    "free_uncached_to_head": ("free", "get_new_blocks", "allocate_slots"),
    "free_tail_first_without_caching": ("free", "get_new_blocks", "allocate_slots"),
}
"""Where flipping each switch first shows: the call whose result or state differs."""


@pytest.mark.parametrize("switch", VLLM_0_33_SWITCHES)
def test_each_vllm_0_33_switch_is_needed(switch: str) -> None:
    """Not vacuous: with any one switch of `vllm-0.33` flipped, vLLM 0.33.0 diverges."""
    status, report = campaign("vllm==0.33.0", 30_000, f"vllm-0.33~{switch}", "pool,manager")
    assert status == 1, report
    failures = [report[name]["failure"] for name in report if _is_layer(report, name)]
    failures = [failure for failure in failures if failure]
    expected = SWITCH_SHOWS_IN[switch]
    assert any(call in f["text"] for f in failures for call in expected), failures


def test_the_deferred_free_switch_is_needed() -> None:
    """Not vacuous: with `deferred_free_flattened` flipped (a deferred free released group by
    group, as `free` releases), vLLM 0.33.0's hybrid layer diverges on the free queue's order
    (its drain is one reversed call over every group: #48489). One group cannot show it."""
    status, report = campaign("vllm==0.33.0", 30_000, "vllm-0.33~deferred_free_flattened", "hybrid")
    assert status == 1, report
    failure = report["hybrid"]["failure"]
    # the step that releases the deferred frees (the client's, before it allocates)
    assert failure and failure["signature"] == ["state", "step", "pool.free_order"], failure


def test_the_differences_outside_the_vllm_0_33_domain_are_still_there() -> None:
    """docs/semantics.md lists them; when one disappears, the domain and the docs must change
    (and a rule fixed to agree must keep agreeing)."""
    completed = run(str(TESTS / "vllm_033_divergences.py"), what="vllm==0.33.0")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(completed.stdout.splitlines()[-1])
    # Three rules that used to differ agree since the attention-truth invariant fixed them in
    # pagedkv (docs/semantics.md): both key an image's place in the block, so the same image
    # at another offset is another key ...
    assert report["mm_offset"] == {"spec": [[1], [2]], "vllm": [[1], [2]]}
    # ... an eagle hit in a window asks one more contiguous block, then drops it ...
    assert report["eagle_sliding_hit"] == {"spec": [[[1, 2]], 2], "vllm": [[[1, 2]], 2]}
    # ... and with several groups the EAGLE lookup looks one block further, then drops one.
    assert report["eagle_hybrid_hit"] == {"spec": 2, "vllm": 2}
    # Under a one-token window vLLM caches nothing; pagedkv caches the full block.
    assert report["one_token_window"]["spec"][1] is True
    assert not any(report["one_token_window"]["vllm"])
    # A block freed while its request lists it, then reused: vLLM chains the request's next
    # block to the request's own hashes, pagedkv to the hash the reused block now holds.
    assert report["stale_parent"] == {
        "spec": {"reused": True, "own chain": False},
        "vllm": {"reused": True, "own chain": True},
    }
    # The `lookup_hashes_every_full_block` switch is needed: without it the spec's lookup of a
    # preempted request stops at its last cached block (3 tokens), vLLM's covers 4.
    assert report["preempted_lookup"] == {"spec": 4, "spec without the switch": 3, "vllm": 4}
    # 0.33.0 counts the null block no more than its semantics does
    assert report["null_count"] == {"spec": [0, 0], "vllm": [0, 0]}


def test_vllm_0_32_conforms_to_the_spec_under_its_semantics_and_domain() -> None:
    """vLLM 0.32.0, the release the plugin runs in (docs/design/vllm-plugin.md), through
    0.33.0's adapter with 0.32.0's planning and constructor (`harness.vllm.v0_32`). Short, to
    keep CI quick: `pagedkv verify --against vllm==0.32.0 --seed S` runs the long campaigns."""
    status, report = campaign("vllm==0.32.0", steps=4_000)
    assert status == 0, json.dumps(report, indent=1)
    assert report["semantics"] == "vllm-0.32"
    for layer in (*LAYERS, "hybrid"):
        assert report[layer]["failure"] is None
        assert report[layer]["steps"] >= 4_000, report[layer]
    assert "allocate_slots: returned None" in report["manager"]["outcomes"]
    # The paths where 0.32.0 differs were reached: the null block in hits (whose count the
    # manager adapter leaves out), deferred frees of several groups (vLLM pops leading nulls
    # too), shared-prefix junctions under sparse retention (the engine's default, 0).
    assert report["manager"]["counts"]["deferred frees: batches released"] > 0
    hybrid = report["hybrid"]["counts"]
    assert hybrid["hybrid hits with leading null blocks, windowed group"] > 0
    assert hybrid["deferred frees: batches of several groups"] > 0
    assert hybrid["retention: lookups finding a shared-prefix junction"] > 0
    assert any(
        "vllm 0.32.0's manager built as its engine builds it" in note
        and "prefix_cache_retention_interval=0 (CacheConfig default)" in note
        for note in report["notes"]
    ), report["notes"]


VLLM_0_32_SWITCHES = {
    "null_block_refcounted": "pool",  # its touch and free_blocks count the null block
    "usage_excludes_null_block": "pool",
    "free_uncached_to_head": "pool",
    "free_tail_first_without_caching": "manager",
    "deferred_free_flattened": "hybrid",
    "junction_ignores_eagle": "hybrid",  # with EAGLE, no run a block below a junction
}
"""Each switch of `vllm-0.32` and the layer where the CI campaign finds its flip;
`lookup_hashes_every_full_block` is replayed (`vllm_033_divergences.py vllm==0.32.0`)."""


@pytest.mark.parametrize("switch", sorted(VLLM_0_32_SWITCHES))
def test_each_vllm_0_32_switch_is_needed(switch: str) -> None:
    """Not vacuous: with any one switch of `vllm-0.32` flipped, vLLM 0.32.0 diverges."""
    layer = VLLM_0_32_SWITCHES[switch]
    status, report = campaign("vllm==0.32.0", 30_000, f"vllm-0.32~{switch}", layer)
    assert status == 1, report
    failure = report[layer]["failure"]
    assert failure is not None, report
    if switch == "null_block_refcounted":
        assert "block 0 differs" in failure["text"], failure


def test_the_vllm_0_32_differences_outside_its_domain_and_the_null_count() -> None:
    """The replays of `vllm_033_divergences.py` on 0.32.0: the same three behaviours outside
    the domain, the same rules agreeing, `lookup_hashes_every_full_block` needed; and the
    null block's count, which the 0.32.0 manager adapter does not compare (docs/semantics.md,
    "vLLM 0.32.0"): vLLM leaves a hit's skipped null uncounted and then counts it down."""
    completed = run(str(TESTS / "vllm_033_divergences.py"), "vllm==0.32.0", what="vllm==0.32.0")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(completed.stdout.splitlines()[-1])
    assert report["mm_offset"] == {"spec": [[1], [2]], "vllm": [[1], [2]]}
    assert report["eagle_sliding_hit"] == {"spec": [[[1, 2]], 2], "vllm": [[[1, 2]], 2]}
    assert report["eagle_hybrid_hit"] == {"spec": 2, "vllm": 2}
    assert report["one_token_window"]["spec"][1] is True
    assert not any(report["one_token_window"]["vllm"])
    assert report["stale_parent"]["vllm"] == {"reused": True, "own chain": True}
    assert report["stale_parent"]["spec"] == {"reused": True, "own chain": False}
    assert report["preempted_lookup"] == {"spec": 4, "spec without the switch": 3, "vllm": 4}
    # after the admission (a hit of two nulls and a block), then after both frees
    assert report["null_count"] == {"spec": [2, 0], "vllm": [0, -2]}


@pytest.mark.parametrize("against", ["vllm==0.8.5", "vllm==0.32.0", "vllm==0.33.0"])
def test_against_needs_no_torch(against: str) -> None:
    """`pip install 'pagedkv[verify]'` has no torch: the dtypes vLLM's specs name are stood in.
    A fixed campaign seed: with a drawn one, this test once drew a divergence that depends on
    the environment (stop 46's note: `--replay-run 2554023930314822322` of the hybrid layer
    diverged in two checkouts without torch and agreed in a clean clone)."""
    completed = _verify_without_torch(
        "--quiet", "--against", against, "--steps", "500", "--seed", "1", what=against
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    layers = 2 if against == "vllm==0.8.5" else 3  # a hybrid coordinator too, since 0.32
    assert completed.stdout.count("OK: no divergence") == layers


def _verify_without_torch(*args: str, what: str) -> subprocess.CompletedProcess[str]:
    """`pagedkv verify ARGS` in a fresh process as if torch were not installed."""
    program = (
        "import sys; sys.modules['torch'] = None; "
        "from pagedkv.cli import main; "
        f"sys.exit(main(['verify', *{list(args)!r}]))"
    )
    return run("-c", program, what=what)


MIXED_PLAN_PROGRAM = """
import json, sys
sys.path.insert(0, {tests!r})
from vllm_campaign import UNREACHABLE, _unreachable
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.swarm.runs import draw_manager_run
from pagedkv.harness.vllm.against import prepare
try:
    target = prepare("vllm==0.33.0")
except SetupError as error:
    print(json.dumps({{"setup_error": str(error)}}))
    sys.exit(UNREACHABLE if _unreachable(error) else 2)
layouts = []
for seed in range(200):
    run = draw_manager_run(seed, semantics=target.adapter.semantics, misuse=False,
                           attention="hybrid", domain=target.domain, mixed_block_sizes=True)
    config = run.config.kv_cache_config
    if len(set(config.block_sizes)) == 1:
        continue
    vllm = target.manager_factory(run.config).manager
    layouts.append({{
        "drawn": list(config.block_sizes),
        "planned": [g.kv_cache_spec.block_size for g in vllm.kv_cache_config.kv_cache_groups],
        "managers": [m.block_size for m in vllm.coordinator.single_type_managers],
        "hash": [config.hash_block_size, vllm.block_pool.hash_block_size],
    }})
print(json.dumps(layouts))
"""


def test_vllm_0_33_plans_the_mixed_block_sizes_the_swarm_draws() -> None:
    """`--against vllm==0.33.0` draws groups of several block sizes: for each such layout of
    the swarm's first 200 hybrid seeds, vLLM's own planner (fed the layers the factory builds)
    gives every group its drawn block size, and its pool hashes at their GCD."""
    completed = run("-c", MIXED_PLAN_PROGRAM.format(tests=str(TESTS)), what="vllm==0.33.0")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    layouts = json.loads(completed.stdout.splitlines()[-1])
    assert len(layouts) >= 20, layouts
    for layout in layouts:
        assert layout["drawn"] == layout["planned"] == layout["managers"], layout
        assert layout["hash"][0] == layout["hash"][1], layout
    assert len({tuple(layout["drawn"]) for layout in layouts}) >= 10


def test_vllm_0_33_agrees_on_mixed_block_sizes_in_the_swarm() -> None:
    """A short hybrid campaign against vLLM 0.33.0 draws groups of several block sizes with
    caching and agrees on them: hits of S-multiples, delayed hashes, and vLLM's partial prefix
    keys, which the pool snapshot compares as index entries (design note §5)."""
    status, report = campaign("vllm==0.33.0", 5_000, layers="hybrid")
    assert status == 0, json.dumps(report, indent=1)
    assert report["hybrid"]["failure"] is None
    counts = report["hybrid"]["counts"]
    assert counts["mixed block sizes: allocations"] > 0, counts
    assert counts["mixed block sizes: full blocks left unhashed below S"] > 0, counts
    assert counts["mixed block sizes: partial keys created"] > 0, counts
