"""The request-level hypothesis machine under pytest: spec manager vs KVCacheManager.

Full attention and sliding window, each with pagedkv's semantics (invalid calls included) and
with vLLM 0.8.5 semantics (valid calls only). Caching on and off, use_eagle on and off, both hash
functions and log_stats are drawn per run by the machine's set-up rule. The machine draws the
simulated client's operations (`pagedkv.harness.client`); the tests below check that it is not
vacuous: it reaches every manager call, prefix hits, the capacity refusal and allocate_slots'
refusals, and it fails on a manager that is wrong.
"""

from __future__ import annotations

from typing import Any

import broken_managers
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.machines.manager import make_manager_machine
from pagedkv.harness.protocol import ManagerFactory
from pagedkv.vocab.semantics import VLLM_0_8_5

# Examples independent of the modules this worker loaded before (conftest.py says why).
pytestmark = pytest.mark.usefixtures("no_local_constants")

TestFullAttention = make_manager_machine(pagedkv_manager, sliding_window=False).TestCase
TestSlidingWindow = make_manager_machine(pagedkv_manager, sliding_window=True).TestCase
TestHybrid = make_manager_machine(pagedkv_manager, sliding_window=True, hybrid=True).TestCase
TestFullAttentionVllm = make_manager_machine(
    pagedkv_manager, sliding_window=False, semantics=VLLM_0_8_5, misuse=False
).TestCase
TestSlidingWindowVllm = make_manager_machine(
    pagedkv_manager, sliding_window=True, semantics=VLLM_0_8_5, misuse=False
).TestCase

MANAGER_CALLS = {
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "free_block_hashes",
    "reset_prefix_cache",
    "make_prefix_cache_stats",
    "get_num_common_prefix_blocks",
}


def _run(sliding_window: bool, **options: Any) -> Coverage:
    """Run the machine over 100 derandomized examples; what it exercised."""
    coverage = Coverage()
    machine = make_manager_machine(
        pagedkv_manager, sliding_window=sliding_window, coverage=coverage, **options
    )
    # derandomized under every profile: what the machine reaches is a fixed-seed fact
    run_state_machine_as_test(
        machine, settings=settings(max_examples=100, derandomize=True, database=None)
    )
    return coverage


def _outcomes(coverage: Coverage) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for operation, kind in coverage.outcomes:
        seen.setdefault(operation, set()).add(kind)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [False, True], ids=["full", "sliding"])
def test_the_machine_reaches_every_call_hits_and_refusals(sliding_window: bool) -> None:
    coverage = _run(sliding_window)
    seen = _outcomes(coverage)
    assert set(seen) >= MANAGER_CALLS
    hits = "prefix hits, sliding window" if sliding_window else "prefix hits, full attention"
    assert coverage.counts[hits] > 0  # prefix-cache hits, not only misses
    assert coverage.counts["allocate_slots refused for lack of blocks"] > 0  # then preemption
    assert {
        "InvalidArgumentError",  # num_tokens <= 0, negative lookahead, foreign hits
        "MaxModelLenExceededError",
        "RequestError",  # more tokens than the request has, drafts, computed outside slots
    } <= seen["allocate_slots"]
    assert coverage.steps > 0 and coverage.runs > 0


@pytest.mark.slow
def test_the_hybrid_machine_reaches_mamba_align_and_several_block_sizes() -> None:
    """The hybrid machine draws every kind of group the swarm's hybrid layer draws
    (`HYBRID_KINDS`), and each does real work: Mamba groups in mode "none" allocate, Mamba
    states in mode "align" are hit and refused in the step that keyed them, groups of several
    block sizes allocate and hit at multiples of S."""
    coverage = Coverage()
    machine = make_manager_machine(
        pagedkv_manager, sliding_window=True, hybrid=True, coverage=coverage
    )
    # 300 derandomized examples: fewer reach too few mixed-size allocations to be a check
    run_state_machine_as_test(
        machine, settings=settings(max_examples=300, derandomize=True, database=None)
    )
    counts = coverage.counts
    assert counts["Mamba hybrids: allocations"] > 0
    assert counts["Mamba align: hits"] > 0
    assert counts["Mamba align: hits refused in the step that keyed their state"] > 0
    assert counts["mixed block sizes: allocations"] > 0
    assert counts["mixed block sizes: hits of S-multiples, tables of different lengths"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [False, True], ids=["full", "sliding"])
def test_the_vllm_machine_makes_valid_calls_only(sliding_window: bool) -> None:
    """Without misuse every call must succeed: a matched error there would be a vacuous step."""
    coverage = _run(sliding_window, semantics=VLLM_0_8_5, misuse=False)
    hits = "prefix hits, sliding window" if sliding_window else "prefix hits, full attention"
    assert coverage.steps > 0 and coverage.counts[hits] > 0
    refused = {(op, kind) for op, kind in coverage.outcomes if not kind.startswith("returned")}
    assert not refused, refused


@pytest.mark.slow
@pytest.mark.parametrize(
    ("factory", "sliding_window"),
    [
        (broken_managers.forward_free, False),
        (broken_managers.no_last_block_rule, False),
        (broken_managers.window_off_by_one, True),
    ],
)
def test_the_machine_fails_on_a_broken_manager(
    factory: ManagerFactory, sliding_window: bool
) -> None:
    machine = make_manager_machine(factory, sliding_window=sliding_window)
    with pytest.raises(Divergence):
        run_state_machine_as_test(
            machine, settings=settings(settings.default, report_multiple_bugs=False)
        )
