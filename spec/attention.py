"""Which cached blocks a request may reuse, and which it may drop: plain definitions.

The implementation scans cleverly (left to right until a miss; right to left until a long enough
run); these definitions say what the scans must find, by brute force over candidate lengths.
`FullAttention`, `SlidingWindow` and `ChunkedLocalAttention` gather them into the policy the
spec managers ask. Each policy's `longest_hit` is the longest hit it allows among the hashes it
is given (a prefix of the request's), so a hybrid manager can shorten the prefix until every
group allows it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from pagedkv.spec.block_counts import ceil_div
from pagedkv.spec.block_pool import NULL_BLOCK_ID
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.refusals import chunk_hit_detail, window_hit_detail

Lookup = Callable[[BlockHashType], "int | None"]
"""The first block cached under a hash, or None (the pool's get_cached_block)."""


def full_attention_hit(lookup: Lookup, block_hashes: Sequence[BlockHashType]) -> list[int]:
    """The longest prefix of `block_hashes` whose every hash is cached, as block ids."""
    for length in range(len(block_hashes), -1, -1):
        found = [lookup(block_hash) for block_hash in block_hashes[:length]]
        if all(block_id is not None for block_id in found):
            return [block_id for block_id in found if block_id is not None]
    raise AssertionError("the empty prefix is always cached")


def contiguous_blocks_needed(sliding_window: int, block_size: int) -> int:
    """Cached blocks a sliding-window hit must end with: cdiv(W - 1, B), but at least 1.

    The token being computed is in its own window, so the cached part covers W - 1 tokens.
    """
    return max(ceil_div(sliding_window - 1, block_size), 1)


def sliding_window_usable_prefix(
    cached: Sequence[bool], sliding_window: int, block_size: int
) -> tuple[int, int]:
    """The longest usable prefix of a hit pattern, as (length, first cached position).

    `cached[i]` says whether block i's hash is cached. A prefix of length L is usable if its last
    `contiguous_blocks_needed` positions are all cached (only they are inside the window of token
    L * B); positions before them are skipped. If no prefix is usable that way, the longest
    prefix that is entirely cached is (skipping nothing).
    """
    needed = contiguous_blocks_needed(sliding_window, block_size)
    for length in range(len(cached), needed - 1, -1):
        if all(cached[length - needed : length]):
            return length, length - needed
    length = 0
    while length < len(cached) and cached[length]:
        length += 1
    return length, 0


def sliding_window_hit(
    lookup: Lookup, block_hashes: Sequence[BlockHashType], sliding_window: int, block_size: int
) -> list[int]:
    """The usable prefix of the hashes' blocks (`sliding_window_usable_prefix`), skipped
    positions as the null block."""
    found = [lookup(block_hash) for block_hash in block_hashes]
    length, first = sliding_window_usable_prefix(
        [block_id is not None for block_id in found], sliding_window, block_size
    )
    return [NULL_BLOCK_ID] * first + [b for b in found[first:length] if b is not None]


def sliding_window_skipped(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """How many leading block positions lie wholly before the window of the next token.

    The next token's window starts at token `num_computed_tokens - sliding_window + 1`; block p
    covers tokens [p * B, (p + 1) * B), so it is skipped iff (p + 1) * B <= that start. Only the
    blocks that hold a token before that start can be skipped; count those that qualify.
    """
    first_useful_token = num_computed_tokens - sliding_window + 1
    candidates = range(ceil_div(max(first_useful_token, 0), block_size))
    return sum(1 for p in candidates if (p + 1) * block_size <= first_useful_token)


def chunk_start_block(num_tokens: int, attention_chunk_size: int, block_size: int) -> int:
    """The first block position the token at `num_tokens` reads: the one holding the first
    token of its chunk, `num_tokens // C * C`. Every block before it lies in earlier chunks."""
    return num_tokens // attention_chunk_size * attention_chunk_size // block_size


def chunked_local_hit(
    lookup: Lookup,
    block_hashes: Sequence[BlockHashType],
    attention_chunk_size: int,
    block_size: int,
) -> list[int]:
    """The longest hit within `block_hashes` for chunked local attention, as block ids.

    A hit of L blocks lets the request compute from token L * B on; that token reads only its
    own chunk, so the hit is valid iff every block from its chunk's first block to L - 1 is
    cached, the blocks before it standing as null blocks. The longest valid L is found by trying
    every L from the longest down (L = 0 is always valid).
    """
    for length in range(len(block_hashes), -1, -1):
        first = min(
            chunk_start_block(length * block_size, attention_chunk_size, block_size), length
        )
        found = [lookup(block_hash) for block_hash in block_hashes[first:length]]
        if all(block_id is not None for block_id in found):
            return [NULL_BLOCK_ID] * first + [b for b in found if b is not None]
    raise AssertionError("the empty hit is always valid")


def chunked_local_skipped(
    num_computed_tokens: int, attention_chunk_size: int, block_size: int
) -> int:
    """How many leading block positions hold only tokens of chunks before the next token's."""
    return chunk_start_block(num_computed_tokens, attention_chunk_size, block_size)


class FullAttention:
    """Every earlier token is attended to: the cached prefix is reused, no block is dropped."""

    allows_null_blocks = False  # a block list never holds the null block
    kind = "full attention"

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: every earlier one."""
        return 0

    def longest_hit(self, lookup: Lookup, block_hashes: Sequence[BlockHashType]) -> list[int]:
        return full_attention_hit(lookup, block_hashes)

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Leading positions the next token no longer reads: none."""
        return 0

    def for_eagle(self) -> FullAttention:
        """The policy whose hit, less its last block, is an EAGLE hit: this one."""
        return self

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool) -> str | None:
        """Any run of cached blocks is a hit (null blocks are refused before this is asked)."""
        return None


class SlidingWindow:
    """A token reads itself and the `sliding_window - 1` tokens before it."""

    allows_null_blocks = True  # positions outside the window hold the null block
    kind = "sliding window"

    def __init__(self, sliding_window: int, block_size: int) -> None:
        self.sliding_window = sliding_window
        self.block_size = block_size

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: the window holds it and the
        `sliding_window - 1` tokens before it."""
        return max(position - self.sliding_window + 1, 0)

    def longest_hit(self, lookup: Lookup, block_hashes: Sequence[BlockHashType]) -> list[int]:
        return sliding_window_hit(lookup, block_hashes, self.sliding_window, self.block_size)

    def num_skipped(self, num_computed_tokens: int) -> int:
        return sliding_window_skipped(num_computed_tokens, self.sliding_window, self.block_size)

    def for_eagle(self) -> SlidingWindow:
        """The policy whose hit, less its last block, is an EAGLE hit: a window one block wider
        (its run of cached blocks one longer), so that the hit keeps a whole window of cached
        blocks after EAGLE drops its last."""
        return SlidingWindow(self.sliding_window + self.block_size, self.block_size)

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool) -> str | None:
        """A hit with null blocks has the shape `sliding_window_hit` gives it: the nulls first,
        then a window of cached blocks (one fewer with EAGLE, which drops the hit's last)."""
        if NULL_BLOCK_ID not in hits:
            return None
        nulls = list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hits))
        cached = hits[len(nulls) :]
        needed = contiguous_blocks_needed(self.sliding_window, self.block_size) - int(use_eagle)
        if NULL_BLOCK_ID in cached or len(cached) < needed:
            return window_hit_detail(len(nulls), len(cached), needed)
        return None


