"""The manager over several KV cache groups: scenarios, spec and impl side by side, then a seeded
differential run.

Every scenario runs on `SpecKVCacheManager` (block ids) and on `KVCacheManager` (its blocks
mapped to ids by `ImplIds` below), with exact block ids per group and free-queue orders. Block
size 2 unless stated; the free queue starts as 1..N-1 (block 0 is the null block). Where a
scenario needs a cache state no request sequence makes simply (one group caching a block another
group lacks), `seed` caches a chain through the pool's own `cache_full_blocks(..., group_id)`,
null blocks marking the positions left out.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pagedkv import (
    ArgumentTypeError,
    ChunkedLocalAttentionSpec,
    ConcurrentUseError,
    FullAttentionSpec,
    InvariantViolation,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheConfigError,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    PagedKVError,
    Request,
    RequestError,
    SlidingWindowSpec,
    sha256,
)
from pagedkv.harness.adapters import free_order
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.vocab.hashes import GroupKey
from pagedkv.vocab.kv_events import BlockRemoved, BlockStored
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_33, Semantics

SIDES = ["spec", "impl"]
B = 2


def full(block_size: int = B) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")


def window(sliding_window: int, block_size: int = B) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float16",
        sliding_window=sliding_window,
    )


def chunked(chunk_size: int, block_size: int = B) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float16",
        attention_chunk_size=chunk_size,
    )


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """One layer per group, each with its own tensor."""
    return KVCacheConfig(
        num_blocks,
        {
            f"layer.{g}": KVCacheTensor(spec.page_size_bytes * num_blocks)
            for g, spec in enumerate(specs)
        },
        [KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
    )


Ids = tuple[list[int], ...]


class SpecIds:
    """The spec manager, which speaks ids already, and its observable state."""

    def __init__(self, manager: SpecKVCacheManager) -> None:
        self.manager = manager
        self.pool = manager.pool

    def get_computed_blocks(self, request: Request) -> tuple[Ids, int]:
        return self.manager.get_computed_blocks(request)

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        hits: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Ids | None:
        return self.manager.allocate_slots(request, num_tokens, hits, num_lookahead_tokens)

    def __getattr__(self, name: str) -> Any:  # free, free_block_hashes, reset_prefix_cache, ...
        return getattr(self.manager, name)

    def seed_pool(self, request: Request, block_ids: list[int], group: int) -> None:
        """Cache the request's chain at the positions of `block_ids` that are not 0, for
        `group`, then free those blocks (tail first): evictable cached blocks."""
        self.pool.cache_full_blocks(request, block_ids, [], 0, len(block_ids), B, sha256, group)
        self.pool.free_blocks([b for b in reversed(block_ids) if b])
        # What those blocks hold: the chain's KV, as if a request had computed it there.
        tables = tuple(block_ids if g == group else [] for g in range(self.manager.num_groups))
        self.manager.truth.computed(request, tables, 0, len(block_ids) * B)

    def new_block_ids(self, count: int) -> list[int]:
        return self.pool.get_new_blocks(count)

    def state(self) -> dict[str, Any]:
        pool, manager = self.pool, self.manager
        return {
            "free_order": tuple(pool.free_order),
            "ref_cnt": tuple(pool.ref_cnt),
            "block_hash": tuple(pool.block_hash),
            "index": {key: tuple(ids) for key, ids in pool.index.items()},
            "blocks": {r: tuple(map(tuple, held)) for r, held in manager.blocks.items()},
            "hashes": {r: tuple(h) for r, h in manager.hashes.items() if h},
            "num_cached": dict(manager.num_cached),
            "events": tuple(pool.events),
            "stats": manager.stats,
        }


class ImplIds:
    """KVCacheManager in block ids: hits go in as the pool's blocks (an id outside the pool as
    a fresh KVCacheBlock, which the manager must refuse), results come out as ids."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.pool = manager.block_pool

    def _block(self, block_id: int) -> KVCacheBlock:
        blocks = self.pool.blocks
        return blocks[block_id] if 0 <= block_id < len(blocks) else KVCacheBlock(block_id)

    def _hits(self, hits: object) -> Any:
        """Ids to blocks where the hits have the right shape (a list or tuple of one list or
        tuple of ids per group); any other value reaches the manager as it is, so that its
        refusal quotes the value the spec was given."""
        if not isinstance(hits, (list, tuple)) or len(hits) != self.manager.num_groups:
            return hits
        return tuple(
            [self._block(b) for b in group] if isinstance(group, (list, tuple)) else group
            for group in hits
        )

    def get_computed_blocks(self, request: Request) -> tuple[Ids, int]:
        hits, num_tokens = self.manager.get_computed_blocks(request)
        return tuple([block.block_id for block in group] for group in hits), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        hits: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Ids | None:
        new = self.manager.allocate_slots(
            request, num_tokens, self._hits(hits), num_lookahead_tokens
        )
        return None if new is None else tuple([block.block_id for block in g] for g in new)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def seed_pool(self, request: Request, block_ids: list[int], group: int) -> None:
        blocks = [self.pool.blocks[b] for b in block_ids]
        self.pool.cache_full_blocks(request, blocks, [], 0, len(blocks), B, sha256, group)
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(block_ids) if b])

    def new_block_ids(self, count: int) -> list[int]:
        return [block.block_id for block in self.pool.get_new_blocks(count)]

    def state(self) -> dict[str, Any]:
        pool, manager = self.pool, self.manager
        groups = manager.coordinator.single_type_managers
        return {
            "free_order": free_order(pool.free_block_queue, len(pool.blocks)),
            "ref_cnt": tuple(block.ref_cnt for block in pool.blocks),
            "block_hash": tuple(block.block_hash for block in pool.blocks),
            "index": {
                key: tuple(cached) for key, cached in pool.cached_block_hash_to_block.items()
            },
            "blocks": {
                r: tuple(tuple(block.block_id for block in g.req_to_blocks[r]) for g in groups)
                for r in groups[0].req_to_blocks
            },
            "hashes": {r: tuple(h) for r, h in manager.req_to_block_hashes.items() if h},
            "num_cached": dict(groups[0].num_cached_block),
            "events": tuple(pool.kv_event_queue),
            "stats": manager.prefix_cache_stats,
        }


