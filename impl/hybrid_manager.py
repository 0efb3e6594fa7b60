"""HybridKVCacheManager: the KV cache of a model with several attention types, over one pool.

A hybrid model (full attention beside sliding-window or chunked local layers) has one KV cache
group per attention type. Every group keeps its own block table over the one `BlockPool`, and
position p of each table covers the same tokens, so a request holds one block list per group,
all of one length. Blocks are cached per group under the request's one chain of hashes (group
0 under the hash itself, group g under `GroupKey(g, hash)`). `pagedkv.spec.SpecHybridKVCacheManager`
states the rules; this is their fast form, and agrees with it call for call:

- **A hit covers the same token prefix in every group**: the longest length every group allows
  (full-attention groups scan forward once and are trimmed after; sliding-window and chunked
  groups scan again for a shorter prefix until no group shortens it), each group's blocks at
  that length; with EAGLE every group drops the hit's last block.
- **Allocation is all or nothing**: blocks a window or chunk no longer reads are freed first
  (group by group, newest first); then the blocks every group still lacks must fit, counted
  together, in the free blocks the hits leave, or the call returns None and nothing else
  changed. Otherwise every group's hits are touched before any group takes a new block (no
  group's allocation evicts another's hit), then group by group, each takes its blocks from
  the free queue's head and caches its full ones.
- **Free** releases group by group, each group's blocks tail first (with caching).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.attention import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    SpecializedManager,
)
from pagedkv.block import KVCacheBlock
from pagedkv.block_counts import cdiv, fits, num_full_blocks, num_new_blocks, num_required_blocks
from pagedkv.block_hash import Sha256Memo, hash_request_tokens
from pagedkv.block_pool import BlockPool
from pagedkv.call_arguments import (
    HYBRID,
    check_common_prefix,
    check_hybrid_allocation,
    check_hybrid_manager,
    check_lookup,
    check_request,
)
from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import require_int, require_str
from pagedkv.vocab.errors import (
    ConcurrentUseError,
    InvalidArgumentError,
    InvariantViolation,
    KVCacheConfigError,
)
from pagedkv.vocab.hashes import BlockHashType, cache_key, get_hash_fn, sha256
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, Semantics

GroupBlocks = tuple[list[KVCacheBlock], ...]
"""One list of blocks per KV cache group, in the config's group order."""

SHA256_MEMO_TOKENS = 1 << 18
"""Tokens' worth of blocks the sha256 memo remembers (as `pagedkv.manager.SHA256_MEMO_TOKENS`)."""

CHECK_INVARIANTS_ENV = "PAGEDKV_CHECK_INVARIANTS"
"""Set to 1 to make every manager run `check_invariants()` after each state-changing call."""


def attention_manager(spec: KVCacheSpec, pool: BlockPool, group_id: int) -> SpecializedManager:
    """The attention policy of KV cache group `group_id`, whose layers have spec `spec`.

    Raises:
        KVCacheConfigError: a spec no policy serves.
    """
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager(spec, pool, group_id)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, pool, group_id)
    raise KVCacheConfigError(f"no attention manager for {type(spec).__name__}")


@dataclass(frozen=True)
class LookupUnit:
    """Groups of one spec, looked up together with EAGLE (vLLM 0.33's attention groups).

    Attributes:
        full: full attention (its hit is only cut once found).
        groups: the KV cache groups, in order.
        plain: the groups' attention policy (the first group's).
        eagle: its `for_eagle()` policy.
    """

    full: bool
    groups: tuple[int, ...]
    plain: SpecializedManager
    eagle: SpecializedManager


def _lookup_units(
    specs: Sequence[KVCacheSpec], managers: Sequence[SpecializedManager]
) -> tuple[LookupUnit, ...]:
    """The groups as vLLM 0.33's coordinator looks them up with EAGLE: equal specs in one unit
    (in the order of their first group), full-attention units first."""
    members: dict[KVCacheSpec, list[int]] = {}
    for group, spec in enumerate(specs):
        members.setdefault(spec, []).append(group)
    units = [
        LookupUnit(
            not managers[groups[0]].allows_null_blocks,
            tuple(groups),
            managers[groups[0]],
            managers[groups[0]].for_eagle(),
        )
        for groups in members.values()
    ]
    units.sort(key=lambda unit: not unit.full)
    return tuple(units)


