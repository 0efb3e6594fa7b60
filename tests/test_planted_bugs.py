"""Planted bugs: every deliberately broken variant of impl is caught by at least two checkers.

The gate (`test_every_variant_is_caught_by_the_ci_campaign`) runs the CI swarm campaign against
every variant in worker processes, two at a time, and prints the table: the campaign must catch
each (a decision variant by the attention-truth invariant). That at least two checkers catch
each is the committed table's claim (`python -m proofs.planted --write`), re-proved by the full
tier with every checker on every variant (`tests/test_full_tier.py`; about 70 minutes on 2
cores, the two-checker rerun that used to be here 6 of the gate's 22). The other tests keep the
machinery honest: planting is undone, a patch reaches every binding, the scenario checker
passes with nothing planted, and the committed table lists the catalog and two catches each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import block_counts, block_pool, manager
from pagedkv.block_pool import BlockPool
from pagedkv.spec.attention_truth import ATTENTION_TRUTH
from proofs.planted import bugs as planted_bugs
from proofs.planted import plugin as planted_plugin
from proofs.planted.bugs import (
    GATE_ORDER,
    MIN_CATCHES,
    TABLE_PATH,
    problems,
    read_table,
    render_document,
    render_table,
    run_all,
)
from proofs.planted.catalog import PLANT_ENV, VARIANTS, VARIANTS_BY_NAME, FunctionPatch, planted
from proofs.planted.checkers import CHECKERS, Verdict, check_scenarios
from proofs.planted.crosshair_checks import CHECKS_BY_VARIANT


@pytest.mark.slow
def test_every_variant_is_caught_by_the_ci_campaign() -> None:
    """The gate: the campaign runs first on every variant and must catch it; the other checkers
    are skipped once it has (`--stop-after 1`; the two-checker proof is the full tier's)."""
    results = run_all([variant.name for variant in VARIANTS], jobs=2, stop_after=1)
    print()
    print(render_table(results))
    assert problems(results, min_catches=1) == []
    column = CHECKERS.index("campaign")
    for name, verdicts in results.items():
        assert verdicts[column].status == "caught", name
        if VARIANTS_BY_NAME[name].decision:  # only the attention-truth invariant can see it
            assert ATTENTION_TRUTH in verdicts[column].evidence, name


def test_the_committed_table_lists_every_variant_and_each_is_caught_twice() -> None:
    recorded = read_table(TABLE_PATH)
    assert list(recorded) == [variant.name for variant in VARIANTS]
    for name, statuses in recorded.items():
        assert len(statuses) == len(CHECKERS)
        assert statuses.count("caught") >= MIN_CATCHES, name
        assert "error" not in statuses, name
        assert statuses[CHECKERS.index("campaign")] == "caught", name


def test_scenario_tests_pass_with_nothing_planted() -> None:
    """The control: the plugin alone changes nothing, so a failing scenario test is the bug's."""
    verdict = check_scenarios(None)
    assert (verdict.status, verdict.evidence) == ("missed", "every test passes")


def test_planting_is_undone_on_exit_even_after_an_error() -> None:
    variant = VARIANTS_BY_NAME["fits_ignores_hits"]
    original_fits, original_touch = block_counts.fits, BlockPool.touch
    with pytest.raises(RuntimeError), planted(variant):
        assert vars(manager)["fits"] is not original_fits
        assert block_counts.fits(1, 1, 1) != original_fits(1, 1, 1)
        raise RuntimeError
    assert block_counts.fits is original_fits
    assert vars(manager)["fits"] is original_fits
    assert BlockPool.touch is original_touch


def test_a_function_patch_reaches_every_module_that_binds_the_function() -> None:
    patch = VARIANTS_BY_NAME["fits_ignores_hits"].patches[0]
    assert isinstance(patch, FunctionPatch)
    owners = {owner for owner, _, _ in patch.bindings()}
    assert owners == {block_counts, manager}


def test_a_method_patch_replaces_the_method_of_the_class() -> None:
    variant = VARIANTS_BY_NAME["touch_keeps_queued"]
    with planted(variant):
        pool = block_pool.BlockPool(4, enable_caching=True)
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block])
        pool.touch([block])
        assert pool.free_block_queue.contains(block)  # the planted bug
    pool = block_pool.BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    pool.touch([block])
    assert not pool.free_block_queue.contains(block)