Side = SpecIds | ImplIds


def make(side: str, kv_config: KVCacheConfig, max_model_len: int = 64, **kwargs: Any) -> Side:
    if side == "spec":
        made: Side = SpecIds(SpecKVCacheManager(kv_config, max_model_len, **kwargs))
    else:
        made = ImplIds(KVCacheManager(kv_config, max_model_len, **kwargs))
    made.check_invariants()
    return made


def admit(manager: Side, request: Request) -> Ids | None:
    """Look up, then allocate the whole prefill; on success the prompt counts as computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return new


def decode(manager: Side, request: Request, token: int = 0) -> Ids | None:
    """Sample one token after a step, then schedule it."""
    request.append_output_token_ids(token)
    new = manager.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    manager.check_invariants()
    return new


def seed(manager: Side, tokens: list[int], cached: dict[int, list[bool]]) -> None:
    """Cache `tokens`' chain of blocks in each group at the positions `cached[group]` marks
    (one fresh block per marked position), then free them: evictable, but hittable."""
    for group, marks in cached.items():
        taken = iter(manager.new_block_ids(sum(marks)))
        manager.seed_pool(
            Request(f"seed{group}", tokens), [next(taken) if m else 0 for m in marks], group
        )
    manager.check_invariants()


# -- the hit: the longest every group allows -----------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_a_window_groups_hit_skips_with_null_blocks_inside_a_hybrid_hit(side: str) -> None:
    """Full attention has 5 blocks cached; the window group (W = 5: a hit must end in 2 cached
    blocks) has positions 0, 1, 3, 4 (blocks 6, 7, 8, 9) but not 2. A lookup of 5 hashes: the
    window allows all 5, so does full attention; the window's hit skips positions 0..2."""
    manager = make(side, config(20, full(), window(5)))
    tokens = list(range(11))  # 5 full blocks and one token: 5 hashes looked up
    seed(manager, tokens, {0: [True] * 5, 1: [True, True, False, True, True]})
    hits, num_tokens = manager.get_computed_blocks(Request("a", tokens))
    assert (hits, num_tokens) == (([1, 2, 3, 4, 5], [0, 0, 0, 8, 9]), 10)


@pytest.mark.parametrize("side", SIDES)
def test_full_attention_is_trimmed_to_the_window_groups_hit(side: str) -> None:
    """The window group's cached run ends at position 2 (positions 3, 4 missing): its hit is 3
    blocks, [null, b, b]; full attention's 5 cached blocks are trimmed to 3."""
    manager = make(side, config(20, full(), window(5)))
    tokens = list(range(11))
    seed(manager, tokens, {0: [True] * 5, 1: [True, True, True, False, False]})
    hits, num_tokens = manager.get_computed_blocks(Request("a", tokens))
    assert (hits, num_tokens) == (([1, 2, 3], [0, 7, 8]), 6)


@pytest.mark.parametrize("side", SIDES)
def test_the_hit_is_a_fixed_point_rechecked_after_a_later_group_shortens_it(side: str) -> None:
    """Full attention allows 6 blocks. Round 1: the window (W = 5, its last 2 blocks) allows 5
    (positions 3, 4), chunked local (C = 4: 2 blocks a chunk; an odd length needs its last
    block) refuses 5 and allows 4. Round 2: the window refuses 4 (position 2 is missing) and
    allows 2 (positions 0, 1); the chunk allows 2 (all null). Round 3 changes nothing."""
    manager = make(side, config(30, full(), window(5), chunked(4)))
    tokens = list(range(13))  # 6 full blocks, one token more: 6 hashes looked up
    seed(
        manager,
        tokens,
        {
            0: [True] * 6,
            1: [True, True, False, True, True, False],
            2: [True, True, True, True, False, True],
        },
    )
    hits, num_tokens = manager.get_computed_blocks(Request("a", tokens))
    assert (hits, num_tokens) == (([1, 2], [7, 8], [0, 0]), 4)
    # Without the chunked group the window's first answer (5 blocks) stands.
    other = make(side, config(30, full(), window(5)))
    seed(other, tokens, {0: [True] * 6, 1: [True, True, False, True, True, False]})
    assert other.get_computed_blocks(Request("a", tokens))[1] == 10


@pytest.mark.parametrize("side", SIDES)
def test_a_hybrid_admission_takes_its_hits_and_caches_every_group(side: str) -> None:
    """The window group's leading nulls are part of the admitted request's table; the new block
    of each group comes after the hits; every full block is cached in every group."""
    manager = make(side, config(16, full(), window(5)))
    first = Request("a", list(range(9)))  # 4 full blocks + 1 token
    assert admit(manager, first) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    first.num_computed_tokens = 9
    manager.free(first)
    assert manager.state()["free_order"] == (11, 12, 13, 14, 15, 5, 4, 3, 2, 1, 10, 9, 8, 7, 6)
    second = Request("b", [*range(8), 50])  # shares the 4 full blocks
    hits, num_tokens = manager.get_computed_blocks(second)
    assert (hits, num_tokens) == (([1, 2, 3, 4], [0, 0, 8, 9]), 8)
    assert manager.allocate_slots(second, 1, hits) == ([11], [12])
    state = manager.state()
    assert state["blocks"]["b"] == ((1, 2, 3, 4, 11), (0, 0, 8, 9, 12))
    assert state["free_order"] == (13, 14, 15, 5, 10, 7, 6)
    manager.check_invariants()


