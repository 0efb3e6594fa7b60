"""The block pool's edge cases, stated exactly: the refusals at the edges of its rules (a block
of another pool, one whose id is the pool's size, a hash function's value that is no int, the
null block among blocks freed), the reports of its event-replay invariant, the decode fast path's
promise to cache the common case and decline, changing nothing, every other one, and the edges
of the structures under it (the free queue, the attention policies' lookups and hit shapes, a
request's token ids, the first multimodal input a block's scan starts from).

A refusal's message is compared word for word: it is what a caller sees. A refused call leaves
the pool as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from manager_fixtures import invariant_report

from pagedkv import (
    VLLM_0_8_5,
    BlockHashType,
    BlockPool,
    BlockStateError,
    ChunkedLocalAttentionSpec,
    ConcurrentUseError,
    FreeKVCacheBlockQueue,
    FreeQueueError,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    PlaceholderRange,
    Request,
    RequestError,
    SlidingWindowSpec,
    hash_request_tokens,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.block_hash import first_mm_input
from pagedkv.single_type import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.vocab.errors import ArgumentTypeError
from pagedkv.vocab.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from pagedkv.vocab.semantics import PAGEDKV, Semantics

B = 2  # block size


def _snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything a call could change: each block's count and key, the free order, the index."""
    return (
        [(block.ref_cnt, block.block_hash) for block in pool.blocks],
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        {key: dict(cached) for key, cached in pool.cached_block_hash_to_block.items()},
        list(pool.kv_event_queue),
    )


def _foreign_block(block_id: int) -> KVCacheBlock:
    """Block `block_id` of another pool, in use there."""
    other = BlockPool(block_id + 1, True)
    block = other.blocks[block_id]
    other.touch([block])
    return block


def _no_int(value: object) -> object:
    """A hash function whose values are no ints."""
    return "abc"


# -- construction --------------------------------------------------------------------------------


def test_a_pool_queues_no_event_unless_events_are_asked_for() -> None:
    pool = BlockPool(4, True)
    assert pool.enable_kv_cache_events is False
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(Request("a", [1, 2]), blocks, [], 0, 1, B, sha256)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == []
    pool.check_invariants()


# -- free_blocks -----------------------------------------------------------------------------------


def test_a_null_block_among_blocks_freed_does_not_end_the_checks_of_the_blocks_after_it() -> None:
    pool = BlockPool(4, True)
    in_use = pool.get_new_blocks(1)[0]
    free = pool.blocks[2]
    before = _snapshot(pool)
    with pytest.raises(BlockStateError) as info:
        pool.free_blocks([in_use, pool.null_block, free])
    assert str(info.value) == "block 2: free of a block whose ref_cnt is 0"
    assert (info.value.block_id, info.value.rule) == (2, "free of a block whose ref_cnt is 0")
    assert _snapshot(pool) == before
    pool.check_invariants()


# -- cache_full_blocks ---------------------------------------------------------------------------


def test_a_hash_function_that_returns_no_int_is_refused_naming_the_call_and_the_value() -> None:
    pool = BlockPool(4, True)
    blocks = pool.get_new_blocks(1)
    block_hashes: list[BlockHashType] = []
    before = _snapshot(pool)
    with pytest.raises(ArgumentTypeError) as info:
        pool.cache_full_blocks(Request("a", [1, 2]), blocks, block_hashes, 0, 1, B, _no_int)  # type: ignore[arg-type]
    assert str(info.value) == (
        "BlockPool.cache_full_blocks: the value hash_fn returned must be an int, got 'abc' (str)"
    )
    assert block_hashes == []
    assert _snapshot(pool) == before


def _cache_a_foreign_block(pool: BlockPool) -> tuple[list[KVCacheBlock], list[BlockHashType], int]:
    """A block of another pool with an id this pool has, in use there."""
    return [_foreign_block(2)], [], 0


def _cache_a_block_numbered_past_the_pool(
    pool: BlockPool,
) -> tuple[list[KVCacheBlock], list[BlockHashType], int]:
    """A block whose id is the pool's size: the first id it does not have."""
    return [_foreign_block(pool.num_gpu_blocks)], [], 0


