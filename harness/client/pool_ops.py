"""The block pool's client moves, as plain replayable records.

As for the manager (`harness/client/manager_ops.py`), operations name what they act on by an
index taken modulo the candidates at execution time and carry sizes that execution clamps, so
any subsequence of a run still executes (block ids too are taken modulo the pool's size).
"""

from __future__ import annotations

from typing import NamedTuple


class NewBlocks(NamedTuple):
    """get_new_blocks of at most `num_blocks` blocks (clamped to the free count)."""

    num_blocks: int


class Touch(NamedTuple):
    """touch of these block ids (taken modulo the pool size), as a list or as an iterator."""

    block_ids: tuple[int, ...]
    as_iterator: bool = False


class FreeSome(NamedTuple):
    """free_blocks of distinct held blocks (and maybe the null block), picked by index."""

    picks: tuple[int, ...]


class FreeAll(NamedTuple):
    """Release every held reference, in rounds of distinct blocks, shuffled by `order`."""

    order: int


class NewRequest(NamedTuple):
    """A request: `tokens` after `follow_len` tokens of earlier request `follow` (-1: none),
    with its extra keys when `follow` is set, else LoRA id, multimodal input and salt here."""

    tokens: tuple[int, ...]
    follow: int
    follow_len: int
    lora: int | None
    mm: tuple[tuple[int, int, str], ...]
    salt: str | None


class Admit(NamedTuple):
    """What a manager does for a new request: look its prefix up, touch the hits, allocate the
    rest, cache its full blocks. Skipped when it does not fit."""

    request: NewRequest


class Hit(NamedTuple):
    """Look a request's prefix up and touch the hits: a sequence holding only its hits."""

    request: NewRequest


class Adopt(NamedTuple):
    """A sequence for `request` over held blocks picked by index (distinct, in pick order),
    with the first `num_stored` of its block hashes already stored (as after a preemption)."""

    request: NewRequest
    picks: tuple[int, ...]
    num_stored: int


class Grow(NamedTuple):
    """Sequence `which` gets `tokens` more tokens and the blocks they need (if free), then its
    full blocks are cached."""

    which: int
    tokens: tuple[int, ...]


class CacheBlocks(NamedTuple):
    """cache_full_blocks of sequence `which` up to at most `num_full` blocks."""

    which: int
    num_full: int


class Finish(NamedTuple):
    """Free sequence `which`'s held blocks, tail first, and drop it."""

    which: int


class Lookup(NamedTuple):
    """get_cached_block of a recently seen hash (`pick`), or of a made-up one."""

    pick: int


class Reset(NamedTuple):
    """reset_prefix_cache()."""


class TakeEvents(NamedTuple):
    """take_events(): drain both pools' KV cache event queues (runs with events on)."""


class Misuse(NamedTuple):
    """An invalid call of kind `kind` (`harness/client/pool.py`: `MISUSE`); `arg` picks the
    variant and its arguments."""

    kind: str
    arg: int


PoolOp = (
    NewBlocks
    | Touch
    | FreeSome
    | FreeAll
    | Admit
    | Hit
    | Adopt
    | Grow
    | CacheBlocks
    | Finish
    | Lookup
    | Reset
    | TakeEvents
    | Misuse
)
