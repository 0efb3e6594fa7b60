"""Deliberately broken block pools: the differential harness must catch each one.

Each factory has the `PoolFactory` signature, so `pagedkv verify --impl broken_pools:NAME` runs
it (with `tests/` on PYTHONPATH).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.harness.adapters import ObjectPoolAdapter
from pagedkv.harness.protocol import PoolUnderTest
from pagedkv.vocab.semantics import Semantics
from proofs.planted.catalog import append_at_head, released_at_head


class HeadAppendQueue(FreeKVCacheBlockQueue):
    """Links a released block at the head instead of the tail (all checks kept)."""

    __slots__ = ()

    append = append_at_head
    append_released = released_at_head


class FreeToHeadPool(BlockPool):
    """free_blocks puts a released block at the head of the queue instead of the tail."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> None:
        super().__init__(num_gpu_blocks, enable_caching, semantics)
        self.free_block_queue.__class__ = HeadAppendQueue


class TouchKeepsQueuedPool(BlockPool):
    """touch takes a reference to a free cached block but leaves it in the free queue."""

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block is not self.null_block:
                block.ref_cnt += 1


class ReleaseResetsRefCntPool(BlockPool):
    """free_blocks sets a released block's ref_cnt to 0 instead of taking one reference away:
    a block two requests share goes back to the free queue while one still holds it."""

    def free_blocks_locked(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block is not self.null_block and block.ref_cnt > 1:
                block.ref_cnt = 1
        super().free_blocks_locked(blocks)


class EvictionKeepsHashPool(BlockPool):
    """get_new_blocks hands out a cached block without dropping it from the index."""

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        return


def free_to_head(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> PoolUnderTest:
    return ObjectPoolAdapter(FreeToHeadPool(num_gpu_blocks, enable_caching, semantics))


def touch_keeps_queued(
    num_gpu_blocks: int, enable_caching: bool, semantics: Semantics
) -> PoolUnderTest:
    return ObjectPoolAdapter(TouchKeepsQueuedPool(num_gpu_blocks, enable_caching, semantics))


def eviction_keeps_hash(
    num_gpu_blocks: int, enable_caching: bool, semantics: Semantics
) -> PoolUnderTest:
    return ObjectPoolAdapter(EvictionKeepsHashPool(num_gpu_blocks, enable_caching, semantics))


def release_resets_ref_cnt(
    num_gpu_blocks: int, enable_caching: bool, semantics: Semantics
) -> PoolUnderTest:
    return ObjectPoolAdapter(ReleaseResetsRefCntPool(num_gpu_blocks, enable_caching, semantics))
