"""evict_blocks (vLLM 0.33's, a KV connector's call for blocks whose load failed), spec and
impl side by side: the hash goes, the block stays where it is; bad ids are refused before
anything changes; the manager's invariants excuse exactly what the call leaves behind.

Pools of 6 blocks (free queue 1..5), block size 2; managers of 10 blocks (1..9), block size 4.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from manager_fixtures import MANAGER_FACTORIES, OneGroupView, manager_config

from pagedkv import (
    ArgumentTypeError,
    BlockStateError,
    KVCacheManager,
    Request,
    sha256,
)
from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.protocol import PoolFactory, PoolUnderTest
from pagedkv.spec.manager import SpecKVCacheManager, check_prefix_closure
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_events import BlockRemoved
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_33

POOLS = [pytest.param(spec_pool, id="spec"), pytest.param(pagedkv_pool, id="impl")]


@pytest.fixture(params=POOLS)
def make_pool(request: pytest.FixtureRequest) -> Callable[..., PoolUnderTest]:
    factory: PoolFactory = request.param

    def make(events: bool = True) -> PoolUnderTest:
        return factory(6, True, PAGEDKV, events)  # type: ignore[call-arg]

    return make


@pytest.fixture(params=sorted(MANAGER_FACTORIES))
def side(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sealed_pool(make_pool: Callable[..., PoolUnderTest]) -> tuple[PoolUnderTest, list[int]]:
    """Blocks 1, 2 cached for tokens 0..3 and freed (tail first); 3, 4 held, uncached."""
    pool = make_pool()
    blocks = pool.get_new_blocks(4)
    hashes: list[BlockHashType] = []
    pool.cache_full_blocks(Request("r", range(4)), blocks[:2], hashes, 0, 2, 2, sha256)
    pool.free_blocks([2, 1])
    pool.take_events()  # type: ignore[attr-defined]
    pool.check_invariants()
    return pool, blocks


def test_a_free_cached_block_loses_its_hash_and_keeps_its_place(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool, _ = sealed_pool(make_pool)
    before = pool.snapshot()
    assert before.free_order == (5, 2, 1)
    pool.evict_blocks([2])
    pool.check_invariants()
    after = pool.snapshot()
    assert after.free_order == (5, 2, 1)  # no move: the queue order is untouched
    assert 2 not in {block for blocks in after.index.values() for block in blocks}
    assert 1 in {block for blocks in after.index.values() for block in blocks}
    events = pool.take_events()  # type: ignore[attr-defined]
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)


def test_held_shared_unhashed_and_repeated_blocks(
    make_pool: Callable[..., PoolUnderTest],
) -> None:
    pool, _ = sealed_pool(make_pool)
    pool.touch([1, 1])  # block 1 held twice: SHARED and cached
    pool.evict_blocks([1, 3, 0, 1])  # 3 unhashed and held, 0 the null block, 1 listed twice
    pool.check_invariants()
    snapshot = pool.snapshot()
    assert snapshot.free_order == (5, 2)
    assert {block for blocks in snapshot.index.values() for block in blocks} == {2}
    pool.free_blocks([1])
    pool.free_blocks([1])  # now unhashed: it joins the queue as any uncached block does
    pool.check_invariants()
    assert pool.snapshot().free_order == (5, 2, 1)


@pytest.mark.parametrize(
    ("block_ids", "error"),
    [
        ([2, 6], BlockStateError),  # 6 is past the pool: nothing evicted, 2 included
        ([1, -1], BlockStateError),
        ([1, True], ArgumentTypeError),
        ([1, "2"], ArgumentTypeError),
        (7, ArgumentTypeError),
    ],
)
def test_a_bad_id_is_refused_before_anything_changes(
    make_pool: Callable[..., PoolUnderTest], block_ids: object, error: type[Exception]
) -> None:
    pool, _ = sealed_pool(make_pool)
    before = pool.snapshot()
    with pytest.raises(error):
        pool.evict_blocks(block_ids)  # type: ignore[arg-type]
    assert pool.snapshot() == before
    assert pool.take_events() == []  # type: ignore[attr-defined]
    pool.check_invariants()


def make(side: str, **kwargs: object) -> OneGroupView:
    manager = MANAGER_FACTORIES[side](manager_config(**kwargs))  # type: ignore[arg-type]
    manager.check_invariants()
    return manager


def admit(manager: OneGroupView, request: Request) -> list[int] | None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return new


def test_a_later_lookup_stops_at_the_evicted_block(side: str) -> None:
    manager = make(side)
    first = Request("a", range(13))  # blocks 1, 2, 3 full and cached, 4 partial
    assert admit(manager, first) == [1, 2, 3, 4]
    manager.evict_blocks([2])  # the connector could not load the second block
    manager.check_invariants()
    again = Request("b", range(13))
    assert manager.get_computed_blocks(again) == ([1], 4)  # block 3 is cached, unreachable


def test_the_holder_goes_on_caching_past_the_evicted_block(side: str) -> None:
    manager = make(side)
    request = Request("a", range(7))  # block 1 full and cached, block 2 partial
    assert admit(manager, request) == [1, 2]
    manager.evict_blocks([1])
    for token in (7,):  # fills block 2: cached, chained through the stored hash of block 1
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    manager.check_invariants()
    snapshot = manager.snapshot()
    assert {block for blocks in snapshot.pool.index.values() for block in blocks} == {2}
    manager.free(request)
    manager.check_invariants()
    # pagedkv frees tail first to the tail, uncached or not: block 1 (no hash) after block 2.
    assert manager.snapshot().pool.free_order[-2:] == (2, 1)


def test_under_vllm_0_33_an_evicted_block_is_freed_to_the_head(side: str) -> None:
    manager = make(side, semantics=VLLM_0_33)
    request = Request("a", range(9))  # blocks 1, 2 full and cached, block 3 partial
    assert admit(manager, request) == [1, 2, 3]
    manager.evict_blocks([2])
    manager.free(request)
    manager.check_invariants()
    assert manager.snapshot().pool.free_order[:2] == (3, 2)  # unhashed: reused first


def test_a_shared_block_that_lost_its_hash_is_excused_only_for_its_holders(side: str) -> None:
    manager = make(side)
    first, second = Request("a", range(9)), Request("b", range(9))
    assert admit(manager, first) == [1, 2, 3]
    assert admit(manager, second) == [4]  # hits blocks 1 and 2
    manager.evict_blocks([1])  # held by both: SHARED without a hash
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    manager.check_invariants()
    third = Request("c", range(9))
    assert admit(manager, third) is not None  # no hit: block 1's key is gone
    manager.check_invariants()


def test_invariants_still_catch_an_unhashed_cached_position_nobody_evicted() -> None:
    """The excuse is the recorded (group, position, block), not any missing hash."""
    manager = KVCacheManager(manager_config().kv_cache_config, 64)
    request = Request("a", range(9))
    hits, _ = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 9, hits)
    block = manager.get_blocks("a")[0][0]
    manager.block_pool.cached_block_hash_to_block.pop(block.block_hash)
    block.reset_hash()  # a hash lost behind the manager's back
    with pytest.raises(InvariantViolation, match="carries the hash its tokens chain to"):
        manager.check_invariants()


def test_prefix_closure_is_waived_only_below_an_evicted_key() -> None:
    spec = SpecKVCacheManager(manager_config().kv_cache_config, 64)
    request = Request("a", range(13))
    hits, _ = spec.get_computed_blocks(request)
    spec.allocate_slots(request, 13, hits)
    spec.evict_blocks([1])
    spec.free(request)
    spec.check_invariants()  # blocks 2 and 3 stay cached below the evicted key
    parent_of = dict(spec.parent_of)
    with pytest.raises(InvariantViolation, match="prefix closure"):
        check_prefix_closure(spec.pool.index, parent_of, [0])  # without the waiver
