"""Adapters that make pools and managers speak the harness protocols, and default factories."""

from __future__ import annotations

import dataclasses
import importlib
import operator
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from pagedkv.block_pool import BlockPool
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.protocol import (
    NOT_REPORTED,
    ManagerConfig,
    ManagerSnapshot,
    ManagerUnderTest,
    PoolSnapshot,
    PoolUnderTest,
)
from pagedkv.harness.setup_check import SetupError
from pagedkv.manager import KVCacheManager
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.arguments import per_group_error
from pagedkv.vocab.errors import InvalidArgumentError, InvariantViolation
from pagedkv.vocab.hashes import BlockHashType, HashFn
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

_block_id = operator.attrgetter("block_id")
_ref_cnt = operator.attrgetter("ref_cnt")
_block_hash = operator.attrgetter("block_hash")


def free_order(queue: Any, limit: int) -> tuple[int, ...]:
    """The ids of a free block queue's blocks, head to tail.

    A queue with `free_list_head` (pagedkv's, vLLM 0.8.5's) is walked by its links, at most
    `limit` blocks: a broken queue whose links loop (a block queued while still linked) raises
    instead of being walked until memory runs out. Any other queue is read through
    `get_all_free_blocks()`.

    Raises:
        InvariantViolation: the links do not end within `limit` blocks.
    """
    if not hasattr(queue, "free_list_head"):
        return tuple(map(_block_id, queue.get_all_free_blocks()))
    ids: list[int] = []
    block = queue.free_list_head
    while block is not None:
        if len(ids) == limit:
            raise InvariantViolation(
                "no block twice in the free order",
                f"the free queue's links go on past the pool's {limit} blocks (they loop): "
                f"{_first_repeat([*ids, block.block_id])} is reached twice from the head",
            )
        ids.append(block.block_id)
        block = block.next_free_block
    return tuple(ids)


def _first_repeat(ids: list[int]) -> str:
    seen: set[int] = set()
    for block_id in ids:
        if block_id in seen:
            return f"block {block_id}"
        seen.add(block_id)
    return "a block"


class ObjectPoolAdapter:
    """Drives any pool shaped like vLLM's `BlockPool` (block objects) through block ids.

    An id outside the pool becomes a fresh block object of the pool's block type, so a
    "foreign block" reaches the pool as one would in real misuse. A hostile value that is no id
    at all (None, a float, a bool, a str) reaches the pool unchanged, in a list, in an iterator
    (as an iterator) or on its own, so that the pool, not the adapter, must refuse it.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._block_type: Callable[[int], Any] = type(pool.blocks[0])

    def _block(self, block_id: object) -> Any:
        if type(block_id) is not int:
            return block_id
        blocks = self.pool.blocks
        return blocks[block_id] if 0 <= block_id < len(blocks) else self._block_type(block_id)

    def _blocks(self, block_ids: Any) -> Any:
        if isinstance(block_ids, (list, tuple)):
            return [self._block(block_id) for block_id in block_ids]
        if isinstance(block_ids, Iterator):
            return iter([self._block(block_id) for block_id in block_ids])
        return block_ids

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        return [block.block_id for block in self.pool.get_new_blocks(num_blocks)]

    def touch(self, block_ids: Iterable[int]) -> None:
        self.pool.touch(self._blocks(block_ids))

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool.free_blocks(self._blocks(block_ids))

    def cache_full_blocks(
        self,
        request: Request,
        block_ids: Sequence[int],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> None:
        self.pool.cache_full_blocks(
            request=request,
            blocks=self._blocks(block_ids),
            block_hashes=block_hashes,
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=block_size,
            hash_fn=hash_fn,
        )

    def get_cached_block(self, block_hash: BlockHashType) -> int | None:
        block = self.pool.get_cached_block(block_hash)
        return None if block is None else int(block.block_id)

    def reset_prefix_cache(self) -> bool:
        return bool(self.pool.reset_prefix_cache())

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Ids pass through (vLLM 0.33's pool takes ids too)."""
        self.pool.evict_blocks(block_ids)

    def get_num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_usage(self) -> float:
        return float(self.pool.get_usage())

    def take_events(self) -> list[KVCacheEvent]:
        return list(self.pool.take_events())

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        return PoolSnapshot(
            free_order=free_order(pool.free_block_queue, len(pool.blocks)),
            ref_cnt=tuple(map(_ref_cnt, pool.blocks)),
            block_hash=tuple(map(_block_hash, pool.blocks)),
            index={
                block_hash: tuple(cached)
                for block_hash, cached in pool.cached_block_hash_to_block.items()
                if cached
            },
            num_free_blocks=self.get_num_free_blocks(),
            usage=self.get_usage(),
            kv_events=tuple(pool.kv_event_queue)
            if getattr(pool, "enable_kv_cache_events", False)
            else None,
        )

    def check_invariants(self) -> None:
        _check_if_offered(self.pool)


