"""vLLM 0.33.0's own `BlockPool` and `KVCacheManager` as a pool and a manager under test.

vLLM 0.33.0 moved the hashing of blocks into the request: `request.block_hashes` lists the hash
of every full block, in bytes, extended as tokens are appended, and the pool indexes blocks by
that hash plus a group id. pagedkv keys blocks by `BlockHashType`. The adapters keep a
`HashTranslation` between the two, filled from both sides' hashes of the same blocks of the
same requests; it fails the step the moment the two stop pairing one to one (a block pagedkv
and vLLM would key differently), and maps vLLM's hashes back for the snapshots. So the pool's
hashes and index are compared in full; the hash *values* differ by design (bytes vs int).
With groups of several block sizes both chains are at their GCD `H` and pair hash for hash;
each group's keys are drawn from them (a block at its last `H`-chunk's hash, a partial key at
an inner one), so the index compared holds vLLM's partial prefix keys too.

Where the API changed, the adapters translate (docs/semantics.md lists each change):
`cache_full_blocks` no longer takes or extends the caller's hash list, so the adapter extends it
with pagedkv's hashes, as pagedkv's pool would; requests are shown with the attributes 0.33.0
reads (`block_hashes`, `mm_features`, `lora_request` with a name, ...); the manager records
prefix-cache stats when the scheduler asks (`record_prefix_cache_stats`), so the adapter asks
after each lookup, as vLLM's scheduler does.

Three things the manager no longer exposes as pagedkv does are reported as `UNOBSERVED` (equal
to anything, so not compared) and listed in docs/semantics.md: a request's stored block hashes
(vLLM keeps every full block's hash on the request, computed as tokens arrive), the prefix-cache
stats' counts (vLLM counts tokens, and counts preempted requests apart), and
`get_num_common_prefix_blocks` (deprecated in 0.33.0: always 0).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.harness.adapters import ObjectPoolAdapter
from pagedkv.harness.domain import Domain
from pagedkv.harness.protocol import (
    ManagerConfig,
    ManagerSnapshot,
    PoolSnapshot,
)
from pagedkv.harness.vllm.engine_0_33 import (
    EnginePath,
    EngineSettings,
    Loaded,
    UnplannableError,
    engine_defaults,
)
from pagedkv.harness.vllm.stand_ins_0_33 import PLANNING_MODULES as MODULES
from pagedkv.harness.vllm.stand_ins_0_33 import PLANNING_STAND_INS as STAND_INS
from pagedkv.harness.vllm.views import (
    RequestViews,
    UnknownMambaTypeError,
    torch_or_stand_in,
    vllm_layer_spec,
)
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.vocab.hashes import BlockHashType, CacheKey, HashFn, cache_key, get_hash_fn
from pagedkv.vocab.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

__all__ = [
    "DOMAIN",
    "HASH_SEEDING",
    "LOGGERS",
    "MODULES",
    "RELEASE",
    "STAND_INS",
    "VERSION",
    "Release",
    "Vllm033Manager",
    "load",
    "load_release",
]

VERSION = "0.33.0"
LOGGERS = ("vllm",)
HASH_SEEDING = "compared through the hash translation, whatever the seeds"
DOMAIN = Domain(
    min_window=2,
    listed_blocks_freed=False,
    one_length_per_mm_hash=True,
    retention_intervals=None,
)
"""Outside it vLLM 0.33.0 differs from every semantics of the spec (docs/semantics.md): a
one-token window (vLLM caches none of its blocks), a block freed while a request still lists it
(vLLM chains the request's next block to the request's own hashes, pagedkv to the hash the freed
and maybe reused block holds; a manager never frees a block a running request lists), and one
multimodal hash with two lengths (vLLM keys an input by its identifier and offset, and its
identifiers name one input, so one length; pagedkv keys the length too)."""
GROUP_ID = 0  # one KV cache group


class Unobserved:
    """A value the object under test does not expose: equal to anything, so never compared."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "UNOBSERVED"


UNOBSERVED: Any = Unobserved()


class HashPairingError(AssertionError):
    """vLLM and pagedkv key two blocks differently: one hash of one side pairs with two."""