def _cache_after_a_parent_numbered_past_the_pool(
    pool: BlockPool,
) -> tuple[list[KVCacheBlock], list[BlockHashType], int]:
    """An own block to cache whose previous block's id is the pool's size."""
    parent = _foreign_block(pool.num_gpu_blocks)
    stored = hash_request_tokens(sha256, B, Request("a", [1, 2, 3, 4]))[:1]
    return [parent, *pool.get_new_blocks(1)], stored, 1


@pytest.mark.parametrize(
    ("scene", "block_id"),
    [
        (_cache_a_foreign_block, 2),
        (_cache_a_block_numbered_past_the_pool, 4),
        (_cache_after_a_parent_numbered_past_the_pool, 4),
    ],
    ids=["foreign block", "block id == num_gpu_blocks", "parent id == num_gpu_blocks"],
)
def test_caching_a_block_or_after_a_parent_of_another_pool_is_refused_naming_its_id(
    scene: Callable[[BlockPool], tuple[list[KVCacheBlock], list[BlockHashType], int]],
    block_id: int,
) -> None:
    pool = BlockPool(4, True)
    blocks, block_hashes, num_cached = scene(pool)
    stored = list(block_hashes)
    foreign_keys = [block.block_hash for block in blocks]
    before = _snapshot(pool)
    with pytest.raises(BlockStateError) as info:
        pool.cache_full_blocks(
            Request("a", [1, 2, 3, 4]), blocks, block_hashes, num_cached, num_cached + 1, B, sha256
        )
    assert str(info.value) == f"block {block_id}: block does not belong to this pool"
    assert info.value.block_id == block_id
    assert block_hashes == stored
    assert [block.block_hash for block in blocks] == foreign_keys
    assert _snapshot(pool) == before


@pytest.mark.parametrize("block_id", [2, 4], ids=["id in range", "id == num_gpu_blocks"])
def test_the_ownership_check_passes_every_own_block_and_refuses_another_pools_by_id(
    block_id: int,
) -> None:
    """`_check_owned`, the test the per-block loops inline (and the planted bugs of
    `proofs/planted/catalog.py` call): the null block is the pool's own too."""
    pool = BlockPool(4, True)
    for block in pool.blocks:
        pool._check_owned(block)
    with pytest.raises(BlockStateError) as info:
        pool._check_owned(_foreign_block(block_id))
    assert str(info.value) == f"block {block_id}: block does not belong to this pool"
    assert info.value.block_id == block_id


# -- take_events and the event-replay invariant --------------------------------------------------


def test_take_events_overlapping_another_call_is_refused_naming_take_events() -> None:
    pool = BlockPool(4, True, enable_kv_cache_events=True)
    pool.get_new_blocks(1)
    token = pool.share_call_token()
    token.pop()  # another call is running
    try:
        with pytest.raises(ConcurrentUseError) as info:
            pool.take_events()
    finally:
        token.append(None)
    assert info.value.call == "BlockPool.take_events"
    assert str(info.value) == (
        "BlockPool.take_events: refused, another call on the same object is running (pagedkv "
        "managers and pools are not thread-safe: serialize calls with a lock of your own)"
    )
    assert token == [None]


def test_events_queued_while_events_are_off_are_reported_with_the_first_three() -> None:
    pool = BlockPool(4, True)
    queued: list[KVCacheEvent] = [
        AllBlocksCleared(),
        BlockRemoved((1,)),
        BlockRemoved((2,)),
        BlockRemoved((3,)),
    ]
    pool.kv_event_queue.extend(queued)
    assert invariant_report(pool.check_invariants) == (
        "no event is queued while events are off",
        repr(queued[:3]),
    )


REPLAY_ERROR = "BlockRemoved of hash 99 (group 0), which no BlockStored announced"
"""What a consumer says of a removal of a key it never saw stored (`KVEventReplayError`)."""


def test_a_taken_batch_that_no_consumer_can_replay_is_reported_with_its_error() -> None:
    pool = BlockPool(4, True, enable_kv_cache_events=True)
    pool.kv_event_queue.append(BlockRemoved((99,)))
    assert pool.take_events() == [BlockRemoved((99,))]
    assert invariant_report(pool.check_invariants) == (
        "replaying the events reproduces the hash index",
        f"a taken batch: {REPLAY_ERROR}",
    )


