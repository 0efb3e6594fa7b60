"""KVCacheManager: what a scheduler asks of the KV cache, request by request, for any number of
KV cache groups.

Layout of one request's blocks during `allocate_slots` (B tokens a block), in every group:

    | computed | new computed (prefix hits) | new (this step) | lookahead |
    |<------------------------- required ---------------------------->|
    |<------------------- full ------------------->|   cached: full blocks without spec tokens

The scheduler looks a waiting request up (`get_computed_blocks`), reserves slots for the tokens
it schedules (`allocate_slots`, None when they do not fit), and releases a request's blocks when
it is preempted (`free`) or finished (`free` + `free_block_hashes`). Every answer holds one
entry per KV cache group (`KVCacheBlocks`), in the config's group order.

The manager checks each call's preconditions and keeps what is the request's (its identity, its
stored block hashes, the stats, the call token, the decode fast path); its coordinator
(`pagedkv.kv_cache_coordinator`) makes the changes through one per-type manager per group
(`pagedkv.single_type`), all drawing from one `BlockPool`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pagedkv.block import KVCacheBlock
from pagedkv.block_counts import cdiv, fits, num_full_blocks, num_new_blocks, num_required_blocks
from pagedkv.block_hash import (
    Sha256Memo,
    chain_block_hashes,
    first_mm_input,
    generate_block_hash_extra_keys,
    hash_request_tokens,
    need_extra_keys,
)
from pagedkv.block_pool import BlockPool
from pagedkv.call_arguments import (
    MANAGER,
    block_list,
    check_allocation,
    check_cache_blocks,
    check_common_prefix,
    check_lookup,
    check_manager,
    check_popped_blocks,
    check_request,
    check_semantics,
    is_block_id,
)
from pagedkv.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    group_view,
    kv_cache_coordinator,
)
from pagedkv.offload.tier import OffloadTier
from pagedkv.single_type import SingleTypeKVCacheManager
from pagedkv.single_type.full_attention import FullAttentionManager
from pagedkv.single_type.mamba import MambaAlignManager
from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import require_int, require_str
from pagedkv.vocab.errors import (
    ArgumentTypeError,
    ConcurrentUseError,
    InvalidArgumentError,
    InvariantViolation,
)
from pagedkv.vocab.hashes import BlockHashType, ExtraKey, cache_key, get_hash_fn, sha256
from pagedkv.vocab.kv_cache_interface import KVCacheConfig, MambaSpec
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, Semantics

KVCacheBlocks = tuple[Sequence[KVCacheBlock], ...]
"""Blocks per KV cache group, in the config's group order (vLLM's `KVCacheBlocks.blocks`): what
`get_computed_blocks` and `allocate_slots` answer, and the hits `allocate_slots` takes back. A
group's entry is a list, or an empty tuple in an answer that holds no block (one shared,
immutable answer: the decode step allocates nothing for it)."""

SHA256_MEMO_TOKENS = 1 << 18
"""How many tokens' worth of blocks a manager's sha256 memo (`Sha256Memo`) remembers: 16,384
blocks of 16 tokens, about 16 MB at most (measured: 7 MB for 16,384 blocks of distinct tokens)."""

CHECK_INVARIANTS_ENV = "PAGEDKV_CHECK_INVARIANTS"
"""Set to 1 to make every manager run `check_invariants()` after each state-changing call."""


class _Record:
    """What the decode fast path knows of a tracked `Request` without asking it: its id, and
    the list that holds its tokens (`Request.live_token_ids`: its length read at C speed, where
    `num_tokens` would cost a Python call). Both are fixed for the object's life.

    Kept, by the object itself, for every tracked request of type `Request` (a subclass could
    hash itself in any way), by `_track` and `_forget_if_done`: finding the record is the
    identity check (another object with the same id has none).
    """

    __slots__ = ("request_id", "token_ids")

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.token_ids = token_ids


_FULL_PATH = object()
"""`_admit_with_hits`' answer when the full path must decide."""

# `x is _NO_TOKENS`: exactly the int 0 (CPython keeps one 0 object; a bool, a float or an
# int subclass is another object), tested without a call: the decode fast path's test of
# num_external_computed_tokens (measured: type() and == cost a decode step about 60 ns).
_NO_TOKENS = 0