AttentionPolicy = FullAttention | SlidingWindow


class ChunkedLocalAttention:
    """A token reads the tokens of its own chunk of `attention_chunk_size` tokens only."""

    allows_null_blocks = True  # positions of earlier chunks hold the null block
    kind = "chunked local attention"

    def __init__(self, attention_chunk_size: int, block_size: int) -> None:
        self.attention_chunk_size = attention_chunk_size
        self.block_size = block_size

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: its chunk's first."""
        return position // self.attention_chunk_size * self.attention_chunk_size

    def longest_hit(self, lookup: Lookup, block_hashes: Sequence[BlockHashType]) -> list[int]:
        return chunked_local_hit(lookup, block_hashes, self.attention_chunk_size, self.block_size)

    def num_skipped(self, num_computed_tokens: int) -> int:
        return chunked_local_skipped(
            num_computed_tokens, self.attention_chunk_size, self.block_size
        )

    def for_eagle(self) -> ChunkedLocalAttention:
        """EAGLE with chunked local attention is refused (`check_hybrid_manager`): this one."""
        return self

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool) -> str | None:
        """A hit is the nulls of the earlier chunks, then cached blocks: exactly the positions
        before its end's chunk are null."""
        nulls = list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hits))
        expected = min(
            chunk_start_block(
                len(hits) * self.block_size, self.attention_chunk_size, self.block_size
            ),
            len(hits),
        )
        if len(nulls) != expected or NULL_BLOCK_ID in hits[len(nulls) :]:
            return chunk_hit_detail(len(nulls), len(hits), expected)
        return None


AnyAttentionPolicy = FullAttention | SlidingWindow | ChunkedLocalAttention
