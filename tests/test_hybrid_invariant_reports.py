"""KVCacheManager.check_invariants() over several KV cache groups names the broken invariant and
the state that breaks it.

The twin of `tests/test_invariant_reports.py` for several groups: each test builds a manager of
two KV cache groups by ordinary calls, corrupts one thing, and compares the whole report
`(invariant, detail)` (what a deployment reads when `debug_invariants` trips). Where a field's
default is part of the contract (a request without a cached count has none cached), a test shows
the check passing.
"""

from __future__ import annotations

from manager_fixtures import invariant_report

from pagedkv import (
    BlockHashType,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheManager,
    KVCacheSpec,
    Request,
    SlidingWindowSpec,
)
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config

H = BlockHashType(1, (1,), None)
B = 2  # tokens a block


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")


def _window() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=B
    )


def _manager(*specs: KVCacheSpec, caching: bool = True, max_model_len: int = 32) -> KVCacheManager:
    """A manager of 20 blocks over `specs` (default: a sliding window, then full attention)."""
    config = hybrid_kv_cache_config(list(specs or (_window(), _full())), 20)
    return KVCacheManager(config, max_model_len=max_model_len, enable_caching=caching)


def _held(manager: KVCacheManager, request_id: str) -> tuple[list[KVCacheBlock], ...]:
    """The request's block lists themselves, one per group (the per-type managers')."""
    groups = manager.coordinator.single_type_managers
    return tuple(group.req_to_blocks[request_id] for group in groups)


def _cached(manager: KVCacheManager, group: int = 0) -> dict[str, int]:
    """Group `group`'s cached-block counts themselves."""
    return manager.coordinator.single_type_managers[group].num_cached_block


def _run(manager: KVCacheManager, request: Request) -> Request:
    """Admit `request` with its whole prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return request


# -- blocks and their holders --------------------------------------------------------------------


def test_a_ref_cnt_that_is_not_the_number_of_holders_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))  # 3 blocks a group
    block = _held(manager, "a")[0][0]
    assert block.block_id == 1  # the first block handed out: the first the check reads
    block.ref_cnt = 2
    assert invariant_report(manager.check_invariants) == (
        "a block's ref_cnt is the number of requests holding it",
        "block 1: ref_cnt 2, held 1 times",
    )


def test_a_block_held_twice_without_a_hash_is_reported() -> None:
    """Exactly two holders (ref_cnt 2) of an uncached block: the smallest count that breaks it."""
    manager = _manager(caching=False)
    _run(manager, Request("a", range(2)))  # one block a group
    _run(manager, Request("b", range(2)))
    shared = _held(manager, "a")[0][0]
    blocks_of_b = _held(manager, "b")[0]
    own = blocks_of_b.pop()  # b gives its own block back ...
    own.ref_cnt = 0
    manager.block_pool.free_block_queue.append(own)
    blocks_of_b.append(shared)  # ... and holds a's instead
    shared.ref_cnt = 2
    assert invariant_report(manager.check_invariants) == (
        "a block held by two requests is cached",
        repr(shared),
    )


def test_a_request_tracked_without_blocks_or_hashes_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))
    manager._requests["ghost"] = Request("ghost", [1])
    assert invariant_report(manager.check_invariants) == (
        "every tracked request has blocks or stored hashes",
        "requests ['a', 'ghost'], with blocks or hashes ['a']",
    )


def test_a_cached_count_for_an_unknown_request_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))
    _cached(manager)["ghost"] = 0
    assert invariant_report(manager.check_invariants) == (
        "every tracked request has blocks or stored hashes",
        "requests ['a'], with blocks or hashes ['a']",
    )


# -- one request's block lists -------------------------------------------------------------------


def test_block_lists_of_different_lengths_are_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))
    null_block = manager.block_pool.null_block
    _held(manager, "a")[1].insert(0, null_block)  # holders unchanged: the null block
    assert invariant_report(manager.check_invariants) == (
        "a request's block lists cover the same token slots in every group",
        "request 'a': [3, 4] blocks of [2, 2] tokens",
    )


def test_a_trailing_null_block_is_reported_in_the_first_group_that_has_one() -> None:
    """Group 0 (a window) may lead with null blocks but not end with one: it is named, not the
    full-attention group 1, which may hold none at all."""
    manager = _manager()
    _run(manager, Request("a", range(5)))
    null_block = manager.block_pool.null_block
    for blocks in _held(manager, "a"):
        blocks.append(null_block)
    assert invariant_report(manager.check_invariants) == (
        "null blocks only as a prefix, and only under sliding window",
        "request 'a', group 0: null at positions [3]",
    )


def test_too_many_blocks_for_max_model_len_are_reported() -> None:
    manager = _manager(_window(), _window(), max_model_len=6)
    _run(manager, Request("a", range(6)))  # 3 blocks a group: the most 6 tokens take
    null_block = manager.block_pool.null_block
    for blocks in _held(manager, "a"):
        blocks.insert(0, null_block)  # a leading null block: allowed under a window
    assert invariant_report(manager.check_invariants) == (
        "a request holds at most cdiv(max_model_len, block_size) blocks",
        "request 'a': [4, 4] blocks",
    )


# -- cached blocks and stored hashes -------------------------------------------------------------


def test_more_cached_blocks_than_full_ones_are_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))  # two full blocks a group, two stored hashes
    _cached(manager)["a"] = 3
    assert invariant_report(manager.check_invariants) == (
        "a request's cached blocks are full blocks with stored hashes",
        "request 'a', group 0: 3 cached, 5 tokens, 2 stored hashes",
    )


def test_a_cached_block_with_another_hash_is_reported_in_group_0() -> None:
    manager = _manager(_full(), _full())
    _run(manager, Request("a", range(5)))
    manager.req_to_block_hashes["a"][1] = H
    block = _held(manager, "a")[0][1]
    assert invariant_report(manager.check_invariants) == (
        "a request's cached block carries the hash its tokens chain to",
        f"request 'a', group 0, position 1: {block!r}, stored {H}",
    )


def test_a_stored_hash_past_the_tokens_is_reported() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))  # two full blocks, two stored hashes
    manager.req_to_block_hashes["a"].append(H)
    assert invariant_report(manager.check_invariants) == (
        "stored hashes are the chain of the request's tokens",
        f"request 'a', position 2: stored {H}, its tokens chain to None",
    )


def test_a_stored_hash_off_the_chain_is_reported() -> None:
    manager = _manager()
    request = Request("a", range(6))
    manager.get_computed_blocks(request)  # stores the 3 hashes of the full blocks
    assert manager.allocate_slots(request, 2) is not None  # a chunk: 1 block cached a group
    request.num_computed_tokens = 2
    manager.check_invariants()
    chained = manager.req_to_block_hashes["a"][2]
    manager.req_to_block_hashes["a"][2] = H  # stored, not cached: only the chain check sees it
    assert invariant_report(manager.check_invariants) == (
        "stored hashes are the chain of the request's tokens",
        f"request 'a', position 2: stored {H}, its tokens chain to {chained}",
    )


def test_a_request_without_a_cached_count_or_stored_hashes_has_none() -> None:
    """The defaults the check reads for a request with neither entry: 0 cached, no hashes."""
    manager = _manager()
    _run(manager, Request("a", range(1)))  # no full block: nothing cached, nothing stored
    for group in (0, 1):
        _cached(manager, group).pop("a", None)
    manager.req_to_block_hashes.pop("a", None)
    manager.check_invariants()
