"""KV cache groups of several block sizes with prefix caching (vLLM 0.33.0's behaviour,
docs/design/mixed-block-sizes.md §8.1), first cut: no EAGLE, full attention at the hash block
size H (the sizes' GCD), chunked groups at the scheduler block size S (their LCM), windows at
any size. Scenarios on both sides, the same outcomes on both, refusals by name that change nothing,
the invariants that name what a wrong mixed-size manager breaks, and a differential run of
random workloads."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hybrid_manager import (
    ImplIds,
    Run,
    Side,
    SpecIds,
    chunked,
    config,
    full,
    make,
    window,
)

from pagedkv import KVCacheManager, PagedKVError, Request
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.vocab.errors import InvariantViolation, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from pagedkv.vocab.kv_events import BlockStored
from pagedkv.vocab.request import PlaceholderRange
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, VLLM_0_32, VLLM_0_33, Semantics

SIDES = ("spec", "impl")
H, S = 16, 32


def full_and_window(num_blocks: int = 64, sliding_window: int = 64) -> KVCacheConfig:
    """Full attention at 16 tokens a block, a 64-token window at 32 (S = 32, H = 16)."""
    return config(num_blocks, full(H), window(sliding_window, block_size=S))


def tokens(count: int, start: int = 0) -> list[int]:
    return [(start + i) % 50 + 1 for i in range(count)]


def admit(manager: Side, request: Request) -> tuple[Any, int]:
    """Look up, then allocate the whole prompt; the hits and their tokens."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return hits, num_hit_tokens


def decode(manager: Side, request: Request, count: int) -> None:
    for _ in range(count):
        request.append_output_token_ids(7)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_invariants()


def held(manager: Side, request_id: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in manager.state()["blocks"][request_id])


def hashed(manager: Side, block_id: int) -> bool:
    return manager.state()["block_hash"][block_id] is not None


def num_cached(manager: Side) -> list[dict[str, int]]:
    """Each group's count of cached positions per request."""
    if isinstance(manager, SpecIds):
        return [dict(group.num_cached) for group in manager.manager.managers]
    assert isinstance(manager, ImplIds)
    groups = manager.manager.coordinator.single_type_managers
    return [dict(group.num_cached_block) for group in groups]


# -- the observable behaviours ----------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_a_hit_is_a_multiple_of_S_and_each_group_holds_it_in_its_own_blocks(side: str) -> None:
    manager = make(side, full_and_window(), 256)
    first = Request("a", tokens(100))
    assert admit(manager, first)[1] == 0
    # 100 tokens: 7 blocks of 16, 4 of 32; cached up to 96 (S-aligned): 6 and 3 positions.
    assert [len(group) for group in held(manager, "a")] == [7, 4]
    assert [counts["a"] for counts in num_cached(manager)] == [6, 3]
    manager.free(first)
    sibling = Request("b", tokens(100) + tokens(20, start=30))
    hits, num_hit_tokens = admit(manager, sibling)
    # The lookup covers 119 tokens (7 chunks of 16): full attention finds 112, cut to 96.
    assert num_hit_tokens == 96
    assert [len(group) for group in hits] == [96 // H, 96 // S]
    assert hits[1][0] == 0  # the window (two blocks of 32) skips the first block
    assert list(held(manager, "b")[0][:6]) == list(hits[0])


@pytest.mark.parametrize("side", SIDES)
def test_full_blocks_below_S_stay_unhashed_until_the_next_S_boundary(side: str) -> None:
    manager = make(side, full_and_window(), 256)
    request = Request("a", tokens(50))
    admit(manager, request)
    full_blocks = held(manager, "a")[0]
    # Tokens 32-47 fill full attention's third block, but 50 rounds down to 32.
    assert [hashed(manager, block) for block in full_blocks] == [True, True, False, False]
    decode(manager, request, 13)  # 63 tokens computed: still below 64
    assert not hashed(manager, full_blocks[2])
    decode(manager, request, 1)  # 64: the boundary
    assert [hashed(manager, block) for block in full_blocks] == [True] * 4
    assert [counts["a"] for counts in num_cached(manager)] == [4, 2]


@pytest.mark.parametrize("side", SIDES)
def test_a_full_block_freed_unhashed_goes_to_the_queue_head_under_vllm_0_33(side: str) -> None:
    manager = make(side, full_and_window(num_blocks=16), 256, semantics=VLLM_0_33)
    request = Request("a", tokens(50))
    admit(manager, request)
    full_blocks, window_blocks = held(manager, "a")
    manager.free(request)
    manager.check_invariants()
    head = manager.state()["free_order"][:3]
    # Group by group, each tail first; unhashed ones prepended: the window's last, then full
    # attention's two unhashed (position 3, then the full but unhashed position 2).
    assert head == (window_blocks[1], full_blocks[3], full_blocks[2])


@pytest.mark.parametrize("side", SIDES)
def test_cache_blocks_caches_to_the_S_boundary_below_it(side: str) -> None:
    manager = make(side, full_and_window(), 256)
    request = Request("a", tokens(70))
    hits, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 70, hits) is not None
    request.num_computed_tokens = 70
    assert [counts["a"] for counts in num_cached(manager)] == [4, 2]
    manager.cache_blocks(request, 40)  # below what is cached: nothing changes
    assert [counts["a"] for counts in num_cached(manager)] == [4, 2]
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_a_chunked_group_of_S_token_blocks_hits_the_last_chunks_blocks(side: str) -> None:
    kv_config = config(64, full(H), chunked(64, block_size=S))
    manager = make(side, kv_config, 256)
    admit(manager, Request("a", tokens(100)))
    sibling = Request("b", [*tokens(100), 9, 9, 9])
    hits, num_hit_tokens = manager.get_computed_blocks(sibling)
    # The first request still runs: its blocks are cached and shared.
    assert num_hit_tokens == 96
    assert [len(group) for group in hits] == [6, 3]
    assert hits[1][:2] == [0, 0]  # chunk [64, 128) reads from 64 on: the earlier blocks are null