class SpecPoolAdapter:
    """The spec pool already speaks ids; this adds `snapshot()`."""

    def __init__(self, pool: SpecBlockPool) -> None:
        self.pool = pool
        self.get_new_blocks = pool.get_new_blocks
        self.touch = pool.touch
        self.free_blocks = pool.free_blocks
        self.cache_full_blocks = pool.cache_full_blocks
        self.get_cached_block = pool.get_cached_block
        self.reset_prefix_cache = pool.reset_prefix_cache
        self.evict_blocks = pool.evict_blocks
        self.get_num_free_blocks = pool.get_num_free_blocks
        self.get_usage = pool.get_usage
        self.take_events = pool.take_events
        self.check_invariants = pool.check_invariants

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        return PoolSnapshot(
            free_order=tuple(pool.free_order),
            ref_cnt=tuple(pool.ref_cnt),
            block_hash=tuple(pool.block_hash),
            index=dict(pool.index),  # its values are tuples: a copy that hashes no key again
            num_free_blocks=pool.get_num_free_blocks(),
            usage=pool.get_usage(),
            kv_events=tuple(pool.events) if pool.enable_kv_cache_events else None,
        )


class ObjectManagerAdapter:
    """Drives any manager shaped like pagedkv's `KVCacheManager` (block objects, one sequence
    per KV cache group; `block_pool`, `coordinator.single_type_managers` each with its
    `req_to_blocks` and `num_cached_block`, `req_to_block_hashes`, `prefix_cache_stats`)
    through block ids, one list per group. Hits that are not one list or tuple per group reach
    the manager unchanged, so that it, not the adapter, must refuse them."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.pool = ObjectPoolAdapter(manager.block_pool)

    def _group_blocks(self, hits: Any) -> Any:
        if isinstance(hits, (list, tuple)):
            return type(hits)(self.pool._blocks(group_hits) for group_hits in hits)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[int], ...], int]:
        groups, num_tokens = self.manager.get_computed_blocks(request)
        return _group_ids(groups), int(num_tokens)

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
    ) -> tuple[list[int], ...] | None:
        hits = None if new_computed_blocks is None else self._group_blocks(new_computed_blocks)
        groups = self.manager.allocate_slots(
            request,
            num_tokens,
            hits,
            num_lookahead_tokens,
            **_extras(full_sequence_must_fit, num_external_computed_tokens, delay_cache_blocks),
        )
        return None if groups is None else _group_ids(groups)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self.manager.free_block_hashes(request)

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def pop_blocks_for_free(self, request: Request) -> tuple[list[int], ...]:
        return _group_ids(self.manager.pop_blocks_for_free(request))

    def free_popped_blocks(self, popped: Sequence[Sequence[int]]) -> None:
        self.manager.free_popped_blocks(self._group_blocks(popped))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]:
        counts = self.manager.get_num_common_prefix_blocks(request, num_running_requests)
        return tuple(int(count) for count in counts)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats: PrefixCacheStats | None = self.manager.make_prefix_cache_stats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return list(self.manager.take_events())

    @property
    def usage(self) -> float:
        return float(self.manager.usage)

    def snapshot(self) -> ManagerSnapshot:
        manager = self.manager
        stats = manager.prefix_cache_stats
        groups = manager.coordinator.single_type_managers
        held = [group.req_to_blocks for group in groups]
        request_ids = {request_id for blocks in held for request_id, b in blocks.items() if b}
        return ManagerSnapshot(
            pool=self.pool.snapshot(),
            blocks={
                request_id: tuple(
                    tuple(map(_block_id, blocks.get(request_id, ()))) for blocks in held
                )
                for request_id in request_ids
            },
            hashes={
                request_id: tuple(hashes)
                for request_id, hashes in manager.req_to_block_hashes.items()
                if hashes
            },
            num_cached=dict(groups[0].num_cached_block),
            stats=_stats_tuple(stats),
            token_stats=_token_stats(stats),
        )

    def check_invariants(self) -> None:
        _check_if_offered(self.manager)


def _extras(
    full_sequence_must_fit: bool, num_external_computed_tokens: int, delay_cache_blocks: bool
) -> dict[str, Any]:
    """allocate_slots' keywords beyond vLLM 0.8.5's (the full-sequence gate, a connector's
    external tokens and delayed caching): passed only when not their defaults, so that a
    manager whose factory does not offer them (`harness.swarm.offers_full_sequence_gate`,
    `offers_external_tokens`) never sees them."""
    extras: dict[str, Any] = {}
    if full_sequence_must_fit is not False:
        extras["full_sequence_must_fit"] = full_sequence_must_fit
    if type(num_external_computed_tokens) is not int or num_external_computed_tokens != 0:
        extras["num_external_computed_tokens"] = num_external_computed_tokens
    if delay_cache_blocks is not False:
        extras["delay_cache_blocks"] = delay_cache_blocks
    return extras


def _group_ids(groups: Any) -> tuple[list[int], ...]:
    return tuple([block.block_id for block in blocks] for blocks in groups)


class FlatObjectManagerAdapter:
    """Drives a manager of one KV cache group shaped like vLLM 0.8.5's `KVCacheManager` (flat
    lists of block objects; `block_pool`, `req_to_blocks`, `req_to_block_hashes`,
    `num_cached_block`, `prefix_cache_stats`) through flat lists of block ids: a
    `FlatManagerUnderTest`, which `OneGroupAdapter` makes a `ManagerUnderTest`."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.pool = ObjectPoolAdapter(manager.block_pool)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        blocks, num_tokens = self.manager.get_computed_blocks(request)
        return [block.block_id for block in blocks], int(num_tokens)

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
    ) -> list[int] | None:
        hits = None if new_computed_blocks is None else self.pool._blocks(new_computed_blocks)
        blocks = self.manager.allocate_slots(
            request,
            num_tokens,
            hits,
            num_lookahead_tokens,
            **_extras(full_sequence_must_fit, num_external_computed_tokens, delay_cache_blocks),
        )
        return None if blocks is None else [block.block_id for block in blocks]

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self.manager.free_block_hashes(request)

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        return int(self.manager.get_num_common_prefix_blocks(request, num_running_requests))

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats: PrefixCacheStats | None = self.manager.make_prefix_cache_stats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return list(self.manager.take_events())

    @property
    def usage(self) -> float:
        return float(self.manager.usage)

    def snapshot(self) -> ManagerSnapshot:
        manager = self.manager
        stats = manager.prefix_cache_stats
        return ManagerSnapshot(
            pool=self.pool.snapshot(),
            blocks={
                request_id: tuple(map(_block_id, blocks))
                for request_id, blocks in manager.req_to_blocks.items()
                if blocks
            },
            hashes={
                request_id: tuple(hashes)
                for request_id, hashes in manager.req_to_block_hashes.items()
                if hashes
            },
            num_cached=dict(manager.num_cached_block),
            stats=_stats_tuple(stats),
            token_stats=_token_stats(stats),
        )

    def check_invariants(self) -> None:
        _check_if_offered(self.manager)


