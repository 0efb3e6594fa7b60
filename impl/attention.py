"""Attention-type policies: which cached blocks a request may reuse, and which it may drop.

Full attention reuses the longest cached prefix and keeps every block. Sliding window needs only
the last window of blocks to be cached, and frees blocks that fell out of the window, putting the
null block in their place so block-table positions stay fixed. `pagedkv.spec.attention` states
what each scan must find, by brute force.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_counts import cdiv
from pagedkv.block_pool import BlockPool
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from pagedkv.vocab.refusals import window_hit_detail


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


T = TypeVar("T")


def first_useful_block(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """The first block position the next token's window reaches; every block before it is skipped.

    The token at position `num_computed_tokens` attends to tokens from
    `num_computed_tokens - sliding_window + 1` on; block p covers `[p * B, (p + 1) * B)`. The
    result is negative while the window still reaches block 0 (then nothing is skipped).

    Complexity: O(1).
    """
    return (num_computed_tokens - sliding_window + 1) // block_size


def num_window_blocks(sliding_window: int, block_size: int) -> int:
    """Cached blocks a hit must end with: those holding the `sliding_window - 1` tokens before
    the next one (the token being computed is itself in the window), i.e. cdiv(W - 1, B).

    Complexity: O(1).
    """
    return cdiv(sliding_window - 1, block_size)


def scan_window_hit(
    num_blocks: int, num_needed: int, lookup: Callable[[int], T | None], null: T
) -> list[T]:
    """The longest prefix of `num_blocks` positions ending in `num_needed` consecutive hits.

    `lookup(i)` is the block cached for position i, or None. Positions are looked up from the
    right, each at most once, and the scan stops at the first run of `num_needed` hits: positions
    left of that run are never looked up and come back as `null`. Without such a run the result
    is the run of hits starting at position 0 (maybe empty, maybe shorter than `num_needed`).

        lookup:  hit   miss  hit   hit   miss      num_needed = 2
        result:  null  null  b2    b3              (positions 4, 3, 2 looked up)

    Complexity: O(num_blocks) lookups at most.
    """
    hits: list[T] = [null] * num_blocks
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        block = lookup(i)
        if block is None:
            run = 0
            continue
        hits[i] = block
        run += 1
        if run >= num_needed:
            del hits[i + run :]
            return hits
    del hits[run:]  # the run that starts at block 0 counts even if short
    return hits


class SlidingWindowManager(SpecializedManager):
    """A token attends to itself and the `sliding_window - 1` tokens before it.

    A request's block list keeps one entry per block position; positions that fell out of the
    window hold the null block. Null blocks therefore form a prefix of every block list.

    Layout of a hit with block size 4 and window 8 (cdiv(7, 4) = 2 blocks must be cached):

        hashes:  h0    h1    h2    h3    h4
        cached:  yes   no    yes   yes   no
        result:  NULL  NULL  b2    b3          (the rightmost run of 2 cached blocks)
    """

    allows_null_blocks = True

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_spec, block_pool)
        self.sliding_window = kv_cache_spec.sliding_window
        self.sliding_window_contiguous_blocks = num_window_blocks(
            self.sliding_window, self.block_size
        )

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The longest prefix ending in a run of `sliding_window_contiguous_blocks` cached blocks.

        Scans from the right and stops at the first run long enough; blocks left of it are
        null. With no such run, the run of cached blocks starting at block 0 (maybe empty).

        Complexity: O(len(block_hashes)).
        """
        get_cached_block = self.block_pool.cached_block
        return scan_window_hit(
            len(block_hashes),
            self.sliding_window_contiguous_blocks,
            lambda i: get_cached_block(block_hashes[i]),
            self.null_block,
        )

    def hit_shape_error(self, hits: Sequence[KVCacheBlock], use_eagle: bool) -> str | None:
        """A hit with null blocks is what `find_longest_cache_hit` makes of a skip: the nulls,
        then a full window of cached blocks (one fewer with EAGLE, which drops the last).

        Complexity: O(len(hits)).
        """
        null_block = self.null_block
        num_nulls = 0
        while num_nulls < len(hits) and hits[num_nulls] is null_block:
            num_nulls += 1
        if not num_nulls:
            return None
        needed = max(self.sliding_window_contiguous_blocks, 1) - int(use_eagle)
        cached = hits[num_nulls:]
        if any(block is null_block for block in cached) or len(cached) < needed:
            return window_hit_detail(num_nulls, len(cached), needed)
        return None

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
        first_useful = first_useful_block(num_computed_tokens, self.sliding_window, self.block_size)
        null_block = self.null_block
        removed = []
        for i in range(first_useful - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            removed.append(block)
            blocks[i] = null_block
        return removed
