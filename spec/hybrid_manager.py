"""The reference hybrid KV cache manager: several KV cache groups over one spec pool, in ids.

A hybrid model has layers of several attention types (full attention, sliding window, chunked
local), one KV cache group per type, each group keeping its own block table over the one pool:
a request holds one block list per group, position p of every list covering the same tokens.
Blocks are cached per group (index key `GroupKey(g, hash)`, plain `hash` for group 0) under the
request's one chain of hashes.

- **A hit covers the same token prefix in every group.** The longest L such that every group
  allows a hit of L blocks: start from the longest lookup, then shorten to each group's longest
  hit within the current length, full attention first, until no group shortens it (a window or
  chunk that allowed L may not allow a shorter L, hence the repetition). Each group's hit is its
  hit at that L; with EAGLE every group drops the hit's last block.
- **Allocation is all or nothing.** Blocks a window or chunk no longer reads are freed first
  (group by group, newest first), then the blocks every group still lacks must fit in the free
  blocks the hits leave: otherwise None, nothing else changed. Else every group's hits are
  touched before any group takes a new block (so no group's allocation evicts another's hit),
  then each group takes its blocks from the free queue's head, group by group, and caches its
  full blocks.
- **Free** releases group by group, each group's blocks tail first (with caching).

Preconditions are checked in order before anything changes; a failed call changes nothing in any
group. `check_invariants()` states the hybrid invariants once: every group's blocks come from the
one pool; a request's lists have one length; a block's ref_cnt is the number of lists holding it;
null blocks only as a prefix of a windowed or chunked group's list; a full-attention group's index
is prefix-closed.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.spec.arguments import (
    HYBRID,
    check_common_prefix,
    check_hybrid_allocation,
    check_hybrid_manager,
    check_lookup,
    check_request,
)
from pagedkv.spec.attention import (
    AnyAttentionPolicy,
    ChunkedLocalAttention,
    FullAttention,
    SlidingWindow,
)
from pagedkv.spec.attention_truth import AttentionTruth
from pagedkv.spec.block_counts import (
    ceil_div,
    fits,
    num_full_blocks,
    num_new_blocks,
    num_required_blocks,
)
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.known_bugs import known_bugs, known_bugs_fatal
from pagedkv.spec.manager import check_prefix_closure
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab import refusals
from pagedkv.vocab.errors import InvariantViolation, KVCacheConfigError
from pagedkv.vocab.hashes import BlockHashType, HashFn, cache_key, get_hash_fn
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
from pagedkv.vocab.semantics import Semantics

GroupBlocks = tuple[list[int], ...]
"""One list of block ids per KV cache group, in the config's group order."""


