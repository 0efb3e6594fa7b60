"""Adapters that make pools speak `PoolUnderTest`, and the factories `--impl` can name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, cast

from pagedkv.block_hash import BlockHashType, HashFn
from pagedkv.block_pool import BlockPool
from pagedkv.errors import InvalidArgumentError
from pagedkv.harness.protocol import PoolFactory, PoolSnapshot, PoolUnderTest
from pagedkv.request import Request
from pagedkv.semantics import Semantics
from pagedkv.spec.block_pool import SpecBlockPool


class ObjectPoolAdapter:
    """Drives any pool shaped like vLLM's `BlockPool` (block objects) through block ids.

    An id outside the pool becomes a fresh block object of the pool's block type, so a
    "foreign block" reaches the pool as one would in real misuse.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._block_type: Callable[[int], Any] = type(pool.blocks[0])

    def _blocks(self, block_ids: Sequence[int]) -> list[Any]:
        blocks = self.pool.blocks
        return [
            blocks[block_id] if 0 <= block_id < len(blocks) else self._block_type(block_id)
            for block_id in block_ids
        ]

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        return [block.block_id for block in self.pool.get_new_blocks(num_blocks)]

    def touch(self, block_ids: Sequence[int]) -> None:
        self.pool.touch(self._blocks(block_ids))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks(self._blocks(block_ids))

    def cache_full_blocks(
        self,
        request: Request,
        block_ids: Sequence[int],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> None:
        self.pool.cache_full_blocks(
            request=request,
            blocks=self._blocks(block_ids),
            block_hashes=block_hashes,
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=block_size,
            hash_fn=hash_fn,
        )

    def get_cached_block(self, block_hash: BlockHashType) -> int | None:
        block = self.pool.get_cached_block(block_hash)
        return None if block is None else int(block.block_id)

    def reset_prefix_cache(self) -> bool:
        return bool(self.pool.reset_prefix_cache())

    def get_num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_usage(self) -> float:
        return float(self.pool.get_usage())

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        return PoolSnapshot(
            free_order=tuple(
                block.block_id for block in pool.free_block_queue.get_all_free_blocks()
            ),
            ref_cnt=tuple(block.ref_cnt for block in pool.blocks),
            block_hash=tuple(block.block_hash for block in pool.blocks),
            index={
                block_hash: tuple(cached)
                for block_hash, cached in pool.cached_block_hash_to_block.items()
                if cached
            },
            num_free_blocks=self.get_num_free_blocks(),
            usage=self.get_usage(),
        )

    def check_invariants(self) -> None:
        check = getattr(self.pool, "check_invariants", None)
        if check is not None:
            check()


class SpecPoolAdapter:
    """The spec pool already speaks ids; this adds `snapshot()`."""

    def __init__(self, pool: SpecBlockPool) -> None:
        self.pool = pool
        self.get_new_blocks = pool.get_new_blocks
        self.touch = pool.touch
        self.free_blocks = pool.free_blocks
        self.cache_full_blocks = pool.cache_full_blocks
        self.get_cached_block = pool.get_cached_block
        self.reset_prefix_cache = pool.reset_prefix_cache
        self.get_num_free_blocks = pool.get_num_free_blocks
        self.get_usage = pool.get_usage
        self.check_invariants = pool.check_invariants

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        return PoolSnapshot(
            free_order=tuple(pool.free_order),
            ref_cnt=tuple(pool.ref_cnt),
            block_hash=tuple(pool.block_hash),
            index={block_hash: tuple(ids) for block_hash, ids in pool.index.items()},
            num_free_blocks=pool.get_num_free_blocks(),
            usage=pool.get_usage(),
        )


def spec_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> PoolUnderTest:
    """The reference model, as a pool under test."""
    return SpecPoolAdapter(SpecBlockPool(num_gpu_blocks, enable_caching, semantics))


def pagedkv_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> PoolUnderTest:
    """pagedkv's optimized `BlockPool`, as a pool under test (the default `--impl`)."""
    return ObjectPoolAdapter(BlockPool(num_gpu_blocks, enable_caching, semantics))


def load_factory(target: str) -> PoolFactory:
    """Import `module:attribute` and return it as a pool factory."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise InvalidArgumentError(f"expected module:factory, got {target!r}")
    factory = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(factory):
        raise InvalidArgumentError(f"{target!r} is not a callable factory")
    return cast(PoolFactory, factory)
