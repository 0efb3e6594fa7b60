"""Every refusal of the implementation says exactly which block or request broke which rule.

Errors carry the block id or request id and the rule as attributes, and a message a log reader can
act on; callers and tools may match on them (`pagedkv.vocab.errors`). The differential harness holds
pagedkv's own objects to the spec's wording; the wording itself is pinned here, call by call. A few
tests also pin edge cases of valid calls next to the refusal they border (a pool of one block,
speculative tokens equal to the scheduled ones, a short sliding-window hit from position 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from pagedkv import (
    PAGEDKV,
    VLLM_0_8_5,
    BlockHashType,
    BlockPool,
    BlockStateError,
    CacheSalt,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheBlock,
    KVCacheManager,
    MaxModelLenExceededError,
    NoFreeBlocksError,
    PagedKVError,
    PlaceholderRange,
    PrefixCachingMetrics,
    Request,
    RequestError,
    Semantics,
    SlidingWindowSpec,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    need_extra_keys,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.client.catalog import not_a_hash
from pagedkv.harness.protocol import PoolFactory
from pagedkv.vocab.errors import ConcurrentUseError, FrozenRequestFieldError

# -- the block pool ------------------------------------------------------------------------------


def test_a_pool_needs_at_least_the_null_block() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BlockPool(0, True)
    assert str(info.value) == "BlockPool: num_gpu_blocks must be an int >= 1, got 0"
    pool = BlockPool(1, True)  # the null block alone: valid, and nothing is free
    assert pool.get_num_free_blocks() == 0
    assert pool.get_new_blocks(0) == []
    pool.check_invariants()


def test_asking_for_too_many_blocks_says_how_many_are_free() -> None:
    pool = BlockPool(5, True)
    with pytest.raises(NoFreeBlocksError) as info:
        pool.get_new_blocks(5)
    error = info.value
    assert (error.num_requested, error.num_free) == (5, 4)
    assert str(error) == "cannot get 5 free blocks: only 4 are free"


def test_popping_an_empty_queue_asks_for_one_of_none() -> None:
    queue = FreeKVCacheBlockQueue([])
    assert (queue.free_list_head, queue.free_list_tail, queue.num_free_blocks) == (None, None, 0)
    with pytest.raises(NoFreeBlocksError) as info:
        queue.popleft()
    error = info.value
    assert (error.num_requested, error.num_free, str(error)) == (1, 0, "No free blocks available")


def test_freeing_a_block_twice_in_one_call_names_the_block() -> None:
    pool = BlockPool(4, True)
    block, _ = pool.get_new_blocks(2)
    with pytest.raises(BlockStateError) as info:
        pool.free_blocks([block, block])
    error = info.value
    assert (error.block_id, error.rule) == (1, "the same block twice in one free_blocks call")
    assert str(error) == "block 1: the same block twice in one free_blocks call"


def test_caching_needs_prefix_caching_on() -> None:
    pool = BlockPool(4, False)
    blocks = pool.get_new_blocks(1)
    with pytest.raises(InvalidArgumentError) as info:
        pool.cache_full_blocks(Request("r", [1]), blocks, [], 0, 1, 1, sha256)
    assert str(info.value) == "cache_full_blocks needs a pool with prefix caching on"


def test_caching_with_an_empty_block_size_is_refused() -> None:
    pool = BlockPool(4, True)
    blocks = pool.get_new_blocks(1)
    with pytest.raises(InvalidArgumentError) as info:
        pool.cache_full_blocks(Request("r", [1]), blocks, [], 0, 1, 0, sha256)
    assert str(info.value) == ("BlockPool.cache_full_blocks: block_size must be an int >= 1, got 0")


def test_a_free_block_after_a_null_block_is_still_refused() -> None:
    pool = BlockPool(4, True)
    pool.get_new_blocks(1)
    free = pool.blocks[2]
    with pytest.raises(BlockStateError) as info:
        pool.cache_full_blocks(Request("r", [1, 2]), [pool.null_block, free], [], 0, 2, 1, sha256)
    assert str(info.value) == "block 2: cache of a free block"
    assert free.block_hash is None


def test_a_block_listed_twice_in_one_cache_call_is_refused() -> None:
    pool = BlockPool(4, True)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(BlockStateError) as info:
        pool.cache_full_blocks(Request("r", [1, 2]), [block, block], [], 0, 2, 1, sha256)
    error = info.value
    assert (error.block_id, error.rule) == (1, "the same block twice in one cache call")
    assert str(error) == "block 1: the same block twice in one cache call"


def test_caching_after_an_unhashed_first_block_is_refused() -> None:
    pool = BlockPool(4, True)
    blocks = pool.get_new_blocks(2)
    request = Request("r", [1, 2])
    stored = hash_request_tokens(sha256, 1, request)[:1]
    with pytest.raises(BlockStateError) as info:
        pool.cache_full_blocks(request, blocks, stored, 1, 2, 1, sha256)
    error = info.value
    assert (error.block_id, error.rule) == (
        1,
        "the block before the first block to cache has no hash",
    )
    assert str(error) == "block 1: the block before the first block to cache has no hash"


def test_too_few_tokens_names_the_block_position_that_needs_them() -> None:
    pool = BlockPool(5, True)
    blocks = pool.get_new_blocks(3)
    request = Request("r", [1, 2])
    stored: list[BlockHashType] = []
    pool.cache_full_blocks(request, blocks, stored, 0, 1, 1, sha256)
    with pytest.raises(InvalidArgumentError) as info:
        pool.cache_full_blocks(request, blocks, stored, 1, 3, 1, sha256)
    assert str(info.value) == "request 'r' has 2 tokens; block 2 needs tokens [2, 3)"


def test_stored_hashes_past_the_cached_blocks_are_used_and_chained_from() -> None:
    """Blocks with a stored hash take it; the first block without one chains from the last."""
    pool = BlockPool(6, True)
    blocks = pool.get_new_blocks(4)
    request = Request("r", [1, 2, 3, 4])
    chain = hash_request_tokens(sha256, 1, request)
    stored = chain[:3]
    pool.cache_full_blocks(request, blocks, stored, 0, 1, 1, sha256)
    pool.cache_full_blocks(request, blocks, stored, 1, 4, 1, sha256)
    assert stored == chain
    assert [block.block_hash for block in blocks] == chain
    pool.check_invariants()


@pytest.mark.parametrize("factory", [spec_pool, pagedkv_pool], ids=["spec", "impl"])
def test_the_parent_blocks_own_hash_seeds_the_chain(factory: PoolFactory) -> None:
    """A cached parent block chains by its own hash, even if the caller's stored list differs."""
    pool = factory(4, True, PAGEDKV)
    pool.get_new_blocks(2)
    first, second = Request("a", [1, 2]), Request("b", [7, 2])
    pool.cache_full_blocks(first, [1], [], 0, 1, 1, sha256)
    other_stored = hash_request_tokens(sha256, 1, second)[:1]  # not block 1's hash
    pool.cache_full_blocks(second, [1, 2], other_stored, 1, 2, 1, sha256)
    assert other_stored[1] == hash_request_tokens(sha256, 1, first)[1]
    pool.check_invariants()