@dataclass
class HashTranslation:
    """vLLM's block keys (hash bytes + group id) <-> pagedkv's `BlockHashType`, one to one."""

    to_vllm: dict[CacheKey, bytes] = field(default_factory=dict)
    to_ours: dict[bytes, CacheKey] = field(default_factory=dict)

    def pair(self, ours: CacheKey, vllm_key: bytes) -> None:
        """Record that both sides key the same block content by these hashes.

        Raises:
            HashPairingError: either hash is already paired with another.
        """
        known_key = self.to_vllm.get(ours, vllm_key)
        known_ours = self.to_ours.get(vllm_key, ours)
        if known_key != vllm_key or known_ours != ours:
            raise HashPairingError(
                f"pagedkv's {ours} pairs with two vLLM keys or vLLM's key pairs with two "
                f"pagedkv hashes ({known_ours}): the two sides key these blocks differently"
            )
        self.to_vllm[ours] = vllm_key
        self.to_ours[vllm_key] = ours

    def ours(self, vllm_key: bytes | None) -> CacheKey | None:
        if vllm_key is None:
            return None
        try:
            return self.to_ours[vllm_key]
        except KeyError:
            raise HashPairingError(f"vLLM holds a key no request produced: {vllm_key!r}") from None


@dataclass(frozen=True)
class _Feature:
    """A multimodal input as vLLM 0.33.0 reads it: an identifier and a placeholder range."""

    identifier: str
    mm_position: Any


class RequestView:
    """pagedkv's `Request` as vLLM 0.33.0 reads it; `block_hashes` are vLLM's own, refreshed
    from the request's current tokens by `refresh()`."""

    def __init__(self, request: Request, hasher: Any) -> None:
        self.request = request
        self._hasher = hasher
        self.block_hashes: list[bytes] = []
        self.lora_request = (
            None
            if request.lora_id is None
            else SimpleNamespace(lora_name=f"lora-{request.lora_id}", lora_path="")
        )
        self.mm_features = [
            _Feature(mm_hash, position)
            for mm_hash, position in zip(request.mm_hashes, request.mm_positions, strict=True)
        ]
        self.prompt_embeds = None
        self.cache_salt = request.cache_salt
        self.skip_reading_prefix_cache = request.prompt_logprobs  # as vLLM sets it
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0  # no asynchronous scheduling here
        self.shared_prefix_boundary = 0
        self.status: Any = None  # set by the manager adapter before each call

    def refresh(self) -> RequestView:
        """Hash the full blocks the request gained since the last call (as vLLM's Request does
        when tokens are appended)."""
        self.block_hashes.extend(self._hasher(self))
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


def request_views(hasher: Any) -> RequestViews[RequestView]:
    return RequestViews(lambda request: RequestView(request, hasher))


def hashing_off(request: RequestView) -> list[bytes]:
    """vLLM gives requests no block hasher when prefix caching is off."""
    return []


