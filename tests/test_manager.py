"""KVCacheManager scenarios, one per rule of docs/semantics.md's manager section.

Every scenario runs on the spec manager and on the implementation (through the same id-based
adapter), with exact block ids and free-queue orders. Block size 4 and 10 blocks unless stated:
the free queue starts as 1..9 (block 0 is the null block).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from manager_fixtures import MANAGER_FACTORIES, OneGroupView, manager_config

from pagedkv import (
    BlockStateError,
    InvalidArgumentError,
    MaxModelLenExceededError,
    PlaceholderRange,
    PrefixCacheStats,
    Request,
    RequestError,
    hash_request_tokens,
    sha256,
)
from pagedkv.vocab.semantics import VLLM_0_8_5


@pytest.fixture(params=sorted(MANAGER_FACTORIES))
def side(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make(side: str, **kwargs: object) -> OneGroupView:
    manager = MANAGER_FACTORIES[side](manager_config(**kwargs))  # type: ignore[arg-type]
    manager.check_invariants()
    return manager


def admit(manager: OneGroupView, request: Request, **kwargs: int) -> list[int] | None:
    """Look up, then allocate the whole prefill; on success the prompt counts as computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, **kwargs)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return new


def decode(manager: OneGroupView, request: Request, token: int = 0) -> list[int] | None:
    """Sample one token after a step, then schedule it."""
    request.append_output_token_ids(token)
    new = manager.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    manager.check_invariants()
    return new


def free_order(manager: OneGroupView) -> tuple[int, ...]:
    return manager.snapshot().pool.free_order


# -- get_computed_blocks -------------------------------------------------------------------


def test_caching_off_means_no_hit_and_nothing_stored(side: str) -> None:
    manager = make(side, enable_caching=False)
    request = Request("a", range(8))
    assert admit(manager, request) == [1, 2]
    assert manager.get_computed_blocks(Request("b", range(8))) == ([], 0)
    assert manager.snapshot().hashes == {}


def test_a_shared_prefix_hits_and_the_last_full_block_is_recomputed(side: str) -> None:
    manager = make(side)
    first = Request("a", range(8))  # two full blocks, both cached after admission
    assert admit(manager, first) == [1, 2]
    same = Request("b", range(8))
    # Every token lies in a full block, so the last block is left out of the lookup.
    assert manager.get_computed_blocks(same) == ([1], 4)
    assert manager.allocate_slots(same, 4, [1]) == [3]
    state = manager.snapshot()
    assert state.blocks == {"a": (1, 2), "b": (1, 3)}
    assert state.pool.ref_cnt[1] == 2
    # Block 3 holds the same content as block 2: both are cached under one hash, 2 first.
    hashes = hash_request_tokens(sha256, 4, first)
    assert state.pool.index[hashes[1]] == (2, 3)
    longer = Request("c", range(9))  # a partial last block: every full block may hit
    assert manager.get_computed_blocks(longer) == ([1, 2], 8)


def test_eagle_drops_the_last_block_of_a_hit(side: str) -> None:
    manager = make(side, use_eagle=True)
    admit(manager, Request("a", range(8)))
    assert manager.get_computed_blocks(Request("b", range(9))) == ([1], 4)
    assert manager.get_computed_blocks(Request("c", range(5))) == ([], 0)


def test_prompt_logprobs_skip_the_cache_but_hashes_are_stored(side: str) -> None:
    manager = make(side)
    admit(manager, Request("a", range(8)))
    wants_logprobs = Request("b", range(9), prompt_logprobs=True)
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)
    assert len(manager.snapshot().hashes["b"]) == 2


def test_hashes_are_computed_once_and_kept_across_preemption(side: str) -> None:
    manager = make(side)
    request = Request("a", range(6))
    admit(manager, request)
    stored = manager.snapshot().hashes["a"]
    manager.free(request)  # preemption: blocks go, hashes stay
    request.num_computed_tokens = 0
    assert manager.snapshot().hashes["a"] == stored
    assert manager.get_computed_blocks(request) == ([1], 4)
    manager.free_block_hashes(request)
    assert "a" not in manager.snapshot().hashes