class OneGroupAdapter:
    """A `FlatManagerUnderTest` (one KV cache group, flat lists of ids) as a `ManagerUnderTest`:
    its answers become 1-tuples, the hits it is given lose their one group's tuple, its
    snapshot's blocks one tuple per group. Hits that are not one list or tuple of one group are
    refused here, in the spec's words (a flat manager has no per-group argument to refuse)."""

    def __init__(self, flat: Any) -> None:
        self.flat = flat
        self.pool = getattr(flat, "pool", None)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[int], ...], int]:
        hits, num_tokens = self.flat.get_computed_blocks(request)
        return (list(hits),), int(num_tokens)

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
    ) -> tuple[list[int], ...] | None:
        hits: Any = new_computed_blocks
        if hits is not None:
            if not isinstance(hits, (list, tuple)) or len(hits) != 1:
                raise per_group_error(
                    "KVCacheManager.allocate_slots",
                    "new_computed_blocks",
                    1,
                    hits,
                    context=f" for request {request.request_id!r}",
                )
            hits = hits[0]
        blocks = self.flat.allocate_slots(
            request,
            num_tokens,
            hits,
            num_lookahead_tokens,
            **_extras(full_sequence_must_fit, num_external_computed_tokens, delay_cache_blocks),
        )
        return None if blocks is None else (list(blocks),)

    def free(self, request: Request) -> None:
        self.flat.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self.flat.free_block_hashes(request)

    def reset_prefix_cache(self) -> bool:
        return bool(self.flat.reset_prefix_cache())

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.flat.evict_blocks(block_ids)

    def pop_blocks_for_free(self, request: Request) -> tuple[list[int], ...]:
        return (list(self.flat.pop_blocks_for_free(request)),)

    def free_popped_blocks(self, popped: Sequence[Sequence[int]]) -> None:
        if not isinstance(popped, (list, tuple)) or len(popped) != 1:
            raise per_group_error("KVCacheManager.free_popped_blocks", "popped", 1, popped)
        self.flat.free_popped_blocks(popped[0])

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.flat.cache_blocks(request, num_computed_tokens)

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]:
        count = self.flat.get_num_common_prefix_blocks(request, num_running_requests)
        return (count,)

    def make_prefix_cache_stats(self) -> Any:
        return self.flat.make_prefix_cache_stats()

    def take_events(self) -> list[KVCacheEvent]:
        return list(self.flat.take_events())

    @property
    def usage(self) -> float:
        return float(self.flat.usage)

    def snapshot(self) -> ManagerSnapshot:
        snapshot: ManagerSnapshot = self.flat.snapshot()
        blocks: Any = {request_id: (held,) for request_id, held in snapshot.blocks.items()}
        return dataclasses.replace(snapshot, blocks=blocks)

    def check_invariants(self) -> None:
        self.flat.check_invariants()