class HybridKVCacheManager:
    """Request-level KV cache management over one `BlockPool` for one or more KV cache groups.

    The scheduler's calls are `KVCacheManager`'s, with blocks per group: `get_computed_blocks`
    returns one hit list per group, `allocate_slots` takes them and returns the new blocks per
    group (or None), `get_num_common_prefix_blocks` counts per group. With one group it behaves
    as `KVCacheManager` does (and takes the same arguments); the module docstring gives the
    rules of several.

    Per request it keeps one block list per group (`req_to_blocks`, one length in every group;
    positions a sliding window or a chunk no longer reads hold the pool's null block, as a
    prefix), the chained block hashes (`req_to_block_hashes`, one chain for every group, kept
    across preemption, dropped by `free_block_hashes`) and how many of its positions are cached
    in every group (`num_cached_block`). A request id names one `Request` object from its first
    use until it is freed and its hashes are dropped. Every public method checks its
    preconditions, argument types included (`pagedkv.call_arguments`), in the spec's order,
    before changing anything: a refused call changes nothing in any group.

    Not thread-safe, but never silently corrupted: a call that overlaps another call on the same
    manager or its pool raises `ConcurrentUseError` and changes nothing (the call token of
    `KVCacheManager`). Invariants: `check_invariants()`, mirroring the spec's.

    Args:
        kv_cache_config: one or more KV cache groups of one block size, each full attention,
            sliding window or chunked local attention.
        max_model_len: the longest request, in tokens.
        enable_caching: prefix caching on or off.
        caching_hash_algo: "sha256" (the default; memoized) or "builtin".
        use_eagle: every group drops the last block of a hit (EAGLE needs its hidden states);
            not with chunked local attention.
        log_stats: gather `PrefixCacheStats`.
        semantics: pagedkv's side of the deliberate differences, or vLLM 0.33's switches (none
            of vLLM 0.8.5's: it had no hybrid manager).
        enable_kv_cache_events: queue KV cache events (each names its group) for
            `take_events()`.
        debug_invariants: as `KVCacheManager`'s: run `check_invariants()` after every n-th
            state-changing call (True or 1: every call; None reads `PAGEDKV_CHECK_INVARIANTS`).

    Raises:
        ArgumentTypeError, InvalidArgumentError: an argument of the wrong type or value.
        KVCacheConfigError: groups of different block sizes, a spec of another attention type,
            EAGLE with chunked local attention, or a vLLM 0.8.5 switch.
    """

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
    ) -> None:
        config = check_hybrid_manager(
            kv_cache_config,
            max_model_len,
            enable_caching,
            caching_hash_algo,
            use_eagle,
            log_stats,
            semantics,
            enable_kv_cache_events,
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
        if self.caching_hash_fn is sha256:  # memoized, as KVCacheManager's (same values)
            self.caching_hash_fn = Sha256Memo(max(SHA256_MEMO_TOKENS // self.block_size, 1))
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self._mm_position = not semantics.mm_keys_without_position  # how hashes key an input
        self.block_pool = BlockPool(
            self.num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events
        )
        self.managers: tuple[SpecializedManager, ...] = tuple(
            attention_manager(spec, self.block_pool, group_id)
            for group_id, spec in enumerate(specs)
        )
        # The hit search asks full attention first (its hit shrinks only by trimming), then the
        # others, which may skip positions and drop blocks (sliding window, chunked local).
        self._full_groups = tuple(
            group for group, manager in enumerate(self.managers) if not manager.allows_null_blocks
        )
        self._skipping_groups = tuple(
            group for group, manager in enumerate(self.managers) if manager.allows_null_blocks
        )
        self._eagle_units = _lookup_units(specs, self.managers) if use_eagle else ()
        # The policies a hit's shape is checked against: with EAGLE, those it was found with.
        self._hit_policies = tuple(
            manager.for_eagle() if use_eagle else manager for manager in self.managers
        )
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.req_to_block_hashes: dict[str, list[BlockHashType]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        if debug_invariants is None:
            setting = os.environ.get(CHECK_INVARIANTS_ENV, "0").strip() or "0"
            if not setting.isdigit():
                raise InvalidArgumentError(
                    f"{CHECK_INVARIANTS_ENV} must be a number of calls (0: off), got {setting!r}"
                )
            debug_invariants = int(setting)
        elif not isinstance(debug_invariants, bool):
            debug_invariants = require_int(HYBRID, "debug_invariants", debug_invariants, 0)
        self.debug_invariants = int(debug_invariants)
        self._calls_until_check = self.debug_invariants
        # The pool's call token: a manager call holds it, so an overlapping call on the manager
        # or its pool is refused; holding it, the manager calls the pool's `*_locked` methods.
        self._call_token = self.block_pool.share_call_token()

    def _enter(self, call: str) -> None:
        """Take the call token, or refuse a call that overlaps another one."""
        try:
            self._call_token.pop()
        except IndexError:
            raise ConcurrentUseError(call) from None

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, every group's together. Complexity: O(1)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since the last call (renewed), or None without `log_stats`.

        Raises:
            ConcurrentUseError: another call on this manager is running.
        """
        self._enter("HybridKVCacheManager.make_prefix_cache_stats")
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

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The cached blocks a waiting request can reuse in every group, and the tokens they
        hold (the same number of blocks in every group).

        Hashes every full block of the request once and stores the list (one chain for every
        group). No hit when caching is off or the request wants prompt logprobs. When every
        token lies in full blocks the last block is not looked up (it is recomputed, so the last
        token yields logits). The hit is the longest every group allows; a sliding-window or
        chunked group's hit starts with null blocks where it skips positions. With `use_eagle`
        every group drops the last block of a non-empty hit. Nothing is touched yet.

        Raises:
            ArgumentTypeError: `request` is not a Request, or its prompt_logprobs not a bool.
            RequestError: another Request object already uses this request id.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_tokens) the first time, then O(full blocks * groups) lookups plus,
        for each time a sliding-window or chunked group shortens the hit, one more scan of those
        groups within the window or chunk.
        """
        self._enter("HybridKVCacheManager.get_computed_blocks")
        try:
            check_lookup(request, HYBRID)
            return self._get_computed_blocks(request)
        finally:
            self._call_token.append(None)

    def _get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        empty: GroupBlocks = tuple([] for _ in self.managers)
        if not self.enable_caching:
            return empty, 0
        self._check_identity(request)
        request_id = request.request_id
        block_size = self.block_size
        block_hashes = self.req_to_block_hashes.get(request_id)
        if not block_hashes:
            block_hashes = hash_request_tokens(
                self.caching_hash_fn, block_size, request, mm_position=self._mm_position
            )
            self.req_to_block_hashes[request_id] = block_hashes
            self._requests[request_id] = request
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
            self._after_call()
            return empty, 0
        # Every token in full blocks: leave the last one out, so one block is recomputed.
        last_left_out = len(block_hashes) * block_size == request.num_tokens
        lookup = block_hashes[:-1] if last_left_out else block_hashes
        if self.use_eagle:
            hits = self._eagle_common_hit(len(lookup), block_hashes)
        else:
            hits = self._longest_common_hit(lookup)
        num_hits = len(hits[0])
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

    def _longest_common_hit(self, block_hashes: list[BlockHashType]) -> GroupBlocks:
        """Each group's hit at the longest length L (in blocks) every group allows.

        Whether a group allows L depends on L alone (every block of [0, L) cached under full
        attention; the last window's or the last chunk's blocks otherwise), and each group's
        `find_longest_cache_hit` gives the longest L it allows within the hashes it is given.
        Full attention allows every L up to its cached prefix, so its groups scan once and are
        trimmed at the end; the others are asked again, for the current L, until none shortens
        it. A group whose last answer is the current L still allows it and is not asked again.
        """
        managers = self.managers
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        length = len(block_hashes)
        for group in self._full_groups:
            hits[group] = managers[group].find_longest_cache_hit(
                block_hashes if length == len(block_hashes) else block_hashes[:length]
            )
            length = len(hits[group])
        answered = [-1] * len(managers)  # the length of each group's hit, once asked
        settled = False
        while not settled:
            settled = True
            for group in self._skipping_groups:
                if answered[group] == length:
                    continue
                hit = managers[group].find_longest_cache_hit(
                    block_hashes if length == len(block_hashes) else block_hashes[:length]
                )
                hits[group] = hit
                answered[group] = len(hit)
                if len(hit) < length:
                    length = len(hit)
                    settled = False
        for group in self._full_groups:
            del hits[group][length:]
        return tuple(hits)

    def _eagle_common_hit(self, num_lookup: int, block_hashes: list[BlockHashType]) -> GroupBlocks:
        """The hit with EAGLE, as vLLM 0.33's coordinator finds it (the spec's
        `eagle_common_hit` states the steps): units of equal specs looked up together, full
        attention first; passes until none shortens the length; a unit not yet asked at this
        length finds its EAGLE policy's hit within one block more and drops the last block; a
        unit asked already finds its own hit within the length, and if it shortens it every
        unit is asked anew.

        Complexity: O(full blocks * groups) lookups per pass; a pass after the first only when
        a windowed group shortened the length.
        """
        units = self._eagle_units
        found: list[list[list[KVCacheBlock]] | None] = [None] * len(units)
        verified: set[int] = set()
        single_pass = len(units) == 2 and units[0].full
        length = num_lookup
        while True:
            current = length
            for index, unit in enumerate(units):
                hits = found[index]
                if unit.full and hits is not None:
                    current = min(current, len(hits[0]))
                    continue
                if index not in verified:
                    limit = min(current + 1, len(block_hashes))
                    hits = self._unit_hit(unit.eagle, unit.groups, block_hashes, limit)
                    if hits[0]:  # EAGLE recomputes the last matched block
                        for group_hits in hits:
                            group_hits.pop()
                    verified.add(index)
                else:
                    hits = self._unit_hit(unit.plain, unit.groups, block_hashes, current)
                    if len(hits[0]) < current:
                        verified.clear()
                current = len(hits[0])
                found[index] = hits
            if current >= length or single_pass:
                length = current
                break
            length = current
        result: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        for unit, hits in zip(units, found, strict=True):
            assert hits is not None
            for group, group_hits in zip(unit.groups, hits, strict=True):
                result[group] = group_hits[:length] if unit.full else group_hits
        return tuple(result)

    def _unit_hit(
        self,
        policy: SpecializedManager,
        groups: tuple[int, ...],
        block_hashes: list[BlockHashType],
        num_blocks: int,
    ) -> list[list[KVCacheBlock]]:
        """`policy`'s hit within the first `num_blocks` hashes for groups looked up together
        (a position counts as cached only if it is in every group); each group's blocks."""
        managers = self.managers

        def cached_in_every_group(i: int) -> list[KVCacheBlock] | None:
            blocks = []
            for group in groups:
                block = managers[group].cached_block(block_hashes[i])
                if block is None:
                    return None
                blocks.append(block)
            return blocks

        null = [self.block_pool.null_block] * len(groups)
        hit = policy.scan_hit(num_blocks, cached_in_every_group, null)
        return [[blocks[k] for blocks in hit] for k in range(len(groups))]

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: object,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
        num_lookahead_tokens: object = 0,
    ) -> GroupBlocks | None:
        """Reserve slots for `num_tokens` scheduled tokens (and lookahead slots) of `request`
        in every group; None when the blocks every group lacks do not fit in the pool together.

        First frees, group by group, the blocks a window or chunk no longer reads (even if the
        request then does not fit). Then, if the new blocks fit (evictable hits do not count as
        free), touches every group's hits, then group by group appends the hits, allocates the
        rest from the free queue's head and caches every block that became full, speculative
        tokens excluded. A None leaves every group as the first step left it.

        Args:
            request: the request; its `num_computed_tokens` and `spec_token_ids` are read.
            num_tokens: tokens scheduled this step (> 0), speculative ones included.
            new_computed_blocks: the hits from `get_computed_blocks` (one list per group), for
                a request that holds no blocks yet.
            num_lookahead_tokens: extra slots for a speculative proposer (>= 0).

        Returns:
            The newly allocated blocks per group (the same number in each, maybe none), or None.

        Raises:
            ArgumentTypeError, InvalidArgumentError: an argument of the wrong type or out of
                range (`check_hybrid_allocation`: the hits a list or tuple of one iterable of
                blocks per group); more speculative tokens than num_tokens; hits with caching
                off; more tokens scheduled than the request has.
            RequestError: another Request object uses the id; num_computed_tokens outside the
                request's slots; hits for a request that already holds blocks; hits of unequal
                lengths; a hit that is not the request's cached block of its group at its
                position, or a hit of a shape its group's attention cannot produce; fewer full
                blocks than already cached.
            BlockStateError: a hit that does not belong to the pool, or a null hit in a full
                attention group.
            MaxModelLenExceededError: the request would need more than
                cdiv(max_model_len, block_size) blocks.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(groups + new blocks + hits + dropped blocks + blocks to cache *
        block_size); a decode step is O(groups) plus the block it needs or fills.
        """
        self._enter("HybridKVCacheManager.allocate_slots")
        try:
            return self._allocate_slots(
                request, num_tokens, new_computed_blocks, num_lookahead_tokens
            )
        finally:
            self._call_token.append(None)

    def _allocate_slots(
        self,
        request: object,
        num_tokens: object,
        new_computed_blocks: object,
        num_lookahead_tokens: object,
    ) -> GroupBlocks | None:
        """allocate_slots: every check in the spec's order, then the changes."""
        hits = check_hybrid_allocation(
            request,
            num_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            self.num_groups,
            KVCacheBlock,
        )
        assert isinstance(request, Request) and isinstance(num_tokens, int)
        assert isinstance(num_lookahead_tokens, int)
        request_id = request.request_id
        block_size = self.block_size
        # -- the preconditions, in the spec's order --
        num_spec = len(request.spec_token_ids)
        if num_spec > num_tokens:
            raise refusals.more_drafts_than_scheduled(request_id, num_spec, num_tokens)
        known = self._requests.get(request_id)  # _check_identity, inline
        if known is not None and known is not request:
            raise refusals.id_in_use(request_id)
        held = self.req_to_blocks.get(request_id)
        num_held = 0 if held is None else len(held[0])
        num_computed = request.num_computed_tokens
        if not 0 <= num_computed <= num_held * block_size:
            raise refusals.computed_outside_slots(request_id, num_computed, num_held, block_size)
        num_hits = len(hits[0]) if hits else 0  # no hits: ()
        if hits and any(hits):
            self._check_hits(request, num_held, hits)
        num_computed_tokens = num_computed + num_hits * block_size
        num_scheduled_real = num_computed_tokens + num_tokens - num_spec
        if num_scheduled_real > request.num_tokens:
            raise refusals.more_tokens_than_request(
                request_id, num_scheduled_real, request.num_tokens
            )
        num_required = num_required_blocks(
            num_computed_tokens, num_tokens, num_lookahead_tokens, block_size
        )
        if num_required > self.max_num_blocks_per_req:
            raise refusals.past_max_model_len(
                request_id,
                num_required,
                self.max_num_blocks_per_req,
                self.max_model_len,
                block_size,
            )
        num_full = num_full_blocks(num_computed_tokens, num_tokens, num_spec, block_size)
        num_cached = self.num_cached_block.get(request_id, num_hits)
        if self.enable_caching and num_full < num_cached:
            raise refusals.cached_blocks_lost(request_id, num_full, num_cached)
        # -- every precondition holds: from here on nothing can fail --
        pool = self.block_pool
        if held is not None and self._skipping_groups:
            self._drop_skipped_blocks(held, num_computed)
        num_new = num_new_blocks(num_required, num_held, num_hits)
        if num_new > 0 and not self._fits(num_new, hits):  # nothing to allocate always fits
            if self.debug_invariants:
                self._after_call()
            return None
        if num_hits:  # every group's hits before any group's new blocks
            for group_hits in hits:
                pool.touch_owned_locked(group_hits)
        lists: GroupBlocks = tuple([] for _ in self.managers) if held is None else held
        # Every group holds as many blocks after the step, so caches the same positions.
        num_blocks = num_held + num_hits + max(num_new, 0)
        first_to_cache, end_to_cache = min(num_cached, num_blocks), min(num_full, num_blocks)
        caching = self.enable_caching
        stored = self.req_to_block_hashes.setdefault(request_id, []) if caching else []
        to_cache = caching and end_to_cache > first_to_cache
        new_blocks: list[list[KVCacheBlock]] = []
        for group, blocks in enumerate(lists):
            if num_hits:
                blocks.extend(hits[group])
            taken = pool.get_new_blocks_locked(num_new) if num_new > 0 else []
            blocks.extend(taken)
            new_blocks.append(taken)
            if to_cache:
                pool.cache_full_blocks_locked(
                    request,
                    blocks,
                    stored,
                    first_to_cache,
                    end_to_cache,
                    block_size,
                    self.caching_hash_fn,
                    group,
                )
        self.req_to_blocks[request_id] = lists
        self._requests[request_id] = request
        if caching:
            self.num_cached_block[request_id] = num_full
        if self.debug_invariants:
            self._after_call()
        return tuple(new_blocks)

    def _check_hits(self, request: Request, num_held: int, hits: GroupBlocks) -> None:
        """Prefix hits are what `get_computed_blocks` could have returned: one length in every
        group, each group's the request's cached blocks of that group, position by position,
        in a shape its attention can produce."""
        request_id = request.request_id
        if not self.enable_caching:
            raise refusals.hits_without_caching(request_id)
        if num_held or request.num_computed_tokens:
            raise refusals.hits_for_running_request(request_id)
        lengths = [len(group_hits) for group_hits in hits]
        if len(set(lengths)) != 1:
            raise refusals.hits_of_unequal_length(request_id, lengths)
        stored = self.req_to_block_hashes.get(request_id, [])
        if lengths[0] > len(stored):
            raise refusals.more_hits_than_hashes(request_id, lengths[0], len(stored))
        pool = self.block_pool
        for group, group_hits in enumerate(hits):
            manager = self.managers[group]
            pool.check_hits_locked(
                request_id, group_hits, stored, manager.allows_null_blocks, group
            )
            shape_error = self._hit_policies[group].hit_shape_error(group_hits, self.use_eagle)
            if shape_error is not None:
                raise refusals.hit_shape(request_id, shape_error)

    def _fits(self, num_new: int, hits: GroupBlocks) -> bool:
        """Capacity, all groups together: every group takes `num_new` blocks, so
        `num_new * num_groups` must fit in the free blocks the hits leave."""
        num_evictable = self._num_evictable_hits(hits) if hits and hits[0] else 0
        return fits(num_new * self.num_groups, self.block_pool.get_num_free_blocks(), num_evictable)

    def _num_evictable_hits(self, hits: GroupBlocks) -> int:
        """Distinct hits with ref_cnt 0, null blocks apart: touching takes them off the free
        queue, so they are not free for this step."""
        null_block = self.block_pool.null_block
        return len(
            {
                block
                for group_hits in hits
                for block in group_hits
                if block.ref_cnt == 0 and block is not null_block
            }
        )

    def _drop_skipped_blocks(self, held: GroupBlocks, num_computed_tokens: int) -> None:
        """Group by group, the positions the next token no longer reads get the null block and
        the blocks they held are freed, the newest first (one free per group)."""
        pool = self.block_pool
        for group in self._skipping_groups:
            removed = self.managers[group].remove_skipped_blocks(held[group], num_computed_tokens)
            if removed:
                pool.free_blocks_locked(removed)

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

        Complexity: O(blocks held).
        """
        self._enter("HybridKVCacheManager.free")
        try:
            check_request("free", request, HYBRID)
            self._check_identity(request)
            request_id = request.request_id
            held = self.req_to_blocks.pop(request_id, None)
            if held is not None:
                tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
                free_blocks = self.block_pool.free_blocks_locked
                for blocks in held:
                    free_blocks(blocks[::-1] if tail_first else blocks)
            self.num_cached_block.pop(request_id, None)
            self._forget_if_done(request_id)
            self._after_call()
        finally:
            self._call_token.append(None)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the request's stored block hashes (when it finishes, not when preempted).

        Raises:
            ArgumentTypeError: `request` is not a Request.
            RequestError: another Request object uses this request id, or the request still
                holds blocks (`free` it first).
            ConcurrentUseError: another call on this manager is running.
        """
        self._enter("HybridKVCacheManager.free_block_hashes")
        try:
            check_request("free_block_hashes", request, HYBRID)
            self._check_identity(request)
            if request.request_id in self.req_to_blocks:
                raise refusals.hashes_dropped_while_held(request.request_id)
            self.req_to_block_hashes.pop(request.request_id, None)
            self._forget_if_done(request.request_id)
            self._after_call()
        finally:
            self._call_token.append(None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash of every group if no request holds blocks; else refuse
        (False).

        Raises:
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_gpu_blocks).
        """
        self._enter("HybridKVCacheManager.reset_prefix_cache")
        try:
            if not self.block_pool.reset_prefix_cache_locked():
                return False
            if self.prefix_cache_stats is not None:
                self.prefix_cache_stats.reset = True
            self._after_call()
            return True
        finally:
            self._call_token.append(None)

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: object
    ) -> tuple[int, ...]:
        """Per group, the leading blocks of `request` whose ref_cnt equals
        `num_running_requests` (a null block's ref_cnt is 0).

        Raises:
            ArgumentTypeError, InvalidArgumentError: `request` is not a Request, or
                `num_running_requests` not an int >= 0.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(common prefix of each group).
        """
        self._enter("HybridKVCacheManager.get_num_common_prefix_blocks")
        try:
            check_common_prefix(request, num_running_requests, HYBRID)
            held = self.req_to_blocks.get(request.request_id)
            if held is None:
                return (0,) * self.num_groups
            counts = []
            for blocks in held:
                count = 0
                for block in blocks:
                    if block.ref_cnt != num_running_requests:
                        break
                    count += 1
                counts.append(count)
            return tuple(counts)
        finally:
            self._call_token.append(None)

    def get_block_ids(self, request_id: object) -> tuple[list[int], ...]:
        """The ids of the blocks `request_id` holds, one list per group (the null block's id
        is 0); empty lists for a request that holds none.

        Raises:
            ArgumentTypeError: `request_id` is not a str.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(blocks held).
        """
        self._enter("HybridKVCacheManager.get_block_ids")
        try:
            checked = require_str(f"{HYBRID}.get_block_ids", "request_id", request_id)
            held = self.req_to_blocks.get(checked)
            if held is None:
                return tuple([] for _ in range(self.num_groups))
            return tuple([block.block_id for block in blocks] for blocks in held)
        finally:
            self._call_token.append(None)

    # -- helpers -----------------------------------------------------------------------------

    def _check_identity(self, request: Request) -> None:
        known = self._requests.get(request.request_id)
        if known is not None and known is not request:
            raise refusals.id_in_use(request.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if request_id not in self.req_to_blocks and request_id not in self.req_to_block_hashes:
            self._requests.pop(request_id, None)

    def _after_call(self) -> None:
        if not self.debug_invariants:
            return
        self._calls_until_check -= 1
        if self._calls_until_check <= 0:
            self._calls_until_check = self.debug_invariants
            self._check_invariants()

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pool's invariants, then the hybrid ones the spec manager states: a block's
        ref_cnt is the number of block lists holding it, and a block two of them hold is
        cached; a request's lists have one length; null blocks only as a prefix, and only in
        sliding-window or chunked groups; at most cdiv(max_model_len, B) positions; with
        caching, the cached positions are full blocks with stored hashes, each group's cached
        block carries its group's key of the stored hash, and the stored hashes are the chain
        of the request's tokens; every tracked request holds blocks or stored hashes.

        All but prefix closure of the full-attention groups: that needs each hash's parent,
        which only the spec keeps (as ghost state).

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
            ConcurrentUseError: another call on this manager is running.

        Complexity: O(num_gpu_blocks + blocks held + tokens of the requests holding blocks).
        """
        self._enter("HybridKVCacheManager.check_invariants")
        try:
            self._check_invariants()
        finally:
            self._call_token.append(None)

    def _check_invariants(self) -> None:
        pool = self.block_pool
        pool.check_invariants_locked()
        null_block = pool.null_block
        holders: Counter[int] = Counter()
        for held in self.req_to_blocks.values():
            for blocks in held:
                holders.update(block.block_id for block in blocks if block is not null_block)
        for block in pool.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                raise InvariantViolation(
                    "a block's ref_cnt is the number of requests holding it",
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held "
                    f"{holders[block.block_id]} times",
                )
            if block.ref_cnt >= 2 and block.block_hash is None:
                raise InvariantViolation("a block held by two requests is cached", repr(block))
        for request_id, held in self.req_to_blocks.items():
            self._check_request(request_id, held)
        known = self.req_to_blocks.keys() | self.req_to_block_hashes.keys()
        if self._requests.keys() != known or not self.num_cached_block.keys() <= known:
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes",
                f"requests {sorted(self._requests)}, with blocks or hashes {sorted(known)}",
            )

    def _check_request(self, request_id: str, held: GroupBlocks) -> None:
        if len(held) != self.num_groups or len({len(blocks) for blocks in held}) != 1:
            raise InvariantViolation(
                "a request's block lists cover the same positions in every group",
                f"request {request_id!r}: {[len(blocks) for blocks in held]} blocks",
            )
        null_block = self.block_pool.null_block
        for group, (manager, blocks) in enumerate(zip(self.managers, held, strict=True)):
            nulls = [i for i, block in enumerate(blocks) if block is null_block]
            if nulls and (not manager.allows_null_blocks or nulls != list(range(len(nulls)))):
                raise InvariantViolation(
                    "null blocks only as a prefix, and only under sliding window",
                    f"request {request_id!r}, group {group}: null at positions {nulls}",
                )
        if len(held[0]) > self.max_num_blocks_per_req:
            raise InvariantViolation(
                "a request holds at most cdiv(max_model_len, block_size) blocks",
                f"request {request_id!r}: {len(held[0])} blocks",
            )
        if not self.enable_caching:
            return
        request = self._requests[request_id]
        num_cached = self.num_cached_block.get(request_id, 0)
        stored = self.req_to_block_hashes.get(request_id, [])
        if num_cached > min(request.num_tokens // self.block_size, len(stored)):
            raise InvariantViolation(
                "a request's cached blocks are full blocks with stored hashes",
                f"request {request_id!r}: {num_cached} cached, {request.num_tokens} tokens, "
                f"{len(stored)} stored hashes",
            )
        for group, blocks in enumerate(held):
            for position, block in enumerate(blocks[:num_cached]):
                if block is not null_block and block.block_hash != cache_key(
                    stored[position], group
                ):
                    raise InvariantViolation(
                        "a request's cached block carries the hash its tokens chain to",
                        f"request {request_id!r}, group {group}, position {position}: "
                        f"{block!r}, stored {stored[position]}",
                    )
        expected = hash_request_tokens(
            self.caching_hash_fn, self.block_size, request, mm_position=self._mm_position
        )
        for position, block_hash in enumerate(stored):
            chained = expected[position] if position < len(expected) else None
            if block_hash != chained:
                raise InvariantViolation(
                    "stored hashes are the chain of the request's tokens",
                    f"request {request_id!r}, position {position}: stored {block_hash}, "
                    f"its tokens chain to {chained}",
                )
