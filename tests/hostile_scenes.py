"""Scenes for hostile-input tests: a busy pool or manager on either side, and the byte-for-byte
comparison of its state before and after a refused call."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pagedkv import (
    BlockHashType,
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    PagedKVError,
    Request,
    SlidingWindowSpec,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.manager import SpecKVCacheManager

SIDES = ("spec", "impl")


def state(*objects: object) -> bytes:
    """The whole object graph, pickled: equal bytes mean nothing changed."""
    return pickle.dumps(objects)


def refused(call: Callable[[], object], *observed: object) -> PagedKVError:
    """Run `call`, demand a typed pagedkv error and `observed` unchanged to the byte."""
    before = state(*observed)
    with pytest.raises(PagedKVError) as info:
        call()
    assert state(*observed) == before, f"a refused call changed the state: {info.value}"
    return info.value


# -- scenes ----------------------------------------------------------------------------------------


@dataclass
class PoolScene:
    """A pool with cached blocks in use, a cached free block and plain free blocks."""

    pool: Any  # BlockPool or SpecBlockPool
    request: Request
    blocks: list[Any]  # the request's blocks (objects or ids): two cached, one partial
    stored: list[BlockHashType]


def pool_scene(side: str) -> PoolScene:
    pool: Any = SpecBlockPool(8, True) if side == "spec" else BlockPool(8, True)
    request = Request("r", [1, 2, 3, 4, 5], cache_salt="tenant-a")
    blocks = pool.get_new_blocks(3)
    stored: list[BlockHashType] = []
    pool.cache_full_blocks(request, blocks, stored, 0, 2, 2, sha256)
    freed = pool.get_new_blocks(1)
    pool.cache_full_blocks(Request("s", [7, 7]), freed, [], 0, 1, 2, sha256)
    pool.free_blocks(freed)  # free but still cached
    pool.check_invariants()
    return PoolScene(pool, request, blocks, stored)


@dataclass
class ManagerScene:
    """A running request (blocks, computed tokens, one sampled token) and a waiting one that
    was looked up (stored hashes, hits at hand)."""

    manager: Any  # KVCacheManager or SpecKVCacheManager
    running: Request
    waiting: Request
    hits: tuple[list[Any], ...]  # one list per KV cache group (one group here)


def manager_scene(side: str, *, sliding: bool = False, hash_algo: str = "sha256") -> ManagerScene:
    layer: FullAttentionSpec | SlidingWindowSpec = (
        SlidingWindowSpec(
            block_size=2, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=4
        )
        if sliding
        else FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    )
    config = uniform_kv_cache_config(layer, 12)
    manager_class: Any = SpecKVCacheManager if side == "spec" else KVCacheManager
    manager = manager_class(config, 32, caching_hash_algo=hash_algo)
    running = Request("running", [1, 2, 3, 4, 5, 6, 7], cache_salt="tenant-a")
    hits, num_hit_tokens = manager.get_computed_blocks(running)
    assert manager.allocate_slots(running, running.num_tokens - num_hit_tokens, hits) is not None
    running.num_computed_tokens = running.num_tokens
    running.append_output_token_ids(8)
    waiting = Request("waiting", [1, 2, 3, 4, 5, 6, 9], cache_salt="tenant-a")
    hits, _ = manager.get_computed_blocks(waiting)
    assert hits[0]
    manager.check_invariants()
    return ManagerScene(manager, running, waiting, hits)
