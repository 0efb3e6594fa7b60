"""Block counts of one allocation step, defined the plain way.

`pagedkv.block_counts` computes the same numbers; these definitions say what they mean (whole
blocks, plus one for a partial block), and `proofs/crosshair/runner.py` compares the two with
`crosshair diffbehavior`.
"""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """The blocks that hold `a` tokens, `b` a block: the whole blocks, plus one if tokens remain."""
    assert b > 0, "blocks hold at least one token"
    return a // b + (1 if a % b else 0)


def num_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int:
    """Blocks holding every computed, scheduled and lookahead slot of the request."""
    return ceil_div(num_computed_tokens + num_tokens + num_lookahead_tokens, block_size)


def num_new_blocks(num_required: int, num_held: int, num_hits: int) -> int:
    """Blocks still missing once the held blocks and the prefix hits are counted (<= 0: none)."""
    return num_required - num_held - num_hits


def fits(num_new: int, num_free: int, num_evictable_hits: int) -> bool:
    """Whether the free blocks left after touching the hits (free hits leave the free queue)
    are enough for the new blocks."""
    free_after_touch = num_free - num_evictable_hits
    return num_new <= free_after_touch


def num_full_blocks(
    num_computed_tokens: int, num_tokens: int, num_spec_tokens: int, block_size: int
) -> int:
    """Whole blocks of real (not speculative) tokens after the step: the blocks to cache.

    Floor division, so a step with more speculative tokens than slots yields a negative count,
    which `allocate_slots` refuses (fewer full blocks than cached) when caching is on.
    """
    assert block_size > 0, "blocks hold at least one token"
    return (num_computed_tokens + num_tokens - num_spec_tokens) // block_size