class Vllm033Pool(ObjectPoolAdapter):
    """vLLM 0.33.0's `BlockPool` through block ids and pagedkv hashes."""

    def __init__(self, pool: Any, api: Any, hasher_for: Any) -> None:
        super().__init__(pool)
        self.api = api
        self.translation = HashTranslation()
        self.hasher_for = hasher_for
        self.views: RequestViews[RequestView] | None = None

    def _views(self, block_size: int) -> RequestViews[RequestView]:
        """The request views; on first use the pool learns the block size, which a pool of one
        KV cache group hashes at (`hash_block_size`: the factory is not told the block size)."""
        if self.views is None:
            self.pool.hash_block_size = block_size
            self.views = request_views(self.hasher_for(block_size))
        assert self.pool.hash_block_size == block_size, "one block size per pool"
        return self.views

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
        view = self._views(block_size)(request).refresh()
        ours = self.pair(request, view, hash_fn, block_size)
        self.pool.cache_full_blocks(
            view, self._blocks(block_ids), num_cached_blocks, num_full_blocks, block_size, GROUP_ID
        )
        # pagedkv's contract: the caller's list gains the hashes of the blocks just cached.
        block_hashes.extend(ours[len(block_hashes) : num_full_blocks])

    def get_cached_block(self, block_hash: BlockHashType) -> int | None:
        key = self.translation.to_vllm.get(block_hash)
        if key is None:
            return None  # vLLM never saw a block with this content
        found = self.pool.get_cached_block(self.api.get_block_hash(key), [GROUP_ID])
        return None if found is None else int(found[0].block_id)

    def pair(
        self,
        request: Request,
        view: RequestView,
        hash_fn: HashFn,
        block_size: int,
        num_groups: int = 1,
    ) -> list[BlockHashType]:
        """Pair pagedkv's and vLLM's keys of the request's chain, one hash per full
        `block_size`-token chunk (the hash block size `H`: one block size, or the groups' GCD),
        in every KV cache group; pagedkv's hashes. Every key either side indexes is one of
        them: a group's block at the hash of its last `H`-chunk, and a partial key at the hash
        of an `H`-chunk inside a block (docs/design/mixed-block-sizes.md §2, §5)."""
        ours = request_block_hashes(hash_fn, block_size, request)
        make_key = self.api.make_block_hash_with_group_id
        for our_hash, vllm_hash in zip(ours, view.block_hashes, strict=False):
            for group in range(num_groups):
                self.translation.pair(cache_key(our_hash, group), make_key(vllm_hash, group))
        return ours

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        index: dict[CacheKey, tuple[int, ...]] = {}
        for key, cached in pool.cached_block_hash_to_block._cache.items():
            ours = self.translation.ours(key)
            assert ours is not None
            blocks = cached.values() if isinstance(cached, dict) else (cached,)
            index[ours] = tuple(block.block_id for block in blocks)
        return PoolSnapshot(
            free_order=tuple(
                block.block_id for block in pool.free_block_queue.get_all_free_blocks()
            ),
            ref_cnt=tuple(block.ref_cnt for block in pool.blocks),
            block_hash=tuple(self.translation.ours(block.block_hash) for block in pool.blocks),
            index=index,
            num_free_blocks=self.get_num_free_blocks(),
            usage=self.get_usage(),
        )


