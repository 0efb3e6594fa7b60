"""Spec/impl twins for `crosshair diffbehavior`: each pair must behave the same on every input.

`crosshair diffbehavior` ignores preconditions, so each wrapper first applies the pair's domain
(the same function on both sides) and returns None outside it; inside, the impl side calls the
implementation the way the library does, and the spec side calls the spec's plain definition.
Both are reached through their modules, so a planted bug (`proofs.crosshair.planted`) replaces
what the wrapper calls. Arguments are ints, bools and lists or tuples of them, so that the
runner can evaluate the inputs CrossHair prints and replay them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv import block_counts as impl_counts
from pagedkv import block_hash as impl_hash
from pagedkv.single_type import chunked_local as impl_chunk
from pagedkv.single_type import sliding_window as impl_window
from pagedkv.spec import block_counts as spec_counts
from pagedkv.spec import block_hash as spec_hash
from pagedkv.spec.block_pool import NULL_BLOCK_ID
from pagedkv.spec.single_type import chunked_local as spec_chunk
from pagedkv.spec.single_type import sliding_window as spec_window
from proofs.crosshair.contracts import MAX_BLOCKS, MAX_INPUTS

StepCounts = tuple[int, int, int, bool]
"""(required, new, full, fits) of one allocate_slots step."""


def _step_domain(block_size: int) -> bool:
    return block_size >= 1


def impl_num_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int | None:
    """Ceiling division the impl's way (negated floor division), on any ints."""
    if not _step_domain(block_size):
        return None
    return impl_counts.num_required_blocks(
        num_computed_tokens, num_tokens, num_lookahead_tokens, block_size
    )


def spec_num_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int | None:
    """Whole blocks plus one for a partial block, the spec's way."""
    if not _step_domain(block_size):
        return None
    return spec_counts.num_required_blocks(
        num_computed_tokens, num_tokens, num_lookahead_tokens, block_size
    )


def impl_allocation_step(
    num_held: int,
    num_hits: int,
    num_computed_tokens: int,
    num_tokens: int,
    num_spec_tokens: int,
    num_free: int,
    num_evictable_hits: int,
    block_size: int,
) -> StepCounts | None:
    """The counts `KVCacheManager.allocate_slots` derives for one step."""
    if not _step_domain(block_size):
        return None
    computed = num_computed_tokens + num_hits * block_size
    required = impl_counts.num_required_blocks(computed, num_tokens, 0, block_size)
    new = impl_counts.num_new_blocks(required, num_held, num_hits)
    full = impl_counts.num_full_blocks(computed, num_tokens, num_spec_tokens, block_size)
    return required, new, full, impl_counts.fits(new, num_free, num_evictable_hits)


def spec_allocation_step(
    num_held: int,
    num_hits: int,
    num_computed_tokens: int,
    num_tokens: int,
    num_spec_tokens: int,
    num_free: int,
    num_evictable_hits: int,
    block_size: int,
) -> StepCounts | None:
    """The counts `SpecKVCacheManager.allocate_slots` derives for one step."""
    if not _step_domain(block_size):
        return None
    computed = num_computed_tokens + num_hits * block_size
    required = spec_counts.num_required_blocks(computed, num_tokens, 0, block_size)
    new = spec_counts.num_new_blocks(required, num_held, num_hits)
    full = spec_counts.num_full_blocks(computed, num_tokens, num_spec_tokens, block_size)
    return required, new, full, spec_counts.fits(new, num_free, num_evictable_hits)


def _window_domain(num_computed_tokens: int, sliding_window: int, block_size: int) -> bool:
    return num_computed_tokens >= 0 and sliding_window >= 1 and block_size >= 1


def _pattern_domain(cached: list[bool], sliding_window: int, block_size: int) -> bool:
    return len(cached) <= MAX_BLOCKS and _window_domain(0, sliding_window, block_size)


def impl_window_skipped(
    num_computed_tokens: int, sliding_window: int, block_size: int
) -> int | None:
    """How many leading positions `remove_skipped_blocks` visits: range(first useful block)."""
    if not _window_domain(num_computed_tokens, sliding_window, block_size):
        return None
    return len(
        range(impl_window.first_useful_block(num_computed_tokens, sliding_window, block_size))
    )


def spec_window_skipped(
    num_computed_tokens: int, sliding_window: int, block_size: int
) -> int | None:
    """The spec's count of positions wholly before the next token's window."""
    if not _window_domain(num_computed_tokens, sliding_window, block_size):
        return None
    return spec_window.sliding_window_skipped(num_computed_tokens, sliding_window, block_size)


def impl_window_hit(
    cached: list[bool], sliding_window: int, block_size: int
) -> tuple[int, int] | None:
    """(length, first hit position) of `SlidingWindowManager.find_longest_cache_hit` over the
    hit pattern, the null block standing for skipped positions."""
    if not _pattern_domain(cached, sliding_window, block_size):
        return None
    null = -1
    hits = impl_window.scan_window_hit(
        len(cached),
        impl_window.num_window_blocks(sliding_window, block_size),
        lambda position: position if cached[position] else None,
        null,
    )
    return len(hits), sum(1 for block in hits if block == null)