def test_vllm_keys_a_completed_block_with_its_only_multimodal_input() -> None:
    pool = BlockPool(4, True, VLLM_0_8_5)
    blocks = pool.get_new_blocks(2)
    request = Request("r", [1, 2, 3], mm_positions=[PlaceholderRange(0, 3)], mm_hashes=["img"])
    request.append_output_token_ids(4)  # completes block 1, which the input overlaps
    stored: list[BlockHashType] = []
    pool.cache_full_blocks(request, blocks, stored, 0, 2, 2, sha256)
    assert [block_hash.extra_keys for block_hash in stored] == [("img",), ("img",)]


def test_a_refused_reset_logs_how_many_blocks_are_in_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = BlockPool(4, True)
    pool.get_new_blocks(2)
    with caplog.at_level(logging.WARNING, logger="pagedkv.block_pool"):
        assert not pool.reset_prefix_cache()
    assert caplog.messages == [
        "Failed to reset prefix cache because some blocks (2) are not freed yet"
    ]


# -- the manager ---------------------------------------------------------------------------------


def _manager(
    *,
    window: int | None = None,
    block_size: int = 4,
    max_model_len: int = 64,
    semantics: Semantics = PAGEDKV,
) -> KVCacheManager:
    spec = (
        FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")
        if window is None
        else SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype="float16",
            sliding_window=window,
        )
    )
    return KVCacheManager(
        uniform_kv_cache_config(spec, 10), max_model_len=max_model_len, semantics=semantics
    )


