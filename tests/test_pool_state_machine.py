"""The block-pool differential state machine under pytest: spec vs pagedkv's BlockPool.

Run for pagedkv's semantics with misuse (invalid calls must raise the same error and change
nothing), and for vLLM 0.8.5 semantics with valid calls only. The tests below check that the
machine is not vacuous: it reaches every operation and every refusal, and it fails on a pool
that is wrong.
"""

from __future__ import annotations

import broken_pools
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.lockstep import CampaignStats, Divergence, compare_call
from pagedkv.harness.pool_machine import make_pool_machine
from pagedkv.harness.protocol import PoolUnderTest
from pagedkv.vocab.errors import NoFreeBlocksError
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5

TestPagedKVPool = make_pool_machine(pagedkv_pool).TestCase
TestVllmConformantPool = make_pool_machine(
    pagedkv_pool, semantics=VLLM_0_8_5, misuse=False
).TestCase

POOL_OPERATIONS = {
    "get_new_blocks",
    "touch",
    "free_blocks",
    "cache_full_blocks",
    "get_cached_block",
    "reset_prefix_cache",
    "take_events",
}


@pytest.mark.slow
def test_the_machine_reaches_every_operation_and_every_refusal() -> None:
    stats = CampaignStats()
    run_state_machine_as_test(
        make_pool_machine(pagedkv_pool, stats=stats),
        # derandomized under every profile: what the campaign reaches is a fixed-seed fact
        settings=settings(max_examples=150, derandomize=True, database=None),
    )
    seen = stats.outcomes_by_operation()
    assert set(seen) == POOL_OPERATIONS
    assert {"returned", "returned None"} <= seen["get_cached_block"]  # hits and misses
    assert {"NoFreeBlocksError", "InvalidArgumentError"} <= seen["get_new_blocks"]
    assert "BlockStateError" in seen["touch"]  # the null block, or an id of no pool
    assert "BlockStateError" in seen["free_blocks"]  # already free, or twice in one call
    assert "InvalidArgumentError" in seen["cache_full_blocks"]
    assert stats.matched_errors > 0
    assert stats.steps > 0


@pytest.mark.slow
def test_the_vllm_machine_makes_valid_calls_only() -> None:
    """Without misuse every call must succeed: a matched error there would be a vacuous step."""
    stats = CampaignStats()
    machine = make_pool_machine(pagedkv_pool, semantics=VLLM_0_8_5, misuse=False, stats=stats)
    run_state_machine_as_test(machine, settings=settings(max_examples=50))
    assert stats.steps > 0
    assert stats.matched_errors == 0, stats.outcomes
    assert "returned" in stats.outcomes_by_operation()["get_cached_block"]


@pytest.mark.slow
def test_the_machine_fails_on_a_broken_pool() -> None:
    machine = make_pool_machine(broken_pools.touch_keeps_queued)
    with pytest.raises(Divergence, match="states differ"):
        run_state_machine_as_test(
            machine, settings=settings(settings.default, report_multiple_bugs=False)
        )


def test_pagedkv_refusals_must_match_the_spec_word_for_word() -> None:
    """pagedkv's own pool is held to the spec's wording; a third party's only to the class."""
    spec, impl = spec_pool(3, True, PAGEDKV), pagedkv_pool(3, True, PAGEDKV)

    def too_many(pool: PoolUnderTest, _: str) -> list[int]:
        return pool.get_new_blocks(5)

    def reworded(pool: PoolUnderTest, side: str) -> list[int]:
        if side == "impl":
            raise NoFreeBlocksError(5, 1)  # the wrong free count
        return pool.get_new_blocks(5)

    name, before = "get_new_blocks(5)", (spec.snapshot(), impl.snapshot())
    assert not compare_call(name, spec, impl, too_many, *before, same_messages=True).ok
    assert not compare_call(name, spec, impl, reworded, *before).ok
    with pytest.raises(Divergence, match="both raised NoFreeBlocksError, but the spec says"):
        compare_call(name, spec, impl, reworded, *before, same_messages=True)