def test_queued_events_that_no_consumer_can_replay_are_reported_with_their_error() -> None:
    pool = BlockPool(4, True, enable_kv_cache_events=True)
    pool.kv_event_queue.append(BlockRemoved((99,)))
    assert invariant_report(pool.check_invariants) == (
        "replaying the events reproduces the hash index",
        f"queued events: {REPLAY_ERROR}",
    )


# -- a hybrid model's hits in a group >= 1 -------------------------------------------------------


Hits = tuple[list[KVCacheBlock], ...]


def _hybrid_with_cached_prefix() -> tuple[KVCacheManager, Request, Hits, int]:
    """A sliding-window group 0 and a full-attention group 1 over 16 blocks; request 'b' looks up
    the 3 blocks request 'a' left cached in each group."""
    specs: list[KVCacheSpec] = [
        SlidingWindowSpec(
            block_size=B, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=5
        ),
        FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16"),
    ]
    config = KVCacheConfig(
        16,
        {f"layer.{g}": KVCacheTensor(spec.page_size_bytes * 16) for g, spec in enumerate(specs)},
        [KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
    )
    manager = KVCacheManager(config, 64)
    first = Request("a", list(range(7)))
    assert manager.allocate_slots(first, 7) is not None
    first.num_computed_tokens = 7
    manager.free(first)
    second = Request("b", list(range(7)))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert [[block.block_id for block in group] for group in hits] == [[0, 2, 3], [5, 6, 7]]
    return manager, second, hits, num_hit_tokens


@pytest.mark.parametrize(
    ("first_hit", "message"),
    [
        (
            lambda pool: pool.null_block,
            "block 0: a null block is no hit: this attention type never skips one",
        ),
        (lambda pool: KVCacheBlock(16), "block 16: block does not belong to this pool"),
    ],
    ids=["null block", "block id == num_gpu_blocks"],
)
def test_a_hit_of_a_full_attention_group_past_0_that_is_no_block_of_it_is_refused_by_id(
    first_hit: Callable[[BlockPool], KVCacheBlock], message: str
) -> None:
    manager, request, hits, num_hit_tokens = _hybrid_with_cached_prefix()
    pool = manager.block_pool
    bad = first_hit(pool)
    before = _snapshot(pool)
    with pytest.raises(BlockStateError) as info:
        manager.allocate_slots(request, 7 - num_hit_tokens, (hits[0], [bad, *hits[1][1:]]))
    assert str(info.value) == message
    assert info.value.block_id == bad.block_id
    assert _snapshot(pool) == before
    manager.check_invariants()


# -- the decode fast path: the common case, and declining every other ---------------------------


def _fast_path(
    pool: BlockPool,
    request: Request,
    blocks: list[KVCacheBlock],
    block_hashes: list[BlockHashType],
    num_cached_blocks: int,
    hash_fn: Callable[[object], object] = sha256,
) -> bool:
    """`cache_next_full_block_locked`, called as a manager calls it: holding the call token."""
    token = pool.share_call_token()
    token.pop()
    try:
        locked: Any = pool.cache_next_full_block_locked  # a hash_fn of any value type
        return bool(locked(request, blocks, block_hashes, num_cached_blocks, B, hash_fn))
    finally:
        token.append(None)


def test_the_fast_path_caches_a_block_after_null_blocks_chained_to_the_stored_hash() -> None:
    """After a sliding window's null blocks the chain goes on from the hash stored at the null
    parent's position, as the full path's does."""
    pool = BlockPool(4, True)
    request = Request("a", [1, 2, 3, 4, 5, 6])
    chain = hash_request_tokens(sha256, B, request)
    (block,) = pool.get_new_blocks(1)
    block_hashes = chain[:2]
    assert _fast_path(pool, request, [pool.null_block, pool.null_block, block], block_hashes, 2)
    assert block.block_hash == chain[2]
    assert block_hashes == chain
    assert pool.get_cached_block(chain[2]) is block
    pool.check_invariants()


def test_the_fast_path_hashes_only_the_block_it_fills() -> None:
    calls: list[object] = []

    def recording_hash(value: object) -> int:
        calls.append(value)
        return sha256(value)

    pool = BlockPool(4, True)
    request = Request("a", [1, 2, 3, 4, 5])
    blocks = pool.get_new_blocks(1)
    block_hashes: list[BlockHashType] = []
    assert _fast_path(pool, request, blocks, block_hashes, 0, recording_hash)
    assert block_hashes == hash_request_tokens(sha256, B, request)[:1]
    assert len(calls) == 1


def _free_block(pool: BlockPool) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    return Request("a", [1, 2]), [pool.blocks[1]], [], 0


def _hashed_block(pool: BlockPool) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    request = Request("a", [1, 2])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, [], 0, 1, B, sha256)
    return request, blocks, [], 0


