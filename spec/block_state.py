"""The five states of a block and the transitions between them, as data.

A block's state is a function of its ref_cnt and whether it carries a hash; being in the free
queue is not a separate dimension, because the pool keeps "queued iff ref_cnt == 0" invariant.
The table below is the chapter's state diagram (section 5.2.3), with two corrections written out:

* A cache hit on a FREE+CACHED block takes its ref_cnt from 0 to 1: it lands in IN_USE+CACHED,
  not SHARED as the diagram's arrow suggests.
* A FREE+CACHED block handed out again is evicted (its hash cleared): it lands in IN_USE.

At the block-pool level `touch` may also take an unhashed block (FREE -> IN_USE, IN_USE ->
SHARED), so SHARED means "ref_cnt >= 2" with or without a hash; the request-level manager only
touches cached blocks, and its invariants add that a shared block is always cached.
"""

from __future__ import annotations

import enum


class BlockState(enum.Enum):
    __hash__ = object.__hash__  # a member is equal only to itself: hashed as such, at C speed

    FREE = "free"  # ref_cnt 0, no hash: in the free queue
    FREE_CACHED = "free+cached"  # ref_cnt 0, hash: in the free queue and the index (evictable)
    IN_USE = "in use"  # ref_cnt 1, no hash: one request's partial or uncached block
    IN_USE_CACHED = "in use+cached"  # ref_cnt 1, hash: one request's full block, hittable
    SHARED = "shared"  # ref_cnt >= 2: held by several requests


class Event(enum.Enum):
    __hash__ = object.__hash__  # as BlockState's

    ALLOC = "get_new_blocks"  # popped from the queue head (evicted if cached), ref_cnt 0 -> 1
    TOUCH = "touch"  # one more reference (a prefix-cache hit)
    RELEASE = "free_blocks"  # one reference fewer; at 0 the block joins the queue tail
    SEAL = "cache_full_blocks"  # a full block gets its hash and joins the index
    RESET = "reset_prefix_cache"  # every hash forgotten (only when no block is in use)
    EVICT = "evict_blocks"  # a connector takes one block's hash out, where the block stands


def state_of(ref_cnt: int, hashed: bool) -> BlockState:
    """The state of a block with this ref_cnt and hash presence."""
    assert ref_cnt >= 0, "a ref_cnt below 0 has no state: it is a bug"
    if ref_cnt == 0:
        return BlockState.FREE_CACHED if hashed else BlockState.FREE
    if ref_cnt == 1:
        return BlockState.IN_USE_CACHED if hashed else BlockState.IN_USE
    return BlockState.SHARED


S = BlockState
TRANSITIONS: dict[tuple[BlockState, Event], frozenset[BlockState]] = {
    (S.FREE, Event.ALLOC): frozenset({S.IN_USE}),
    (S.FREE_CACHED, Event.ALLOC): frozenset({S.IN_USE}),  # evicted
    (S.FREE, Event.TOUCH): frozenset({S.IN_USE}),  # pool level only
    (S.FREE_CACHED, Event.TOUCH): frozenset({S.IN_USE_CACHED}),  # hit on a freed cached block
    (S.IN_USE, Event.TOUCH): frozenset({S.SHARED}),  # pool level only
    (S.IN_USE_CACHED, Event.TOUCH): frozenset({S.SHARED}),  # hit on another request's block
    (S.SHARED, Event.TOUCH): frozenset({S.SHARED}),
    (S.IN_USE, Event.SEAL): frozenset({S.IN_USE_CACHED}),  # the block became full
    (S.SHARED, Event.SEAL): frozenset({S.SHARED}),  # pool level only
    (S.IN_USE, Event.RELEASE): frozenset({S.FREE}),
    (S.IN_USE_CACHED, Event.RELEASE): frozenset({S.FREE_CACHED}),  # stays hittable
    (S.SHARED, Event.RELEASE): frozenset({S.SHARED, S.IN_USE_CACHED, S.IN_USE}),
    (S.FREE, Event.RESET): frozenset({S.FREE}),
    (S.FREE_CACHED, Event.RESET): frozenset({S.FREE}),
    # evict_blocks: the hash goes, the references and the queue place stay (an unhashed block
    # is passed over). A shared block may so lose its hash: the one way to SHARED without one.
    (S.FREE_CACHED, Event.EVICT): frozenset({S.FREE}),
    (S.IN_USE_CACHED, Event.EVICT): frozenset({S.IN_USE}),
    (S.SHARED, Event.EVICT): frozenset({S.SHARED}),
}
"""(state, event) -> the states the block may be in afterwards. A pair missing here is illegal."""
del S