class Vllm033Manager:
    """vLLM 0.33.0's `KVCacheManager` through block ids (one list per KV cache group, as vLLM
    answers) and pagedkv requests: a `ManagerUnderTest` (vLLM's unitary coordinator inside for
    one group, its hybrid coordinator for several)."""

    pops_leading_nulls = False
    """Whether `pop_blocks_for_free` returns each group's leading null blocks too (0.32.0)."""

    def __init__(self, manager: Any, api: Any, config: ManagerConfig, hasher: Any) -> None:
        self.manager = manager
        self.api = api
        self.block_size = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.hash_block_size = config.kv_cache_config.hash_block_size
        self.num_groups = len(config.kv_cache_config.kv_cache_groups)
        self.hash_fn = get_hash_fn(config.caching_hash_algo)
        self.pool = Vllm033Pool(manager.block_pool, api, lambda _: hasher)
        self.views = request_views(hasher if config.enable_caching else hashing_off)
        self.running: set[str] = set()
        self.single_types = manager.coordinator.single_type_managers
        self.popped: list[tuple[tuple[list[int], ...], list[Any]]] = []  # answered, vLLM's

    def _view(self, request: Request) -> RequestView:
        view = self.views(request).refresh()
        view.status = self.api.RUNNING if request.request_id in self.running else self.api.WAITING
        self.pool.pair(request, view, self.hash_fn, self.hash_block_size, self.num_groups)
        return view

    def _ids(self, groups: Sequence[Sequence[Any]]) -> tuple[list[int], ...]:
        """vLLM's blocks per group as ids."""
        return tuple([block.block_id for block in blocks] for blocks in groups)

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        view = self._view(request)
        blocks, num_tokens, view.shared_prefix_boundary = self.manager.get_computed_blocks(view)
        self.manager.record_prefix_cache_stats(view, num_tokens)  # as the scheduler does
        return self._ids(blocks.blocks), int(num_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Any:
        view = self._view(request)
        hits = new_computed_blocks or tuple([] for _ in range(self.num_groups))
        lists = tuple(self.pool._blocks(group_hits) for group_hits in hits)
        blocks = self.manager.allocate_slots(
            view,
            num_tokens,
            len(lists[0]) * self.block_size,
            self.manager.create_kv_cache_blocks(lists) if lists[0] else None,
            num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        self._drain_step_outputs()
        if blocks is None:
            return None
        self.running.add(request.request_id)
        return self._ids(blocks.blocks)

    def _drain_step_outputs(self) -> None:
        """What the scheduler takes from the manager after each allocation with a Mamba group
        in mode "align" (`take_kv_cache_block_copies`, `take_boundary_state_offloads`), as it
        does: the copies run at once (their retained endpoints are released), the boundary
        states go to no connector."""
        take_copies = getattr(self.manager, "take_kv_cache_block_copies", None)
        if take_copies is not None:
            _, retained = take_copies()
            if retained:
                self.manager.block_pool.free_blocks(retained)
        take_offloads = getattr(self.manager, "take_boundary_state_offloads", None)
        if take_offloads is not None:
            take_offloads()

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    def free(self, request: Request) -> None:
        view = self._view(request)
        self.manager.free(view)
        if request.request_id in self.running:
            self.running.discard(request.request_id)
            view.num_preemptions += 1

    def free_block_hashes(self, request: Request) -> None:
        """vLLM keeps hashes on the request: a finished request's view is dropped."""
        self.views.forget(request)

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """vLLM takes a set of ids (their order changes only its events, which are off)."""
        self.manager.evict_blocks(set(block_ids))

    def pop_blocks_for_free(self, request: Request) -> tuple[list[int], ...]:
        """vLLM returns one list, every group's blocks in group order, less each group's
        leading nulls (0.33.0) or with them (`pops_leading_nulls`: 0.32.0); it is split here by
        each group's count, read before the call, and answered less the leading nulls, as
        pagedkv answers. vLLM's own list is kept for `free_popped_blocks`."""
        request_id = request.request_id
        counts, leading = [], []
        for single_type in self.single_types:
            held = [block.block_id for block in single_type.req_to_blocks.get(request_id, ())]
            nulls = len(list(itertools.takewhile(lambda b: b == 0, held)))
            counts.append(len(held) if self.pops_leading_nulls else len(held) - nulls)
            leading.append(nulls if self.pops_leading_nulls else 0)
        view = self._view(request)
        popped = list(self.manager.pop_blocks_for_free(view))
        flat = [block.block_id for block in popped]
        if request_id in self.running:  # as `free`: a preemption, if it runs again
            self.running.discard(request_id)
            view.num_preemptions += 1
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
        groups = tuple(
            flat[start + nulls : start + count]
            for start, count, nulls in zip(starts, counts, leading, strict=True)
        )
        if any(groups):
            self.popped.append((groups, popped))
        return groups

    def free_popped_blocks(self, popped: Sequence[Sequence[int]]) -> None:
        """The scheduler's drain of a deferred free (docs/design/connector-path.md §2.5): one
        `free_blocks` call over the list vLLM popped, reversed."""
        key = tuple(list(group) for group in popped)
        index = next((i for i, (groups, _) in enumerate(self.popped) if groups == key), None)
        assert index is not None, f"free_popped_blocks of a batch never popped: {key}"
        _, blocks = self.popped.pop(index)
        self.manager.block_pool.free_blocks(reversed(blocks))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(self._view(request), num_computed_tokens)

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]:
        self.manager.get_num_common_prefix_blocks(request.request_id)  # deprecated: always 0
        unobserved: tuple[int, ...] = UNOBSERVED
        return unobserved

    def make_prefix_cache_stats(self) -> Any:
        return None if self.manager.make_prefix_cache_stats() is None else UNOBSERVED

    @property
    def usage(self) -> float:
        return float(self.manager.usage)

    def snapshot(self) -> ManagerSnapshot:
        return ManagerSnapshot(
            pool=self.pool.snapshot(),
            blocks=self._blocks(),
            hashes=UNOBSERVED,
            num_cached=self._num_cached(),
            stats=None if self.manager.prefix_cache_stats is None else UNOBSERVED,
        )

    def _blocks(self) -> dict[str, Any]:
        """Request id -> its block ids, one tuple per group."""
        held = [single_type.req_to_blocks for single_type in self.single_types]
        request_ids = {
            request_id for group in held for request_id, blocks in group.items() if blocks
        }
        return {
            request_id: tuple(
                tuple(block.block_id for block in group.get(request_id, ())) for group in held
            )
            for request_id in request_ids
        }

    def _num_cached(self) -> dict[str, int]:
        """vLLM records a count once a block is cached; pagedkv records 0 from the first
        allocation on (with caching on): the same state, written two ways."""
        single_type = self.single_types[0]
        counts = dict(single_type.num_cached_block)
        if self.manager.enable_caching:
            for request_id, blocks in single_type.req_to_blocks.items():
                if blocks:
                    counts.setdefault(request_id, 0)
        return counts

    def check_invariants(self) -> None:
        """vLLM's manager has no invariant check of its own."""


def engine_block_sizes(specs: Sequence[KVCacheSpec]) -> tuple[int, int | None]:
    """`CacheConfig.block_size` (the attention layers' block size: the smallest attention
    group's, which the model's layers are built with and the engine sets it back to after
    planning; the first group's where none attends) and `CacheConfig.mamba_block_size` (the
    first Mamba group's, None without one) for the groups' specs."""
    attention = [spec.block_size for spec in specs if isinstance(spec, AttentionSpec)]
    mamba = [spec.block_size for spec in specs if isinstance(spec, MambaSpec)]
    return min(attention or [specs[0].block_size]), (mamba[0] if mamba else None)


def planner_layers(specs: Sequence[KVCacheSpec]) -> list[dict[str, int]]:
    """Per spec, the fields its vLLM layer takes instead of the spec's own (none when every
    attention group has one block size), such that vLLM's planner gives each group its drawn
    block size.

    vLLM builds every attention layer at `CacheConfig.block_size` and its planner
    (`unify_kv_cache_spec_page_size`) grows a layer whose page is 1/r of the largest to r times
    that block size (docs/design/mixed-block-sizes.md §7). So a group of `B_g` tokens is given
    a layer of the smallest drawn size `b` whose head is `L / (B_g / b)` times the spec's,
    `L` the LCM of those ratios: its page is `1 / (B_g / b)` of the `b`-sized groups'. Only the
    pages change (which pagedkv's managers never read); the caller checks the planned sizes.

    Raises:
        UnplannableError: mixed sizes that no head size makes: a Mamba group beside them,
            attention layers of different shapes (heads, head size or dtype), or a size that
            is not a multiple of the smallest.
    """
    attention = [spec for spec in specs if isinstance(spec, AttentionSpec)]
    sizes = {spec.block_size for spec in attention}
    if len(sizes) <= 1:
        return [{} for _ in specs]
    smallest = min(sizes)
    shapes = {(spec.num_kv_heads, spec.head_size, spec.dtype) for spec in attention}
    if len(attention) < len(specs) or len(shapes) > 1:
        raise UnplannableError(
            "groups of several block sizes are planned from attention layers of one shape "
            f"only; drawn: {[type(spec).__name__ for spec in specs]}, shapes {sorted(shapes)}"
        )
    if any(size % smallest for size in sizes):
        raise UnplannableError(
            f"block sizes {sorted(sizes)}: vLLM's planner grows the smallest by whole ratios"
        )
    ratios = [spec.block_size // smallest for spec in attention]
    lcm = math.lcm(*ratios)
    return [
        {"block_size": smallest, "head_size": spec.head_size * lcm // ratio}
        for spec, ratio in zip(attention, ratios, strict=True)
    ]


class PlannedSizesError(AssertionError):
    """vLLM's planner gave the groups block sizes other than the drawn ones."""


def check_planned_sizes(groups: Sequence[Any], specs: Sequence[KVCacheSpec]) -> None:
    """Fail loudly where vLLM's planned `groups` (one per spec, in order) do not have the
    block sizes of `specs`.

    Raises:
        PlannedSizesError: they differ.
    """
    planned = [group.kv_cache_spec.block_size for group in groups]
    drawn = [spec.block_size for spec in specs]
    if planned != drawn:
        raise PlannedSizesError(
            f"vLLM's planner gives the groups block sizes {planned}, not the drawn {drawn}"
        )


@dataclass(frozen=True)
class Release:
    """What tells one release's manager path from 0.33.0's (`v0_32` names 0.32.0's).

    Attributes:
        version: the release.
        engine_path: its planning and sizing functions (`EnginePath` or a subclass).
        manager: the adapter class over its `KVCacheManager`.
        manager_arguments: the `KVCacheManager` arguments only some releases take.
        marks_draft_layers: with EAGLE, each layer's spec says it is the drafter's
            (`is_draft`, 0.33.0), so every group is flagged; a release without the field flags
            every group when none is (0.32.0's coordinator).
        mamba_align: whether the campaigns draw Mamba groups in mode "align" for it
            (`offers_mamba_align`): checked for 0.33.0 only.
        mixed_block_sizes: whether the campaigns draw groups of several block sizes with
            caching for it (`offers_mixed_block_sizes`): checked for 0.33.0 only.
    """

    version: str
    engine_path: type[EnginePath] = EnginePath
    manager: type[Vllm033Manager] = Vllm033Manager
    manager_arguments: tuple[tuple[str, object], ...] = ()
    marks_draft_layers: bool = True
    mamba_align: bool = False
    mixed_block_sizes: bool = False


RELEASE = Release(
    VERSION,
    manager_arguments=(("num_hash_lookahead_tokens", 0),),
    mamba_align=True,
    mixed_block_sizes=True,
)
"""0.33.0: lookahead hashes off (the EAGLE drop, as pagedkv models it; docs/semantics.md)."""


def load(semantics: Semantics, root: Path, settings: Sequence[str]) -> Loaded:
    """Pool and manager factories over vLLM 0.33.0's classes (its tree, at `root`, must be on
    sys.path); the manager built as the engine builds it (`engine_0_33`), with the engine's
    defaults unless `settings` (`NAME=VALUE`s) say otherwise.

    Raises:
        SetupError: a malformed or unmodelled setting.
    """
    return load_release(RELEASE, semantics, root, settings)


def load_release(
    release: Release, semantics: Semantics, root: Path, settings: Sequence[str]
) -> Loaded:
    """`load` for `release`, whose manager path differs from 0.33.0's only as it states."""
    torch = torch_or_stand_in()  # before vLLM's modules import it
    from vllm.utils.hashing import sha256
    from vllm.v1 import kv_cache_interface as interface
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    engine_settings = EngineSettings.resolve(engine_defaults(root), settings)
    path = release.engine_path(engine_settings, interface, torch)
    kv_cache_utils.init_none_hash(sha256)
    api = SimpleNamespace(
        make_block_hash_with_group_id=kv_cache_utils.make_block_hash_with_group_id,
        get_block_hash=kv_cache_utils.get_block_hash,
        RUNNING=RequestStatus.RUNNING,
        WAITING=RequestStatus.WAITING,
    )

    def hasher(block_size: int) -> Any:
        return kv_cache_utils.get_request_block_hasher(block_size, sha256)

    def vllm_pool(num_gpu_blocks: int, enable_caching: bool, _: Semantics) -> Vllm033Pool:
        pool = BlockPool(num_gpu_blocks, enable_caching, hash_block_size=1)  # see _views
        return Vllm033Pool(pool, api, hasher)

    def vllm_specs(specs: Sequence[Any], use_eagle: bool) -> list[Any]:
        """vLLM's layer of each spec, as the model builds it (`planner_layers`)."""
        draft = {"is_draft": True} if use_eagle and release.marks_draft_layers else {}
        try:
            return [
                vllm_layer_spec(spec, interface, torch, **draft, **fields)
                for spec, fields in zip(specs, planner_layers(specs), strict=True)
            ]
        except UnknownMambaTypeError as error:
            raise UnplannableError(f"{error}: draw a Mamba type vLLM's stand-in names") from None

    def plan(specs: list[Any]) -> list[Any]:
        """pagedkv's specs of the groups vLLM's planning makes of one layer per spec, in its
        order (the swarm's hybrid configurations are drawn through it). Mamba specs plan as the
        engine plans them with prefix caching off (mode "none", their own block size)."""
        block_size, mamba_block_size = engine_block_sizes(specs)
        has_mamba = mamba_block_size is not None
        config = path.vllm_config(
            block_size,
            mamba_block_size or block_size,
            False,
            None,
            not has_mamba,
            mamba_block_size=mamba_block_size,
        )
        groups = path.plan_groups(vllm_specs(specs, False), config)
        ours = [specs[int(group.layer_names[0].rpartition(".")[2])] for group in groups]
        check_planned_sizes(groups, ours)
        return ours

    def vllm_manager(config: ManagerConfig) -> Vllm033Manager:
        """vLLM's manager for `config`, built as the release's scheduler builds it."""
        ours = config.kv_cache_config
        specs = [group.kv_cache_spec for group in ours.kv_cache_groups]
        retention = (
            ours.prefix_cache_retention_interval
            if any(
                isinstance(spec, SlidingWindowSpec)
                or (isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align")
                for spec in specs
            )
            else engine_settings.retention  # acts on sliding-window and Mamba "align" groups
        )
        block_size, mamba_block_size = engine_block_sizes(specs)
        engine_config = path.vllm_config(
            block_size,
            config.max_model_len,
            config.use_eagle,
            retention,
            config.enable_caching,
            ours.num_blocks,
            mamba_block_size,
        )
        groups = path.plan_groups(vllm_specs(specs, config.use_eagle), engine_config)
        planned = [tuple(group.layer_names) for group in groups]
        if planned != [(f"layers.{g}",) for g in range(len(specs))]:
            raise UnplannableError(
                f"vLLM's planning groups the layers as {planned}, not one group per layer in "
                "the drawn order: draw hybrid configurations through DOMAIN's plan"
            )
        check_planned_sizes(groups, specs)
        kv_cache_config, scheduler_block_size, hash_block_size = path.kv_cache_config(
            groups, ours.num_blocks, engine_config
        )
        manager = KVCacheManager(
            kv_cache_config,
            config.max_model_len,
            max_in_flight_tokens=config.max_in_flight_tokens
            or engine_settings.max_in_flight_tokens,
            enable_caching=config.enable_caching,
            use_eagle=config.use_eagle,
            num_prefill_lookahead=0,
            log_stats=config.log_stats,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            watermark=engine_settings.values["watermark"],
            enable_mamba_shared_prefix_checkpoint=engine_settings.values[
                "enable_mamba_shared_prefix_checkpoint"
            ],
            **dict(release.manager_arguments),
        )
        return release.manager(manager, api, config, hasher(hash_block_size))

    vllm_manager.evict_blocks = True  # type: ignore[attr-defined]  # offers_evict_blocks
    vllm_manager.mamba_groups = True  # type: ignore[attr-defined]  # offers_mamba_groups
    vllm_manager.mamba_align = release.mamba_align  # type: ignore[attr-defined]  # offers_mamba_align
    vllm_manager.mixed_block_sizes = release.mixed_block_sizes  # type: ignore[attr-defined]
    vllm_manager.full_sequence_must_fit = True  # type: ignore[attr-defined]  # the gate
    vllm_manager.cache_blocks = True  # type: ignore[attr-defined]  # offers_cache_blocks
    vllm_manager.external_tokens = True  # type: ignore[attr-defined]  # a connector's tokens
    vllm_manager.deferred_frees = True  # type: ignore[attr-defined]  # offers_deferred_frees

    domain = dataclasses.replace(
        DOMAIN, retention_intervals=(engine_settings.retention,), group_plan=plan
    )
    notes = (
        f"vllm {release.version}'s manager built as its engine builds it: "
        f"{engine_settings.describe()}",
    )
    return Loaded(vllm_pool, vllm_manager, domain, notes)
