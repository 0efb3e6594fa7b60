"""How many blocks one `allocate_slots` step requires, allocates and caches, and whether it fits.

Pure integer functions, so that CrossHair can check their contracts
(`proofs/crosshair/contracts.py`) and compare them with the spec's brute-force twins
(`pagedkv.spec.block_counts`). With B tokens a block, a step that schedules `num_tokens` tokens
(speculative ones included) after `num_computed_tokens`:

    | computed | new (this step), speculative last | lookahead |
    |<----------- required: cdiv(all of them, B) ----------->|
    |<--- full: (computed + new - spec) // B --->|     speculative tokens are never cached

All arguments are token or block counts; the manager checks its preconditions (`block_size >= 1`,
no negative counts) before calling these. `cdiv` is pagedkv's one ceiling division.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of `a / b` for b > 0, in integers: the blocks of b tokens that hold a tokens.

    Complexity: O(1).
    """
    return -(-a // b)


def num_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int:
    """Blocks that hold every computed, scheduled and lookahead slot: the least n with n * B >= all.

    Complexity: O(1).
    """
    return cdiv(num_computed_tokens + num_tokens + num_lookahead_tokens, block_size)


def num_new_blocks(num_required: int, num_held: int, num_hits: int) -> int:
    """Blocks to allocate after the held blocks and the prefix hits; <= 0 means none.

    Complexity: O(1).
    """
    return num_required - num_held - num_hits


def fits(num_new: int, num_free: int, num_evictable_hits: int) -> bool:
    """Whether `num_new` blocks can be allocated once the hits are touched.

    Touching a hit whose ref_cnt is 0 takes it off the free queue, so those hits do not count as
    free. A step that allocates nothing (num_new <= 0) always fits, since 0 <= evictable <= free.

    Complexity: O(1).
    """
    return num_new <= num_free - num_evictable_hits


def num_full_blocks(
    num_computed_tokens: int, num_tokens: int, num_spec_tokens: int, block_size: int
) -> int:
    """Full blocks after the step, speculative tokens excluded: the blocks that get cached.

    Complexity: O(1).
    """
    return (num_computed_tokens + num_tokens - num_spec_tokens) // block_size