def _run(manager: KVCacheManager, request: Request) -> Request:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return request


def _request_error(call: object) -> RequestError:
    with pytest.raises(RequestError) as info:
        assert callable(call)
        call()
    return info.value


def test_computed_tokens_outside_the_slots_are_refused_with_the_counts() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(6)))
    request.num_computed_tokens = 9
    error = _request_error(lambda: manager.allocate_slots(request, 1))
    assert (error.request_id, error.rule) == (
        "a",
        "num_computed_tokens outside the request's slots",
    )
    assert str(error) == (
        "request 'a': num_computed_tokens outside the request's slots "
        "(9 computed, 2 blocks of 4 held)"
    )


def test_growing_past_max_model_len_is_refused_with_the_numbers() -> None:
    manager = _manager(max_model_len=8)
    request = _run(manager, Request("a", range(8)))
    request.append_output_token_ids(0)
    with pytest.raises(MaxModelLenExceededError) as info:
        manager.allocate_slots(request, 1)
    assert str(info.value) == (
        "request 'a': allocation past max_model_len "
        "(3 blocks needed, at most 2 (max_model_len 8, block size 4))"
    )


def test_vllm_refuses_a_hit_that_already_fills_max_model_len() -> None:
    """vLLM caps an allocation past max_model_len, but not when the hits alone fill it."""
    manager = _manager(max_model_len=8, semantics=VLLM_0_8_5)
    _run(manager, Request("a", range(8)))
    longer = Request("b", range(9))
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 8
    with pytest.raises(MaxModelLenExceededError):
        manager.allocate_slots(longer, 1, hits)


def test_computed_tokens_going_back_are_refused_with_the_counts() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(9)))
    request.num_computed_tokens = 0
    error = _request_error(lambda: manager.allocate_slots(request, 1))
    assert str(error) == (
        "request 'a': fewer full blocks than already cached "
        "(0 full, 2 cached: did num_computed_tokens go back?)"
    )


def test_a_step_of_speculative_tokens_only_is_valid() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(5)))
    request.spec_token_ids = [7, 7]
    assert manager.allocate_slots(request, 2) == ((),)  # 7 slots fit in the 2 blocks held
    manager.check_invariants()


def test_hits_for_a_request_that_holds_blocks_are_refused() -> None:
    manager = _manager()
    _run(manager, Request("a", range(9)))
    other = Request("b", range(9))
    hits, _ = manager.get_computed_blocks(other)
    assert manager.allocate_slots(other, 1, hits) is not None  # computed tokens still 0
    error = _request_error(lambda: manager.allocate_slots(other, 1, hits))
    assert str(error) == (
        "request 'b': new_computed_blocks for a request that already holds blocks or computed "
        "tokens"
    )


def test_more_hits_than_stored_hashes_are_refused() -> None:
    manager = _manager()
    _run(manager, Request("a", range(12)))
    other = Request("b", range(9))
    manager.get_computed_blocks(other)
    blocks = manager.block_pool.blocks
    error = _request_error(lambda: manager.allocate_slots(other, 1, (blocks[1:4],)))
    assert str(error) == (
        "request 'b': new_computed_blocks must be the request's cached blocks "
        "(3 hits but 2 stored block hashes)"
    )


def test_a_hit_of_other_content_is_refused_with_its_position() -> None:
    manager = _manager()
    _run(manager, Request("a", range(9)))
    other = Request("b", range(9))
    manager.get_computed_blocks(other)
    blocks = manager.block_pool.blocks
    error = _request_error(lambda: manager.allocate_slots(other, 1, ([blocks[2], blocks[1]],)))
    assert str(error) == (
        "request 'b': new_computed_blocks must be the request's cached blocks "
        "(block 2 at position 0 is not cached under the request's hash there)"
    )


