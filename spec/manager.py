"""The reference KV cache manager: every KVCacheManager operation over the spec pool, in ids.

Per request it keeps a block-id list, the stored chain of block hashes, and how many blocks are
cached. Preconditions are listed in each docstring in the order they are checked; the first one
broken raises, before anything changes. `check_invariants()` adds the request-level invariants to
the pool's, among them prefix closure for full attention, checked against a ghost map of every
hash's parent that only the spec keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedkv.block_hash import BlockHashType, HashFn, get_hash_fn
from pagedkv.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvariantViolation,
    KVCacheConfigError,
    MaxModelLenExceededError,
    RequestError,
)
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from pagedkv.prefix_cache_stats import PrefixCacheStats
from pagedkv.request import Request
from pagedkv.semantics import PAGEDKV, Semantics
from pagedkv.spec.attention import (
    contiguous_blocks_needed,
    full_attention_hit,
    sliding_window_hit,
    sliding_window_skipped,
)
from pagedkv.spec.block_counts import (
    ceil_div,
    fits,
    num_full_blocks,
    num_new_blocks,
    num_required_blocks,
)
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool


class SpecKVCacheManager:
    """Reference model of `pagedkv.KVCacheManager`.

    Attributes:
        pool: the spec block pool.
        blocks: request id -> its block ids, in position order (null block 0 = skipped).
        hashes: request id -> its stored block hashes (kept across preemption).
        num_cached: request id -> how many of its blocks are cached.
        requests: request id -> the one Request object that id names while it is tracked.
        parent_of: ghost state: every block hash ever stored -> the hash before it in its chain.
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
        semantics: Semantics = PAGEDKV,
    ) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise KVCacheConfigError(
                f"KVCacheManager needs exactly one KV cache group, got "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        if max_model_len <= 0:
            raise InvalidArgumentError(f"max_model_len must be > 0, got {max_model_len}")
        kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if not isinstance(kv_cache_spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise KVCacheConfigError(f"no attention manager for {type(kv_cache_spec).__name__}")
        self.block_size = kv_cache_spec.block_size
        self.sliding_window: int | None = (
            kv_cache_spec.sliding_window if isinstance(kv_cache_spec, SlidingWindowSpec) else None
        )
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = ceil_div(max_model_len, self.block_size)
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = get_hash_fn(caching_hash_algo)
        self.use_eagle = use_eagle
        self.stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.semantics = semantics
        self.pool = SpecBlockPool(kv_cache_config.num_blocks, enable_caching, semantics)
        self.blocks: dict[str, list[int]] = {}
        self.hashes: dict[str, list[BlockHashType]] = {}
        self.num_cached: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.parent_of: dict[BlockHashType, BlockHashType | None] = {}

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call, renewed; None without log_stats."""
        if self.stats is None:
            return None
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # -- lookups -----------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The blocks a waiting request may reuse, and the tokens they hold.

        Caching off: ([], 0), nothing stored. Otherwise the request's full-block hashes are
        stored (computed unless already stored and non-empty); a lookup is counted; a request
        wanting prompt logprobs gets ([], 0); the lookup leaves out the last hash if every token
        lies in full blocks; with use_eagle a non-empty hit loses its last block.

        Preconditions: the id names no other Request object (RequestError).
        """
        if not self.enable_caching:
            return [], 0
        self._require_same_request(request)
        request_id = request.request_id
        if not self.hashes.get(request_id):
            self.hashes[request_id] = request_block_hashes(self.hash_fn, self.block_size, request)
            self.requests[request_id] = request
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
        hits = self._longest_cache_hit(lookup)
        if self.use_eagle and hits:
            hits = hits[:-1]
        if self.stats is not None:
            self.stats.queries += len(lookup)
            self.stats.hits += len(hits)
        return hits, len(hits) * self.block_size

    def _longest_cache_hit(self, lookup: list[BlockHashType]) -> list[int]:
        if self.sliding_window is None:
            return full_attention_hit(self.pool.get_cached_block, lookup)
        return sliding_window_hit(
            self.pool.get_cached_block, lookup, self.sliding_window, self.block_size
        )

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
          1. num_tokens > 0; 2. num_lookahead_tokens >= 0; 2b. no more speculative tokens
             than num_tokens (InvalidArgumentError);
          3. the id names no other Request object (RequestError);
          4. 0 <= num_computed_tokens <= blocks held * B (RequestError);
          5. if there are hits: caching is on (InvalidArgumentError); the request holds no
             blocks and has no computed tokens (RequestError); there are no more hits than
             stored hashes (RequestError); each hit, in order, is a block of the pool
             (BlockStateError), is not the null block under full attention (BlockStateError),
             and unless it is the null block is cached under the request's stored hash at its
             position (RequestError); under sliding window, if there are null hits, they come
             first and are followed by contiguous_blocks_needed cached blocks, one fewer with
             use_eagle (RequestError);
          6. computed tokens after the step, speculative ones excluded, do not exceed the
             request's tokens (InvalidArgumentError);
          7. the blocks required, lookahead included, do not exceed cdiv(max_model_len, B)
             (MaxModelLenExceededError; under vLLM semantics only when nothing could be added);
          8. with caching, full blocks after the step are at least the blocks already cached
             (RequestError).

        Then: the blocks wholly outside the window are replaced by the null block and freed,
        newest first (even if the request then does not fit); the new blocks must fit in the
        free blocks minus the hits that are themselves free (null blocks not counted, unless
        vLLM semantics); the hits are touched and appended; the missing blocks are allocated;
        with caching, blocks [cached, full) are cached, speculative tokens excluded.
        """
        request_id = request.request_id
        block_size = self.block_size
        if num_tokens <= 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_tokens must be > 0, got {num_tokens}"
            )
        if num_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_lookahead_tokens must be >= 0, got "
                f"{num_lookahead_tokens}"
            )
        if len(request.spec_token_ids) > num_tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: {len(request.spec_token_ids)} speculative tokens but "
                f"only {num_tokens} scheduled (speculative tokens are part of num_tokens)"
            )
        self._require_same_request(request)
        held = self.blocks.get(request_id, [])
        hits = list(new_computed_blocks or [])
        if not 0 <= request.num_computed_tokens <= len(held) * block_size:
            raise RequestError(
                request_id,
                "num_computed_tokens outside the request's slots",
                f"{request.num_computed_tokens} computed, {len(held)} blocks of {block_size} held",
            )
        if hits:
            self._require_hits(request, held, hits)
        computed_tokens = request.num_computed_tokens + len(hits) * block_size
        real_tokens_after = computed_tokens + num_tokens - len(request.spec_token_ids)
        if real_tokens_after > request.num_tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: {real_tokens_after} tokens computed after this step, "
                f"but the request has {request.num_tokens}"
            )
        num_required = num_required_blocks(
            computed_tokens, num_tokens, num_lookahead_tokens, block_size
        )
        num_held_after_hits = len(held) + len(hits)
        if num_required > self.max_num_blocks_per_req and (
            not self.semantics.cap_at_max_model_len
            or num_held_after_hits >= self.max_num_blocks_per_req
        ):
            raise MaxModelLenExceededError(
                request_id,
                "allocation past max_model_len",
                f"{num_required} blocks needed, at most {self.max_num_blocks_per_req} "
                f"(max_model_len {self.max_model_len}, block size {block_size})",
            )
        num_full = num_full_blocks(
            computed_tokens, num_tokens, len(request.spec_token_ids), block_size
        )
        num_cached = self.num_cached.get(request_id, len(hits))
        if self.enable_caching and num_full < num_cached:
            raise RequestError(
                request_id,
                "fewer full blocks than already cached",
                f"{num_full} full, {num_cached} cached: did num_computed_tokens go back?",
            )

        held = list(held)
        if self.sliding_window is not None:
            skipped = sliding_window_skipped(
                request.num_computed_tokens, self.sliding_window, block_size
            )
            removed = [b for b in reversed(held[:skipped]) if b != NULL_BLOCK_ID]
            held[:skipped] = [NULL_BLOCK_ID] * min(skipped, len(held))
            self.pool.free_blocks(removed)
            if request_id in self.blocks:
                self.blocks[request_id] = held
        num_new = num_new_blocks(num_required, len(held), len(hits))
        num_free_hits = sum(
            1
            for block_id in hits
            if self.pool.ref_cnt[block_id] == 0
            and (block_id != NULL_BLOCK_ID or self.semantics.capacity_counts_null_blocks)
        )
        if not fits(num_new, self.pool.get_num_free_blocks(), num_free_hits):
            return None
        if self.enable_caching:
            self.pool.touch(hits)
        held += hits
        new_blocks: list[int] = []
        if num_new > 0:
            room = self.max_num_blocks_per_req - len(held)
            new_blocks = self.pool.get_new_blocks(
                min(num_new, self.pool.get_num_free_blocks(), room)
            )
            held += new_blocks
        self.blocks[request_id] = held
        self.requests[request_id] = request
        if self.enable_caching:
            stored = self.hashes.setdefault(request_id, [])
            self.pool.cache_full_blocks(
                request,
                held,
                stored,
                min(num_cached, len(held)),
                min(num_full, len(held)),
                block_size,
                self.hash_fn,
            )
            self._record_parents(stored)
            self.num_cached[request_id] = num_full
        return new_blocks

    def _require_hits(self, request: Request, held: list[int], hits: list[int]) -> None:
        request_id = request.request_id
        if not self.enable_caching:
            raise InvalidArgumentError(
                f"request {request_id!r}: new_computed_blocks given while prefix caching is off"
            )
        if held or request.num_computed_tokens:
            raise RequestError(
                request_id,
                "new_computed_blocks for a request that already holds blocks or computed tokens",
            )
        stored = self.hashes.get(request_id, [])
        if len(hits) > len(stored):
            raise RequestError(
                request_id,
                "new_computed_blocks must be the request's cached blocks",
                f"{len(hits)} hits but {len(stored)} stored block hashes",
            )
        for position, block_id in enumerate(hits):
            if not 0 <= block_id < self.pool.num_gpu_blocks:
                raise BlockStateError(block_id, "block does not belong to this pool")
            if block_id == NULL_BLOCK_ID:
                if self.sliding_window is None:
                    raise BlockStateError(block_id, "a null block is no hit under full attention")
                continue
            if self.pool.block_hash[block_id] != stored[position]:
                raise RequestError(
                    request_id,
                    "new_computed_blocks must be the request's cached blocks",
                    f"block {block_id} at position {position} is not cached under the "
                    f"request's hash there",
                )
        if self.sliding_window is not None and NULL_BLOCK_ID in hits:
            # The shape sliding_window_hit produces: nulls, then a window of cached blocks
            # (one block fewer with use_eagle, which drops the hit's last block).
            num_nulls = len(hits) - len(list(itertools.dropwhile(lambda b: b == 0, hits)))
            cached = hits[num_nulls:]
            needed = contiguous_blocks_needed(self.sliding_window, self.block_size)
            needed -= int(self.use_eagle)
            if NULL_BLOCK_ID in cached or len(cached) < needed:
                raise RequestError(
                    request_id,
                    "new_computed_blocks is not a sliding-window hit",
                    f"{num_nulls} null blocks, then {len(cached)} blocks; "
                    f"the window needs {needed}",
                )

    # -- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Free the request's blocks, last first when caching (first evicted), else in order.

        Its stored hashes stay. Unknown request: nothing happens.
        Preconditions: the id names no other Request object (RequestError).
        """
        self._require_same_request(request)
        request_id = request.request_id
        held = self.blocks.get(request_id, [])
        self.pool.free_blocks(list(reversed(held)) if self.enable_caching else held)
        self.blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        self._forget_if_done(request_id)

    def free_block_hashes(self, request: Request) -> None:
        """Drop the stored hashes of a finished request.

        Preconditions: the id names no other Request object; the request holds no blocks
        (its cached blocks need their stored hashes) (RequestError).
        """
        self._require_same_request(request)
        if request.request_id in self.blocks:
            raise RequestError(
                request.request_id,
                "free_block_hashes of a request that still holds blocks",
                "free it first; a running request's cached blocks need their stored hashes",
            )
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
        """Leading blocks of the request with ref_cnt == num_running_requests."""
        count = 0
        for block_id in self.blocks.get(request.request_id, []):
            if self.pool.ref_cnt[block_id] != num_running_requests:
                break
            count += 1
        return count

    # -- helpers -----------------------------------------------------------------------------

    def _require_same_request(self, request: Request) -> None:
        known = self.requests.get(request.request_id)
        if known is not None and known is not request:
            raise RequestError(
                request.request_id,
                "request id already in use by another Request object",
                "free it and drop its hashes (free_block_hashes) before reusing the id",
            )

    def _forget_if_done(self, request_id: str) -> None:
        if request_id not in self.blocks and request_id not in self.hashes:
            self.requests.pop(request_id, None)

    def _record_parents(self, chain: list[BlockHashType]) -> None:
        for position, block_hash in enumerate(chain):
            self.parent_of.setdefault(block_hash, chain[position - 1] if position else None)

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pool's invariants, then each request-level invariant, stated once.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
        """
        self.pool.check_invariants()
        # ref_cnt of each block = the number of request block lists holding it.
        for block_id in range(1, self.pool.num_gpu_blocks):
            holders = sum(held.count(block_id) for held in self.blocks.values())
            if self.pool.ref_cnt[block_id] != holders:
                raise InvariantViolation(
                    "a block's ref_cnt is the number of requests holding it",
                    f"block {block_id}: ref_cnt {self.pool.ref_cnt[block_id]}, held {holders}",
                )
            if holders >= 2 and self.pool.block_hash[block_id] is None:
                raise InvariantViolation("a block held by two requests is cached", str(block_id))
        for request_id, held in self.blocks.items():
            self._check_request(request_id, held)
        tracked = self.blocks.keys() | self.hashes.keys()
        if self.requests.keys() != tracked or not self.num_cached.keys() <= tracked:
            raise InvariantViolation(
                "every tracked request has blocks or stored hashes", repr(sorted(tracked))
            )
        if self.sliding_window is None and self.enable_caching:
            self._check_prefix_closure()

    def _check_request(self, request_id: str, held: list[int]) -> None:
        nulls = [position for position, block_id in enumerate(held) if block_id == NULL_BLOCK_ID]
        if nulls and (self.sliding_window is None or nulls != list(range(len(nulls)))):
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
        if num_cached * self.block_size > request.num_tokens or num_cached > len(stored):
            raise InvariantViolation(
                "a request's cached blocks are full blocks with stored hashes",
                f"request {request_id!r}: {num_cached} cached, {request.num_tokens} tokens, "
                f"{len(stored)} stored hashes",
            )
        for position, block_id in enumerate(held[:num_cached]):
            if block_id != NULL_BLOCK_ID and self.pool.block_hash[block_id] != stored[position]:
                raise InvariantViolation(
                    "a request's cached block carries the hash its tokens chain to",
                    f"request {request_id!r}, position {position}, block {block_id}",
                )
        if not self.semantics.vllm_new_block_mm_keys:
            expected = request_block_hashes(self.hash_fn, self.block_size, request)
            for position, block_hash in enumerate(stored):
                chained = expected[position] if position < len(expected) else None
                if block_hash != chained:
                    raise InvariantViolation(
                        "stored hashes are the chain of the request's tokens",
                        f"request {request_id!r}, position {position}: stored {block_hash}, "
                        f"its tokens chain to {chained}",
                    )

    def _check_prefix_closure(self) -> None:
        """Full attention: every cached hash's parent is cached too (tail-first freeing)."""
        for block_hash in self.pool.index:
            parent = self.parent_of.get(block_hash)
            if parent is not None and parent not in self.pool.index:
                raise InvariantViolation(
                    "prefix closure: a cached block's parent hash is cached",
                    f"{block_hash} is cached, its parent {parent} is not",
                )