@pytest.mark.parametrize("side", SIDES)
def test_a_window_of_blocks_below_S_hits_at_S_and_caches_only_what_such_hits_read(
    side: str,
) -> None:
    # 16 / 64 / 32 (vLLM 0.33's plan of full h128 + SWA h32 + SWA h64): S = 64. The 32-token
    # window needs one block before a hit's end; ends are multiples of 64, so of its blocks
    # only the odd positions (the last of each 64-token segment) are ever read by a hit.
    kv_config = config(96, full(16), window(128, block_size=64), window(32, block_size=32))
    manager = make(side, kv_config, 512)
    first = Request("a", tokens(200))
    admit(manager, first)
    small_window = held(manager, "a")[2]
    assert [counts["a"] for counts in num_cached(manager)] == [12, 3, 6]
    assert [hashed(manager, block) for block in small_window] == [False, True] * 3 + [False]
    manager.free(first)
    sibling = Request("b", [*tokens(200), 3, 3])
    hits, num_hit_tokens = admit(manager, sibling)
    assert num_hit_tokens == 192
    assert [len(group) for group in hits] == [12, 3, 6]
    assert hits[2] == [0] * 5 + [small_window[5]]


@pytest.mark.parametrize("side", SIDES)
def test_full_attention_above_H_is_keyed_at_its_blocks_ends(side: str) -> None:
    # 32 / 16 (vLLM 0.33's plan of full h64 + SWA h128): H = 16, S = 32. Full attention's block
    # k is keyed by the chain hash of its 2k+1-th 16-token chunk; no partial key (pagedkv).
    kv_config = config(64, full(32), window(32, block_size=16))
    manager = make(side, kv_config, 256)
    first = Request("a", tokens(100))
    admit(manager, first)
    assert [counts["a"] for counts in num_cached(manager)] == [3, 6]
    manager.free(first)
    sibling = Request("b", [*tokens(90), 5, 5])
    hits, num_hit_tokens = admit(manager, sibling)
    assert num_hit_tokens == 64  # 91 tokens looked up: 2 blocks of 32, aligned
    assert [len(group) for group in hits] == [2, 4]
    assert hits[1][:2] == [0, 0]  # the 32-token window reads 2 blocks of 16 before 64


def partial_keys(manager: Side) -> dict[int, int]:
    """Block id -> how many secondary (partial) keys index it (both pools keep them by id)."""
    return {block: len(keys) for block, keys in manager.pool.partial_keys.items()}


