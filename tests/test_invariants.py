"""check_invariants() catches each kind of corruption, in the spec and in the implementation.

Every invariant is stated once in `SpecBlockPool.check_invariants` and mirrored by
`BlockPool.check_invariants` (which also checks the free queue's links); the request-level ones
are stated in `SpecKVCacheManager.check_invariants`. Each test corrupts one thing and expects the
violation to be named. (`tests/test_invariant_reports.py` pins the implementation's reports.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv import (
    BlockHashType,
    BlockPool,
    FullAttentionSpec,
    InvariantViolation,
    KVCacheBlock,
    Request,
    SlidingWindowSpec,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.spec import BlockState, Event, SpecBlockPool, block_state
from pagedkv.spec import block_pool as spec_block_pool
from pagedkv.spec.manager import SpecKVCacheManager

H = BlockHashType(1, (1,), None)


def _spec() -> SpecBlockPool:
    pool = SpecBlockPool(5, True)
    pool.get_new_blocks(2)  # 1, 2 in use; 3, 4 free
    pool.cache_full_blocks(Request("r", [1]), [1], [], 0, 1, 1, sha256)
    pool.check_invariants()
    return pool


def _impl() -> BlockPool:
    pool = BlockPool(5, True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(Request("r", [1]), blocks, [], 0, 1, 1, sha256)
    pool.check_invariants()
    return pool


SPEC_CORRUPTIONS: list[tuple[str, Callable[[SpecBlockPool], None]]] = [
    ("the null block is never free", lambda p: p.free_order.append(0)),
    ("the null block is never hashed", lambda p: p.block_hash.__setitem__(0, H)),
    ("the null block's ref_cnt stays 0", lambda p: p.ref_cnt.__setitem__(0, 1)),
    ("no block twice in the free order", lambda p: p.free_order.append(3)),
    ("a block is in the free queue iff its ref_cnt is 0", lambda p: p.free_order.remove(4)),
    ("a block is in the free queue iff its ref_cnt is 0", lambda p: p.ref_cnt.__setitem__(3, 1)),
    ("ref_cnt >= 0", lambda p: p.ref_cnt.__setitem__(2, -1)),
    ("hash index <=> hashed blocks", lambda p: p.block_hash.__setitem__(2, H)),
    ("hash index <=> hashed blocks", lambda p: p.index.clear()),
    ("index entries are non-empty", lambda p: p.index.__setitem__(H, [])),
    ("free blocks belong to the pool", lambda p: p.free_order.append(7)),
]


@pytest.mark.parametrize(("invariant", "corrupt"), SPEC_CORRUPTIONS)
def test_spec_names_the_broken_invariant(
    invariant: str, corrupt: Callable[[SpecBlockPool], None]
) -> None:
    pool = _spec()
    corrupt(pool)
    with pytest.raises(InvariantViolation, match=invariant.replace("(", r"\(").replace(")", r"\)")):
        pool.check_invariants()


def _unlink_middle(pool: BlockPool) -> None:
    block = pool.blocks[3]
    block.next_free_block = None  # breaks the chain after block 3


def _owned(pool: BlockPool | None, block_id: int) -> KVCacheBlock:
    """A new block object owned by `pool`'s free queue (None: by no queue)."""
    block = KVCacheBlock(block_id)
    block.owner_queue = None if pool is None else pool.free_block_queue
    block.ref_cnt = 1
    return block


IMPL_CORRUPTIONS: list[tuple[str, Callable[[BlockPool], None]]] = [
    (
        "num_free_blocks counts the queue",
        lambda p: setattr(p.free_block_queue, "num_free_blocks", 5),
    ),
    ("free queue tail is its last block", _unlink_middle),
    (
        "free queue links agree both ways",
        lambda p: setattr(p.blocks[4], "prev_free_block", p.blocks[1]),
    ),
    ("the null block is never hashed", lambda p: setattr(p.null_block, "_block_hash", H)),
    ("the null block's ref_cnt stays 0", lambda p: setattr(p.null_block, "ref_cnt", 1)),
    ("iff its ref_cnt is 0", lambda p: setattr(p.blocks[2], "ref_cnt", 0)),
    ("ref_cnt >= 0", lambda p: setattr(p.blocks[2], "ref_cnt", -1)),
    ("hash index <=> hashed blocks", lambda p: setattr(p.blocks[2], "_block_hash", H)),
    ("hash index <=> hashed blocks", lambda p: p.blocks[1].reset_hash()),
    ("index entries are non-empty", lambda p: p.cached_block_hash_to_block.__setitem__(H, {})),
    ("free blocks belong to the pool", lambda p: p.blocks.__setitem__(3, _owned(p, 3))),
    (
        "every block belongs to the pool's free queue",
        lambda p: p.blocks.__setitem__(2, _owned(None, 2)),
    ),
]


@pytest.mark.parametrize(("invariant", "corrupt"), IMPL_CORRUPTIONS)
def test_impl_names_the_broken_invariant(
    invariant: str, corrupt: Callable[[BlockPool], None]
) -> None:
    pool = _impl()
    corrupt(pool)
    with pytest.raises(InvariantViolation, match=invariant.replace("(", r"\(").replace(")", r"\)")):
        pool.check_invariants()


