"""The interface a block pool must offer to be checked against pagedkv's spec.

A pool under test speaks block *ids*, so any implementation can be driven, whatever its block
objects look like. A pool shaped like vLLM's `BlockPool` (block objects with `block_id`,
`ref_cnt`, `block_hash`; `blocks`, `null_block`, `free_block_queue.get_all_free_blocks()`,
`cached_block_hash_to_block`) needs no code: wrap it in `ObjectPoolAdapter`.

`pagedkv verify --impl module:factory` imports `factory` and calls
`factory(num_gpu_blocks, enable_caching, semantics)`; it must return a `PoolUnderTest`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.block_hash import BlockHashType, HashFn
from pagedkv.request import Request
from pagedkv.semantics import Semantics


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything observable about a pool; two conforming pools have equal snapshots.

    Attributes:
        free_order: the free queue, head first.
        ref_cnt: ref_cnt of every block, by id.
        block_hash: hash of every block (None if uncached), by id.
        index: hash -> ids cached under it, first inserted first.
        num_free_blocks: as reported by `get_num_free_blocks()`.
        usage: as reported by `get_usage()`.
    """

    free_order: tuple[int, ...]
    ref_cnt: tuple[int, ...]
    block_hash: tuple[BlockHashType | None, ...]
    index: Mapping[BlockHashType, tuple[int, ...]]
    num_free_blocks: int
    usage: float

    def key(self) -> int:
        """A hash of the whole state, for counting distinct states."""
        return hash(
            (
                self.free_order,
                self.ref_cnt,
                self.block_hash,
                frozenset(self.index.items()),
            )
        )


class PoolUnderTest(Protocol):
    """BlockPool's operations over block ids, plus observation. Errors: `pagedkv.errors`."""

    def get_new_blocks(self, num_blocks: int) -> list[int]: ...

    def touch(self, block_ids: Sequence[int]) -> None: ...

    def free_blocks(self, block_ids: Sequence[int]) -> None: ...

    def cache_full_blocks(
        self,
        request: Request,
        block_ids: Sequence[int],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> None: ...

    def get_cached_block(self, block_hash: BlockHashType) -> int | None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_free_blocks(self) -> int: ...

    def get_usage(self) -> float: ...

    def snapshot(self) -> PoolSnapshot:
        """The whole observable state (free order, ref counts, hashes, index, counters)."""
        ...

    def check_invariants(self) -> None:
        """Raise `pagedkv.InvariantViolation` (or any AssertionError) if the pool is broken."""
        ...


PoolFactory = Callable[[int, bool, Semantics], PoolUnderTest]
"""`factory(num_gpu_blocks, enable_caching, semantics)` -> a fresh pool under test."""