@pytest.mark.parametrize("side", SIDES)
def test_full_attention_above_H_adds_vllms_partial_key_under_vllm_0_33(side: str) -> None:
    # The design note's run (§5): full 32 + SWA 16 (W 32), a 56-token prompt, no EAGLE. After
    # the prefill only 32 tokens are cached (S = 32): no partial key. At 64 tokens full
    # attention's position 1 (tokens 32-63) is hashed, and indexed under the chain hash at 48
    # (the prompt's last 16-token boundary before its last token) too.
    kv_config = config(24, full(32), window(32, block_size=16))
    for semantics, expected in ((VLLM_0_33, 1), (PAGEDKV, 0)):
        manager = make(side, kv_config, 256, semantics=semantics)
        request = Request("a", tokens(56))
        admit(manager, request)
        assert partial_keys(manager) == {}
        decode(manager, request, 8)
        position_1 = held(manager, "a")[0][1]
        assert hashed(manager, position_1)
        assert partial_keys(manager) == ({position_1: 1} if expected else {})
        assert len(manager.state()["index"]) == 2 + 4 + expected  # full 2, window 4 (dense)
        manager.free(request)
        manager.check_invariants()
        # Handed out again (every free block is), the block loses both keys.
        assert manager.allocate_slots(Request("b", tokens(240, start=7)), 240) is not None
        assert partial_keys(manager) == {}
        manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_events_publish_each_groups_blocks_and_the_partial_key(side: str) -> None:
    # Full 32 / window 16 (H = 16, S = 32), a 56-token prompt, then 8 decode steps, vllm-0.33.
    manager = make(
        side,
        config(24, full(32), window(32, block_size=16)),
        256,
        semantics=VLLM_0_33,
        enable_kv_cache_events=True,
    )
    request = Request("a", tokens(56), lora_id=3)
    admit(manager, request)
    decode(manager, request, 8)
    events = manager.take_events()
    stored = [event for event in events if isinstance(event, BlockStored)]
    by_group = {event.group_idx: event for event in stored if event.block_size != 16}
    # Full attention's blocks: 32 tokens each, keyed by the chain hash at their ends.
    assert (
        [event.token_ids for event in stored if event.group_idx == 0]
        == [
            tuple(tokens(32)),
            (*tokens(56)[32:], *[7] * 8),  # decode() samples 7s
            tuple(tokens(56)[32:48]),  # the partial key: the 16 tokens before the prompt's boundary
        ]
    )
    assert [event.block_size for event in stored if event.group_idx == 0] == [32, 32, 16]
    assert by_group[0].lora_id == 3
    windowed = [event for event in stored if event.group_idx == 1]
    assert sum(len(event.block_hashes) for event in windowed) == 4
    assert all(event.block_size == 16 for event in windowed)
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_a_window_shortens_the_hit_in_S_steps_and_full_attention_is_cut(side: str) -> None:
    # Three groups of sizes 16 / 64 / 16: S = 64.
    kv_config = config(96, full(16), window(128, block_size=64), full(16))
    manager = make(side, kv_config, 256)
    first = Request("a", tokens(200))
    admit(manager, first)
    manager.free(first)
    sibling = Request("b", tokens(200) + [3] * 10)
    hits, num_hit_tokens = admit(manager, sibling)
    assert num_hit_tokens == 192
    assert [len(group) for group in hits] == [12, 3, 12]
    assert hits[1][0] == 0


def test_both_sides_agree_on_the_scenarios_above() -> None:
    for semantics in (PAGEDKV, VLLM_0_33):
        states = []
        for side in SIDES:
            manager = make(side, full_and_window(num_blocks=24), 256, semantics=semantics)
            first, second = Request("a", tokens(90)), Request("b", tokens(90) + [4] * 40)
            admit(manager, first)
            decode(manager, first, 9)
            manager.free(first)
            admit(manager, second)
            decode(manager, second, 3)
            states.append((manager.state(), num_cached(manager)))
        assert states[0] == states[1]


# -- the invariants name what a wrong manager breaks -----------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_caching_off_the_S_grid_is_caught_by_name(side: str) -> None:
    manager = make(side, full_and_window(), 256)
    if isinstance(manager, SpecIds):
        manager.manager.scheduler_block_size = H  # a manager that forgets the delay
    else:
        manager.manager._scheduler_block_size = H
    request = Request("a", tokens(50))
    hits, _ = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 50, hits)
    with pytest.raises(InvariantViolation, match="every group caches the same prefix"):
        manager.check_invariants()


