"""Deferred frees (vLLM 0.33's `pop_blocks_for_free`, for a step still in flight that may read a
finished or preempted request's blocks), spec and impl side by side: the blocks keep their
references until the batch is released, exactly once; pagedkv releases it in `free`'s order,
vLLM 0.33 in one reversed call over every group (#48489); a bad batch is refused and changes
nothing.

Managers of two groups (full attention, then a window of 8 tokens), block size 4, 10 blocks (the
free queue 1..9).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from manager_fixtures import GROUP_FACTORIES, manager_config

from pagedkv import ArgumentTypeError, BlockStateError, Request
from pagedkv.harness.adapters import ObjectManagerAdapter, SpecManagerAdapter
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_33, Semantics

SIDES = sorted(GROUP_FACTORIES)
B = 4


def two_groups(semantics: Semantics = PAGEDKV, *, caching: bool = True) -> ManagerConfig:
    full = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")
    window = SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=8
    )
    return dataclasses.replace(
        manager_config(semantics=semantics, enable_caching=caching),
        kv_cache_config=hybrid_kv_cache_config([full, window], 10),
    )


def both(config: ManagerConfig) -> list[ManagerUnderTest]:
    return [GROUP_FACTORIES[side](config) for side in SIDES]


def running(manager: ManagerUnderTest, request_id: str = "r", num_tokens: int = 12) -> Request:
    """A request that computed `num_tokens` tokens in one step (its full blocks cached)."""
    request = Request(request_id, range(num_tokens))
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    return request


def free_order(manager: ManagerUnderTest) -> tuple[int, ...]:
    return tuple(manager.snapshot().pool.free_order)


@pytest.mark.parametrize("side", SIDES)
def test_popped_blocks_stay_referenced_until_the_batch_is_released(side: str) -> None:
    manager = GROUP_FACTORIES[side](two_groups())
    request = running(manager)
    assert manager.pop_blocks_for_free(request) == ([1, 2, 3], [4, 5, 6])
    manager.check_invariants()
    snapshot = manager.snapshot()
    assert "r" not in snapshot.blocks
    assert free_order(manager) == (7, 8, 9)  # none of the popped blocks is free
    other = Request("o", [9] * 16)
    manager.get_computed_blocks(other)
    assert manager.allocate_slots(other, 8) is None  # 4 blocks needed, 3 free
    manager.free_popped_blocks(([1, 2, 3], [4, 5, 6]))
    manager.check_invariants()
    assert manager.allocate_slots(other, 8) is not None


@pytest.mark.parametrize("side", SIDES)
def test_pagedkv_releases_a_batch_in_the_order_free_would(side: str) -> None:
    freed = GROUP_FACTORIES[side](two_groups())
    freed.free(running(freed))
    popped = GROUP_FACTORIES[side](two_groups())
    popped.free_popped_blocks(popped.pop_blocks_for_free(running(popped)))
    # group by group, each tail first: group 0's blocks are evicted before group 1's
    assert free_order(popped) == free_order(freed) == (7, 8, 9, 3, 2, 1, 6, 5, 4)
    assert popped.snapshot() == freed.snapshot()


@pytest.mark.parametrize("side", SIDES)
def test_vllm_0_33_releases_a_batch_last_group_first(side: str) -> None:
    """vLLM #48489: the drain frees every group's blocks in one reversed call, so the last
    group's cached blocks are evicted first, where `free` evicts the first group's first."""
    freed = GROUP_FACTORIES[side](two_groups(VLLM_0_33))
    freed.free(running(freed))
    assert free_order(freed) == (7, 8, 9, 3, 2, 1, 6, 5, 4)
    popped = GROUP_FACTORIES[side](two_groups(VLLM_0_33))
    popped.free_popped_blocks(popped.pop_blocks_for_free(running(popped)))
    assert free_order(popped) == (7, 8, 9, 6, 5, 4, 3, 2, 1)
    popped.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_without_caching_a_batch_is_released_in_order_as_free_releases(side: str) -> None:
    config = two_groups(caching=False)
    freed, popped = GROUP_FACTORIES[side](config), GROUP_FACTORIES[side](config)
    freed.free(running(freed))
    popped.free_popped_blocks(popped.pop_blocks_for_free(running(popped)))
    assert free_order(popped) == free_order(freed) == (7, 8, 9, 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("side", SIDES)
def test_a_window_groups_leading_null_blocks_are_left_out(side: str) -> None:
    manager = GROUP_FACTORIES[side](two_groups())
    request = running(manager, num_tokens=12)
    request.append_output_token_ids([1, 2, 3, 4, 5])
    assert manager.allocate_slots(request, 5) is not None  # the window drops positions 0, 1
    request.num_computed_tokens = 17
    held = manager.snapshot().blocks["r"]
    assert held[1][:1] == (0,)
    popped = manager.pop_blocks_for_free(request)
    assert popped[0] == list(held[0])
    assert popped[1] == [block for block in held[1] if block != 0]
    manager.check_invariants()
    manager.free_popped_blocks(popped)
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_a_popped_cached_block_may_be_hit_before_its_release(side: str) -> None:
    manager = GROUP_FACTORIES[side](two_groups())
    popped = manager.pop_blocks_for_free(running(manager))
    sibling = Request("s", [*range(12), 7, 7])
    hits, num_tokens = manager.get_computed_blocks(sibling)
    assert num_tokens == 12 and hits[0] == [1, 2, 3]
    assert manager.allocate_slots(sibling, 2, hits) is not None
    manager.check_invariants()  # blocks 1-3: one reference popped, one the sibling's
    manager.free_popped_blocks(popped)
    manager.check_invariants()
    assert manager.snapshot().blocks["s"][0][:3] == (1, 2, 3)


@pytest.mark.parametrize("side", SIDES)
def test_a_request_holding_nothing_pops_an_empty_batch(side: str) -> None:
    manager = GROUP_FACTORIES[side](two_groups())
    before = manager.snapshot()
    assert manager.pop_blocks_for_free(Request("unknown", range(4))) == ([], [])
    manager.free_popped_blocks(([], []))  # nothing to release
    assert manager.snapshot() == before


BAD_BATCHES: list[tuple[Any, type[Exception]]] = [
    (([1, 2, 3], [4, 5, 6]), BlockStateError),  # released already
    (([1, 2], [4, 5, 6]), BlockStateError),  # not as returned
    (([7], []), BlockStateError),  # never popped
    (([1, 2, 3],), ArgumentTypeError),  # one group of two
    ([[1, 2, 3], [4, "5"]], ArgumentTypeError),
    (7, ArgumentTypeError),
]


@pytest.mark.parametrize(("batch", "error"), BAD_BATCHES)
def test_a_bad_batch_is_refused_and_changes_nothing(batch: Any, error: type[Exception]) -> None:
    for manager in both(two_groups()):
        first = manager.pop_blocks_for_free(running(manager))
        second = manager.pop_blocks_for_free(running(manager, "q", 4))
        assert second == ([7], [8])
        manager.free_popped_blocks(first)
        before = manager.snapshot()
        with pytest.raises(error):
            manager.free_popped_blocks(batch)
        assert manager.snapshot() == before
        manager.check_invariants()
        manager.free_popped_blocks(second)
        manager.check_invariants()


def test_a_refused_batch_names_the_rule() -> None:
    for manager in both(two_groups()):
        manager.free_popped_blocks(manager.pop_blocks_for_free(running(manager)))
        with pytest.raises(BlockStateError, match="pop_blocks_for_free handed over, once"):
            manager.free_popped_blocks(([1, 2, 3], [4, 5, 6]))


def test_the_prefix_cache_cannot_be_reset_while_a_batch_is_held() -> None:
    for manager in both(two_groups()):
        popped = manager.pop_blocks_for_free(running(manager))
        assert manager.reset_prefix_cache() is False
        manager.free_popped_blocks(popped)
        assert manager.reset_prefix_cache() is True


def test_the_reference_count_invariant_counts_popped_blocks() -> None:
    """A popped block whose count changes behind the managers' backs is caught."""
    impl_side, spec_side = both(two_groups())  # SIDES: impl, spec
    for manager in (spec_side, impl_side):
        manager.pop_blocks_for_free(running(manager))
        manager.check_invariants()
    assert isinstance(spec_side, SpecManagerAdapter)
    spec_side.manager.pool.ref_cnt[2] += 1
    with pytest.raises(InvariantViolation, match="ref_cnt is the number of requests"):
        spec_side.check_invariants()
    assert isinstance(impl_side, ObjectManagerAdapter)
    impl_side.manager.block_pool.blocks[2].ref_cnt += 1
    with pytest.raises(InvariantViolation, match="ref_cnt is the number of requests"):
        impl_side.check_invariants()
