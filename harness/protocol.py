"""The interfaces a block pool and a KV cache manager must offer to be checked against the spec.

A pool under test speaks block *ids*, so any implementation can be driven, whatever its block
objects look like. A pool shaped like vLLM's `BlockPool` (block objects with `block_id`,
`ref_cnt`, `block_hash`; `blocks`, `null_block`, `free_block_queue.get_all_free_blocks()`,
`cached_block_hash_to_block`) needs no code: wrap it in `ObjectPoolAdapter`.

`pagedkv verify --impl module:factory` imports `factory` and calls
`factory(num_gpu_blocks, enable_caching, semantics)`; it must return a `PoolUnderTest`.
`--manager-impl module:factory` calls `factory(ManagerConfig)` for a `ManagerUnderTest`: block
ids per KV cache group, whatever the number of groups. A manager shaped like pagedkv's
`KVCacheManager` (block objects per group) needs only `ObjectManagerAdapter`; a one-group manager
that answers in flat lists, like vLLM 0.8.5's `KVCacheManager`, `FlatObjectManagerAdapter` (or,
speaking ids already, `FlatManagerUnderTest`, `OneGroupAdapter`).

KV cache events (`pagedkv.vocab.kv_events`) are compared only for objects that emit them
(`EmitsKVEvents`), built with events on (`ManagerConfig.enable_kv_cache_events`, or a
`KVEventPoolFactory` called with `enable_kv_cache_events=True`): the events not yet taken are
then part of the snapshot, so spec and implementation must queue the same events in the same
order, and a refused call must queue none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

from pagedkv.vocab.hashes import BlockHashType, CacheKey, HashFn
from pagedkv.vocab.kv_cache_interface import KVCacheConfig
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

M = TypeVar("M")


class _NotReported:
    """Equal to anything: a snapshot field the object under test does not report."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "NOT_REPORTED"


NOT_REPORTED: Any = _NotReported()
"""The default of snapshot fields added after the protocol was first published, so that a
third-party adapter building a snapshot without them still compares equal to the spec's."""


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything observable about a pool; two conforming pools have equal snapshots.

    Attributes:
        free_order: the free queue, head first.
        ref_cnt: ref_cnt of every block, by id.
        block_hash: index key of every block (its hash, or a `GroupKey` for a KV cache group
            other than 0; None if uncached), by id.
        index: key -> ids cached under it, first inserted first.
        num_free_blocks: as reported by `get_num_free_blocks()`.
        usage: as reported by `get_usage()`.
        kv_events: the KV cache events queued and not yet taken, oldest first; None with events
            off (not part of `key()`: it records history, not state).
    """

    free_order: tuple[int, ...]
    ref_cnt: tuple[int, ...]
    block_hash: tuple[CacheKey | None, ...]
    index: Mapping[CacheKey, tuple[int, ...]]
    num_free_blocks: int
    usage: float
    kv_events: tuple[KVCacheEvent, ...] | None = None

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
    """BlockPool's operations over block ids, plus observation. Errors: `pagedkv.vocab.errors`."""

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


class EmitsKVEvents(Protocol):
    """A pool or manager under test that emits KV cache events (`pagedkv.vocab.kv_events`)."""

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first; the queue is emptied."""
        ...


class KVEventPoolFactory(Protocol):
    """A `PoolFactory` that can also build its pool with KV cache events on."""

    def __call__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        semantics: Semantics,
        enable_kv_cache_events: bool = False,
    ) -> PoolUnderTest: ...


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
    enable_kv_cache_events: bool = False
    max_in_flight_tokens: int | None = None

    def build(self, manager_class: Callable[..., M], *, pass_semantics: bool = True) -> M:
        """`manager_class` called with these arguments, the way KVCacheManager takes them
        (`enable_kv_cache_events` only when on: a manager without events need not take it;
        `max_in_flight_tokens` only when set, which only runs drawn for a manager that offers
        the full-sequence gate do; without `pass_semantics`, the manager takes its own
        default)."""
        options: dict[str, object] = {"semantics": self.semantics} if pass_semantics else {}
        if self.enable_kv_cache_events:
            options["enable_kv_cache_events"] = True
        if self.max_in_flight_tokens is not None:
            options["max_in_flight_tokens"] = self.max_in_flight_tokens
        return manager_class(
            self.kv_cache_config,
            self.max_model_len,
            self.enable_caching,
            self.caching_hash_algo,
            self.use_eagle,
            self.log_stats,
            **options,
        )


GroupIds: TypeAlias = "tuple[list[int], ...]"
"""Block ids a manager call takes or returns: one list per KV cache group, in the config's group
order (a 1-tuple for one group)."""

BlockIds: TypeAlias = "tuple[tuple[int, ...], ...]"
"""A request's blocks in a snapshot: a tuple of ids per KV cache group."""