def test_a_hit_just_past_the_pool_is_refused_as_foreign() -> None:
    manager = _manager()
    request = Request("a", range(5))
    manager.get_computed_blocks(request)
    with pytest.raises(BlockStateError) as info:
        manager.allocate_slots(request, 1, ([KVCacheBlock(10)],))
    assert str(info.value) == "block 10: block does not belong to this pool"


def test_a_null_hit_under_full_attention_is_refused() -> None:
    manager = _manager()
    request = Request("a", range(5))
    manager.get_computed_blocks(request)
    with pytest.raises(BlockStateError) as info:
        manager.allocate_slots(request, 1, ([manager.block_pool.null_block],))
    assert str(info.value) == "block 0: a null block is no hit: this attention type never skips one"


def _window_scene() -> tuple[KVCacheManager, Request]:
    """Block size 2, window 4 (hits end in 2 cached blocks); b's hit is [null, null, 3, 4]."""
    manager = _manager(window=4, block_size=2)
    _run(manager, Request("a", range(8)))
    other = Request("b", range(9))
    (hits,), _ = manager.get_computed_blocks(other)
    assert [block.block_id for block in hits] == [0, 0, 3, 4]
    return manager, other


def test_a_window_hit_of_other_content_after_null_blocks_is_refused() -> None:
    manager, other = _window_scene()
    null, blocks = manager.block_pool.null_block, manager.block_pool.blocks
    error = _request_error(lambda: manager.allocate_slots(other, 1, ([null, blocks[1]],)))
    assert str(error) == (
        "request 'b': new_computed_blocks must be the request's cached blocks "
        "(block 1 at position 1 is not cached under the request's hash there)"
    )


def test_a_window_hit_too_short_after_null_blocks_is_refused_with_its_shape() -> None:
    manager, other = _window_scene()
    null, blocks = manager.block_pool.null_block, manager.block_pool.blocks
    error = _request_error(
        lambda: manager.allocate_slots(other, 1, ([null, null, null, blocks[4]],))
    )
    assert str(error) == (
        "request 'b': new_computed_blocks is not a hit this attention type can produce "
        "(3 null blocks, then 1 blocks; the window needs 2)"
    )


def test_a_short_window_hit_from_position_0_is_valid() -> None:
    """Without a run long enough for the window, the hit is the cached run from block 0."""
    manager = _manager(window=4, block_size=2)
    _run(manager, Request("a", [0, 1, 9]))
    other = Request("b", [0, 1, 5, 5, 5])
    hits, num_hit_tokens = manager.get_computed_blocks(other)
    assert ([block.block_id for block in hits[0]], num_hit_tokens) == ([1], 2)
    assert manager.allocate_slots(other, 3, hits) is not None
    manager.check_invariants()


def test_dropping_the_hashes_of_a_running_request_is_refused() -> None:
    manager = _manager()
    request = _run(manager, Request("a", range(5)))
    error = _request_error(lambda: manager.free_block_hashes(request))
    assert str(error) == (
        "request 'a': free_block_hashes of a request that still holds blocks "
        "(free it first; a running request's cached blocks need their stored hashes)"
    )


def test_an_impostor_request_object_is_refused() -> None:
    manager = _manager()
    _run(manager, Request("a", range(5)))
    error = _request_error(lambda: manager.free(Request("a", range(5))))
    assert str(error) == (
        "request 'a': request id already in use by another Request object "
        "(free it and drop its hashes (free_block_hashes) before reusing the id)"
    )


# -- argument refusals: the call, the argument, the rule, the value ------------------------------


def _message(call: Callable[[], object]) -> tuple[str, str]:
    """The class name and message of the pagedkv error `call` raises."""
    with pytest.raises(PagedKVError) as info:
        call()
    return type(info.value).__name__, str(info.value)