# -- chunked local attention ---------------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_chunked_local_hits_are_the_last_chunks_blocks_after_nulls(side: str) -> None:
    """C = 4 tokens (2 blocks): a lookup of 4 blocks ends on a chunk boundary (all 4 null); of 3
    blocks, its chunk starts at block 2."""
    manager = make(side, config(16, full(), chunked(4)))
    first = Request("a", list(range(9)))
    assert admit(manager, first) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    manager.free(first)
    ten = Request("b", [*range(9), 99])  # 5 full blocks: 4 looked up
    assert manager.get_computed_blocks(ten) == (([1, 2, 3, 4], [0, 0, 0, 0]), 8)
    seven = Request("c", [*range(6), 77])  # 3 full blocks looked up
    assert manager.get_computed_blocks(seven) == (([1, 2, 3], [0, 0, 8]), 6)


@pytest.mark.parametrize("side", SIDES)
def test_chunked_local_frees_each_chunk_as_the_next_one_starts(side: str) -> None:
    """Blocks of earlier chunks are freed newest first when the next token's chunk starts
    past them; full attention keeps every block."""
    manager = make(side, config(16, full(), chunked(4)))
    request = Request("a", list(range(9)))
    assert admit(manager, request) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    # 9 computed: token 9's chunk starts at token 8 (block 4): blocks 0..3 are dropped.
    assert decode(manager, request) == ([], [])
    state = manager.state()
    assert state["blocks"]["a"] == ((1, 2, 3, 4, 5), (0, 0, 0, 0, 10))
    assert state["free_order"] == (11, 12, 13, 14, 15, 9, 8, 7, 6)
    assert decode(manager, request) == ([11], [12])  # 10 computed: the same chunk
    assert manager.state()["blocks"]["a"][1] == (0, 0, 0, 0, 10, 12)
    assert decode(manager, request) == ([], [])
    assert decode(manager, request) == ([13], [14])  # 12 computed: chunk at block 6
    state = manager.state()
    assert state["blocks"]["a"][1] == (0, 0, 0, 0, 0, 0, 14)
    assert state["free_order"] == (15, 9, 8, 7, 6, 12, 10)
    manager.free(request)
    assert manager.state()["free_order"] == (15, 9, 8, 7, 6, 12, 10, 13, 11, 5, 4, 3, 2, 1, 14)


# -- allocation: all or nothing, capacity across groups, touch before allocating ----------------


@pytest.mark.parametrize("side", SIDES)
def test_capacity_is_counted_across_groups(side: str) -> None:
    """7 free blocks: 4 a group do not fit two groups, though one group's 4 would; 3 a group
    do."""
    manager = make(side, config(8, full(), full()))
    big = Request("b", list(range(10, 18)))
    assert manager.get_computed_blocks(big) == (([], []), 0)
    before = manager.state()
    assert manager.allocate_slots(big, 8) is None
    assert manager.state() == before
    assert admit(manager, Request("a", list(range(6)))) == ([1, 2, 3], [4, 5, 6])
    assert manager.state()["free_order"] == (7,)


@pytest.mark.parametrize("side", SIDES)
def test_a_refused_allocation_changes_nothing_in_any_group(side: str) -> None:
    """A new request with hits in both groups that does not fit: None, no hit touched, the free
    queue in its order, the stats and events as they were."""
    manager = make(
        side,
        config(9, full(), window(3)),
        log_stats=True,
        enable_kv_cache_events=True,
    )
    first = Request("a", list(range(5)))
    assert admit(manager, first) == ([1, 2, 3], [4, 5, 6])
    manager.free(first)
    second = Request("b", [*range(4), *range(20, 26)])  # 2 hits, 3 new blocks a group
    hits, _ = manager.get_computed_blocks(second)
    assert hits == ([1, 2], [0, 5])
    manager.take_events()
    before = manager.state()
    assert manager.allocate_slots(second, 6, hits) is None  # 6 needed, 8 free, 3 are hits
    assert manager.state() == before
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_every_groups_hits_are_touched_before_any_group_takes_a_block(side: str) -> None:
    """The free queue is [1, 2, 3, 4]: a's blocks (1 in group 0, 2 in group 1), then c's. b
    hits 1 and 2; group 0's new block must not be 2, group 1's hit (at ref_cnt 0, next in the
    queue once 1 is touched): both groups' hits leave the queue first."""
    manager = make(side, config(5, full(), full()), enable_kv_cache_events=True)
    first, other = Request("a", [1, 2]), Request("c", [5, 5])
    assert admit(manager, first) == ([1], [2])
    assert admit(manager, other) == ([3], [4])
    manager.free(first)
    manager.free(other)
    assert manager.state()["free_order"] == (1, 2, 3, 4)
    h_a, h_c = manager.state()["hashes"]["a"][0], manager.state()["hashes"]["c"][0]
    events = manager.take_events()
    assert [(e.block_hashes, e.group_idx) for e in events] == [  # type: ignore[union-attr]
        ((h_a.hash_value,), 0),
        ((h_a.hash_value,), 1),
        ((h_c.hash_value,), 0),
        ((h_c.hash_value,), 1),
    ]
    assert all(isinstance(event, BlockStored) for event in events)
    second = Request("b", [1, 2, 9])
    hits, _ = manager.get_computed_blocks(second)
    assert hits == ([1], [2])
    assert manager.allocate_slots(second, 1, hits) == ([3], [4])
    state = manager.state()
    assert state["blocks"]["b"] == ((1, 3), (2, 4))
    assert state["index"] == {h_a: (1,), GroupKey(1, h_a): (2,)}
    assert manager.take_events() == [
        BlockRemoved((h_c.hash_value,), 0),
        BlockRemoved((h_c.hash_value,), 1),
    ]
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("semantics", [PAGEDKV, VLLM_0_33], ids=["pagedkv", "vllm-0.33"])
def test_free_goes_group_by_group_each_tail_first(side: str, semantics: Semantics) -> None:
    """Caching on: group 0's blocks last first, then group 1's. Under vLLM 0.33's
    `free_uncached_to_head` the unhashed last blocks go to the head, group by group."""
    manager = make(side, config(10, full(), window(3)), semantics=semantics)
    request = Request("a", list(range(7)))  # 3 full blocks + 1 token
    assert admit(manager, request) == ([1, 2, 3, 4], [5, 6, 7, 8])
    manager.free(request)
    expected = (9, 4, 3, 2, 1, 8, 7, 6, 5) if semantics == PAGEDKV else (8, 4, 9, 3, 2, 1, 7, 6, 5)
    assert manager.state()["free_order"] == expected


