"""Cheap views of one side of a lock-step pair: what the swarm engine compares after every step.

A full snapshot of a pool of a few hundred blocks costs tens of microseconds per side, and the
invariant checks hundreds; the swarm engine takes those on a cadence (`harness/comparison.py`).
After every step it compares a *digest* instead: the number of free blocks and, for each request
(or block) the step touched, what the step could have changed. A probe reads that digest
straight from the objects pagedkv knows (the spec, pagedkv's own classes, and anything shaped
like vLLM's, through `ObjectPoolAdapter` / `ObjectManagerAdapter` themselves); for any other
object under test, a subclass of those adapters included (it may translate what it shows, as
vLLM 0.33's hash keys), it falls back to `snapshot()`, which is correct but slow.

Digest of a request: (its block ids, its cached-block count, how many block hashes it stores).
Digest of a block: (its ref_cnt, its hash).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pagedkv.harness.adapters import (
    ObjectManagerAdapter,
    ObjectPoolAdapter,
    SpecManagerAdapter,
    SpecPoolAdapter,
)
from pagedkv.vocab.hashes import BlockHashType

RequestDigest = tuple[tuple[Any, ...], int | None, int]
"""(block ids (one tuple per group; () when it holds none), cached-block count or None when
untracked, number of stored block hashes)."""

BlockDigest = tuple[int, BlockHashType | None]
"""(ref_cnt, hash or None)."""


class Probe:
    """Reads one side's free-block count, and the digest of one request (by id) or block (by id).

    Attributes:
        num_free: the number of free blocks.
        view: the digest of the request or block named by its argument.
        subject: what a digest is of, and its fields, for messages ("block", "(ref_cnt, hash)").
    """

    __slots__ = ("num_free", "subject", "view")

    def __init__(
        self,
        num_free: Callable[[], int],
        view: Callable[[Any], object],
        subject: tuple[str, str] = ("request", "(block ids, cached blocks, stored hashes)"),
    ) -> None:
        self.num_free = num_free
        self.view = view
        self.subject = subject


BLOCK = ("block", "(ref_cnt, hash)")
"""The subject of a pool probe's digests."""


def manager_probe(side: Any) -> Probe:
    """The fastest probe `side` (a manager under test) allows."""
    if isinstance(side, SpecManagerAdapter):
        return _spec_manager_probe(side)
    if type(side) is ObjectManagerAdapter:  # a subclass may translate what it shows
        return _object_manager_probe(side)
    return _snapshot_manager_probe(side)


def pool_probe(side: Any) -> Probe:
    """The fastest probe `side` (a pool under test) allows."""
    if isinstance(side, SpecPoolAdapter):
        spec = side.pool
        return Probe(
            spec.get_num_free_blocks,
            lambda block_id: (spec.ref_cnt[block_id], spec.block_hash[block_id]),
            BLOCK,
        )
    if type(side) is ObjectPoolAdapter:  # a subclass may translate what it shows
        pool = side.pool
        blocks = pool.blocks

        def block(block_id: int) -> BlockDigest:
            found = blocks[block_id]
            return (found.ref_cnt, found.block_hash)

        return Probe(pool.get_num_free_blocks, block, BLOCK)

    def from_snapshot(block_id: int) -> BlockDigest:
        state = side.snapshot()
        return (state.ref_cnt[block_id], state.block_hash[block_id])

    return Probe(side.get_num_free_blocks, from_snapshot, BLOCK)


def _spec_manager_probe(side: SpecManagerAdapter) -> Probe:
    manager = side.manager

    def request(request_id: str) -> RequestDigest:
        held = manager.held(request_id)
        return (
            () if not held or not any(held) else tuple(tuple(blocks) for blocks in held),
            manager.num_cached.get(request_id),
            len(manager.hashes.get(request_id, ())),
        )

    return Probe(manager.pool.get_num_free_blocks, request)


def _object_manager_probe(side: ObjectManagerAdapter) -> Probe:
    manager = side.manager
    groups = manager.coordinator.single_type_managers
    first = groups[0]

    def request(request_id: str) -> RequestDigest:
        held = tuple(
            tuple([block.block_id for block in group.req_to_blocks.get(request_id, ())])
            for group in groups
        )
        return (
            held if any(held) else (),
            first.num_cached_block.get(request_id),
            len(manager.req_to_block_hashes.get(request_id, ())),
        )

    return Probe(manager.block_pool.get_num_free_blocks, request)


def _snapshot_manager_probe(side: Any) -> Probe:
    def num_free() -> int:
        return int(side.snapshot().pool.num_free_blocks)

    def request(request_id: str) -> RequestDigest:
        state = side.snapshot()
        return (
            tuple(state.blocks.get(request_id, ())),
            _get(state.num_cached, request_id, None),
            _get(state.hashes, request_id, (), len),
        )

    return Probe(num_free, request)


def _get(
    field: object, key: str, default: Any, view: Callable[[Any], Any] = lambda value: value
) -> Any:
    """`view(field.get(key, default))` of a snapshot's mapping; the field itself when the
    object under test does not report it (an unobserved value, equal to anything)."""
    if not isinstance(field, Mapping):
        return field
    return view(field.get(key, default))
