"""Sliding-window attention: reuse a cached window, drop blocks that left the window."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import BlockHashType
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import SlidingWindowSpec, cdiv
from pagedkv.specialized_manager import SpecializedManager


class SlidingWindowManager(SpecializedManager):
    """A token attends to itself and the `sliding_window - 1` tokens before it.

    A request's block list keeps one entry per block position; positions that fell out of the
    window hold the null block. Null blocks therefore form a prefix of every block list.

    Layout of a hit with block size 4 and window 8 (cdiv(7, 4) = 2 blocks must be cached):

        hashes:  h0    h1    h2    h3    h4
        cached:  yes   no    yes   yes   no
        result:  NULL  NULL  b2    b3          (the rightmost run of 2 cached blocks)
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_spec, block_pool)
        self.sliding_window = kv_cache_spec.sliding_window
        # The token being computed is itself in the window, hence W - 1.
        self.sliding_window_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The longest prefix ending in a run of `sliding_window_contiguous_blocks` cached blocks.

        Scans from the right and stops at the first run long enough; blocks left of it are
        null. With no such run, the run of cached blocks starting at block 0 (maybe empty).

        Complexity: O(len(block_hashes)).
        """
        get_cached_block = self.block_pool.get_cached_block
        needed = self.sliding_window_contiguous_blocks
        hits: list[KVCacheBlock] = [self.null_block] * len(block_hashes)
        run = 0
        for i in range(len(block_hashes) - 1, -1, -1):
            block = get_cached_block(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                del hits[i + run :]
                return hits
        del hits[run:]  # the run that starts at block 0 counts even if short
        return hits

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Null out blocks wholly before token `num_computed_tokens - sliding_window + 1`.

        Scans from the newest such block back to the first null block (the nulls before it were
        set by earlier calls).

        Returns:
            The replaced blocks, newest first.

        Complexity: O(number of blocks replaced).
        """
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        first_useful_block = first_useful_token // self.block_size
        null_block = self.null_block
        removed = []
        for i in range(first_useful_block - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            removed.append(block)
            blocks[i] = null_block
        return removed