def test_stats_count_lookups_and_hits_and_renew(side: str) -> None:
    manager = make(side, log_stats=True)
    admit(manager, Request("a", range(8)))  # 2 hashes, last left out: 1 query, 0 hits
    admit(manager, Request("b", range(8)))  # 1 query, 1 hit
    admit(manager, Request("c", range(9)))  # 2 queries, 2 hits: hits add up across lookups
    # ... and in tokens: 8 + 8 + 9 looked up, 3 blocks of 4 hit
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(False, 3, 4, 3, 25, 12)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()
    assert make(side).make_prefix_cache_stats() is None


# -- allocate_slots ------------------------------------------------------------------------


def test_decode_allocates_only_when_crossing_a_block_boundary(side: str) -> None:
    manager = make(side)
    request = Request("a", range(10))
    assert admit(manager, request) == [1, 2, 3]
    assert decode(manager, request) == []  # 11 tokens: still in block 3
    assert decode(manager, request) == []  # 12 tokens
    assert decode(manager, request) == [4]  # the 13th token starts block 4
    state = manager.snapshot()
    assert state.num_cached == {"a": 3}
    assert [h is not None for h in state.pool.block_hash[1:5]] == [True, True, True, False]


def test_lookahead_slots_are_allocated_but_not_cached(side: str) -> None:
    manager = make(side)
    request = Request("a", range(4))
    assert admit(manager, request, num_lookahead_tokens=1) == [1, 2]
    assert manager.snapshot().num_cached == {"a": 1}


def test_speculative_tokens_are_not_cached(side: str) -> None:
    manager = make(side)
    request = Request("a", range(4))
    admit(manager, request)
    request.append_output_token_ids(7)  # 5 tokens, 4 computed
    request.spec_token_ids = [8, 8, 8]
    assert manager.allocate_slots(request, 4) == [2]  # 8 slots: 1 real + 3 draft tokens
    state = manager.snapshot()
    assert state.num_cached == {"a": 1}  # block 2 holds draft tokens: not cached
    assert state.pool.block_hash[2] is None


def test_no_fit_returns_none_and_changes_nothing(side: str) -> None:
    manager = make(side, num_blocks=4)
    first = Request("a", range(8))
    assert admit(manager, first) == [1, 2]
    manager.free(first)
    assert free_order(manager) == (3, 2, 1)  # tail first
    # Hits [1, 2] are free themselves, so they do not count as free blocks for the new ones.
    big = Request("b", range(13))
    hits, _ = manager.get_computed_blocks(big)
    assert hits == [1, 2]
    before = manager.snapshot()
    assert manager.allocate_slots(big, 5, hits) is None  # 2 new blocks, 3 free - 2 hits = 1
    assert manager.snapshot() == before
    fits = Request("c", range(9))
    assert manager.get_computed_blocks(fits) == ([1, 2], 8)
    assert manager.allocate_slots(fits, 1, [1, 2]) == [3]
    assert free_order(manager) == ()


def test_past_max_model_len_raises_in_pagedkv_and_caps_in_vllm(side: str) -> None:
    ours = make(side, max_model_len=8)
    request = Request("a", range(4))
    admit(ours, request)
    request.append_output_token_ids(0)
    before = ours.snapshot()
    with pytest.raises(MaxModelLenExceededError, match="allocation past max_model_len"):
        ours.allocate_slots(request, 1, None, 4)  # 9 slots needed, 8 allowed
    assert ours.snapshot() == before
    theirs = make(side, max_model_len=8, semantics=VLLM_0_8_5)
    capped = Request("a", range(4))
    admit(theirs, capped)
    capped.append_output_token_ids(0)
    assert theirs.allocate_slots(capped, 1, None, 4) == [2]  # 3 blocks needed, 2 given
    capped.num_computed_tokens += 1
    capped.append_output_token_ids(0)
    with pytest.raises(MaxModelLenExceededError):  # vLLM 0.8.5 fails an assert here
        theirs.allocate_slots(capped, 1, None, 4)


def test_capacity_check_leaves_null_hits_out_unlike_vllm(side: str) -> None:
    """Sliding window: a hit whose skipped positions are null blocks (ref_cnt 0)."""
    for semantics, fits in ((None, True), (VLLM_0_8_5, False)):
        kwargs = {"semantics": semantics} if semantics else {}
        manager = make(side, block_size=2, num_blocks=7, sliding_window=4, **kwargs)  # type: ignore[arg-type]
        first = Request("a", range(8))
        assert admit(manager, first) == [1, 2, 3, 4]
        second = Request("b", range(9))
        hits, num_hit_tokens = manager.get_computed_blocks(second)
        assert (hits, num_hit_tokens) == ([0, 0, 3, 4], 8)
        filler = Request("filler", [9])
        assert admit(manager, filler) == [5]  # 1 block free now: exactly what b needs
        assert (manager.allocate_slots(second, 1, hits) is not None) is fits


