"""Attention-type policies: which cached blocks a request may reuse, and which it may drop.

Full attention reuses the longest cached prefix and keeps every block. Sliding window (see
`sliding_window.py`) needs only the last window of blocks to be cached, and frees blocks that fell
out of the window, putting the null block in their place so block-table positions stay fixed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import BlockHashType
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import KVCacheSpec


class SpecializedManager(ABC):
    """The policy of one attention type over a shared block pool.

    Attributes:
        allows_null_blocks: whether a request's block list may start with null blocks
            (positions the attention no longer reads); a hit may then start with them too.
    """

    allows_null_blocks: ClassVar[bool]

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

    def hit_shape_error(self, hits: Sequence[KVCacheBlock], use_eagle: bool) -> str | None:
        """Why `hits`, with no null block out of place, cannot be a hit of this attention type;
        None if they can. Complexity: O(len(hits))."""
        return None


class FullAttentionManager(SpecializedManager):
    """Every earlier token is attended to: reuse the cached prefix, never drop a block."""

    allows_null_blocks = False

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The cached prefix: chained hashes make every block after the first miss a miss too."""
        index = self.block_pool.cached_block_hash_to_block  # BlockPool.cached_block, inline
        hits = []
        for block_hash in block_hashes:
            cached = index.get(block_hash)
            if not cached:
                break
            hits.append(next(iter(cached.values())))
        return hits

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Nothing is skipped. Complexity: O(1)."""
        return []