class SpecManagerAdapter:
    """The spec manager already speaks ids per group; this adds `snapshot()`."""

    def __init__(self, manager: SpecKVCacheManager) -> None:
        self.manager = manager
        self.pool = SpecPoolAdapter(manager.pool)
        self.get_computed_blocks = manager.get_computed_blocks
        self.allocate_slots = manager.allocate_slots
        self.free = manager.free
        self.free_block_hashes = manager.free_block_hashes
        self.reset_prefix_cache = manager.reset_prefix_cache
        self.evict_blocks = manager.evict_blocks
        self.pop_blocks_for_free = manager.pop_blocks_for_free
        self.free_popped_blocks = manager.free_popped_blocks
        self.cache_blocks = manager.cache_blocks
        self.new_step_starts = manager.new_step_starts
        self.get_num_common_prefix_blocks = manager.get_num_common_prefix_blocks
        self.make_prefix_cache_stats = manager.make_prefix_cache_stats
        self.take_events = manager.take_events
        self.check_invariants = manager.check_invariants

    @property
    def usage(self) -> float:
        return self.manager.usage

    def snapshot(self) -> ManagerSnapshot:
        manager = self.manager
        return ManagerSnapshot(
            pool=self.pool.snapshot(),
            blocks={
                request_id: tuple(tuple(blocks) for blocks in groups)
                for request_id, groups in manager.blocks.items()
                if any(groups)
            },
            hashes={r: tuple(hashes) for r, hashes in manager.hashes.items() if hashes},
            num_cached=dict(manager.num_cached),
            stats=_stats_tuple(manager.stats),
            token_stats=_token_stats(manager.stats),
        )


def _check_if_offered(checked: Any) -> None:
    """Run the object's own `check_invariants()`, if it has one (vLLM's classes do not)."""
    check = getattr(checked, "check_invariants", None)
    if check is not None:
        check()


def _stats_tuple(stats: PrefixCacheStats | None) -> tuple[bool, int, int, int] | None:
    if stats is None:
        return None
    return (stats.reset, stats.requests, stats.queries, stats.hits)