def test_rebound_contracts_see_exactly_the_variants_that_replace_a_pure_function() -> None:
    visible = {name for name, items in CHECKS_BY_VARIANT.items() if items}
    expected = {variant.name for variant in VARIANTS if variant.replaced_functions}
    # No contract calls the extra-key builder.
    assert visible == expected - {"salt_ignored", "decision_mm_key_without_place"}
    # A call-site patch leaves the function, and every pure contract on it, intact.
    assert not CHECKS_BY_VARIANT["drafts_as_full_blocks"]
    assert not CHECKS_BY_VARIANT["lookahead_ignored"]


def test_a_call_site_patch_changes_only_the_calling_module() -> None:
    variant = VARIANTS_BY_NAME["drafts_as_full_blocks"]
    original = block_counts.num_full_blocks
    with planted(variant):
        assert vars(manager)["num_full_blocks"] is not original
        assert vars(manager)["num_full_blocks"](0, 3, 2, 1) == 3  # the drafts counted
        assert block_counts.num_full_blocks is original
    assert vars(manager)["num_full_blocks"] is original


def test_the_manager_contracts_see_a_variant_planted_in_their_process() -> None:
    """CrossHair's process plants the variant named in its environment at import."""
    script = (
        "import proofs.planted.crosshair_manager as suite, pagedkv.manager as m, "
        "pagedkv.block_counts as b; print(m.num_required_blocks is b.num_required_blocks)"
    )
    env = {**os.environ, PLANT_ENV: "lookahead_ignored"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_the_plugin_refuses_an_unknown_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLANT_ENV, "no_such_variant")
    with pytest.raises(pytest.UsageError, match="no_such_variant"):
        planted_plugin.pytest_configure(pytest.Config.__new__(pytest.Config))


def _verdicts(*statuses: str) -> list[Verdict]:
    return [
        Verdict(checker, status, "", 0.0)  # type: ignore[arg-type]
        for checker, status in zip(CHECKERS, statuses, strict=True)
    ]


def test_problems_name_rare_catches_errors_and_control_failures() -> None:
    results = {
        "twice": _verdicts("missed", "caught", "caught", "missed", "missed"),
        "once": _verdicts("missed", "caught", "missed", "missed", "missed"),
        "broken": _verdicts("caught", "caught", "caught", "error", "missed"),
    }
    assert problems(results) == [
        "once: caught by 1 checkers, fewer than 2",
        "broken: crosshair could not run: ",
    ]
    control = {"control": _verdicts("missed", "missed", "caught", "missed", "missed")}
    assert problems(control, control=True) == ["control: exhaustive fails unplanted: "]


def test_the_document_round_trips_through_read_table(tmp_path: Path) -> None:
    statuses = ("caught", "caught", "missed", "missed", "caught")
    results = {variant.name: _verdicts(*statuses) for variant in VARIANTS}
    table = tmp_path / "planted-bugs.md"
    table.write_text(render_document(results, 1.0, 2))
    assert read_table(table) == dict.fromkeys(results, statuses)


def test_write_needs_a_run_of_every_variant() -> None:
    with pytest.raises(SystemExit) as exit_info:
        planted_bugs.main(["--write", "--variant", "free_to_head"])
    assert exit_info.value.code == 2


def test_the_quick_gate_runs_every_checker_in_its_order_and_the_campaign_first() -> None:
    assert sorted(GATE_ORDER) == sorted(CHECKERS)
    assert GATE_ORDER[0] == "campaign"


def test_a_decision_variant_plants_the_spec_and_the_implementation_alike() -> None:
    """A decision variant changes both sides (so they still agree): at least one binding in a
    `pagedkv.spec` module or class, and one in impl."""
    decisions = [variant for variant in VARIANTS if variant.decision]
    assert len(decisions) >= 3
    for variant in decisions:
        modules = {
            getattr(owner, "__module__", None) or getattr(owner, "__name__", "")
            for patch in variant.patches
            for owner, _, _ in patch.bindings()
        }
        assert any(name.startswith("pagedkv.spec") for name in modules), variant.name
        assert any(not name.startswith("pagedkv.spec") for name in modules), variant.name