def spec_window_hit(
    cached: list[bool], sliding_window: int, block_size: int
) -> tuple[int, int] | None:
    """(length, first hit position) of the spec's usable prefix of the hit pattern."""
    if not _pattern_domain(cached, sliding_window, block_size):
        return None
    return spec_window.sliding_window_usable_prefix(cached, sliding_window, block_size)


# -- chunked local attention -------------------------------------------------------------------


def _chunk_domain(cached: list[bool], attention_chunk_size: int, block_size: int) -> bool:
    return len(cached) <= MAX_BLOCKS and attention_chunk_size >= 1 and block_size >= 1


def impl_chunk_hit(
    cached: list[bool], attention_chunk_size: int, block_size: int
) -> tuple[int, int] | None:
    """(length, null positions) of `ChunkedLocalAttentionManager.find_longest_cache_hit` over
    the hit pattern (`scan_chunk_hit`: a forward scan per chunk, from the top)."""
    if not _chunk_domain(cached, attention_chunk_size, block_size):
        return None
    null = -1
    hits = impl_chunk.scan_chunk_hit(
        len(cached),
        attention_chunk_size,
        block_size,
        lambda position: position if cached[position] else None,
        null,
    )
    return len(hits), sum(1 for block in hits if block == null)


def spec_chunk_hit(
    cached: list[bool], attention_chunk_size: int, block_size: int
) -> tuple[int, int] | None:
    """(length, null positions) of the spec's brute force over every length, longest first."""
    if not _chunk_domain(cached, attention_chunk_size, block_size):
        return None
    positions: list[Any] = list(range(len(cached)))  # the hashes: each position its own

    def lookup(position: Any) -> int | None:
        return position + 1 if cached[position] else None  # block ids from 1: 0 is the null

    hits = spec_chunk.chunked_local_hit(lookup, positions, attention_chunk_size, block_size)
    return len(hits), sum(1 for block in hits if block == NULL_BLOCK_ID)


def _mm_domain(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Placeholder ranges as `Request` accepts them, and a non-empty block at a position >= 0."""
    return (
        len(ranges) <= MAX_INPUTS
        and 0 <= start < end
        and all(offset >= 0 and length >= 1 for offset, length in ranges)
        and all(
            a_offset + a_length <= b_offset
            for (a_offset, a_length), (b_offset, _) in itertools.pairwise(ranges)
        )
    )


def impl_mm_inputs(ranges: list[tuple[int, int]], start: int, end: int) -> list[int] | None:
    """The inputs `hash_request_tokens` keys the block with (a scan from input 0)."""
    if not _mm_domain(ranges, start, end):
        return None
    return impl_hash.mm_inputs_in_block(ranges, start, end, 0)[0]


def spec_mm_inputs(ranges: list[tuple[int, int]], start: int, end: int) -> list[int] | None:
    """The inputs that share a token with the block."""
    if not _mm_domain(ranges, start, end):
        return None
    return spec_hash.mm_inputs_in_block(ranges, start, end)


def impl_vllm_mm_inputs(ranges: list[tuple[int, int]], start: int, end: int) -> list[int] | None:
    """The inputs `cache_full_blocks` keys a block with under vLLM 0.8.5 semantics (a scan from
    the last input, touching inputs included), as `BlockPool.cache_full_blocks` calls it."""
    if not _mm_domain(ranges, start, end):
        return None
    first_idx = max(len(ranges) - 1, 0)
    return impl_hash.mm_inputs_in_block(ranges, start, end, first_idx, True)[0]


def spec_vllm_mm_inputs(ranges: list[tuple[int, int]], start: int, end: int) -> list[int] | None:
    """The spec's statement of vLLM 0.8.5's choice (difference 6)."""
    if not _mm_domain(ranges, start, end):
        return None
    return spec_hash.vllm_mm_inputs_in_block(ranges, start, end)


# -- the registry the runner reads -------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """An impl wrapper, its spec twin, and concrete inputs inside the domain (not vacuous)."""

    impl: Callable[..., object]
    spec: Callable[..., object]
    examples: tuple[tuple[object, ...], ...]

    @property
    def name(self) -> str:
        return self.impl.__name__.removeprefix("impl_")


PAIRS: tuple[Pair, ...] = (
    Pair(impl_num_required_blocks, spec_num_required_blocks, ((5, 3, 2, 4), (0, 1, 0, 1))),
    Pair(impl_allocation_step, spec_allocation_step, ((0, 2, 0, 3, 1, 4, 1, 4),)),
    Pair(impl_window_skipped, spec_window_skipped, ((10, 4, 2), (3, 8, 4))),
    Pair(impl_window_hit, spec_window_hit, (([True, False, True, True], 8, 4),)),
    Pair(
        impl_chunk_hit,
        spec_chunk_hit,
        (([False, True, True, True], 8, 4), ([True, False, True], 6, 4)),
    ),
    Pair(impl_mm_inputs, spec_mm_inputs, (([(0, 3), (5, 2)], 2, 6),)),
    Pair(impl_vllm_mm_inputs, spec_vllm_mm_inputs, (([(0, 4)], 4, 8), ([(0, 4)], 5, 8))),
)
