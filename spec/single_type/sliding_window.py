"""Sliding window, stated plainly: a token reads itself and the `sliding_window - 1` tokens
before it, so a hit needs only its last window cached, and blocks that fell out of the window
are dropped for the null block."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedkv.spec import retention
from pagedkv.spec.block_counts import ceil_div
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import SlidingWindowSpec
from pagedkv.vocab.refusals import window_hit_detail
from pagedkv.vocab.request import Request


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


class SlidingWindow(SpecSingleTypeManager):
    """A token reads itself and the `sliding_window - 1` tokens before it. For EAGLE
    (`for_eagle`) a hit is found for a window one block wider (its run of cached blocks one
    longer), so that the hit keeps a whole window of cached blocks after EAGLE drops its last."""

    kind = "sliding window"
    allows_null_blocks = True  # positions outside the window hold the null block

    def __init__(self, spec: SlidingWindowSpec, pool: SpecBlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.sliding_window = spec.sliding_window
        # Groups of several block sizes with caching: hits end on multiples of S (set by the
        # manager; None otherwise), and a window of smaller blocks caches only what they read.
        self.alignment: int | None = None

    def _window(self, for_eagle: bool) -> int:
        return self.sliding_window + self.block_size if for_eagle else self.sliding_window

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: the window holds it and the
        `sliding_window - 1` tokens before it."""
        return max(position - self.sliding_window + 1, 0)

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        return sliding_window_hit(lookup, block_hashes, self._window(for_eagle), self.block_size)

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """A hit with null blocks has the shape `sliding_window_hit` gives it: the nulls first,
        then a window of cached blocks (one fewer with EAGLE, which drops the hit's last)."""
        if NULL_BLOCK_ID not in hits:
            return None
        nulls = list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hits))
        cached = hits[len(nulls) :]
        window = self._window(for_eagle)
        needed = contiguous_blocks_needed(window, self.block_size) - int(use_eagle)
        if NULL_BLOCK_ID in cached or len(cached) < needed:
            return window_hit_detail(len(nulls), len(cached), needed)
        return None

    def num_skipped(self, num_computed_tokens: int) -> int:
        return sliding_window_skipped(num_computed_tokens, self.sliding_window, self.block_size)

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """The window's `sliding_window - 1` earlier tokens and the tokens in flight (never more
        than max_model_len), plus one block: a window may start inside a block."""
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return ceil_div(num_tokens, self.block_size) + 1

    def retained(self, request: Request, junction: int, positions: range) -> list[bool] | None:
        """`pagedkv.spec.retention`'s rule for this window: a hit's run is the window's blocks,
        one more with EAGLE."""
        aligned = self.alignment is not None and self.alignment != self.block_size
        if self.retention_interval is None and not aligned:
            return None
        return retention.retained(
            positions,
            interval=self.retention_interval,
            boundaries=retention.reachable_boundaries(
                request.num_prompt_tokens,
                junction,
                self.block_size,
                self.use_eagle,
                self.junction_ignores_eagle,
            ),
            need=contiguous_blocks_needed(self._window(self.use_eagle), self.block_size),
            block_size=self.block_size,
            use_eagle=self.use_eagle,
            alignment=self.alignment,
        )

    def replay_tail(self, request: Request) -> set[int]:
        if self.retention_interval is None:
            return set()
        need = contiguous_blocks_needed(self._window(self.use_eagle), self.block_size)
        boundaries = retention.replay_boundaries(
            request.num_prompt_tokens, self.block_size, self.use_eagle
        )
        return {
            position
            for boundary in boundaries
            for position in retention.boundary_tail(
                boundary, need, self.block_size, self.use_eagle, self.alignment
            )
        }
