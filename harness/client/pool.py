"""The block pool's client: every pool operation, spec and implementation in lock-step.

`PoolClient.execute` runs one operation (`harness/client/pool_ops.py`) on a `ComparedPair` of
pools: allocation, touches, frees in the caller's order, admissions as a manager makes them
(prefix lookup, touch, allocate, cache), growing sequences, lookups, resets, invalid calls
(`MISUSE`, the value catalog included), which must fail the same way on both sides and change
nothing, and takes of both pools' KV cache events. It owns every reference it was handed (a
multiset of block ids) and the requests whose blocks it caches (sequences, each side with its own
stored hash list, since `cache_full_blocks` appends the hashes it computes). Events are counted on
the spec's side. The swarm samples its operations (`harness/swarm/sampling.py`), the hypothesis
machine draws them (`harness/machines/pool.py`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from pagedkv.harness.adapters import SpecPoolAdapter, pagedkv_pool, spec_pool
from pagedkv.harness.client.catalog import POOL_HOSTILE_CALLS, PoolScene, side_name
from pagedkv.harness.client.events import EventConsumer
from pagedkv.harness.client.pool_ops import (
    Admit,
    Adopt,
    CacheBlocks,
    Finish,
    FreeAll,
    FreeSome,
    Grow,
    Hit,
    Lookup,
    Misuse,
    NewBlocks,
    NewRequest,
    PoolOp,
    Reset,
    TakeEvents,
    Touch,
)
from pagedkv.harness.client.requests import RequestRecord, new_request
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence, operation_of
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.probes import pool_probe
from pagedkv.harness.protocol import KVEventPoolFactory, PoolFactory, PoolUnderTest
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.vocab.hashes import BlockHashType, HashFn, get_hash_fn
from pagedkv.vocab.semantics import Semantics

MISUSE = (
    "negative count",
    "more blocks than free",
    "touch outside the pool",
    "free a free block",
    "free twice in one call",
    "free outside the pool",
    "cache with a bad range",
    "cache a hashed block",
    "cache without caching",
    *(f"catalog: {name}" for name in POOL_HOSTILE_CALLS),
)
"""The invalid calls of `Misuse` operations: the client's own, and every pool entry of the
value catalog (`harness/client/catalog.py`), its values drawn from the operation's `arg`."""

MAX_SEQUENCES = 4
MAX_REQUESTS = 8
"""Earlier requests a new one may follow (the most recent ones)."""


@dataclass
class Sequence:
    """A request's blocks as the client holds them; each side keeps its own stored hashes."""

    record: RequestRecord
    block_ids: list[int]
    spec_hashes: list[BlockHashType]
    impl_hashes: list[BlockHashType]
    num_cached: int = 0