@pytest.mark.parametrize("side", SIDES)
def test_free_without_caching_goes_group_by_group_in_order(side: str) -> None:
    manager = make(side, config(10, full(), full()), enable_caching=False)
    request = Request("a", list(range(5)))
    assert admit(manager, request) == ([1, 2, 3], [4, 5, 6])
    manager.free(request)
    assert manager.state()["free_order"] == (7, 8, 9, 1, 2, 3, 4, 5, 6)
    assert manager.get_computed_blocks(request) == (([], []), 0)


@pytest.mark.parametrize("side", SIDES)
def test_common_prefix_blocks_are_counted_per_group(side: str) -> None:
    manager = make(side, config(16, full(), window(3)))
    first, second = Request("a", list(range(5))), Request("b", [*range(4), 9])
    admit(manager, first)
    admit(manager, second)
    assert manager.state()["blocks"]["b"] == ((1, 2, 7), (0, 5, 8))
    assert manager.get_num_common_prefix_blocks(first, 2) == (2, 0)  # a's block 4 is its own
    assert manager.get_num_common_prefix_blocks(second, 1) == (0, 0)  # the null block: 0
    assert manager.get_num_common_prefix_blocks(Request("z", [1]), 1) == (0, 0)


# -- refusals: typed, worded as the spec, atomic -------------------------------------------------


Scene = Callable[[Side], Callable[[], object]]
"""Sets a scene up on a manager; returns the call that must be refused."""


def refusal(side: str, scene: Scene) -> tuple[type, str]:
    """Set a scene up, run its refused call; nothing may change."""
    manager = make(side, config(20, full(), window(5), chunked(4)), enable_kv_cache_events=True)
    call = scene(manager)
    before = manager.state()
    with pytest.raises(PagedKVError) as info:
        call()
    assert manager.state() == before
    manager.check_invariants()
    return type(info.value), str(info.value)


def cached_and_waiting(manager: Side) -> tuple[Request, Ids]:
    first = Request("a", list(range(9)))
    admit(manager, first)
    manager.free(first)
    second = Request("b", [*range(8), 70])
    hits, _ = manager.get_computed_blocks(second)
    assert hits == ([1, 2, 3, 4], [0, 0, 8, 9], [0, 0, 0, 0])
    return second, hits


def with_hits(change: Callable[[Ids], object]) -> Scene:
    """b waits with hits in every group; the call passes `change(hits)` instead."""

    def scene(manager: Side) -> Callable[[], object]:
        request, hits = cached_and_waiting(manager)
        return lambda: manager.allocate_slots(request, 1, change(hits))  # type: ignore[arg-type]

    return scene


def reused_id(manager: Side) -> Callable[[], object]:
    cached_and_waiting(manager)
    return lambda: manager.allocate_slots(Request("b", [1]), 1)


def hashes_dropped_while_held(manager: Side) -> Callable[[], object]:
    request = Request("x", [1, 2, 3])
    admit(manager, request)
    return lambda: manager.free_block_hashes(request)


SCENES: dict[str, Scene] = {
    "unequal hit lengths": with_hits(lambda h: (h[0], h[1][:3], h[2])),
    "a hit of another group's key": with_hits(lambda h: (h[0], [0, 0, 3, 4], h[2])),
    "a full-attention block as a chunked hit": with_hits(lambda h: (h[0], h[1], [0, 0, 0, 4])),
    "a null hit in the full group": with_hits(lambda h: ([0, 2, 3, 4], h[1], h[2])),
    "a misshapen window hit": with_hits(lambda h: (h[0], [0, 0, 0, 9], h[2])),
    "hits for two groups only": with_hits(lambda h: (h[0], h[1])),
    "a flat hit list": with_hits(lambda h: h[0][:3]),
    "a foreign hit": with_hits(lambda h: (h[0], [0, 0, 8, 99], h[2])),
    "a request reusing an id": reused_id,
    "free of a str": lambda m: lambda: m.free("b"),
    "free_block_hashes while held": hashes_dropped_while_held,
    "lookup of None": lambda m: lambda: m.get_computed_blocks(None),
    "common prefix of -1": lambda m: lambda: m.get_num_common_prefix_blocks(Request("x", [1]), -1),
}


@pytest.mark.parametrize("scene", list(SCENES), ids=list(SCENES))
def test_refusals_are_typed_worded_as_the_spec_and_change_nothing(scene: str) -> None:
    spec, impl = refusal("spec", SCENES[scene]), refusal("impl", SCENES[scene])
    assert spec == impl


