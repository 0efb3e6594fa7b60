"""Attention-type policies: which cached blocks a request may reuse, and which it may drop.

Full attention reuses the longest cached prefix and keeps every block. Sliding window (see
`sliding_window.py`) needs only the last window of blocks to be cached, and frees blocks that fell
out of the window, putting the null block in their place so block-table positions stay fixed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import BlockHashType
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import KVCacheSpec


class SpecializedManager(ABC):
    """The policy of one attention type over a shared block pool."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.null_block = block_pool.null_block

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The cached blocks a request with these hashes may reuse, skipped ones as null blocks.

        Complexity: O(len(block_hashes)).
        """

    @abstractmethod
    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Replace blocks no longer needed by the null block, in place.

        Returns:
            The replaced blocks, in eviction order (the first should be evicted first). The
            caller frees them.
        """


class FullAttentionManager(SpecializedManager):
    """Every earlier token is attended to: reuse the cached prefix, never drop a block."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The cached prefix: chained hashes make every block after the first miss a miss too."""
        get_cached_block = self.block_pool.get_cached_block
        hits = []
        for block_hash in block_hashes:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Nothing is skipped. Complexity: O(1)."""
        return []