# -- free ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("caching", "order"),
    [(True, (4, 5, 6, 7, 8, 9, 3, 2, 1)), (False, (4, 5, 6, 7, 8, 9, 1, 2, 3))],
)
def test_free_releases_tail_first_only_when_caching(
    side: str, caching: bool, order: tuple[int, ...]
) -> None:
    manager = make(side, enable_caching=caching)
    request = Request("a", range(12))
    admit(manager, request)
    manager.free(request)
    assert free_order(manager) == order
    manager.free(request)  # a second free: nothing held, nothing happens
    manager.free(Request("stranger", [1]))
    assert free_order(manager) == order


def test_reset_prefix_cache_only_when_nothing_is_held(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = make(side, log_stats=True)
    request = Request("a", range(8))
    admit(manager, request)
    with caplog.at_level(logging.WARNING):
        assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(Request("b", range(9))) == ([], 0)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.reset


def test_usage_and_common_prefix_blocks(side: str) -> None:
    manager = make(side)
    first, second = Request("a", range(8)), Request("b", [*range(4), 9, 9, 9, 9, 9])
    admit(manager, first)
    admit(manager, second)
    assert manager.snapshot().blocks == {"a": (1, 2), "b": (1, 3, 4)}
    assert manager.usage == 1 - 5 / 10  # blocks 0 (null) to 4 in use, 5 free
    assert manager.get_num_common_prefix_blocks(first, 2) == 1
    assert manager.get_num_common_prefix_blocks(second, 2) == 1
    assert manager.get_num_common_prefix_blocks(first, 1) == 0
    assert manager.get_num_common_prefix_blocks(Request("z", [1]), 1) == 0


# -- sliding window ------------------------------------------------------------------------


def test_sliding_window_table_before_and_after_skipping(side: str) -> None:
    """Block size 2, window 4: a token needs the 3 tokens before it, cdiv(3, 2) = 2 blocks."""
    manager = make(side, block_size=2, sliding_window=4)
    request = Request("a", range(9))
    assert admit(manager, request) == [1, 2, 3, 4, 5]
    assert manager.snapshot().blocks["a"] == (1, 2, 3, 4, 5)
    # The next token (position 9) sees tokens 6..9: blocks 0-2 (tokens 0-5) are skipped,
    # replaced by the null block and freed newest first.
    assert decode(manager, request) == []
    state = manager.snapshot()
    assert state.blocks["a"] == (0, 0, 0, 4, 5)
    assert state.pool.free_order == (6, 7, 8, 9, 3, 2, 1)
    assert state.pool.block_hash[3] is not None  # freed, still cached until reused
    # Another request with the same prompt hits the last window of cached blocks.
    other = Request("b", range(9))
    assert manager.get_computed_blocks(other) == ([0, 0, 3, 4], 8)
    assert manager.allocate_slots(other, 1, [0, 0, 3, 4]) == [6]
    assert manager.snapshot().blocks["b"] == (0, 0, 3, 4, 6)
    assert manager.snapshot().pool.ref_cnt[4] == 2


def test_sliding_window_skip_boundary_is_exact(side: str) -> None:
    """Block size 2, window 4: with 8 tokens computed the next token (8) sees tokens 5..8, so
    blocks 0 and 1 (tokens 0-3) are skipped and block 2 (tokens 4-5, token 5 still needed) is
    kept."""
    manager = make(side, block_size=2, sliding_window=4)
    request = Request("a", range(8))
    assert admit(manager, request) == [1, 2, 3, 4]
    assert decode(manager, request) == [5]
    assert manager.snapshot().blocks["a"] == (0, 0, 3, 4, 5)
    assert free_order(manager)[-2:] == (2, 1)  # newest first


def test_sliding_window_hit_falls_back_to_a_short_cached_start(side: str) -> None:
    manager = make(side, block_size=2, sliding_window=8)  # 4 blocks must be cached
    admit(manager, Request("a", range(5)))  # blocks 1, 2 cached
    assert manager.get_computed_blocks(Request("b", [*range(4), 7, 7, 7, 7, 7])) == ([1, 2], 4)


# -- hostile input: a typed error, and nothing changes -------------------------------------


class Scene:
    """A running request "a" (7 tokens, 6 computed) and a waiting "b" that was looked up."""

    def __init__(self, manager: OneGroupView) -> None:
        self.running = Request("a", range(6))
        admit(manager, self.running)
        self.running.append_output_token_ids(0)
        self.waiting = Request("b", range(5))
        manager.get_computed_blocks(self.waiting)


def _with_drafts(request: Request, drafts: list[int], call: Callable[[], object]) -> object:
    request.spec_token_ids = drafts
    try:
        return call()
    finally:
        request.spec_token_ids = []


HOSTILE: list[tuple[str, Callable[[OneGroupView, Scene], object], type[Exception], str]] = [
    (
        "no tokens",
        lambda m, s: m.allocate_slots(s.running, 0),
        InvalidArgumentError,
        "num_tokens 0 must adopt new_computed_blocks or external tokens",
    ),
    (
        "negative tokens",
        lambda m, s: m.allocate_slots(s.running, -3),
        InvalidArgumentError,
        "an int >= 0",
    ),
    (
        "negative lookahead",
        lambda m, s: m.allocate_slots(s.running, 1, None, -1),
        InvalidArgumentError,
        ">= 0",
    ),
    (
        "past max_model_len",
        lambda m, s: m.allocate_slots(s.running, 1, None, 64),
        MaxModelLenExceededError,
        "max_model_len",
    ),
    (
        "more drafts than scheduled tokens",
        lambda m, s: _with_drafts(s.running, [1, 1], lambda: m.allocate_slots(s.running, 1)),
        InvalidArgumentError,
        "2 speculative tokens but only 1 scheduled",
    ),
    (
        "tokens it does not have",
        lambda m, s: m.allocate_slots(s.running, 2),
        InvalidArgumentError,
        "has 7",
    ),
    (
        "impostor",
        lambda m, s: m.get_computed_blocks(Request("a", range(6))),
        RequestError,
        "another Request",
    ),
    ("impostor free", lambda m, s: m.free(Request("b", range(5))), RequestError, "another Request"),
    (
        "hashes dropped while running",
        lambda m, s: m.free_block_hashes(s.running),
        RequestError,
        "still holds blocks",
    ),
    (
        "hits for a running request",
        lambda m, s: m.allocate_slots(s.running, 1, [1]),
        RequestError,
        "already holds",
    ),
    (
        "foreign hit",
        lambda m, s: m.allocate_slots(s.waiting, 1, [99]),
        BlockStateError,
        "block 99: block does not belong",
    ),
    (
        "hit without a lookup",
        lambda m, s: m.allocate_slots(Request("c", range(4)), 1, [1]),
        RequestError,
        "cached blocks",
    ),
    (
        "hit of other content",
        lambda m, s: m.allocate_slots(s.waiting, 1, [2]),
        RequestError,
        "block 2 at position 0",
    ),
    (
        "null hit under full attention",
        lambda m, s: m.allocate_slots(s.waiting, 1, [0]),
        BlockStateError,
        "null block is no hit",
    ),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_calls_raise_and_change_nothing(
    side: str,
    name: str,
    call: Callable[[OneGroupView, Scene], object],
    error: type[Exception],
    message: str,
) -> None:
    manager = make(side)
    scene = Scene(manager)
    before = manager.snapshot()
    with pytest.raises(error, match=message):
        call(manager, scene)
    assert manager.snapshot() == before
    manager.check_invariants()


def test_num_computed_tokens_outside_the_slots_is_refused(side: str) -> None:
    manager = make(side)
    request = Scene(manager).running  # 6 computed tokens in 2 blocks of 4
    before = manager.snapshot()
    request.num_computed_tokens = 9
    with pytest.raises(RequestError, match="outside the request's slots"):
        manager.allocate_slots(request, 1)
    assert manager.snapshot() == before


def test_a_sliding_window_hit_must_have_the_shape_of_one(side: str) -> None:
    manager = make(side, block_size=2, sliding_window=4)
    admit(manager, Request("a", range(8)))
    other = Request("b", range(9))
    hits, _ = manager.get_computed_blocks(other)
    assert hits == [0, 0, 3, 4]
    before = manager.snapshot()
    for bogus in ([0, 0, 0, 4], [0, 2, 0, 4], [0, 0]):  # [0, 0]: nulls and nothing after
        with pytest.raises(RequestError, match="not a hit this attention type can produce"):
            manager.allocate_slots(other, 1, bogus)
    assert manager.snapshot() == before


def test_an_eagle_sliding_window_hit_keeps_its_window_whole(side: str) -> None:
    """Window 4, block size 2: a hit must end with 2 cached blocks; with EAGLE it is the hit of
    a window one block wider (3 blocks), less its last: token 6 still finds positions 3-5."""
    manager = make(side, block_size=2, sliding_window=4, use_eagle=True)
    admit(manager, Request("a", range(8)))
    other = Request("b", range(9))
    assert manager.get_computed_blocks(other) == ([0, 2, 3], 6)
    assert manager.allocate_slots(other, 3, [0, 2, 3]) == [5, 6]
    assert manager.snapshot().blocks["b"] == (0, 2, 3, 5, 6)


def test_vllm_0_8_5s_eagle_sliding_window_hit_is_one_block_short(side: str) -> None:
    """vLLM 0.8.5 drops the last block of the usual run: the hit's window misses position 3
    (a known bug, counted by the spec's attention-truth invariant), and the shorter hit is
    accepted."""
    manager = make(side, block_size=2, sliding_window=4, use_eagle=True, semantics=VLLM_0_8_5)
    admit(manager, Request("a", range(8)))
    other = Request("b", range(9))
    assert manager.get_computed_blocks(other) == ([0, 0, 3], 6)
    assert manager.allocate_slots(other, 3, [0, 0, 3]) == [5, 6]
    assert manager.snapshot().blocks["b"] == (0, 0, 3, 5, 6)


def test_hits_with_caching_off_are_refused(side: str) -> None:
    manager = make(side, enable_caching=False)
    with pytest.raises(InvalidArgumentError, match="prefix caching is off"):
        manager.allocate_slots(Request("a", range(4)), 4, [1])


def test_a_request_id_is_free_again_after_free_and_free_block_hashes(side: str) -> None:
    manager = make(side)
    request = Scene(manager).running
    manager.free(request)
    with pytest.raises(RequestError):  # hashes still stored: the id is still taken
        manager.get_computed_blocks(Request("a", [5, 5, 5, 5, 5]))
    manager.free_block_hashes(request)
    reused = Request("a", [5, 5, 5, 5, 5])
    assert manager.get_computed_blocks(reused) == ([], 0)
    assert manager.snapshot().hashes["a"] == tuple(hash_request_tokens(sha256, 4, reused))


def test_multimodal_ranges_and_hashes_must_agree() -> None:
    with pytest.raises(InvalidArgumentError, match="pair one to one"):
        Request("a", range(8), mm_positions=[PlaceholderRange(0, 2)], mm_hashes=[])


def test_request_tokens_cannot_be_changed_in_place() -> None:
    request = Request("a", [1, 2, 3])
    with pytest.raises(TypeError):
        request.all_token_ids[0] = 9  # type: ignore[index]


def test_runtime_invariant_checking_is_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv import KVCacheManager

    config = manager_config()
    assert not KVCacheManager(config.kv_cache_config, 64).debug_invariants
    monkeypatch.setenv("PAGEDKV_CHECK_INVARIANTS", "1")
    checked = KVCacheManager(config.kv_cache_config, 64)
    assert checked.debug_invariants
    request = Request("a", range(8))
    assert checked.allocate_slots(request, 8) is not None
    checked.block_pool.blocks[1].ref_cnt = 5  # corrupt it: the next call must notice
    with pytest.raises(AssertionError, match="ref_cnt"):
        checked.free(request)


def test_runtime_checking_can_sample_every_nth_call() -> None:
    from pagedkv import KVCacheManager

    config = manager_config()
    manager = KVCacheManager(config.kv_cache_config, 64, debug_invariants=3)
    request = Request("a", range(8))
    manager.allocate_slots(request, 8)  # call 1: not checked
    manager.block_pool.blocks[1].ref_cnt = 5  # corrupt it
    request.num_computed_tokens = 8
    request.append_output_token_ids(0)
    manager.allocate_slots(request, 1)  # call 2: not checked
    with pytest.raises(AssertionError, match="ref_cnt"):
        manager.free(request)  # call 3: checked


def test_a_bad_checking_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv import KVCacheManager

    monkeypatch.setenv("PAGEDKV_CHECK_INVARIANTS", "yes")
    with pytest.raises(InvalidArgumentError, match="PAGEDKV_CHECK_INVARIANTS"):
        KVCacheManager(manager_config().kv_cache_config, 64)