def test_the_refusals_say_what_is_wrong() -> None:
    assert refusal("impl", SCENES["unequal hit lengths"]) == (
        RequestError,
        "request 'b': new_computed_blocks must cover the same blocks in every KV cache group "
        "([4, 3, 4] hits per group)",
    )
    assert refusal("impl", SCENES["a hit of another group's key"])[1] == (
        "request 'b': new_computed_blocks must be the request's cached blocks (block 3 at "
        "position 2 is not cached under the request's hash there)"
    )
    assert refusal("impl", SCENES["free of a str"]) == (
        ArgumentTypeError,
        "KVCacheManager.free: request must be a Request, got 'b' (str)",
    )


CONFIG_REFUSALS: dict[str, tuple[KVCacheConfig, dict[str, Any], str]] = {
    "eagle with chunked local attention": (
        config(8, full(), chunked(4)),
        {"use_eagle": True},
        "EAGLE is not supported with chunked local attention",
    ),
    "mixed block sizes, chunked local attention below the LCM": (
        config(8, full(2), chunked(4, block_size=2), window(4, block_size=4)),
        {},
        "KV cache group 1 (chunked local attention) has block size 2: with prefix caching and "
        "groups of several block sizes, a chunked local attention group's block size must be "
        "the scheduler block size 4 (their LCM: vLLM 0.33 asserts it at the first lookup)",
    ),
    "mixed block sizes with EAGLE": (
        config(8, full(2), window(4, block_size=4)),
        {"use_eagle": True},
        "KVCacheManager with prefix caching serves groups of several block sizes ([2, 4]) only "
        "without EAGLE (vLLM 0.33 drops a block of each group's own size, then rounds the hit "
        "down to their LCM: not modelled yet)",
    ),
    "a Mamba group with caching on": (
        config(8, full(), MambaSpec(block_size=2, shapes=[(4,)], dtypes=["float16"])),
        {},
        "KV cache group 1: a Mamba group with mamba_cache_mode 'none' needs prefix caching off "
        "(vLLM 0.33 caches states only in mode 'align')",
    ),
    "a Mamba group in mode align with caching off": (
        config(
            8,
            MambaSpec(block_size=2, shapes=[(4,)], dtypes=["float16"], mamba_cache_mode="align"),
            full(),
        ),
        {"enable_caching": False},
        "KV cache group 0: a Mamba group with mamba_cache_mode 'align' needs prefix caching on "
        "(vLLM 0.33 switches it to 'none' with caching off)",
    ),
    "a vLLM 0.8.5 switch with two groups": (
        config(8, full(), window(4)),
        {"semantics": Semantics(cap_at_max_model_len=True)},
        "vLLM 0.8.5's switches need one KV cache group (0.8.5 had no hybrid manager), got 2 "
        "groups and cap_at_max_model_len",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS), ids=list(CONFIG_REFUSALS))
def test_configs_a_manager_does_not_serve_are_refused_alike(case: str) -> None:
    kv_config, kwargs, message = CONFIG_REFUSALS[case]
    for manager_class in (SpecKVCacheManager, KVCacheManager):
        with pytest.raises(KVCacheConfigError) as info:
            manager_class(kv_config, 32, **kwargs)  # type: ignore[operator]
        assert str(info.value) == message


def test_one_class_serves_one_group_or_several_and_the_old_name_is_deprecated() -> None:
    import pagedkv

    for specs in ([full()], [chunked(2)], [full(), chunked(2)], [window(3), full(), window(5)]):
        manager = KVCacheManager(config(8, *specs), 16)
        assert len(manager.coordinator.single_type_managers) == len(specs)
        SpecKVCacheManager(config(8, *specs), 16)
    with pytest.warns(DeprecationWarning, match="KVCacheManager serves any number"):
        assert pagedkv.HybridKVCacheManager is KVCacheManager


def test_a_coordinator_states_how_it_finds_hits() -> None:
    """A coordinator's documented flags, one group or several: with use_eagle, hits found for
    EAGLE (`eagle_lookup`: no vLLM 0.8.5 switch with these configs)."""
    for specs in ([full()], [full(), window(3)], [window(3), full(), window(5)]):
        for use_eagle in (False, True):
            manager = KVCacheManager(config(8, *specs), 16, use_eagle=use_eagle)
            coordinator = manager.coordinator
            flags = (coordinator.num_groups, coordinator.use_eagle, coordinator.eagle_lookup)
            assert flags == (len(specs), use_eagle, use_eagle)


def test_a_manager_lists_block_ids_per_group() -> None:
    manager = KVCacheManager(config(8, full(), chunked(2)), 16)
    request = Request("a", [1, 2, 3])
    manager.allocate_slots(request, 3)
    assert manager.get_block_ids("a") == ([1, 2], [3, 4])
    assert manager.get_block_ids("z") == ([], [])
    assert [[b.block_id for b in group] for group in manager.get_blocks("a")] == [[1, 2], [3, 4]]
    assert manager.get_blocks("z") == ((), ())
    with pytest.raises(ArgumentTypeError, match="get_block_ids: request_id must be a str"):
        manager.get_block_ids(1)
    with pytest.raises(ArgumentTypeError, match="get_blocks: request_id must be a str"):
        manager.get_blocks(None)


