"""The interfaces a block pool and a KV cache manager must offer to be checked against the spec.

A pool under test speaks block *ids*, so any implementation can be driven, whatever its block
objects look like. A pool shaped like vLLM's `BlockPool` (block objects with `block_id`,
`ref_cnt`, `block_hash`; `blocks`, `null_block`, `free_block_queue.get_all_free_blocks()`,
`cached_block_hash_to_block`) needs no code: wrap it in `ObjectPoolAdapter`.

`pagedkv verify --impl module:factory` imports `factory` and calls
`factory(num_gpu_blocks, enable_caching, semantics)`; it must return a `PoolUnderTest`.
`--manager-impl module:factory` calls `factory(ManagerConfig)` for a `ManagerUnderTest`; a
manager shaped like vLLM's `KVCacheManager` needs only `ObjectManagerAdapter`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pagedkv.block_hash import BlockHashType, HashFn
from pagedkv.kv_cache_interface import KVCacheConfig
from pagedkv.prefix_cache_stats import PrefixCacheStats
from pagedkv.request import Request
from pagedkv.semantics import Semantics

M = TypeVar("M")


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

    def touch(self, block_ids: Iterable[int]) -> None:
        """Any iterable of ids, read once (an iterator works too)."""
        ...

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Any iterable of ids, read once."""
        ...

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


@dataclass(frozen=True)
class ManagerConfig:
    """Everything a KV cache manager is built from (the KVCacheManager constructor's arguments)."""

    kv_cache_config: KVCacheConfig
    max_model_len: int
    enable_caching: bool
    caching_hash_algo: str
    use_eagle: bool
    log_stats: bool
    semantics: Semantics

    def build(self, manager_class: Callable[..., M]) -> M:
        """`manager_class` called with these arguments, the way KVCacheManager takes them."""
        return manager_class(
            self.kv_cache_config,
            self.max_model_len,
            self.enable_caching,
            self.caching_hash_algo,
            self.use_eagle,
            self.log_stats,
            semantics=self.semantics,
        )


@dataclass(frozen=True)
class ManagerSnapshot:
    """Everything observable about a manager; two conforming managers have equal snapshots.

    Attributes:
        pool: the block pool's snapshot.
        blocks: request id -> its block ids (requests with no blocks left out).
        hashes: request id -> its stored block hashes (empty lists left out).
        num_cached: request id -> its cached-block count.
        stats: (reset, requests, queries, hits) of the pending prefix-cache stats, or None.
    """

    pool: PoolSnapshot
    blocks: Mapping[str, tuple[int, ...]]
    hashes: Mapping[str, tuple[BlockHashType, ...]]
    num_cached: Mapping[str, int]
    stats: tuple[bool, int, int, int] | None

    def key(self) -> int:
        """A hash of the whole state, for counting distinct states."""
        return hash(
            (
                self.pool.key(),
                frozenset(self.blocks.items()),
                frozenset(self.hashes.items()),
                frozenset(self.num_cached.items()),
            )
        )


class ManagerUnderTest(Protocol):
    """KVCacheManager's operations over block ids, plus observation. Errors: `pagedkv.errors`."""

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]: ...

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None: ...

    def free(self, request: Request) -> None: ...

    def free_block_hashes(self, request: Request) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    @property
    def usage(self) -> float: ...

    def snapshot(self) -> ManagerSnapshot: ...

    def check_invariants(self) -> None: ...


ManagerFactory = Callable[[ManagerConfig], ManagerUnderTest]
"""`factory(config)` -> a fresh manager under test."""
