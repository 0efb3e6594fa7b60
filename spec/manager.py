"""The reference KV cache manager: every KVCacheManager operation over the spec pool, in ids.

Per request it keeps a block-id list, the stored chain of block hashes, and how many blocks are
cached. Each operation is written as its preconditions, in the order its docstring lists them
(the first one broken raises, before anything changes), then the state it leads to. The spec
decides every rule itself, arguments included (`pagedkv.spec.arguments`); only the wording of a
refusal is shared (`pagedkv.vocab.refusals`), so both sides refuse alike in the same words.
`check_invariants()` adds the request-level invariants to the pool's, among them prefix
closure for full attention, checked against a ghost map of every hash's parent that only the
spec keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from pagedkv.spec.arguments import (
    check_allocation,
    check_common_prefix,
    check_lookup,
    check_manager,
    check_request,
)
from pagedkv.spec.attention import AttentionPolicy, FullAttention, SlidingWindow
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
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab import refusals
from pagedkv.vocab.errors import InvariantViolation, KVCacheConfigError
from pagedkv.vocab.hashes import (
    BlockHashType,
    CacheKey,
    HashFn,
    cache_key,
    get_hash_fn,
    key_group,
    key_hash,
)
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from pagedkv.vocab.kv_events import KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics


@dataclass(frozen=True)
class Step:
    """What one `allocate_slots` call asks for, once its preconditions hold.

    Attributes:
        hits: the prefix hits (block ids, nulls first under a sliding window).
        num_required: blocks the request must hold after the step, lookahead included.
        num_full: its full blocks after the step, speculative tokens left out: cached after it.
        num_cached: its blocks cached before the step.
        num_computed: its tokens computed before the step, the hits' included.
        num_tokens: the tokens the step computes (drafts included).
    """

    hits: list[int]
    num_required: int
    num_full: int
    num_cached: int
    num_computed: int
    num_tokens: int


class SpecKVCacheManager:
    """Reference model of `pagedkv.KVCacheManager`.

    Attributes:
        pool: the spec block pool.
        attention: the attention policy (which hits are usable, which blocks are dropped).
        lookup_policy: the policy a lookup finds its hit with: `attention`, or with use_eagle
            its `for_eagle()` (unless `eagle_window_hit_one_short`), whose hit then loses its
            last block.
        blocks: request id -> its block ids, in position order (null block 0 = skipped).
        hashes: request id -> its stored block hashes (kept across preemption).
        num_cached: request id -> how many of its blocks are cached.
        requests: request id -> the one Request object that id names while it is tracked.
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
        check_manager(
            kv_cache_config,
            max_model_len,
            enable_caching,
            caching_hash_algo,
            use_eagle,
            log_stats,
            semantics,
            enable_kv_cache_events,
        )
        layer_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = layer_spec.block_size
        self.attention: AttentionPolicy
        if isinstance(layer_spec, SlidingWindowSpec):
            self.attention = SlidingWindow(layer_spec.sliding_window, self.block_size)
        elif isinstance(layer_spec, FullAttentionSpec):
            self.attention = FullAttention()
        else:
            raise KVCacheConfigError(f"no attention manager for {type(layer_spec).__name__}")
        self.lookup_policy = self.attention
        if use_eagle and not semantics.eagle_window_hit_one_short:
            self.lookup_policy = self.attention.for_eagle()  # a whole window after the drop
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = ceil_div(max_model_len, self.block_size)
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = get_hash_fn(caching_hash_algo)
        self.use_eagle = use_eagle
        self.stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self.pool = SpecBlockPool(
            kv_cache_config.num_blocks, enable_caching, semantics, enable_kv_cache_events
        )
        self.blocks: dict[str, list[int]] = {}
        self.hashes: dict[str, list[BlockHashType]] = {}
        self.num_cached: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.parent_of: dict[BlockHashType, BlockHashType | None] = {}
        self.truth = AttentionTruth(
            (self.attention,),
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
        """The pool's KV cache events not yet taken."""
        return self.pool.take_events()

    # -- lookups -----------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The blocks a waiting request may reuse, and the tokens they hold.

        Caching off: ([], 0), nothing stored. Otherwise the request's full-block hashes are
        stored (computed unless already stored and non-empty; with
        `lookup_hashes_every_full_block`, the stored ones extended to every full block); a
        lookup is counted; a request
        wanting prompt logprobs gets ([], 0); the lookup leaves out the last hash if every token
        lies in full blocks; with use_eagle a non-empty hit loses its last block, and a sliding
        window's hit is found for a window one block wider first (unless
        `eagle_window_hit_one_short`), so that a whole window stays.

        Preconditions: `check_lookup` (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_lookup(request)
        if not self.enable_caching:
            return [], 0
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
        if request.prompt_logprobs:
            return [], 0
        if len(stored) * self.block_size == request.num_tokens:
            lookup = stored[:-1]  # recompute the last block, so the last token yields logits
        else:
            lookup = list(stored)
        hits = self.lookup_policy.longest_hit(self.pool.get_cached_block_unchecked, lookup)
        if self.use_eagle and hits:
            hits = hits[:-1]
        self.truth.check_hit(request, (hits,), len(hits) * self.block_size, eagle=self.use_eagle)
        if self.stats is not None:
            self.stats.queries += len(lookup)
            self.stats.hits += len(hits)
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve slots for `num_tokens` scheduled tokens; None when they do not fit.

        Preconditions, in order:
          1. `check_allocation`: a Request; num_tokens an int >= 1; num_lookahead_tokens an
             int >= 0; the request's num_computed_tokens an int and spec_token_ids a list; the
             hits None or an iterable of block ids (ArgumentTypeError, InvalidArgumentError);
          2. no more speculative tokens than num_tokens (InvalidArgumentError);
          3. the id names no other Request object (RequestError);
          4. 0 <= num_computed_tokens <= blocks held * B (RequestError);
          5. if there are hits: caching is on (InvalidArgumentError); the request holds no
             blocks and has no computed tokens (RequestError); there are no more hits than
             stored hashes (RequestError); each hit, in order, is a block of the pool
             (BlockStateError), is the null block only if the attention allows null blocks
             (BlockStateError), and unless it is the null block is cached under the request's
             stored hash at its position (RequestError); the hits have a shape the attention
             can produce: under sliding window, null hits first, then contiguous_blocks_needed
             cached blocks of the lookup's window (`lookup_policy`), one fewer with use_eagle
             (RequestError);
          6. computed tokens after the step, speculative ones excluded, do not exceed the
             request's tokens (InvalidArgumentError);
          7. the blocks required, lookahead included, do not exceed cdiv(max_model_len, B)
             (MaxModelLenExceededError; under vLLM semantics only when nothing could be added);
          8. with caching, full blocks after the step are at least the blocks already cached
             (RequestError).

        Then, in three steps: `_drop_skipped_blocks` (even if the request then does not fit);
        `_fits`, or None; `_grow`, which returns the new blocks.
        """
        hits = check_allocation(request, num_tokens, new_computed_blocks, num_lookahead_tokens)
        step = self._allocation_step(request, num_tokens, hits, num_lookahead_tokens)
        self._drop_skipped_blocks(request)
        if not self._fits(request, step):
            return None
        return self._grow(request, step)

    def _allocation_step(
        self, request: Request, num_tokens: int, hits: list[int], num_lookahead_tokens: int
    ) -> Step:
        """Preconditions 2-8 of `allocate_slots`; the step they allow. Changes nothing."""
        request_id = request.request_id
        num_spec = len(request.spec_token_ids)
        if num_spec > num_tokens:
            raise refusals.more_drafts_than_scheduled(request_id, num_spec, num_tokens)
        self._require_same_request(request)
        held = self.blocks.get(request_id, [])
        slots = len(held) * self.block_size
        if request.num_computed_tokens not in range(slots + 1):
            raise refusals.computed_outside_slots(
                request_id, request.num_computed_tokens, len(held), self.block_size
            )
        if hits:
            self._require_hits(request, held, hits)
        computed = request.num_computed_tokens + len(hits) * self.block_size
        if computed + num_tokens - num_spec > request.num_tokens:
            raise refusals.more_tokens_than_request(
                request_id, computed + num_tokens - num_spec, request.num_tokens
            )
        required = num_required_blocks(computed, num_tokens, num_lookahead_tokens, self.block_size)
        could_grow = len(held) + len(hits) < self.max_num_blocks_per_req
        capped = self.semantics.cap_at_max_model_len and could_grow  # vLLM allocates fewer
        if required > self.max_num_blocks_per_req and not capped:
            raise refusals.past_max_model_len(
                request_id,
                required,
                self.max_num_blocks_per_req,
                self.max_model_len,
                self.block_size,
            )
        full = num_full_blocks(computed, num_tokens, num_spec, self.block_size)
        cached = self.num_cached.get(request_id, len(hits))
        if self.enable_caching and full < cached:
            raise refusals.cached_blocks_lost(request_id, full, cached)
        return Step(hits, required, full, cached, computed, num_tokens)

    def _require_hits(self, request: Request, held: list[int], hits: list[int]) -> None:
        """Precondition 5: the hits are what `get_computed_blocks` could have returned."""
        request_id = request.request_id
        if not self.enable_caching:
            raise refusals.hits_without_caching(request_id)
        if held or request.num_computed_tokens:
            raise refusals.hits_for_running_request(request_id)
        stored = self.hashes.get(request_id, [])
        if len(hits) > len(stored):
            raise refusals.more_hits_than_hashes(request_id, len(hits), len(stored))
        for position, block_id in enumerate(hits):
            if block_id not in range(self.pool.num_gpu_blocks):
                raise refusals.foreign_block(block_id)
            if block_id == NULL_BLOCK_ID:
                if not self.attention.allows_null_blocks:
                    raise refusals.null_hit(block_id)
            elif self.pool.block_hash[block_id] != stored[position]:
                raise refusals.hit_not_cached(request_id, block_id, position)
        shape_error = self.lookup_policy.hit_shape_error(hits, self.use_eagle)
        if shape_error is not None:
            raise refusals.hit_shape(request_id, shape_error)

    def _drop_skipped_blocks(self, request: Request) -> None:
        """The positions the next token no longer reads hold the null block afterwards; the
        blocks they held are freed, the newest first."""
        held = self.blocks.get(request.request_id)
        if held is None:
            return
        skipped = min(self.attention.num_skipped(request.num_computed_tokens), len(held))
        dropped = [block_id for block_id in held[:skipped] if block_id != NULL_BLOCK_ID]
        self.pool.free_blocks_unchecked(dropped[::-1])
        held[:skipped] = [NULL_BLOCK_ID] * skipped

    def _fits(self, request: Request, step: Step) -> bool:
        """The blocks still missing fit in the free blocks the hits leave: a hit at ref_cnt 0
        leaves the free queue when touched (a null hit only under vLLM semantics)."""
        num_held = len(self.blocks.get(request.request_id, []))
        missing = num_new_blocks(step.num_required, num_held, len(step.hits))
        free_hits = [
            block_id
            for block_id in step.hits
            if self.pool.ref_cnt[block_id] == 0
            and (block_id != NULL_BLOCK_ID or self.semantics.capacity_counts_null_blocks)
        ]
        return fits(missing, self.pool.get_num_free_blocks(), len(free_hits))

    def _grow(self, request: Request, step: Step) -> list[int]:
        """The state after a step that fits: the request holds its blocks, then the hits (one
        more reference each), then the missing blocks from the head of the free queue (as many
        as max_model_len leaves room for); with caching, its blocks [cached, full) are cached
        and `num_cached` is `full`."""
        request_id = request.request_id
        if self.enable_caching:
            self.pool.touch_unchecked(step.hits)
        blocks = self.blocks.get(request_id, []) + step.hits
        room = self.max_num_blocks_per_req - len(blocks)
        missing = num_new_blocks(step.num_required, len(blocks), 0)
        new_blocks = self.pool.get_new_blocks_unchecked(
            max(min(missing, self.pool.get_num_free_blocks(), room), 0)
        )
        self.truth.handed_out(new_blocks)
        blocks += new_blocks
        self.blocks[request_id] = blocks
        self.requests[request_id] = request
        self.truth.check_step(request, (blocks,), step.num_computed)
        self.truth.computed(request, (blocks,), step.num_computed, step.num_tokens)
        if self.enable_caching:
            stored = self.hashes.setdefault(request_id, [])
            num_recorded = len(stored)
            self.pool.cache_full_blocks_unchecked(
                request,
                blocks,
                stored,
                min(step.num_cached, len(blocks)),
                min(step.num_full, len(blocks)),
                self.block_size,
                self.hash_fn,
            )
            self._record_parents(stored, num_recorded)
            self.num_cached[request_id] = step.num_full
        return new_blocks

    # -- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Free the request's blocks, last first when caching (first evicted), else in order
        (last first as well under `free_tail_first_without_caching`).

        Its stored hashes stay. Unknown request: nothing happens.
        Preconditions: a Request (ArgumentTypeError); the id names no other Request object
        (RequestError).
        """
        check_request("free", request)
        self._require_same_request(request)
        held = self.blocks.pop(request.request_id, [])
        tail_first = self.enable_caching or self.semantics.free_tail_first_without_caching
        self.pool.free_blocks_unchecked(held[::-1] if tail_first else held)
        self.num_cached.pop(request.request_id, None)
        self.truth.freed(request.request_id)
        self._forget_if_done(request.request_id)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the stored hashes of a finished request.

        Preconditions: a Request (ArgumentTypeError); the id names no other Request object; the
        request holds no blocks (its cached blocks need their stored hashes) (RequestError).
        """
        check_request("free_block_hashes", request)
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

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """Leading blocks of the request with ref_cnt == num_running_requests.

        Preconditions: `check_common_prefix` (ArgumentTypeError, InvalidArgumentError).
        """
        check_common_prefix(request, num_running_requests)
        held = self.blocks.get(request.request_id, [])
        shared = [self.pool.ref_cnt[block_id] == num_running_requests for block_id in held]
        return shared.index(False) if False in shared else len(shared)

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
        """The pool's invariants, then each request-level invariant, stated once.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
        """
        self.pool.check_invariants()
        # ref_cnt of each block = the number of request block lists holding it.
        holders_of = Counter(block_id for held in self.blocks.values() for block_id in held)
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
            self.truth.check_table(self.requests[request_id], (held,))
        tracked = self.blocks.keys() | self.hashes.keys()
        if self.requests.keys() != tracked or not self.num_cached.keys() <= tracked:
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes", repr(sorted(tracked))
            )
        if not self.attention.allows_null_blocks and self.enable_caching:
            self._check_prefix_closure()

    def _check_request(self, request_id: str, held: list[int]) -> None:
        nulls = [position for position, block_id in enumerate(held) if block_id == NULL_BLOCK_ID]
        if nulls and (not self.attention.allows_null_blocks or nulls != list(range(len(nulls)))):
            raise InvariantViolation(
                "null blocks only as a prefix, and only under sliding window",
                f"request {request_id!r}: {held}",
            )
        if len(held) > self.max_num_blocks_per_req and not self.semantics.cap_at_max_model_len:
            raise InvariantViolation(
                "a request holds at most cdiv(max_model_len, block_size) blocks", repr(held)
            )
        if not self.enable_caching:
            return
        request = self.requests[request_id]
        num_cached = self.num_cached.get(request_id, 0)
        stored = self.hashes.get(request_id, [])
        num_full = request.num_tokens // self.block_size
        if num_cached > min(num_full, len(stored)):
            raise InvariantViolation(
                "a request's cached blocks are full blocks with stored hashes",
                f"request {request_id!r}: {num_cached} cached of {num_full} full blocks and "
                f"{len(stored)} stored hashes",
            )
        carried = [self.pool.block_hash[block_id] for block_id in held[:num_cached]]
        for position, block_hash in enumerate(carried):
            if held[position] != NULL_BLOCK_ID and block_hash != stored[position]:
                raise InvariantViolation(
                    "a request's cached block carries the hash its tokens chain to",
                    f"request {request_id!r}, position {position}, block {held[position]}",
                )
        if self.semantics.vllm_new_block_mm_keys:
            return  # vLLM 0.8.5 stores some hashes with other multimodal keys than the chain's
        chain = self._chain(request)
        if stored != chain[: len(stored)]:  # the stored hashes are a prefix of the chain
            raise InvariantViolation(
                "stored hashes are the chain of the request's tokens",
                f"request {request_id!r}: stored {stored}, its tokens chain to {chain}",
            )

    def _check_prefix_closure(self) -> None:
        """Full attention: every cached hash's parent is cached too (tail-first freeing)."""
        check_prefix_closure(self.pool.index, self.parent_of, groups=(0,))


def check_prefix_closure(
    index: Iterable[CacheKey],
    parent_of: dict[BlockHashType, BlockHashType | None],
    groups: Collection[int],
) -> None:
    """In each of `groups` (full-attention groups: a request frees its blocks tail first), every
    cached hash's parent is cached too, `parent_of` being the ghost map of every chain's parents.

    Raises:
        InvariantViolation: a cached key whose parent is not cached in its group.
    """
    keys = set(index)
    for key in keys:
        group = key_group(key)
        if group not in groups:
            continue
        parent = parent_of.get(key_hash(key))
        if parent is not None and cache_key(parent, group) not in keys:
            raise InvariantViolation(
                "prefix closure: a cached block's parent hash is cached",
                f"{key} is cached, its parent {parent} is not",
            )
