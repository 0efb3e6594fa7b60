"""Sliding window: a token reads itself and the `sliding_window - 1` tokens before it.

Only the last window of a hit must be cached, and blocks that fell out of the window are freed,
the null block taking their place so that block-table positions stay fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_counts import cdiv
from pagedkv.block_pool import BlockPool
from pagedkv.single_type.base import SingleTypeKVCacheManager
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import SlidingWindowSpec
from pagedkv.vocab.refusals import window_hit_detail
from pagedkv.vocab.request import Request

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
    num_blocks: int,
    num_needed: int,
    lookup: Callable[[int], T | None],
    null: T,
    align: int = 1,
) -> list[T]:
    """The longest prefix of `num_blocks` positions ending in `num_needed` consecutive hits.

    `lookup(i)` is the block cached for position i, or None. Positions are looked up from the
    right, each at most once, and the scan stops at the first run of `num_needed` hits: positions
    left of that run are never looked up and come back as `null`. Without such a run the result
    is the run of hits starting at position 0 (maybe empty, maybe shorter than `num_needed`).

        lookup:  hit   miss  hit   hit   miss      num_needed = 2
        result:  null  null  b2    b3              (positions 4, 3, 2 looked up)

    With `align` > 1 (groups of several block sizes: S / B), hits end on a multiple of `align`
    blocks: a run starts (from the right) only at a position i with `(i + 1) % align == 0`;
    a cached block elsewhere starts nothing and comes back as `null`.

    Complexity: O(num_blocks) lookups at most.
    """
    hits: list[T] = [null] * num_blocks
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        block = lookup(i)
        if block is None:
            run = 0
            continue
        if not run and (i + 1) % align:
            continue
        hits[i] = block
        run += 1
        if run >= num_needed:
            del hits[i + run :]
            return hits
    del hits[run:]  # the run that starts at block 0 counts even if short
    return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token attends to itself and the `sliding_window - 1` tokens before it.

    A request's block list keeps one entry per block position; positions that fell out of the
    window hold the null block. Null blocks therefore form a prefix of every block list.

    Layout of a hit with block size 4 and window 8 (cdiv(7, 4) = 2 blocks must be cached):

        hashes:  h0    h1    h2    h3    h4
        cached:  yes   no    yes   yes   no
        result:  NULL  NULL  b2    b3          (the rightmost run of 2 cached blocks)

    For EAGLE (`for_eagle`) a hit is found for a window one block wider: its run of cached
    blocks is one longer, so that a whole window stays once EAGLE drops the last block.
    """

    kind = "sliding window"
    allows_null_blocks = True
    acts_on_retention = True

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int):
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        self.sliding_window_contiguous_blocks = num_window_blocks(
            self.sliding_window, self.block_size
        )
        self.eagle_contiguous_blocks = num_window_blocks(
            self.sliding_window + self.block_size, self.block_size
        )
        # Groups of several block sizes with caching: S / B (set by the manager, with `sparse`
        # when S > B): hits end on multiples of S, and only the blocks they read are cached.
        self.alignment_blocks = 1

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """The longest prefix ending in a run of `sliding_window_contiguous_blocks` cached blocks
        (one more `for_eagle`). Scans from the right and stops at the first run long enough;
        blocks left of it are null. With no such run, the run of cached blocks starting at
        block 0 (maybe empty).

        Complexity: O(len(block_hashes)).
        """
        get_cached_block = self.block_pool.cached_block if not self.group_id else self.cached_block
        return self.scan_hit(
            len(block_hashes),
            lambda i: get_cached_block(block_hashes[i]),
            self.null_block,
            for_eagle,
        )

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """`scan_window_hit` for this window (one block wider `for_eagle`).
        Complexity: O(num_blocks)."""
        num_needed = (
            self.eagle_contiguous_blocks if for_eagle else self.sliding_window_contiguous_blocks
        )
        return scan_window_hit(num_blocks, num_needed, lookup, null, self.alignment_blocks)

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """A hit with null blocks is what `find_longest_cache_hit` makes of a skip: the nulls,
        then a full window of cached blocks (found `for_eagle` one longer, then one fewer with
        `use_eagle`, which drops the last).

        Complexity: O(len(hits)).
        """
        null_block = self.null_block
        num_nulls = self.num_leading_nulls(hits)
        if not num_nulls:
            return None
        window = (
            self.eagle_contiguous_blocks if for_eagle else self.sliding_window_contiguous_blocks
        )
        needed = max(window, 1) - int(use_eagle)
        cached = hits[num_nulls:]
        if any(block is null_block for block in cached) or len(cached) < needed:
            return window_hit_detail(num_nulls, len(cached), needed)
        return None

    def retained(self, request: Request, junction: int, first: int, end: int) -> list[bool]:
        """vLLM 0.33's reachable-block mask (`pagedkv.spec.retention` states it): the run of
        blocks a hit needs (`need`: the window's, one more with EAGLE) ending at each replay
        boundary of the prompt and at the junction (a block lower too with EAGLE, unless
        `junction_ignores_eagle`: vLLM 0.32.0), each run
        ending a block further with EAGLE; with a positive interval also the last `need`
        blocks of every interval-long segment.

        With groups of several block sizes (`alignment_blocks` S / B > 1) boundaries round
        down to S, and with no interval only the last `need` blocks of each S-token segment are
        cached (all when a segment is no longer than `need` blocks).

        Complexity: O(end - first + need).
        """
        block_size = self.block_size
        eagle = self.use_eagle
        shift = 1 if eagle else 0
        need = (
            self.eagle_contiguous_blocks if eagle else self.sliding_window_contiguous_blocks
        ) or 1
        interval = self.retention_interval
        align = self.alignment_blocks
        if interval is None:  # dense, only with alignment (else not `sparse`)
            if need >= align:
                return [True] * (end - first)
            return [i % align >= align - need for i in range(first, end)]
        if interval:
            per_segment = interval // block_size
            if need >= per_segment:
                return [True] * (end - first)
            low = per_segment - need
            mask = [i >= shift and (i - shift) % per_segment >= low for i in range(first, end)]
        else:
            mask = [False] * (end - first)
        num_prompt = request.num_prompt_tokens
        if eagle:
            resend = (num_prompt - 1) // block_size * block_size
            extension = num_prompt // block_size * block_size
            boundaries = [max(resend - block_size, 0), max(extension - block_size, 0)]
        else:
            boundaries = [num_prompt - 1]
        if junction:
            boundaries.append(junction)
            if eagle and not self.junction_ignores_eagle:
                boundaries.append(junction - block_size)
        aligned_to = align * block_size
        for boundary in boundaries:
            tail_end = boundary // aligned_to * align + shift
            for i in range(max(first, tail_end - need), min(end, tail_end)):
                mask[i - first] = True
        return mask

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """The blocks wholly before token `num_computed_tokens - sliding_window + 1`
        (`first_useful_block`). Complexity: O(1)."""
        return first_useful_block(num_computed_tokens, self.sliding_window, self.block_size)