def test_an_overlapping_call_is_refused_and_changes_nothing() -> None:
    """The call token of KVCacheManager: held (here, taken by hand) by a running call, every
    other call on the manager or its pool is refused."""
    manager = KVCacheManager(config(8, full(), window(3)), 16)
    request = Request("a", [1, 2, 3])
    manager.allocate_slots(request, 3)
    token = manager._call_token.pop()
    try:
        for call, name in [
            (lambda: manager.free(request), "KVCacheManager.free"),
            (lambda: manager.allocate_slots(request, 1), "KVCacheManager.allocate_slots"),
            (lambda: manager.get_computed_blocks(request), "KVCacheManager.get_computed_blocks"),
            (lambda: manager.get_blocks("a"), "KVCacheManager.get_blocks"),
            (lambda: manager.block_pool.get_new_blocks(1), "BlockPool.get_new_blocks"),
        ]:
            with pytest.raises(ConcurrentUseError, match=name):
                call()
    finally:
        manager._call_token.append(token)
    assert manager.get_block_ids("a") == ([1, 2], [3, 4])
    manager.check_invariants()


# -- invariants: each hybrid one caught by name, on both sides -----------------------------------


def _held_lists(manager: Side, request_id: str) -> tuple[list[Any], ...]:
    """The request's block lists themselves (ids on the spec's side, blocks on the impl's)."""
    if isinstance(manager, SpecIds):
        return manager.manager.blocks[request_id]
    groups = manager.manager.coordinator.single_type_managers
    return tuple(group.req_to_blocks[request_id] for group in groups)


def _null(manager: Side) -> Any:
    return 0 if isinstance(manager, SpecIds) else manager.pool.null_block


def _swap_first_two(lists: tuple[list[Any], ...], group: int, null: Any) -> None:
    lists[group][0], lists[group][1] = lists[group][1], lists[group][0]


