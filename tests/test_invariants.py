"""check_invariants() catches each kind of corruption, in the spec and in the implementation.

Every invariant is stated once in `SpecBlockPool.check_invariants` and mirrored by
`BlockPool.check_invariants` (which also checks the free queue's links). Each test corrupts one
thing and expects the violation to be named.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv import BlockHashType, BlockPool, InvariantViolation, Request, sha256
from pagedkv.spec import BlockState, Event, SpecBlockPool, block_state
from pagedkv.spec import block_pool as spec_block_pool

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
    ("every hashed block is indexed", lambda p: setattr(p.blocks[2], "_block_hash", H)),
    ("every indexed block carries its index key", lambda p: p.blocks[1].reset_hash()),
    ("no empty index entry", lambda p: p.cached_block_hash_to_block.__setitem__(H, {})),
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
    with pytest.raises(InvariantViolation, match=r"acyclic|agree"):
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
