"""The proved transition system as a pool under test: the model runs in lock step with the spec.

`ModelPool` is a `pagedkv.harness.PoolUnderTest` whose whole state is `pool_model.PoolState`
under the concrete interpretation (`algebra.CONCRETE`), and whose every state change is a fold
of the very step functions `pool_proof.py` proves preserve the invariant. So a model that
drifts from the code (a step that puts a freed block at the head, forgets an eviction, ...)
diverges from the spec in the campaign:

    pagedkv verify --layer pool --impl proofs.inductive.pool_executable:model_pool

(from the repository root; `tests/test_inductive.py` runs it). What the model leaves out is
glue here, checked by the same lock-step run: the argument checks (`pagedkv.spec.arguments`),
each refusal's wording (`pagedkv.vocab.refusals`), and the keys `cache_full_blocks` computes
from a request's tokens (the model only compares keys). Its `check_invariants()` evaluates the
proved invariant, conjunct by conjunct, on the concrete state. It emits no KV cache events (the
campaign then never turns them on for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from pagedkv.harness.protocol import PoolSnapshot
from pagedkv.spec.arguments import (
    check_cache_full_blocks,
    check_cache_key,
    check_get_new_blocks,
    check_pool,
    require_block_ids,
)
from pagedkv.spec.block_hash import block_extra_keys, block_hash, vllm_new_block_extra_keys
from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import require_int
from pagedkv.vocab.errors import InvariantViolation, NoFreeBlocksError
from pagedkv.vocab.hashes import BlockHashType, CacheKey, HashFn, key_hash
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics
from proofs.inductive import pool_model as model
from proofs.inductive.algebra import CONCRETE, Table
from proofs.inductive.pool_model import NULL, PoolParams, PoolState

Step = Callable[[PoolParams, PoolState], PoolState]
"""One single-block step, bound to its arguments (`pop`, `touch(b)`, ...)."""


class ModelPool:
    """The executable model (module docstring); speaks block ids like the spec.

    Attributes:
        params: the pool's size and switches.
        state: its state.
        usage_excludes_null_block: how `get_usage()` counts (not a state change: no step).
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> None:
        check_pool(num_gpu_blocks, enable_caching, semantics, False)
        self.params = PoolParams(
            num_gpu_blocks,
            enable_caching,
            semantics.null_block_refcounted,
            semantics.free_uncached_to_head,
        )
        self.semantics = semantics
        self.usage_excludes_null_block = semantics.usage_excludes_null_block
        self.state = model.init(CONCRETE, self.params)
        self._snapshot: tuple[PoolState, PoolSnapshot] | None = None

    # -- queries -----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return int(self.state.num_free)

    def get_usage(self) -> float:
        n: int = self.params.n
        free = self.get_num_free_blocks()
        if self.usage_excludes_null_block:
            return 1.0 - free / (n - 1) if n > 1 else 0.0
        return 1.0 - free / n

    def get_cached_block(self, block_hash: CacheKey) -> int | None:
        """The block listed first (lowest stamp) under the key, or None."""
        check_cache_key("BlockPool.get_cached_block", "block_hash", block_hash)
        listed = self._listed(block_hash)
        return listed[0] if listed else None

    def _listed(self, key: CacheKey) -> list[int]:
        row: Table = self.state.index[key]
        stamp = self.state.stamp
        return sorted((b for b, listed in row.stored() if listed), key=lambda b: stamp[b])

    # -- operations --------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` pops (refused first if the queue is shorter)."""
        count = check_get_new_blocks(num_blocks)
        if count > self.state.num_free:
            raise NoFreeBlocksError(count, self.state.num_free)
        taken = []
        for _ in range(count):
            taken.append(int(model.head(self.state)))
            self._step(model.pop_guard, partial(model.pop, CONCRETE))
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """One `touch` per id, after every id is checked."""
        touched = require_block_ids("BlockPool.touch", "blocks", block_ids)
        for b in touched:
            self._require_block(b)
        for b in touched:
            self._step(partial(model.touch_guard, b=b), partial(model.touch, CONCRETE, b=b))

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """One `release` per id, in order, after the call's preconditions hold for all."""
        freed = require_block_ids("BlockPool.free_blocks", "ordered_blocks", block_ids)
        seen: set[int] = set()
        for b in freed:
            self._require_block(b)
            if b == NULL:
                continue
            if self.state.ref[b] <= 0:
                raise refusals.free_of_free_block(b)
            if b in seen:
                raise refusals.freed_twice(b)
            seen.add(b)
        ahead = 0  # blocks this call put at the head so far
        for b in freed:
            to_head = model.released_to_head(CONCRETE, self.params, self.state, b)
            self._step(
                partial(model.release_guard, b=b, ahead=ahead),
                partial(model.release, CONCRETE, b=b, ahead=ahead),
            )
            ahead += 1 if to_head else 0

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
        """One `seal` per block to cache, with the key the spec computes for it."""
        checked = check_cache_full_blocks(
            self.params.caching,
            request,
            block_ids,
            block_hashes,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            hash_fn,
        )
        if checked is None or num_cached_blocks == num_full_blocks:
            return
        to_cache = list(checked[num_cached_blocks:num_full_blocks])
        self._require_cacheable(to_cache)
        parent = self._parent_hash(checked, block_hashes, num_cached_blocks)
        new_hashes = self._new_hashes(
            request, block_hashes, parent, num_cached_blocks, num_full_blocks, block_size, hash_fn
        )
        chain = list(block_hashes) + new_hashes
        for position, b in enumerate(to_cache, start=num_cached_blocks):
            key = chain[position]
            self._step(partial(model.seal_guard, b=b), partial(model.seal, CONCRETE, b=b, k=key))
        block_hashes.extend(new_hashes)

    def reset_prefix_cache(self) -> bool:
        """`reset`, if its guard holds; else nothing changes."""
        if not model.reset_guard(CONCRETE, self.params, self.state):
            return False
        self._step(model.reset_guard, partial(model.reset, CONCRETE))
        return True

    # -- observation -------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        """The observable state (kept until the next step: the campaign reads it per block)."""
        s, n = self.state, self.params.n
        if self._snapshot is not None and self._snapshot[0] is s:
            return self._snapshot[1]
        hashed = [b for b in range(n) if s.hashed[b]]
        index: dict[CacheKey, list[int]] = {}
        for b in sorted(hashed, key=lambda b: s.stamp[b]):
            index.setdefault(s.key[b], []).append(b)
        block_hash = [None] * n
        for b in hashed:
            block_hash[b] = s.key[b]
        snapshot = PoolSnapshot(
            free_order=tuple([s.order[i] for i in range(s.num_free)]),
            ref_cnt=tuple([s.ref[b] for b in range(n)]),
            block_hash=tuple(block_hash),
            index={key: tuple(blocks) for key, blocks in index.items()},
            num_free_blocks=self.get_num_free_blocks(),
            usage=self.get_usage(),
        )
        self._snapshot = (s, snapshot)
        return snapshot

    def check_invariants(self) -> None:
        """The proved invariant, evaluated on the state.

        Raises:
            InvariantViolation: the first conjunct that does not hold.
        """
        for name, holds in model.INVARIANTS.items():
            if not holds(CONCRETE, self.params, self.state):
                raise InvariantViolation(name, repr(self.state))

    # -- helpers -----------------------------------------------------------------------------

    def _step(self, guard: Callable[..., Any], step: Step) -> None:
        """Apply one single-block step; its guard must hold (the call's checks establish it)."""
        if not guard(CONCRETE, self.params, self.state):
            raise AssertionError(f"a step's guard fails at {self.state!r}")
        self.state = step(self.params, self.state)

    def _require_block(self, b: int) -> None:
        if not 0 <= b < self.params.n:
            raise refusals.foreign_block(b)

    def _require_cacheable(self, to_cache: list[int]) -> None:
        seen: set[int] = set()
        for b in to_cache:
            self._require_block(b)
            if b == NULL:
                continue
            if self.state.ref[b] <= 0:
                raise refusals.cache_of_free_block(b)
            if self.state.hashed[b]:
                raise refusals.hash_already_set(b)
            if b in seen:
                raise refusals.cached_twice(b)
            seen.add(b)

    def _parent_hash(
        self, checked: Sequence[int], block_hashes: list[BlockHashType], num_cached: int
    ) -> int | None:
        """The hash value position `num_cached` chains to (None at position 0)."""
        if num_cached == 0:
            return None
        parent = checked[num_cached - 1]
        self._require_block(parent)
        if parent == NULL:
            return block_hashes[num_cached - 1].hash_value
        if not self.state.hashed[parent]:
            raise refusals.parent_without_hash(parent)
        return key_hash(self.state.key[parent]).hash_value

    def _new_hashes(
        self,
        request: Request,
        block_hashes: list[BlockHashType],
        parent: int | None,
        num_cached: int,
        num_full: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> list[BlockHashType]:
        """The hashes of positions [num_cached, num_full) the request does not store yet,
        chained from `parent`, as the spec computes them."""
        new: list[BlockHashType] = []
        for position in range(num_cached, num_full):
            if position < len(block_hashes):
                parent = block_hashes[position].hash_value
                continue
            start, end = position * block_size, (position + 1) * block_size
            if request.num_tokens < end:
                raise refusals.too_few_tokens(
                    request.request_id, request.num_tokens, position, block_size
                )
            tokens = tuple(request.all_token_ids[start:end])
            if self.semantics.vllm_new_block_mm_keys:
                extra_keys = vllm_new_block_extra_keys(request, start, end)
            else:
                extra_keys = block_extra_keys(request, start, end)
            this_hash = block_hash(hash_fn, parent, tokens, extra_keys)
            require_int(
                "BlockPool.cache_full_blocks", "the value hash_fn returned", this_hash.hash_value
            )
            new.append(this_hash)
            parent = this_hash.hash_value
        return new


def model_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> ModelPool:
    """The executable model, as a pool under test (`--impl` factory)."""
    return ModelPool(num_gpu_blocks, enable_caching, semantics)
