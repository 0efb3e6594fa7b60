"""Sparse sliding-window retention (`prefix_cache_retention_interval`), pinned on a Gemma-style
window of 32 tokens with blocks of 16, on the spec and the implementation alike.

A hit of a 32-token window reads its last cdiv(31, 16) = 2 blocks (3 with EAGLE, which drops
one), so a prompt of 8 blocks (128 tokens) computes 8 full blocks of which a later request can
only ever use the runs ending where it stops: its resend stops at token 127 (before its last
token), a longer sibling at 128.
"""

from __future__ import annotations

import pytest
from test_hybrid_manager import SIDES, Side, admit, full, make, window

from pagedkv import Request
from pagedkv.spec.retention import reachable_boundaries, replay_boundaries, retained
from pagedkv.vocab.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)

B = 16
PROMPT = list(range(8 * B))  # 8 full blocks
SIBLING = [*PROMPT, *([999] * 20)]  # the prompt, then more: 9 full blocks


def config(interval: int | None, *specs: KVCacheSpec, num_blocks: int = 40) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        {
            f"layer.{g}": KVCacheTensor(spec.page_size_bytes * num_blocks)
            for g, spec in enumerate(specs)
        },
        [KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
        prefix_cache_retention_interval=interval,
    )


def cached_positions(manager: Side, request_id: str, group: int) -> list[int]:
    """The positions of the request's blocks in `group` that carry a hash."""
    state = manager.state()
    held = state["blocks"][request_id][group]
    return [p for p, block_id in enumerate(held) if state["block_hash"][block_id] is not None]


# (interval, use_eagle) -> (positions cached, resend's hit tokens, longer sibling's hit tokens)
SINGLE_GROUP = {
    (None, False): ([0, 1, 2, 3, 4, 5, 6, 7], 112, 128),
    (None, True): ([0, 1, 2, 3, 4, 5, 6, 7], 96, 112),
    # Only the run ending at the replay boundary (token 127: blocks 5, 6); the sibling's hit
    # stops there too.
    (0, False): ([5, 6], 112, 112),
    # EAGLE: two boundaries a block lower (96 and 112), each run 3 blocks ending a block on.
    (0, True): ([4, 5, 6, 7], 96, 112),
    # Segments of 4 blocks keep their last 2 (2, 3 and 6, 7), plus the replay tail (5, 6).
    (64, False): ([2, 3, 5, 6, 7], 112, 128),
    (64, True): ([2, 3, 4, 5, 6, 7], 96, 112),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(("interval", "use_eagle"), sorted(SINGLE_GROUP, key=repr))
def test_a_window_caches_only_the_runs_a_later_hit_can_use(
    side: str, interval: int | None, use_eagle: bool
) -> None:
    positions, resend_hit, sibling_hit = SINGLE_GROUP[interval, use_eagle]
    manager = make(side, config(interval, window(32, B)), 1024, use_eagle=use_eagle)
    first = Request("first", PROMPT)
    assert admit(manager, first) is not None
    assert cached_positions(manager, "first", 0) == positions
    # A block left out is still the request's: it holds all 8.
    assert len(manager.state()["blocks"]["first"][0]) == 8
    manager.free(first)
    manager.check_invariants()
    assert manager.get_computed_blocks(Request("resend", PROMPT))[1] == resend_hit
    assert manager.get_computed_blocks(Request("sibling", SIBLING))[1] == sibling_hit
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_full_attention_caches_every_block_whatever_the_interval(side: str) -> None:
    manager = make(side, config(0, full(B), window(32, B)), 1024)
    assert admit(manager, Request("first", PROMPT)) is not None
    assert cached_positions(manager, "first", 0) == list(range(8))
    assert cached_positions(manager, "first", 1) == [5, 6]


@pytest.mark.parametrize("side", SIDES)
def test_a_hybrid_hit_cut_short_by_the_window_pins_the_shared_prefix_junction(side: str) -> None:
    """Full attention caches the 5 shared blocks; the window group, retaining only the first
    prompt's tail (5, 6), allows no hit there: the common hit is 0, and the junction (80
    tokens) makes the second request's window keep blocks 3, 4, so the third request hits
    the whole shared prefix."""
    manager = make(side, config(0, full(B), window(32, B)), 1024)
    shared = PROMPT[: 5 * B]
    assert admit(manager, Request("first", PROMPT)) is not None
    second = Request("second", [*shared, *([500] * (3 * B))])
    assert manager.get_computed_blocks(second)[1] == 0
    assert admit(manager, second) is not None
    # Its replay tail (5, 6) and the junction's (3, 4).
    assert cached_positions(manager, "second", 1) == [3, 4, 5, 6]
    third = Request("third", [*shared, *([700] * (3 * B))])
    hits, num_tokens = manager.get_computed_blocks(third)
    assert num_tokens == 5 * B
    assert hits[1][:3] == [0, 0, 0]  # the window's hit: nulls, then blocks 3 and 4
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_with_eagle_the_junction_is_a_block_lower_and_so_is_its_second_run(side: str) -> None:
    """With EAGLE full attention's hit of the 5 shared blocks loses its last: the junction is
    64 tokens. The second request keeps the runs of 3 ending a block past 96 and 112 (its
    replay boundaries), 64 and 48 (the junction, and a block lower): blocks 1-7; the third
    hits 4 blocks, its window's run 2, 3, 4 less the dropped block."""
    manager = make(side, config(0, full(B), window(32, B)), 1024, use_eagle=True)
    shared = PROMPT[: 5 * B]
    assert admit(manager, Request("first", PROMPT)) is not None
    assert cached_positions(manager, "first", 1) == [4, 5, 6, 7]
    second = Request("second", [*shared, *([500] * (3 * B))])
    assert manager.get_computed_blocks(second)[1] == 0
    assert admit(manager, second) is not None
    assert cached_positions(manager, "second", 1) == [1, 2, 3, 4, 5, 6, 7]
    hits, num_tokens = manager.get_computed_blocks(Request("third", [*shared, *([7] * 48)]))
    assert num_tokens == 4 * B
    assert hits[1][:2] == [0, 0]
    manager.check_invariants()


def test_the_rule_without_a_manager() -> None:
    assert replay_boundaries(128, B, use_eagle=False) == (127,)
    assert replay_boundaries(128, B, use_eagle=True) == (96, 112)
    assert replay_boundaries(120, B, use_eagle=True) == (96,)  # not whole blocks: one boundary
    assert reachable_boundaries(128, 80, B, use_eagle=True) == (96, 112, 80, 64)
    kept = retained(
        range(8), interval=None, boundaries=(127,), need=2, block_size=B, use_eagle=False
    )
    assert kept == [True] * 8
    kept = retained(range(8), interval=0, boundaries=(127,), need=2, block_size=B, use_eagle=False)
    assert [p for p in range(8) if kept[p]] == [5, 6]
    # A segment no longer than the run a hit needs keeps every block.
    kept = retained(range(8), interval=32, boundaries=(), need=2, block_size=B, use_eagle=False)
    assert kept == [True] * 8
