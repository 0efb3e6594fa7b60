"""The swarm engine's block-pool driver: every pool operation, spec and implementation in lock-step.

`PoolDriver` holds a `ComparedPair` of pools built from a `PoolRun`, and the references it owns
(a multiset of block ids) and the requests whose blocks it caches (sequences, each side with its
own stored hash list, since `cache_full_blocks` appends the hashes it computes). It draws and
executes `harness/pool_ops.py` operations: allocation, touches, frees in the caller's order,
admissions as a manager makes them (prefix lookup, touch, allocate, cache), growing sequences,
lookups, resets, invalid calls (`MISUSE`, the hostile catalog included), which must fail the
same way on both sides and change nothing, and, in runs with KV cache events on, takes of both
pools' events (`harness/swarm_events.py`). Events are counted on the spec's side.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from pagedkv.harness.adapters import SpecPoolAdapter, pagedkv_pool, spec_pool
from pagedkv.harness.catalog_draws import draw_entry, side_name
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.hostile_calls import POOL_HOSTILE_CALLS, PoolScene
from pagedkv.harness.lockstep import Divergence
from pagedkv.harness.pool_ops import (
    Admit,
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
from pagedkv.harness.probes import pool_probe
from pagedkv.harness.protocol import KVEventPoolFactory, PoolFactory, PoolUnderTest
from pagedkv.harness.requests import MM_HASHES, SALTS
from pagedkv.harness.swarm_events import EventTakes, take_events
from pagedkv.harness.swarm_runs import OperationPicker, PoolRun
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.vocab.hashes import BlockHashType, HashFn, get_hash_fn
from pagedkv.vocab.request import PlaceholderRange, Request
from pagedkv.vocab.semantics import PAGEDKV

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
"""The invalid calls the pool driver makes: its own, and every entry of the state machines'
catalog (`harness/hostile_calls.py`), drawn through `harness/catalog_draws.py`."""

MAX_SEQUENCES = 4


@dataclass
class _Sequence:
    """A request's blocks as the driver holds them; each side keeps its own stored hashes."""

    request: Request
    block_ids: list[int]
    spec_hashes: list[BlockHashType]
    impl_hashes: list[BlockHashType]
    num_cached: int = 0


