"""Ill-typed calls on the public API of the modules the compiled build compiles, and their outcomes.

Each case builds a fresh pool, queue, block or manager, makes one call with an argument of the
wrong type (float, NaN, None, str, bool, a non-block), and reports what happened: the exception
class and, for pagedkv's own errors, the message; or the result; and whether the call changed the
object's observable state. `tests/test_compiled_refusals.py` compares these outcomes between the
compiled build and the pure one; run as a script, this module prints them as JSON for the
`pagedkv` it imports.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pagedkv
from pagedkv import (
    BlockPool,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    PagedKVError,
    Request,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.harness.adapters import ObjectManagerAdapter, ObjectPoolAdapter

Outcome = dict[str, Any]
Snapshot = Callable[[], object]
Case = Callable[[], tuple[Snapshot, Callable[[], object]]]
NAN = math.nan
BLOCK_SIZE = 4


def _config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float16")
    return uniform_kv_cache_config(spec, 10)


def _manager() -> KVCacheManager:
    return KVCacheManager(_config(), 64)


def _running() -> tuple[KVCacheManager, Request, Snapshot]:
    """A manager with one request that holds two blocks and decodes inside the second."""
    manager = _manager()
    request = Request("r", list(range(6)))
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    request.append_output_token_ids(7)
    return manager, request, ObjectManagerAdapter(manager).snapshot


def _waiting_with_hits() -> tuple[KVCacheManager, Request, KVCacheBlocks, Snapshot]:
    """A freed request left its two full blocks cached; a new one with the same prompt hits them
    (one group: one list of two blocks)."""
    manager = _manager()
    first = Request("first", list(range(9)))
    assert manager.allocate_slots(first, 9) is not None
    manager.free(first)
    manager.free_block_hashes(first)
    second = Request("second", list(range(9)))
    hits, _ = manager.get_computed_blocks(second)
    assert [len(group_hits) for group_hits in hits] == [2]
    return manager, second, hits, ObjectManagerAdapter(manager).snapshot


def _pool() -> tuple[BlockPool, list[KVCacheBlock], Snapshot]:
    """A pool of 6 blocks, 2 of them in use."""
    pool = BlockPool(6, enable_caching=True)
    return pool, pool.get_new_blocks(2), ObjectPoolAdapter(pool).snapshot


def _no_state() -> object:
    return None


def _allocate(num_tokens: Any, lookahead: Any = 0) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        manager, request, snapshot = _running()
        return snapshot, lambda: manager.allocate_slots(request, num_tokens, None, lookahead)

    return case


def _allocate_with_hits(num_tokens: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        manager, request, hits, snapshot = _waiting_with_hits()
        return snapshot, lambda: manager.allocate_slots(request, num_tokens, hits)

    return case


def _allocate_after_setting(field: str, value: Any) -> Case:
    """The scheduler set a field of the request to an ill-typed value, then allocates."""

    def case() -> tuple[Snapshot, Callable[[], object]]:
        manager, request, snapshot = _running()

        def call() -> object:
            setattr(request, field, value)
            return manager.allocate_slots(request, 1)

        return snapshot, call

    return case


def _manager_call(method: str, *args: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        manager, _, snapshot = _running()
        return snapshot, lambda: getattr(manager, method)(*args)

    return case


def _common_prefix(num_running: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        manager, request, snapshot = _running()
        return snapshot, lambda: manager.get_num_common_prefix_blocks(request, num_running)

    return case


def _construct_manager(max_model_len: Any, **kwargs: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        config = _config()
        return _no_state, lambda: KVCacheManager(config, max_model_len, **kwargs)

    return case


def _construct_pool(num_gpu_blocks: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        return _no_state, lambda: BlockPool(num_gpu_blocks, True)

    return case


def _pool_call(method: str, make_args: Callable[[list[KVCacheBlock]], tuple[Any, ...]]) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        pool, held, snapshot = _pool()
        return snapshot, lambda: getattr(pool, method)(*make_args(held))

    return case


def _cache(num_cached: Any, num_full: Any, block_size: Any) -> Case:
    return _cache_into([], num_cached, num_full, block_size)


def _cache_into(
    block_hashes: Any, num_cached: Any, num_full: Any, block_size: Any = BLOCK_SIZE
) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        pool, held, snapshot = _pool()
        request = Request("c", list(range(2 * BLOCK_SIZE)))
        return snapshot, lambda: pool.cache_full_blocks(
            request, held, block_hashes, num_cached, num_full, block_size, sha256
        )

    return case


def _queue_call(method: str, argument: Any) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])

        def snapshot() -> object:
            return [block.block_id for block in queue.get_all_free_blocks()], queue.num_free_blocks

        return snapshot, lambda: getattr(queue, method)(argument)

    return case


def _function(call: Callable[[], object]) -> Case:
    def case() -> tuple[Snapshot, Callable[[], object]]:
        return _no_state, call

    return case


CASES: dict[str, Case] = {
    "allocate_slots: num_tokens float": _allocate(1.0),
    "allocate_slots: num_tokens NaN": _allocate(NAN),
    "allocate_slots: num_tokens None": _allocate(None),
    "allocate_slots: num_tokens str": _allocate("1"),
    "allocate_slots: num_tokens bool": _allocate(True),
    "allocate_slots: lookahead float": _allocate(1, 1.5),
    "allocate_slots: lookahead None": _allocate(1, None),
    "allocate_slots with hits: num_tokens float": _allocate_with_hits(1.0),
    "allocate_slots with hits: num_tokens NaN": _allocate_with_hits(NAN),
    "allocate_slots: hits are not blocks": _manager_call(
        "allocate_slots", Request("h", [1]), 1, [[1]]
    ),
    "allocate_slots: hits are not one list per group": _manager_call(
        "allocate_slots", Request("h", [1]), 1, [1]
    ),
    "allocate_slots: request None": _manager_call("allocate_slots", None, 1),
    "allocate_slots: num_computed_tokens float": _allocate_after_setting(
        "num_computed_tokens", 6.0
    ),
    "allocate_slots: num_computed_tokens None": _allocate_after_setting(
        "num_computed_tokens", None
    ),
    "allocate_slots: spec_token_ids None": _allocate_after_setting("spec_token_ids", None),
    "allocate_slots: spec_token_ids tuple": _allocate_after_setting("spec_token_ids", (1,)),
    "allocate_slots: num_computed_tokens bool": _allocate_after_setting(
        "num_computed_tokens", True
    ),
    "allocate_slots: lookahead bool": _allocate(1, False),
    "get_computed_blocks: request None": _manager_call("get_computed_blocks", None),
    "get_computed_blocks: request str": _manager_call("get_computed_blocks", "r"),
    "free: request None": _manager_call("free", None),
    "free_block_hashes: request str": _manager_call("free_block_hashes", "r"),
    "get_num_common_prefix_blocks: float": _common_prefix(1.0),
    "get_num_common_prefix_blocks: None": _common_prefix(None),
    "KVCacheManager: max_model_len float": _construct_manager(64.0),
    "KVCacheManager: max_model_len NaN": _construct_manager(NAN),
    "KVCacheManager: max_model_len None": _construct_manager(None),
    "KVCacheManager: max_model_len str": _construct_manager("64"),
    "KVCacheManager: caching_hash_algo None": _construct_manager(64, caching_hash_algo=None),
    "KVCacheManager: debug_invariants float": _construct_manager(64, debug_invariants=1.5),
    "KVCacheManager: enable_caching None": _construct_manager(64, enable_caching=None),
    "KVCacheManager: use_eagle int": _construct_manager(64, use_eagle=1),
    "BlockPool: num_gpu_blocks float": _construct_pool(4.0),
    "BlockPool: num_gpu_blocks NaN": _construct_pool(NAN),
    "BlockPool: num_gpu_blocks None": _construct_pool(None),
    "BlockPool: num_gpu_blocks str": _construct_pool("4"),
    "BlockPool: num_gpu_blocks bool": _construct_pool(True),
    "get_new_blocks: float": _pool_call("get_new_blocks", lambda _: (1.0,)),
    "get_new_blocks: NaN": _pool_call("get_new_blocks", lambda _: (NAN,)),
    "get_new_blocks: None": _pool_call("get_new_blocks", lambda _: (None,)),
    "get_new_blocks: bool": _pool_call("get_new_blocks", lambda _: (True,)),
    "touch: block ids instead of blocks": _pool_call("touch", lambda _: ([3],)),
    "touch: None": _pool_call("touch", lambda _: (None,)),
    "free_blocks: a None among blocks": _pool_call("free_blocks", lambda held: ([*held, None],)),
    "get_cached_block: None": _pool_call("get_cached_block", lambda _: (None,)),
    "cache_full_blocks: num_cached_blocks float": _cache(0.0, 1, BLOCK_SIZE),
    "cache_full_blocks: num_full_blocks NaN": _cache(0, NAN, BLOCK_SIZE),
    "cache_full_blocks: block_size float": _cache(0, 1, float(BLOCK_SIZE)),
    "cache_full_blocks: block_size None": _cache(0, 1, None),
    "cache_full_blocks: block_hashes a tuple": _cache_into((), 0, 1),
    "free queue: remove None": _queue_call("remove", None),
    "free queue: append an int": _queue_call("append", 3),
    "free queue: appendleft None": _queue_call("appendleft", None),
    "KVCacheBlock: block_id float": _function(lambda: KVCacheBlock(1.0)),
    "KVCacheBlock: block_id None": _function(lambda: KVCacheBlock(None)),
    "hash_request_tokens: block_size float": _function(
        lambda: hash_request_tokens(sha256, 4.0, Request("q", [1, 2, 3, 4]))
    ),
    "hash_request_tokens: block_size None": _function(
        lambda: hash_request_tokens(sha256, None, Request("q", [1, 2, 3, 4]))
    ),
    "hash_block_tokens: parent hash float": _function(
        lambda: hash_block_tokens(sha256, 1.5, [1, 2])
    ),
    "hash_block_tokens: extra keys a list": _function(
        lambda: hash_block_tokens(sha256, None, [1, 2], [1])
    ),
    "generate_block_hash_extra_keys: start float": _function(
        lambda: generate_block_hash_extra_keys(Request("q", [1], lora_id=1), 0.0, 1, 0)
    ),
    "generate_block_hash_extra_keys: start_mm_idx None": _function(
        lambda: generate_block_hash_extra_keys(Request("q", [1], lora_id=1), 0, 1, None)
    ),
    "get_hash_fn: None": _function(lambda: get_hash_fn(None)),
    "get_hash_fn: bytes": _function(lambda: get_hash_fn(b"sha256")),
}


def _describe(result: object) -> object:
    if isinstance(result, list) and all(isinstance(item, KVCacheBlock) for item in result):
        return [item.block_id for item in result]
    if result is None or isinstance(result, (bool, int, str)):
        return result
    return type(result).__name__


def outcome(name: str) -> Outcome:
    """Run case `name` once and say what it did."""
    snapshot, call = CASES[name]()
    before = snapshot()
    try:
        result = call()
    except Exception as error:  # the outcome is the point: any exception is recorded
        typed = isinstance(error, PagedKVError)
        return {
            "raised": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error) if typed else None,
            "changed": snapshot() != before,
        }
    return {"returned": _describe(result), "changed": snapshot() != before}


def outcomes() -> dict[str, Outcome]:
    """Every case's outcome on the `pagedkv` this process imports."""
    return {name: outcome(name) for name in CASES}


RECORDED = Path(__file__).with_name("refusal_outcomes.json")
"""Every case's outcome, recorded: the messages users see, pinned on both builds. Rewrite it
with `python tests/refusal_cases.py --write` when a message changes on purpose."""


def recorded_outcomes() -> dict[str, Outcome]:
    recorded: dict[str, Outcome] = json.loads(RECORDED.read_text())
    return recorded


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        RECORDED.write_text(json.dumps(outcomes(), indent=1, sort_keys=True) + "\n")
    else:
        json.dump({"compiled": pagedkv.COMPILED, "outcomes": outcomes()}, sys.stdout, indent=1)
    sys.exit(0)
