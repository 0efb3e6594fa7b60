"""BlockPool scenarios with exact block ids and free-queue orders, spec and impl side by side.

Each scenario runs on both pools through the harness adapters, so every expectation written here
holds for the spec and for the implementation.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import pytest

from pagedkv import (
    BlockHashType,
    BlockPool,
    BlockStateError,
    FreeQueueError,
    InvalidArgumentError,
    NoFreeBlocksError,
    Request,
    hash_request_tokens,
    sha256,
)
from pagedkv.harness.adapters import ObjectPoolAdapter, pagedkv_pool, spec_pool
from pagedkv.harness.protocol import PoolFactory, PoolUnderTest
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, Semantics

FACTORIES = [pytest.param(spec_pool, id="spec"), pytest.param(pagedkv_pool, id="impl")]


@pytest.fixture(params=FACTORIES)
def make_pool(request: pytest.FixtureRequest) -> Callable[..., PoolUnderTest]:
    factory: PoolFactory = request.param

    def make(
        num_blocks: int = 6, caching: bool = True, semantics: Semantics = PAGEDKV
    ) -> PoolUnderTest:
        pool = factory(num_blocks, caching, semantics)
        pool.check_invariants()
        return pool

    return make


def seal(
    pool: PoolUnderTest, tokens: list[int], block_ids: list[int], block_size: int = 2
) -> list[BlockHashType]:
    request = Request("r", tokens)
    hashes: list[BlockHashType] = []
    pool.cache_full_blocks(
        request, block_ids, hashes, 0, len(tokens) // block_size, block_size, sha256
    )
    pool.check_invariants()
    return hashes


def test_null_block_is_taken_out_at_construction(make_pool: Callable[..., PoolUnderTest]) -> None:
    pool = make_pool(6)
    state = pool.snapshot()
    assert state.free_order == (1, 2, 3, 4, 5)
    assert pool.get_num_free_blocks() == 5
    assert state.ref_cnt == (0,) * 6
    assert pool.get_usage() == pytest.approx(1 / 6)


def test_get_new_blocks_pops_from_the_head_in_order(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(6)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.get_new_blocks(0) == []
    assert pool.snapshot().free_order == (3, 4, 5)
    assert pool.snapshot().ref_cnt == (0, 1, 1, 0, 0, 0)
    pool.check_invariants()


def test_free_appends_in_the_callers_order(make_pool: Callable[..., PoolUnderTest]) -> None:
    pool = make_pool(6)
    pool.get_new_blocks(3)
    pool.free_blocks([3, 1])
    assert pool.snapshot().free_order == (4, 5, 3, 1)
    pool.free_blocks([2])
    assert pool.snapshot().free_order == (4, 5, 3, 1, 2)
    assert pool.get_new_blocks(3) == [4, 5, 3]
    pool.check_invariants()


def test_shared_block_returns_to_the_queue_only_at_ref_cnt_zero(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(4)
    pool.get_new_blocks(1)
    pool.touch([1])
    assert pool.snapshot().ref_cnt[1] == 2
    pool.free_blocks([1])
    assert 1 not in pool.snapshot().free_order
    pool.free_blocks([1])
    assert pool.snapshot().free_order == (2, 3, 1)


def test_cached_block_stays_hittable_after_free_until_reused(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(4)
    assert pool.get_new_blocks(2) == [1, 2]
    hashes = seal(pool, [7, 7, 8, 8], [1, 2])
    assert pool.get_cached_block(hashes[0]) == 1
    pool.free_blocks([2, 1])  # tail first, as the manager frees
    assert pool.snapshot().free_order == (3, 2, 1)
    assert pool.get_cached_block(hashes[1]) == 2  # free, yet still cached (lazy eviction)
    # A hit takes the block out of the middle of the queue.
    pool.touch([2])
    assert pool.snapshot().free_order == (3, 1)
    pool.free_blocks([2])
    # Reuse evicts: block 3 is plain, block 1 loses its hash.
    assert pool.get_new_blocks(2) == [3, 1]
    state = pool.snapshot()
    assert state.block_hash[1] is None
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) == 2
    pool.check_invariants()


def test_same_content_in_two_blocks_answers_with_the_first_inserted(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(6)
    pool.get_new_blocks(4)
    first = seal(pool, [1, 2], [3])
    second = seal(pool, [1, 2], [2])
    assert first == second
    assert pool.snapshot().index == {first[0]: (3, 2)}
    assert pool.get_cached_block(first[0]) == 3
    pool.free_blocks([3])
    pool.get_new_blocks(2)  # 5 and then 3: evicts block 3's copy only
    assert pool.get_cached_block(first[0]) == 2
    pool.check_invariants()


def test_cache_full_blocks_chains_to_the_previous_block_and_stores_new_hashes(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(6)
    pool.get_new_blocks(3)
    request = Request("r", [1, 2, 3, 4, 5, 6])
    expected = hash_request_tokens(sha256, 2, request)
    stored = expected[:1]  # the first hash is known already (as after a prefix lookup)
    pool.cache_full_blocks(request, [1, 2, 3], stored, 0, 2, 2, sha256)
    assert stored == expected[:2]
    pool.cache_full_blocks(request, [1, 2, 3], stored, 2, 3, 2, sha256)
    assert stored == expected
    assert pool.snapshot().block_hash[1:4] == tuple(expected)
    pool.check_invariants()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(
    make_pool: Callable[..., PoolUnderTest], caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool(4)
    pool.get_new_blocks(2)
    hashes = seal(pool, [5, 5], [1])
    with caplog.at_level(logging.WARNING):
        assert pool.reset_prefix_cache() is False
    assert "(2) are not freed yet" in caplog.text
    assert pool.get_cached_block(hashes[0]) == 1
    pool.free_blocks([1, 2])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.snapshot().index == {}
    assert pool.snapshot().free_order == (3, 1, 2)  # reset keeps the order
    pool.check_invariants()


def test_usage_counts_the_null_block_as_used(make_pool: Callable[..., PoolUnderTest]) -> None:
    pool = make_pool(4)
    pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    pool.free_blocks([1])
    assert pool.get_usage() == 0.75


def test_null_block_is_passed_over_by_touch_and_free(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(4)
    pool.touch([0, 0])
    pool.free_blocks([0])
    assert pool.snapshot().ref_cnt[0] == 0
    assert 0 not in pool.snapshot().free_order


def test_vllm_semantics_count_the_null_blocks_references(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool = make_pool(4, semantics=VLLM_0_8_5)
    pool.touch([0, 0])
    assert pool.snapshot().ref_cnt[0] == 2
    pool.free_blocks([0, 0, 0])
    assert pool.snapshot().ref_cnt[0] == -1
    assert 0 not in pool.snapshot().free_order
    pool.check_invariants()


# -- misuse: a typed error naming the block and the rule, and no change --------------------


def _misuse_cases() -> list[tuple[str, Callable[[PoolUnderTest], object], type[Exception], str]]:
    request = Request("r", [1, 1, 2, 2])
    return [
        ("more than free", lambda p: p.get_new_blocks(4), NoFreeBlocksError, "cannot get 4"),
        ("negative count", lambda p: p.get_new_blocks(-1), InvalidArgumentError, ">= 0"),
        ("free a free block", lambda p: p.free_blocks([3]), BlockStateError, "block 3: free of"),
        ("free twice in one call", lambda p: p.free_blocks([1, 1]), BlockStateError, "twice"),
        (
            "free foreign id",
            lambda p: p.free_blocks([9]),
            BlockStateError,
            "block 9: block does not",
        ),
        ("touch foreign id", lambda p: p.touch([1, -1]), BlockStateError, "block -1"),
        (
            "hash a free block",
            lambda p: p.cache_full_blocks(request, [1, 3], [], 0, 2, 2, sha256),
            BlockStateError,
            "block 3: cache of a free block",
        ),
        (
            "counts out of range",
            lambda p: p.cache_full_blocks(request, [1, 2], [], 0, 3, 2, sha256),
            InvalidArgumentError,
            "num_full_blocks",
        ),
        (
            "too few tokens",
            lambda p: p.cache_full_blocks(Request("s", [1]), [1, 2], [], 0, 1, 2, sha256),
            InvalidArgumentError,
            "needs tokens [0, 2)",
        ),
        (
            "stored hashes missing",
            lambda p: p.cache_full_blocks(request, [1, 2], [], 1, 2, 2, sha256),
            InvalidArgumentError,
            "stored block hashes",
        ),
    ]


@pytest.mark.parametrize(("name", "call", "error", "message"), _misuse_cases())
def test_misuse_raises_a_typed_error_and_changes_nothing(
    make_pool: Callable[..., PoolUnderTest],
    name: str,
    call: Callable[[PoolUnderTest], object],
    error: type[Exception],
    message: str,
) -> None:
    pool = make_pool(4)
    pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(
        error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        call(pool)
    assert pool.snapshot() == before
    pool.check_invariants()


def test_null_blocks_in_the_range_get_no_hash_but_keep_the_chain(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    """A sliding window may drop a full block before it is cached; the chain goes on."""
    pool = make_pool(4)
    pool.get_new_blocks(2)
    request = Request("r", [1, 1, 2, 2, 3, 3])
    stored: list[BlockHashType] = []
    pool.cache_full_blocks(request, [0, 0, 1], stored, 0, 3, 2, sha256)
    assert stored == hash_request_tokens(sha256, 2, request)
    state = pool.snapshot()
    assert state.block_hash[0] is None
    assert state.index == {stored[2]: (1,)}
    # A null block before the range: the chain continues from the stored hash at its place.
    longer = Request("s", [1, 1, 2, 2, 3, 3, 4, 4])
    hashes = hash_request_tokens(sha256, 2, longer)[:2]
    pool.cache_full_blocks(longer, [0, 0, 2, 2], hashes, 2, 3, 2, sha256)
    assert hashes == hash_request_tokens(sha256, 2, longer)[:3]
    pool.check_invariants()


def test_hashing_a_block_twice_is_refused(make_pool: Callable[..., PoolUnderTest]) -> None:
    pool = make_pool(4)
    pool.get_new_blocks(2)
    seal(pool, [1, 1], [1])
    before = pool.snapshot()
    with pytest.raises(BlockStateError, match="block 1: block hash is already set"):
        pool.cache_full_blocks(Request("s", [2, 2]), [1], [], 0, 1, 2, sha256)
    assert pool.snapshot() == before


def test_cache_needs_prefix_caching_on(make_pool: Callable[..., PoolUnderTest]) -> None:
    pool = make_pool(4, caching=False)
    pool.get_new_blocks(1)
    with pytest.raises(InvalidArgumentError, match="prefix caching on"):
        pool.cache_full_blocks(Request("r", [1, 1]), [1], [], 0, 1, 2, sha256)


def test_a_block_of_another_pool_is_refused() -> None:
    pool, other = BlockPool(4, True), BlockPool(4, True)
    pool.get_new_blocks(1)
    (stranger,) = other.get_new_blocks(1)
    with pytest.raises(BlockStateError, match="block 1: block does not belong to this pool"):
        pool.free_blocks([stranger])
    with pytest.raises(BlockStateError, match="does not belong"):
        pool.touch([stranger])
    pool.check_invariants()


def test_constructor_rejects_an_empty_pool() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(0, True)


def test_free_queue_refuses_to_corrupt_itself() -> None:
    pool = BlockPool(4, True)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(FreeQueueError, match="block 1: remove of a block that is not in"):
        pool.free_block_queue.remove(block)
    free_block = pool.blocks[2]
    with pytest.raises(FreeQueueError, match="block 2: append of a block already in"):
        pool.free_block_queue.append(free_block)
    pool.check_invariants()


def test_adapter_wraps_the_pool_without_copying() -> None:
    pool = BlockPool(4, True)
    adapter = ObjectPoolAdapter(pool)
    assert adapter.get_new_blocks(1) == [1]
    assert pool.blocks[1].ref_cnt == 1


@pytest.mark.parametrize("collecting", [True, False])
def test_building_a_pool_leaves_the_garbage_collector_as_it_was(collecting: bool) -> None:
    """The pool pauses the collector while it makes its blocks (a million would set off
    collections that find nothing), then restores the caller's setting, on or off."""
    was_enabled = gc.isenabled()
    try:
        if collecting:
            gc.enable()
        else:
            gc.disable()
        pool = BlockPool(64, enable_caching=True)
        assert gc.isenabled() is collecting
        assert pool.get_num_free_blocks() == 63
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
