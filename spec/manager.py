"""The reference KV cache manager: every KVCacheManager operation over the spec pool, in ids, for
one or more KV cache groups.

A model with several attention types (full attention, sliding window, chunked local, Mamba
states) has one KV cache group per type; each group's per-type manager
(`pagedkv.spec.single_type`) keeps its block table over the one pool: a request holds one
block-id list per group, position p of every list covering the same tokens when the groups
share one block size (else each list covers the same token slots in blocks of its group's size,
plus a Mamba group's speculative blocks). Blocks are cached per group (index key
`GroupKey(g, hash)`, plain `hash` for group 0) under the request's one chain of hashes, which
this manager stores: at the block size, or with several block sizes and caching at their GCD H,
each group keying its block by the chain hash at the block's end, hits and cached prefixes then
multiples of their LCM S (docs/semantics.md, "Several block sizes with caching").

- **A hit covers the same token prefix in every group.** With one group it is the group's own
  longest hit (with EAGLE found for EAGLE, then less its last block). With several, the longest
  L such that every group allows a hit of L blocks: start from the longest lookup, then shorten
  to each group's longest hit within the current length, full attention first, until no group
  shortens it (a window or chunk that allowed L may not allow a shorter L, hence the
  repetition); with EAGLE, vLLM 0.33's procedure (`eagle_common_hit`).
- **Allocation is all or nothing.** Blocks a window or chunk no longer reads are freed first
  (group by group, newest first), then the blocks every group still lacks must fit in the free
  blocks the hits leave: otherwise None, nothing else changed. Else every group's hits are
  touched before any group takes a new block (so no group's allocation evicts another's hit),
  then each group takes its blocks from the free queue's head, group by group, and caches its
  full blocks.
- **External tokens** (a KV connector's, `num_external_computed_tokens`) extend a request's
  first allocation past its hits: every group adopts its hits less those the external tokens
  push out of its window or chunk (null blocks instead, untouched), every group's adopted hits
  are touched, then every group takes the blocks the external tokens fill, then every group its
  new blocks (vLLM 0.33's two phases: no group's allocation evicts another's adopted hit).
- **Free** releases group by group, each group's blocks tail first (with caching).

Each operation is written as its preconditions, in the order its docstring lists them (the first
one broken raises, before anything changes in any group), then the state it leads to. The spec
decides every rule itself, arguments included (`pagedkv.spec.arguments`); only the wording of a
refusal is shared (`pagedkv.vocab.refusals`), so both sides refuse alike in the same words.
`check_invariants()` adds the request-level invariants to the pool's, among them prefix
closure of the full-attention groups, checked against a ghost map of every hash's parent that
only the spec keeps, and the attention-truth invariant (`pagedkv.spec.attention_truth`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.spec.arguments import (
    check_allocation,
    check_cache_blocks,
    check_common_prefix,
    check_lookup,
    check_manager,
    check_popped_blocks,
    check_request,
    check_semantics,
    require_block_ids,
)
from pagedkv.spec.attention_truth import AttentionTruth
from pagedkv.spec.block_counts import (
    ceil_div,
    fits,
    num_full_blocks,
    num_new_blocks,
)
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.known_bugs import known_bugs, known_bugs_fatal
from pagedkv.spec.offload.tier import SpecOffloadTier
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.spec.single_type import (
    FullAttention,
    SlidingWindow,
    SpecSingleTypeManager,
    spec_single_type_manager,
)
from pagedkv.vocab import refusals
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError, InvariantViolation
from pagedkv.vocab.hashes import (
    BlockHashType,
    CacheKey,
    HashFn,
    cache_key,
    get_hash_fn,
    key_group,
    key_hash,
)
from pagedkv.vocab.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

GroupBlocks = tuple[list[int], ...]
"""One list of block ids per KV cache group, in the config's group order."""


@dataclass(frozen=True)
class Step:
    """What one `allocate_slots` call asks for, once its preconditions hold.

    Attributes:
        hits: the prefix each group adopts, one list per group (block ids, nulls first where a
            group's attention skips positions): the hits given, less (with external tokens)
            those outside the window or chunk the external tokens move to, as null blocks, and
            null blocks up to the first position that window or chunk reads.
        num_required: blocks the request must hold after the step, lookahead included, one
            count per group (`SpecSingleTypeManager.num_required`).
        num_full: its full blocks after the step, speculative tokens left out: cached after it.
        num_cached: its blocks cached before the step.
        num_computed: its tokens computed before the step, the hits' and external included.
        num_tokens: the tokens the step computes (drafts included).
        num_external: the external tokens the step adopts (a connector loads them).
        delay_cache: the step caches nothing (an async load: the caller caches on landing).
        cache_tokens: with several block sizes and caching, the tokens every group caches
            after the step (its computed tokens, drafts out, rounded down to S); each group
            caches `cache_tokens // B_g` positions, `num_full` being group 0's.
    """

    hits: GroupBlocks
    num_required: tuple[int, ...]
    num_full: int
    num_cached: int
    num_computed: int
    num_tokens: int
    num_external: int = 0
    delay_cache: bool = False
    cache_tokens: int | None = None


@dataclass(frozen=True)
class PoppedBatch:
    """One `pop_blocks_for_free` answer not yet freed.

    Attributes:
        blocks: each group's popped block ids, as returned.
        evicted: those of them `evict_blocks` took the hash of while the request held them (a
            block may be shared without a hash only then).
    """

    blocks: tuple[tuple[int, ...], ...]
    evicted: frozenset[int]


@dataclass(frozen=True)
class HitTrace:
    """How a common hit was found (`SpecKVCacheManager.trace_common_hit`).

    Attributes:
        alone: each group's longest hit on its own, in blocks.
        length: the common hit, in blocks (at most every entry of `alone`).
        passes: passes over the groups, the last one shortening nothing (1: the longest lookup
            held in every group; 3 or more: a group shortened a length an earlier pass had
            already shortened, so the hit had to be checked again).
        undercut: a group shortened a length that a windowed or chunked group had accepted
            before it, so that group's hit had to be found again at the shorter length (its
            hit at the longer length, cut, may be no hit at all).
    """

    alone: tuple[int, ...]
    length: int
    passes: int
    undercut: bool