def test_the_attention_truth_reads_each_groups_blocks_at_its_own_size() -> None:
    spec = SpecKVCacheManager(full_and_window(), 256)
    first = Request("a", tokens(100))
    hits, _ = spec.get_computed_blocks(first)
    spec.allocate_slots(first, 100, hits)
    first.num_computed_tokens = 100
    spec.check_invariants()
    full_blocks, window_blocks = spec.held("a")
    sibling = Request("b", [*tokens(100), 5])
    truth = spec.truth
    # The true hit of 96 tokens: 6 blocks of 16, and the window's last two blocks of 32.
    truth.check_hit(sibling, (full_blocks[:6], [0, *window_blocks[1:3]]), 96, eagle=False)
    truth.check_hit(sibling, (full_blocks[:4], list(window_blocks[:2])), 64, eagle=False)
    with pytest.raises(InvariantViolation, match="holds its own KV"):  # blocks swapped
        truth.check_hit(
            sibling, (full_blocks[:6], [0, window_blocks[2], window_blocks[1]]), 96, eagle=False
        )


# -- refusals ---------------------------------------------------------------------------------

CONFIGS: dict[str, tuple[list[KVCacheSpec], dict[str, Any], str]] = {
    "chunked below S": (
        [full(16), chunked(64, block_size=16), window(64, block_size=32)],
        {},
        "KV cache group 1 (chunked local attention) has block size 16: with prefix caching and "
        "groups of several block sizes, a chunked local attention group's block size must be "
        "the scheduler block size 32 (their LCM: vLLM 0.33 asserts it at the first lookup)",
    ),
    "EAGLE": (
        [full(16), window(64, block_size=32)],
        {"use_eagle": True},
        "KVCacheManager with prefix caching serves groups of several block sizes ([16, 32]) "
        "only without EAGLE (vLLM 0.33 drops a block of each group's own size, then rounds the "
        "hit down to their LCM: not modelled yet)",
    ),
    "vLLM 0.8.5": (
        [full(16), window(64, block_size=32)],
        {"semantics": VLLM_0_8_5},
        "KVCacheManager with prefix caching serves groups of several block sizes ([16, 32]) "
        "only under the semantics 'pagedkv', 'vllm-0.33' and 'vllm-0.32' (the behaviour "
        "checked against vLLM 0.33.0 and 0.32.0), not vllm-0.8.5",
    ),
    "semantics of one's own": (
        [full(16), window(64, block_size=32)],
        {"semantics": Semantics(free_uncached_to_head=True)},
        "KVCacheManager with prefix caching serves groups of several block sizes ([16, 32]) "
        "only under the semantics 'pagedkv', 'vllm-0.33' and 'vllm-0.32' (the behaviour "
        "checked against vLLM 0.33.0 and 0.32.0), not "
        + repr(Semantics(free_uncached_to_head=True)),
    ),
}


@pytest.mark.parametrize("case", list(CONFIGS), ids=list(CONFIGS))
def test_configs_outside_the_first_cut_are_refused_alike(case: str) -> None:
    specs, kwargs, message = CONFIGS[case]
    for manager_class in (SpecKVCacheManager, KVCacheManager):
        with pytest.raises(KVCacheConfigError) as info:
            manager_class(config(64, *specs), 256, **kwargs)  # type: ignore[operator]
        assert str(info.value) == message
        manager_class(config(64, *specs), 256, enable_caching=False)  # served without caching


def test_several_block_sizes_with_caching_off_are_unchanged() -> None:
    for manager_class in (SpecKVCacheManager, KVCacheManager):
        manager_class(config(64, full(32), window(64, block_size=16)), 256, enable_caching=False)


Scene = Callable[[Side, Request], object]


def _unequal_hits(manager: Side, request: Request) -> object:
    hits, _ = manager.get_computed_blocks(request)
    return manager.allocate_slots(request, 4, (hits[0][:-1], hits[1]))


CALLS: dict[str, tuple[Scene, type, str]] = {
    "hits of unequal tokens": (
        _unequal_hits,
        PagedKVError,
        "request 'b': new_computed_blocks must cover the same tokens in every KV cache group "
        "([80, 96] tokens per group)",
    ),
}


