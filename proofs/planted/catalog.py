"""Planted bugs: deliberately broken variants of pagedkv's implementation, and how to plant them.

Each `Variant` is one realistic mistake, written as the code would look with it: a method of an
impl class replaced (`MethodPatch`), a module-level function replaced wherever impl binds it
(`FunctionPatch`, e.g. `pagedkv.manager` imports `num_required_blocks` by name), one module's
binding of a function replaced (`CallSitePatch`: that module's calls pass a wrong argument, while
the function itself, and every contract on it, stays right), or a field of a shared value
changed (`FieldPatch`). Nothing is edited: `planted(variant)` swaps the attributes in this
process and restores them on exit, so checkers run unchanged against the broken code.

Most variants break impl only, and the spec stays correct. The last group breaks the vocabulary
both sides share (`pagedkv.vocab`: the `Request` type, the default semantics switches): the spec
and the implementation then see the same broken thing, and only what the spec decides for itself
(its own statement of pagedkv's semantics) and what the client checks for itself (its own record
of every request it sent) can catch them.

Public methods of the pool and the manager check arguments and guard the call, then run the
method that does the work: the manager's underscored ones, the pool's `*_locked` ones (which the
manager calls directly, holding the call token). Variants replace those, so both paths see the
bug.

`proofs.planted.bugs` runs every checker against every variant and tabulates what caught it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import pagedkv
from pagedkv import (
    block_counts,
    block_hash,
    block_pool,
    free_queue,
    kv_cache_coordinator,
    manager,
)
from pagedkv.block import KVCacheBlock
from pagedkv.harness.client.manager import Live, ManagerClient
from pagedkv.single_type import base, chunked_local, mamba, sliding_window
from pagedkv.spec import block_hash as spec_block_hash
from pagedkv.spec.single_type import chunked_local as spec_chunked_local
from pagedkv.spec.single_type import sliding_window as spec_sliding_window
from pagedkv.vocab import refusals
from pagedkv.vocab.errors import BlockStateError, FreeQueueError
from pagedkv.vocab.hashes import BlockHashType, CacheKey, CacheSalt, ExtraKey, key_group, key_hash
from pagedkv.vocab.kv_events import BlockRemoved
from pagedkv.vocab.request import PlaceholderRange, Request, TokenView
from pagedkv.vocab.semantics import PAGEDKV

PLANT_ENV = "PAGEDKV_PLANTED"
"""The environment variable that names the variant a fresh process plants (the pytest plugin,
the CrossHair suite of manager contracts)."""

# The untouched functions, captured before anything is planted (a variant may wrap them).
_MM_INPUTS_IN_BLOCK = block_hash.mm_inputs_in_block
_FIRST_MM_INPUT = block_hash.first_mm_input
_EXTRA_KEYS = block_hash.generate_block_hash_extra_keys
_NUM_FULL_BLOCKS = block_counts.num_full_blocks
_NUM_REQUIRED_BLOCKS = block_counts.num_required_blocks


@dataclass(frozen=True)
class MethodPatch:
    """Replace `owner.attribute` (a method of an impl class, or of the campaigns' client for a
    scheduler's mistake) with `replacement`."""

    owner: type
    attribute: str
    replacement: Callable[..., Any]

    def bindings(self) -> list[tuple[object, str, object]]:
        """(object, attribute, original value) for every place this patch changes."""
        return [(self.owner, self.attribute, self.owner.__dict__[self.attribute])]


@dataclass(frozen=True)
class FunctionPatch:
    """Replace a module-level function of impl everywhere impl binds it by name.

    Every loaded `pagedkv.*` module outside `pagedkv.spec`, `pagedkv.harness` and `pagedkv.gpu`
    whose attribute is `original` gets `replacement`: callers in the defining module and callers
    that imported the name (`from pagedkv.block_counts import fits`) all see the broken one.
    With `side="spec"`, the same for a function of the spec, in every `pagedkv.spec` module.
    """

    original: Callable[..., Any]
    replacement: Callable[..., Any]
    side: Literal["impl", "spec"] = "impl"

    def bindings(self) -> list[tuple[object, str, object]]:
        found: list[tuple[object, str, object]] = []
        in_side = _is_impl_module if self.side == "impl" else _is_spec_module
        for name, module in sorted(sys.modules.items()):
            if not in_side(name) or module is None:
                continue
            for attribute, value in vars(module).items():
                if value is self.original:
                    found.append((module, attribute, value))
        if not found:
            raise LookupError(f"no impl module binds {self.original.__qualname__}")
        return found


@dataclass(frozen=True)
class CallSitePatch:
    """Replace one impl module's binding of a function: that module's calls go to
    `replacement`, every other module (and every contract on the function) keeps the original.
    """

    module: types.ModuleType
    name: str
    replacement: Callable[..., Any]

    def bindings(self) -> list[tuple[object, str, object]]:
        if self.name not in vars(self.module):
            raise LookupError(f"{self.module.__name__} binds no {self.name}")
        return [(self.module, self.name, vars(self.module)[self.name])]


def _is_impl_module(name: str) -> bool:
    if name != "pagedkv" and not name.startswith("pagedkv."):
        return False
    return not name.startswith(("pagedkv.spec", "pagedkv.harness", "pagedkv.gpu"))


def _is_spec_module(name: str) -> bool:
    return name == "pagedkv.spec" or name.startswith("pagedkv.spec.")


@dataclass(frozen=True)
class FieldPatch:
    """Set field `name` of a shared value (a frozen dataclass such as the default `Semantics`)
    to `value`: every default argument that refers to the value sees it."""

    instance: object
    name: str
    value: object

    @property
    def replacement(self) -> object:
        return self.value

    def bindings(self) -> list[tuple[object, str, object]]:
        return [(self.instance, self.name, getattr(self.instance, self.name))]


Patch = MethodPatch | FunctionPatch | CallSitePatch | FieldPatch


@dataclass(frozen=True)
class Variant:
    """One planted bug.

    Attributes:
        name: a short identifier (used on command lines and in the table).
        description: the mistake, in one line.
        patches: what planting it replaces.
        layer: the campaign layer that reaches the mistake first ("manager", "hybrid",
            "pool"): the campaign checker starts there, then runs the others.
        decision: a mistake in which block serves which tokens, planted in the spec and the
            implementation alike (so they still agree): only what attention reads can show
            it, and the campaign must catch it by the attention-truth invariant.
    """

    name: str
    description: str
    patches: tuple[Patch, ...]
    layer: str = "manager"
    decision: bool = False

    @property
    def replaced_functions(self) -> tuple[FunctionPatch, ...]:
        """The module-level functions of impl it replaces (CrossHair's contracts can call
        those)."""
        return tuple(
            patch
            for patch in self.patches
            if isinstance(patch, FunctionPatch) and patch.side == "impl"
        )


def _changes(variant: Variant) -> list[tuple[object, str, object, object]]:
    """(object, attribute, original, replacement) for every binding the variant changes."""
    return [
        (owner, attribute, original, patch.replacement)
        for patch in variant.patches
        for owner, attribute, original in patch.bindings()
    ]


@contextmanager
def planted(variant: Variant | None) -> Iterator[None]:
    """Plant `variant` (None: nothing) in this process for the duration of the block."""
    changes = [] if variant is None else _changes(variant)
    applied: list[tuple[object, str, object]] = []
    try:
        for owner, attribute, original, replacement in changes:
            _set(owner, attribute, replacement)
            applied.append((owner, attribute, original))
        yield
    finally:
        for owner, attribute, original in reversed(applied):
            _set(owner, attribute, original)


def plant_for_good(variant: Variant) -> None:
    """Plant `variant` for the rest of this process (meant for a dedicated subprocess)."""
    for owner, attribute, _, replacement in _changes(variant):
        _set(owner, attribute, replacement)


def _set(owner: object, attribute: str, value: object) -> None:
    """setattr, also on an instance of a frozen dataclass (a `FieldPatch`)."""
    if dataclasses.is_dataclass(owner) and not isinstance(owner, type):
        object.__setattr__(owner, attribute, value)
    else:
        setattr(owner, attribute, value)


def rebound(function: Callable[..., Any], **globals_: object) -> Callable[..., Any]:
    """`function`'s own code, reading the given global names from a copy of its globals."""
    copy = types.FunctionType(
        function.__code__,
        {**function.__globals__, **globals_},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = dict(function.__annotations__)
    copy.__doc__ = function.__doc__
    copy.__qualname__ = function.__qualname__
    return copy


# -- the block pool and its free queue ---------------------------------------------------------


def append_at_head(self: free_queue.FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    """FreeKVCacheBlockQueue.append linking the block at the head: freed last, evicted first."""
    if self.contains(block):
        raise FreeQueueError(block.block_id, "append of a block already in the free queue")
    head = self.free_list_head
    block.next_free_block = head
    if head is None:
        self.free_list_tail = block
    else:
        head.prev_free_block = block
    self.free_list_head = block
    self.num_free_blocks += 1


def released_at_head(self: free_queue.FreeKVCacheBlockQueue, blocks: list[KVCacheBlock]) -> None:
    """FreeKVCacheBlockQueue.append_released with the same mistake, for the blocks the pool
    frees (each linked at the head)."""
    for block in blocks:
        append_at_head(self, block)


def _touch_without_unlink(self: block_pool.BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
    """BlockPool.touch_owned_locked taking the reference but leaving a free block in the free
    queue."""
    for block in blocks:
        if block is self.null_block:
            if self.semantics.null_block_refcounted:
                block.ref_cnt += 1
            continue
        block.ref_cnt += 1


def _evict_keeping_hash(self: block_pool.BlockPool, block: KVCacheBlock) -> None:
    """BlockPool._maybe_evict_cached_block dropping the index entry but not the block's hash."""
    cached_hash = block.block_hash
    if cached_hash is None:
        return
    cached = self.cached_block_hash_to_block[cached_hash]
    del cached[block.block_id]
    if not cached:
        del self.cached_block_hash_to_block[cached_hash]


def _evict_to_queue_head(self: block_pool.BlockPool, block_ids: list[int]) -> list[KVCacheBlock]:
    """BlockPool.evict_blocks_locked that also moves each free block it evicts to the head of
    the free queue, as if it were freed anew without a hash (vLLM keeps its place)."""
    for block_id in block_ids:
        if not 0 <= block_id < self.num_gpu_blocks:
            raise refusals.foreign_block(block_id)
    evicted = []
    for block_id in block_ids:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._maybe_evict_cached_block(block)
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.free_block_queue.appendleft(block)
            evicted.append(block)
    return evicted


def _free_blocks_null_queued(
    self: block_pool.BlockPool, ordered_blocks: Iterable[KVCacheBlock]
) -> None:
    """BlockPool.free_blocks_locked whose null-block guard covers only the decrement: the null
    block's ref_cnt is 0 under pagedkv semantics, so freeing it links it into the free queue."""
    blocks = list(ordered_blocks)
    null_block = self.null_block
    seen: set[int] = set()
    for block in blocks:
        self._check_owned(block)
        if block is null_block:
            continue
        if block.ref_cnt <= 0:
            raise BlockStateError(block.block_id, "free of a block whose ref_cnt is 0")
        if block.block_id in seen:
            raise BlockStateError(block.block_id, "the same block twice in one free_blocks call")
        seen.add(block.block_id)
    for block in blocks:
        if block is not null_block or self.semantics.null_block_refcounted:
            block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_block_queue.append(block)


def _drop_from_index(pool: block_pool.BlockPool, block: KVCacheBlock) -> CacheKey | None:
    """The eviction variants' common part: drop `block` from the index and clear its hash,
    announcing nothing; the hash it held, if any."""
    cached_hash = block.block_hash
    if cached_hash is None:
        return None
    cached = pool.cached_block_hash_to_block[cached_hash]
    del cached[block.block_id]
    if not cached:
        del pool.cached_block_hash_to_block[cached_hash]
    block.reset_hash()
    return cached_hash


def _evict_announcing_every_block(self: block_pool.BlockPool, block: KVCacheBlock) -> None:
    """BlockPool._maybe_evict_cached_block announcing a BlockRemoved for every evicted block, as
    vLLM does, even while another block still caches the hash: a duplicate removal."""
    evicted = _drop_from_index(self, block)
    if evicted is not None and self.enable_kv_cache_events:
        removed = BlockRemoved((key_hash(evicted).hash_value,), key_group(evicted))
        self.kv_event_queue.append(removed)


def _evict_unannounced(self: block_pool.BlockPool, block: KVCacheBlock) -> None:
    """BlockPool._maybe_evict_cached_block dropping a key from the index without announcing it:
    a missing BlockRemoved."""
    _drop_from_index(self, block)


# -- block hashes --------------------------------------------------------------------------------


def _extra_keys_without_salt(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    *,
    include_touching: bool = False,
    mm_position: bool = True,
) -> tuple[tuple[ExtraKey, ...] | None, int]:
    """generate_block_hash_extra_keys with LoRA and multimodal keys but no cache salt."""
    keys, mm_idx = _EXTRA_KEYS(
        request,
        start_token_idx,
        end_token_idx,
        start_mm_idx,
        include_touching=include_touching,
        mm_position=mm_position,
    )
    kept = [key for key in keys or () if not isinstance(key, CacheSalt)]
    return (tuple(kept) if kept else None), mm_idx


def _vllm_new_block_keys(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    *,
    include_touching: bool = False,
    mm_position: bool = True,
) -> tuple[tuple[ExtraKey, ...] | None, int]:
    """vLLM 0.8.5's keys for a block cache_full_blocks hashes (from the last multimodal input,
    one ending where the block starts included, keyed by its hash alone), whatever the
    semantics asked for."""
    last = max(len(request.mm_positions) - 1, 0)
    return _EXTRA_KEYS(
        request, start_token_idx, end_token_idx, last, include_touching=True, mm_position=False
    )


def _mm_inputs_closed_interval(
    ranges: block_hash.PlaceholderTuples,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    include_touching: bool = False,
) -> tuple[list[int], int]:
    """mm_inputs_in_block testing overlap on closed intervals: an input that ends exactly where
    the block starts joins the block (`input_end < start` where `<=` was meant)."""
    return _MM_INPUTS_IN_BLOCK(ranges, start_token_idx, end_token_idx, start_mm_idx, True)


def _first_mm_input_closed_interval(
    positions: Sequence[PlaceholderRange], token_idx: int, include_touching: bool = False
) -> int:
    """first_mm_input with the same closed-interval mistake: a scan that starts at a block
    (cache_full_blocks after a decode) begins at an input ending exactly there."""
    return _FIRST_MM_INPUT(positions, token_idx, True)


# -- allocate_slots arithmetic -------------------------------------------------------------------


def _required_blocks_floor(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int:
    """num_required_blocks by floor division: the step's last, partial block is missing."""
    return (num_computed_tokens + num_tokens + num_lookahead_tokens) // block_size


def _fits_ignoring_evictable_hits(num_new: int, num_free: int, num_evictable_hits: int) -> bool:
    """fits forgetting that touching a free prefix hit takes it off the free queue."""
    return num_new <= num_free


# -- the manager ---------------------------------------------------------------------------------


def _full_blocks_with_drafts(
    num_computed_tokens: int, num_tokens: int, num_spec_tokens: int, block_size: int
) -> int:
    """num_full_blocks as allocate_slots would call it forgetting the speculative tokens: a
    block filled only by draft tokens is cached (under the hash of tokens it does not have)."""
    return _NUM_FULL_BLOCKS(num_computed_tokens, num_tokens, 0, block_size)


def _required_blocks_without_lookahead(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int:
    """num_required_blocks as allocate_slots would call it forgetting the lookahead slots."""
    return _NUM_REQUIRED_BLOCKS(num_computed_tokens, num_tokens, 0, block_size)


def _evictable_hits_counting_null(
    self: manager.KVCacheManager, hits: tuple[list[KVCacheBlock], ...]
) -> int:
    """_num_evictable_hits as vLLM 0.8.5 counts them, whatever the semantics: the null block's
    ref_cnt is 0 under pagedkv semantics, so each null hit is counted as leaving the queue."""
    return sum(1 for group_hits in hits for block in group_hits if block.ref_cnt == 0)


_SINGLE_TYPE_FREE = base.SingleTypeKVCacheManager.free


def _free_head_first(
    self: base.SingleTypeKVCacheManager, request_id: str, tail_first: bool
) -> None:
    """SingleTypeKVCacheManager.free releasing blocks head first even with caching on (no
    reversal)."""
    _SINGLE_TYPE_FREE(self, request_id, False)


def _computed_blocks_without_last_block_rule(
    self: manager.KVCacheManager, request: Request
) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """_get_computed_blocks looking up every full block, so a fully cached prompt computes
    nothing and yields no logits."""
    if not self.enable_caching:
        return self._no_blocks, 0  # type: ignore[return-value]
    self._check_identity(request)
    request_id = request.request_id
    block_hashes = self.req_to_block_hashes.get(request_id)
    if not block_hashes:
        block_hashes = block_hash.hash_request_tokens(
            self.caching_hash_fn, self.block_size, request
        )
        self.req_to_block_hashes[request_id] = block_hashes
        self._track(request_id, request)
    stats = self.prefix_cache_stats
    if stats is not None:
        stats.requests += 1
    if request.prompt_logprobs:
        self._after_call()
        return self._no_blocks, 0  # type: ignore[return-value]
    hits = self.coordinator.find_longest_cache_hit(block_hashes, block_hashes)
    num_hits = len(hits[0])
    if stats is not None:
        stats.queries += len(block_hashes)
        stats.hits += num_hits
    self._after_call()
    return hits, num_hits * self.block_size


# -- sliding window ------------------------------------------------------------------------------


def _first_useful_block_off_by_one(
    num_computed_tokens: int, sliding_window: int, block_size: int
) -> int:
    """first_useful_block from the window's start + 1: a block the next token still attends to
    is freed."""
    return (num_computed_tokens - sliding_window + 2) // block_size


def _first_useful_block_one_early(
    num_computed_tokens: int, sliding_window: int, block_size: int
) -> int:
    """first_useful_block from the window's start - 1: a block the window has left stays held
    (and referenced) one step longer."""
    return (num_computed_tokens - sliding_window) // block_size


def _window_blocks_floor(sliding_window: int, block_size: int) -> int:
    """num_window_blocks by floor division: a hit may end with too few cached blocks."""
    return (sliding_window - 1) // block_size


# -- decisions both sides make alike (the attention-truth class) -------------------------------

_SPEC_BLOCKS_NEEDED = spec_sliding_window.contiguous_blocks_needed
_SPEC_EXTRA_KEYS = spec_block_hash.block_extra_keys


def _spec_window_run_one_short(sliding_window: int, block_size: int) -> int:
    """The spec's contiguous_blocks_needed one block short (at least one)."""
    return max(_SPEC_BLOCKS_NEEDED(sliding_window, block_size) - 1, 1)


def _window_run_one_short(sliding_window: int, block_size: int) -> int:
    """num_window_blocks one block short (at least one), as the spec's above."""
    return max(block_counts.cdiv(sliding_window - 1, block_size) - 1, 1)


def _spec_window_freed_early(
    self: spec_sliding_window.SlidingWindow, num_computed_tokens: int
) -> int:
    """SlidingWindow.num_skipped for the token after the next one: the block the next token's
    window starts in is freed one token early."""
    return spec_sliding_window.sliding_window_skipped(
        num_computed_tokens + 1, self.sliding_window, self.block_size
    )


def _spec_chunk_freed_early(
    self: spec_chunked_local.ChunkedLocalAttention, num_computed_tokens: int
) -> int:
    """ChunkedLocalAttention.num_skipped for the token after the next one: when the next token
    is its chunk's last, the chunk's blocks are freed before it reads them."""
    return spec_chunked_local.chunked_local_skipped(
        num_computed_tokens + 1, self.attention_chunk_size, self.block_size
    )


def _chunk_freed_early(
    self: chunked_local.ChunkedLocalAttentionManager, num_computed_tokens: int
) -> int:
    """ChunkedLocalAttentionManager.num_skipped_blocks with the spec's mistake above."""
    return _CHUNK_SKIPPED(self, num_computed_tokens + 1)


_CHUNK_SKIPPED = chunked_local.ChunkedLocalAttentionManager.num_skipped_blocks


def _spec_keys_without_place(
    request: Request, start: int, end: int, *, mm_position: bool = True
) -> tuple[ExtraKey, ...] | None:
    """block_extra_keys keying a multimodal input by its hash alone, whatever was asked."""
    return _SPEC_EXTRA_KEYS(request, start, end, mm_position=False)


def _keys_without_place(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    *,
    include_touching: bool = False,
    mm_position: bool = True,
) -> tuple[tuple[ExtraKey, ...] | None, int]:
    """generate_block_hash_extra_keys with the spec's mistake above."""
    return _EXTRA_KEYS(
        request,
        start_token_idx,
        end_token_idx,
        start_mm_idx,
        include_touching=include_touching,
        mm_position=False,
    )


# -- the catalog ---------------------------------------------------------------------------------

# -- the shared vocabulary ---------------------------------------------------------------------

_APPEND_OUTPUT_TOKEN_IDS = Request.append_output_token_ids


def _append_first_token_only(self: Request, token_ids: int | Iterable[int]) -> None:
    """Request.append_output_token_ids whose path for a list appends its first token only."""
    if isinstance(token_ids, (list, tuple)) and len(token_ids) > 1:
        _APPEND_OUTPUT_TOKEN_IDS(self, token_ids[0])
        return
    _APPEND_OUTPUT_TOKEN_IDS(self, token_ids)


def _token_view_of_a_copy(self: TokenView, tokens: list[int]) -> None:
    """TokenView.__init__ keeping a copy of the token list: the view misses every append."""
    self._tokens = list(tokens)


# -- the hybrid coordinator ----------------------------------------------------------------------


def _hit_cut_not_found_again(
    self: kv_cache_coordinator.HybridKVCacheCoordinator, block_hashes: list[BlockHashType]
) -> tuple[list[KVCacheBlock], ...]:
    """One pass over the groups, full attention first; each group's hit is then cut to the
    final length instead of being found again at it (a windowed group's cut hit may not be a
    hit: its last blocks before the cut were skipped as null)."""
    managers = self.single_type_managers
    hits: list[list[KVCacheBlock]] = [[] for _ in managers]
    length = len(block_hashes)
    for group in (*self._full_groups, *self._skipping_groups):
        hits[group] = managers[group].find_longest_cache_hit(block_hashes[:length])
        length = min(length, len(hits[group]))
    for hit in hits:
        del hit[length:]
    return tuple(hits)


def _blocks_of_one_group(self: kv_cache_coordinator.KVCacheCoordinator, num_new: int) -> int:
    """Capacity counted for one group's blocks, as if each group had a pool of its own."""
    return num_new


def _free_last_group_first(
    self: kv_cache_coordinator.KVCacheCoordinator, request_id: str, tail_first: bool
) -> None:
    """free, with the groups released last first (each group's tail still first): the free
    queue's order, and so which cached blocks are evicted first, changes."""
    for single_type in reversed(self.single_type_managers):
        single_type.free(request_id, tail_first)


_MAMBA_INIT = mamba.MambaManager.__init__


def _mamba_without_speculative_blocks(
    self: mamba.MambaManager, kv_cache_spec: Any, block_pool: Any, group_id: int
) -> None:
    """MambaManager.__init__ that forgets the spec's speculative state blocks."""
    _MAMBA_INIT(self, kv_cache_spec, block_pool, group_id)
    self.extra_blocks = 0


def _mamba_align_never_defers(self: mamba.MambaAlignManager, hits: Sequence[Any]) -> bool:
    """MambaAlignManager.defers that never defers: a hit on a state keyed in this scheduler
    step is adopted before the step's forward pass has written it."""
    return False


_MANAGER_INIT = manager.KVCacheManager.__init__


def _gate_without_admission_caps(self: manager.KVCacheManager, *args: Any, **kwargs: Any) -> None:
    """KVCacheManager.__init__ that leaves the admission caps out: the full-sequence gate then
    counts every block a window or chunk group would need for the whole request."""
    _MANAGER_INIT(self, *args, **kwargs)
    self._admission_caps = (None,) * self.num_groups


def _adopt_and_load_group_by_group(
    self: manager.KVCacheManager,
    request_id: str,
    adopted: list[list[Any]],
    num_loaded: int,
) -> None:
    """vLLM's connector path before PR #44409 (issue #43884): each group touches its hits and
    takes its external blocks before the next group touches its own, so one group's external
    blocks may be another group's hits still in the free queue: evicted, then handed out
    twice."""
    pool = self.block_pool
    for group, single_type in enumerate(self.coordinator.single_type_managers):
        if self.enable_caching:
            pool.touch_owned_locked(adopted[group])
        single_type.add_hits(request_id, adopted[group])
        if num_loaded:
            blocks = single_type.req_to_blocks[request_id]
            count = min(
                single_type.num_required(num_loaded) - len(blocks),
                pool.get_num_free_blocks(),
                self._max_blocks[group] - len(blocks),
            )
            single_type.allocate_new_blocks(request_id, count)


_FREE_BLOCKS_LOCKED = block_pool.BlockPool.free_blocks_locked


def _free_blocks_without_duplicate_check(
    self: block_pool.BlockPool, blocks: list[KVCacheBlock]
) -> None:
    """vLLM's `free_blocks` neither dedups nor asserts (issue #42571: a caller passed the same
    block twice, the free queue's count went wrong): a repeat is freed again, unchecked."""
    seen: set[int] = set()
    first: list[KVCacheBlock] = []
    again: list[KVCacheBlock] = []
    for block in blocks:
        (again if id(block) in seen else first).append(block)
        seen.add(id(block))
    _FREE_BLOCKS_LOCKED(self, first)
    if again:
        _FREE_BLOCKS_LOCKED(self, again)


_FINISH_REQUEST = ManagerClient._finish_request


def _abort_frees_a_loading_request(self: ManagerClient, live: Live, deferred: bool = False) -> None:
    """vLLM's scheduler before the fix of issue #32255: an abort in WAITING_FOR_REMOTE_KVS
    frees the request at once, while its load still writes the blocks."""
    live.loading = False
    _FINISH_REQUEST(self, live, deferred)


def _release_popped_flattened(
    self: manager.KVCacheManager, groups: list[list[KVCacheBlock]]
) -> None:
    """vLLM 0.33's drain of a deferred free (issue #48489): one `free_blocks` over every group's
    popped blocks, reversed, so the last group's cached blocks are evicted first."""
    self.block_pool.free_blocks_locked([block for blocks in groups for block in blocks][::-1])


def _reset_keeping_tier(self: manager.KVCacheManager) -> bool:
    """vLLM 0.33's default reset (issue #57727, `reset_connector=False`): the GPU pool's
    hashes are forgotten, but the CPU offload tier keeps serving the chunks stored before."""
    if not self.block_pool.reset_prefix_cache_locked():
        return False
    if self.prefix_cache_stats is not None:
        self.prefix_cache_stats.reset = True
    self._after_call()
    return True


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "free_to_head",
        "a freed block joins the free queue at the head, so it is evicted first",
        (
            MethodPatch(free_queue.FreeKVCacheBlockQueue, "append", append_at_head),
            MethodPatch(free_queue.FreeKVCacheBlockQueue, "append_released", released_at_head),
        ),
    ),
    Variant(
        "touch_keeps_queued",
        "touch takes a reference to a free cached block but leaves it in the free queue",
        (MethodPatch(block_pool.BlockPool, "touch_owned_locked", _touch_without_unlink),),
    ),
    Variant(
        "eviction_keeps_hash",
        "eviction drops the index entry but the reused block keeps its old hash",
        (MethodPatch(block_pool.BlockPool, "_maybe_evict_cached_block", _evict_keeping_hash),),
    ),
    Variant(
        "null_block_freed",
        "free_blocks guards only the null block's decrement, so it joins the free queue",
        (MethodPatch(block_pool.BlockPool, "free_blocks_locked", _free_blocks_null_queued),),
    ),
    Variant(
        "evict_to_queue_head",
        "evict_blocks moves a free block it evicts to the head of the free queue (reused first)",
        (MethodPatch(block_pool.BlockPool, "evict_blocks_locked", _evict_to_queue_head),),
    ),
    Variant(
        "event_removed_per_block",
        "a BlockRemoved for every evicted block, though another block still caches the hash",
        (
            MethodPatch(
                block_pool.BlockPool, "_maybe_evict_cached_block", _evict_announcing_every_block
            ),
        ),
    ),
    Variant(
        "event_eviction_unannounced",
        "a hash evicted from the index at reuse without a BlockRemoved event",
        (MethodPatch(block_pool.BlockPool, "_maybe_evict_cached_block", _evict_unannounced),),
    ),
    Variant(
        "capacity_counts_null",
        "the capacity check counts null hits as evictable under pagedkv semantics",
        (
            MethodPatch(
                manager.KVCacheManager, "_num_evictable_hits", _evictable_hits_counting_null
            ),
        ),
    ),
    Variant(
        "fits_ignores_hits",
        "the capacity check forgets that touching a free prefix hit takes it off the queue",
        (FunctionPatch(block_counts.fits, _fits_ignoring_evictable_hits),),
    ),
    Variant(
        "required_floor",
        "required blocks by floor division: the step's partial last block is not allocated",
        (FunctionPatch(block_counts.num_required_blocks, _required_blocks_floor),),
    ),
    Variant(
        "forward_free",
        "free releases a request's blocks head first with caching on (prefix evicted first)",
        (MethodPatch(base.SingleTypeKVCacheManager, "free", _free_head_first),),
    ),
    Variant(
        "no_last_block_rule",
        "a fully cached prompt is a full hit: its last block is not recomputed",
        (
            MethodPatch(
                manager.KVCacheManager,
                "_get_computed_blocks",
                _computed_blocks_without_last_block_rule,
            ),
        ),
    ),
    Variant(
        "drafts_as_full_blocks",
        "allocate_slots counts draft tokens as computed: blocks full only of drafts are cached",
        (CallSitePatch(manager, "num_full_blocks", _full_blocks_with_drafts),),
    ),
    Variant(
        "lookahead_ignored",
        "allocate_slots leaves the lookahead slots out of the blocks it requires",
        (CallSitePatch(manager, "num_required_blocks", _required_blocks_without_lookahead),),
    ),
    Variant(
        "window_off_by_one",
        "the sliding window's first useful block is one token late: a needed block is freed",
        (FunctionPatch(sliding_window.first_useful_block, _first_useful_block_off_by_one),),
    ),
    Variant(
        "window_start_early",
        "the sliding window's first useful block is one token early: a block it left stays held",
        (FunctionPatch(sliding_window.first_useful_block, _first_useful_block_one_early),),
    ),
    Variant(
        "window_blocks_floor",
        "a sliding-window hit needs floor((W - 1) / B) cached blocks instead of the ceiling",
        (FunctionPatch(sliding_window.num_window_blocks, _window_blocks_floor),),
    ),
    Variant(
        "salt_ignored",
        "block extra keys leave the cache salt out: tenants share blocks",
        (FunctionPatch(block_hash.generate_block_hash_extra_keys, _extra_keys_without_salt),),
    ),
    Variant(
        "mm_closed_interval",
        "a multimodal input ending where a block starts joins the block (closed intervals)",
        (
            FunctionPatch(block_hash.mm_inputs_in_block, _mm_inputs_closed_interval),
            FunctionPatch(block_hash.first_mm_input, _first_mm_input_closed_interval),
        ),
    ),
    Variant(
        "vllm_mm_keys",
        "cache_full_blocks keys blocks it completes the vLLM 0.8.5 way under pagedkv semantics",
        (
            MethodPatch(
                block_pool.BlockPool,
                "cache_full_blocks_locked",
                rebound(
                    block_pool.BlockPool.cache_full_blocks_locked,
                    generate_block_hash_extra_keys=_vllm_new_block_keys,
                ),
            ),
        ),
    ),
    Variant(
        "hybrid_hit_cut",
        "a hybrid hit is cut to the length a later group allows, not found again at it",
        (
            MethodPatch(
                kv_cache_coordinator.HybridKVCacheCoordinator,
                "_longest_common_hit",
                _hit_cut_not_found_again,
            ),
        ),
        layer="hybrid",
    ),
    Variant(
        "hybrid_capacity_per_group",
        "a hybrid allocation's capacity is checked for one group's blocks, not every group's",
        (
            MethodPatch(
                kv_cache_coordinator.KVCacheCoordinator,
                "get_num_blocks_to_allocate",
                _blocks_of_one_group,
            ),
        ),
        layer="hybrid",
    ),
    Variant(
        "hybrid_free_last_group_first",
        "a hybrid request's groups are freed last group first (each group's tail still first)",
        (MethodPatch(kv_cache_coordinator.KVCacheCoordinator, "free", _free_last_group_first),),
        layer="hybrid",
    ),
    Variant(
        "mamba_speculative_blocks_dropped",
        "a Mamba group holds no blocks for its speculative states (num_speculative_blocks)",
        (MethodPatch(mamba.MambaManager, "__init__", _mamba_without_speculative_blocks),),
        layer="hybrid",
    ),
    Variant(
        "mamba_align_no_same_step_refusal",
        "a Mamba hit (mode 'align') on a state keyed in the same scheduler step is adopted, "
        "not refused until the next step",
        (MethodPatch(mamba.MambaAlignManager, "defers", _mamba_align_never_defers),),
        layer="hybrid",
    ),
    Variant(
        "gate_without_admission_caps",
        "the full-sequence gate counts every block of a window or chunk group, not its cap",
        (MethodPatch(manager.KVCacheManager, "__init__", _gate_without_admission_caps),),
        layer="hybrid",
    ),
    Variant(
        "vllm_43884_external_evicts_hits",
        "with external tokens, each group takes its external blocks before the next group's "
        "hits are touched (vLLM #43884)",
        (MethodPatch(manager.KVCacheManager, "_adopt_then_load", _adopt_and_load_group_by_group),),
        layer="hybrid",
    ),
    Variant(
        "vllm_32255_abort_frees_loading_blocks",
        "an abort frees a request whose async load is in flight at once, not when the load "
        "finishes (vLLM #32255; planted in the campaigns' scheduler stand-in)",
        (MethodPatch(ManagerClient, "_finish_request", _abort_frees_a_loading_request),),
    ),
    Variant(
        "vllm_42571_free_same_block_twice",
        "free_blocks frees a block listed twice in one call twice, unchecked, as vLLM's does "
        "(vLLM #42571)",
        (
            MethodPatch(
                block_pool.BlockPool, "free_blocks_locked", _free_blocks_without_duplicate_check
            ),
        ),
        layer="pool",
    ),
    Variant(
        "vllm_48489_deferred_free_flattened",
        "a deferred free releases every group's popped blocks in one reversed call, the last "
        "group's first, not group by group as free does (vLLM #48489)",
        (MethodPatch(manager.KVCacheManager, "_release_popped", _release_popped_flattened),),
        layer="hybrid",
    ),
    Variant(
        "vllm_57727_reset_keeps_tier",
        "reset_prefix_cache clears the GPU pool only: the CPU offload tier keeps serving KV "
        "computed before the reset (vLLM #57727)",
        (MethodPatch(manager.KVCacheManager, "_reset_prefix_cache", _reset_keeping_tier),),
    ),
    Variant(
        "decision_window_run_short",
        "a sliding-window hit ends in one cached block fewer than its next token's window reads "
        "(spec and impl alike)",
        (
            FunctionPatch(_SPEC_BLOCKS_NEEDED, _spec_window_run_one_short, side="spec"),
            FunctionPatch(sliding_window.num_window_blocks, _window_run_one_short),
        ),
        decision=True,
    ),
    Variant(
        "decision_window_freed_early",
        "a sliding window frees the block its next token's window starts in, one token early "
        "(spec and impl alike)",
        (
            MethodPatch(spec_sliding_window.SlidingWindow, "num_skipped", _spec_window_freed_early),
            FunctionPatch(sliding_window.first_useful_block, _first_useful_block_off_by_one),
        ),
        decision=True,
    ),
    Variant(
        "decision_chunk_freed_early",
        "chunked local attention frees a chunk's blocks when its last token is the next one "
        "(spec and impl alike)",
        (
            MethodPatch(
                spec_chunked_local.ChunkedLocalAttention, "num_skipped", _spec_chunk_freed_early
            ),
            MethodPatch(
                chunked_local.ChunkedLocalAttentionManager, "num_skipped_blocks", _chunk_freed_early
            ),
        ),
        layer="hybrid",
        decision=True,
    ),
    Variant(
        "decision_mm_key_without_place",
        "a multimodal input keyed by its hash alone, not where it sits in the block (spec and "
        "impl alike)",
        (
            FunctionPatch(_SPEC_EXTRA_KEYS, _spec_keys_without_place, side="spec"),
            FunctionPatch(block_hash.generate_block_hash_extra_keys, _keys_without_place),
        ),
        decision=True,
    ),
    Variant(
        "request_append_first_only",
        "Request.append_output_token_ids keeps only the first token of a list (both sides see it)",
        (MethodPatch(Request, "append_output_token_ids", _append_first_token_only),),
    ),
    Variant(
        "request_view_copies",
        "a request's token view is a copy made at construction: appended tokens go unseen",
        (MethodPatch(TokenView, "__init__", _token_view_of_a_copy),),
    ),
    Variant(
        "default_uncached_to_head",
        "the shared default semantics free unhashed blocks to the queue's head (vLLM 0.33's)",
        (FieldPatch(PAGEDKV, "free_uncached_to_head", True),),
    ),
    Variant(
        "default_usage_without_null",
        "the shared default semantics leave the null block out of the usage (vLLM 0.33's)",
        (FieldPatch(PAGEDKV, "usage_excludes_null_block", True),),
    ),
)
"""Every planted bug, in the order the table lists them: pool, manager, window, hashing, the
hybrid coordinator, then the vocabulary both sides share."""

VARIANTS_BY_NAME: dict[str, Variant] = {variant.name: variant for variant in VARIANTS}

assert pagedkv.BlockPool is block_pool.BlockPool  # the patched classes are the exported ones
