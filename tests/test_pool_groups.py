"""The pool's KV cache groups: blocks indexed under `cache_key(hash, group)`, spec and impl alike.

Group 0's key is the hash itself (a single-group pool is unchanged); a block cached for group
g >= 1 carries `GroupKey(g, hash)`, is found only under that key, and its events say its group.
The harness adapters speak one group, so the scenarios drive both pools through `IdPool` below.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv import BlockPool, Request, sha256
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError, PagedKVError
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey, cache_key
from pagedkv.vocab.kv_events import BlockRemoved, BlockStored
from pagedkv.vocab.semantics import PAGEDKV

SIDES = ["spec", "impl"]


class IdPool:
    """Either pool in block ids, `group_id` passed through."""

    def __init__(self, side: str, num_blocks: int = 8, events: bool = True) -> None:
        self.side = side
        self.pool: Any = (
            SpecBlockPool(num_blocks, True, PAGEDKV, events)
            if side == "spec"
            else BlockPool(num_blocks, True, PAGEDKV, events)
        )

    def _blocks(self, block_ids: list[int]) -> list[Any]:
        if self.side == "spec":
            return block_ids
        return [self.pool.blocks[block_id] for block_id in block_ids]

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        taken = self.pool.get_new_blocks(num_blocks)
        return taken if self.side == "spec" else [block.block_id for block in taken]

    def free_blocks(self, block_ids: list[int]) -> None:
        self.pool.free_blocks(self._blocks(block_ids))

    def cache(
        self,
        request: Request,
        block_ids: list[int],
        hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        group_id: object,
    ) -> None:
        self.pool.cache_full_blocks(
            request, self._blocks(block_ids), hashes, num_cached, num_full, 2, sha256, group_id
        )

    def cached(self, key: object) -> int | None:
        found = self.pool.get_cached_block(key)
        if self.side == "spec" or found is None:
            return found  # type: ignore[no-any-return]
        return int(found.block_id)

    def key_of(self, block_id: int) -> CacheKey | None:
        if self.side == "spec":
            return self.pool.block_hash[block_id]  # type: ignore[no-any-return]
        return self.pool.blocks[block_id].block_hash  # type: ignore[no-any-return]

    def index(self) -> dict[CacheKey, tuple[int, ...]]:
        if self.side == "spec":
            return {key: tuple(ids) for key, ids in self.pool.index.items()}
        return {key: tuple(ids) for key, ids in self.pool.cached_block_hash_to_block.items()}


@pytest.mark.parametrize("side", SIDES)
def test_one_content_is_cached_once_per_group_under_its_own_key(side: str) -> None:
    pool = IdPool(side)
    request = Request("a", [1, 2, 3, 4])
    hashes: list[BlockHashType] = []
    pool.cache(request, pool.get_new_blocks(2), hashes, 0, 2, 0)  # blocks 1, 2
    pool.cache(request, pool.get_new_blocks(2), hashes, 0, 2, 1)  # blocks 3, 4
    pool.cache(request, pool.get_new_blocks(2), hashes, 0, 2, 2)  # blocks 5, 6
    h0, h1 = hashes
    assert len(hashes) == 2  # one chain for every group
    assert pool.index() == {
        h0: (1,),
        h1: (2,),
        GroupKey(1, h0): (3,),
        GroupKey(1, h1): (4,),
        GroupKey(2, h0): (5,),
        GroupKey(2, h1): (6,),
    }
    assert [pool.key_of(b) for b in (1, 3, 6)] == [h0, GroupKey(1, h0), GroupKey(2, h1)]
    assert pool.cached(h1) == 2
    assert pool.cached(GroupKey(1, h1)) == 4
    assert pool.cached(GroupKey(2, h0)) == 5
    assert pool.cached(GroupKey(3, h0)) is None
    assert cache_key(h0, 0) is h0
    pool.pool.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_a_group_chain_goes_on_from_a_parent_cached_in_that_group(side: str) -> None:
    """The second call's parent is block 3, cached under GroupKey(1, h0): its hash value seeds
    the chain, exactly as group 0's parent would."""
    pool = IdPool(side)
    request = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    group_hashes: list[BlockHashType] = []
    pool.cache(request, blocks, group_hashes, 0, 1, 1)
    assert group_hashes == [key_hash_of(pool.key_of(blocks[0]))]
    pool.cache(request, blocks, group_hashes, 1, 2, 1)
    chain: list[BlockHashType] = []
    other = pool.get_new_blocks(2)
    pool.cache(request, other, chain, 0, 2, 0)
    assert group_hashes == chain
    assert pool.key_of(blocks[1]) == GroupKey(1, chain[1])
    pool.pool.check_invariants()