class PoolDriver:
    """Drives a spec pool and a pool under test with the same calls (module docstring)."""

    def __init__(
        self,
        run: PoolRun,
        factory: PoolFactory,
        coverage: Coverage,
        *,
        check_every: int | None = None,
    ) -> None:
        self.run = run
        spec = spec_pool(run.num_blocks, run.enable_caching, run.semantics, run.kv_events)
        if run.kv_events:  # a KVEventPoolFactory (the layer knows)
            impl = cast(KVEventPoolFactory, factory)(
                run.num_blocks, run.enable_caching, run.semantics, True
            )
        else:
            impl = factory(run.num_blocks, run.enable_caching, run.semantics)
        self.pair: ComparedPair[PoolUnderTest] = ComparedPair(
            spec,
            impl,
            pool_probe(spec),
            pool_probe(impl),
            check_every=check_every or run.check_every,
            same_messages=factory is pagedkv_pool,
            beyond_snapshots=self._stored_hashes_agree,
        )
        assert isinstance(spec, SpecPoolAdapter)
        self._spec = spec.pool  # read for coverage and to keep calls valid
        self.coverage = coverage
        self.hash_fn: HashFn = get_hash_fn(run.hash_algo)
        self.held: list[int] = []
        self.sequences: list[_Sequence] = []
        self.requests: list[Request] = []
        self.seen_hashes: list[BlockHashType] = []
        self.num_requests = 0
        self._pick = OperationPicker(run.weights).pick
        self._takes = EventTakes(run.seed, run.kv_events)
        coverage.start_run(run.histogram_keys())

    # -- drawing operations -------------------------------------------------------------------

    def generate(self, rng: random.Random) -> PoolOp:
        if self._takes.due():
            return TakeEvents()
        kind = self._pick(rng)
        n = self.run.num_blocks
        if kind == "get_new_blocks":
            return NewBlocks(rng.randint(0, max(1, n // 4)))
        if kind == "touch":
            return Touch(tuple(rng.randrange(n) for _ in range(rng.randint(0, 3))))
        if kind == "free_blocks":
            return FreeSome(tuple(rng.getrandbits(16) for _ in range(rng.randint(0, 4))))
        if kind == "free everything":
            return FreeAll(rng.getrandbits(32))
        if kind == "admit":
            return Admit(self._draw_request(rng))
        if kind == "hit":
            return Hit(self._draw_request(rng))
        if kind == "grow":
            count = rng.randint(0, 2 * self.run.block_size)
            return Grow(rng.getrandbits(16), tuple(rng.choices(range(self.run.alphabet), k=count)))
        if kind == "cache_full_blocks":
            return CacheBlocks(rng.getrandbits(16), rng.randint(0, 8))
        if kind == "finish":
            return Finish(rng.getrandbits(16))
        if kind == "get_cached_block":
            return Lookup(rng.getrandbits(16))
        if kind == "reset":
            return Reset()
        return Misuse(rng.choice(MISUSE), rng.getrandbits(16))

    def _draw_request(self, rng: random.Random) -> NewRequest:
        block_size = self.run.block_size
        follow, follow_len = -1, 0
        if self.requests and rng.random() < 0.5:
            follow = rng.randrange(len(self.requests))
            follow_len = block_size * rng.randint(1, 4) + rng.choice((0, 0, 1))
        count = rng.randint(0 if follow >= 0 else 1, 4 * block_size)
        tokens = tuple(rng.choices(range(self.run.alphabet), k=count))
        lora: int | None = None
        mm: tuple[tuple[int, int, str], ...] = ()
        salt: str | None = None
        if self.run.extra_keys and follow < 0:
            lora = rng.choice((None, None, 1, 2))
            if self.run.semantics == PAGEDKV:
                salt = rng.choice((None, None, *SALTS))
            if count and rng.random() < 0.4:
                start = rng.randrange(count)
                mm = ((start, rng.randint(1, count - start), rng.choice(MM_HASHES)),)
        return NewRequest(tokens, follow, follow_len, lora, mm, salt)

    # -- executing operations -----------------------------------------------------------------

    def execute(self, op: PoolOp) -> None:
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
            take_events(self.pair, self.coverage)
        else:
            self._misuse(op)
        self._end(touched)

    def finish_run(self) -> None:
        self.pair.full_check("the end of the run")

    def _end(self, touched: tuple[int, ...]) -> None:
        self.pair.end_step(touched)
        coverage = self.coverage
        coverage.steps += 1
        spec = self._spec
        coverage.states.add(hash((self.run.num_blocks, len(spec.index), *spec.ref_cnt)))

    def _stored_hashes_agree(self) -> None:
        for sequence in self.sequences:
            if sequence.spec_hashes != sequence.impl_hashes:
                raise Divergence(
                    f"stored hashes of {sequence.request.request_id} differ: spec "
                    f"{sequence.spec_hashes}, the one under test {sequence.impl_hashes}"
                )

    def _new_blocks(self, count: int) -> tuple[int, ...]:
        count = min(count, self._spec.get_num_free_blocks())
        hashed_before = list(self._spec.block_hash)
        result, error = self.pair.call(
            lambda: f"get_new_blocks({count})", lambda pool: pool.get_new_blocks(count)
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
        block_ids = list(op.block_ids)
        spec = self._spec
        free_cached = sum(
            1 for b in set(block_ids) if b and spec.ref_cnt[b] == 0 and spec.block_hash[b]
        )
        _, error = self.pair.call(lambda: f"touch({block_ids})", lambda pool: pool.touch(block_ids))
        if error is not None:
            self._error(error)
            return ()
        self.held.extend(block_id for block_id in block_ids if block_id != 0)
        self.coverage.counts["touches of free cached blocks"] += free_cached
        return tuple(block_ids)

    def _free(self, block_ids: list[int]) -> bool:
        """free_blocks on both; on success the references leave `held`."""
        _, error = self.pair.call(
            lambda: f"free_blocks({block_ids})", lambda pool: pool.free_blocks(block_ids)
        )
        if error is not None:
            self._error(error)
            return False
        for block_id in block_ids:
            if block_id != 0:
                self.held.remove(block_id)
        self.coverage.counts["blocks freed"] += sum(1 for block_id in block_ids if block_id)
        return True

    def _free_some(self, op: FreeSome) -> tuple[int, ...]:
        candidates = [*sorted(set(self.held)), 0]  # the null block is passed over
        block_ids = list(dict.fromkeys(candidates[pick % len(candidates)] for pick in op.picks))
        self._free(block_ids)
        return tuple(block_ids)

    def _free_all(self, op: FreeAll) -> None:
        shuffle = random.Random(op.order).shuffle
        while self.held:
            block_ids = sorted(set(self.held))
            shuffle(block_ids)
            if not self._free(block_ids):
                return

    def _request(self, wish: NewRequest) -> Request:
        self.num_requests += 1
        request_id = f"req-{self.num_requests}"
        tokens = list(wish.tokens)
        lora, mm, salt = wish.lora, wish.mm, wish.salt
        if wish.follow >= 0 and self.requests:
            earlier = self.requests[wish.follow % len(self.requests)]
            tokens = [*earlier.all_token_ids[: wish.follow_len], *tokens]
            lora, salt = earlier.lora_id, earlier.cache_salt
            mm = tuple(
                (position.offset, position.length, h)
                for position, h in zip(earlier.mm_positions, earlier.mm_hashes, strict=True)
            )
        mm = tuple(entry for entry in mm if entry[0] + entry[1] <= len(tokens))
        request = Request(
            request_id,
            tokens,
            mm_positions=[PlaceholderRange(start, length) for start, length, _ in mm],
            mm_hashes=[h for _, _, h in mm],
            lora_id=lora,
            cache_salt=salt,
        )
        self.requests.append(request)
        if len(self.requests) > 8:
            del self.requests[0]
        return request

    def _chain(self, request: Request) -> list[BlockHashType]:
        hashes = request_block_hashes(self.hash_fn, self.run.block_size, request)
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
            lambda: f"get_cached_block({block_hash})",
            lambda pool: pool.get_cached_block(block_hash),
        )
        if result is not None:
            self.coverage.counts["cache hits"] += 1
        return result

    def _admit(self, wish: NewRequest) -> tuple[int, ...]:
        if len(self.sequences) >= MAX_SEQUENCES:
            return ()
        request = self._request(wish)
        hashes = self._chain(request)
        hits = self._lookup_prefix(hashes)
        spec = self._spec
        num_needed = -(-request.num_tokens // self.run.block_size) - len(hits)
        evictable = sum(1 for block_id in hits if spec.ref_cnt[block_id] == 0)
        if num_needed > spec.get_num_free_blocks() - evictable:
            return ()  # does not fit: a manager would return None and change nothing
        if not self._touch_hits(hits):
            return ()
        new_ids = self._new_blocks(num_needed)
        sequence = _Sequence(
            request, hits + list(new_ids), list(hashes), list(hashes), num_cached=len(hits)
        )
        self.sequences.append(sequence)
        if self.run.enable_caching:
            self._seal(sequence, sequence.num_cached, request.num_tokens // self.run.block_size)
        return tuple(sequence.block_ids)

    def _touch_hits(self, hits: list[int]) -> bool:
        spec = self._spec
        free_cached = sum(1 for b in set(hits) if spec.ref_cnt[b] == 0)
        _, error = self.pair.call(lambda: f"touch({hits})", lambda pool: pool.touch(hits))
        if error is not None:
            self._error(error)
            return False
        self.held.extend(hits)
        self.coverage.counts["touches of free cached blocks"] += free_cached
        return True

    def _hit(self, wish: NewRequest) -> tuple[int, ...]:
        if len(self.sequences) >= MAX_SEQUENCES:
            return ()
        request = self._request(wish)
        hashes = self._chain(request)
        hits = self._lookup_prefix(hashes)
        if self._touch_hits(hits):
            self.sequences.append(
                _Sequence(request, hits, list(hashes), list(hashes), num_cached=len(hits))
            )
        return tuple(hits)

    def _grow(self, op: Grow) -> tuple[int, ...]:
        if not self.sequences:
            return ()
        sequence = self.sequences[op.which % len(self.sequences)]
        request = sequence.request
        request.append_output_token_ids(list(op.tokens))
        block_size = self.run.block_size
        missing = -(-request.num_tokens // block_size) - len(sequence.block_ids)
        new_ids: tuple[int, ...] = ()
        if 0 < missing <= self._spec.get_num_free_blocks():
            new_ids = self._new_blocks(missing)
            sequence.block_ids.extend(new_ids)
        if self.run.enable_caching:
            self._seal(sequence, sequence.num_cached, self._max_valid_full(sequence))
        return new_ids

    def _cache_blocks(self, op: CacheBlocks) -> tuple[int, ...]:
        if not self.sequences or not self.run.enable_caching:
            return ()
        sequence = self.sequences[op.which % len(self.sequences)]
        num_full = max(sequence.num_cached, min(op.num_full, self._max_valid_full(sequence)))
        self._seal(sequence, sequence.num_cached, num_full)
        return tuple(sequence.block_ids)

    def _max_valid_full(self, sequence: _Sequence) -> int:
        """The most full blocks a valid cache_full_blocks call may pass for this sequence now:
        held, distinct, unhashed blocks after a hashed parent, full of tokens."""
        spec = self._spec
        num_full = sequence.num_cached
        block_ids = sequence.block_ids
        if num_full > 0:
            parent = block_ids[num_full - 1]
            if spec.block_hash[parent] is None:
                return num_full  # nothing to chain to
        limit = min(len(block_ids), sequence.request.num_tokens // self.run.block_size)
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

    def _seal(self, sequence: _Sequence, num_cached: int, num_full: int) -> bool:
        """cache_full_blocks on both, each side with its own stored hashes."""
        request, block_ids = sequence.request, sequence.block_ids
        block_size, hash_fn = self.run.block_size, self.hash_fn

        def call(pool: PoolUnderTest) -> None:
            hashes = sequence.spec_hashes if pool is self.pair.spec else sequence.impl_hashes
            pool.cache_full_blocks(
                request, block_ids, hashes, num_cached, num_full, block_size, hash_fn
            )

        _, error = self.pair.call(
            lambda: (
                f"cache_full_blocks({request.request_id}, {block_ids}, {num_cached}, {num_full})"
            ),
            call,
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
        made_up = BlockHashType(0, (0,) * self.run.block_size, None)
        seen = self.seen_hashes
        pick = op.pick % (len(seen) + 1)
        self._lookup_hash(seen[pick] if pick < len(seen) else made_up)

    def _reset(self) -> None:
        reset, _ = self.pair.call(
            lambda: "reset_prefix_cache()", lambda pool: pool.reset_prefix_cache()
        )
        if reset:
            self.coverage.counts["successful prefix-cache resets"] += 1
            self.pair.full_check("a prefix-cache reset")

    def _misuse(self, op: Misuse) -> None:
        spec, n, arg = self._spec, self.run.num_blocks, op.arg
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
            sequence.request,
            tuple(sequence.block_ids),
            tuple(sequence.spec_hashes),
            self.run.block_size,
            self.hash_fn,
        )
        shown, side_call = draw_entry(POOL_HOSTILE_CALLS, name, scene, arg)
        spec = self.pair.spec
        self._refused(shown, lambda pool: side_call(pool, side_name(pool, spec)))

    def _bad_cache(self, kind: str, sequence: _Sequence, arg: int) -> None:
        request, block_ids = sequence.request, sequence.block_ids
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
        elif self.run.enable_caching:
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
                self.run.block_size,
                self.hash_fn,
            ),
        )

    def _refused(self, label: str, call: Callable[[PoolUnderTest], object]) -> None:
        _, error = self.pair.refused_call(lambda: label, call)
        if error is not None:
            self._error(error)

    def _error(self, error: Exception | None) -> None:
        if error is not None:
            self.coverage.counts[f"typed error {type(error).__name__}"] += 1
