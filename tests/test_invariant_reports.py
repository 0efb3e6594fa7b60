"""check_invariants() of the implementation names the broken invariant and dumps its state exactly.

A report is what a deployment sees when runtime checking trips (`debug_invariants`), so its
wording is part of the contract: the invariant's name as the spec states it, and the state that
breaks it. Each test corrupts one thing in a pool, free queue or manager built by ordinary calls,
and compares the whole report: `(invariant, detail)`. (`tests/test_invariants.py` checks that the
spec and the implementation catch each corruption at all.)
"""

from __future__ import annotations

import pytest
from manager_fixtures import invariant_report

from pagedkv import (
    BlockHashType,
    BlockPool,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheManager,
    Request,
    SlidingWindowSpec,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue

H = BlockHashType(1, (1,), None)


# -- the block pool ------------------------------------------------------------------------------


def _pool() -> BlockPool:
    """5 blocks: 1 (cached) and 2 in use, 3 and 4 free, in that order."""
    pool = BlockPool(5, True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(Request("r", [1]), blocks, [], 0, 1, 1, sha256)
    pool.check_invariants()
    return pool


def test_a_null_block_that_is_not_block_0_is_reported() -> None:
    pool = _pool()
    pool.blocks[0] = KVCacheBlock(0)  # a block 0 that is not the pool's null block
    assert invariant_report(pool.check_invariants) == (
        "the null block is block 0",
        repr(pool.null_block),
    )


def test_a_null_block_with_another_id_is_reported() -> None:
    pool = _pool()
    pool.null_block.block_id = 9
    assert invariant_report(pool.check_invariants) == (
        "the null block is block 0",
        repr(pool.null_block),
    )


def test_a_queued_null_block_is_reported() -> None:
    pool = _pool()
    pool.free_block_queue.append(pool.null_block)
    expected = "KVCacheBlock(block_id=0, ref_cnt=0, block_hash=None, prev_free_block=4, "
    expected += "next_free_block=None)"
    assert invariant_report(pool.check_invariants) == ("the null block is never free", expected)


def test_a_hashed_null_block_is_reported() -> None:
    pool = _pool()
    pool.null_block._block_hash = H
    assert invariant_report(pool.check_invariants) == (
        "the null block is never hashed",
        repr(pool.null_block),
    )


def test_a_referenced_null_block_is_reported() -> None:
    pool = _pool()
    pool.null_block.ref_cnt = 1
    assert invariant_report(pool.check_invariants) == (
        "the null block's ref_cnt stays 0",
        repr(pool.null_block),
    )


def test_a_block_out_of_its_place_is_reported() -> None:
    pool = _pool()
    pool.blocks[2].block_id = 7
    assert invariant_report(pool.check_invariants) == (
        "blocks[i].block_id == i",
        repr(pool.blocks[2]),
    )


def test_a_queued_block_of_no_pool_is_reported() -> None:
    pool = _pool()
    queued = pool.blocks[3]
    replacement = KVCacheBlock(3)
    replacement.owner_queue = pool.free_block_queue
    pool.blocks[3] = replacement  # the queue still links the old object
    assert invariant_report(pool.check_invariants) == (
        "free blocks belong to the pool",
        repr(queued),
    )


def test_a_block_of_another_queue_in_the_pool_is_reported() -> None:
    pool = _pool()
    pool.blocks[2].owner_queue = None
    assert invariant_report(pool.check_invariants) == (
        "every block belongs to the pool's free queue",
        repr(pool.blocks[2]),
    )


@pytest.mark.parametrize("block_id", [1, 2])
def test_a_negative_ref_cnt_is_reported(block_id: int) -> None:
    pool = _pool()
    pool.blocks[block_id].ref_cnt = -1
    assert invariant_report(pool.check_invariants) == ("ref_cnt >= 0", repr(pool.blocks[block_id]))


def test_a_free_block_outside_the_queue_is_reported() -> None:
    pool = _pool()
    pool.blocks[2].ref_cnt = 0
    assert invariant_report(pool.check_invariants) == (
        "a block is in the free queue iff its ref_cnt is 0",
        repr(pool.blocks[2]),
    )


def test_a_block_count_that_does_not_add_up_is_reported() -> None:
    pool = _pool()
    pool.num_gpu_blocks = 6
    assert invariant_report(pool.check_invariants) == (
        "free + in use == num_gpu_blocks - 1",
        "2 free + 2 in use != 5",
    )


def test_an_empty_index_entry_is_reported() -> None:
    pool = _pool()
    pool.cached_block_hash_to_block[H] = {}
    assert invariant_report(pool.check_invariants) == (
        "index entries are non-empty lists of distinct blocks",
        repr(H),
    )


def test_an_indexed_block_without_its_hash_is_reported() -> None:
    pool = _pool()
    (block_hash,) = pool.cached_block_hash_to_block
    pool.blocks[1].reset_hash()
    assert invariant_report(pool.check_invariants) == (
        "hash index <=> hashed blocks",
        f"{block_hash} -> {pool.blocks[1]!r}",
    )


def test_a_hashed_block_outside_the_index_is_reported() -> None:
    pool = _pool()
    pool.blocks[2]._block_hash = H
    assert invariant_report(pool.check_invariants) == (
        "hash index <=> hashed blocks",
        "2 hashed blocks, 1 index entries",
    )


def test_a_hashed_block_with_caching_off_is_reported() -> None:
    pool = _pool()
    pool.enable_caching = False
    assert invariant_report(pool.check_invariants) == (
        "no block is hashed while caching is off",
        "1 hashed",
    )


# -- the free queue ------------------------------------------------------------------------------


def test_a_cycle_in_the_free_queue_is_reported_where_it_closes() -> None:
    pool = _pool()  # queue: 3, 4
    pool.blocks[4].next_free_block = pool.blocks[3]
    assert invariant_report(pool.check_invariants) == (
        "no block twice in the free order",
        "block 3 is reached twice",
    )


def test_a_link_that_disagrees_is_reported_with_both_ends() -> None:
    pool = _pool()
    pool.blocks[4].prev_free_block = pool.blocks[1]
    assert invariant_report(pool.check_invariants) == (
        "free queue links agree both ways",
        "block 4.prev_free_block is 1, expected 3",
    )


def test_a_head_with_a_predecessor_is_reported() -> None:
    pool = _pool()
    pool.blocks[3].prev_free_block = pool.blocks[2]
    assert invariant_report(pool.check_invariants) == (
        "free queue links agree both ways",
        "block 3.prev_free_block is 2, expected None",
    )


def test_a_wrong_tail_is_reported() -> None:
    pool = _pool()
    pool.blocks[3].next_free_block = None
    assert invariant_report(pool.check_invariants) == (
        "free queue tail is its last block",
        "tail is 4, last block is 3",
    )


def test_an_empty_queue_with_a_tail_is_reported() -> None:
    queue = FreeKVCacheBlockQueue([])
    queue.free_list_tail = KVCacheBlock(5)
    assert invariant_report(queue.check_invariants) == (
        "free queue tail is its last block",
        "tail is 5, last block is None",
    )


def test_a_wrong_counter_is_reported() -> None:
    pool = _pool()
    pool.free_block_queue.num_free_blocks = 5
    assert invariant_report(pool.check_invariants) == (
        "num_free_blocks counts the queue",
        "counter 5, queue length 2",
    )


# -- the manager ---------------------------------------------------------------------------------


def _manager(
    *, caching: bool = True, window: int | None = None, max_model_len: int = 64
) -> KVCacheManager:
    spec = (
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
        if window is None
        else SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window
        )
    )
    return KVCacheManager(
        uniform_kv_cache_config(spec, 10), max_model_len=max_model_len, enable_caching=caching
    )


def _blocks(manager: KVCacheManager, request_id: str) -> list[KVCacheBlock]:
    """The request's block list itself (the one group's per-type manager's)."""
    return manager.coordinator.single_type_managers[0].req_to_blocks[request_id]


def _cached(manager: KVCacheManager) -> dict[str, int]:
    """The one group's cached-block counts themselves."""
    return manager.coordinator.single_type_managers[0].num_cached_block


def _run(manager: KVCacheManager, request: Request) -> Request:
    """Admit `request` with its whole prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return request


def test_a_null_block_under_full_attention_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))
    _blocks(manager, "a").insert(0, manager.block_pool.null_block)
    assert invariant_report(manager.check_invariants) == (
        "null blocks only as a prefix, and only under sliding window",
        "request 'a', group 0: null at positions [0]",
    )


def test_a_null_block_after_a_real_one_is_reported_under_a_window() -> None:
    manager = _manager(window=4)
    _run(manager, Request("a", range(6)))
    _blocks(manager, "a").append(manager.block_pool.null_block)
    assert invariant_report(manager.check_invariants) == (
        "null blocks only as a prefix, and only under sliding window",
        "request 'a', group 0: null at positions [2]",
    )


def test_too_many_blocks_for_max_model_len_are_reported() -> None:
    manager = _manager(max_model_len=8)
    _run(manager, Request("a", range(8)))
    (taken,) = manager.block_pool.get_new_blocks(1)  # held once: only the length is wrong
    _blocks(manager, "a").append(taken)
    assert invariant_report(manager.check_invariants) == (
        "a request holds at most cdiv(max_model_len, block_size) blocks",
        "request 'a': [3] blocks",
    )


def test_a_ref_cnt_that_is_not_the_number_of_holders_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))
    manager.block_pool.blocks[1].ref_cnt = 2
    assert invariant_report(manager.check_invariants) == (
        "a block's ref_cnt is the number of requests holding it",
        "block 1: ref_cnt 2, held 1 times",
    )


def test_a_shared_block_without_a_hash_is_reported() -> None:
    manager = _manager(caching=False)
    _run(manager, Request("a", range(6)))
    _run(manager, Request("b", range(3)))  # holds block 3
    shared = manager.block_pool.blocks[1]
    _blocks(manager, "b").append(shared)
    shared.ref_cnt = 2
    assert invariant_report(manager.check_invariants) == (
        "a block held by two requests is cached",
        repr(shared),
    )


def test_a_request_tracked_without_blocks_or_hashes_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))
    manager._requests["ghost"] = Request("ghost", [1])
    assert invariant_report(manager.check_invariants) == (
        "every tracked request has blocks or stored hashes",
        "requests ['a', 'ghost'], with blocks or hashes ['a']",
    )


def test_a_cached_count_for_an_unknown_request_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))
    _cached(manager)["ghost"] = 0
    assert invariant_report(manager.check_invariants) == (
        "every tracked request has blocks or stored hashes",
        "requests ['a'], with blocks or hashes ['a']",
    )


def test_a_tracked_request_without_a_fast_path_record_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))
    manager._records.clear()
    assert invariant_report(manager.check_invariants) == (
        "the fast path's record of a tracked request is its own",
        "request 'a': no record",
    )


def test_a_fast_path_record_with_another_token_list_is_reported() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(6)))
    record = manager._records[request]
    manager._records[request] = type(record)("a", list(request.all_token_ids))
    assert invariant_report(manager.check_invariants) == (
        "the fast path's record of a tracked request is its own",
        "request 'a': a record of 'a' with another token list",
    )


def test_a_fast_path_record_of_a_forgotten_request_is_reported() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(6)))
    records = dict(manager._records)
    manager.free(request)
    manager.free_block_hashes(request)
    manager._records.update(records)
    assert invariant_report(manager.check_invariants) == (
        "the fast path's record of a tracked request is its own",
        "1 records, 0 tracked requests",
    )


def test_more_cached_blocks_than_full_ones_are_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))  # one full block, one stored hash
    manager.req_to_block_hashes["a"].append(H)  # a second stored hash
    _cached(manager)["a"] = 2
    assert invariant_report(manager.check_invariants) == (
        "a request's cached blocks are full blocks with stored hashes",
        "request 'a', group 0: 2 cached, 6 tokens, 2 stored hashes",
    )


def test_more_cached_blocks_than_stored_hashes_are_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(9)))  # two full blocks, two stored hashes
    del manager.req_to_block_hashes["a"][1]
    assert invariant_report(manager.check_invariants) == (
        "a request's cached blocks are full blocks with stored hashes",
        "request 'a', group 0: 2 cached, 9 tokens, 1 stored hashes",
    )


def test_a_cached_block_with_another_hash_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(9)))
    stored = manager.req_to_block_hashes["a"]
    stored[1] = H
    block = _blocks(manager, "a")[1]
    assert invariant_report(manager.check_invariants) == (
        "a request's cached block carries the hash its tokens chain to",
        f"request 'a', group 0, position 1: {block!r}, stored {H}",
    )


def test_a_stored_hash_off_the_chain_is_reported() -> None:
    manager = _manager()
    request = Request("a", range(12))
    manager.get_computed_blocks(request)  # stores the 3 hashes of the full blocks
    assert manager.allocate_slots(request, 4) is not None  # a chunk: 1 block cached
    request.num_computed_tokens = 4
    manager.check_invariants()
    chained = manager.req_to_block_hashes["a"][2]
    manager.req_to_block_hashes["a"][2] = H  # stored, not cached: only the chain check sees it
    assert invariant_report(manager.check_invariants) == (
        "stored hashes are the chain of the request's tokens",
        f"request 'a', position 2: stored {H}, its tokens chain to {chained}",
    )


def test_a_stored_hash_past_the_tokens_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(6)))  # one full block, one stored hash
    manager.req_to_block_hashes["a"].append(H)
    assert invariant_report(manager.check_invariants) == (
        "stored hashes are the chain of the request's tokens",
        f"request 'a', position 1: stored {H}, its tokens chain to None",
    )


def test_a_windowed_request_passes_over_its_null_blocks() -> None:
    """Null blocks hold no hash: the cached-block check passes over them."""
    manager = _manager(window=4)
    request = _run(manager, Request("a", range(12)))
    request.append_output_token_ids(0)
    assert manager.allocate_slots(request, 1) is not None
    assert _blocks(manager, "a")[:2] == [manager.block_pool.null_block] * 2
    manager.check_invariants()
