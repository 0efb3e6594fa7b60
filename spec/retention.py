"""Sparse prefix-cache retention, stated once: which full blocks of a sliding-window group are put
in the prefix cache (vLLM 0.33's `prefix_cache_retention_interval`).

A sliding-window hit of L blocks reads only its last `need` blocks (the window of token L * B;
with EAGLE one block more, which it then drops), so a block that ends no such run at any length
a later lookup can stop at serves no hit. Under sparse retention a sliding-window group caches
only the blocks that can:

- `None`: every full block (dense: what pagedkv did before, vLLM 0.33's `KVCacheConfig`
  default);
- `0`: the `need`-block tail ending at each reachable boundary, and nothing else (vLLM 0.33's
  engine default);
- a positive multiple `R` of the block size: those tails, and the last `need` blocks of every
  `R`-token segment (every block when a segment is no longer than `need` blocks).

The reachable boundaries of a request are where a later request can stop its hit: the request's
replay boundaries (`replay_boundaries`: a resend stops before its last token, a longer sibling
at the prompt's last whole block; with EAGLE one block lower, as its hit drops a block), and
the shared-prefix junction its lookup found (`junction`: where a hybrid hit was cut short
because a sparse group had not cached the prefix another group had; with EAGLE one block
lower too). A boundary `b` (tokens) ends its tail at block `b // B`, one block further with
EAGLE (the block it looks at and drops): the tail is the `need` blocks before that end.

A block retention leaves out is still the request's (it holds it and computes into it); it is
only never indexed, so no later lookup finds it. Full-attention and chunked groups cache every
full block whatever the interval.
"""

from __future__ import annotations

from collections.abc import Sequence


def replay_boundaries(num_prompt_tokens: int, block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """The token positions a later request replaying this prompt can stop its hit at.

    Without EAGLE, `num_prompt_tokens - 1`: a resend leaves its last token out of the lookup,
    and a longer sibling's hit of the same prompt ends at the same block boundary once aligned
    down. With EAGLE the two differ on a prompt of whole blocks (the resend's lookup stops a
    block earlier), and each hit then loses its last block: both positions, a block lower.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // block_size * block_size
    extension = num_prompt_tokens // block_size * block_size
    return tuple(sorted({max(resend - block_size, 0), max(extension - block_size, 0)}))


def reachable_boundaries(
    num_prompt_tokens: int,
    junction: int,
    block_size: int,
    use_eagle: bool,
    junction_ignores_eagle: bool = False,
) -> tuple[int, ...]:
    """The replay boundaries, then the shared-prefix junction (tokens; 0: none), and with
    EAGLE the position a block below it (a sibling that diverges right after the junction
    has no block past it to drop), unless `junction_ignores_eagle` (vLLM 0.32.0)."""
    boundaries = replay_boundaries(num_prompt_tokens, block_size, use_eagle)
    if junction:
        boundaries += (junction,)
        if use_eagle and not junction_ignores_eagle:
            boundaries += (junction - block_size,)
    return boundaries


def boundary_tail(
    boundary: int, need: int, block_size: int, use_eagle: bool, alignment: int | None = None
) -> range:
    """The block positions a hit stopping at token `boundary` reads: the `need` blocks ending at
    block `boundary // B` (EAGLE: one block further, the block it drops). With groups of several
    block sizes hits end on `alignment` (S) tokens: the boundary is rounded down to it first."""
    if alignment is not None:
        boundary -= boundary % alignment
    end = boundary // block_size + int(use_eagle)
    return range(max(end - need, 0), end)


def in_segment_tail(position: int, interval: int, need: int, block_size: int, shift: int) -> bool:
    """Whether block `position` is among the last `need` blocks of its `interval`-token segment
    (segments counted from block `shift`: 1 with EAGLE, whose runs end a block further)."""
    per_segment = interval // block_size
    if need >= per_segment:
        return True
    return position >= shift and (position - shift) % per_segment >= per_segment - need


def retained(
    positions: Sequence[int],
    *,
    interval: int | None,
    boundaries: Sequence[int],
    need: int,
    block_size: int,
    use_eagle: bool,
    alignment: int | None = None,
) -> list[bool]:
    """For each block position, whether a sliding-window group caches it (module docstring).

    With groups of several block sizes (`alignment`: S, hits end on its multiples), a window of
    blocks smaller than S caches only the blocks a hit at such an end reads: its boundaries are
    rounded down to S, and even without an interval (dense) only the last `need` blocks of every
    S-token segment are cached (every block when a segment is no longer than `need` blocks),
    as vLLM 0.33's `reachable_block_mask` does.

    Args:
        positions: the block positions asked about.
        interval: the config's `prefix_cache_retention_interval`.
        boundaries: the request's reachable boundaries (`reachable_boundaries`), in tokens.
        need: cached blocks a hit's run needs (with EAGLE, one more).
        block_size: tokens per block.
        use_eagle: hits drop their last block.
        alignment: S with groups of several block sizes, else None.
    """
    if interval is None:
        if alignment is None or alignment == block_size:
            return [True for _ in positions]
        return [in_segment_tail(p, alignment, need, block_size, 0) for p in positions]
    tails = {
        position
        for boundary in boundaries
        for position in boundary_tail(boundary, need, block_size, use_eagle, alignment)
    }
    shift = int(use_eagle)
    return [
        position in tails
        or (interval > 0 and in_segment_tail(position, interval, need, block_size, shift))
        for position in positions
    ]