class SpecKVCacheManager:
    """Reference model of `pagedkv.KVCacheManager` (module docstring).

    Attributes:
        pool: the one spec pool every group takes its blocks from.
        specs: each group's KV cache spec, in group order.
        managers: each group's per-type manager (its block lists, its attention's rules), in
            group order.
        eagle_lookup: with use_eagle, hits are found for EAGLE (`for_eagle`), unless
            `eagle_window_hit_one_short`.
        hashes: request id -> its stored block hashes (one chain for every group, kept across
            preemption).
        requests: request id -> the one Request object the id names while it is tracked.
        parent_of: ghost state: every block hash ever stored -> the hash before it in its chain.
        retention_interval: the config's `prefix_cache_retention_interval`
            (`pagedkv.spec.retention`).
        junction: request id -> the shared-prefix junction its last lookup found, in tokens
            (0: none; `junction_of`).
        retention_counts: what sparse retention did, for a campaign's coverage
            (`take_retention_counts`).
        truth: ghost state: what every block holds, and the attention-truth checks.
        evicted: request id -> the (group, position, block id) it held when `evict_blocks`
            took that block's hash (until the request is freed): cached positions that may
            carry no hash, blocks that may be shared without one.
        evicted_keys: ghost state: every key `evict_blocks` took since the last reset; prefix
            closure holds only for keys none of whose ancestors is among them.
        evict_counts: what `evict_blocks` led to, for a campaign's coverage
            (`take_evict_counts`).
        popped: the deferred frees not yet released (`pop_blocks_for_free`), oldest first:
            each of their blocks keeps one reference per entry.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        caching_hash_algo: str = "sha256",
        use_eagle: bool = False,
        log_stats: bool = False,
        *,
        semantics: Semantics = PAGEDKV_SEMANTICS,
        enable_kv_cache_events: bool = False,
        max_in_flight_tokens: int | None = None,
    ) -> None:
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
        self.specs = tuple(group.kv_cache_spec for group in config.kv_cache_groups)
        self.num_groups = len(self.specs)
        self.block_size = self.specs[0].block_size
        self.pool = SpecBlockPool(
            config.num_blocks, enable_caching, semantics, enable_kv_cache_events
        )
        self.retention_interval = config.prefix_cache_retention_interval
        self.managers: tuple[SpecSingleTypeManager, ...] = tuple(
            spec_single_type_manager(spec, self.pool, group, use_eagle, self.retention_interval)
            for group, spec in enumerate(self.specs)
        )
        for manager in self.managers:
            manager.junction_ignores_eagle = semantics.junction_ignores_eagle
            # vLLM 0.32.0's hybrid coordinator aligns the cached length to the block, so its
            # re-registration reaches the boundary on every call there (`Semantics`).
            manager.remarks_keyed_boundary = (
                semantics.mamba_remarks_keyed_boundary and self.num_groups > 1
            )
        check_semantics(semantics, self.num_groups)
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = ceil_div(max_model_len, self.block_size)
        # Each group's most blocks a request holds (its own block size, its extra blocks).
        self.max_blocks = tuple(manager.num_required(max_model_len) for manager in self.managers)
        # What the full-sequence gate reserves at most per group (None: no cap); tokens in
        # flight default to max_model_len, as vLLM 0.33's, which then caps nothing.
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self.admission_caps = tuple(
            manager.admission_cap(max_model_len, in_flight) for manager in self.managers
        )
        # Groups of several block sizes: refusals name the group.
        self.mixed_sizes = len({manager.block_size for manager in self.managers}) > 1
        self.enable_caching = enable_caching
        # With caching (`mixed_cached`), the request's one chain is at H, each group's keys are
        # its view of it (`group_keys`), and hits and cached prefixes are multiples of S.
        self.mixed_cached = self.mixed_sizes and enable_caching
        self.hash_block_size = config.hash_block_size
        self.scheduler_block_size = config.scheduler_block_size
        if self.mixed_cached:
            for manager in self.managers:
                if isinstance(manager, SlidingWindow):
                    manager.alignment = self.scheduler_block_size
        self.hash_fn: HashFn = get_hash_fn(caching_hash_algo)
        self.use_eagle = use_eagle
        self.eagle_lookup = use_eagle and not semantics.eagle_window_hit_one_short
        self.stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self.hashes: dict[str, list[BlockHashType]] = {}
        self.requests: dict[str, Request] = {}
        self.parent_of: dict[BlockHashType, BlockHashType | None] = {}
        self.junction: dict[str, int] = {}
        self.retention_counts: Counter[str] = Counter()
        self.evicted: dict[str, set[tuple[int, int, int]]] = {}
        self.evicted_keys: set[CacheKey] = set()
        self.evict_counts: Counter[str] = Counter()
        self.popped: list[PoppedBatch] = []
        self.offload_tier: SpecOffloadTier | None = None
        """The CPU offload tier behind the manager's KV connector (`attach_offload_tier`)."""
        self.truth = AttentionTruth(
            self.managers,
            tuple(manager.block_size for manager in self.managers),
            known_bugs(semantics),
            fatal_known_bugs=known_bugs_fatal(),
        )

    @property
    def blocks(self) -> dict[str, GroupBlocks]:
        """Request id -> its block-id lists, one per group (the per-type managers' lists)."""
        return {
            request_id: tuple(manager.blocks[request_id] for manager in self.managers)
            for request_id in self.managers[0].blocks
        }

    def held(self, request_id: str) -> GroupBlocks | None:
        """The request's block-id lists, one per group; None if it holds none."""
        if request_id not in self.managers[0].blocks:
            return None
        return tuple(manager.blocks[request_id] for manager in self.managers)

    @property
    def num_cached(self) -> dict[str, int]:
        """Request id -> how many of its positions are cached (in every group)."""
        return self.managers[0].num_cached

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    def shared_prefix_boundary(self, request_id: str) -> int:
        """The junction of the request's last lookup (`junction_of`), in tokens: with a Mamba
        group in mode "align" whatever the retention (vLLM 0.33 answers it always, and its
        scheduler cuts a Mamba group's chunks there), else where a sliding-window group keeps
        it (sparse retention); else 0."""
        if any(manager.holds_state for manager in self.managers):
            return self.junction.get(request_id, 0)
        if self.retention_interval is None or not any(
            isinstance(spec, SlidingWindowSpec) for spec in self.specs
        ):
            return 0
        return self.junction.get(request_id, 0)

    def new_step_starts(self) -> None:
        """A new scheduler step starts (vLLM 0.33's scheduler calls it first in every
        `schedule()`): the Mamba states keyed during the last step have been written, so hits
        on them fit from now on (`allocate_slots`). Without a Mamba group in mode "align" it
        changes nothing a call can see."""
        for manager in self.managers:
            manager.new_step_starts()
        self.truth.new_step()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call, renewed; None without log_stats."""
        if self.stats is None:
            return None
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV cache events not yet taken (each names its group)."""
        return self.pool.take_events()

    # -- lookups -----------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The blocks a waiting request may reuse in every group, and the tokens they hold.

        Caching off: an empty list per group, 0 tokens, nothing stored. Otherwise the
        request's full-block hashes are stored (computed unless already stored and non-empty;
        with `lookup_hashes_every_full_block`, the stored ones extended to every full block); a
        lookup is counted; a request wanting prompt logprobs gets empty hits; the lookup leaves
        out the last hash if every token lies in full blocks; the hit is the module
        docstring's: with one group `unitary_hit`, with several `longest_common_hit`, or with
        use_eagle `eagle_common_hit`.

        Preconditions: `check_lookup` (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_lookup(request)
        empty: GroupBlocks = tuple([] for _ in self.managers)
        if not self.enable_caching:
            return empty, 0
        self._require_same_request(request)
        request_id = request.request_id
        if not self.hashes.get(request_id):
            self.hashes[request_id] = self._chain(request)
            self.requests[request_id] = request
        elif self.semantics.lookup_hashes_every_full_block:
            stored = self.hashes[request_id]
            chain = self._chain(request)
            stored.extend(chain[len(stored) :])  # blocks generated before a preemption
        self._record_parents(self.hashes[request_id])
        stored = self.hashes[request_id]
        if self.stats is not None:
            self.stats.requests += 1
        self.junction[request_id] = 0
        if request.prompt_logprobs:
            return empty, 0
        if self.mixed_cached:
            return self._mixed_lookup(request, stored)
        if len(stored) * self.block_size == request.num_tokens:
            lookup = stored[:-1]  # recompute the last block, so the last token yields logits
        else:
            lookup = list(stored)
        if self.num_groups == 1:
            hits: GroupBlocks = (self.unitary_hit(lookup),)
        elif self.use_eagle:
            hits = self.eagle_common_hit(len(lookup), stored)
        else:
            hits = self.longest_common_hit(lookup)
        num_hits = len(hits[0])
        if self.num_groups > 1:
            self.junction[request_id] = self.junction_of(len(lookup), stored, num_hits)
            if self.junction[request_id] and self.retention_interval is not None:
                self.retention_counts["retention: lookups finding a shared-prefix junction"] += 1
        self._count_retention_hit(hits, lookup)
        if self.evicted_keys and num_hits < len(lookup):
            stop = [cache_key(lookup[num_hits], group) for group in range(self.num_groups)]
            if any(key in self.evicted_keys and key not in self.pool.index for key in stop):
                self.evict_counts["evict_blocks: lookups stopped at an evicted block"] += 1
        self.truth.check_hit(request, hits, num_hits * self.block_size, eagle=self.use_eagle)
        if self.stats is not None:
            self.stats.queries += len(lookup)
            self.stats.hits += num_hits
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += num_hits * self.block_size
        return hits, num_hits * self.block_size

    def junction_of(
        self, num_lookup: int, block_hashes: Sequence[BlockHashType], num_hits: int
    ) -> int:
        """The shared-prefix junction of a hybrid lookup, in tokens (0: none): where the hit of
        the groups looked up first (vLLM 0.33's first attention group: the groups sharing the
        first full-attention group's spec, else group 0's) ends, when the common hit of
        `num_hits` blocks is shorter. Another group cached that longer prefix; the sparse group
        that cut it short caches the tail ending there (`pagedkv.spec.retention`), so the next
        request sharing it hits. That first hit is found as the common hit finds it first:
        within the lookup, or with EAGLE for EAGLE within one block more and less its last."""
        lead = next(
            (g for g, manager in enumerate(self.managers) if not manager.allows_null_blocks), 0
        )
        groups = [g for g, spec in enumerate(self.specs) if spec == self.specs[lead]]
        if self.use_eagle:
            limit = min(num_lookup + 1, len(block_hashes))
            found = len(self._unit_hit(groups, block_hashes[:limit], for_eagle=True)[0])
            found = max(found - 1, 0)
        else:
            found = len(self._unit_hit(groups, block_hashes[:num_lookup], for_eagle=False)[0])
        return found * self.block_size if found > num_hits else 0

    def take_evict_counts(self) -> Counter[str]:
        """What `evict_blocks` led to since the last call, renewed."""
        counts, self.evict_counts = self.evict_counts, Counter()
        return counts

    def take_retention_counts(self) -> Counter[str]:
        """What sparse retention did since the last call, renewed."""
        counts, self.retention_counts = self.retention_counts, Counter()
        return counts

    def _count_retention_hit(self, hits: GroupBlocks, lookup: Sequence[BlockHashType]) -> None:
        """Count what sparse retention did to a lookup: a hit in a sliding-window group whose
        last block was cached as a replay boundary's tail; a group whose hit would have been
        longer had the blocks retention left out been cached."""
        sparse = [
            group
            for group, manager in enumerate(self.managers)
            if manager.retention_interval is not None and manager.allows_null_blocks
        ]
        if not sparse:
            return
        counts = self.retention_counts
        if hits[0]:
            counts["retention: hits under sparse retention"] += 1
            if any(hits[g][-1] in self.managers[g].at_replay_boundary for g in sparse):
                counts["retention: hits at a replay boundary"] += 1
        for group in sparse:
            manager = self.managers[group]
            would_be = {key: block_id for block_id, key in manager.left_out.items()}

            def lookup_dense(
                block_hash: BlockHashType,
                group: int = group,
                would_be: dict[CacheKey, int] = would_be,
            ) -> int | None:
                key = cache_key(block_hash, group)
                found = self.pool.get_cached_block_unchecked(key)
                return found if found is not None else would_be.get(key)

            actual = self._group_hit(group, lookup, self.eagle_lookup)
            dense = manager.longest_hit(lookup_dense, lookup, self.eagle_lookup)
            if len(dense) > len(actual):
                counts["retention: hits cut short by blocks not retained"] += 1
                return

    def unitary_hit(self, block_hashes: Sequence[BlockHashType]) -> list[int]:
        """One group's hit (vLLM 0.33's unitary coordinator): its longest hit within
        `block_hashes`, found for EAGLE with `eagle_lookup`; with use_eagle a non-empty hit
        loses its last block, so that a sliding window keeps a whole window."""
        hits = self._group_hit(0, block_hashes, self.eagle_lookup)
        return hits[:-1] if self.use_eagle and hits else hits

    def longest_common_hit(self, block_hashes: Sequence[BlockHashType]) -> GroupBlocks:
        """Each group's hit at the longest length every group allows (module docstring)."""
        length = self.trace_common_hit(block_hashes).length
        hits = tuple(self._group_hit(g, block_hashes[:length]) for g in range(self.num_groups))
        assert all(len(hit) == length for hit in hits), "a fixed point: every group allows it"
        return hits

    def trace_common_hit(self, block_hashes: Sequence[BlockHashType]) -> HitTrace:
        """How the common hit within `block_hashes` is found: passes over the groups (full
        attention first), each group shortening the length to its longest hit within it, until
        a pass shortens nothing. Reads the pool only."""
        order = sorted(
            range(self.num_groups), key=lambda group: self.managers[group].allows_null_blocks
        )
        alone = tuple(len(self._group_hit(g, block_hashes)) for g in range(self.num_groups))
        length, passes, undercut = len(block_hashes), 0, False
        while True:
            passes += 1
            shortened, windowed_accepted = length, None
            for group in order:
                shortened = min(shortened, len(self._group_hit(group, block_hashes[:shortened])))
                if windowed_accepted is not None and shortened < windowed_accepted:
                    undercut = True
                if self.managers[group].allows_null_blocks:
                    windowed_accepted = shortened
            if shortened == length:
                return HitTrace(alone, length, passes, undercut)
            length = shortened

    def eagle_common_hit(
        self, num_lookup: int, block_hashes: Sequence[BlockHashType]
    ) -> GroupBlocks:
        """The hit of several groups with use_eagle, found as vLLM 0.33's coordinator finds it
        (a procedure: its answer depends on the order of its steps, so it is stated as those
        steps).

        Groups of equal specs form one unit, looked up together (a position is cached for the
        unit only if it is in every one of its groups); full-attention units go first. The
        length starts at `num_lookup` blocks (the lookup without EAGLE). Passes go over the
        units until one shortens nothing (with one full-attention unit and one other, a single
        pass): a full-attention unit asked before is only cut to the length; a unit not yet
        asked at this length ("unverified") finds its hit for EAGLE (`for_eagle`) within one
        block more than the length (at most the request's full blocks, `block_hashes`) and
        drops that hit's last block: a sliding window keeps a whole window of cached blocks; a
        verified unit finds its own hit within the length, and if it shortens the length every
        unit is unverified again. Full-attention groups are cut to the final length; the others
        keep their last hit, which has that length.

        Args:
            num_lookup: the blocks a lookup without EAGLE covers.
            block_hashes: the request's stored hashes (every full block's under vLLM 0.33).
        """
        units: list[list[int]] = []
        for group, spec in enumerate(self.specs):
            member_of = [unit for unit in units if self.specs[unit[0]] == spec]
            if member_of:
                member_of[0].append(group)
            else:
                units.append([group])
        units.sort(key=lambda unit: self.managers[unit[0]].allows_null_blocks)
        full = [not self.managers[unit[0]].allows_null_blocks for unit in units]
        single_pass = len(units) == 2 and full[0]
        found: dict[int, list[list[int]]] = {}
        verified: set[int] = set()
        length = num_lookup
        while True:
            current = length
            for index, groups in enumerate(units):
                if full[index] and index in found:
                    current = min(current, len(found[index][0]))
                    continue
                if index not in verified:
                    limit = min(current + 1, len(block_hashes))
                    hits = self._unit_hit(groups, block_hashes[:limit], for_eagle=True)
                    hits = [group_hits[:-1] for group_hits in hits] if hits[0] else hits
                    verified.add(index)
                else:
                    hits = self._unit_hit(groups, block_hashes[:current], for_eagle=False)
                    if len(hits[0]) < current:
                        verified.clear()
                current = len(hits[0])
                found[index] = hits
            if current >= length or single_pass:
                length = current
                break
            length = current
        result: list[list[int]] = [[] for _ in self.managers]
        for index, groups in enumerate(units):
            for group, group_hits in zip(groups, found[index], strict=True):
                result[group] = group_hits[:length] if full[index] else group_hits
        return tuple(result)

    def _unit_hit(
        self, groups: Sequence[int], block_hashes: Sequence[BlockHashType], *, for_eagle: bool
    ) -> list[list[int]]:
        """The first group's attention's hit within `block_hashes` for groups looked up
        together: a position is cached if every group caches it; each group's own blocks, in
        group order."""

        def cached_in_every_group(block_hash: BlockHashType) -> int | None:
            found = [
                self.pool.get_cached_block_unchecked(cache_key(block_hash, group))
                for group in groups
            ]
            return found[0] if None not in found else None

        hit = self.managers[groups[0]].longest_hit(cached_in_every_group, block_hashes, for_eagle)
        nulls = len(list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hit)))
        result = []
        for group in groups:
            cached = [
                self.pool.get_cached_block_unchecked(cache_key(block_hash, group))
                for block_hash in block_hashes[nulls : len(hit)]
            ]
            result.append([NULL_BLOCK_ID] * nulls + [b for b in cached if b is not None])
        return result

    def _group_hit(
        self, group: int, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        def lookup(block_hash: BlockHashType) -> int | None:
            return self.pool.get_cached_block_unchecked(cache_key(block_hash, group))

        return self.managers[group].longest_hit(lookup, block_hashes, for_eagle)

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """Reserve slots for `num_tokens` scheduled tokens in every group; None when they do
        not fit in the pool, every group counted together, or (`full_sequence_must_fit`, the
        admission gate of vLLM 0.33's scheduler) when the whole request would not.

        `num_external_computed_tokens` (a KV connector's, vLLM 0.33): tokens after the hits
        whose KV a connector loads into blocks this call takes (the spec's ghost KV takes the
        connector at its word: they hold the request's KV from here on). `delay_cache_blocks`
        (an async load): cache nothing now; the caller calls `cache_blocks` when the load lands.

        Preconditions, in order:
          1. `check_allocation`: a Request; num_tokens an int >= 0; num_lookahead_tokens an
             int >= 0; full_sequence_must_fit a bool; num_external_computed_tokens an int >= 0;
             delay_cache_blocks a bool; the request's num_computed_tokens an int and
             spec_token_ids a list; the hits None or one iterable of block ids per group
             (ArgumentTypeError, InvalidArgumentError);
          2. num_tokens 0 only with hits or external tokens (InvalidArgumentError);
          3. no more speculative tokens than num_tokens (InvalidArgumentError);
          4. the id names no other Request object (RequestError);
          5. 0 <= num_computed_tokens <= blocks held per group * B (RequestError);
          6. external tokens only for a request that holds no blocks and has no computed
             tokens (RequestError), and no Mamba group (InvalidArgumentError);
          7. if there are hits: caching is on (InvalidArgumentError); the request holds no
             blocks and has no computed tokens; every group has as many hits (several block
             sizes with caching: hits covering as many tokens); there are no more hits than
             stored hashes (RequestError); then group by group, each hit, in order,
             is a block of the pool (BlockStateError), is the null block only if the group's
             attention allows null blocks (BlockStateError), and unless it is the null block
             is cached in the group under the request's stored hash at its position
             (RequestError); the group's hits have a shape its attention can produce when
             found with `eagle_lookup`, less the last block with use_eagle (RequestError);
          8. computed tokens after the step (hits and external tokens included, speculative
             ones excluded) do not exceed the request's tokens (InvalidArgumentError); with a
             Mamba group in mode "align", no more speculative tokens than its speculative
             blocks (InvalidArgumentError: each draft's state takes one), and a step starting
             inside one of its blocks ends its tokens (drafts excluded) by that block's end
             (RequestError: the state it leaves would be keyed at the boundary it crossed);
          9. the blocks required, lookahead included, do not exceed cdiv(max_model_len, B)
             (MaxModelLenExceededError; under vLLM 0.8.5's `cap_at_max_model_len` only when
             nothing could be added);
          10. with caching, full blocks after the step are at least the blocks already cached
             (RequestError).

        Then: with `full_sequence_must_fit`, `_whole_request_fits`, or None with nothing
        changed; `_drop_skipped_blocks` (even if the request then does not fit); `_fits`, or
        None; `_grow`, which returns the new blocks of each group (not the blocks the external
        tokens fill: vLLM 0.33 returns them only in the request's table; a Mamba group in mode
        "align": the columns its table grew by, null blocks included, as vLLM 0.33 returns
        them). A hit whose Mamba state was keyed since the last `new_step_starts` does not
        fit (None) in either count, as vLLM 0.33's.
        """
        hits = check_allocation(
            request,
            num_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            self.num_groups,
            full_sequence_must_fit,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        step = self._allocation_step(
            request,
            num_tokens,
            hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        self.truth.drafts_settled(request)  # the last step's accepted drafts are known
        if full_sequence_must_fit and not self._whole_request_fits(request, step):
            return None
        self._drop_skipped_blocks(request)
        if not self._fits(request, step.hits, step.num_required):
            return None
        return self._grow(request, step)

    def _allocation_step(
        self,
        request: Request,
        num_tokens: int,
        hits: GroupBlocks,
        num_lookahead_tokens: int,
        num_external: int = 0,
        delay_cache: bool = False,
    ) -> Step:
        """Preconditions 2-10 of `allocate_slots`; the step they allow. Changes nothing."""
        request_id = request.request_id
        if num_tokens == 0 and not num_external and not any(hits):
            raise refusals.nothing_to_allocate(request_id)
        num_spec = len(request.spec_token_ids)
        if num_spec > num_tokens:
            raise refusals.more_drafts_than_scheduled(request_id, num_spec, num_tokens)
        self._require_same_request(request)
        held = [len(manager.blocks.get(request_id, [])) for manager in self.managers]
        num_held = held[0]
        for group, (manager, group_held) in enumerate(zip(self.managers, held, strict=True)):
            if request.num_computed_tokens not in range(manager.num_slots(group_held) + 1):
                raise refusals.computed_outside_slots(
                    request_id,
                    request.num_computed_tokens,
                    max(group_held - manager.extra_blocks, 0),
                    manager.block_size,
                    group if self.mixed_sizes else None,
                )
        if num_external:
            if num_held or request.num_computed_tokens:
                raise refusals.external_for_running_request(request_id, num_external)
            for group, manager in enumerate(self.managers):
                if isinstance(manager.spec, MambaSpec):
                    raise refusals.external_with_mamba(request_id, group)
        if any(group_hits for group_hits in hits):
            self._require_hits(request, num_held, hits)
        num_hits = len(hits[0])
        hit_tokens = num_hits * self.managers[0].block_size  # one block size: num_hits * B
        computed = request.num_computed_tokens + hit_tokens + num_external
        if computed + num_tokens - num_spec > request.num_tokens:
            raise refusals.more_tokens_than_request(
                request_id, computed + num_tokens - num_spec, request.num_tokens
            )
        state_groups = [g for g, manager in enumerate(self.managers) if manager.holds_state]
        for group in state_groups:
            if num_spec > self.managers[group].extra_blocks:
                raise refusals.mamba_align_speculation(
                    request_id, group, num_spec, self.managers[group].extra_blocks
                )
            size = self.managers[group].block_size
            main = computed + num_tokens - num_spec  # drafts past a boundary: the worker copies
            if computed % size and main > ceil_div(computed, size) * size:
                raise refusals.mamba_unaligned_chunk(request_id, group, computed, main, size)
        slots = computed + num_tokens + num_lookahead_tokens
        # A state group ignores lookahead slots (vLLM 0.33's `num_tokens_main_model`).
        required = tuple(
            manager.num_required(computed + num_tokens if manager.holds_state else slots)
            for manager in self.managers
        )
        could_grow = num_held + num_hits < self.max_blocks[0]
        capped = self.semantics.cap_at_max_model_len and could_grow  # vLLM allocates fewer
        for group, (manager, group_required) in enumerate(
            zip(self.managers, required, strict=True)
        ):
            if group_required > self.max_blocks[group] and not capped:
                raise refusals.past_max_model_len(
                    request_id,
                    group_required,
                    self.max_blocks[group],
                    self.max_model_len,
                    manager.block_size,
                    group if self.mixed_sizes else None,
                )
        cache_tokens = None
        if self.mixed_cached:
            cache_tokens = self._aligned(computed + num_tokens - num_spec)
            full = cache_tokens // self.managers[0].block_size
        else:
            full = num_full_blocks(computed, num_tokens, num_spec, self.block_size)
        cached = self.num_cached.get(request_id, num_hits)
        if self.enable_caching and full < cached:
            raise refusals.cached_blocks_lost(request_id, full, cached)
        if num_external:
            hits = tuple(
                self.adopted_prefix(manager, group_hits, computed)
                for manager, group_hits in zip(self.managers, hits, strict=True)
            )
        return Step(
            hits,
            required,
            full,
            cached,
            computed,
            num_tokens,
            num_external,
            delay_cache,
            cache_tokens,
        )

    @staticmethod
    def adopted_prefix(
        manager: SpecSingleTypeManager, hits: Sequence[int], num_computed: int
    ) -> list[int]:
        """The prefix a group adopts when external tokens take the request to `num_computed`
        tokens: null blocks at the positions the token there no longer reads (hits there are
        left as they are, untouched), then the rest of the hits."""
        skipped = manager.num_skipped(num_computed)
        return [NULL_BLOCK_ID] * skipped + list(hits[skipped:])

    def _require_hits(self, request: Request, num_held: int, hits: GroupBlocks) -> None:
        """Precondition 5: the hits are what `get_computed_blocks` could have returned."""
        request_id = request.request_id
        if not self.enable_caching:
            raise refusals.hits_without_caching(request_id)
        if num_held or request.num_computed_tokens:
            raise refusals.hits_for_running_request(request_id)
        lengths = [len(group_hits) for group_hits in hits]
        stored = self.hashes.get(request_id, [])
        if self.mixed_cached:
            tokens = [
                len(group_hits) * m.block_size
                for m, group_hits in zip(self.managers, hits, strict=True)
            ]
            if len(set(tokens)) != 1:
                raise refusals.hits_of_unequal_tokens(request_id, tokens)
            if tokens[0] // self.hash_block_size > len(stored):
                raise refusals.more_hits_than_hashes(
                    request_id, tokens[0] // self.hash_block_size, len(stored)
                )
        else:
            if len(set(lengths)) != 1:
                raise refusals.hits_of_unequal_length(request_id, lengths)
            if lengths[0] > len(stored):
                raise refusals.more_hits_than_hashes(request_id, lengths[0], len(stored))
        for group, (manager, group_hits) in enumerate(zip(self.managers, hits, strict=True)):
            keys = self.group_keys(group, stored)
            for position, block_id in enumerate(group_hits):
                if block_id not in range(self.pool.num_gpu_blocks):
                    raise refusals.foreign_block(block_id)
                if block_id == NULL_BLOCK_ID:
                    if not manager.allows_null_blocks:
                        raise refusals.null_hit(block_id)
                elif self.pool.block_hash[block_id] != cache_key(keys[position], group):
                    raise refusals.hit_not_cached(request_id, block_id, position)
            shape_error = manager.hit_shape_error(group_hits, self.use_eagle, self.eagle_lookup)
            if shape_error is not None:
                raise refusals.hit_shape(request_id, shape_error)

    def _drop_skipped_blocks(self, request: Request) -> None:
        """Group by group, the positions the next token no longer reads hold the null block;
        the blocks they held are freed, the newest first."""
        for manager in self.managers:
            manager.drop_skipped_blocks(request.request_id, request.num_computed_tokens)

    def _whole_request_fits(self, request: Request, step: Step) -> bool:
        """The full-sequence gate, before anything changes (skipped blocks still held): the
        blocks every group lacks for all the request's tokens (at most max_model_len; no
        lookahead, no drafts), each group's count at most its `admission_cap`, fit as `_fits`
        counts them. A chunked prefill is admitted only if its whole prompt will fit."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        required = tuple(
            manager.num_required(num_tokens)
            if cap is None
            else min(manager.num_required(num_tokens), cap)
            for manager, cap in zip(self.managers, self.admission_caps, strict=True)
        )
        return self._fits(request, step.hits, required)

    def _fits(self, request: Request, hits: GroupBlocks, num_required: Sequence[int]) -> bool:
        """The blocks still missing in every group (each needing `num_required`, each adopting
        its `hits`; a Mamba group in mode "align" one at most, `num_missing`) fit, together,
        in the free blocks the hits leave: a hit at ref_cnt 0 leaves the free queue when
        touched (a null hit only under vLLM 0.8.5's `capacity_counts_null_blocks`). Never
        when a group defers its hits to the next scheduler step (`defers`)."""
        if any(
            manager.defers(group_hits)
            for manager, group_hits in zip(self.managers, hits, strict=True)
        ):
            return False
        missing = sum(
            max(manager.num_missing_for(request.request_id, required, len(group_hits)), 0)
            for manager, required, group_hits in zip(self.managers, num_required, hits, strict=True)
        )
        free_hits = [
            block_id
            for group_hits in hits
            for block_id in group_hits
            if self.pool.ref_cnt[block_id] == 0
            and (block_id != NULL_BLOCK_ID or self.semantics.capacity_counts_null_blocks)
        ]
        return fits(missing, self.pool.get_num_free_blocks(), len(free_hits))

    def _grow(self, request: Request, step: Step) -> GroupBlocks:
        """The state after a step that fits: the hits of every group get one more reference
        each (every group's before any group's new blocks); each group's list holds its blocks,
        then its hits, then (external tokens: group by group, before any group's new blocks)
        the blocks the external tokens fill, then (group by group) the missing blocks from the
        head of the free queue (as many as max_model_len leaves room for), and with caching,
        unless delayed, its blocks [cached, full) are cached and `num_full` positions count as
        cached (delayed: the positions of its hits)."""
        request_id = request.request_id
        self.truth.load_ended(request_id)  # a step after an async load: it landed
        if self.enable_caching:
            for group_hits in step.hits:
                self.pool.touch_unchecked(group_hits)
        for manager, group_hits in zip(self.managers, step.hits, strict=True):
            manager.add_hits(request_id, group_hits)
            if step.num_external or group_hits:
                # vLLM 0.33 counts an adopted prefix as cached, even with caching off.
                manager.num_cached.setdefault(request_id, len(group_hits))
        if self.mixed_cached:  # stored hashes cover the positions counted as cached
            covered = max(m.num_cached.get(request_id, 0) * m.block_size for m in self.managers)
            self._extend_chain(request, self.hashes.setdefault(request_id, []), covered)
        if step.num_external:
            for group, manager in enumerate(self.managers):
                num_blocks = len(manager.blocks[request_id])
                missing = manager.num_required(step.num_computed) - num_blocks
                room = self.max_blocks[group] - num_blocks
                num_free = self.pool.get_num_free_blocks()
                taken = manager.take_new_blocks(request_id, max(min(missing, num_free, room), 0))
                self.truth.handed_out(taken)
                for other in self.managers:
                    other.handed_out(taken)
        num_free = self.pool.get_num_free_blocks()
        num_new = []
        groups = zip(self.managers, step.num_required, strict=True)
        for group, (manager, required) in enumerate(groups):
            num_blocks = len(manager.blocks[request_id])
            room = self.max_blocks[group] - num_blocks
            missing = num_new_blocks(required, num_blocks, 0)
            num_new.append(max(min(missing, num_free, room), 0))
        num_recorded = len(self.hashes.get(request_id, []))
        new_blocks: list[list[int]] = []
        junction = self.junction.get(request_id, 0)
        for group, (manager, group_new) in enumerate(zip(self.managers, num_new, strict=True)):
            taken = manager.take_new_blocks(request_id, group_new)
            real = [block_id for block_id in taken if block_id != NULL_BLOCK_ID]
            self.truth.handed_out(real)
            for other in self.managers:
                other.handed_out(real)
            new_blocks.append(taken)
            if self.enable_caching and not step.delay_cache:
                stored = self.hashes.setdefault(request_id, [])
                if step.cache_tokens is not None:  # several block sizes: the group's view
                    # Stored hashes cover the cached positions, adopted null ones included.
                    counted = manager.num_cached.get(request_id, len(step.hits[group]))
                    self._extend_chain(
                        request, stored, max(step.cache_tokens, counted * manager.block_size)
                    )
                    left_out = manager.cache_blocks(
                        request,
                        self.group_keys(group, stored),
                        len(step.hits[group]),
                        step.cache_tokens // manager.block_size,
                        self.hash_fn,
                        junction,
                    )
                    self._cache_partial_tail(request, group, step.cache_tokens)
                else:
                    num_cached = step.num_cached if not step.num_external else len(step.hits[group])
                    left_out = manager.cache_blocks(
                        request, stored, num_cached, step.num_full, self.hash_fn, junction
                    )
                if left_out:
                    self.retention_counts["retention: blocks left uncached"] += len(left_out)
        self.requests[request_id] = request
        tables = tuple(manager.blocks[request_id] for manager in self.managers)
        if step.num_external:
            # The connector's load: the external tokens' KV, computed elsewhere.
            local = step.num_computed - step.num_external
            self.truth.loaded(request, tables, local, step.num_external)
            self.truth.checks["attention truth: external tokens loaded"] += step.num_external
            if step.delay_cache:
                self.truth.load_started(request_id, tables, local, step.num_external)
        self.truth.check_step(request, tables, step.num_computed)
        self.truth.computed(request, tables, step.num_computed, step.num_tokens)
        if self.enable_caching and not step.delay_cache:
            self._record_parents(self.hashes[request_id], num_recorded)
            if step.num_full > step.num_cached and any(
                entry[1] < step.num_cached for entry in self.evicted.get(request_id, ())
            ):
                self.evict_counts["evict_blocks: blocks cached past an evicted one"] += 1
        return tuple(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache, in every group, the request's full blocks within its first
        `num_computed_tokens` tokens that are not cached yet (vLLM 0.33's
        `KVCacheManager.cache_blocks`: its scheduler calls it after a step whose accepted draft
        tokens filled a block, a KV connector when an async load lands). As `allocate_slots`
        caches: under the stored hashes, a sparse window group what retention keeps. Nothing
        with caching off, nor when no more blocks are full than are cached.

        Preconditions, in order: `check_cache_blocks` (ArgumentTypeError,
        InvalidArgumentError); the id names no other Request object; then, with caching, the
        request holds blocks; its num_computed_tokens lies within its slots in every group;
        `num_computed_tokens` is at most its computed tokens and its tokens (RequestError): a
        hash over KV not yet written would serve a later request garbage.
        """
        check_cache_blocks(request, num_computed_tokens)
        self._require_same_request(request)
        request_id = request.request_id
        if not self.enable_caching:
            self.truth.load_ended(request_id)  # vLLM 0.33 calls it when a load lands
            return
        held = self.held(request_id)
        if held is None:
            raise refusals.cache_without_blocks(request_id)
        for manager, blocks in zip(self.managers, held, strict=True):
            if request.num_computed_tokens not in range(manager.num_slots(len(blocks)) + 1):
                raise refusals.computed_outside_slots(
                    request_id, request.num_computed_tokens, len(blocks), manager.block_size
                )
        self.truth.load_ended(request_id)
        computed = min(request.num_computed_tokens, request.num_tokens)
        if num_computed_tokens > computed:
            raise refusals.cache_past_computed(request_id, num_computed_tokens, computed)
        self.truth.drafts_settled(request)
        if self.mixed_cached:
            self._mixed_cache_blocks(request, num_computed_tokens)
            return
        num_full = num_computed_tokens // self.block_size
        if not any(manager.holds_state for manager in self.managers) and all(
            num_full <= manager.num_cached.get(request_id, 0) for manager in self.managers
        ):
            return  # (a Mamba group in mode "align" may key its replay state again)
        num_cached = self.num_cached.get(request_id, 0)
        stored = self.hashes.setdefault(request_id, [])
        num_recorded = len(stored)
        junction = self.junction.get(request_id, 0)
        for manager in self.managers:
            left_out = manager.cache_blocks(
                request, stored, num_cached, num_full, self.hash_fn, junction
            )
            if left_out:
                self.retention_counts["retention: blocks left uncached"] += len(left_out)
        self._record_parents(stored, num_recorded)

    def external_load_failed(self, request: Request, num_valid_tokens: int) -> None:
        """Ghost state only (a connector's report, for the attention-truth check): the load
        into the request's blocks failed from `num_valid_tokens` on (a multiple of B), so its
        blocks from there hold garbage until the request recomputes into them. A caller that
        then caches past it, or a step that reads there before recomputing, is caught.

        Preconditions: the request holds blocks; `num_valid_tokens` is a multiple of B within
        its slots (InvalidArgumentError, RequestError).
        """
        request_id = request.request_id
        held = self.held(request_id)
        if held is None:
            raise refusals.cache_without_blocks(request_id)
        if num_valid_tokens % self.block_size or num_valid_tokens not in range(
            self.managers[0].num_slots(len(held[0])) + 1
        ):
            raise InvalidArgumentError(
                f"request {request_id!r}: a failed load's valid tokens must be a multiple of "
                f"{self.block_size} within its slots, got {num_valid_tokens}"
            )
        self.truth.load_failed(request, held, num_valid_tokens)

    def external_load_finished(self, request: Request) -> None:
        """Ghost state only (a connector's report, vLLM's `finished_recving`): the async load
        into the request's blocks is over, so blocks it freed meanwhile may be reused. A
        caller that frees a request whose load is still in flight must report this before any
        of those blocks is handed out again (`attention_truth.BLOCK_RELEASED`); landing
        (`cache_blocks`, or the request's next allocation) and `external_load_failed` report
        it too. A request with no load in flight: nothing happens.

        Preconditions: a Request (ArgumentTypeError).
        """
        check_request("external_load_finished", request)
        self.truth.load_ended(request.request_id)

    def external_send_started(self, request: Request) -> None:
        """Ghost state only (vLLM: `request_finished` returned True, the connector still reads
        the finished request's blocks to send its KV): until `external_send_finished`, blocks
        it frees must not be handed out again (`attention_truth.BLOCK_RELEASED`). A request
        holding no blocks: nothing to read.

        Preconditions: a Request (ArgumentTypeError).
        """
        check_request("external_send_started", request)
        held = self.held(request.request_id)
        if held is not None:
            self.truth.send_started(request.request_id, held)

    def external_send_finished(self, request: Request) -> None:
        """Ghost state only (vLLM's `finished_sending`): the send is over; blocks the request
        freed may be reused. A request with no send in flight: nothing happens.

        Preconditions: a Request (ArgumentTypeError).
        """
        check_request("external_send_finished", request)
        self.truth.send_ended(request.request_id)

    # -- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Free the request's blocks group by group, each group's last first when caching, else
        in order (last first as well under `free_tail_first_without_caching`). Its stored hashes
        stay. Unknown request: nothing happens.

        Preconditions: a Request (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_request("free", request)
        self._require_same_request(request)
        tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
        for manager in self.managers:
            manager.free(request.request_id, tail_first)
        self.evicted.pop(request.request_id, None)
        self.truth.freed(request.request_id)
        self._forget_if_done(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> GroupBlocks:
        """Hand the request's blocks to a deferred free (vLLM 0.33's, under `defer_block_free`:
        a forward pass still in flight may read them). The request is gone as after `free`,
        but each block keeps its reference, so none is reused, until `free_popped_blocks`
        releases the batch. Returns each group's blocks less its leading null blocks; a request
        holding no block: empty lists, and no batch to free.

        Preconditions: as `free`.
        """
        check_request("pop_blocks_for_free", request)
        self._require_same_request(request)
        request_id = request.request_id
        popped = tuple(manager.pop(request_id) for manager in self.managers)
        if any(popped):
            evicted = frozenset(entry[2] for entry in self.evicted.get(request_id, ()))
            self.popped.append(PoppedBatch(tuple(map(tuple, popped)), evicted))
        self.evicted.pop(request_id, None)
        self.truth.freed(request_id)
        self._forget_if_done(request_id)
        return popped

    def free_popped_blocks(self, popped: Sequence[Sequence[int]]) -> None:
        """Release a batch `pop_blocks_for_free` returned, exactly once, in the order `free`
        would have freed it: group by group, each group's last first (without caching, in
        order unless `free_tail_first_without_caching`). Under `deferred_free_flattened` (vLLM
        0.33's drain, #48489): one call over every group's blocks, the last group's last
        first. A batch of empty lists: nothing happens.

        Preconditions: one iterable of block ids per group (ArgumentTypeError); a batch popped
        and not yet freed, as returned (BlockStateError).
        """
        groups = check_popped_blocks(popped, self.num_groups)
        if not any(groups):
            return
        key = tuple(map(tuple, groups))
        index = next((i for i, batch in enumerate(self.popped) if batch.blocks == key), None)
        if index is None:
            raise refusals.popped_blocks_unknown(groups)
        del self.popped[index]
        if self.semantics.deferred_free_flattened:
            self.pool.free_blocks_unchecked([b for blocks in groups for b in blocks][::-1])
            return
        tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
        for blocks in groups:
            self.pool.free_blocks_unchecked(blocks[::-1] if tail_first else blocks)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the stored hashes of a finished request.

        Preconditions: a Request (ArgumentTypeError); the id names no other Request object; the
        request holds no blocks (its cached blocks need their stored hashes) (RequestError).
        """
        check_request("free_block_hashes", request)
        self._require_same_request(request)
        if request.request_id in self.managers[0].blocks:
            raise refusals.hashes_dropped_while_held(request.request_id)
        self.hashes.pop(request.request_id, None)
        self._forget_if_done(request.request_id)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """The pool's `evict_blocks` (vLLM 0.33's `KVCacheManager.evict_blocks`, a KV
        connector's call for blocks whose load failed): each listed block loses its hash and
        stays held, or queued, where it is. The requests holding one keep their count of cached
        positions, so they never cache it again; a later lookup stops where it was.

        Preconditions: as `SpecBlockPool.evict_blocks` (ArgumentTypeError, BlockStateError),
        all checked before anything changes.
        """
        dropped = self.pool.evict_blocks_unchecked(
            require_block_ids("KVCacheManager.evict_blocks", "block_ids", block_ids)
        )
        if not dropped:
            return
        self.evicted_keys.update(key for _, key in dropped)
        lost = {block_id for block_id, _ in dropped}
        for group, manager in enumerate(self.managers):
            for request_id, held in manager.blocks.items():
                for position, block_id in enumerate(held):
                    if block_id in lost:
                        self.evicted.setdefault(request_id, set()).add((group, position, block_id))

    def attach_offload_tier(self, tier: SpecOffloadTier | None) -> None:
        """The CPU offload tier behind this manager's KV connector (None: none): the caller
        (the connector) stores and loads its chunks; `reset_prefix_cache` clears it with the
        GPU pool.

        Preconditions: `tier` is a `SpecOffloadTier` or None (ArgumentTypeError).
        """
        if tier is not None and not isinstance(tier, SpecOffloadTier):
            raise ArgumentTypeError(
                f"KVCacheManager.attach_offload_tier: tier must be an OffloadTier or None, "
                f"got {type(tier).__name__}"
            )
        self.offload_tier = tier

    def offload_stored(self, stored: Sequence[tuple[bytes, int]]) -> None:
        """Ghost state only (the connector's report): each (key, block id) is a chunk whose
        store `prepare_store` started, copying what the GPU block holds now."""
        for key, block_id in stored:
            self.truth.tier_stored(key, block_id)

    def offload_dropped(self, keys: Iterable[bytes]) -> None:
        """Ghost state only: the tier dropped these chunks (evicted, or their store failed)."""
        self.truth.tier_dropped(keys)

    def offload_load_next(self, request: Request, sources: Mapping[tuple[int, int], bytes]) -> None:
        """Ghost state only (the connector's word): the request's next allocation adopting
        external tokens loads, into its block at each (group, position), the tier chunk named
        there: its block then holds what the chunk's store copied, which the attention-truth
        check holds to what the request reads."""
        check_request("offload_load_next", request)
        self.truth.load_from_tier(request.request_id, dict(sources))

    def reset_prefix_cache(self) -> bool:
        """The pool's reset, and with it the CPU offload tier's (`attach_offload_tier`): both
        tiers or neither. A successful reset is recorded in the stats and stands for new
        weights: KV computed before it is never read after it (`attention_truth.STALE_KV`)."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload_tier is not None:
            self.offload_tier.reset_cache()
            self.truth.tier.clear()
        self.truth.new_epoch()
        self.evicted_keys.clear()
        if self.stats is not None:
            self.stats.reset = True
        return True

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, the leading blocks of the request with ref_cnt == num_running_requests.

        Preconditions: `check_common_prefix` (ArgumentTypeError, InvalidArgumentError).
        """
        check_common_prefix(request, num_running_requests)
        return tuple(
            manager.num_common_prefix_blocks(request.request_id, num_running_requests)
            for manager in self.managers
        )

    # -- helpers -----------------------------------------------------------------------------

    def _chain(self, request: Request) -> list[BlockHashType]:
        """The hashes of the request's full blocks (`request_block_hashes`) at the hash block
        size H (B with one block size), keyed as the semantics keys multimodal inputs."""
        return request_block_hashes(
            self.hash_fn,
            self.hash_block_size,
            request,
            mm_position=not self.semantics.mm_keys_without_position,
        )

    # -- several block sizes with caching ------------------------------------------------------

    def group_keys(self, group: int, chain: Sequence[BlockHashType]) -> list[BlockHashType]:
        """Group `group`'s block hashes: for its block k, the chain hash at that block's end,
        `chain[(k + 1) * B_g / H - 1]` (vLLM 0.33's per-group view; with one block size the
        chain itself). It fingerprints the whole prefix, so no new hash is computed."""
        scale = self.managers[group].block_size // self.hash_block_size
        return list(chain[scale - 1 :: scale])

    def _aligned(self, num_tokens: int) -> int:
        """`num_tokens` rounded down to a multiple of S (where hits and cached prefixes end)."""
        return num_tokens - num_tokens % self.scheduler_block_size

    def _extend_chain(self, request: Request, stored: list[BlockHashType], num_tokens: int) -> None:
        """The stored chain covers the request's first `num_tokens` tokens (its H-chunks)."""
        needed, recorded = num_tokens // self.hash_block_size, len(stored)
        if recorded < needed:
            stored.extend(self._chain(request)[recorded:needed])
            self._record_parents(stored, recorded)

    def _mixed_lookup(
        self, request: Request, stored: list[BlockHashType]
    ) -> tuple[GroupBlocks, int]:
        """`get_computed_blocks` with several block sizes: the lookup covers the stored hashes
        of at most `num_tokens - 1` tokens, the hit is `mixed_common_hit`'s, in tokens."""
        request_id = request.request_id
        num_lookup = min(len(stored), (request.num_tokens - 1) // self.hash_block_size)
        lookup = stored[:num_lookup]
        length, hits = self.mixed_common_hit(lookup)
        self.junction[request_id] = self._mixed_junction(lookup, length)
        if self.junction[request_id] and self.retention_interval is not None:
            self.retention_counts["retention: lookups finding a shared-prefix junction"] += 1
        self.truth.check_hit(request, hits, length, eagle=False)
        if self.stats is not None:
            self.stats.queries += num_lookup
            self.stats.hits += length // self.hash_block_size
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += length
        return hits, length

    def mixed_common_hit(self, lookup: Sequence[BlockHashType]) -> tuple[int, GroupBlocks]:
        """The hit of groups of several block sizes within the chain `lookup`, in tokens, and
        each group's blocks (`length / B_g` of them): passes over the groups, full attention
        first, each cutting the length to its own longest hit within it rounded down to S,
        until a pass cuts nothing (vLLM 0.33's fixed point with `alignment_tokens = S`)."""
        order = sorted(
            range(self.num_groups), key=lambda group: self.managers[group].allows_null_blocks
        )
        length = len(lookup) * self.hash_block_size
        while True:
            shortened = length
            for group in order:
                shortened = min(shortened, self._aligned_hit(group, lookup, shortened))
            if shortened == length:
                break
            length = shortened
        hits = tuple(
            self._group_hit(g, self.group_keys(g, lookup)[: length // manager.block_size])
            for g, manager in enumerate(self.managers)
        )
        assert all(
            len(hit) * manager.block_size == length
            for hit, manager in zip(hits, self.managers, strict=True)
        ), "a fixed point: every group allows it"
        return length, hits

    def _aligned_hit(self, group: int, lookup: Sequence[BlockHashType], limit: int) -> int:
        """Group `group`'s longest hit within `limit` tokens of `lookup` that ends on a multiple
        of S, in tokens: full attention's cached prefix rounded down; a window's or chunk's
        longest hit, of S-token blocks, ends there already; a window of smaller blocks is asked
        at every multiple of S, longest first, until it allows one (it allows 0)."""
        manager = self.managers[group]
        block_size = manager.block_size
        keys = self.group_keys(group, lookup)[: limit // block_size]
        if not manager.allows_null_blocks or block_size == self.scheduler_block_size:
            return self._aligned(len(self._group_hit(group, keys)) * block_size)
        for length in range(self._aligned(limit), 0, -self.scheduler_block_size):
            num_blocks = length // block_size
            if len(self._group_hit(group, keys[:num_blocks])) == num_blocks:
                return length
        return 0

    def _mixed_junction(self, lookup: Sequence[BlockHashType], length: int) -> int:
        """`junction_of` with several block sizes, in tokens: the hit of the groups sharing the
        first full-attention group's spec, rounded down to S, where it is longer than the
        common hit of `length` tokens; else 0."""
        lead = next(
            (g for g, manager in enumerate(self.managers) if not manager.allows_null_blocks), 0
        )
        groups = [g for g, spec in enumerate(self.specs) if spec == self.specs[lead]]
        keys = self.group_keys(lead, lookup)
        found = self._aligned(
            len(self._unit_hit(groups, keys, for_eagle=False)[0]) * self.managers[lead].block_size
        )
        return found if found > length else 0

    def _mixed_cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """`cache_blocks` with several block sizes: every group caches its positions within
        the first `num_computed_tokens` tokens rounded down to S (a block of a group with
        B_g < S stays unhashed until the next S boundary)."""
        request_id = request.request_id
        cache_tokens = self._aligned(num_computed_tokens)
        if all(
            cache_tokens // manager.block_size <= manager.num_cached.get(request_id, 0)
            for manager in self.managers
        ):
            for group in range(self.num_groups):  # vLLM 0.33 asks for the partial key anyway
                self._cache_partial_tail(request, group, cache_tokens)
            return
        stored = self.hashes.setdefault(request_id, [])
        num_recorded = len(stored)
        self._extend_chain(request, stored, cache_tokens)
        junction = self.junction.get(request_id, 0)
        for group, manager in enumerate(self.managers):
            left_out = manager.cache_blocks(
                request,
                self.group_keys(group, stored),
                manager.num_cached.get(request_id, 0),
                cache_tokens // manager.block_size,
                self.hash_fn,
                junction,
            )
            if left_out:
                self.retention_counts["retention: blocks left uncached"] += len(left_out)
            self._cache_partial_tail(request, group, cache_tokens)
        self._record_parents(stored, num_recorded)

    def _cache_partial_tail(self, request: Request, group: int, cache_tokens: int) -> None:
        """Under `partial_prefix_keys`, after group `group` cached up to `cache_tokens`: a
        full-attention group whose block B_g exceeds H indexes the block holding token `b`, the
        prompt's last H boundary before its last token, under the chain hash at `b` too (a
        partial key), when `b` is positive, within `cache_tokens`, inside a block it holds and
        not at a block's end (vLLM 0.33's `_cache_partial_tail_block`, asked at every caching
        call). Its hash, already set, stays; the key serves no lookup here (only a Mamba
        "align" group's fine-grained lookups hit it)."""
        manager = self.managers[group]
        block_size, hash_size = manager.block_size, self.hash_block_size
        if not self.semantics.partial_prefix_keys or block_size == hash_size:
            return
        if not isinstance(manager, FullAttention):
            return
        boundary = (request.num_prompt_tokens - 1) // hash_size * hash_size
        boundary = min(boundary, request.num_tokens // hash_size * hash_size)
        if boundary == 0 or boundary > cache_tokens or boundary % block_size == 0:
            return
        held = manager.blocks[request.request_id]
        if boundary // block_size >= len(held):
            return
        stored = self.hashes[request.request_id]
        key = cache_key(stored[boundary // hash_size - 1], group)
        parent = stored[boundary // hash_size - 2].hash_value if boundary > hash_size else None
        self.pool.add_partial_key_unchecked(
            held[boundary // block_size], key, parent, request.lora_id
        )

    def _check_mixed_request(self, request_id: str, held: GroupBlocks) -> None:
        """With several block sizes and caching: every group has cached the same prefix, a
        multiple of S tokens, and no block past it carries a hash (delayed hashing)."""
        cached = [
            manager.num_cached.get(request_id, 0) * manager.block_size for manager in self.managers
        ]
        # External tokens may push a window's or chunk's hits out: its null positions then
        # count as cached too (vLLM 0.33), past the prefix the other groups cached.
        common = min(cached)
        beyond = [
            blocks[common // manager.block_size : manager.num_cached.get(request_id, 0)]
            for manager, blocks in zip(self.managers, held, strict=True)
        ]
        if common % self.scheduler_block_size or any(
            block_id != NULL_BLOCK_ID for extra in beyond for block_id in extra
        ):
            raise InvariantViolation(
                "with several block sizes, every group caches the same prefix, a multiple of "
                "the scheduler block size (null positions past it aside)",
                f"request {request_id!r}: {cached} tokens cached per group, "
                f"S = {self.scheduler_block_size}",
            )
        for group, (manager, blocks) in enumerate(zip(self.managers, held, strict=True)):
            for position in range(manager.num_cached.get(request_id, 0), len(blocks)):
                if self.pool.block_hash[blocks[position]] is not None:
                    raise InvariantViolation(
                        "with several block sizes, a request's blocks past its cached prefix "
                        "carry no hash",
                        f"request {request_id!r}, group {group}, position {position}, "
                        f"block {blocks[position]}",
                    )

    def _require_same_request(self, request: Request) -> None:
        if self.requests.get(request.request_id, request) is not request:
            raise refusals.id_in_use(request.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if request_id not in self.managers[0].blocks and request_id not in self.hashes:
            self.requests.pop(request_id, None)
            self.junction.pop(request_id, None)
            self.truth.forget(request_id)

    def _record_parents(self, chain: list[BlockHashType], start: int = 0) -> None:
        """Record the parent of each hash of `chain` from position `start` on (the ones before
        were recorded when they were stored: every stored hash is recorded as it is stored)."""
        for position in range(start, len(chain)):
            self.parent_of.setdefault(chain[position], chain[position - 1] if position else None)

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pool's invariants, then each request-level invariant, stated once.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
        """
        self.pool.check_invariants()
        holders_of = Counter(
            block_id
            for manager in self.managers
            for held in manager.blocks.values()
            for block_id in held
        )
        holders_of.update(b for batch in self.popped for blocks in batch.blocks for b in blocks)
        evicted = {entry[2] for lost in self.evicted.values() for entry in lost}
        evicted.update(block_id for batch in self.popped for block_id in batch.evicted)
        for block_id in range(1, self.pool.num_gpu_blocks):
            holders = holders_of.get(block_id, 0)
            if self.pool.ref_cnt[block_id] != holders:
                raise InvariantViolation(
                    "a block's ref_cnt is the number of requests holding it",
                    f"block {block_id}: ref_cnt {self.pool.ref_cnt[block_id]}, held {holders} "
                    f"(deferred frees included)",
                )
            if holders >= 2 and self.pool.block_hash[block_id] is None and block_id not in evicted:
                raise InvariantViolation(
                    "a block held by two requests is cached",
                    str(block_id),
                )
        for request_id in self.managers[0].blocks:
            tables = self._check_request(request_id)
            self.truth.check_table(self.requests[request_id], tables)
        tracked = self.managers[0].blocks.keys() | self.hashes.keys()
        anywhere = set().union(
            *(manager.blocks.keys() | manager.num_cached.keys() for manager in self.managers)
        )
        if self.requests.keys() != tracked or not anywhere <= tracked:
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes", repr(sorted(tracked))
            )
        if self.enable_caching:
            closed = [group for group, m in enumerate(self.managers) if m.prefix_closed]
            scales = {g: m.block_size // self.hash_block_size for g, m in enumerate(self.managers)}
            partial = {key for keys in self.pool.partial_keys.values() for key in keys}
            partial.update(
                key
                for key in (self.pool.block_hash[b] for b in self.pool.partial_hashed)
                if key is not None
            )
            check_prefix_closure(
                self.pool.index.keys() - partial, self.parent_of, closed, self.evicted_keys, scales
            )

    def _check_request(self, request_id: str) -> GroupBlocks:
        """The request's invariants in every group; its tables."""
        found = [manager.blocks.get(request_id) for manager in self.managers]
        lengths = [None if blocks is None else len(blocks) for blocks in found]
        # A state group ignores lookahead slots: its table covers no more than attention's.
        ranges = [
            manager.slot_range(length)
            for manager, length in zip(self.managers, lengths, strict=True)
            if length is not None and not manager.holds_state
        ]
        state_starts = [
            manager.slot_range(length).start
            for manager, length in zip(self.managers, lengths, strict=True)
            if length is not None and manager.holds_state
        ]
        if (
            None in lengths
            or max(r.start for r in ranges) >= min(r.stop for r in ranges)
            or any(start >= min(r.stop for r in ranges) for start in state_starts)
        ):
            raise InvariantViolation(
                "a request's block lists cover the same token slots in every group",
                f"request {request_id!r}: {lengths} blocks of "
                f"{[manager.block_size for manager in self.managers]} tokens",
            )
        held = tuple(blocks for blocks in found if blocks is not None)
        for group, (manager, blocks) in enumerate(zip(self.managers, held, strict=True)):
            if manager.holds_state:
                error = manager.layout_error(request_id)
                if error is not None:
                    raise InvariantViolation(
                        "a Mamba table holds its running state and at most its previous one",
                        f"request {request_id!r}, group {group}: {blocks}: {error}",
                    )
                continue
            nulls = [position for position, block_id in enumerate(blocks) if block_id == 0]
            if nulls and (not manager.allows_null_blocks or nulls != list(range(len(nulls)))):
                raise InvariantViolation(
                    "null blocks only as a prefix, and only under sliding window",
                    f"request {request_id!r}, group {group}: {blocks}",
                )
        if not self.semantics.cap_at_max_model_len and any(
            len(blocks) > most for blocks, most in zip(held, self.max_blocks, strict=True)
        ):
            raise InvariantViolation(
                "a request holds at most cdiv(max_model_len, block_size) blocks",
                repr(held),
            )
        if not self.enable_caching:
            return held
        request = self.requests[request_id]
        stored = self.hashes.get(request_id, [])
        if self.mixed_cached:
            self._check_mixed_request(request_id, held)
        for group, (manager, blocks) in enumerate(zip(self.managers, held, strict=True)):
            num_cached = manager.num_cached.get(request_id, 0)
            keys = self.group_keys(group, stored)
            if num_cached > min(request.num_tokens // manager.block_size, len(keys)):
                raise InvariantViolation(
                    "a request's cached blocks are full blocks with stored hashes",
                    f"request {request_id!r}, group {group}: {num_cached} cached, "
                    f"{len(keys)} stored hashes",
                )
            evicted = self.evicted.get(request_id, ())
            for position, block_id in enumerate(blocks[:num_cached]):
                key = cache_key(keys[position], group)
                if (group, position, block_id) in evicted:
                    continue  # evict_blocks took its hash (a partial key may stand in for it)
                if self.pool.block_hash[block_id] is None and (
                    manager.left_out.get(block_id) == key  # retention left it out
                ):
                    continue
                if block_id != NULL_BLOCK_ID and self.pool.block_hash[block_id] != key:
                    raise InvariantViolation(
                        "a request's cached block carries the hash its tokens chain to",
                        f"request {request_id!r}, group {group}, position {position}, "
                        f"block {block_id}",
                    )
        if self.semantics.vllm_new_block_mm_keys:
            return held  # vLLM 0.8.5 stores some hashes with other multimodal keys than the chain's
        chain = self._chain(request)
        if stored != chain[: len(stored)]:  # the stored hashes are a prefix of the chain
            raise InvariantViolation(
                "stored hashes are the chain of the request's tokens",
                f"request {request_id!r}: stored {stored}, its tokens chain to {chain}",
            )
        return held


def check_prefix_closure(
    index: Iterable[CacheKey],
    parent_of: dict[BlockHashType, BlockHashType | None],
    groups: Collection[int],
    evicted_keys: Collection[CacheKey] = (),
    scales: Mapping[int, int] | None = None,
) -> None:
    """In each of `groups` (full-attention groups: a request frees its blocks tail first), every
    cached hash's parent is cached too, `parent_of` being the ghost map of every chain's parents.
    With several block sizes the chain is at H and a group's block spans `scales[group]` (B_g /
    H) of its hashes: its parent is that many hashes up the chain.
    A key with an ancestor among `evicted_keys` (taken by `evict_blocks` since the last reset) is
    exempt: its request may still hold and cache blocks past the gap, and the order in which
    they and the gap's refilled blocks are freed is then anyone's.

    Raises:
        InvariantViolation: a cached key whose parent is not cached in its group.
    """
    keys = set(index)
    for key in keys:
        group = key_group(key)
        if group not in groups:
            continue
        parent = parent_of.get(key_hash(key))
        for _ in range((scales or {}).get(group, 1) - 1):
            parent = None if parent is None else parent_of.get(parent)
        if evicted_keys and _descends_from(parent, group, parent_of, evicted_keys):
            continue
        if parent is not None and cache_key(parent, group) not in keys:
            raise InvariantViolation(
                "prefix closure: a cached block's parent hash is cached",
                f"{key} is cached, its parent {parent} is not",
            )


def _descends_from(
    ancestor: BlockHashType | None,
    group: int,
    parent_of: dict[BlockHashType, BlockHashType | None],
    keys: Collection[CacheKey],
) -> bool:
    """Whether `ancestor` or a hash before it in its chain is, as group `group`'s key, in
    `keys`. Complexity: O(the chain's length)."""
    while ancestor is not None:
        if cache_key(ancestor, group) in keys:
            return True
        ancestor = parent_of.get(ancestor)
    return False
