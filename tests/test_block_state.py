"""The transition table against the chapter's state diagram (section 5.2.3)."""

from __future__ import annotations

import pytest

from pagedkv.spec import TRANSITIONS, BlockState, Event, state_of

S = BlockState

# The chapter's arrows, as (from, event, to). Two of them are corrected in the table; see below.
CHAPTER_ARROWS = [
    (S.FREE, Event.ALLOC, S.IN_USE),
    (S.IN_USE, Event.RELEASE, S.FREE),  # request.finish()
    (S.IN_USE, Event.SEAL, S.IN_USE_CACHED),  # seal: the block is full, its hash is computed
    (S.IN_USE_CACHED, Event.RELEASE, S.FREE_CACHED),  # request.finish()
    (S.IN_USE_CACHED, Event.TOUCH, S.SHARED),  # cache hit by another request
    (S.SHARED, Event.RELEASE, S.IN_USE_CACHED),  # a request finishes
]


@pytest.mark.parametrize(("before", "event", "after"), CHAPTER_ARROWS)
def test_every_chapter_arrow_is_in_the_table(
    before: BlockState, event: Event, after: BlockState
) -> None:
    assert after in TRANSITIONS[(before, event)]


def test_corrections_to_the_chapter() -> None:
    # A hit on a free cached block takes ref_cnt 0 -> 1: IN_USE+CACHED, not SHARED.
    assert TRANSITIONS[(S.FREE_CACHED, Event.TOUCH)] == {S.IN_USE_CACHED}
    # The last release of a shared block is two releases: SHARED -> IN_USE_CACHED -> FREE_CACHED.
    assert S.FREE_CACHED not in TRANSITIONS[(S.SHARED, Event.RELEASE)]
    # Handing a free cached block out again evicts it.
    assert TRANSITIONS[(S.FREE_CACHED, Event.ALLOC)] == {S.IN_USE}


def test_nothing_leaves_a_state_it_cannot() -> None:
    assert (S.IN_USE, Event.ALLOC) not in TRANSITIONS  # only free blocks are handed out
    assert (S.FREE, Event.RELEASE) not in TRANSITIONS  # a free block has no reference to drop
    assert (S.IN_USE_CACHED, Event.SEAL) not in TRANSITIONS  # a hash is set once
    assert (S.IN_USE, Event.RESET) not in TRANSITIONS  # reset refuses while blocks are in use


def test_state_of_covers_every_state() -> None:
    assert {state_of(r, h) for r in (0, 1, 2, 3) for h in (False, True)} == set(BlockState)
    assert state_of(2, False) is S.SHARED