@dataclass(frozen=True)
class ManagerSnapshot:
    """Everything observable about a manager; two conforming managers have equal snapshots.

    Attributes:
        pool: the block pool's snapshot.
        blocks: request id -> its block ids, one tuple per group (requests with no blocks in
            any group left out).
        hashes: request id -> its stored block hashes (empty lists left out).
        num_cached: request id -> its cached-block count.
        stats: (reset, requests, queries, hits) of the pending prefix-cache stats, or None.
        token_stats: (queried_tokens, hit_tokens) of the pending stats, or None;
            `NOT_REPORTED` for a manager whose stats count no tokens (vLLM 0.8.5's).
    """

    pool: PoolSnapshot
    blocks: Mapping[str, BlockIds]
    hashes: Mapping[str, tuple[BlockHashType, ...]]
    num_cached: Mapping[str, int]
    stats: tuple[bool, int, int, int] | None
    token_stats: tuple[int, int] | None = NOT_REPORTED

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
    """KVCacheManager's operations over block ids, plus observation (errors: `pagedkv.vocab`):
    hits and new blocks one list per KV cache group, in the config's group order, a common
    prefix per group; its snapshot's `blocks` hold one tuple per group."""

    def get_computed_blocks(self, request: Request) -> tuple[GroupIds, int]: ...

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupIds | None:
        """`full_sequence_must_fit` (vLLM 0.33's admission gate) is passed, True, only to a
        manager whose factory offers it (`harness.swarm.offers_full_sequence_gate`); the
        connector's `num_external_computed_tokens` and `delay_cache_blocks`, when not their
        defaults, only to one that offers them (`harness.swarm.offers_external_tokens`)."""

    def free(self, request: Request) -> None: ...

    def free_block_hashes(self, request: Request) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Take the listed blocks' hashes out of the prefix cache (vLLM 0.33's; called only
        of a manager whose factory offers it: `harness.swarm.offers_evict_blocks`)."""

    def pop_blocks_for_free(self, request: Request) -> tuple[list[int], ...]:
        """Hand the request's blocks to a deferred free: each group's, less its leading null
        blocks, still referenced until `free_popped_blocks` (vLLM 0.33's, under
        `defer_block_free`; called only of a manager whose factory offers it:
        `harness.swarm.offers_deferred_frees`)."""

    def free_popped_blocks(self, popped: Sequence[Sequence[int]]) -> None:
        """Release a batch `pop_blocks_for_free` returned (vLLM 0.33's scheduler drains it
        with one `block_pool.free_blocks(reversed(...))`; called only as that is)."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first `num_computed_tokens` tokens
        (vLLM 0.33's; called only of a manager whose factory offers it:
        `harness.swarm.offers_cache_blocks`)."""

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    @property
    def usage(self) -> float: ...

    def snapshot(self) -> ManagerSnapshot: ...

    def check_invariants(self) -> None: ...


class StartsSchedulerSteps(Protocol):
    """What a `ManagerUnderTest` that serves Mamba prefix caching (`mamba_cache_mode="align"`)
    has besides; the campaigns draw such runs only for a manager whose factory says so
    (`harness.swarm.offers_mamba_align`), and a manager without it is never sent it."""

    def new_step_starts(self) -> None:
        """A scheduler step starts (vLLM 0.33's scheduler calls it first in every step): a
        Mamba state keyed before it may be hit from now on."""


class FlatManagerUnderTest(Protocol):
    """A manager of one KV cache group that answers in flat lists of ids (vLLM 0.8.5's shape):
    as `ManagerUnderTest`, with one list where it has one list per group, one count where it
    has one per group, and a snapshot whose `blocks` hold one tuple of ids per request.
    `OneGroupAdapter` makes it a `ManagerUnderTest`."""

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]: ...

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
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