def test_hash_function_refusals_name_the_function_and_the_argument() -> None:
    request = Request("r", [1, 2, 3, 4], lora_id=3)
    assert _message(lambda: hash_block_tokens(None, None, [1]))[1] == (  # type: ignore[arg-type]
        "hash_block_tokens: hash_fn must be callable, got None"
    )
    assert _message(lambda: hash_block_tokens(sha256, 1.5, [1])) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "hash_block_tokens: parent_block_hash must be an int, got 1.5 (float)",
    )
    assert _message(lambda: hash_block_tokens(sha256, None, [1, -1])) == (
        "InvalidArgumentError",
        "hash_block_tokens: curr_block_token_ids[1] must be an int in [0, 2147483647], got -1",
    )
    assert _message(lambda: hash_block_tokens(sha256, None, [1], ["k"])) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "hash_block_tokens: extra_keys must be a tuple, got ['k'] (list)",
    )
    assert _message(lambda: hash_block_tokens(not_a_hash("h"), None, [1])) == (
        "ArgumentTypeError",
        "hash_block_tokens: the value hash_fn returned must be an int, got 'h' (str)",
    )
    block_hash = hash_block_tokens(sha256, 7, [1, 2], (3,))
    assert block_hash == BlockHashType(sha256((7, (1, 2), (3,))), (1, 2), (3,))
    assert hash_block_tokens(sha256, None, [1]) == hash_block_tokens(sha256, 0, [1])
    assert _message(lambda: hash_request_tokens(None, 2, request))[1] == (  # type: ignore[arg-type]
        "hash_request_tokens: hash_fn must be callable, got None"
    )
    assert _message(lambda: hash_request_tokens(sha256, 2, "r"))[1] == (  # type: ignore[arg-type]
        "hash_request_tokens: request must be a Request, got 'r' (str)"
    )
    assert _message(lambda: need_extra_keys("r"))[1] == (  # type: ignore[arg-type]
        "need_extra_keys: request must be a Request, got 'r' (str)"
    )
    assert need_extra_keys(request) and not need_extra_keys(Request("plain", [1]))
    assert _message(lambda: get_hash_fn(1))[1] == (  # type: ignore[arg-type]
        "get_hash_fn: algo must be a str, got 1"
    )
    for arguments, message in [
        (("r", 0, 2, 0), "request must be a Request, got 'r' (str)"),
        ((request, -1, 2, 0), "start_token_idx must be an int >= 0, got -1"),
        ((request, 2, 1, 0), "end_token_idx must be an int >= 2, got 1"),
        ((request, 0, 2, -1), "start_mm_idx must be an int >= 0, got -1"),
    ]:
        assert _message(lambda a=arguments: generate_block_hash_extra_keys(*a))[1] == (  # type: ignore[misc]
            f"generate_block_hash_extra_keys: {message}"
        )


def test_a_salt_key_hides_its_value() -> None:
    assert repr(CacheSalt("tenant secret")) == "CacheSalt(<redacted>)"
    assert CacheSalt("a") == CacheSalt("a") and CacheSalt("a") != CacheSalt("b")
    imitations: list[object] = ["a", ("cache_salt", "a"), ("a",)]
    assert all(CacheSalt("a") != imitation for imitation in imitations)


