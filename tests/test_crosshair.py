"""The CrossHair runner: its suites are sound, it refutes planted bugs, and it replays honestly.

The full run (`python -m proofs.crosshair`, about a minute on two cores) is its own CI
step; here run the pieces that keep it trustworthy: every contract and pair has inputs that meet
its preconditions and pass, every pure function runs under some contract, planted bugs are
refuted with concrete replayed counterexamples, and a CrossHair false alarm is discarded.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from pagedkv import block_counts, block_hash
from pagedkv.planning import kv_cache_config
from pagedkv.single_type import sliding_window
from pagedkv.vocab import kv_cache_interface
from proofs.crosshair import contracts as crosshair_contracts
from proofs.crosshair import pairs as crosshair_pairs
from proofs.crosshair import planted as crosshair_planted
from proofs.crosshair.contracts import CONTRACTS, Contract
from proofs.crosshair.pairs import PAIRS, Pair
from proofs.crosshair.runner import (
    Bounds,
    Check,
    Outcome,
    Unreplayable,
    contract_outcome,
    exit_status,
    load_checks,
    pair_outcome,
    precondition_lines,
    replay_contract,
    replay_pair,
    run_examples,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.name)
def test_contract_examples_meet_the_preconditions_and_hold(contract: Contract) -> None:
    assert contract.examples, "an example shows the preconditions can be met"
    assert run_examples(Check("proofs.crosshair.contracts", contract)) is None


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.name)
def test_pair_examples_are_in_the_domain_and_agree(pair: Pair) -> None:
    assert pair.examples
    assert run_examples(Check("proofs.crosshair.pairs", pair)) is None


PURE_FUNCTIONS: list[Callable[..., Any]] = [
    block_counts.num_required_blocks,
    block_counts.num_new_blocks,
    block_counts.fits,
    block_counts.num_full_blocks,
    sliding_window.first_useful_block,
    sliding_window.num_window_blocks,
    sliding_window.scan_window_hit,
    block_hash.mm_inputs_in_block,
    kv_cache_interface.attention_page_size_bytes,
    kv_cache_interface.full_attention_max_blocks,
    kv_cache_interface.sliding_window_max_blocks,
    kv_cache_config.num_blocks_for_budget,
    kv_cache_config.unify_kv_cache_configs,
]


def _codes_run(calls: Iterator[None]) -> set[CodeType]:
    seen: set[CodeType] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            seen.add(frame.f_code)

    sys.setprofile(profile)
    try:
        for _ in calls:
            pass
    finally:
        sys.setprofile(None)
    return seen


def test_every_pure_function_runs_under_a_contract() -> None:
    def examples() -> Iterator[None]:
        for contract in CONTRACTS:
            for example in contract.examples:
                contract.check(*example)
                yield None

    seen = _codes_run(examples())
    unchecked = [f.__qualname__ for f in PURE_FUNCTIONS if f.__code__ not in seen]
    assert not unchecked


def test_every_pure_function_runs_under_a_pair_or_is_shared_vocabulary() -> None:
    def examples() -> Iterator[None]:
        for pair in PAIRS:
            for example in pair.examples:
                pair.impl(*example)
                yield None

    seen = _codes_run(examples())
    # The memory budget and config functions have no spec twin: the spec imports them.
    vocabulary = {kv_cache_interface.__name__, kv_cache_config.__name__}
    twinned = [f for f in PURE_FUNCTIONS if f.__module__ not in vocabulary]
    assert [f.__qualname__ for f in twinned if f.__code__ not in seen] == []


def test_planted_bugs_are_refuted_with_replayed_counterexamples(tmp_path: Path) -> None:
    report = tmp_path / "planted.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "proofs.crosshair.runner",
            "--suite",
            "proofs.crosshair.planted",
            "--per-condition-timeout",
            "3",
            "--per-path-timeout",
            "1",
            "--json",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    outcomes = {o["name"]: o for o in json.loads(report.read_text())["outcomes"]}
    for name in (
        "contract_num_required_blocks",
        "contract_first_useful_block",
        "num_required_blocks",
        "window_skipped",
    ):
        assert outcomes[name]["status"] == "counterexample", outcomes[name]
    # The replayed call is in the report, e.g. contract_num_required_blocks(0, 1, 0, 2).
    assert "contract_num_required_blocks(" in outcomes["contract_num_required_blocks"]["detail"]
    assert "impl returns" in outcomes["window_skipped"]["detail"]
    false_alarm = outcomes["contract_false_alarm"]
    assert false_alarm["status"] in ("bounded", "confirmed")
    assert false_alarm["discarded"], "CrossHair's false counterexample was reported and dropped"
    assert "passes on replay" in false_alarm["discarded"][0]


def test_replaying_a_counterexample_calls_the_contract_concretely() -> None:
    contract = crosshair_contracts.contract_num_required_blocks
    assert replay_contract(contract, "contract_num_required_blocks(0, 1, 0, 2)") == (
        False,
        "passes on replay",
    )
    reproduced, what = replay_contract(contract, "contract_num_required_blocks(0, 1, 0, 0)")
    assert not reproduced
    assert what.startswith("precondition fails on replay")
    planted = crosshair_planted.contract_num_required_blocks
    reproduced, what = replay_contract(planted, "contract_num_required_blocks(0, 1, 0, 2)")
    assert reproduced
    assert what == "AssertionError: a slot without a block"


def test_the_leading_asserts_are_the_preconditions() -> None:
    lines = precondition_lines(crosshair_contracts.contract_fits)
    source, first = inspect.getsourcelines(crosshair_contracts.contract_fits)
    asserts = [first + i for i, line in enumerate(source) if line.strip().startswith("assert")]
    assert sorted(lines) == asserts[:1]  # one precondition, then the postconditions


def test_a_counterexample_that_is_no_literal_cannot_be_replayed() -> None:
    with pytest.raises(Unreplayable):
        replay_contract(crosshair_contracts.contract_fits, "contract_fits(<object at 0x1>, 1, 0)")
    with pytest.raises(Unreplayable):
        replay_contract(crosshair_contracts.contract_fits, "contract_fits(*xs)")


def test_replaying_a_pair_compares_both_sides() -> None:
    pair = PAIRS[0]
    given = "num_computed_tokens=5, num_tokens=3, num_lookahead_tokens=0, block_size=4"
    assert replay_pair(pair, given)[0] is False
    planted = Pair(
        crosshair_planted.impl_num_required_blocks, crosshair_pairs.spec_num_required_blocks, ()
    )
    differ, what = replay_pair(
        planted, "num_computed_tokens=0, num_tokens=1, num_lookahead_tokens=0, block_size=2"
    )
    assert differ
    assert "impl returns 0, spec returns 1" in what


CONTRACT_CHECK = Check("proofs.crosshair.contracts", CONTRACTS[2])  # contract_fits


@pytest.mark.parametrize(
    ("output", "rc", "status"),
    [
        ("x.py:1: info: Confirmed over all paths.\n", 0, "confirmed"),
        ("x.py:1: info: Not confirmed.\n", 0, "bounded"),
        ("", 0, "error"),  # nothing analysed: no leading assert, or the wrong analysis kind
        ("x.py:1: error: AssertionError: x when calling contract_fits(4, 5, 2)\n", 1, "bounded"),
        ("x.py:1: error: ImportError: no module named proofs\n", 2, "error"),
        ("x.py:1: info: Unable to meet precondition\n", 0, "error"),
    ],
)
def test_crosshair_reports_are_classified(output: str, rc: int, status: str) -> None:
    contract = CONTRACT_CHECK.item
    assert isinstance(contract, Contract)
    assert contract_outcome(CONTRACT_CHECK, contract, output, rc).status == status


def test_a_false_counterexample_is_kept_as_discarded() -> None:
    contract = CONTRACT_CHECK.item
    assert isinstance(contract, Contract)
    output = "x.py:1: error: AssertionError: x when calling contract_fits(4, 5, 2)\n"
    outcome = contract_outcome(CONTRACT_CHECK, contract, output, 1)
    assert outcome.discarded == [
        "contract_fits(4, 5, 2): CrossHair said AssertionError: x; passes on replay"
    ]


def test_diffbehavior_reports_are_classified() -> None:
    pair = PAIRS[0]
    check = Check("proofs.crosshair.pairs", pair)
    exhausted = "No differences found. (attempted 12 iterations)\nAll paths exhausted, ...\n"
    assert pair_outcome(check, pair, exhausted, 0).status == "confirmed"
    assert pair_outcome(check, pair, "No differences found.\n", 0).status == "bounded"
    same = "Given: (num_computed_tokens=1, num_tokens=1, num_lookahead_tokens=0, block_size=1),\n"
    outcome = pair_outcome(check, pair, same, 1)
    assert (outcome.status, len(outcome.discarded)) == ("bounded", 1)
    assert pair_outcome(check, pair, "Traceback ...\n", 2).status == "error"


def test_exit_status_prefers_a_counterexample_to_a_setup_error() -> None:
    def outcome(status: Any) -> Outcome:
        return Outcome("contract", "c", status, 0.0)

    assert exit_status([outcome("confirmed"), outcome("bounded")]) == 0
    assert exit_status([outcome("error"), outcome("bounded")]) == 2
    assert exit_status([outcome("error"), outcome("counterexample")]) == 1


def test_the_default_suites_load_and_every_check_has_a_crosshair_command() -> None:
    checks = load_checks(("proofs.crosshair.contracts", "proofs.crosshair.pairs"), ())
    assert len(checks) == len(CONTRACTS) + len(PAIRS)
    for check in checks:
        command = check.command(Bounds())
        if check.kind == "contract":
            assert command[3:6] == ["check", "--analysis_kind", "asserts"]  # else asserts pass
        else:
            assert command[3] == "diffbehavior"
        assert "--per_condition_timeout" in command and "--max_uninteresting_iterations" in command