def _token_stats(stats: Any) -> tuple[int, int] | None:
    """(queried_tokens, hit_tokens), or NOT_REPORTED for stats that count no tokens (vLLM's)."""
    if stats is None:
        return None
    if not hasattr(stats, "queried_tokens"):
        return NOT_REPORTED  # type: ignore[no-any-return]
    return (stats.queried_tokens, stats.hit_tokens)


def spec_manager(config: ManagerConfig) -> ManagerUnderTest:
    """The reference manager, as a manager under test."""
    return SpecManagerAdapter(config.build(SpecKVCacheManager))


def pagedkv_manager(config: ManagerConfig) -> ManagerUnderTest:
    """pagedkv's `KVCacheManager`, as a manager under test (the default `--manager-impl`).

    Under the spec's own semantics the manager is built with its own default, which must be
    the spec's (`pagedkv.spec.PAGEDKV_SEMANTICS`): a mistake in the shared default switches
    shows here, not only in what the manager then does.
    """
    if config.semantics != PAGEDKV_SEMANTICS:
        return ObjectManagerAdapter(config.build(KVCacheManager))
    manager = config.build(KVCacheManager, pass_semantics=False)
    check_default_semantics("KVCacheManager", manager.semantics)
    return ObjectManagerAdapter(manager)


def spec_pool(
    num_gpu_blocks: int,
    enable_caching: bool,
    semantics: Semantics,
    enable_kv_cache_events: bool = False,
) -> PoolUnderTest:
    """The reference model, as a pool under test."""
    return SpecPoolAdapter(
        SpecBlockPool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events)
    )


def pagedkv_pool(
    num_gpu_blocks: int,
    enable_caching: bool,
    semantics: Semantics,
    enable_kv_cache_events: bool = False,
) -> PoolUnderTest:
    """pagedkv's optimized `BlockPool`, as a pool under test (the default `--impl`); built with
    its own default semantics under the spec's (see `pagedkv_manager`)."""
    if semantics != PAGEDKV_SEMANTICS:
        pool = BlockPool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events)
    else:
        pool = BlockPool(
            num_gpu_blocks, enable_caching, enable_kv_cache_events=enable_kv_cache_events
        )
        check_default_semantics("BlockPool", pool.semantics)
    return ObjectPoolAdapter(pool)


def check_default_semantics(built: str, semantics: Semantics) -> None:
    """The semantics an implementation took by default must be the ones the spec states.

    Raises:
        Divergence: ("semantics", `built`, the first switch that differs).
    """
    for switch in dataclasses.fields(PAGEDKV_SEMANTICS):
        spec, impl = getattr(PAGEDKV_SEMANTICS, switch.name), getattr(semantics, switch.name)
        if spec != impl:
            raise Divergence(
                f"{built}'s default semantics differ from the spec's: {switch.name} is {impl} "
                f"(the spec states {spec}: pagedkv.spec.semantics)",
                "semantics",
                built,
                switch.name,
            )


def load_factory(target: str, option: str = "--impl") -> Callable[..., Any]:
    """Import `module:attribute` and return it (a pool or manager factory), as `python -m`
    would: the working directory is searched first (it is put at the front of `sys.path`, where
    it stays, so that the module's own imports work later too).

    Raises:
        InvalidArgumentError: `target` is no `module:attribute`, the module is not found, or the
            attribute is missing or not callable; the message starts with `option` and `target`.
        SetupError: importing the module raised (the error is its cause).
    """
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise InvalidArgumentError(
            f"{option}: expected MODULE:FACTORY (a module path, a colon, a callable), "
            f"got {target!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not f"{module_name}.".startswith(f"{error.name}."):
            raise SetupError(f"{option} {target}: importing {module_name} raised {error!r}") from (
                error
            )
        raise InvalidArgumentError(
            f"{option} {target}: no module named {error.name!r} in the working directory "
            f"({cwd}) or on the Python path"
        ) from None
    except Exception as error:
        raise SetupError(f"{option} {target}: importing {module_name} raised {error!r}") from (
            error
        )
    factory = getattr(module, attribute, None)
    if factory is None:
        raise InvalidArgumentError(f"{option} {target}: {module_name} has no {attribute!r}")
    if not callable(factory):
        raise InvalidArgumentError(
            f"{option} {target}: {module_name}.{attribute} is not callable "
            f"({type(factory).__name__} {factory!r})"
        )
    return cast(Callable[..., Any], factory)