@pytest.mark.parametrize("case", list(CALLS), ids=list(CALLS))
def test_refused_calls_are_worded_alike_and_change_nothing(case: str) -> None:
    scene, error, message = CALLS[case]
    outcomes = []
    for side in SIDES:
        manager = make(side, full_and_window(), 256)
        first = Request("a", tokens(100))
        admit(manager, first)
        manager.free(first)
        request = Request("b", [*tokens(100), 1])
        manager.get_computed_blocks(request)  # its hashes stored: the state to keep
        before = (manager.state(), num_cached(manager))
        with pytest.raises(error) as info:
            scene(manager, request)
        assert str(info.value) == message
        manager.check_invariants()
        after = (manager.state(), num_cached(manager))
        assert {k: v for k, v in after[0].items() if k != "stats"} == {
            k: v for k, v in before[0].items() if k != "stats"
        }
        assert after[1] == before[1]
        outcomes.append((type(info.value), str(info.value)))
    assert outcomes[0] == outcomes[1]


# -- spec and implementation on random workloads ------------------------------------------------

LAYOUTS: list[tuple[int, ...]] = [(1, 2), (2, 4), (1, 4), (2, 8), (4, 8), (2, 12)]
"""(H, S) pairs, scaled down from 16/32/64 so that short random prompts cross many blocks; the
sizes drawn are H's multiples dividing S ((2, 12): 2, 4, 6, 12, so that no group may be at S
and windows of 4 or 6 then align their own hits to 12)."""


def mixed_config(
    rng: random.Random, hash_size: int, sched_size: int, any_full_size: bool = False
) -> KVCacheConfig:
    """Full attention at H (`any_full_size`: a second one at any size); windows at any size of
    the layout; chunked at S; two sizes at least (the LCM of those drawn may be below the
    layout's S, their GCD above its H)."""
    sizes = [size for size in range(hash_size, sched_size + 1, hash_size) if sched_size % size == 0]
    specs: list[KVCacheSpec] = [full(rng.choice(sizes) if any_full_size else hash_size)]
    for _ in range(rng.randint(1, 2)):
        kind = rng.choice(("full", "window", "window", "chunked"))
        if kind == "full":
            specs.append(full(rng.choice(sizes) if any_full_size else hash_size))
        elif kind == "window":
            specs.append(window(rng.randint(2, 3 * sched_size), rng.choice(sizes)))
        else:
            specs.append(chunked(sched_size * rng.randint(1, 3), sched_size))
    if len({spec.block_size for spec in specs}) == 1:
        others = [size for size in sizes if size != specs[0].block_size]
        specs.append(window(rng.randint(2, 3 * sched_size), rng.choice(others)))
    rng.shuffle(specs)
    return config(rng.randint(6, 14) * len(specs) + 1, *specs)


