"""Attention-type policies: which cached blocks a request may reuse, and which it may drop.

Full attention reuses the longest cached prefix and keeps every block. Sliding window needs only
the last window of blocks to be cached, and frees blocks that fell out of the window, putting the
null block in their place so block-table positions stay fixed. Chunked local attention needs only
the blocks of the next token's chunk, and frees the blocks of earlier chunks the same way.
`pagedkv.spec.attention` states what each scan must find, by brute force.

Each policy serves one KV cache group of the pool (`group_id`, 0 for a single-group manager) and
looks blocks up under that group's keys (`pagedkv.vocab.hashes.cache_key`). Its
`find_longest_cache_hit` is the longest hit within the hashes it is given, so a hybrid manager
can ask again for a shorter prefix until every group allows it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_counts import cdiv
from pagedkv.block_pool import BlockPool
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.vocab.refusals import chunk_hit_detail, window_hit_detail

_new_tuple = tuple.__new__  # GroupKey(group, hash) without the NamedTuple's Python-level __new__
T = TypeVar("T")


class SpecializedManager(ABC):
    """The policy of one attention type over a shared block pool, for one KV cache group.

    Attributes:
        allows_null_blocks: whether a request's block list may start with null blocks
            (positions the attention no longer reads); a hit may then start with them too.
        group_id: the KV cache group whose blocks it looks up (0 for a single-group manager).
    """

    allows_null_blocks: ClassVar[bool]

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int = 0
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.null_block = block_pool.null_block
        self.group_id = group_id

    def cached_block(self, block_hash: BlockHashType) -> KVCacheBlock | None:
        """The block cached for this group under `block_hash`, or None. Complexity: O(1)."""
        key: CacheKey = (
            _new_tuple(GroupKey, (self.group_id, block_hash)) if self.group_id else block_hash
        )
        return self.block_pool.cached_block(key)

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

    def for_eagle(self) -> SpecializedManager:
        """The policy whose hit, less its last block, is an EAGLE hit (this one, unless a
        window must stay whole: `SlidingWindowManager.for_eagle`). Complexity: O(1)."""
        return self

    @abstractmethod
    def scan_hit(self, num_blocks: int, lookup: Callable[[int], T | None], null: T) -> list[T]:
        """`find_longest_cache_hit` over any lookup: `lookup(i)` is what position i holds
        cached (None: not cached), `null` stands for a skipped position (several groups looked
        up together pass a list of blocks per position). Complexity: O(num_blocks) lookups."""


class FullAttentionManager(SpecializedManager):
    """Every earlier token is attended to: reuse the cached prefix, never drop a block."""

    allows_null_blocks = False

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The cached prefix: chained hashes make every block after the first miss a miss too."""
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

    def scan_hit(self, num_blocks: int, lookup: Callable[[int], T | None], null: T) -> list[T]:
        """The cached prefix (`find_longest_cache_hit`'s). Complexity: O(num_blocks)."""
        hits = []
        for i in range(num_blocks):
            cached = lookup(i)
            if cached is None:
                break
            hits.append(cached)
        return hits

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Nothing is skipped. Complexity: O(1)."""
        return []


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

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int = 0
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
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
        get_cached_block = self.block_pool.cached_block if not self.group_id else self.cached_block
        return self.scan_hit(
            len(block_hashes), lambda i: get_cached_block(block_hashes[i]), self.null_block
        )

    def scan_hit(self, num_blocks: int, lookup: Callable[[int], T | None], null: T) -> list[T]:
        """`scan_window_hit` for this window. Complexity: O(num_blocks)."""
        return scan_window_hit(num_blocks, self.sliding_window_contiguous_blocks, lookup, null)

    def for_eagle(self) -> SlidingWindowManager:
        """The policy of a window one block wider: its hit ends in one more cached block, which
        EAGLE then drops, so that a whole window of cached blocks stays. Complexity: O(1)."""
        spec = self.kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec)
        wider = SlidingWindowSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            sliding_window=spec.sliding_window + spec.block_size,
            use_mla=spec.use_mla,
        )
        return SlidingWindowManager(wider, self.block_pool, self.group_id)

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


def chunk_start_block(num_tokens: int, attention_chunk_size: int, block_size: int) -> int:
    """The position of the block holding the first token of the chunk of token `num_tokens`:
    every block before it holds tokens of earlier chunks only.

    Complexity: O(1).
    """
    return num_tokens // attention_chunk_size * attention_chunk_size // block_size


def scan_chunk_hit(
    num_blocks: int,
    attention_chunk_size: int,
    block_size: int,
    lookup: Callable[[int], T | None],
    null: T,
) -> list[T]:
    """The longest hit of at most `num_blocks` blocks for chunked local attention.

    A hit of L blocks lets the request compute from token L * B on, which reads its own chunk
    only: L is valid iff positions `chunk_start_block(L * B)` to L - 1 are cached (`lookup(i)`
    is the block cached for position i, or None); the positions before are `null`. The Ls that
    share a chunk start s form one range [lo, hi], and the longest valid one among them is
    min(hi, s + the run of hits from s) if that reaches lo. So the ranges are tried from the
    top, each by one forward scan from its chunk start that stops at the first miss; the ranges'
    scans do not overlap. L = 0 is always valid.

        C = 8, B = 4:  lookup: hit  miss  hit  hit  miss   (num_blocks = 5)
        L in [4, 5] (s = 4): position 4 misses, so L = 4 would need s + 0 >= 4: valid
        result:  null  null  null  null

    Complexity: O(num_blocks) lookups at most.
    """
    top = num_blocks
    while top > 0:
        chunk = top * block_size // attention_chunk_size
        start = chunk * attention_chunk_size // block_size  # chunk_start_block(top * B)
        lowest = -(-chunk * attention_chunk_size // block_size)  # the least L in this chunk
        found: list[T] = []
        for position in range(start, top):
            block = lookup(position)
            if block is None:
                break
            found.append(block)
        if start + len(found) >= lowest:
            return [null] * start + found
        top = lowest - 1
    return []


class ChunkedLocalAttentionManager(SpecializedManager):
    """A token attends to the tokens of its own chunk of `attention_chunk_size` tokens only.

    Positions whose blocks hold only tokens of earlier chunks than the next token's hold the
    null block, a prefix of every block list, as under a sliding window.

    Layout of a hit with block size 4 and chunk size 8, 3 hashes (token 12 reads tokens 8..11):

        hashes:  h0    h1    h2
        cached:  no    yes   yes
        result:  NULL  NULL  b2          (block 2 starts token 12's chunk)
    """

    allows_null_blocks = True

    def __init__(
        self, kv_cache_spec: ChunkedLocalAttentionSpec, block_pool: BlockPool, group_id: int = 0
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHashType]) -> list[KVCacheBlock]:
        """The longest hit within `block_hashes` (`scan_chunk_hit`): the nulls of the earlier
        chunks, then the cached blocks of its last chunk.

        Complexity: O(len(block_hashes)).
        """
        get_cached_block = self.block_pool.cached_block if not self.group_id else self.cached_block
        return self.scan_hit(
            len(block_hashes), lambda i: get_cached_block(block_hashes[i]), self.null_block
        )

    def scan_hit(self, num_blocks: int, lookup: Callable[[int], T | None], null: T) -> list[T]:
        """`scan_chunk_hit` for this chunk size. Complexity: O(num_blocks)."""
        return scan_chunk_hit(num_blocks, self.attention_chunk_size, self.block_size, lookup, null)

    def hit_shape_error(self, hits: Sequence[KVCacheBlock], use_eagle: bool) -> str | None:
        """A hit is the nulls of the chunks before its end's chunk, then cached blocks: exactly
        its first `chunk_start_block(len(hits) * B)` positions are null.

        Complexity: O(len(hits)).
        """
        null_block = self.null_block
        num_nulls = 0
        while num_nulls < len(hits) and hits[num_nulls] is null_block:
            num_nulls += 1
        expected = min(
            chunk_start_block(
                len(hits) * self.block_size, self.attention_chunk_size, self.block_size
            ),
            len(hits),
        )
        if num_nulls != expected or any(block is null_block for block in hits[num_nulls:]):
            return chunk_hit_detail(num_nulls, len(hits), expected)
        return None

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Null out the blocks before the one holding the first token of the next token's chunk
        (`chunk_start_block(num_computed_tokens)`).

        Scans from the newest such block back to the first null block (the nulls before it were
        set by earlier calls).

        Returns:
            The replaced blocks, newest first.

        Complexity: O(number of blocks replaced).
        """
        first_useful = chunk_start_block(
            num_computed_tokens, self.attention_chunk_size, self.block_size
        )
        null_block = self.null_block
        removed = []
        for i in range(first_useful - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            removed.append(block)
            blocks[i] = null_block
        return removed