def test_manager_argument_refusals_name_the_call_the_request_and_the_rule() -> None:
    layer = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(layer, 8), 16)
    request = Request("r", [1, 2, 3])
    assert _message(lambda: manager.get_num_common_prefix_blocks(request, -1)) == (
        "InvalidArgumentError",
        "KVCacheManager.get_num_common_prefix_blocks for request 'r': num_running_requests "
        "must be an int >= 0, got -1",
    )
    assert _message(lambda: manager.get_num_common_prefix_blocks(request, 1.0)) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "KVCacheManager.get_num_common_prefix_blocks for request 'r': num_running_requests "
        "must be an int >= 0, got 1.0 (float)",
    )
    assert _message(lambda: manager.get_num_common_prefix_blocks("r", 1))[1] == (  # type: ignore[arg-type]
        "KVCacheManager.get_num_common_prefix_blocks: request must be a Request, got 'r' (str)"
    )
    request.prompt_logprobs = 1  # type: ignore[assignment]
    assert _message(lambda: manager.get_computed_blocks(request)) == (
        "ArgumentTypeError",
        "KVCacheManager.get_computed_blocks for request 'r': request.prompt_logprobs must be a "
        "bool, got 1",
    )
    request.prompt_logprobs = False
    for method in ("get_computed_blocks", "free", "free_block_hashes"):
        assert _message(lambda m=method: getattr(manager, m)(None))[1] == (  # type: ignore[misc]
            f"KVCacheManager.{method}: request must be a Request, got None"
        )
    assert _message(lambda: manager.allocate_slots(request, 1, ([1],))) == (  # type: ignore[list-item]
        "ArgumentTypeError",
        "KVCacheManager.allocate_slots for request 'r': new_computed_blocks[0][0] must be a "
        "block, got 1",
    )
    assert _message(lambda: manager.allocate_slots(request, 1, (5,))) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "KVCacheManager.allocate_slots for request 'r': new_computed_blocks[0] must be an "
        "iterable, got 5",
    )
    assert _message(lambda: manager.allocate_slots(request, 1, [])) == (
        "ArgumentTypeError",
        "KVCacheManager.allocate_slots for request 'r': new_computed_blocks must be one "
        "iterable of blocks per KV cache group (1), got a list of 0",
    )
    request.spec_token_ids = (1,)  # type: ignore[assignment]
    assert _message(lambda: manager.allocate_slots(request, 1)) == (
        "ArgumentTypeError",
        "KVCacheManager.allocate_slots for request 'r': request.spec_token_ids must be a list, "
        "got (1,) (tuple)",
    )
    request.spec_token_ids = []
    manager.check_invariants()


def test_pool_argument_refusals_name_the_block_position() -> None:
    pool = BlockPool(4, True)
    assert _message(lambda: pool.touch([pool.blocks[1], "b"])) == (  # type: ignore[list-item]
        "ArgumentTypeError",
        "BlockPool.touch: blocks[1] must be a block, got 'b' (str)",
    )
    assert _message(lambda: pool.free_blocks(None)) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "BlockPool.free_blocks: ordered_blocks must be an iterable, got None",
    )
    assert _message(lambda: pool.get_cached_block((1, (1,), None))) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "BlockPool.get_cached_block: block_hash must be a BlockHashType, got (1, (1,), None) "
        "(tuple)",
    )
    unhashable = BlockHashType(1, [1], None)  # type: ignore[arg-type]
    assert _message(lambda: pool.get_cached_block(unhashable)) == (
        "ArgumentTypeError",
        "BlockPool.get_cached_block: block_hash must be a hashable BlockHashType, got "
        "BlockHashType(hash_value=1, token_ids=[1], extra_keys=None) (BlockHashType)",
    )
    blocks = pool.get_new_blocks(2)
    request = Request("r", [1, 2, 3, 4])
    stored = hash_request_tokens(sha256, 2, request)[:1]
    assert _message(
        lambda: pool.cache_full_blocks(request, [blocks[0], 5], [], 0, 2, 2, sha256)  # type: ignore[list-item]
    ) == ("ArgumentTypeError", "BlockPool.cache_full_blocks: blocks[1] must be a block, got 5")
    assert _message(lambda: pool.cache_full_blocks(request, blocks, stored, 1, 2, 2, sha256)) == (
        "BlockStateError",
        "block 1: the block before the first block to cache has no hash",
    )
    assert _message(
        lambda: pool.cache_full_blocks(request, blocks, [(1, (1,), None)], 1, 1, 2, sha256)  # type: ignore[list-item]
    )[1] == (
        "BlockPool.cache_full_blocks: block_hashes[0] must be a BlockHashType, got "
        "(1, (1,), None) (tuple)"
    )
    pool.check_invariants()


def test_free_queue_refusals_name_the_block_and_the_queue() -> None:
    pool, other = BlockPool(3, True), BlockPool(3, True)
    queue = pool.free_block_queue
    assert _message(lambda: queue.remove(other.blocks[1])) == (
        "FreeQueueError",
        "block 1: remove of a block of another free queue",
    )
    assert _message(lambda: queue.append(other.blocks[2])) == (
        "FreeQueueError",
        "block 2: append of a block of another free queue",
    )
    assert _message(lambda: queue.append(None)) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "FreeKVCacheBlockQueue.append: block must be a KVCacheBlock, got None",
    )
    assert _message(lambda: queue.remove(1)) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "FreeKVCacheBlockQueue.remove: block must be a KVCacheBlock, got 1",
    )
    assert _message(lambda: queue.remove(pool.null_block)) == (
        "FreeQueueError",
        "block 0: remove of a block that is not in the free queue",
    )
    assert not queue.contains(other.blocks[1])
    pool.check_invariants()
    other.check_invariants()


