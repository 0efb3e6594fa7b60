"""The request-level differential state machine under pytest: spec manager vs KVCacheManager.

Full attention and sliding window, each with pagedkv's semantics (invalid calls included) and
with vLLM 0.8.5 semantics (valid calls only). Caching on and off, use_eagle on and off, both hash
functions and log_stats are drawn per run by the machine's set-up rule. The tests below check
that the machine is not vacuous: it reaches every manager call, prefix hits, the capacity refusal
and allocate_slots' refusals, and it fails on a manager that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import broken_managers
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.harness.lockstep import CampaignStats, Divergence, Outcome
from pagedkv.harness.manager_machine import make_manager_machine
from pagedkv.harness.protocol import ManagerFactory
from pagedkv.vocab.semantics import VLLM_0_8_5

T = TypeVar("T")

TestFullAttention = make_manager_machine(pagedkv_manager, sliding_window=False).TestCase
TestSlidingWindow = make_manager_machine(pagedkv_manager, sliding_window=True).TestCase
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


def _run(sliding_window: bool, **options: Any) -> tuple[CampaignStats, int]:
    """Run the machine over the profile's examples; its stats, and how many lookups hit."""
    stats = CampaignStats()
    hits = 0

    machine = make_manager_machine(
        pagedkv_manager, sliding_window=sliding_window, stats=stats, **options
    )

    class CountingHits(machine):  # type: ignore[valid-type,misc]
        def both(self, name: str, call: Callable[[Any, str], T]) -> Outcome[T]:
            nonlocal hits
            outcome: Outcome[T] = super().both(name, call)
            if name.startswith("get_computed_blocks") and outcome.ok:
                _, num_hit_tokens = cast(tuple[list[int], int], outcome.result)
                hits += num_hit_tokens > 0
            return outcome

    # derandomized under every profile: what the machine reaches is a fixed-seed fact
    run_state_machine_as_test(
        CountingHits, settings=settings(max_examples=100, derandomize=True, database=None)
    )
    return stats, hits


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [False, True], ids=["full", "sliding"])
def test_the_machine_reaches_every_call_hits_and_refusals(sliding_window: bool) -> None:
    stats, hits = _run(sliding_window)
    seen = stats.outcomes_by_operation()
    assert set(seen) >= MANAGER_CALLS
    assert hits > 0  # prefix-cache hits, not only misses
    assert "returned None" in seen["allocate_slots"]  # the capacity refusal (then preemption)
    assert {
        "InvalidArgumentError",  # num_tokens <= 0, negative lookahead, foreign hits
        "MaxModelLenExceededError",
        "RequestError",  # more tokens than the request has, drafts, computed outside slots
    } <= seen["allocate_slots"]
    assert stats.steps > 0


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [False, True], ids=["full", "sliding"])
def test_the_vllm_machine_makes_valid_calls_only(sliding_window: bool) -> None:
    """Without misuse every call must succeed: a matched error there would be a vacuous step."""
    stats, hits = _run(sliding_window, semantics=VLLM_0_8_5, misuse=False)
    assert stats.steps > 0 and hits > 0
    assert stats.matched_errors == 0, stats.outcomes


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
