"""The switches of the `vllm-0.33` semantics, one scenario each, on the spec and the impl.

Exact free-queue orders and usage values: each switch changes nothing else, and leaving it off
keeps pagedkv's (and vLLM 0.8.5's) behaviour. `tests/test_vllm_conformance.py` shows vLLM
0.33.0's own code diverging from the spec as soon as any one of them is flipped.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from manager_fixtures import MANAGER_FACTORIES, manager_config

from pagedkv import BlockStateError, FreeKVCacheBlockQueue, KVCacheBlock, Request, sha256
from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.protocol import PoolFactory
from pagedkv.vocab.errors import FreeQueueError
from pagedkv.vocab.semantics import PAGEDKV, SEMANTICS_BY_NAME, VLLM_0_8_5, VLLM_0_33

POOLS = [pytest.param(spec_pool, id="spec"), pytest.param(pagedkv_pool, id="impl")]
HEAD_FIRST = replace(PAGEDKV, free_uncached_to_head=True)


@pytest.mark.parametrize("factory", POOLS)
@pytest.mark.parametrize(
    ("semantics", "usage"), [(PAGEDKV, 0.5), (VLLM_0_8_5, 0.5), (VLLM_0_33, 1 / 3)]
)
def test_usage_leaves_the_null_block_out_only_under_vllm_0_33(
    factory: PoolFactory, semantics: object, usage: float
) -> None:
    pool = factory(4, True, semantics)  # type: ignore[arg-type]
    pool.get_new_blocks(1)  # 2 of 4 blocks used, counting the null block; 1 of 3 without it
    assert pool.get_usage() == pytest.approx(usage)
    assert pool.snapshot().usage == pytest.approx(usage)


@pytest.mark.parametrize("factory", POOLS)
def test_a_pool_of_only_the_null_block_has_usage_0_under_vllm_0_33(factory: PoolFactory) -> None:
    assert factory(1, True, VLLM_0_33).get_usage() == 0.0


@pytest.mark.parametrize("factory", POOLS)
def test_freed_unhashed_blocks_go_to_the_head_in_the_callers_order(factory: PoolFactory) -> None:
    pool = factory(7, True, HEAD_FIRST)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4; queue 5 6
    request = Request("r", [1, 2, 3, 4])
    pool.cache_full_blocks(request, [1, 2], [], 0, 2, 2, sha256)  # 1 and 2 get hashes
    pool.free_blocks([3, 1, 4, 2])
    # 3 and 4 hold nothing reusable: reused first, in the order given; 1 and 2 join the tail.
    assert pool.snapshot().free_order == (3, 4, 5, 6, 1, 2)
    assert pool.get_new_blocks(2) == [3, 4]
    pool.check_invariants()
    assert blocks == [1, 2, 3, 4]


@pytest.mark.parametrize("factory", POOLS)
def test_without_the_switch_every_freed_block_joins_the_tail(factory: PoolFactory) -> None:
    pool = factory(7, True, PAGEDKV)
    pool.get_new_blocks(4)
    pool.free_blocks([3, 1, 4, 2])
    assert pool.snapshot().free_order == (5, 6, 3, 1, 4, 2)


@pytest.mark.parametrize("factory", POOLS)
def test_a_refused_free_changes_nothing_under_the_switch(factory: PoolFactory) -> None:
    pool = factory(5, True, HEAD_FIRST)
    pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(BlockStateError, match="twice"):
        pool.free_blocks([1, 2, 1])
    assert pool.snapshot() == before


@pytest.mark.parametrize("side", sorted(MANAGER_FACTORIES))
@pytest.mark.parametrize(
    ("switch", "free_order"), [(False, (3, 1, 2)), (True, (3, 2, 1))], ids=["in order", "tail"]
)
def test_free_without_caching_releases_tail_first_only_under_the_switch(
    side: str, switch: bool, free_order: tuple[int, ...]
) -> None:
    semantics = replace(PAGEDKV, free_tail_first_without_caching=switch)
    config = manager_config(block_size=2, num_blocks=4, enable_caching=False, semantics=semantics)
    manager = MANAGER_FACTORIES[side](config)
    request = Request("r", [1, 2, 3, 4])
    assert manager.allocate_slots(request, 4) == [1, 2]
    manager.free(request)
    assert manager.snapshot().pool.free_order == free_order
    manager.check_invariants()


def test_the_vllm_0_33_semantics_is_named_and_listed() -> None:
    assert SEMANTICS_BY_NAME["vllm-0.33"] is VLLM_0_33
    assert VLLM_0_33.name == "vllm-0.33"
    assert not VLLM_0_33.null_block_refcounted  # vLLM 0.33 passes over the null block too
    assert replace(VLLM_0_33, free_uncached_to_head=False).name.startswith("Semantics(")


def test_appendleft_links_a_block_at_the_head_and_refuses_a_queued_one() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 0, 1]
    queue.check_invariants()
    with pytest.raises(FreeQueueError, match="already in the free queue"):
        queue.appendleft(blocks[0])
    with pytest.raises(FreeQueueError, match="appendleft of a block of another free queue"):
        queue.appendleft(KVCacheBlock(3))
    only = KVCacheBlock(7)
    single = FreeKVCacheBlockQueue([only])
    assert single.popleft() is only
    single.appendleft(only)
    assert [b.block_id for b in single.get_all_free_blocks()] == [7]
    single.check_invariants()