def test_an_identity_change_names_the_request_and_the_field() -> None:
    request = Request("r", [1])
    with pytest.raises(FrozenRequestFieldError) as info:
        request.cache_salt = "other"
    error = info.value
    assert (error.request_id, error.rule) == ("r", "cache_salt is fixed at construction")
    assert str(error) == (
        "request 'r': cache_salt is fixed at construction (a request's identity cannot change; "
        "build a new Request (with a new id) instead)"
    )


def test_prefix_caching_metrics_refuse_what_is_no_stats() -> None:
    metrics = PrefixCachingMetrics()
    assert _message(lambda: metrics.observe({"hits": 1})) == (  # type: ignore[arg-type]
        "ArgumentTypeError",
        "PrefixCachingMetrics.observe: stats must be a PrefixCacheStats, got {'hits': 1} (dict)",
    )
    assert metrics.aggregated_requests == 0


# -- concurrent use: every guarded call names itself ----------------------------------------------

POOL_GUARDED: dict[str, Callable[[BlockPool], object]] = {
    "get_new_blocks": lambda pool: pool.get_new_blocks(1),
    "touch": lambda pool: pool.touch([]),
    "free_blocks": lambda pool: pool.free_blocks([]),
    "cache_full_blocks": lambda pool: pool.cache_full_blocks(
        Request("r", [1]), [], [], 0, 0, 1, sha256
    ),
    "reset_prefix_cache": lambda pool: pool.reset_prefix_cache(),
    "check_invariants": lambda pool: pool.check_invariants(),
}
MANAGER_GUARDED: dict[str, Callable[[KVCacheManager, Request], object]] = {
    "get_computed_blocks": lambda manager, request: manager.get_computed_blocks(request),
    "allocate_slots": lambda manager, request: manager.allocate_slots(request, 2),
    "get_num_common_prefix_blocks": lambda manager, request: manager.get_num_common_prefix_blocks(
        request, 1
    ),
    "free": lambda manager, request: manager.free(request),
    "free_block_hashes": lambda manager, request: manager.free_block_hashes(request),
    "reset_prefix_cache": lambda manager, request: manager.reset_prefix_cache(),
    "make_prefix_cache_stats": lambda manager, request: manager.make_prefix_cache_stats(),
    "check_invariants": lambda manager, request: manager.check_invariants(),
}


def test_every_guarded_pool_call_refused_while_another_runs_names_itself() -> None:
    pool = BlockPool(4, True)
    token = pool._idle.pop()  # as a running call holds it
    for method, call in POOL_GUARDED.items():
        with pytest.raises(ConcurrentUseError) as info:
            call(pool)
        assert info.value.call == f"BlockPool.{method}"
        assert str(info.value).startswith(
            f"BlockPool.{method}: refused, another call on the same object is running"
        )
    pool._idle.append(token)
    for call in POOL_GUARDED.values():
        call(pool)  # each one works again, and gives the token back
    assert pool._idle == [None]


def test_every_guarded_manager_call_refused_while_another_runs_names_itself() -> None:
    layer = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(layer, 8), 16)
    request = Request("r", [1, 2])
    token = manager.block_pool._idle.pop()
    for method, call in MANAGER_GUARDED.items():
        with pytest.raises(ConcurrentUseError) as info:
            call(manager, request)
        assert info.value.call == f"KVCacheManager.{method}"
        assert str(info.value).startswith(f"KVCacheManager.{method}: refused, another call")
    manager.block_pool._idle.append(token)
    for call in MANAGER_GUARDED.values():
        call(manager, request)  # a request's whole life: each call works again
    assert manager.block_pool._idle == [None]