def key_hash_of(key: CacheKey | None) -> BlockHashType:
    assert isinstance(key, GroupKey)
    return key.block_hash


@pytest.mark.parametrize("side", SIDES)
def test_events_name_the_group_of_the_keys_that_enter_and_leave(side: str) -> None:
    pool = IdPool(side, num_blocks=4)
    request = Request("a", [1, 2])
    hashes: list[BlockHashType] = []
    first, second = pool.get_new_blocks(2)
    pool.cache(request, [first], hashes, 0, 1, 0)
    pool.cache(request, [second], hashes, 0, 1, 2)
    pool.free_blocks([second, first])
    pool.get_new_blocks(3)  # evicts block 2 (group 2's), then block 1 (group 0's)
    (h,) = hashes
    events = pool.pool.take_events()
    assert events == [
        BlockStored((h.hash_value,), None, (1, 2), 2, None, (None,), 0),
        BlockStored((h.hash_value,), None, (1, 2), 2, None, (None,), 2),
        BlockRemoved((h.hash_value,), 2),
        BlockRemoved((h.hash_value,), 0),
    ]
    pool.pool.check_invariants()


def _refusal(side: str, call: Any) -> tuple[type[PagedKVError], str]:
    pool = IdPool(side)
    with pytest.raises(PagedKVError) as info:
        call(pool)
    pool.pool.check_invariants()
    assert pool.index() == {}
    return type(info.value), str(info.value)


H = BlockHashType(1, (1, 2))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda pool: pool.cached(GroupKey(0, H)), InvalidArgumentError),
        (lambda pool: pool.cached(GroupKey(-1, H)), InvalidArgumentError),
        (lambda pool: pool.cached(GroupKey(True, H)), ArgumentTypeError),
        (lambda pool: pool.cached(GroupKey(1, (1, (1, 2), None))), ArgumentTypeError),
        (lambda pool: pool.cached(GroupKey(1, BlockHashType(1, [1]))), ArgumentTypeError),
        (lambda pool: pool.cached((0, H)), ArgumentTypeError),
        (
            lambda pool: pool.cache(Request("a", [1, 2]), pool.get_new_blocks(1), [], 0, 1, -1),
            InvalidArgumentError,
        ),
        (
            lambda pool: pool.cache(Request("a", [1, 2]), pool.get_new_blocks(1), [], 0, 1, "1"),
            ArgumentTypeError,
        ),
        (
            lambda pool: pool.cache(Request("a", [1, 2]), pool.get_new_blocks(1), [], 0, 1, 1.0),
            ArgumentTypeError,
        ),
    ],
    ids=[
        "group 0 key",
        "negative group key",
        "bool group",
        "plain tuple hash",
        "unhashable hash",
        "plain tuple key",
        "negative group_id",
        "str group_id",
        "float group_id",
    ],
)
def test_group_arguments_are_refused_alike(call: Any, error: type[PagedKVError]) -> None:
    spec, impl = _refusal("spec", call), _refusal("impl", call)
    assert spec == impl
    assert spec[0] is error


def test_the_refusals_word_the_group_rule() -> None:
    assert _refusal("impl", lambda pool: pool.cached(GroupKey(0, H))) == (
        InvalidArgumentError,
        "BlockPool.get_cached_block: block_hash.group_id must be an int >= 1, got 0",
    )
    assert _refusal(
        "impl",
        lambda pool: pool.cache(Request("a", [1, 2]), pool.get_new_blocks(1), [], 0, 1, -1),
    ) == (InvalidArgumentError, "BlockPool.cache_full_blocks: group_id must be an int >= 0, got -1")