def test_a_cycle_in_the_free_queue_is_reported_not_looped_on() -> None:
    pool = _impl()
    last = pool.free_block_queue.free_list_tail
    assert last is not None
    last.next_free_block = pool.blocks[3]
    with pytest.raises(InvariantViolation, match=r"no block twice in the free order|agree"):
        pool.check_invariants()


def test_every_spec_state_change_is_checked_against_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the (FREE, ALLOC) entry, the spec refuses to hand out a free block."""
    table = dict(block_state.TRANSITIONS)
    del table[(BlockState.FREE, Event.ALLOC)]
    monkeypatch.setattr(spec_block_pool, "TRANSITIONS", table)
    pool = SpecBlockPool(3, True)
    with pytest.raises(InvariantViolation, match="free --get_new_blocks--> in use"):
        pool.get_new_blocks(1)


# -- the spec manager: each request-level invariant, corrupted once ------------------------------


def _spec_manager(
    *, caching: bool = True, window: int | None = None, max_model_len: int = 64
) -> SpecKVCacheManager:
    kv_spec = (
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
        if window is None
        else SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window
        )
    )
    return SpecKVCacheManager(
        uniform_kv_cache_config(kv_spec, 10), max_model_len=max_model_len, enable_caching=caching
    )


def _admit(manager: SpecKVCacheManager, request_id: str, num_tokens: int) -> Request:
    """Admit a request of `num_tokens` tokens with its whole prompt computed (no hits)."""
    request = Request(request_id, range(num_tokens))
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    manager.check_invariants()
    return request


def _held(m: SpecKVCacheManager, request_id: str) -> list[int]:
    """The request's block-id list itself (the one group's per-type manager's)."""
    return m.managers[0].blocks[request_id]


def _null_under_full_attention(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)
    _held(m, "a").insert(0, 0)


def _null_after_a_real_block(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)
    _held(m, "a").append(0)


def _too_many_blocks(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 8)
    _held(m, "a").append(_held(m, "a")[0])
    m.pool.ref_cnt[_held(m, "a")[0]] += 1  # the extra holder counted, so only the length is off


def _ref_cnt_off(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)
    m.pool.ref_cnt[1] = 2


def _shared_without_hash(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)  # blocks 1, 2
    _admit(m, "b", 3)  # block 3
    _held(m, "b").append(1)
    m.pool.ref_cnt[1] = 2


def _tracked_without_blocks(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)
    m.requests["ghost"] = Request("ghost", [1])


def _more_cached_than_full(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)  # one full block, one stored hash
    m.hashes["a"].append(H)
    m.num_cached["a"] = 2


def _cached_block_with_another_hash(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 9)
    m.hashes["a"][1] = H


def _stored_hash_off_the_chain(m: SpecKVCacheManager) -> None:
    request = Request("a", range(12))
    m.get_computed_blocks(request)  # stores the 3 hashes of the full blocks
    assert m.allocate_slots(request, 4) is not None  # a chunk: 1 block cached
    request.num_computed_tokens = 4
    m.hashes["a"][2] = H  # stored, not cached: only the chain check sees it


def _stored_hash_past_the_tokens(m: SpecKVCacheManager) -> None:
    _admit(m, "a", 6)  # one full block, one stored hash
    m.hashes["a"].append(H)


def _parent_evicted_before_child(m: SpecKVCacheManager) -> None:
    request = _admit(m, "a", 9)  # blocks 1 and 2 cached, 1's hash is 2's parent
    m.free(request)
    root = m.pool.block_hash[1]
    assert root is not None
    del m.pool.index[root]  # as if block 1 were evicted first, which tail-first freeing prevents
    m.pool.block_hash[1] = None


SPEC_MANAGER_CORRUPTIONS: list[tuple[str, dict[str, int], Callable[[SpecKVCacheManager], None]]] = [
    ("null blocks only as a prefix", {}, _null_under_full_attention),
    (
        "null blocks only as a prefix, and only under sliding",
        {"window": 4},
        _null_after_a_real_block,
    ),
    ("a request holds at most cdiv(max_model_len", {"max_model_len": 8}, _too_many_blocks),
    ("a block's ref_cnt is the number of requests holding it", {}, _ref_cnt_off),
    ("a block held by two requests is cached", {"caching": False}, _shared_without_hash),
    ("every tracked request has blocks or stored hashes", {}, _tracked_without_blocks),
    ("a request's cached blocks are full blocks with stored hashes", {}, _more_cached_than_full),
    ("a request's cached block carries the hash", {}, _cached_block_with_another_hash),
    ("stored hashes are the chain of the request's tokens", {}, _stored_hash_off_the_chain),
    ("stored hashes are the chain of the request's tokens", {}, _stored_hash_past_the_tokens),
    ("prefix closure", {}, _parent_evicted_before_child),
]


@pytest.mark.parametrize(
    ("invariant", "options", "corrupt"),
    SPEC_MANAGER_CORRUPTIONS,
    ids=[corrupt.__name__.strip("_") for _, _, corrupt in SPEC_MANAGER_CORRUPTIONS],
)
def test_spec_manager_names_the_broken_invariant(
    invariant: str, options: dict[str, int], corrupt: Callable[[SpecKVCacheManager], None]
) -> None:
    manager = _spec_manager(**options)  # type: ignore[arg-type]
    corrupt(manager)
    with pytest.raises(InvariantViolation) as info:
        manager.check_invariants()
    assert info.value.invariant.startswith(invariant)
