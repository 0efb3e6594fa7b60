"""Full attention: every earlier token is read, so the cached prefix is reused and no block is
ever dropped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.single_type.base import SingleTypeKVCacheManager
from pagedkv.vocab.hashes import BlockHashType, GroupKey

_new_tuple = tuple.__new__  # GroupKey(group, hash) without the NamedTuple's Python-level __new__
T = TypeVar("T")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every earlier token is attended to: reuse the cached prefix, never drop a block."""

    kind = "full attention"
    allows_null_blocks = False

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """The cached prefix: chained hashes make every block after the first miss a miss too
        (EAGLE's hit is the same one). Complexity: O(len(block_hashes))."""
        index = self.block_pool.cached_block_hash_to_block  # BlockPool.cached_block, inline
        hits = []
        group_id = self.group_id
        if group_id:  # a hybrid model's other group: its keys are GroupKeys
            for block_hash in block_hashes:
                cached = index.get(_new_tuple(GroupKey, (group_id, block_hash)))
                if not cached:
                    break
                hits.append(next(iter(cached.values())))
            return hits
        for block_hash in block_hashes:
            cached = index.get(block_hash)
            if not cached:
                break
            hits.append(next(iter(cached.values())))
        return hits

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """The cached prefix (`find_longest_cache_hit`'s). Complexity: O(num_blocks)."""
        hits = []
        for i in range(num_blocks):
            cached = lookup(i)
            if cached is None:
                break
            hits.append(cached)
        return hits