class KVCacheManager:
    """Request-level KV cache management over one `BlockPool`, for one or more KV cache groups.

    Per request it keeps the chained block hashes (`req_to_block_hashes`: one chain for every
    group, kept across preemption, dropped by `free_block_hashes`); each group's per-type
    manager (`coordinator.single_type_managers`) keeps the request's block list of that group
    (one length in every group of one block size; in general, lists covering the same token
    slots; positions a window, a chunk or a Mamba state no longer reads hold the pool's null
    block, as a prefix) and how many of its positions are cached. A request id
    names one `Request` object from its first use until it is freed and its hashes are dropped;
    since a request's tokens only grow, stored hashes can never go stale. Every public method
    checks its preconditions, argument types included (`pagedkv.call_arguments`), in the
    spec's order, before changing anything: a refused call changes nothing in any group.

    With one group, a hit is the group's own (with EAGLE, found for a window one block wider
    under a sliding window, less its last block); with several, the longest every group allows,
    as vLLM 0.33's coordinators find them (`pagedkv.kv_cache_coordinator`). Allocation is all or
    nothing: the blocks every group lacks must fit together, and every group's hits are touched
    before any group takes a new block.

    Not thread-safe, but never silently corrupted: a call that overlaps another call on the
    same manager or its pool (from another thread, or re-entering from a hash function) raises
    `ConcurrentUseError` and changes nothing, while the running call goes on. The guard costs
    about 50 ns a call: it pops a token from a list, which is atomic (a busy flag would cost
    13 ns, but its check-then-set is not). To share a manager between threads, serialize the
    calls with a lock of your own.
    Invariants: `check_invariants()`, mirroring the spec's manager.

    Args:
        kv_cache_config: one or more KV cache groups, each of an attention type the registry
            of per-type managers serves (full attention, sliding window, chunked local
            attention, Mamba with caching off); with caching, groups of several block sizes
            as docs/semantics.md, "Several block sizes with caching", states.
        max_model_len: the longest request, in tokens.
        enable_caching: prefix caching on or off.
        caching_hash_algo: "sha256" (pagedkv's default; memoized, see `SHA256_MEMO_TOKENS`)
            or "builtin" (vLLM 0.8.5's).
        use_eagle: drop the last matched block of a hit (EAGLE needs its hidden states); not
            with chunked local attention.
        log_stats: gather `PrefixCacheStats`.
        semantics: pagedkv's side of the deliberate differences, vLLM 0.33's, or (with one
            group only: it had no hybrid manager) vLLM 0.8.5's.
        enable_kv_cache_events: queue KV cache events (each names its group) for
            `take_events()`.
        max_in_flight_tokens: tokens scheduled but not yet computed, at most (vLLM 0.33's
            `VllmConfig.max_in_flight_tokens`): with `full_sequence_must_fit`, a window or
            chunk group reserves at most the blocks they and its reads span
            (`KVCacheSpec.max_admission_blocks`). None: max_model_len (no cap).
        debug_invariants: run `check_invariants()` after state-changing calls (for
            deployments that prefer an exception to a silent corruption): True or 1 after every
            call, an int n > 1 after every n-th call (the check is O(num_gpu_blocks) plus
            rehashing the tokens of the requests holding blocks), False or 0 never. None reads
            the `PAGEDKV_CHECK_INVARIANTS` environment variable (an int).

    Raises:
        ArgumentTypeError, InvalidArgumentError: an argument of the wrong type or value.
        KVCacheConfigError: groups of different block sizes with caching outside the domain
            served (`refusals.groups_of_several_block_sizes`,
            `refusals.group_block_size_unserved`), a spec no per-type manager serves, EAGLE
            with chunked local attention, or a vLLM 0.8.5 switch with several groups.
    """

    offload_tier: OffloadTier | None = None
    """The CPU offload tier behind this manager's KV connector (`attach_offload_tier`)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: object,
        enable_caching: object = True,
        caching_hash_algo: object = "sha256",
        use_eagle: object = False,
        log_stats: object = False,
        *,
        semantics: Semantics = PAGEDKV,
        enable_kv_cache_events: object = False,
        debug_invariants: object = None,
        max_in_flight_tokens: object = None,
    ) -> None:
        # Arguments a caller supplies are typed `object` and checked here, so that a compiled
        # build refuses a wrong type with the same typed error as the pure one (mypyc would
        # raise a bare TypeError before the body runs). The same holds for every public call.
        config = check_manager(
            kv_cache_config,
            max_model_len,
            enable_caching,
            caching_hash_algo,
            use_eagle,
            log_stats,
            semantics,
            enable_kv_cache_events,
            max_in_flight_tokens,
        )
        assert isinstance(max_model_len, int) and isinstance(enable_caching, bool)
        assert isinstance(use_eagle, bool) and isinstance(log_stats, bool)
        assert isinstance(enable_kv_cache_events, bool)
        specs = [group.kv_cache_spec for group in config.kv_cache_groups]
        self.kv_cache_config = config
        self.num_groups = len(specs)
        self.block_size = specs[0].block_size
        self.num_gpu_blocks = config.num_blocks
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.enable_caching = enable_caching
        self.caching_hash_fn = get_hash_fn(caching_hash_algo)
        if self.caching_hash_fn is sha256:
            # Memoized: blocks of a shared prefix are looked up again by every request that
            # shares it, and SHA-256 is most of a lookup's time (issue 11). Same values.
            self.caching_hash_fn = Sha256Memo(max(SHA256_MEMO_TOKENS // self.block_size, 1))
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self._mm_position = not semantics.mm_keys_without_position  # how hashes key an input
        self.block_pool = BlockPool(
            self.num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events
        )
        # A lookup with EAGLE finds a hit that, less its last block, keeps a whole window
        # (`for_eagle`; not under vLLM 0.8.5, whose window hit is one block short).
        self._eagle_lookup = use_eagle and not semantics.eagle_window_hit_one_short
        self.coordinator: KVCacheCoordinator = kv_cache_coordinator(
            specs,
            self.block_pool,
            use_eagle,
            self._eagle_lookup,
            config.prefix_cache_retention_interval,
            config.scheduler_block_size
            if enable_caching and len(set(config.block_sizes)) > 1
            else None,
        )
        remarks = semantics.mamba_remarks_keyed_boundary and len(config.kv_cache_groups) > 1
        for single_type in self.coordinator.single_type_managers:
            single_type.junction_ignores_eagle = semantics.junction_ignores_eagle
            single_type.remarks_keyed_boundary = remarks
        # Sparse retention (a sliding-window group with an interval): the shared-prefix
        # junction of each request's last lookup, which its caching keeps (several groups).
        self._sparse = self.coordinator.sparse
        self._junctions: dict[str, int] = {}
        check_semantics(semantics, self.num_groups)
        single_type_managers = self.coordinator.single_type_managers
        # The decode fast path's view of the one group (a manager of several takes the full
        # path): its per-type manager and the dicts it keeps.
        # (With a Mamba group in mode "align", the first attention group: a state group's
        # table length is its own, `MambaAlignManager.plan_step`.)
        first = next(
            (m for m in single_type_managers if not m.holds_state), single_type_managers[0]
        )
        # Each group's most blocks a request holds (its own block size, its extra blocks).
        self._max_blocks = tuple(
            manager.num_required(max_model_len) for manager in single_type_managers
        )
        # The most blocks the full-sequence gate reserves per group (None: no cap); tokens in
        # flight default to max_model_len, which caps nothing (vLLM 0.33's default).
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        assert isinstance(in_flight, int)
        self._admission_caps = tuple(
            spec.max_admission_blocks(max_model_len, in_flight) for spec in specs
        )
        self._choose_paths(config, enable_caching, semantics)
        self._unitary = self.num_groups == 1 and not self._per_group
        # The admission fast path's ground: one full-attention group that caches every block.
        self._admits_fast = (
            self._unitary and enable_caching and not first.allows_null_blocks and not first.sparse
        )
        self._first = first
        self._first_blocks = first.req_to_blocks
        self._first_cached = first.num_cached_block
        self._first_skips = first.allows_null_blocks
        # The fast path caches a filled block only when the group caches every full block.
        self._first_dense = not first.sparse
        # The answer of a step that allocates no block, shared (immutable).
        self._no_blocks: KVCacheBlocks = tuple(() for _ in specs)
        self.req_to_block_hashes: dict[str, list[BlockHashType]] = {}
        self._requests: dict[str, Request] = {}
        self._records: dict[Request, _Record] = {}  # the fast path's, by request object
        # Request id -> the (group, position, block id) it held when evict_blocks took that
        # block's hash, until it is freed: what the invariant checks excuse (`evict_blocks`).
        self._evicted: dict[str, set[tuple[int, int, int]]] = {}
        # The deferred frees not yet released (`pop_blocks_for_free`), oldest first: each
        # group's block ids, and those of them evict_blocks took the hash of while held.
        self._popped: list[tuple[tuple[tuple[int, ...], ...], frozenset[int]]] = []
        if debug_invariants is None:
            setting = os.environ.get(CHECK_INVARIANTS_ENV, "0").strip() or "0"
            if not setting.isdigit():
                raise InvalidArgumentError(
                    f"{CHECK_INVARIANTS_ENV} must be a number of calls (0: off), got {setting!r}"
                )
            debug_invariants = int(setting)
        elif not isinstance(debug_invariants, bool):
            debug_invariants = require_int(MANAGER, "debug_invariants", debug_invariants, 0)
        self.debug_invariants = int(debug_invariants)  # fixed at construction
        self._calls_until_check = self.debug_invariants
        # The decode fast path's ground, one flag: one group, one block size, no invariant
        # checks after calls (each of them would be one more test per decode step).
        self._decode_fast = self._unitary and not self.debug_invariants
        # The pool's call token (see BlockPool): a manager call holds it, so a call overlapping
        # it, on the manager or on its pool, is refused; holding it, the manager calls the
        # pool's `*_locked` methods.
        self._call_token = self.block_pool.share_call_token()

    def _choose_paths(
        self, config: KVCacheConfig, enable_caching: bool, semantics: Semantics
    ) -> None:
        """The paths this configuration takes, decided once at construction. Groups whose
        block counts differ (several block sizes, or a group with extra blocks, which needs
        caching off) take the per-group path (`_allocate_per_group`; with caching, the
        adopting path `_allocate_adopting`). Several block sizes with caching: one chain at H
        (the GCD), each group keyed by its view of it, hits and cached prefixes multiples of S
        (the LCM); under vllm-0.33 full attention above H adds partial keys
        (`_cache_partial_tail`). Junctions are recorded under sparse retention, and with a
        Mamba group in mode "align" whatever the retention (`shared_prefix_boundary`)."""
        managers = self.coordinator.single_type_managers
        self._mixed_sizes = len({manager.block_size for manager in managers}) > 1
        self._per_group = self._mixed_sizes or any(manager.extra_blocks for manager in managers)
        self._keeps_junctions = self._sparse or self.coordinator.state_group is not None
        self._mixed_cached = self._mixed_sizes and enable_caching
        self._hash_block_size = config.hash_block_size
        self._scheduler_block_size = config.scheduler_block_size
        self._partial_keys = self._mixed_cached and semantics.partial_prefix_keys

    def _enter(self, call: str) -> None:
        """Take the call token, or refuse a call that overlaps another one. (The calls made
        once a decode step inline this.)"""
        try:
            self._call_token.pop()
        except IndexError:
            raise ConcurrentUseError(call) from None

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, every group's together, the null block counted.
        Complexity: O(1)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since the last call (renewed), or None without `log_stats`.

        Raises:
            ConcurrentUseError: another call on this manager is running.
        """
        self._enter("KVCacheManager.make_prefix_cache_stats")
        try:
            if self.prefix_cache_stats is None:
                return None
            stats = self.prefix_cache_stats
            self.prefix_cache_stats = PrefixCacheStats()
            return stats
        finally:
            self._call_token.append(None)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call, oldest first, each naming its group
        (`pagedkv.vocab.kv_events`); always empty unless `enable_kv_cache_events`.
        Complexity: O(events taken)."""
        return self.block_pool.take_events()

    # -- lookups -----------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The cached blocks a waiting request can reuse in every group, and how many tokens
        they hold (the same number of blocks in every group; with several block sizes,
        `tokens / B_g` in group g, tokens a multiple of their LCM).

        Hashes every full block of the request once and stores the list (one chain for every
        group). No hit when caching is off or the request wants prompt logprobs. When every
        token lies in full blocks, the last block is not looked up (it is recomputed, so the
        last token yields logits). With one group the hit is the group's own; with several, the
        longest every group allows (`pagedkv.kv_cache_coordinator`); a sliding-window or
        chunked group's hit starts with null blocks where it skips positions. With `use_eagle`
        one more block is dropped from a non-empty hit, found under a sliding window for a
        window one block wider, so that a whole window stays. Nothing is touched yet:
        `allocate_slots` does that if the request gets scheduled.

        Raises:
            ArgumentTypeError: `request` is not a Request, or its prompt_logprobs not a bool.
            RequestError: another Request object already uses this request id.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_tokens) the first time, then O(full blocks * groups) lookups plus,
        for each time a sliding-window or chunked group shortens a hit of several groups, one
        more scan of those groups.
        """
        self._enter("KVCacheManager.get_computed_blocks")
        try:
            check_lookup(request)
            return self._get_computed_blocks(request)
        finally:
            self._call_token.append(None)

    def _get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        if not self.enable_caching:
            return self._no_blocks, 0
        self._check_identity(request)
        request_id = request.request_id
        block_size = self._hash_block_size  # the block size, with one
        block_hashes = self.req_to_block_hashes.get(request_id)
        if not block_hashes:
            block_hashes = hash_request_tokens(
                self.caching_hash_fn, block_size, request, mm_position=self._mm_position
            )
            self.req_to_block_hashes[request_id] = block_hashes
            self._track(request_id, request)
        elif (
            self.semantics.lookup_hashes_every_full_block
            and len(block_hashes) * block_size <= request.num_tokens - block_size
        ):  # blocks generated before a preemption (vLLM 0.33's lookup)
            chain = hash_request_tokens(
                self.caching_hash_fn, block_size, request, mm_position=self._mm_position
            )
            block_hashes.extend(chain[len(block_hashes) :])
        stats = self.prefix_cache_stats
        if stats is not None:
            stats.requests += 1
        if request.prompt_logprobs:
            if self._keeps_junctions:
                self._junctions[request_id] = 0
            self._after_call()
            return self._no_blocks, 0
        if self._mixed_cached:
            return self._mixed_lookup(request, block_hashes)
        # Every token in full blocks: leave the last one out, so one block is recomputed.
        last_left_out = len(block_hashes) * block_size == request.num_tokens
        lookup = block_hashes[:-1] if last_left_out else block_hashes
        hits = self.coordinator.find_longest_cache_hit(lookup, block_hashes)
        num_hits = len(hits[0])
        if self._keeps_junctions:
            self._junctions[request_id] = self.coordinator.junction(num_hits, lookup, block_hashes)
        if num_hits:
            # Group 0's blocks carry the hashes themselves: allocate_slots' check of them
            # becomes an identity test.
            self.block_pool.intern_hashes_locked(hits[0], block_hashes)
        if stats is not None:
            stats.queries += len(lookup)
            stats.hits += num_hits
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += num_hits * block_size
        self._after_call()
        return hits, num_hits * block_size

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: object,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
        num_lookahead_tokens: object = 0,
        # Not keyword-only: CPython fills a keyword-only default from a dict on every call
        # (measured: +75 ns a call, 5-10% of a decode step); pass it by keyword all the same.
        full_sequence_must_fit: object = False,
        num_external_computed_tokens: object = 0,
        delay_cache_blocks: object = False,
    ) -> KVCacheBlocks | None:
        """Reserve slots for `num_tokens` scheduled tokens (and lookahead slots) of `request`
        in every group; None when the blocks every group lacks do not fit in the pool together.

        With `num_external_computed_tokens` (a KV connector's tokens after the hits, vLLM
        0.33's connector path; a request's first allocation only), every group adopts its hits
        less those the external tokens push out of its window or chunk (null blocks there,
        untouched), then every group takes the blocks the external tokens fill, then every
        group its new blocks. With `delay_cache_blocks` (an async load) nothing is cached: call
        `cache_blocks` when the load lands.

        With `full_sequence_must_fit` (the admission gate vLLM 0.33's scheduler passes for a
        waiting request), first None, with nothing changed, unless the blocks every group lacks
        for all of the request's tokens (at most max_model_len; a window or chunk group at most
        its `max_admission_blocks`) fit: a chunked prefill is admitted only if its whole
        prompt will fit.

        First frees, group by group, the blocks a window or chunk no longer reads (even if the
        request then does not fit). Then, if the new blocks fit (evictable prefix hits do not
        count as free), touches every group's hits, then group by group appends the hits,
        allocates the rest from the free queue's head and caches every block that became full,
        speculative tokens excluded. A None leaves every group as the first step left it.

        Args:
            request: the request; its `num_computed_tokens` and `spec_token_ids` are read.
            num_tokens: tokens scheduled this step (> 0), speculative ones included.
            new_computed_blocks: the hits from `get_computed_blocks` (one sequence per group),
                for a request that holds no blocks yet.
            num_lookahead_tokens: extra slots for a speculative proposer (>= 0).
            full_sequence_must_fit: admit only if the whole request will fit (above).
            num_external_computed_tokens: tokens after the hits a connector loads (>= 0).
            delay_cache_blocks: cache nothing at this call.

        Returns:
            The newly allocated blocks per group (maybe none; not the blocks the external
            tokens fill, which only the request's table lists), or None.

        Raises:
            ArgumentTypeError, InvalidArgumentError: an argument of the wrong type or out of
                range (`check_allocation`: num_tokens an int >= 0, lookahead and external tokens
                ints >= 0, full_sequence_must_fit and delay_cache_blocks bools, the request's
                num_computed_tokens an int and spec_token_ids a list, the hits a list or tuple
                of one iterable of blocks per group); num_tokens 0 with no hits and no external
                tokens; more speculative tokens than num_tokens; external tokens with a Mamba
                group; hits with caching off; more tokens scheduled than the request has.
            RequestError: another Request object uses the id; num_computed_tokens outside the
                request's slots; hits or external tokens for a request that already holds
                blocks or computed tokens; hits of unequal lengths (several block sizes
                with caching: covering unequal tokens); a hit that is not the request's
                cached block of its group at its position, or a hit of a shape its group's
                attention cannot produce; fewer full blocks than already cached.
            BlockStateError: a hit that does not belong to the pool, or a null hit in a full
                attention group.
            MaxModelLenExceededError: the request would need more than
                cdiv(max_model_len, block_size) blocks.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + new blocks + hits + dropped blocks + blocks to cache *
        block_size); with one group, O(1) for a decode step that stays inside its last block or
        needs a new one, O(block_size) for one that fills its last block.
        """
        try:
            self._call_token.pop()
        except IndexError:
            raise ConcurrentUseError("KVCacheManager.allocate_slots") from None
        try:
            # The decode fast path, for one group: a running request, no hits, nothing skipped,
            # and a step that stays inside its last block (changes nothing), fills it (caches
            # that one block) or needs one new block (allocates it). It acts only once it has
            # seen that every check of the full path below would pass (a request never holds
            # more than max_num_blocks_per_req blocks, so the slots it holds are within
            # max_model_len), and makes exactly the full path's changes. Anything else (a value
            # of another type, a rule broken, more blocks to allocate or cache, extra keys,
            # events on, a window or chunk to drop, invariant checks on) takes the full path,
            # which raises.
            if self._decode_fast and new_computed_blocks is None and type(request) is Request:
                # This very object's record (another with its id has none): id and identity
                # check in one lookup.
                record = self._records.get(request)
                request_id = "" if record is None else record.request_id
                blocks = self._first_blocks.get(request_id)
                # The fields the scheduler sets, read untyped: a compiled build would check the
                # declared type on reading and raise a bare TypeError; the full path refuses.
                fields: Any = request
                num_computed = fields.num_computed_tokens
                spec_token_ids = fields.spec_token_ids
                if (
                    record is not None
                    and blocks is not None
                    and type(num_tokens) is int
                    and type(num_lookahead_tokens) is int
                    and type(num_computed) is int
                    and type(spec_token_ids) is list
                    and full_sequence_must_fit is False  # a gated call takes the full path
                    and delay_cache_blocks is False
                    and num_external_computed_tokens is _NO_TOKENS
                ):
                    block_size = self.block_size
                    num_spec = len(spec_token_ids)
                    num_real = num_computed + num_tokens - num_spec  # then computed, drafts out
                    num_slots = num_computed + num_tokens + num_lookahead_tokens
                    num_held_slots = len(blocks) * block_size
                    if (
                        num_tokens > 0
                        and num_spec <= num_tokens
                        and num_lookahead_tokens >= 0
                        and 0 <= num_computed <= num_held_slots
                        and num_real <= len(record.token_ids)
                        and (
                            not self._first_skips
                            or not self._first.skips_a_block(blocks, num_computed)
                        )
                    ):
                        num_cached = self._first_cached.get(request_id)
                        num_full = num_real // block_size
                        # Whether the step completes no block (caching off: none is cached).
                        completes_none = not self.enable_caching or num_full == num_cached
                        if num_slots <= num_held_slots:
                            if completes_none:
                                return self._no_blocks  # inside the last block
                            stored = self.req_to_block_hashes.get(request_id)
                            if (
                                num_cached is not None
                                and self._first_dense
                                and num_full == num_cached + 1
                                and stored is not None
                                and self.block_pool.cache_next_full_block_locked(
                                    request,
                                    blocks,
                                    stored,
                                    num_cached,
                                    block_size,
                                    self.caching_hash_fn,
                                )
                            ):
                                self._first_cached[request_id] = num_full
                                return self._no_blocks  # fills its last block
                        elif (
                            completes_none
                            and num_slots <= num_held_slots + block_size
                            and len(blocks) < self.max_num_blocks_per_req
                        ):
                            # Needs one new block, which fits when one is free.
                            block = self.block_pool.append_new_block_locked(blocks)
                            if block is not None:
                                return ([block],)
            elif (
                self._admits_fast
                and full_sequence_must_fit is False
                and delay_cache_blocks is False
                and type(num_external_computed_tokens) is int
                and num_external_computed_tokens == 0
                and type(new_computed_blocks) is tuple
                and len(new_computed_blocks) == 1
                and type(request) is Request
            ):
                admitted = self._admit_with_hits(
                    request, num_tokens, new_computed_blocks[0], num_lookahead_tokens
                )
                if admitted is not _FULL_PATH:
                    return admitted  # type: ignore[return-value]
            return self._allocate_slots(
                request,
                num_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                full_sequence_must_fit,
                num_external_computed_tokens,
                delay_cache_blocks,
            )
        finally:
            self._call_token.append(None)

    def _admit_with_hits(
        self, request: Request, num_tokens: object, hits: object, num_lookahead_tokens: object
    ) -> object:
        """The admission fast path (one full-attention group, caching on): a new request with
        a lookup's hits, taken only once every check of the full path is seen to pass but the
        hits' own (`check_hits_locked`, which raises as the full path would: every check before
        it passed), with the full path's changes made without the coordinator's per-group
        tuples and calls. Anything else returns `_FULL_PATH`: the full path decides.
        Complexity: O(hits + new blocks + blocks cached * block_size)."""
        fields: Any = request  # read untyped, as the decode fast path does
        request_id = fields.request_id
        num_computed = fields.num_computed_tokens
        spec_token_ids = fields.spec_token_ids
        if not (
            type(hits) is list
            and hits
            and type(num_tokens) is int
            and type(num_lookahead_tokens) is int
            and type(num_computed) is int
            and type(spec_token_ids) is list
            and num_tokens > 0
            and num_lookahead_tokens >= 0
            and num_computed == 0
            and len(spec_token_ids) <= num_tokens
            and not self.debug_invariants
            and request_id not in self._first_blocks
            and self._requests.get(request_id, request) is request
        ):
            return _FULL_PATH
        stored = self.req_to_block_hashes.get(request_id)
        num_hits = len(hits)
        block_size = self.block_size
        num_real = num_hits * block_size + num_tokens - len(spec_token_ids)
        num_required = -(-(num_hits * block_size + num_tokens + num_lookahead_tokens) // block_size)
        num_full = num_real // block_size
        if (
            stored is None
            or num_hits > len(stored)
            or num_real > request.num_tokens
            or num_required > self.max_num_blocks_per_req
            or num_full < num_hits
            or not all(type(block) is KVCacheBlock for block in hits)
        ):
            return _FULL_PATH
        pool = self.block_pool
        pool.check_hits_locked(request_id, hits, stored, False)
        num_new = num_required - num_hits
        num_evictable = 0
        for block in hits:
            if block.ref_cnt == 0:
                num_evictable += 1
        if not fits(num_new, pool.get_num_free_blocks(), num_evictable):
            return None
        pool.touch_owned_locked(hits)
        blocks = list(hits)  # the caller's list stays the caller's
        self._first_blocks[request_id] = blocks
        self._track(request_id, request)
        new_blocks = pool.get_new_blocks_locked(num_new)
        blocks.extend(new_blocks)
        end = num_full if num_full < len(blocks) else len(blocks)
        if end > num_hits:
            pool.cache_full_blocks_locked(
                request,
                blocks,
                stored,
                num_hits,
                end,
                block_size,
                self.caching_hash_fn,
                0,
                None,
                True,  # parent_from_stored, as the per-type manager caches
            )
        self._first_cached[request_id] = num_full
        return (new_blocks,)

    def _allocate_slots(
        self,
        request: object,
        num_tokens: object,
        new_computed_blocks: object,
        num_lookahead_tokens: object,
        full_sequence_must_fit: object = False,
        num_external_computed_tokens: object = 0,
        delay_cache_blocks: object = False,
    ) -> KVCacheBlocks | None:
        """allocate_slots' full path: every check in the spec's order, then the changes."""
        hits = check_allocation(
            request,
            num_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            self.num_groups,
            KVCacheBlock,
            full_sequence_must_fit,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        assert isinstance(request, Request) and isinstance(num_tokens, int)
        assert isinstance(num_lookahead_tokens, int) and isinstance(
            num_external_computed_tokens, int
        )
        request_id = request.request_id
        # -- the preconditions, in the spec's order --
        if num_tokens == 0 and not num_external_computed_tokens and not any(hits):
            raise refusals.nothing_to_allocate(request_id)
        num_spec = len(request.spec_token_ids)
        if num_spec > num_tokens:
            raise refusals.more_drafts_than_scheduled(request_id, num_spec, num_tokens)
        self._check_identity(request)
        held = self._first_blocks.get(request_id)
        num_held = 0 if held is None else len(held)
        num_computed = request.num_computed_tokens
        if self._per_group:
            self._check_group_slots(request_id, num_computed)
        elif not 0 <= num_computed <= num_held * self.block_size:
            raise refusals.computed_outside_slots(
                request_id, num_computed, num_held, self.block_size
            )
        if num_external_computed_tokens:
            self._check_external(request_id, num_held or num_computed, num_external_computed_tokens)
        if hits and any(hits):
            self._check_hits(request, num_held, hits)
        else:
            hits = ()
        num_hits = len(hits[0]) if hits else 0
        num_computed_tokens = (
            num_computed + num_hits * self.block_size + num_external_computed_tokens
        )
        num_scheduled_real = num_computed_tokens + num_tokens - num_spec
        if num_scheduled_real > request.num_tokens:
            raise refusals.more_tokens_than_request(
                request_id, num_scheduled_real, request.num_tokens
            )
        self._check_mamba_step(
            request_id, num_spec, num_lookahead_tokens, num_computed_tokens, num_tokens, num_hits
        )
        if num_external_computed_tokens or delay_cache_blocks is True or self._mixed_cached:
            return self._allocate_adopting(
                request,
                hits,
                num_computed_tokens,
                num_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks is True,
                held,
                full_sequence_must_fit is True,
            )
        if self._per_group:  # several block sizes or extra blocks, caching off
            return self._allocate_per_group(
                request,
                num_computed_tokens + num_tokens + num_lookahead_tokens,
                held is not None,
                full_sequence_must_fit is True,
            )
        num_required = num_required_blocks(
            num_computed_tokens, num_tokens, num_lookahead_tokens, self.block_size
        )
        if num_required > self.max_num_blocks_per_req and (
            not self.semantics.cap_at_max_model_len
            or num_held + num_hits >= self.max_num_blocks_per_req
        ):
            raise refusals.past_max_model_len(
                request_id,
                num_required,
                self.max_num_blocks_per_req,
                self.max_model_len,
                self.block_size,
            )
        num_full = num_full_blocks(num_computed_tokens, num_tokens, num_spec, self.block_size)
        num_cached = self._first_cached.get(request_id, num_hits)
        if self.enable_caching and num_full < num_cached:
            raise refusals.cached_blocks_lost(request_id, num_full, num_cached)
        # -- every precondition holds: from here on nothing can fail --
        if full_sequence_must_fit and not self._whole_request_fits(request, hits):
            if self.debug_invariants:
                self._after_call()
            return None
        coordinator = self.coordinator
        pool = self.block_pool
        if held is not None:
            coordinator.remove_skipped_blocks(request_id, num_computed)
        num_new = num_new_blocks(num_required, num_held, num_hits)
        # Every group takes its blocks: together they must fit in the free blocks the hits
        # leave; a hit on a Mamba state keyed in this scheduler step waits for the next.
        num_evictable = self._num_evictable_hits(hits) if num_hits else 0
        num_to_allocate = coordinator.get_num_blocks_to_allocate(num_new)
        if not fits(num_to_allocate, pool.get_num_free_blocks(), num_evictable) or (
            num_hits and self.coordinator.state_group is not None and coordinator.defers(hits)
        ):
            if self.debug_invariants:
                self._after_call()
            return None
        coordinator.add_hits(request_id, hits)
        self._track(request_id, request)
        if num_new > 0:
            # A no-op but under vLLM 0.8.5's capped allocation (cap_at_max_model_len, one
            # group): as many blocks as are free and max_model_len leaves room for.
            num_new = min(
                num_new,
                pool.get_num_free_blocks(),
                self.max_num_blocks_per_req - num_held - num_hits,
            )
        caching = self.enable_caching
        new_blocks = coordinator.allocate_new_blocks(
            request,
            num_new,
            self.req_to_block_hashes.setdefault(request_id, []) if caching else [],
            num_cached,
            num_full,
            self.caching_hash_fn if caching else None,
            self._junctions.get(request_id, 0) if self._sparse else 0,
        )
        if self.debug_invariants:
            self._after_call()
        return new_blocks

    def _check_mamba_step(
        self,
        request_id: str,
        num_spec: int,
        num_lookahead: int,
        num_computed: int,
        num_tokens: int,
        num_hits: int = 0,
    ) -> None:
        """With a Mamba group in mode "align" (the spec's precondition 8): no more drafts than
        its speculative blocks, and a step starting inside one of its blocks ends its tokens
        (drafts out) by that block's end; then the state groups are told the step
        (`plan_state_step`). Complexity: O(groups)."""
        group = self.coordinator.state_group
        if group is None:
            return
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, MambaAlignManager) and num_spec > manager.num_speculative:
                raise refusals.mamba_align_speculation(
                    request_id, manager.group_id, num_spec, manager.num_speculative
                )
        block_size = self.block_size
        offset = num_computed % block_size
        if offset and offset + num_tokens - num_spec > block_size:
            raise refusals.mamba_unaligned_chunk(
                request_id, group, num_computed, num_computed + num_tokens - num_spec, block_size
            )
        self.coordinator.plan_state_step(request_id, num_computed + num_tokens, num_hits)

    def _check_external(self, request_id: str, running: int, num_external: int) -> None:
        """External tokens extend a request's first allocation only (`running`: it holds
        blocks or computed tokens), and no Mamba group's (the spec's precondition 6)."""
        if running:
            raise refusals.external_for_running_request(request_id, num_external)
        for group, manager in enumerate(self.coordinator.single_type_managers):
            if isinstance(manager.kv_cache_spec, MambaSpec):
                raise refusals.external_with_mamba(request_id, group)

    def _allocate_adopting(
        self,
        request: Request,
        hits: tuple[list[KVCacheBlock], ...],
        num_computed: int,
        num_tokens: int,
        num_lookahead_tokens: int,
        num_external: int,
        delay_cache: bool,
        held: list[KVCacheBlock] | None,
        full_sequence_must_fit: bool,
    ) -> KVCacheBlocks | None:
        """allocate_slots with external tokens or a delayed cache (the connector path), or with
        several block sizes and caching (any call), every precondition up to the hits'
        checked; `num_computed` counts the hits and the external tokens. Group by group, as
        the spec's step: each group adopts its hits with the positions the token at
        `num_computed` no longer reads as null blocks; each group needs its own count, at most
        its `_max_blocks`; the blocks every group then lacks must fit; every group's adopted
        hits are touched, then every group takes its external blocks, then every group its
        new blocks, caching them unless delayed (several block sizes: `_cache_group`, its
        positions within the computed tokens rounded down to S). Complexity: O(groups + hits
        + new blocks + blocks cached * block_size), plus O(num_tokens) when several block
        sizes extend the chain."""
        request_id = request.request_id
        managers = self.coordinator.single_type_managers
        num_spec = len(request.spec_token_ids)
        num_held = 0 if held is None else len(held)
        num_hits = len(hits[0]) if hits else 0
        num_slots = num_computed + num_tokens + num_lookahead_tokens
        required = [manager.num_required(num_slots) for manager in managers]
        capped = self.semantics.cap_at_max_model_len and num_held + num_hits < self._max_blocks[0]
        self._refuse_past_max_model_len(request_id, required, capped)
        cache_tokens = num_computed + num_tokens - num_spec  # several block sizes: to S
        cache_tokens -= cache_tokens % self._scheduler_block_size
        num_full = (
            cache_tokens // managers[0].block_size
            if self._mixed_cached
            else num_full_blocks(num_computed, num_tokens, num_spec, self.block_size)
        )
        num_cached = self._first_cached.get(request_id, num_hits)
        if self.enable_caching and num_full < num_cached:
            raise refusals.cached_blocks_lost(request_id, num_full, num_cached)
        # -- every precondition holds: from here on nothing can fail --
        null_block = self.block_pool.null_block
        adopted: list[list[KVCacheBlock]] = []
        for group, manager in enumerate(managers):
            group_hits = hits[group] if hits else []
            if num_external:
                skipped = max(manager.num_skipped_blocks(num_computed), 0)
                group_hits = [null_block] * skipped + group_hits[skipped:]
            adopted.append(group_hits)
        if full_sequence_must_fit and not self._whole_request_fits(request, adopted):
            if self.debug_invariants:
                self._after_call()
            return None
        pool = self.block_pool
        if held is not None:
            self.coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        lengths = [len(manager.req_to_blocks.get(request_id, ())) for manager in managers]
        missing = sum(
            max(need - have - len(group_hits), 0)
            for need, have, group_hits in zip(required, lengths, adopted, strict=True)
        )
        if not fits(missing, pool.get_num_free_blocks(), self._num_evictable_hits(adopted)):
            if self.debug_invariants:
                self._after_call()
            return None
        num_adopted = [len(group_hits) for group_hits in adopted]
        if num_external or num_hits:
            # vLLM 0.33 counts an adopted prefix as cached, even with caching off.
            for manager, count in zip(managers, num_adopted, strict=True):
                manager.num_cached_block.setdefault(request_id, count)
        if self._mixed_cached:  # stored hashes cover the positions counted as cached
            self._extend_chain(
                request,
                self.req_to_block_hashes.setdefault(request_id, []),
                max(m.num_cached_block.get(request_id, 0) * m.block_size for m in managers),
            )
        self._adopt_then_load(request_id, adopted, num_computed if num_external else 0)
        self._track(request_id, request)
        num_free = pool.get_num_free_blocks()
        caching = self.enable_caching
        stored = self.req_to_block_hashes.setdefault(request_id, []) if caching else []
        junction = self._junctions.get(request_id, 0) if self._sparse else 0
        new_blocks = []
        for group, manager in enumerate(managers):
            num_blocks = len(manager.req_to_blocks[request_id])
            count = min(
                required[group] - num_blocks, num_free, self._max_blocks[group] - num_blocks
            )
            new_blocks.append(manager.allocate_new_blocks(request_id, count))
            if caching and not delay_cache and self._mixed_cached:
                self._cache_group(request, manager, stored, num_adopted[group], cache_tokens)
            elif caching and not delay_cache:
                manager.cache_blocks(
                    request, stored, num_adopted[group], num_full, self.caching_hash_fn, junction
                )
        if self.debug_invariants:
            self._after_call()
        return tuple(new_blocks)

    def _adopt_then_load(
        self, request_id: str, adopted: list[list[KVCacheBlock]], num_loaded: int
    ) -> None:
        """vLLM 0.33's two phases (PR #44409): every group's adopted hits are touched and
        appended (the lists handed over), then every group takes the blocks its first
        `num_loaded` token slots still lack (the external tokens'), from the queue's head: no
        group's allocation can evict another group's adopted hit. Complexity: O(groups + hits
        + blocks taken)."""
        managers = self.coordinator.single_type_managers
        pool = self.block_pool
        if self.enable_caching:
            for group_hits in adopted:
                pool.touch_owned_locked(group_hits)
        for manager, group_hits in zip(managers, adopted, strict=True):
            manager.add_hits(request_id, group_hits)
        if num_loaded:
            for group, manager in enumerate(managers):
                blocks = manager.req_to_blocks[request_id]
                count = min(
                    manager.num_required(num_loaded) - len(blocks),
                    pool.get_num_free_blocks(),
                    self._max_blocks[group] - len(blocks),
                )
                manager.allocate_new_blocks(request_id, count)

    def _check_group_slots(self, request_id: str, num_computed: int) -> None:
        """`num_computed` lies within the slots the request holds in every group (the
        per-group path's precondition 3)."""
        for group, manager in enumerate(self.coordinator.single_type_managers):
            group_held = len(manager.req_to_blocks.get(request_id, ()))
            if not 0 <= num_computed <= manager.num_slots(group_held):
                raise refusals.computed_outside_slots(
                    request_id,
                    num_computed,
                    max(group_held - manager.extra_blocks, 0),
                    manager.block_size,
                    group if self._mixed_sizes else None,
                )

    def _refuse_past_max_model_len(
        self, request_id: str, required: list[int], capped: bool
    ) -> None:
        """No group may need more than its `_max_blocks` blocks, unless vLLM 0.33's semantics
        cap the allocation there instead (`capped`)."""
        if capped:
            return
        for group, manager in enumerate(self.coordinator.single_type_managers):
            if required[group] > self._max_blocks[group]:
                raise refusals.past_max_model_len(
                    request_id,
                    required[group],
                    self._max_blocks[group],
                    self.max_model_len,
                    manager.block_size,
                    group if self._mixed_sizes else None,
                )

    def _allocate_per_group(
        self, request: Request, num_slots: int, running: bool, full_sequence_must_fit: bool
    ) -> KVCacheBlocks | None:
        """allocate_slots for groups whose block counts differ (caching off): each group needs
        `num_required(num_slots)` blocks, at most its `_max_blocks`; the ones every group lacks
        must fit together. Complexity: O(groups + blocks dropped + new blocks)."""
        request_id = request.request_id
        managers = self.coordinator.single_type_managers
        required = [manager.num_required(num_slots) for manager in managers]
        capped = (
            self.semantics.cap_at_max_model_len
            and len(managers[0].req_to_blocks.get(request_id, ())) < self._max_blocks[0]
        )
        self._refuse_past_max_model_len(request_id, required, capped)
        # -- every precondition holds: from here on nothing can fail --
        if full_sequence_must_fit and not self._whole_request_fits(request, ()):
            if self.debug_invariants:
                self._after_call()
            return None
        coordinator = self.coordinator
        pool = self.block_pool
        if running:
            coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        held = [len(manager.req_to_blocks.get(request_id, ())) for manager in managers]
        missing = [need - have for need, have in zip(required, held, strict=True)]
        num_free = pool.get_num_free_blocks()
        if not fits(sum(max(count, 0) for count in missing), num_free, 0):
            if self.debug_invariants:
                self._after_call()
            return None
        coordinator.add_hits(request_id, ())
        self._track(request_id, request)
        counts = [
            max(min(missing[group], num_free, self._max_blocks[group] - held[group]), 0)
            for group in range(self.num_groups)
        ]
        new_blocks = coordinator.allocate_per_group(request_id, counts)
        if self.debug_invariants:
            self._after_call()
        return new_blocks

    # -- several block sizes with caching ------------------------------------------------------

    def _extend_chain(self, request: Request, stored: list[BlockHashType], num_tokens: int) -> None:
        """The stored chain (at H) covers the request's first `num_tokens` tokens: the chunks
        it lacks are hashed, chained to its last. Complexity: O(the tokens hashed) plus the
        hash function."""
        hash_size = self._hash_block_size
        have, needed = len(stored), num_tokens // hash_size
        if have >= needed:
            return
        extra_keys: list[tuple[ExtraKey, ...] | None] | None = None
        if need_extra_keys(request):
            extra_keys = []
            mm_idx = first_mm_input(request.mm_positions, have * hash_size)
            for start in range(have * hash_size, needed * hash_size, hash_size):
                keys, mm_idx = generate_block_hash_extra_keys(
                    request, start, start + hash_size, mm_idx, mm_position=self._mm_position
                )
                extra_keys.append(keys)
        stored.extend(
            chain_block_hashes(
                self.caching_hash_fn,
                stored[-1].hash_value if stored else None,
                list(request.all_token_ids[have * hash_size : needed * hash_size]),
                0,
                needed - have,
                hash_size,
                extra_keys,
            )
        )

    def _mixed_lookup(
        self, request: Request, block_hashes: list[BlockHashType]
    ) -> tuple[KVCacheBlocks, int]:
        """get_computed_blocks with several block sizes: the chain of at most `num_tokens -
        1` tokens looked up, the hit `HybridKVCacheCoordinator.mixed_hit`'s, in tokens.
        Complexity: as `mixed_hit`."""
        coordinator = self.coordinator
        assert isinstance(coordinator, HybridKVCacheCoordinator)
        hash_size, scheduler_size = self._hash_block_size, self._scheduler_block_size
        num_lookup = min(len(block_hashes), (request.num_tokens - 1) // hash_size)
        lookup = block_hashes[:num_lookup]
        length, hits = coordinator.mixed_hit(lookup, hash_size, scheduler_size)
        if self._sparse:
            self._junctions[request.request_id] = coordinator.mixed_junction(
                length, lookup, hash_size, scheduler_size
            )
        stats = self.prefix_cache_stats
        if stats is not None:
            stats.queries += num_lookup
            stats.hits += length // hash_size
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += length
        self._after_call()
        return hits, length

    def _cache_group(
        self,
        request: Request,
        manager: SingleTypeKVCacheManager,
        chain: list[BlockHashType],
        num_cached: int,
        cache_tokens: int,
    ) -> None:
        """Several block sizes with caching: the group caches its positions within
        `cache_tokens` (a multiple of S) under its view of the request's `chain` (extended to
        them and to the positions counted as cached first), `num_cached` (its hits) counting as
        cached until it has a count; then its partial key under `partial_prefix_keys`.
        Complexity: as the group's `cache_blocks`."""
        # Stored hashes cover the cached positions, adopted null ones included.
        counted = manager.num_cached_block.get(request.request_id)
        if counted is not None and cache_tokens // manager.block_size <= counted:
            # Nothing to cache (a decode step inside an S span): the count stays.
            self._extend_chain(request, chain, counted * manager.block_size)
            if self._partial_keys:
                self._cache_partial_tail(request, manager, cache_tokens)
            return
        counted = num_cached if counted is None else counted
        self._extend_chain(request, chain, max(cache_tokens, counted * manager.block_size))
        manager.cache_blocks(
            request,
            group_view(chain, manager.block_size, self._hash_block_size),
            num_cached,
            cache_tokens // manager.block_size,
            self.caching_hash_fn,
            self._junctions.get(request.request_id, 0) if self._sparse else 0,
        )
        if self._partial_keys:
            self._cache_partial_tail(request, manager, cache_tokens)

    def _cache_mixed(self, request: Request, num_computed_tokens: int) -> None:
        """cache_blocks with several block sizes, its checks passed: every group caches its
        positions within `num_computed_tokens` rounded down to S.
        Complexity: O(groups + blocks cached * H + num_tokens when the chain grows)."""
        request_id = request.request_id
        managers = self.coordinator.single_type_managers
        cache_tokens = num_computed_tokens - num_computed_tokens % self._scheduler_block_size
        if all(
            cache_tokens // manager.block_size <= manager.num_cached_block.get(request_id, 0)
            for manager in managers
        ):
            if self._partial_keys:  # vLLM 0.33 asks for the partial key anyway
                for manager in managers:
                    self._cache_partial_tail(request, manager, cache_tokens)
            return
        stored = self.req_to_block_hashes.setdefault(request_id, [])
        self._extend_chain(request, stored, cache_tokens)
        junction = self._junctions.get(request_id, 0) if self._sparse else 0
        for manager in managers:
            manager.cache_blocks(
                request,
                group_view(stored, manager.block_size, self._hash_block_size),
                0,
                cache_tokens // manager.block_size,
                self.caching_hash_fn,
                junction,
            )
            if self._partial_keys:
                self._cache_partial_tail(request, manager, cache_tokens)

    def _cache_partial_tail(
        self, request: Request, manager: SingleTypeKVCacheManager, cache_tokens: int
    ) -> None:
        """Under `partial_prefix_keys` (the spec's `_cache_partial_tail`): a full-attention
        group whose blocks exceed H also indexes the block holding the prompt's last H boundary
        before its last token under the chain hash there, when that boundary is positive,
        within `cache_tokens`, inside a block the request holds and not at a block's end.
        Complexity: O(1) but the pool's."""
        block_size, hash_size = manager.block_size, self._hash_block_size
        if block_size == hash_size or not isinstance(manager, FullAttentionManager):
            return
        boundary = (request.num_prompt_tokens - 1) // hash_size * hash_size
        boundary = min(boundary, request.num_tokens // hash_size * hash_size)
        if boundary == 0 or boundary > cache_tokens or boundary % block_size == 0:
            return
        held = manager.req_to_blocks[request.request_id]
        if boundary // block_size >= len(held):
            return
        chain = self.req_to_block_hashes[request.request_id]
        self.block_pool.add_partial_key_locked(
            held[boundary // block_size],
            cache_key(chain[boundary // hash_size - 1], manager.group_id),
            chain[boundary // hash_size - 2].hash_value if boundary > hash_size else None,
            request.lora_id,
        )

    def _check_hits(
        self, request: Request, num_held: int, hits: tuple[list[KVCacheBlock], ...]
    ) -> None:
        """Prefix hits are what `get_computed_blocks` could have returned: one length in every
        group, each group's the request's cached blocks of that group, position by position,
        in a shape its attention can produce."""
        request_id = request.request_id
        if not self.enable_caching:
            raise refusals.hits_without_caching(request_id)
        if num_held or request.num_computed_tokens:
            raise refusals.hits_for_running_request(request_id)
        num_hits = len(hits[0])
        stored = self.req_to_block_hashes.get(request_id, [])
        managers = self.coordinator.single_type_managers  # as many as hits (check_allocation)
        if self._mixed_cached:
            tokens = [
                len(group_hits) * m.block_size for m, group_hits in zip(managers, hits, strict=True)
            ]
            if len(set(tokens)) != 1:
                raise refusals.hits_of_unequal_tokens(request_id, tokens)
            if tokens[0] // self._hash_block_size > len(stored):
                raise refusals.more_hits_than_hashes(
                    request_id, tokens[0] // self._hash_block_size, len(stored)
                )
        else:
            if len(hits) > 1:
                lengths = [len(group_hits) for group_hits in hits]
                if len(set(lengths)) != 1:
                    raise refusals.hits_of_unequal_length(request_id, lengths)
            if num_hits > len(stored):
                raise refusals.more_hits_than_hashes(request_id, num_hits, len(stored))
        pool = self.block_pool
        for group, group_hits in enumerate(hits):
            manager = managers[group]
            pool.check_hits_locked(
                request_id,
                group_hits,
                group_view(stored, manager.block_size, self._hash_block_size),
                manager.allows_null_blocks,
                manager.group_id,
            )
            if manager.allows_null_blocks:  # only a type that skips positions has a shape
                shape_error = manager.hit_shape_error(
                    group_hits, self.use_eagle, self._eagle_lookup
                )
                if shape_error is not None:
                    raise refusals.hit_shape(request_id, shape_error)

    def _whole_request_fits(self, request: Request, hits: Sequence[list[KVCacheBlock]]) -> bool:
        """The full-sequence gate, before anything changes: the blocks every group lacks for
        `min(num_tokens, max_model_len)` tokens (lookahead and drafts out), each group's need
        at most its admission cap, fit in the free blocks the hits leave (each group's own,
        adopted as the step adopts them), as the step's own check counts them.
        Complexity: O(groups + hits)."""
        request_id = request.request_id
        if hits and self.coordinator.state_group is not None and self.coordinator.defers(hits):
            return False
        num_tokens = min(request.num_tokens, self.max_model_len)
        missing = 0
        managers = self.coordinator.single_type_managers
        for group, (manager, cap) in enumerate(zip(managers, self._admission_caps, strict=True)):
            required = manager.num_required(num_tokens)
            if cap is not None and cap < required:
                required = cap
            num_hits = len(hits[group]) if hits else 0
            lacking = required - len(manager.req_to_blocks.get(request_id, ())) - num_hits
            if lacking > 0:
                missing += manager.num_blocks_to_allocate(lacking)
        num_evictable = self._num_evictable_hits(hits) if hits else 0
        return fits(missing, self.block_pool.get_num_free_blocks(), num_evictable)

    def _num_evictable_hits(self, hits: Sequence[list[KVCacheBlock]]) -> int:
        """Hits with ref_cnt 0: touching takes them off the free queue, so they are not free
        for this step. Null hits count only under vLLM 0.8.5 semantics (difference 2)."""
        null_block = self.block_pool.null_block
        count_null = self.semantics.capacity_counts_null_blocks
        return sum(
            1
            for group_hits in hits
            for block in group_hits
            if block.ref_cnt == 0 and (count_null or block is not null_block)
        )

    # -- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks group by group, each group's tail first when caching
        (evicted first), else in order (tail first as well under
        `free_tail_first_without_caching`).

        Keeps its block hashes (a preempted request reuses them). An unknown request is a no-op.

        Raises:
            ArgumentTypeError: `request` is not a Request.
            RequestError: another Request object uses this request id.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + blocks held).
        """
        self._enter("KVCacheManager.free")
        try:
            check_request("free", request)
            self._check_identity(request)
            request_id = request.request_id
            tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
            self.coordinator.free(request_id, tail_first)
            if self._evicted:
                self._evicted.pop(request_id, None)
            self._forget_if_done(request_id)
            self._after_call()
        finally:
            self._call_token.append(None)

    def pop_blocks_for_free(self, request: Request) -> KVCacheBlocks:
        """Hand the request's blocks to a deferred free (vLLM 0.33's, under `defer_block_free`:
        a forward pass still in flight may read them). The request is forgotten as by `free`,
        but its blocks keep their references, so none is reused until `free_popped_blocks`
        releases the batch. Returns each group's blocks less its leading null blocks; a
        request holding none: empty lists, and no batch to free.

        Raises:
            ArgumentTypeError: `request` is not a Request.
            RequestError: another Request object uses this request id.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + blocks held).
        """
        self._enter("KVCacheManager.pop_blocks_for_free")
        try:
            check_request("pop_blocks_for_free", request)
            self._check_identity(request)
            request_id = request.request_id
            managers = self.coordinator.single_type_managers
            popped = tuple(manager.pop(request_id) for manager in managers)
            if any(popped):
                lost = self._evicted.get(request_id, ()) if self._evicted else ()
                self._popped.append(
                    (
                        tuple(tuple(block.block_id for block in blocks) for blocks in popped),
                        frozenset(entry[2] for entry in lost),
                    )
                )
            if self._evicted:
                self._evicted.pop(request_id, None)
            self._forget_if_done(request_id)
            self._after_call()
            return popped
        finally:
            self._call_token.append(None)

    def free_popped_blocks(self, popped: object) -> None:
        """Release a batch `pop_blocks_for_free` returned, exactly once, in the order `free`
        would have: group by group, each group's tail first (without caching, in order unless
        `free_tail_first_without_caching`). Under `deferred_free_flattened` (vLLM 0.33's drain,
        its #48489): one call over every group's blocks, the last group's last first. A batch
        of empty lists: nothing happens.

        Raises:
            ArgumentTypeError: not one iterable of KVCacheBlocks per group.
            BlockStateError: not a batch popped and not yet freed, as returned, of this
                pool's blocks (nothing changed).
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + blocks in the batch + batches outstanding).
        """
        self._enter("KVCacheManager.free_popped_blocks")
        try:
            groups = check_popped_blocks(popped, self.num_groups, KVCacheBlock)
            if not any(groups):
                return
            key = tuple(tuple(block.block_id for block in blocks) for blocks in groups)
            index = next((i for i, (ids, _) in enumerate(self._popped) if ids == key), None)
            if index is None:
                raise refusals.popped_blocks_unknown([list(ids) for ids in key])
            owned = self.block_pool.blocks
            for blocks in groups:
                for block in blocks:
                    if owned[block.block_id] is not block:
                        raise refusals.foreign_block(block.block_id)
            del self._popped[index]
            self._release_popped(groups)
            self._after_call()
        finally:
            self._call_token.append(None)

    def _release_popped(self, groups: list[list[KVCacheBlock]]) -> None:
        """Free a checked batch of popped blocks, in `free`'s order (or vLLM 0.33's, one call
        over every group, the last group's last block first). Complexity: O(blocks)."""
        pool = self.block_pool
        if self.semantics.deferred_free_flattened:
            pool.free_blocks_locked([block for blocks in groups for block in blocks][::-1])
            return
        tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
        for blocks in groups:
            pool.free_blocks_locked(blocks[::-1] if tail_first else blocks)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the request's stored block hashes (when it finishes, not when preempted).

        Raises:
            ArgumentTypeError: `request` is not a Request.
            RequestError: another Request object uses this request id, or the request still
                holds blocks (its cached blocks need their hashes: `free` it first).
            ConcurrentUseError: another call on this manager is running.
        """
        self._enter("KVCacheManager.free_block_hashes")
        try:
            check_request("free_block_hashes", request)
            self._check_identity(request)
            if request.request_id in self._first_blocks:
                raise refusals.hashes_dropped_while_held(request.request_id)
            self.req_to_block_hashes.pop(request.request_id, None)
            self._forget_if_done(request.request_id)
            self._after_call()
        finally:
            self._call_token.append(None)

    def cache_blocks(self, request: Request, num_computed_tokens: object) -> None:
        """Cache, in every group, the request's full blocks within its first
        `num_computed_tokens` tokens that are not cached yet, as `allocate_slots` caches them
        (vLLM 0.33's `KVCacheManager.cache_blocks`: its scheduler calls it after a step whose
        accepted draft tokens filled a block, a KV connector when an async load lands).
        Nothing with caching off, nor when no more blocks are full than are cached.

        Raises:
            ArgumentTypeError, InvalidArgumentError: not a Request, or num_computed_tokens not
                an int >= 0.
            RequestError: another Request object uses the id; (with caching) the request holds
                no blocks, its num_computed_tokens lies outside its slots, or
                `num_computed_tokens` exceeds its computed tokens or its tokens (a hash over KV
                not yet written would serve a later request garbage).
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + blocks cached * block_size).
        """
        self._enter("KVCacheManager.cache_blocks")
        try:
            checked = check_cache_blocks(request, num_computed_tokens)
            assert isinstance(num_computed_tokens, int)
            self._check_identity(checked)
            if not self.enable_caching:
                return
            request_id = checked.request_id
            held = self._first_blocks.get(request_id)
            if held is None:
                raise refusals.cache_without_blocks(request_id)
            block_size = self.block_size
            computed = checked.num_computed_tokens
            if self._mixed_cached:
                for manager in self.coordinator.single_type_managers:
                    blocks = manager.req_to_blocks[request_id]
                    if not 0 <= computed <= manager.num_slots(len(blocks)):
                        raise refusals.computed_outside_slots(
                            request_id, computed, len(blocks), manager.block_size
                        )
            elif not 0 <= computed <= len(held) * block_size:
                raise refusals.computed_outside_slots(request_id, computed, len(held), block_size)
            limit = min(computed, checked.num_tokens)
            if num_computed_tokens > limit:
                raise refusals.cache_past_computed(request_id, num_computed_tokens, limit)
            if self._mixed_cached:
                self._cache_mixed(checked, num_computed_tokens)
                self._after_call()
                return
            num_full = num_computed_tokens // block_size
            managers = self.coordinator.single_type_managers
            # Each group from its own count (they differ after external tokens pushed hits out
            # of a window).
            if self.coordinator.state_group is not None or any(
                num_full > manager.num_cached_block.get(request_id, 0) for manager in managers
            ):
                stored = self.req_to_block_hashes.setdefault(request_id, [])
                junction = self._junctions.get(request_id, 0) if self._sparse else 0
                for manager in managers:
                    manager.cache_blocks(
                        checked, stored, 0, num_full, self.caching_hash_fn, junction
                    )
            self._after_call()
        finally:
            self._call_token.append(None)

    def evict_blocks(self, block_ids: object) -> None:
        """Take each listed block's hash out of the prefix cache (vLLM 0.33's
        `KVCacheManager.evict_blocks`, a KV connector's call for blocks whose load failed). A
        block stays held, or queued, where it is; one without a hash is passed over. The
        requests holding one keep their count of cached positions, so they never cache it
        again, and a later lookup stops where it was.

        Raises:
            ArgumentTypeError: `block_ids` is not iterable, or an item is not an int.
            BlockStateError: an id is not a block of the pool (nothing changed).
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(len(block_ids)), and O(blocks held) when a block loses its hash (the
        holders are found for the invariant checks' record).
        """
        self._enter("KVCacheManager.evict_blocks")
        try:
            evicted = self.block_pool.evict_blocks_locked(
                block_list(f"{MANAGER}.evict_blocks", "block_ids", block_ids, is_block_id)
            )
            if evicted:
                lost = {block.block_id for block in evicted}
                for group, manager in enumerate(self.coordinator.single_type_managers):
                    for request_id, blocks in manager.req_to_blocks.items():
                        for position, block in enumerate(blocks):
                            if block.block_id in lost:
                                self._evicted.setdefault(request_id, set()).add(
                                    (group, position, block.block_id)
                                )
            self._after_call()
        finally:
            self._call_token.append(None)

    def attach_offload_tier(self, tier: OffloadTier | None) -> None:
        """Put the CPU offload tier behind this manager's KV connector (None: none). The
        connector stores and loads its chunks; `reset_prefix_cache` clears it with the GPU
        pool, so that KV computed before a reset (with older weights) is never loaded after
        it (vLLM 0.33 keeps serving it unless asked to reset the connector: #57727).

        Raises:
            ArgumentTypeError: `tier` is not an `OffloadTier` or None.

        Complexity: O(1).
        """
        if tier is not None and not isinstance(tier, OffloadTier):
            raise ArgumentTypeError(
                f"KVCacheManager.attach_offload_tier: tier must be an OffloadTier or None, "
                f"got {type(tier).__name__}"
            )
        self.offload_tier = tier

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash of every group, and every chunk of the CPU offload tier
        (`attach_offload_tier`), if no request holds blocks; else refuse (False), changing
        neither.

        Raises:
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_gpu_blocks + the tier's chunks).
        """
        self._enter("KVCacheManager.reset_prefix_cache")
        try:
            return self._reset_prefix_cache()
        finally:
            self._call_token.append(None)

    def _reset_prefix_cache(self) -> bool:
        """`reset_prefix_cache` under the call token: both tiers, or neither."""
        if not self.block_pool.reset_prefix_cache_locked():
            return False
        if self.offload_tier is not None:
            self.offload_tier.reset_cache()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        self._after_call()
        return True

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: object
    ) -> tuple[int, ...]:
        """Per group, the leading blocks of `request` whose ref_cnt equals
        `num_running_requests` (a null block's ref_cnt is 0).

        With every running request holding them, these blocks are a prefix common to all.

        Raises:
            ArgumentTypeError, InvalidArgumentError: `request` is not a Request, or
                `num_running_requests` not an int >= 0.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + the common prefix of each group).
        """
        self._enter("KVCacheManager.get_num_common_prefix_blocks")
        try:
            checked = check_common_prefix(request, num_running_requests)
            assert isinstance(num_running_requests, int)
            return self.coordinator.num_common_prefix_blocks(
                checked.request_id, num_running_requests
            )
        finally:
            self._call_token.append(None)

    def get_blocks(self, request_id: object) -> KVCacheBlocks:
        """The blocks `request_id` holds, one sequence per group (the null block where a
        group's attention skipped a position); empty for a request that holds none. The
        sequences are the manager's own: read them, never change them.

        Raises:
            ArgumentTypeError: `request_id` is not a str.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups).
        """
        self._enter("KVCacheManager.get_blocks")
        try:
            checked = require_str(f"{MANAGER}.get_blocks", "request_id", request_id)
            return tuple(
                manager.req_to_blocks.get(checked, ())
                for manager in self.coordinator.single_type_managers
            )
        finally:
            self._call_token.append(None)

    def new_step_starts(self) -> None:
        """A new scheduler step starts (vLLM 0.33's scheduler calls it first in every
        `schedule()`): the Mamba states keyed during the last step have been written, so
        hits on them fit from now on (`allocate_slots` answers None for a hit on a state keyed
        since the last call, as vLLM 0.33 does). Without a Mamba group in mode "align" it
        changes nothing a call can see.

        Raises:
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + the keys cached since the last call).
        """
        self._enter("KVCacheManager.new_step_starts")
        try:
            self.coordinator.new_step_starts()
        finally:
            self._call_token.append(None)

    def shared_prefix_boundary(self, request_id: object) -> int:
        """The shared-prefix junction the request's last lookup found, in tokens (vLLM's
        `shared_prefix_boundary`, the third value of its `get_computed_blocks`): where the
        longest single-group hit ends when the common hit is shorter. 0 when there is none,
        without sparse retention (nothing keeps a junction then) unless a Mamba group in mode
        "align" is there (vLLM's scheduler cuts its chunks at the junction whatever the
        retention), or for an unknown request.

        Raises:
            ArgumentTypeError: `request_id` is not a str.

        Complexity: O(1).
        """
        checked = require_str(f"{MANAGER}.shared_prefix_boundary", "request_id", request_id)
        return self._junctions.get(checked, 0) if self._keeps_junctions else 0

    def get_block_ids(self, request_id: object) -> tuple[list[int], ...]:
        """The ids of the blocks `request_id` holds, one list per group (the null block's id
        is 0); empty lists for a request that holds none.

        Raises:
            ArgumentTypeError: `request_id` is not a str.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + blocks held).
        """
        self._enter("KVCacheManager.get_block_ids")
        try:
            checked = require_str(f"{MANAGER}.get_block_ids", "request_id", request_id)
            return self.coordinator.block_ids(checked)
        finally:
            self._call_token.append(None)

    # -- helpers -----------------------------------------------------------------------------

    def _check_identity(self, request: Request) -> None:
        known = self._requests.get(request.request_id)
        if known is not None and known is not request:
            raise refusals.id_in_use(request.request_id)

    def _track(self, request_id: str, request: Request) -> None:
        """Track `request` under its id (it passed `_check_identity`), with its fast-path
        record if it is a `Request`."""
        self._requests[request_id] = request
        if type(request) is Request and request not in self._records:
            self._records[request] = _Record(request_id, request.live_token_ids())

    def _forget_if_done(self, request_id: str) -> None:
        if request_id not in self._first_blocks and request_id not in self.req_to_block_hashes:
            request = self._requests.pop(request_id, None)
            if type(request) is Request:
                self._records.pop(request, None)
            if self._junctions:  # only sparse retention or a Mamba group records junctions
                self._junctions.pop(request_id, None)

    def _after_call(self) -> None:
        if not self.debug_invariants:
            return
        self._calls_until_check -= 1
        if self._calls_until_check <= 0:
            self._calls_until_check = self.debug_invariants
            self._check_invariants()

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pool's invariants, then the request-level ones the spec manager states: a
        block's ref_cnt is the number of block lists holding it, and a block two of them hold
        is cached; a request's lists cover the same token slots; null blocks only as a prefix,
        and only in groups whose attention skips positions; at most cdiv(max_model_len, B)
        positions per group (plus its extra blocks); with
        caching, the cached positions are full blocks with stored hashes, each group's cached
        block carries its group's key of the stored hash, and the stored hashes are the chain
        of the request's tokens; every tracked request holds blocks or stored hashes, and has
        its own fast-path record.

        All but prefix closure of the full-attention groups: that needs each hash's parent,
        which only the spec keeps (as ghost state); the lock-step harness holds this index
        equal to the spec's.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_gpu_blocks + blocks held + tokens of the requests holding blocks),
        the tokens rehashed to check the stored chains.
        """
        self._enter("KVCacheManager.check_invariants")
        try:
            self._check_invariants()
        finally:
            self._call_token.append(None)

    def _check_invariants(self) -> None:
        pool = self.block_pool
        pool.check_invariants_locked()
        null_block = pool.null_block
        managers = self.coordinator.single_type_managers
        holders: Counter[int] = Counter()
        for manager in managers:
            for blocks in manager.req_to_blocks.values():
                holders.update(block.block_id for block in blocks if block is not null_block)
        evicted = {entry[2] for lost in self._evicted.values() for entry in lost}
        for ids, popped_evicted in self._popped:  # deferred frees hold their blocks too
            for group_ids in ids:
                holders.update(group_ids)
            evicted.update(popped_evicted)
        for block in pool.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                raise InvariantViolation(
                    "a block's ref_cnt is the number of requests holding it",
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held "
                    f"{holders[block.block_id]} times",
                )
            if block.ref_cnt >= 2 and block.block_hash is None and block.block_id not in evicted:
                raise InvariantViolation(
                    "a block held by two requests is cached",
                    repr(block),
                )
        for request_id in self._first_blocks:
            self._check_request(request_id)
        known = self._first_blocks.keys() | self.req_to_block_hashes.keys()
        held_anywhere = set().union(*(manager.req_to_blocks.keys() for manager in managers))
        cached_anywhere = set().union(*(manager.num_cached_block.keys() for manager in managers))
        if (
            self._requests.keys() != known
            or not held_anywhere <= known
            or not cached_anywhere <= known
        ):
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes",
                f"requests {sorted(self._requests)}, with blocks or hashes {sorted(known)}",
            )
        self._check_records()

    def _check_request(self, request_id: str) -> None:
        managers = self.coordinator.single_type_managers
        held = [manager.req_to_blocks.get(request_id) for manager in managers]
        lengths = [None if blocks is None else len(blocks) for blocks in held]
        if None in lengths or not _cover_same_slots(managers, lengths):
            raise InvariantViolation(
                "a request's block lists cover the same token slots in every group",
                f"request {request_id!r}: {lengths} blocks of "
                f"{[manager.block_size for manager in managers]} tokens",
            )
        null_block = self.block_pool.null_block
        group_blocks = [blocks for blocks in held if blocks is not None]
        for manager, blocks in zip(managers, group_blocks, strict=True):
            if manager.holds_state:
                error = manager.layout_error(request_id)
                if error is not None:
                    raise InvariantViolation(
                        "a Mamba table holds its running state and at most its previous one",
                        f"request {request_id!r}, group {manager.group_id}: "
                        f"{[block.block_id for block in blocks]}: {error}",
                    )
                continue
            nulls = [i for i, block in enumerate(blocks) if block is null_block]
            if nulls and (not manager.allows_null_blocks or nulls != list(range(len(nulls)))):
                raise InvariantViolation(
                    "null blocks only as a prefix, and only under sliding window",
                    f"request {request_id!r}, group {manager.group_id}: null at positions {nulls}",
                )
        if not self.semantics.cap_at_max_model_len and any(
            len(blocks) > most for blocks, most in zip(group_blocks, self._max_blocks, strict=True)
        ):
            raise InvariantViolation(
                "a request holds at most cdiv(max_model_len, block_size) blocks",
                f"request {request_id!r}: {[len(blocks) for blocks in group_blocks]} blocks",
            )
        if not self.enable_caching:
            return
        request = self._requests[request_id]
        chain = self.req_to_block_hashes.get(request_id, [])
        if self._mixed_cached:
            self._check_mixed_request(request_id, group_blocks)
        for manager, blocks in zip(managers, group_blocks, strict=True):
            num_cached = manager.num_cached_block.get(request_id, 0)
            stored = group_view(chain, manager.block_size, self._hash_block_size)
            if num_cached > min(request.num_tokens // manager.block_size, len(stored)):
                raise InvariantViolation(
                    "a request's cached blocks are full blocks with stored hashes",
                    f"request {request_id!r}, group {manager.group_id}: {num_cached} cached, "
                    f"{request.num_tokens} tokens, {len(stored)} stored hashes",
                )
            # Under sparse retention a held block may be left out: it then carries no hash; so
            # does one whose hash evict_blocks took.
            left_out_ok = manager.sparse
            evicted = self._evicted.get(request_id, ())
            for position, block in enumerate(blocks[:num_cached]):
                if (manager.group_id, position, block.block_id) in evicted:
                    continue  # its hash taken (a partial key may stand in for it)
                if block.block_hash is None and left_out_ok:
                    continue
                if block is not null_block and block.block_hash != cache_key(
                    stored[position], manager.group_id
                ):
                    raise InvariantViolation(
                        "a request's cached block carries the hash its tokens chain to",
                        f"request {request_id!r}, group {manager.group_id}, position "
                        f"{position}: {block!r}, stored {stored[position]}",
                    )
        if self.semantics.vllm_new_block_mm_keys:
            return  # vLLM 0.8.5 stores some hashes with other multimodal keys than the chain's
        expected = hash_request_tokens(
            self.caching_hash_fn, self._hash_block_size, request, mm_position=self._mm_position
        )
        for position, block_hash in enumerate(chain):
            chained = expected[position] if position < len(expected) else None
            if block_hash != chained:
                raise InvariantViolation(
                    "stored hashes are the chain of the request's tokens",
                    f"request {request_id!r}, position {position}: stored {block_hash}, "
                    f"its tokens chain to {chained}",
                )

    def _check_mixed_request(
        self, request_id: str, group_blocks: Sequence[list[KVCacheBlock]]
    ) -> None:
        """Several block sizes with caching: every group caches the same prefix, a multiple
        of S tokens, and no block past it carries a hash (delayed hashing)."""
        managers = self.coordinator.single_type_managers
        cached = [
            manager.num_cached_block.get(request_id, 0) * manager.block_size for manager in managers
        ]
        # External tokens may push a window's or chunk's hits out: its null positions then
        # count as cached too (vLLM 0.33), past the prefix the other groups cached.
        common = min(cached)
        null_block = self.block_pool.null_block
        beyond = [
            blocks[common // manager.block_size : manager.num_cached_block.get(request_id, 0)]
            for manager, blocks in zip(managers, group_blocks, strict=True)
        ]
        if common % self._scheduler_block_size or any(
            block is not null_block for extra in beyond for block in extra
        ):
            raise InvariantViolation(
                "with several block sizes, every group caches the same prefix, a multiple of "
                "the scheduler block size (null positions past it aside)",
                f"request {request_id!r}: {cached} tokens cached per group, "
                f"S = {self._scheduler_block_size}",
            )
        for manager, blocks in zip(managers, group_blocks, strict=True):
            first = manager.num_cached_block.get(request_id, 0)
            for position in range(first, len(blocks)):
                if blocks[position].block_hash is not None:
                    raise InvariantViolation(
                        "with several block sizes, a request's blocks past its cached prefix "
                        "carry no hash",
                        f"request {request_id!r}, group {manager.group_id}, position "
                        f"{position}, block {blocks[position].block_id}",
                    )

    def _check_records(self) -> None:
        """Each tracked `Request` has one fast-path record, with its id and its token list."""
        num_expected = 0
        for request_id, request in self._requests.items():
            if type(request) is not Request:
                continue
            num_expected += 1
            record = self._records.get(request)
            if (
                record is None
                or record.request_id != request_id
                or record.token_ids is not request.live_token_ids()
            ):
                found = (
                    "no record"
                    if record is None
                    else f"a record of {record.request_id!r} with "
                    f"{'its' if record.token_ids is request.live_token_ids() else 'another'} "
                    "token list"
                )
                raise InvariantViolation(
                    "the fast path's record of a tracked request is its own",
                    f"request {request_id!r}: {found}",
                )
        if len(self._records) != num_expected:
            raise InvariantViolation(
                "the fast path's record of a tracked request is its own",
                f"{len(self._records)} records, {num_expected} tracked requests",
            )


def _cover_same_slots(
    managers: Sequence[SingleTypeKVCacheManager], lengths: Sequence[int | None]
) -> bool:
    """Whether one count of token slots gives every group its block list's length
    (`num_required`): each length allows the counts of an interval, and they must meet; a
    state group (lookahead slots out) covers no more than they do (the spec's check).
    Complexity: O(groups)."""
    low, high = 0, None
    state_low = 0
    for manager, length in zip(managers, lengths, strict=True):
        blocks = max((length or 0) - manager.num_required(0), 0)
        if (length or 0) < manager.num_required(0):
            return False
        first = 0 if blocks == 0 else (blocks - 1) * manager.block_size + 1
        last = blocks * manager.block_size
        if manager.holds_state:
            state_low = max(state_low, first)
            continue
        low = max(low, first)
        high = last if high is None else min(high, last)
    return high is None or (low <= high and state_low <= high)