CORRUPTIONS: dict[str, tuple[Callable[[tuple[list[Any], ...], Any], None], str]] = {
    "one list longer": (
        lambda lists, null: lists[1].append(null),
        "a request's block lists cover the same token slots in every group",
    ),
    "a null block in a full-attention list": (
        lambda lists, null: [group.append(null) for group in lists],
        "null blocks only as a prefix, and only under sliding window",
    ),
    "two cached blocks of group 1 swapped": (
        lambda lists, null: _swap_first_two(lists, 1, null),
        "a request's cached block carries the hash its tokens chain to",
    ),
    "a block held by one list twice": (
        lambda lists, null: lists[1].__setitem__(0, lists[1][1]),
        "a block's ref_cnt is the number of requests holding it",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_each_hybrid_invariant_is_caught_by_name_on_both_sides(case: str) -> None:
    corrupt, name = CORRUPTIONS[case]
    for side in SIDES:
        manager = make(side, config(12, full(), window(5)))
        admit(manager, Request("a", list(range(5))))  # 2 cached blocks + 1 in each group
        corrupt(_held_lists(manager, "a"), _null(manager))
        with pytest.raises(InvariantViolation) as info:
            manager.check_invariants()
        assert info.value.invariant == name, (side, str(info.value))


def test_debug_invariants_checks_after_each_call() -> None:
    manager = KVCacheManager(config(12, full(), window(5)), 32, debug_invariants=True)
    request = Request("a", list(range(5)))
    manager.allocate_slots(request, 5)
    groups = manager.coordinator.single_type_managers
    groups[0].num_cached_block["a"] = 3  # more cached blocks than full ones
    with pytest.raises(InvariantViolation, match="cached blocks are full blocks"):
        manager.free_block_hashes(Request("b", [1]))


# -- one group: vLLM 0.33's unitary coordinator ------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_one_group_finds_an_eagle_hit_without_the_hybrid_margin(side: str) -> None:
    """vLLM 0.33 looks one group up with its unitary coordinator, several with its hybrid one.
    With EAGLE, one sliding-window group's hit lies within the lookup (the prompt's last full
    block left out), found for a window one block wider, less its last block; two groups of
    that window look one block further first (the hybrid coordinator's margin), so their hit
    ends one block later."""
    found = {}
    for num_groups in (1, 2):
        manager = make(side, config(16, *[window(3)] * num_groups), 32, use_eagle=True)
        first = Request("a", list(range(8)))  # 4 full blocks, all cached once computed
        admit(manager, first)
        manager.free(first)
        hits, num_tokens = manager.get_computed_blocks(Request("b", list(range(8))))
        found[num_groups] = (hits[0], num_tokens)
        manager.check_invariants()
    assert found == {1: ([0, 2], 4), 2: ([0, 0, 3], 6)}


# -- several groups with EAGLE: vLLM 0.33's procedure (the spec's `eagle_common_hit`) ------------

T, F = True, False

EAGLE_SCENES: dict[str, tuple[tuple[KVCacheSpec, ...], int, dict[int, list[bool]], Ids, int]] = {
    # 6 hashes looked up. Pass 1: full attention's 6, less the last: 5. Window 3 (its hit ends
    # in 1 cached block, 2 for EAGLE) within 6: positions 3, 4, less the last: 4. Window 5 (2
    # cached, 3 for EAGLE) within 5: positions 0..2, less the last: 2. Pass 2 at 2 asks the
    # windows again without EAGLE's margin: window 3 ends on position 1, window 5 keeps 0, 1.
    # One pass would leave window 3 at 4 blocks; asking it for EAGLE again (within 3, position
    # 2 missing) would shorten the hit to 1.
    "a later window shortens: the earlier one is asked again": (
        (full(), window(3), window(5)),
        13,
        {0: [T] * 6, 1: [T, T, F, T, T, F], 2: [T, T, T, F, T, T]},
        ([1, 2], [0, 8], [11, 12]),
        4,
    ),
    # Three windows, no full attention. Pass 1: window 3 within 6: 5; window 5 within 6:
    # positions 3..5, less the last: 5; window 7 (3 cached, 4 for EAGLE) within 6: only the run
    # 0..2 from the start, less the last: 2. Pass 2 at 2: window 3 keeps 2, so the others stay
    # verified and keep 2 without EAGLE's margin (asked for EAGLE, window 5 would miss position
    # 2 and shorten the hit to 1).
    "a window that keeps the length leaves the others verified": (
        (window(3), window(5), window(7)),
        13,
        {0: [T] * 6, 1: [T, T, F, T, T, T], 2: [T, T, T, F, T, T]},
        ([0, 2], [7, 8], [12, 13]),
        4,
    ),
    # Full attention is looked up first, whatever the config's order: its 3 blocks less the
    # last leave 2, and window 3 within 3 (position 2 missing) keeps the run 0, 1 less the
    # last: 1, in a single pass. The window first would find positions 4, 5 and then settle
    # at 2 with full attention.
    "full attention first, in one pass": (
        (window(3), full()),
        13,
        {0: [T, T, F, T, T, T], 1: [T, T, T, F, T, T]},
        ([1], [6]),
        2,
    ),
    # A window of 1 reads no earlier token: for EAGLE its hit ends on one cached block. Within
    # 4 (full attention's 4, less the last: 3) the last cached position is 2; less the last: 2
    # nulls. One full-attention unit and one other make a single pass: asked again without
    # EAGLE, the window would end on its block at position 1 instead.
    "a window of one: a single pass": (
        (full(), window(1)),
        9,
        {0: [T] * 4, 1: [T, T, T, F]},
        ([1, 2], [0, 0]),
        4,
    ),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("scene", list(EAGLE_SCENES), ids=list(EAGLE_SCENES))
def test_eagle_hits_of_several_groups_follow_vllms_passes(side: str, scene: str) -> None:
    specs, num_tokens, cached, expected, hit_tokens = EAGLE_SCENES[scene]
    manager = make(side, config(40, *specs), 32, use_eagle=True)
    tokens = list(range(num_tokens))
    seed(manager, tokens, cached)
    request = Request("a", tokens)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert (hits, num_hit_tokens) == (expected, hit_tokens)
    # The manager takes the hit it found: each group's blocks start with it.
    assert manager.allocate_slots(request, num_tokens - hit_tokens, hits) is not None
    held = manager.state()["blocks"]["a"]
    assert tuple(group[: len(hit)] for group, hit in zip(held, hits, strict=True)) == tuple(
        map(tuple, expected)
    )


@pytest.mark.parametrize("side", SIDES)
def test_an_eagle_hit_of_nulls_alone_is_refused_for_the_wider_window(side: str) -> None:
    """With EAGLE a window hit is found for a window one block wider (W = 3: 2 blocks), then
    drops its last block: after its nulls it keeps 1 cached block, so nulls alone are refused;
    the hit the lookup found is taken."""
    manager = make(side, config(16, window(3)), 32, use_eagle=True)
    first = Request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    second = Request("b", list(range(8)))
    hits, num_tokens = manager.get_computed_blocks(second)
    assert (hits, num_tokens) == (([0, 2],), 4)
    before = manager.state()
    with pytest.raises(RequestError) as info:
        manager.allocate_slots(second, 4, ([0, 0],))
    assert str(info.value) == (
        "request 'b': new_computed_blocks is not a hit this attention type can produce "
        "(2 null blocks, then 0 blocks; the window needs 1)"
    )
    assert manager.state() == before
    assert manager.allocate_slots(second, 4, hits) is not None
    manager.check_invariants()


# -- a seeded differential run -------------------------------------------------------------------


def random_config(rng: random.Random) -> tuple[KVCacheConfig, dict[str, Any], int]:
    block_size = rng.choice((1, 2, 3))
    specs: list[KVCacheSpec] = []
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice(("full", "window", "chunked"))
        if kind == "full":
            specs.append(full(block_size))
        elif kind == "window":
            specs.append(window(rng.randint(2, 7), block_size))
        else:
            specs.append(chunked(rng.randint(1, 8), block_size))
    has_chunked = any(isinstance(spec, ChunkedLocalAttentionSpec) for spec in specs)
    kwargs = {
        "enable_caching": rng.random() < 0.9,
        "use_eagle": not has_chunked and rng.random() < 0.3,
        "log_stats": True,
        "semantics": rng.choice((PAGEDKV, VLLM_0_33)),
        "enable_kv_cache_events": True,
        "caching_hash_algo": rng.choice(("sha256", "builtin")),
    }
    num_blocks = rng.randint(4, 12) * len(specs) + 1
    return config(num_blocks, *specs), kwargs, rng.choice((12, 18, 24))


class Run:
    """One seeded run: a random config of 2-4 groups, the spec and the implementation driven
    alike by a small scheduler (arrivals sharing a few prefixes, admissions with hits and
    chunked prefill, decode with drafts and lookahead, preemption, finishing, resets, refused
    calls), every outcome compared (equal results, or the same error class and message), then
    the whole state of both and their invariants."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        kv_config, kwargs, self.max_model_len = random_config(rng)
        self.spec = make("spec", kv_config, self.max_model_len, **kwargs)
        self.impl = make("impl", kv_config, self.max_model_len, **kwargs)
        self.num_groups = len(kv_config.kv_cache_groups)
        self.seed = seed
        self.prefixes = [[rng.choice((1, 2, 3)) for _ in range(rng.randint(2, 8))] for _ in "ab"]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.arrivals = 0
        self.seen: Counter[str] = Counter()

    def call(self, what: Callable[[Side], object]) -> tuple[bool, object]:
        """`what` on both sides: (True, the result) or (False, the error)."""
        outcomes: list[tuple[object, object]] = []
        for side in (self.spec, self.impl):
            try:
                outcomes.append(("ok", what(side)))
            except PagedKVError as error:
                outcomes.append((type(error), str(error)))
        assert outcomes[0] == outcomes[1], (self.seed, outcomes)
        assert self.spec.state() == self.impl.state(), self.seed
        self.spec.check_invariants()
        self.impl.check_invariants()
        ok = outcomes[0][0] == "ok"
        self.seen["refused" if not ok else "ok"] += 1
        return ok, outcomes[0][1]

    def step(self) -> None:
        rng = self.rng
        op = rng.choice(
            ("arrive", "admit", "admit", "run", "run", "run", "preempt", "misc", "misc")
        )
        if op == "arrive" or (op in ("admit", "run") and not self.waiting and not self.running):
            self.arrive()
        elif (op == "admit" and self.waiting) or (op == "run" and not self.running):
            self.admit(self.waiting.pop(rng.randrange(len(self.waiting))))
        elif op == "run":
            self.schedule(rng.choice(self.running))
        elif op == "preempt" and self.running:
            request = self.running.pop(rng.randrange(len(self.running)))
            self.call(lambda m: m.free(request))
            request.num_computed_tokens = 0
            self.waiting.append(request)
        else:
            self.misc()

    def arrive(self) -> None:
        rng = self.rng
        prefix = rng.choice((*self.prefixes, []))
        tokens = prefix + [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 4))]
        self.arrivals += 1
        self.waiting.append(Request(f"r{self.arrivals}", tokens))

    def admit(self, request: Request) -> None:
        rng = self.rng
        ok, looked_up = self.call(lambda m: m.get_computed_blocks(request))
        assert ok and isinstance(looked_up, tuple)
        hits, num_hit_tokens = looked_up
        num_tokens = rng.randint(1, request.num_tokens - num_hit_tokens)  # chunked prefill
        lookahead = rng.choice((0, 0, 1, 2))
        ok, new = self.call(lambda m: m.allocate_slots(request, num_tokens, hits, lookahead))
        if ok and new is not None:
            request.num_computed_tokens = num_hit_tokens + num_tokens
            self.running.append(request)
            self.seen["admitted with hits" if num_hit_tokens else "admitted"] += 1
            self.seen["nulls in a hit"] += any(0 in group for group in hits)
        else:
            self.seen["not admitted"] += 1
            self.waiting.append(request)

    def schedule(self, request: Request) -> None:
        rng = self.rng
        drafts: list[int] = []
        if request.num_computed_tokens == request.num_tokens:  # decode
            request.append_output_token_ids(rng.choice((1, 2, 3)))
            drafts = [rng.choice((1, 2)) for _ in range(rng.choice((0, 0, 1, 2)))]
            num_tokens = 1 + len(drafts)
        else:  # the rest of a chunked prefill
            num_tokens = rng.randint(1, request.num_tokens - request.num_computed_tokens)
        request.spec_token_ids = drafts
        lookahead = rng.choice((0, 0, 1))
        ok, new = self.call(lambda m: m.allocate_slots(request, num_tokens, None, lookahead))
        request.spec_token_ids = []
        if ok and new is not None:
            request.num_computed_tokens += num_tokens - len(drafts)
            self.seen["scheduled"] += 1
            return
        self.seen["preempted" if ok else "past max_model_len"] += 1
        self.running.remove(request)
        self.call(lambda m: m.free(request))
        request.num_computed_tokens = 0
        if request.num_tokens + 4 <= self.max_model_len:
            self.waiting.append(request)
        else:
            self.call(lambda m: m.free_block_hashes(request))

    def misc(self) -> None:
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:
            self.call(lambda m: m.reset_prefix_cache())
        elif choice == 1 and self.running:
            request = rng.choice(self.running)
            count = rng.randint(0, 3)
            self.call(lambda m: m.get_num_common_prefix_blocks(request, count))
        elif choice == 2:
            self.call(lambda m: m.make_prefix_cache_stats())
            self.call(lambda m: m.take_events())
        elif choice == 3 and self.waiting:  # one group's hits one shorter: refused alike
            request = rng.choice(self.waiting)
            ok, looked_up = self.call(lambda m: m.get_computed_blocks(request))
            assert ok and isinstance(looked_up, tuple)
            hits = [list(group) for group in looked_up[0]]
            if hits[0]:
                hits[rng.randrange(len(hits))].pop(0)
                self.call(lambda m: m.allocate_slots(request, 1, tuple(hits)))
        elif choice == 4 and self.running:  # hits for a running request: refused alike
            request = rng.choice(self.running)
            held = self.spec.state()["blocks"].get(request.request_id)
            if held:
                hits = tuple(list(group[:1]) for group in held)
                self.call(lambda m: m.allocate_slots(request, 1, hits))
        elif choice == 5 and self.running:  # a finished request
            request = self.running.pop(rng.randrange(len(self.running)))
            self.call(lambda m: m.free(request))
            self.call(lambda m: m.free_block_hashes(request))

    def finish(self) -> None:
        for request in self.running:
            self.call(lambda m, r=request: m.free(r))
        ref_cnt = self.spec.state()["ref_cnt"]
        assert ref_cnt == (0,) * len(ref_cnt)


def test_spec_and_impl_agree_step_by_step_on_random_hybrid_runs() -> None:
    seen: Counter[str] = Counter()
    for seed in range(12):
        run = Run(seed)
        for _ in range(80):
            run.step()
        run.finish()
        seen += run.seen
    # The runs exercised what they are for.
    assert seen["ok"] >= 900 and seen["refused"] >= 30, seen
    assert seen["admitted with hits"] >= 50 and seen["nulls in a hit"] >= 30, seen
    assert seen["preempted"] >= 8 and seen["not admitted"] >= 30, seen