class MixedRun(Run):
    """`test_hybrid_manager.Run` over groups of several block sizes with caching: prompts
    sharing prefixes that span several S-token blocks; every group's cached counts compared
    too."""

    def __init__(self, seed: int, layout: tuple[int, ...], semantics: Semantics) -> None:
        self.rng = rng = random.Random(seed)
        hash_size, sched_size = layout
        kv_config = mixed_config(rng, hash_size, sched_size, rng.random() < 0.6)
        self.max_model_len = 6 * sched_size + 8
        kwargs: dict[str, Any] = {"log_stats": True, "semantics": semantics}
        kwargs["enable_kv_cache_events"] = rng.random() < 0.5
        if any(
            isinstance(group.kv_cache_spec, SlidingWindowSpec)
            for group in kv_config.kv_cache_groups
        ):
            kv_config = kv_config.with_retention(rng.choice((None, None, 0, 2 * sched_size)))
        kwargs["caching_hash_algo"] = rng.choice(("sha256", "builtin"))
        self.spec = make("spec", kv_config, self.max_model_len, **kwargs)
        self.impl = make("impl", kv_config, self.max_model_len, **kwargs)
        self.num_groups = len(kv_config.kv_cache_groups)
        self.seed = seed
        span = 3 * sched_size
        self.prefixes = [[rng.choice((1, 2, 3)) for _ in range(rng.randint(2, span))] for _ in "ab"]
        self.sched_size = sched_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.arrivals = 0
        self.seen: Counter[str] = Counter()

    def arrive(self) -> None:
        """A request sharing a prefix, or not; a few with a LoRA id, a cache salt or an image
        (extra keys: each H-chunk of the chain has its own)."""
        rng = self.rng
        prefix = rng.choice((*self.prefixes, []))
        extra = [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, self.sched_size + 2))]
        tokens = prefix + extra
        self.arrivals += 1
        kwargs: dict[str, Any] = {}
        kind = rng.randrange(8)
        if kind == 0:
            kwargs["lora_id"] = rng.choice((1, 2))
        elif kind == 1:
            kwargs["cache_salt"] = rng.choice(("a", "b"))
        elif kind == 2 and len(tokens) > 2:
            offset = rng.randrange(len(tokens) - 1)
            length = rng.randint(1, len(tokens) - offset)
            kwargs["mm_positions"] = [PlaceholderRange(offset=offset, length=length)]
            kwargs["mm_hashes"] = [rng.choice(("img0", "img1"))]
        self.waiting.append(Request(f"r{self.arrivals}", tokens, **kwargs))

    def call(self, what: Callable[[Side], object]) -> tuple[bool, object]:
        result = super().call(what)
        assert num_cached(self.spec) == num_cached(self.impl), self.seed
        self.seen["partial keys"] = max(self.seen["partial keys"], len(partial_keys(self.spec)))
        return result

    def finish(self) -> None:
        """Run's, the null block aside (vLLM 0.32 counts its references: `null_block_refcounted`,
        its deferred frees count them down past 0)."""
        for request in self.running:
            self.call(lambda m, r=request: m.free(r))
        ref_cnt = self.spec.state()["ref_cnt"]
        assert ref_cnt[1:] == (0,) * (len(ref_cnt) - 1)

    def misc(self) -> None:
        """Run's, or a connector's `evict_blocks` of some blocks (held or free), or a deferred
        free of a running request (`pop_blocks_for_free`, then its release)."""
        rng = self.rng
        choice = rng.randrange(8)
        if choice == 6:
            num_blocks = len(self.spec.state()["ref_cnt"])
            block_ids = [rng.randrange(1, num_blocks) for _ in range(rng.randint(1, 3))]
            self.call(lambda m: m.evict_blocks(block_ids))
            self.seen["evict_blocks"] += 1
        elif choice == 7 and self.running:
            request = self.running.pop(rng.randrange(len(self.running)))

            def deferred(m: Side) -> object:
                popped = m.pop_blocks_for_free(request)
                m.free_popped_blocks(popped)
                return tuple([getattr(b, "block_id", b) for b in group] for group in popped)

            self.call(deferred)
            request.num_computed_tokens = 0
            self.waiting.append(request)
            self.seen["deferred frees"] += 1
        else:
            super().misc()

    def admit(self, request: Request) -> None:
        """Run's admission, or (a third of them) one with a connector's external tokens after
        the hits, its cache sometimes delayed to a `cache_blocks` when the load lands."""
        rng = self.rng
        if rng.random() < 2 / 3:
            super().admit(request)
            return
        ok, looked_up = self.call(lambda m: m.get_computed_blocks(request))
        assert ok and isinstance(looked_up, tuple)
        hits, num_hit_tokens = looked_up
        remaining = request.num_tokens - num_hit_tokens
        if remaining < 2:
            self.waiting.append(request)
            return
        external = rng.randint(1, remaining - 1)
        num_tokens = rng.randint(1, remaining - external)
        delay = rng.random() < 0.5

        def allocate(m: Side) -> object:
            if isinstance(m, SpecIds):
                return m.manager.allocate_slots(
                    request, num_tokens, hits, 0, False, external, delay
                )
            new = m.manager.allocate_slots(
                request, num_tokens, m._hits(hits), 0, False, external, delay
            )
            return None if new is None else tuple([b.block_id for b in group] for group in new)

        ok, new = self.call(allocate)
        if not ok or new is None:
            self.seen["not admitted"] += 1
            self.waiting.append(request)
            return
        request.num_computed_tokens = num_hit_tokens + external + num_tokens
        self.running.append(request)
        self.seen["admitted with external tokens"] += 1
        self.seen["admitted with hits"] += bool(num_hit_tokens)
        if delay:
            landed = num_hit_tokens + external
            self.call(lambda m: m.cache_blocks(request, landed))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from(LAYOUTS),
    semantics=st.sampled_from((PAGEDKV, VLLM_0_33, VLLM_0_32)),
)
def test_spec_and_impl_agree_on_random_mixed_size_workloads(
    seed: int, layout: tuple[int, ...], semantics: Semantics
) -> None:
    run = MixedRun(seed, layout, semantics)
    for _ in range(60):
        run.step()
    run.finish()