def _block_of_another_pool(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    return Request("a", [1, 2]), [_foreign_block(2)], [], 0


def _block_numbered_past_the_pool(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    return Request("a", [1, 2]), [_foreign_block(pool.num_gpu_blocks)], [], 0


def _null_block_in_use(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    """vLLM 0.8.5 counts the null block's references: a hit through it holds one."""
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 1
    return Request("a", [1, 2]), [pool.null_block], [], 0


def _parent_of_another_pool(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    """The parent is another pool's block 1, cached there under the request's first hash."""
    request = Request("a", [1, 2, 3, 4])
    other = BlockPool(4, True)
    parent = other.get_new_blocks(1)
    block_hashes: list[BlockHashType] = []
    other.cache_full_blocks(request, parent, block_hashes, 0, 1, B, sha256)
    return request, [*parent, *pool.get_new_blocks(1)], block_hashes, 1


def _parent_numbered_past_the_pool(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    request = Request("a", [1, 2, 3, 4])
    parent = _foreign_block(pool.num_gpu_blocks)
    stored = hash_request_tokens(sha256, B, request)[:1]
    return request, [parent, *pool.get_new_blocks(1)], stored, 1


def _parent_without_hash(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    request = Request("a", [1, 2, 3, 4])
    return request, pool.get_new_blocks(2), hash_request_tokens(sha256, B, request)[:1], 1


def _fewer_stored_hashes_than_cached_blocks(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    request = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, [], 0, 1, B, sha256)
    return request, blocks, [], 1


def _request_with_a_lora(
    pool: BlockPool,
) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    return Request("a", [1, 2], lora_id=1), pool.get_new_blocks(1), [], 0


def _new_block(pool: BlockPool) -> tuple[Request, list[KVCacheBlock], list[BlockHashType], int]:
    """The common case itself: declined only for the pool's events or the hash function."""
    return Request("a", [1, 2]), pool.get_new_blocks(1), [], 0


Scene = Callable[[BlockPool], tuple[Request, list[KVCacheBlock], list[BlockHashType], int]]


@pytest.mark.parametrize(
    ("scene", "semantics", "events", "hash_fn"),
    [
        (_free_block, PAGEDKV, False, sha256),
        (_hashed_block, PAGEDKV, False, sha256),
        (_block_of_another_pool, PAGEDKV, False, sha256),
        (_block_numbered_past_the_pool, PAGEDKV, False, sha256),
        (_null_block_in_use, VLLM_0_8_5, False, sha256),
        (_parent_of_another_pool, PAGEDKV, False, sha256),
        (_parent_numbered_past_the_pool, PAGEDKV, False, sha256),
        (_parent_without_hash, PAGEDKV, False, sha256),
        (_fewer_stored_hashes_than_cached_blocks, PAGEDKV, False, sha256),
        (_request_with_a_lora, PAGEDKV, False, sha256),
        (_new_block, PAGEDKV, True, sha256),
        (_new_block, PAGEDKV, False, _no_int),
    ],
    ids=[
        "free block",
        "hashed block",
        "block of another pool",
        "block id == num_gpu_blocks",
        "null block in use",
        "parent of another pool",
        "parent id == num_gpu_blocks",
        "parent without hash",
        "fewer stored hashes than cached blocks",
        "lora",
        "events on",
        "hash value no int",
    ],
)
def test_the_fast_path_declines_every_uncommon_case_having_changed_nothing(
    scene: Scene, semantics: Semantics, events: bool, hash_fn: Callable[[object], object]
) -> None:
    pool = BlockPool(4, True, semantics, events)
    request, blocks, block_hashes, num_cached = scene(pool)
    stored = list(block_hashes)
    keys = [block.block_hash for block in blocks]
    before = _snapshot(pool)
    assert not _fast_path(pool, request, blocks, block_hashes, num_cached, hash_fn)
    assert block_hashes == stored
    assert [block.block_hash for block in blocks] == keys
    assert _snapshot(pool) == before


def test_two_requests_whose_decode_fills_blocks_alike_index_both_blocks_under_the_hash() -> None:
    """Neither is a hit of the other (no full block at admission), so each fills its own block
    with the same tokens; the decode fast path indexes the second next to the first."""
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(spec, 10), 64, debug_invariants=False)
    requests = [Request("a", [1, 2, 3]), Request("b", [1, 2, 3])]
    for request in requests:
        assert manager.get_computed_blocks(request) == (([],), 0)
        assert manager.allocate_slots(request, 3) is not None
        request.num_computed_tokens = 3
    for request in requests:
        request.append_output_token_ids(4)
        assert manager.allocate_slots(request, 1) == ((),)
        request.num_computed_tokens = 4
    ((first,),), ((second,),) = (manager.get_blocks(r.request_id) for r in requests)
    (key,) = hash_request_tokens(sha256, 4, requests[0])
    assert manager.block_pool.cached_block_hash_to_block == {
        key: {first.block_id: first, second.block_id: second}
    }
    assert first.block_hash == second.block_hash == key
    manager.check_invariants()


# -- the free queue ------------------------------------------------------------------------------


def test_appending_a_queued_block_at_the_head_is_refused_naming_it() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(FreeQueueError) as info:
        queue.appendleft(blocks[1])
    assert str(info.value) == "block 1: append of a block already in the free queue"
    assert info.value.block_id == 1
    assert queue.get_all_free_blocks() == blocks
    queue.check_invariants()


def test_the_only_block_of_a_queue_is_in_it() -> None:
    (block,) = blocks = [KVCacheBlock(7)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.contains(block)
    with pytest.raises(FreeQueueError) as info:
        queue.appendleft(block)
    assert str(info.value) == "block 7: append of a block already in the free queue"
    assert queue.get_all_free_blocks() == [block]
    assert queue.num_free_blocks == 1
    queue.check_invariants()


def test_a_block_appended_to_an_empty_queue_is_its_head_and_tail() -> None:
    block = KVCacheBlock(3)
    queue = FreeKVCacheBlockQueue([block])
    assert queue.popleft() is block
    queue.append(block)
    assert (queue.free_list_head, queue.free_list_tail) == (block, block)
    assert queue.get_all_free_blocks() == [block]
    queue.check_invariants()
    assert queue.popleft() is block


# -- the per-type managers -----------------------------------------------------------------------


def _window(pool: BlockPool) -> SlidingWindowManager:
    spec = SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=4
    )
    return SlidingWindowManager(spec, pool, 0)


def _chunked(pool: BlockPool) -> ChunkedLocalAttentionManager:
    spec = ChunkedLocalAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=2 * B
    )
    return ChunkedLocalAttentionManager(spec, pool, 0)


@pytest.mark.parametrize("policy", [_window, _chunked], ids=["sliding window", "chunked local"])
def test_a_group_0_manager_looks_up_the_hashes_themselves(
    policy: Callable[[BlockPool], SlidingWindowManager | ChunkedLocalAttentionManager],
) -> None:
    pool = BlockPool(6, True)
    request = Request("a", [1, 2, 3, 4, 5])
    blocks = pool.get_new_blocks(2)
    block_hashes: list[BlockHashType] = []
    pool.cache_full_blocks(request, blocks, block_hashes, 0, 2, B, sha256)
    manager = policy(pool)
    assert manager.group_id == 0
    assert [manager.cached_block(h) for h in block_hashes] == blocks
    assert manager.find_longest_cache_hit(block_hashes[:1]) == blocks[:1]


@pytest.mark.parametrize(
    ("hits", "detail"),
    [
        ("NCCCC", "1 null blocks in a hit of 5 blocks; its chunk starts at block 4"),
        ("CCC", "0 null blocks in a hit of 3 blocks; its chunk starts at block 2"),
        ("NNC", None),
    ],
)
def test_a_chunked_local_hit_must_be_null_up_to_its_chunks_first_block(
    hits: str, detail: str | None
) -> None:
    """Chunks of 2 blocks: a hit of 5 blocks ends in the chunk that starts at block 4, one of 3
    in the chunk that starts at block 2."""
    pool = BlockPool(4, True)
    cached = pool.get_new_blocks(1)[0]
    blocks = [pool.null_block if kind == "N" else cached for kind in hits]
    assert _chunked(pool).hit_shape_error(blocks, use_eagle=False, for_eagle=False) == detail


def test_a_chunked_local_hit_with_a_null_block_after_its_cached_ones_is_refused() -> None:
    """Chunks of 4 blocks: a hit of 2 blocks starts at its chunk's first block, so it leads
    with no null block, and a null block after a cached one is out of place."""
    pool = BlockPool(4, True)
    cached = pool.get_new_blocks(1)[0]
    spec = ChunkedLocalAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=4 * B
    )
    manager = ChunkedLocalAttentionManager(spec, pool, 0)
    hits = [cached, pool.null_block]
    assert manager.hit_shape_error(hits, use_eagle=False, for_eagle=False) == (
        "0 null blocks in a hit of 2 blocks; its chunk starts at block 0"
    )
    assert manager.hit_shape_error(hits[:1], use_eagle=False, for_eagle=False) is None


@pytest.mark.parametrize(
    ("num_cached", "for_eagle", "detail"),
    [
        (1, True, "1 null blocks, then 1 blocks; the window needs 2"),
        (2, True, None),
        (1, False, None),
    ],
)
def test_a_window_hit_found_for_eagle_needs_the_wider_windows_run_less_one(
    num_cached: int, for_eagle: bool, detail: str | None
) -> None:
    """W = 4, B = 2: a run of 2 cached blocks, 3 found `for_eagle`; EAGLE then drops the last
    block, so a hit after a null block keeps 1, or 2 when found `for_eagle`."""
    pool = BlockPool(4, True)
    cached = pool.get_new_blocks(1)[0]
    hits = [pool.null_block] + [cached] * num_cached
    assert _window(pool).hit_shape_error(hits, use_eagle=True, for_eagle=for_eagle) == detail


def test_hits_are_checked_against_group_0_unless_a_group_is_named() -> None:
    """Blocks cached without a group id are group 0's: `check_hits_locked` without `group_id`
    accepts them as hits under their stored hashes, and refuses them for group 1."""
    pool = BlockPool(4, True)
    request = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    block_hashes: list[BlockHashType] = []
    pool.cache_full_blocks(request, blocks, block_hashes, 0, 2, B, sha256)
    pool.check_hits_locked("a", blocks, block_hashes, False)
    with pytest.raises(RequestError) as info:
        pool.check_hits_locked("a", blocks, block_hashes, False, 1)
    assert "block 1 at position 0 is not cached under the request's hash there" in str(info.value)


# -- the first multimodal input a block's scan starts from ---------------------------------------


def test_the_first_input_for_a_block_passes_over_one_ending_where_it_starts() -> None:
    """Unless `include_touching` (vLLM 0.8.5's quirk) takes that one too."""
    positions = [PlaceholderRange(0, 4), PlaceholderRange(4, 4), PlaceholderRange(10, 2)]
    assert first_mm_input(positions, 4) == 1
    assert first_mm_input(positions, 4, include_touching=True) == 0
    assert first_mm_input(positions, 8) == 2
    assert first_mm_input(positions, 8, include_touching=True) == 1
    assert first_mm_input(positions, 12) == 3


# -- a request's output tokens -------------------------------------------------------------------


class TokenId(int):
    """A token id of an int subclass (an IntEnum's values are)."""


def test_a_token_of_an_int_subclass_is_appended_as_a_plain_int() -> None:
    """Equal tokens must hash alike, whatever the type they came in."""
    request = Request("a", [1])
    request.append_output_token_ids(TokenId(7))
    assert list(request.all_token_ids) == [1, 7]
    assert type(request.all_token_ids[1]) is int
    assert list(request.output_token_ids) == [7]