@dataclass(frozen=True)
class HitTrace:
    """How a common hit was found (`SpecHybridKVCacheManager.trace_common_hit`).

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


def policy_of(spec: KVCacheSpec, block_size: int) -> AnyAttentionPolicy:
    """The attention policy of one group's spec.

    Raises:
        KVCacheConfigError: a spec no policy serves.
    """
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindow(spec.sliding_window, block_size)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttention(spec.attention_chunk_size, block_size)
    if isinstance(spec, FullAttentionSpec):
        return FullAttention()
    raise KVCacheConfigError(f"no attention manager for {type(spec).__name__}")


class SpecHybridKVCacheManager:
    """Reference model of `pagedkv.HybridKVCacheManager` (module docstring).

    Attributes:
        pool: the one spec pool every group takes its blocks from.
        specs: each group's KV cache spec, in group order.
        policies: each group's attention policy, in group order.
        blocks: request id -> one block-id list per group (null block 0 = skipped).
        hashes: request id -> its stored block hashes (one chain for every group).
        num_cached: request id -> how many of its positions are cached (in every group).
        requests: request id -> the one Request object the id names while it is tracked.
        parent_of: ghost state: every block hash ever stored -> the hash before it in its chain.
        truth: ghost state: what every block holds, and the attention-truth checks.
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
        specs = [group.kv_cache_spec for group in config.kv_cache_groups]
        self.specs = tuple(specs)
        self.block_size = specs[0].block_size
        self.policies: tuple[AnyAttentionPolicy, ...] = tuple(
            policy_of(spec, self.block_size) for spec in specs
        )
        self.num_groups = len(specs)
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = ceil_div(max_model_len, self.block_size)
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = get_hash_fn(caching_hash_algo)
        self.use_eagle = use_eagle
        self.stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self.pool = SpecBlockPool(
            config.num_blocks, enable_caching, semantics, enable_kv_cache_events
        )
        self.blocks: dict[str, GroupBlocks] = {}
        self.hashes: dict[str, list[BlockHashType]] = {}
        self.num_cached: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.parent_of: dict[BlockHashType, BlockHashType | None] = {}
        self.truth = AttentionTruth(
            self.policies,
            self.block_size,
            known_bugs(semantics),
            fatal_known_bugs=known_bugs_fatal(),
        )

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

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
        request's hashes are stored as a single-group manager stores them; a lookup is counted;
        a request wanting prompt logprobs gets empty hits; the lookup leaves out the last hash
        if every token lies in full blocks; the hit is the longest every group allows (module
        docstring), each group's blocks at that length; with use_eagle it is
        `eagle_common_hit`'s.

        Preconditions: `check_lookup` (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_lookup(request, HYBRID)
        empty: GroupBlocks = tuple([] for _ in self.policies)
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
            stored.extend(chain[len(stored) :])
        self._record_parents(self.hashes[request_id])
        stored = self.hashes[request_id]
        if self.stats is not None:
            self.stats.requests += 1
        if request.prompt_logprobs:
            return empty, 0
        if len(stored) * self.block_size == request.num_tokens:
            lookup = stored[:-1]  # recompute the last block, so the last token yields logits
        else:
            lookup = list(stored)
        if self.use_eagle:
            hits = self.eagle_common_hit(len(lookup), stored)
        else:
            hits = self.longest_common_hit(lookup)
        num_hits = len(hits[0])
        self.truth.check_hit(request, hits, num_hits * self.block_size, eagle=self.use_eagle)
        if self.stats is not None:
            self.stats.queries += len(lookup)
            self.stats.hits += num_hits
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += num_hits * self.block_size
        return hits, num_hits * self.block_size

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
            range(self.num_groups),
            key=lambda group: not isinstance(self.policies[group], FullAttention),
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
                if not isinstance(self.policies[group], FullAttention):
                    windowed_accepted = shortened
            if shortened == length:
                return HitTrace(alone, length, passes, undercut)
            length = shortened

    def eagle_common_hit(
        self, num_lookup: int, block_hashes: Sequence[BlockHashType]
    ) -> GroupBlocks:
        """The hit with use_eagle, found as vLLM 0.33's coordinator finds it (a procedure: its
        answer depends on the order of its steps, so it is stated as those steps).

        Groups of equal specs form one unit, looked up together (a position is cached for the
        unit only if it is in every one of its groups); full-attention units go first. The
        length starts at `num_lookup` blocks (the lookup without EAGLE). Passes go over the
        units until one shortens nothing (with one full-attention unit and one other, a single
        pass): a full-attention unit asked before is only cut to the length; a unit not yet
        asked at this length ("unverified") finds its EAGLE policy's hit (`for_eagle`) within
        one block more than the length (at most the request's full blocks, `block_hashes`)
        and drops that hit's last block: a sliding window keeps a whole window of cached
        blocks; a verified unit finds its own hit within the length, and if it shortens the
        length every unit is unverified again. Full-attention groups are cut to the final
        length; the others keep their last hit, which has that length.

        Args:
            num_lookup: the blocks a lookup without EAGLE covers.
            block_hashes: the request's stored hashes (every full block's under vLLM 0.33).
        """
        units: list[tuple[AnyAttentionPolicy, list[int]]] = []
        for group, spec in enumerate(self.specs):
            member_of = [
                unit for unit, (_, groups) in enumerate(units) if self.specs[groups[0]] == spec
            ]
            if member_of:
                units[member_of[0]][1].append(group)
            else:
                units.append((self.policies[group], [group]))
        units.sort(key=lambda unit: not isinstance(unit[0], FullAttention))
        single_pass = len(units) == 2 and isinstance(units[0][0], FullAttention)
        found: dict[int, list[list[int]]] = {}
        verified: set[int] = set()
        length = num_lookup
        while True:
            current = length
            for unit, (policy, groups) in enumerate(units):
                if isinstance(policy, FullAttention) and unit in found:
                    current = min(current, len(found[unit][0]))
                    continue
                drop = unit not in verified
                if drop:
                    limit = min(current + 1, len(block_hashes))
                    hits = self._unit_hit(policy.for_eagle(), groups, block_hashes[:limit])
                    hits = [group_hits[:-1] for group_hits in hits] if hits[0] else hits
                    verified.add(unit)
                else:
                    hits = self._unit_hit(policy, groups, block_hashes[:current])
                    if len(hits[0]) < current:
                        verified.clear()
                current = len(hits[0])
                found[unit] = hits
            if current >= length or single_pass:
                length = current
                break
            length = current
        result: list[list[int]] = [[] for _ in self.policies]
        for unit, (policy, groups) in enumerate(units):
            for group, group_hits in zip(groups, found[unit], strict=True):
                full = isinstance(policy, FullAttention)
                result[group] = group_hits[:length] if full else group_hits
        return tuple(result)

    def _unit_hit(
        self,
        policy: AnyAttentionPolicy,
        groups: Sequence[int],
        block_hashes: Sequence[BlockHashType],
    ) -> list[list[int]]:
        """`policy`'s hit within `block_hashes` for groups looked up together: a position is
        cached if every group caches it; each group's own blocks, in group order."""

        def cached_in_every_group(block_hash: BlockHashType) -> int | None:
            found = [
                self.pool.get_cached_block_unchecked(cache_key(block_hash, group))
                for group in groups
            ]
            return found[0] if None not in found else None

        hit = policy.longest_hit(cached_in_every_group, block_hashes)
        nulls = len(list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hit)))
        result = []
        for group in groups:
            cached = [
                self.pool.get_cached_block_unchecked(cache_key(block_hash, group))
                for block_hash in block_hashes[nulls : len(hit)]
            ]
            result.append([NULL_BLOCK_ID] * nulls + [b for b in cached if b is not None])
        return result

    def _group_hit(self, group: int, block_hashes: Sequence[BlockHashType]) -> list[int]:
        def lookup(block_hash: BlockHashType) -> int | None:
            return self.pool.get_cached_block_unchecked(cache_key(block_hash, group))

        return self.policies[group].longest_hit(lookup, block_hashes)

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> GroupBlocks | None:
        """Reserve slots for `num_tokens` scheduled tokens in every group; None when they do
        not fit in the pool, every group counted together.

        Preconditions, in order (each as the single-group manager's, for every group):
          1. `check_hybrid_allocation`: a Request; num_tokens an int >= 1;
             num_lookahead_tokens an int >= 0; the request's num_computed_tokens an int and
             spec_token_ids a list; the hits None or one iterable of block ids per group
             (ArgumentTypeError, InvalidArgumentError);
          2. no more speculative tokens than num_tokens (InvalidArgumentError);
          3. the id names no other Request object (RequestError);
          4. 0 <= num_computed_tokens <= blocks held per group * B (RequestError);
          5. if there are hits: caching is on (InvalidArgumentError); the request holds no
             blocks and has no computed tokens; every group has as many hits (RequestError);
             then group by group, the single-group rules of each hit and of the hit's shape;
          6-8. computed tokens after the step within the request; the blocks required within
             max_model_len; full blocks at least the cached ones.

        Then: every group drops what it no longer reads (even if the request then does not
        fit); the blocks missing in all groups together must fit; else the hits of every group
        are touched, then each group takes its new blocks and caches its full ones.
        """
        hits = check_hybrid_allocation(
            request, num_tokens, new_computed_blocks, num_lookahead_tokens, self.num_groups
        )
        request_id = request.request_id
        num_spec = len(request.spec_token_ids)
        if num_spec > num_tokens:
            raise refusals.more_drafts_than_scheduled(request_id, num_spec, num_tokens)
        self._require_same_request(request)
        held = self.blocks.get(request_id)
        num_held = len(held[0]) if held is not None else 0
        if request.num_computed_tokens not in range(num_held * self.block_size + 1):
            raise refusals.computed_outside_slots(
                request_id, request.num_computed_tokens, num_held, self.block_size
            )
        num_hits = len(hits[0])
        if any(group_hits for group_hits in hits):
            self._require_hits(request, num_held, hits)
        computed = request.num_computed_tokens + num_hits * self.block_size
        if computed + num_tokens - num_spec > request.num_tokens:
            raise refusals.more_tokens_than_request(
                request_id, computed + num_tokens - num_spec, request.num_tokens
            )
        required = num_required_blocks(computed, num_tokens, num_lookahead_tokens, self.block_size)
        if required > self.max_num_blocks_per_req:
            raise refusals.past_max_model_len(
                request_id,
                required,
                self.max_num_blocks_per_req,
                self.max_model_len,
                self.block_size,
            )
        full = num_full_blocks(computed, num_tokens, num_spec, self.block_size)
        cached = self.num_cached.get(request_id, num_hits)
        if self.enable_caching and full < cached:
            raise refusals.cached_blocks_lost(request_id, full, cached)
        # -- every precondition holds --
        self._drop_skipped_blocks(request)
        missing = num_new_blocks(required, num_held, num_hits)
        free_hits = {
            block_id
            for group_hits in hits
            for block_id in group_hits
            if block_id != NULL_BLOCK_ID and self.pool.ref_cnt[block_id] == 0
        }
        if not fits(missing * self.num_groups, self.pool.get_num_free_blocks(), len(free_hits)):
            return None
        return self._grow(request, hits, required, full, cached, num_tokens)

    def _require_hits(self, request: Request, num_held: int, hits: GroupBlocks) -> None:
        """Precondition 5: the hits are what `get_computed_blocks` could have returned."""
        request_id = request.request_id
        if not self.enable_caching:
            raise refusals.hits_without_caching(request_id)
        if num_held or request.num_computed_tokens:
            raise refusals.hits_for_running_request(request_id)
        lengths = [len(group_hits) for group_hits in hits]
        if len(set(lengths)) != 1:
            raise refusals.hits_of_unequal_length(request_id, lengths)
        stored = self.hashes.get(request_id, [])
        if lengths[0] > len(stored):
            raise refusals.more_hits_than_hashes(request_id, lengths[0], len(stored))
        for group, group_hits in enumerate(hits):
            policy = self.policies[group]
            for position, block_id in enumerate(group_hits):
                if block_id not in range(self.pool.num_gpu_blocks):
                    raise refusals.foreign_block(block_id)
                if block_id == NULL_BLOCK_ID:
                    if not policy.allows_null_blocks:
                        raise refusals.null_hit(block_id)
                elif self.pool.block_hash[block_id] != cache_key(stored[position], group):
                    raise refusals.hit_not_cached(request_id, block_id, position)
            if self.use_eagle:  # a hit `eagle_common_hit` can give
                policy = policy.for_eagle()
            shape_error = policy.hit_shape_error(group_hits, self.use_eagle)
            if shape_error is not None:
                raise refusals.hit_shape(request_id, shape_error)

    def _drop_skipped_blocks(self, request: Request) -> None:
        """Group by group, the positions the next token no longer reads hold the null block;
        the blocks they held are freed, the newest first."""
        held = self.blocks.get(request.request_id)
        if held is None:
            return
        for policy, blocks in zip(self.policies, held, strict=True):
            skipped = min(policy.num_skipped(request.num_computed_tokens), len(blocks))
            dropped = [block_id for block_id in blocks[:skipped] if block_id != NULL_BLOCK_ID]
            self.pool.free_blocks_unchecked(dropped[::-1])
            blocks[:skipped] = [NULL_BLOCK_ID] * skipped

    def _grow(
        self,
        request: Request,
        hits: GroupBlocks,
        required: int,
        full: int,
        cached: int,
        num_tokens: int,
    ) -> GroupBlocks:
        """The state after a step that fits (`allocate_slots`' last sentence)."""
        request_id = request.request_id
        if self.enable_caching:
            for group_hits in hits:  # every group's hits before any group's new blocks
                self.pool.touch_unchecked(group_hits)
        held = self.blocks.get(request_id) or tuple([] for _ in self.policies)
        lists: GroupBlocks = tuple(
            blocks + group_hits for blocks, group_hits in zip(held, hits, strict=True)
        )
        new_blocks: list[list[int]] = []
        num_recorded = len(self.hashes.get(request_id, []))
        for group, blocks in enumerate(lists):
            taken = self.pool.get_new_blocks_unchecked(
                max(num_new_blocks(required, len(blocks), 0), 0)
            )
            self.truth.handed_out(taken)
            blocks.extend(taken)
            new_blocks.append(taken)
            if self.enable_caching:
                stored = self.hashes.setdefault(request_id, [])
                self.pool.cache_full_blocks_unchecked(
                    request,
                    blocks,
                    stored,
                    min(cached, len(blocks)),
                    min(full, len(blocks)),
                    self.block_size,
                    self.hash_fn,
                    group,
                )
        self.blocks[request_id] = lists
        self.requests[request_id] = request
        computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        self.truth.check_step(request, lists, computed)
        self.truth.computed(request, lists, computed, num_tokens)
        if self.enable_caching:
            self._record_parents(self.hashes[request_id], num_recorded)
            self.num_cached[request_id] = full
        return tuple(new_blocks)

    # -- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Free the request's blocks group by group, each group's last first when caching, else
        in order (last first as well under `free_tail_first_without_caching`). Its stored hashes
        stay. Unknown request: nothing happens.

        Preconditions: a Request (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_request("free", request, HYBRID)
        self._require_same_request(request)
        held = self.blocks.pop(request.request_id, ())
        tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
        for blocks in held:
            self.pool.free_blocks_unchecked(blocks[::-1] if tail_first else blocks)
        self.num_cached.pop(request.request_id, None)
        self.truth.freed(request.request_id)
        self._forget_if_done(request.request_id)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the stored hashes of a finished request.

        Preconditions: a Request (ArgumentTypeError); the id names no other Request object; the
        request holds no blocks (RequestError).
        """
        check_request("free_block_hashes", request, HYBRID)
        self._require_same_request(request)
        if request.request_id in self.blocks:
            raise refusals.hashes_dropped_while_held(request.request_id)
        self.hashes.pop(request.request_id, None)
        self._forget_if_done(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """The pool's reset; a successful one is recorded in the stats."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.stats is not None:
            self.stats.reset = True
        return True

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, the leading blocks of the request with ref_cnt == num_running_requests.

        Preconditions: `check_common_prefix` (ArgumentTypeError, InvalidArgumentError).
        """
        check_common_prefix(request, num_running_requests, HYBRID)
        held = self.blocks.get(request.request_id) or tuple([] for _ in self.policies)
        counts = []
        for blocks in held:
            shared = [self.pool.ref_cnt[block_id] == num_running_requests for block_id in blocks]
            counts.append(shared.index(False) if False in shared else len(shared))
        return tuple(counts)

    # -- helpers -----------------------------------------------------------------------------

    def _chain(self, request: Request) -> list[BlockHashType]:
        """The hashes of the request's full blocks (`request_block_hashes`), keyed as the
        semantics keys multimodal inputs."""
        return request_block_hashes(
            self.hash_fn,
            self.block_size,
            request,
            mm_position=not self.semantics.mm_keys_without_position,
        )

    def _require_same_request(self, request: Request) -> None:
        if self.requests.get(request.request_id, request) is not request:
            raise refusals.id_in_use(request.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if request_id not in self.blocks and request_id not in self.hashes:
            self.requests.pop(request_id, None)
            self.truth.forget(request_id)

    def _record_parents(self, chain: list[BlockHashType], start: int = 0) -> None:
        """Record the parent of each hash of `chain` from position `start` on (the ones before
        were recorded when they were stored: every stored hash is recorded as it is stored)."""
        for position in range(start, len(chain)):
            self.parent_of.setdefault(chain[position], chain[position - 1] if position else None)

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pool's invariants, then each hybrid invariant, stated once.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
        """
        self.pool.check_invariants()
        holders_of = Counter(
            block_id for held in self.blocks.values() for blocks in held for block_id in blocks
        )
        for block_id in range(1, self.pool.num_gpu_blocks):
            holders = holders_of.get(block_id, 0)
            if self.pool.ref_cnt[block_id] != holders:
                raise InvariantViolation(
                    "a block's ref_cnt is the number of requests holding it",
                    f"block {block_id}: ref_cnt {self.pool.ref_cnt[block_id]}, held {holders}",
                )
            if holders >= 2 and self.pool.block_hash[block_id] is None:
                raise InvariantViolation("a block held by two requests is cached", str(block_id))
        for request_id, held in self.blocks.items():
            self._check_request(request_id, held)
            self.truth.check_table(self.requests[request_id], held)
        tracked = self.blocks.keys() | self.hashes.keys()
        if self.requests.keys() != tracked or not self.num_cached.keys() <= tracked:
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes", repr(sorted(tracked))
            )
        if self.enable_caching:
            full_groups = [
                group
                for group, policy in enumerate(self.policies)
                if isinstance(policy, FullAttention)
            ]
            check_prefix_closure(self.pool.index, self.parent_of, full_groups)

    def _check_request(self, request_id: str, held: GroupBlocks) -> None:
        if len({len(blocks) for blocks in held}) != 1:
            raise InvariantViolation(
                "a request's block lists cover the same positions in every group",
                f"request {request_id!r}: {[len(blocks) for blocks in held]} blocks",
            )
        for group, (policy, blocks) in enumerate(zip(self.policies, held, strict=True)):
            nulls = [position for position, block_id in enumerate(blocks) if block_id == 0]
            if nulls and (not policy.allows_null_blocks or nulls != list(range(len(nulls)))):
                raise InvariantViolation(
                    "null blocks only as a prefix, and only under sliding window",
                    f"request {request_id!r}, group {group}: {blocks}",
                )
        if len(held[0]) > self.max_num_blocks_per_req:
            raise InvariantViolation(
                "a request holds at most cdiv(max_model_len, block_size) blocks", repr(held)
            )
        if not self.enable_caching:
            return
        request = self.requests[request_id]
        num_cached = self.num_cached.get(request_id, 0)
        stored = self.hashes.get(request_id, [])
        if num_cached > min(request.num_tokens // self.block_size, len(stored)):
            raise InvariantViolation(
                "a request's cached blocks are full blocks with stored hashes",
                f"request {request_id!r}: {num_cached} cached, {len(stored)} stored hashes",
            )
        for group, blocks in enumerate(held):
            for position, block_id in enumerate(blocks[:num_cached]):
                if block_id != NULL_BLOCK_ID and self.pool.block_hash[block_id] != cache_key(
                    stored[position], group
                ):
                    raise InvariantViolation(
                        "a request's cached block carries the hash its tokens chain to",
                        f"request {request_id!r}, group {group}, position {position}, "
                        f"block {block_id}",
                    )
        chain = self._chain(request)
        if stored != chain[: len(stored)]:
            raise InvariantViolation(
                "stored hashes are the chain of the request's tokens",
                f"request {request_id!r}: stored {stored}, its tokens chain to {chain}",
            )