def test_the_random_workloads_hit_across_groups_of_several_sizes() -> None:
    seen: Counter[str] = Counter()
    for seed in range(24):
        run = MixedRun(
            seed, LAYOUTS[seed % len(LAYOUTS)], (PAGEDKV, VLLM_0_33, VLLM_0_32)[seed % 3]
        )
        for _ in range(60):
            run.step()
        run.finish()
        seen += run.seen
    assert seen["admitted with hits"] >= 20 and seen["refused"] >= 5, seen
    assert seen["partial keys"] >= 3, seen
    assert seen["evict_blocks"] >= 5 and seen["deferred frees"] >= 5, seen
    assert seen["nulls in a hit"] >= 3 and seen["preempted"] >= 5, seen
    assert seen["admitted with external tokens"] >= 10, seen


# -- vLLM 0.33.0 itself ---------------------------------------------------------------------------

VLLM_LAYOUTS: list[tuple[list[list[Any]], int]] = [
    ([["full", 16], ["window", 32, 64]], 48),
    ([["full", 16], ["window", 64, 128], ["full", 16]], 96),
    ([["window", 32, 40], ["full", 16]], 40),
    ([["full", 16], ["chunked", 32, 64]], 48),
    ([["full", 16], ["window", 64, 128], ["window", 32, 64]], 96),
    ([["full", 16], ["window", 16, 40], ["window", 32, 33]], 60),
    ([["full", 8], ["window", 16, 20], ["chunked", 64, 64]], 80),
    ([["full", 32], ["window", 16, 32]], 64),
    ([["window", 32, 64], ["full", 64], ["full", 16]], 96),
    ([["full", 32], ["full", 16], ["window", 64, 100]], 96),
    ([["full", 64], ["window", 16, 20], ["chunked", 64, 128]], 96),
]
"""(groups, num_blocks) for the check against vLLM 0.33.0: the plans of
docs/design/mixed-block-sizes.md §7 (16/32, 32/16, 16/64/32) and more, full attention above H
(vLLM's partial keys) in the last four."""


@pytest.mark.parametrize("release", ["0.33.0", "0.32.0"])
def test_vllm_itself_serves_the_same_blocks_step_by_step(release: str) -> None:
    """vLLM 0.33.0's own KVCacheManager and pagedkv's under vllm-0.33, driven alike over random
    workloads (external tokens and delayed caches among them) of every layout and retention
    (None, 0, 2S): the same hits and new blocks, free
    queue, hashed blocks, block tables and index after every call
    (`tests/vllm_033_mixed_block_sizes.py`;
    with full attention above H, vLLM's partial keys too: how many index each block, and the
    index's size)."""
    cases = []
    for groups, num_blocks in VLLM_LAYOUTS:
        largest = max(group[1] for group in groups)
        windowed = any(group[0] == "window" for group in groups)
        for retention in (None, 0, 2 * largest) if windowed else (None,):
            cases.append(
                {
                    "groups": groups,
                    "num_blocks": num_blocks,
                    "retention": retention,
                    "seeds": 2,
                    "steps": 120,
                }
            )
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "vllm_033_mixed_block_sizes.py"), release],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode == 3:
        pytest.skip(f"vllm=={release}: the package index is unreachable and nothing is cached")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results = json.loads(completed.stdout.splitlines()[-1])
    for case, result in zip(cases, results, strict=True):
        assert "difference" not in result, (case, result)
        assert result["calls"] >= 150 and result["admitted with hits"] >= 5, (case, result)
        assert result["admitted with external tokens"] >= 3, (case, result)


@pytest.mark.parametrize("seed", [1004, 5224])
def test_adopted_nulls_past_the_s_boundary_are_covered_by_stored_hashes(seed: int) -> None:
    """Regressions (a sweep's seeds): under pagedkv's semantics external tokens push a window's
    hits out past the computed tokens rounded down to S; its adopted null positions count as
    cached, so the stored chain must cover them, caching delayed (5224) or not (1004)."""
    run = MixedRun(seed, LAYOUTS[seed % len(LAYOUTS)], PAGEDKV)
    for _ in range(120):
        run.step()
    run.finish()