class PoolClient:
    """Drives a spec pool and a pool under test with the same calls (module docstring).

    Attributes:
        pair: the two pools and the comparison schedule.
        spec: the spec pool itself (read for coverage and to keep calls valid).
        held: the references the client owns, a multiset of block ids.
        sequences: requests whose blocks the client holds and caches.
        requests: recent requests a new one may follow, oldest first.
        seen_hashes: recent block hashes, for lookups.
    """

    def __init__(
        self,
        pair: ComparedPair[PoolUnderTest],
        spec: SpecBlockPool,
        *,
        block_size: int,
        hash_fn: HashFn,
        coverage: Coverage,
        domain: Domain = FULL_DOMAIN,
    ) -> None:
        self.pair = pair
        self.domain = domain
        self.spec = spec
        self.num_blocks = spec.num_gpu_blocks
        self.enable_caching = spec.enable_caching
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.coverage = coverage
        self.held: list[int] = []
        self.sequences: list[Sequence] = []
        self.requests: list[RequestRecord] = []
        self.seen_hashes: list[BlockHashType] = []
        self.num_requests = 0
        self.events = EventConsumer()
        pair.beyond_snapshots = self._sequences_agree

    @classmethod
    def build(
        cls,
        factory: PoolFactory,
        coverage: Coverage,
        *,
        num_blocks: int,
        enable_caching: bool,
        semantics: Semantics,
        kv_events: bool,
        block_size: int,
        hash_algo: str,
        check_every: int,
        domain: Domain = FULL_DOMAIN,
    ) -> PoolClient:
        """A client over a fresh spec pool and a fresh `factory` pool (a `KVEventPoolFactory`
        when `kv_events`); pagedkv's own pool must also word each refusal as the spec does."""
        spec = spec_pool(num_blocks, enable_caching, semantics, kv_events)
        if kv_events:
            impl = cast(KVEventPoolFactory, factory)(num_blocks, enable_caching, semantics, True)
        else:
            impl = factory(num_blocks, enable_caching, semantics)
        pair: ComparedPair[PoolUnderTest] = ComparedPair(
            spec,
            impl,
            pool_probe,
            check_every=check_every,
            same_messages=factory is pagedkv_pool,
            outcomes=coverage.outcomes,
        )
        assert isinstance(spec, SpecPoolAdapter)
        return cls(
            pair,
            spec.pool,
            block_size=block_size,
            hash_fn=get_hash_fn(hash_algo),
            coverage=coverage,
            domain=domain,
        )

    def __getstate__(self) -> dict[str, object]:
        """A copy of the client and its pair (the exhaustive search's states); the copy counts
        its coverage afresh."""
        state = dict(self.__dict__)
        state["coverage"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.coverage = Coverage()

    # -- executing operations -----------------------------------------------------------------

    def execute(self, op: PoolOp) -> None:
        """Apply one operation to both pools, compare, and count what it exercised.

        Raises:
            Divergence: the two pools (or a request and the client's record of it) differ.
            InvariantViolation: the spec broke an invariant.
        """
        touched: tuple[int, ...] = ()
        if isinstance(op, NewBlocks):
            touched = self._new_blocks(op.num_blocks)
        elif isinstance(op, Touch):
            touched = self._touch(op)
        elif isinstance(op, FreeSome):
            touched = self._free_some(op)
        elif isinstance(op, FreeAll):
            self._free_all(op)
        elif isinstance(op, Admit):
            touched = self._admit(op.request)
        elif isinstance(op, Hit):
            touched = self._hit(op.request)
        elif isinstance(op, Adopt):
            self._adopt(op)
        elif isinstance(op, Grow):
            touched = self._grow(op)
        elif isinstance(op, CacheBlocks):
            touched = self._cache_blocks(op)
        elif isinstance(op, Finish):
            touched = self._finish(op)
        elif isinstance(op, Lookup):
            self._lookup(op)
        elif isinstance(op, Reset):
            self._reset()
        elif isinstance(op, TakeEvents):
            self.events.take(self.pair, self.coverage, self.spec.index)
        else:
            self._misuse(op)
        self._end(touched)

    def finish_run(self) -> None:
        """The end of the run: a full check of both pools and of every request."""
        self.pair.full_check("the end of the run")

    def _end(self, touched: tuple[int, ...]) -> None:
        self.pair.end_step(touched)
        coverage = self.coverage
        coverage.steps += 1
        spec = self.spec
        coverage.states.add(hash((self.num_blocks, len(spec.index), *spec.ref_cnt)))

    def _sequences_agree(self) -> None:
        """Each sequence's stored hashes are equal on both sides, and each request is what the
        client sent (every full check runs this)."""
        for sequence in self.sequences:
            if sequence.spec_hashes != sequence.impl_hashes:
                raise Divergence(
                    f"stored hashes of {sequence.record.request_id} differ: spec "
                    f"{sequence.spec_hashes}, the one under test {sequence.impl_hashes}",
                    "state",
                    "cache_full_blocks",
                    "stored hashes",
                )
        for record in self.requests:
            record.check_all("step")

    def _new_blocks(self, count: int) -> tuple[int, ...]:
        count = min(count, self.spec.get_num_free_blocks())
        hashed_before = list(self.spec.block_hash)
        result, error = self.pair.call(
            "get_new_blocks",
            lambda pool: pool.get_new_blocks(count),
            lambda: f"get_new_blocks({count})",
        )
        if error is not None or result is None:
            self._error(error)
            return ()
        self.held.extend(result)
        counts = self.coverage.counts
        counts["blocks handed out"] += len(result)
        counts["evictions of cached blocks"] += sum(
            1 for block_id in result if hashed_before[block_id] is not None
        )
        return tuple(result)

    def _touch(self, op: Touch) -> tuple[int, ...]:
        block_ids = [block_id % self.num_blocks for block_id in op.block_ids]
        spec = self.spec
        free_cached = sum(
            1 for b in set(block_ids) if b and spec.ref_cnt[b] == 0 and spec.block_hash[b]
        )
        as_iterator = op.as_iterator  # an iterator is read once, whatever the pool does with it
        _, error = self.pair.call(
            "touch",
            lambda pool: pool.touch(iter(block_ids) if as_iterator else block_ids),
            lambda: f"touch({'iter(' * as_iterator}{block_ids}{')' * as_iterator})",
        )
        if error is not None:
            self._error(error)
            return ()
        self.held.extend(block_id for block_id in block_ids if block_id != 0)
        self.coverage.counts["touches of free cached blocks"] += free_cached
        return tuple(block_ids)

    def _free(self, block_ids: list[int]) -> bool:
        """free_blocks on both; on success the references leave `held`."""
        _, error = self.pair.call(
            "free_blocks",
            lambda pool: pool.free_blocks(block_ids),
            lambda: f"free_blocks({block_ids})",
        )
        if error is not None:
            self._error(error)
            return False
        for block_id in block_ids:
            if block_id != 0:
                self.held.remove(block_id)
        self.coverage.counts["blocks freed"] += sum(1 for block_id in block_ids if block_id)
        return True

    def _releasable(self) -> list[int]:
        """The blocks the client may free or list anew: every block it holds, or, when the
        domain keeps listed blocks held, those it holds more often than sequences list them."""
        if self.domain.listed_blocks_freed:
            return sorted(set(self.held))
        spare = Counter(self.held)
        for sequence in self.sequences:
            spare.subtract(set(sequence.block_ids))
        return sorted(block_id for block_id, count in spare.items() if count > 0)

    def _free_some(self, op: FreeSome) -> tuple[int, ...]:
        candidates = [*self._releasable(), 0]  # the null block is passed over
        block_ids = list(dict.fromkeys(candidates[pick % len(candidates)] for pick in op.picks))
        self._free(block_ids)
        return tuple(block_ids)

    def _free_all(self, op: FreeAll) -> None:
        if not self.domain.listed_blocks_freed:
            while self.sequences:  # each request's blocks, tail first, as a manager frees them
                self._finish(Finish(0))
        shuffle = random.Random(op.order).shuffle
        while self.held:
            block_ids = sorted(set(self.held))
            shuffle(block_ids)
            if not self._free(block_ids):
                return

    def _request(self, wish: NewRequest) -> RequestRecord:
        self.num_requests += 1
        request_id = f"req-{self.num_requests}"
        tokens = list(wish.tokens)
        lora, mm, salt = wish.lora, self.domain.multimodal_inputs(wish.mm), wish.salt
        if wish.follow >= 0 and self.requests:
            earlier = self.requests[wish.follow % len(self.requests)]
            tokens = [*earlier.tokens[: wish.follow_len], *tokens]
            lora, salt, mm = earlier.lora_id, earlier.cache_salt, earlier.mm
        mm = tuple(entry for entry in mm if entry[0] + entry[1] <= len(tokens))
        record = new_request(request_id, tokens, mm, lora, salt)
        self.requests.append(record)
        if len(self.requests) > MAX_REQUESTS:
            del self.requests[0]
        return record

    def _chain(self, record: RequestRecord) -> list[BlockHashType]:
        hashes = request_block_hashes(self.hash_fn, self.block_size, record.request)
        self.seen_hashes.extend(hashes)
        if len(self.seen_hashes) > 32:
            del self.seen_hashes[: len(self.seen_hashes) - 32]
        return hashes

    def _lookup_prefix(self, hashes: list[BlockHashType]) -> list[int]:
        """The cached prefix of a chain, looked up hash by hash on both sides until a miss."""
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self._lookup_hash(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _lookup_hash(self, block_hash: BlockHashType) -> int | None:
        result, _ = self.pair.call(
            "get_cached_block",
            lambda pool: pool.get_cached_block(block_hash),
            lambda: f"get_cached_block({block_hash})",
        )
        if result is not None:
            self.coverage.counts["cache hits"] += 1
        return result

    def _admit(self, wish: NewRequest) -> tuple[int, ...]:
        if len(self.sequences) >= MAX_SEQUENCES:
            return ()
        record = self._request(wish)
        hashes = self._chain(record)
        hits = self._lookup_prefix(hashes)
        spec = self.spec
        num_needed = -(-record.num_tokens // self.block_size) - len(hits)
        evictable = sum(1 for block_id in hits if spec.ref_cnt[block_id] == 0)
        if num_needed > spec.get_num_free_blocks() - evictable:
            return ()  # does not fit: a manager would return None and change nothing
        if not self._touch_hits(hits):
            return ()
        new_ids = self._new_blocks(num_needed)
        sequence = Sequence(
            record, hits + list(new_ids), list(hashes), list(hashes), num_cached=len(hits)
        )
        self.sequences.append(sequence)
        if self.enable_caching:
            self._seal(sequence, sequence.num_cached, record.num_tokens // self.block_size)
        return tuple(sequence.block_ids)

    def _touch_hits(self, hits: list[int]) -> bool:
        spec = self.spec
        free_cached = sum(1 for b in set(hits) if spec.ref_cnt[b] == 0)
        _, error = self.pair.call("touch", lambda pool: pool.touch(hits), lambda: f"touch({hits})")
        if error is not None:
            self._error(error)
            return False
        self.held.extend(hits)
        self.coverage.counts["touches of free cached blocks"] += free_cached
        return True

    def _hit(self, wish: NewRequest) -> tuple[int, ...]:
        if len(self.sequences) >= MAX_SEQUENCES:
            return ()
        record = self._request(wish)
        hashes = self._chain(record)
        hits = self._lookup_prefix(hashes)
        if self._touch_hits(hits):
            self.sequences.append(
                Sequence(record, hits, list(hashes), list(hashes), num_cached=len(hits))
            )
        return tuple(hits)

    def _adopt(self, op: Adopt) -> None:
        """A sequence over held blocks, with some hashes stored: `cache_full_blocks` then reads
        stored hashes past the cached blocks (a manager does after a preemption)."""
        if len(self.sequences) >= MAX_SEQUENCES or not self.held:
            return
        candidates = self._releasable()
        if not candidates:
            return
        record = self._request(op.request)
        picked = list(dict.fromkeys(candidates[pick % len(candidates)] for pick in op.picks))
        hashes = self._chain(record)
        stored = hashes[: max(op.num_stored, 0)]
        self.sequences.append(Sequence(record, picked, list(stored), list(stored)))

    def _grow(self, op: Grow) -> tuple[int, ...]:
        if not self.sequences:
            return ()
        sequence = self.sequences[op.which % len(self.sequences)]
        record = sequence.record
        record.append(list(op.tokens))
        record.check("Grow")
        block_size = self.block_size
        missing = -(-record.num_tokens // block_size) - len(sequence.block_ids)
        new_ids: tuple[int, ...] = ()
        if 0 < missing <= self.spec.get_num_free_blocks():
            new_ids = self._new_blocks(missing)
            sequence.block_ids.extend(new_ids)
        if self.enable_caching:
            self._seal(sequence, sequence.num_cached, self._max_valid_full(sequence))
        return new_ids

    def _cache_blocks(self, op: CacheBlocks) -> tuple[int, ...]:
        if not self.sequences or not self.enable_caching:
            return ()
        sequence = self.sequences[op.which % len(self.sequences)]
        num_full = max(sequence.num_cached, min(op.num_full, self._max_valid_full(sequence)))
        self._seal(sequence, sequence.num_cached, num_full)
        return tuple(sequence.block_ids)

    def _max_valid_full(self, sequence: Sequence) -> int:
        """The most full blocks a valid cache_full_blocks call may pass for this sequence now:
        held, distinct, unhashed blocks after a hashed parent, full of tokens."""
        spec = self.spec
        num_full = sequence.num_cached
        block_ids = sequence.block_ids
        if num_full > 0:
            parent = block_ids[num_full - 1]
            if spec.block_hash[parent] is None:
                return num_full  # nothing to chain to
        limit = min(len(block_ids), sequence.record.num_tokens // self.block_size)
        seen: set[int] = set()
        while num_full < limit:
            block_id = block_ids[num_full]
            if (
                block_id == 0
                or block_id in seen
                or spec.ref_cnt[block_id] <= 0
                or spec.block_hash[block_id] is not None
            ):
                break
            seen.add(block_id)
            num_full += 1
        return num_full

    def _seal(self, sequence: Sequence, num_cached: int, num_full: int) -> bool:
        """cache_full_blocks on both, each side with its own stored hashes."""
        request, block_ids = sequence.record.request, sequence.block_ids
        block_size, hash_fn = self.block_size, self.hash_fn

        def call(pool: PoolUnderTest) -> None:
            hashes = sequence.spec_hashes if pool is self.pair.spec else sequence.impl_hashes
            pool.cache_full_blocks(
                request, block_ids, hashes, num_cached, num_full, block_size, hash_fn
            )

        _, error = self.pair.call(
            "cache_full_blocks",
            call,
            lambda: (
                f"cache_full_blocks({request.request_id}, {block_ids}, {num_cached}, {num_full})"
            ),
        )
        if error is not None:
            self._error(error)
            return False
        if num_cached == sequence.num_cached:
            self.coverage.counts["blocks cached"] += max(num_full - num_cached, 0)
            sequence.num_cached = max(num_full, num_cached)
            self.seen_hashes.extend(sequence.spec_hashes[-4:])
        return True

    def _finish(self, op: Finish) -> tuple[int, ...]:
        if not self.sequences:
            return ()
        sequence = self.sequences.pop(op.which % len(self.sequences))
        held = set(self.held)
        block_ids = [b for b in dict.fromkeys(reversed(sequence.block_ids)) if b in held]
        self._free(block_ids)
        return tuple(block_ids)

    def _lookup(self, op: Lookup) -> None:
        made_up = BlockHashType(0, (0,) * self.block_size, None)
        seen = self.seen_hashes
        pick = op.pick % (len(seen) + 1)
        self._lookup_hash(seen[pick] if pick < len(seen) else made_up)

    def _reset(self) -> None:
        reset, _ = self.pair.call("reset_prefix_cache", lambda pool: pool.reset_prefix_cache())
        if reset:
            self.coverage.counts["successful prefix-cache resets"] += 1
            self.pair.full_check("a prefix-cache reset")

    def _misuse(self, op: Misuse) -> None:
        spec, n, arg = self.spec, self.num_blocks, op.arg
        kind = op.kind
        held = sorted(set(self.held))
        if kind == "negative count":
            self._refused("get_new_blocks", lambda pool: pool.get_new_blocks(-1 - arg % 2))
        elif kind == "more blocks than free":
            count = spec.get_num_free_blocks() + 1 + arg % 3
            self._refused(f"get_new_blocks({count})", lambda pool: pool.get_new_blocks(count))
        elif kind == "touch outside the pool":
            ids = [(-1, n, n + 7)[arg % 3]]
            self._refused(f"touch({ids})", lambda pool: pool.touch(ids))
        elif kind == "free a free block" and spec.free_order:
            ids = [*held[:1], spec.free_order[arg % len(spec.free_order)]]
            self._refused(f"free_blocks({ids})", lambda pool: pool.free_blocks(ids))
        elif kind == "free twice in one call" and held:
            twice = held[arg % len(held)]
            ids = [twice, *held[:1], twice] if spec.ref_cnt[twice] == 1 else [twice] * 3
            self._refused(f"free_blocks({ids})", lambda pool: pool.free_blocks(ids))
        elif kind == "free outside the pool":
            ids = [*held[:1], (-1, n, n + 7)[arg % 3]]
            self._refused(f"free_blocks({ids})", lambda pool: pool.free_blocks(ids))
        elif kind.startswith("cache") and self.sequences:
            self._bad_cache(kind, self.sequences[arg % len(self.sequences)], arg)
        elif kind.startswith("catalog: ") and self.sequences:
            self._catalog_call(kind.removeprefix("catalog: "), arg)

    def _catalog_call(self, name: str, arg: int) -> None:
        """Entry `name` of the hostile catalog, about one of the sequences, values from `arg`."""
        sequence = self.sequences[arg % len(self.sequences)]
        scene = PoolScene(
            sequence.record.request,
            tuple(sequence.block_ids),
            tuple(sequence.spec_hashes),
            self.block_size,
            self.hash_fn,
        )
        shown, side_call = POOL_HOSTILE_CALLS[name](random.Random(arg), scene)
        spec = self.pair.spec
        self._refused(shown, lambda pool: side_call(pool, side_name(pool, spec)))

    def _bad_cache(self, kind: str, sequence: Sequence, arg: int) -> None:
        request, block_ids = sequence.record.request, sequence.block_ids
        num_cached, num_full = sequence.num_cached, len(block_ids)
        if kind == "cache with a bad range":
            num_cached, num_full = (
                (num_cached, len(block_ids) + 1),
                (-1, num_full),
                (num_cached + 1, num_cached),
            )[arg % 3]
        elif kind == "cache a hashed block":
            if not num_cached:
                return
            num_cached, num_full = 0, num_cached
        elif self.enable_caching:
            return  # "cache without caching" needs a pool with caching off
        hashes = list(sequence.spec_hashes)
        self._refused(
            f"cache_full_blocks({request.request_id}, {block_ids}, {num_cached}, {num_full})",
            lambda pool: pool.cache_full_blocks(
                request,
                block_ids,
                list(hashes),
                num_cached,
                num_full,
                self.block_size,
                self.hash_fn,
            ),
        )

    def _refused(self, label: str, call: Callable[[PoolUnderTest], object]) -> None:
        """A call expected to be refused, shown as `label` (its operation: before the "(")."""
        _, error = self.pair.refused_call(operation_of(label), call, lambda: label)
        if error is not None:
            self._error(error)

    def _error(self, error: Exception | None) -> None:
        if error is not None:
            self.coverage.counts[f"typed error {type(error).__name__}"] += 1
