"""The differential state machine for the block pool: spec and a pool under test, in lock-step.

Every rule applies the same call to both pools. A call must succeed in both with equal results,
or raise the same exception class in both and leave both unchanged. After every step the whole
observable state (free order, ref counts, hashes, index, counters, and the KV cache events not yet
taken) must be equal, and both `check_invariants()` must pass. Events are on in most examples when
the factory can emit them; each taken batch is also replayed by a consumer the machine keeps, which
must then hold the index (`pagedkv.events.index.replay_hash_counts`). Pools are tiny (2-16
blocks) and tokens come from a 2-3 letter alphabet, so exhaustion, eviction, reuse and prefix
collisions happen constantly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, cast

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from pagedkv.block_counts import cdiv
from pagedkv.events.index import index_hash_counts, replay_hash_counts
from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.hostile_calls import POOL_HOSTILE_CALLS, PoolScene, draw_hostile_call
from pagedkv.harness.lockstep import CampaignStats, Divergence, LockstepMachine
from pagedkv.harness.protocol import (
    EmitsKVEvents,
    KVEventPoolFactory,
    PoolFactory,
    PoolUnderTest,
)
from pagedkv.harness.requests import requests
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.vocab.hashes import BlockHashType, HashFn, get_hash_fn
from pagedkv.vocab.kv_events import KVCacheEvent, KVEventReplayError
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, Semantics


@dataclass
class _Sequence:
    """A request's blocks as the test drives them; each side keeps its own stored hashes."""

    request: Request
    block_ids: list[int]
    spec_hashes: list[BlockHashType]
    impl_hashes: list[BlockHashType]
    num_cached: int = 0


class PoolMachine(LockstepMachine):
    """Spec vs `factory` pool. Subclass via `make_pool_machine` to choose what is tested."""

    factory: ClassVar[PoolFactory] = staticmethod(pagedkv_pool)
    semantics: ClassVar[Semantics] = PAGEDKV
    domain: ClassVar[Domain] = FULL_DOMAIN
    kv_events: ClassVar[bool] = True  # the factory is a KVEventPoolFactory: compare events

    def __init__(self) -> None:
        super().__init__()
        self.spec: PoolUnderTest
        self.impl: PoolUnderTest
        self.held: list[int] = []  # references this test owns (a multiset of block ids)
        self.sequences: list[_Sequence] = []
        self.seen_hashes: list[BlockHashType] = []
        self.drawn: list[Request] = []  # every request drawn so far, oldest first
        self.num_requests = 0
        self.events_on = False
        self.consumer: Counter[int] = Counter()  # a replay of every batch taken so far

    # -- set-up -------------------------------------------------------------------------------

    @initialize(
        num_gpu_blocks=st.one_of(st.integers(2, 6), st.integers(2, 16)),  # mostly tiny
        enable_caching=st.sampled_from((True, True, True, False)),
        block_size=st.integers(1, 4),
        alphabet=st.integers(2, 3),
        hash_algo=st.sampled_from(("sha256", "builtin")),
        kv_events=st.sampled_from((True, True, True, False)),
    )
    def setup(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        block_size: int,
        alphabet: int,
        hash_algo: str,
        kv_events: bool,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.alphabet = alphabet
        self.hash_fn: HashFn = get_hash_fn(hash_algo)
        self.events_on = kv_events and self.kv_events
        self.spec = spec_pool(num_gpu_blocks, enable_caching, self.semantics, self.events_on)
        if self.events_on:
            factory = cast(KVEventPoolFactory, type(self).factory)
            self.impl = factory(
                num_gpu_blocks, enable_caching, self.semantics, enable_kv_cache_events=True
            )
        else:
            self.impl = type(self).factory(num_gpu_blocks, enable_caching, self.semantics)
        self.stats.examples += 1

    # -- rules --------------------------------------------------------------------------------

    @rule(data=st.data())
    def get_new_blocks(self, data: st.DataObject) -> None:
        assert self.spec is not None
        misuse = self.draw_misuse(data)
        top = self.num_gpu_blocks if misuse else self.spec.get_num_free_blocks()
        num_blocks = data.draw(st.integers(-1 if misuse else 0, top), label="num_blocks")
        outcome = self.both(
            f"get_new_blocks({num_blocks})", lambda pool, _: pool.get_new_blocks(num_blocks)
        )
        if outcome.ok and outcome.result is not None:
            self.held.extend(outcome.result)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        misuse = self.draw_misuse(data)
        low, high = (-1, self.num_gpu_blocks) if misuse else (0, self.num_gpu_blocks - 1)
        block_ids = data.draw(st.lists(st.integers(low, high), max_size=3), label="block_ids")
        # An iterator is read once, whatever the pool does with it.
        as_iterator = data.draw(st.sampled_from((False, False, True)), label="as an iterator")
        shown = f"touch(iter({block_ids}))" if as_iterator else f"touch({block_ids})"
        if self.outcome_ok(
            shown,
            lambda pool, _: pool.touch(iter(block_ids) if as_iterator else block_ids),
        ):
            self.held.extend(block_id for block_id in block_ids if block_id != 0)

    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        candidates = [*sorted(set(self.held)), 0]  # the null block is passed over
        block_ids = data.draw(
            st.lists(st.sampled_from(candidates), unique=True, max_size=4), label="block_ids"
        )
        if self.draw_misuse(data):
            # an already-free block, a duplicate, or a block of no pool
            wrong = data.draw(st.integers(-1, self.num_gpu_blocks), label="wrong id")
            block_ids.insert(data.draw(st.integers(0, len(block_ids)), label="at"), wrong)
        self.free(block_ids)

    @rule(data=st.data())
    def free_everything(self, data: st.DataObject) -> None:
        """Release every held reference, in rounds of distinct blocks, in a drawn order."""
        while self.held:
            block_ids = data.draw(st.permutations(sorted(set(self.held))), label="order")
            if not self.free(block_ids):
                return

    @precondition(lambda self: len(self.sequences) < 4)
    @rule(data=st.data())
    def new_sequence(self, data: st.DataObject) -> None:
        """A request whose blocks are some of the held ones, maybe with hashes already stored."""
        request = self.draw_request(data)
        max_blocks = cdiv(request.num_tokens, self.block_size) + 1
        misuse = self.draw_misuse(data)
        if misuse:
            pool_ids = st.integers(-1, self.num_gpu_blocks)
        elif self.held:
            pool_ids = st.sampled_from(sorted(set(self.held)))
        else:
            return
        block_ids = data.draw(
            st.lists(pool_ids, unique=not misuse, max_size=max_blocks), label="block_ids"
        )
        hashes = self.chain(request)
        num_stored = data.draw(st.integers(0, len(hashes)), label="num_stored")
        self.sequences.append(
            _Sequence(request, block_ids, hashes[:num_stored], hashes[:num_stored])
        )

    @precondition(lambda self: len(self.sequences) < 4)
    @rule(data=st.data())
    def hit_sequence(self, data: st.DataObject) -> None:
        """A request that looks up its prefix and touches the hits, as a manager does."""
        request = self.draw_request(data)
        hashes = self.chain(request)
        hits = self.lookup_prefix(hashes)
        if self.outcome_ok(f"touch({hits})", lambda pool, _: pool.touch(hits)):
            self.held.extend(hits)
            self.sequences.append(
                _Sequence(request, hits, list(hashes), list(hashes), num_cached=len(hits))
            )

    @precondition(lambda self: len(self.sequences) < 4)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """What a manager does for a new request: hit, touch, allocate the rest, cache full ones."""
        request = self.draw_request(data)
        hashes = self.chain(request)
        hits = self.lookup_prefix(hashes)
        assert self.spec is not None
        num_needed = cdiv(request.num_tokens, self.block_size) - len(hits)
        num_evictable_hits = sum(
            1 for block_id in hits if self.spec.snapshot().ref_cnt[block_id] == 0
        )
        if num_needed > self.spec.get_num_free_blocks() - num_evictable_hits:
            return  # does not fit: a manager would return None and change nothing
        if not self.outcome_ok(f"touch({hits})", lambda pool, _: pool.touch(hits)):
            return
        self.held.extend(hits)
        new = self.both(
            f"get_new_blocks({num_needed})", lambda pool, _: pool.get_new_blocks(num_needed)
        )
        assert new.result is not None
        self.held.extend(new.result)
        sequence = _Sequence(
            request, hits + new.result, list(hashes), list(hashes), num_cached=len(hits)
        )
        self.sequences.append(sequence)
        if self.enable_caching or self.misuse:  # caching into a pool without caching is misuse
            self.seal(sequence, sequence.num_cached, request.num_tokens // self.block_size)

    @precondition(lambda self: bool(self.sequences))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Free a sequence's blocks tail first (the manager's eviction order) and drop it."""
        sequence = data.draw(st.sampled_from(self.sequences), label="sequence")
        self.sequences.remove(sequence)
        held = set(self.held)
        self.free([block_id for block_id in reversed(sequence.block_ids) if block_id in held])

    @precondition(lambda self: bool(self.sequences))
    @rule(data=st.data())
    def grow_sequence(self, data: st.DataObject) -> None:
        """Generate tokens and add held blocks to a sequence."""
        sequence = data.draw(st.sampled_from(self.sequences), label="sequence")
        new_tokens = data.draw(
            st.lists(st.integers(0, self.alphabet - 1), max_size=2 * self.block_size),
            label="tokens",
        )
        sequence.request.append_output_token_ids(new_tokens)
        spare = sorted(set(self.held) - set(sequence.block_ids))
        if spare:
            sequence.block_ids.extend(
                data.draw(st.lists(st.sampled_from(spare), unique=True, max_size=2), label="blocks")
            )

    @precondition(lambda self: bool(self.sequences))
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        if not (self.enable_caching or self.misuse):
            return  # caching into a pool without caching is misuse
        sequence = data.draw(st.sampled_from(self.sequences), label="sequence")
        num_cached = sequence.num_cached
        if self.draw_misuse(data):
            top = len(sequence.block_ids) + 1
            num_full = data.draw(st.integers(num_cached - 1, top), label="num_full")
            if data.draw(st.integers(0, 2), label="wrong num_cached") == 0:
                num_cached = data.draw(st.integers(-1, top), label="num_cached")
        else:
            num_full = data.draw(
                st.integers(num_cached, self.max_valid_full(sequence)), label="num_full"
            )
        self.seal(sequence, num_cached, num_full)

    @rule(data=st.data())
    def get_cached_block(self, data: st.DataObject) -> None:
        made_up = BlockHashType(0, (0,) * self.block_size, None)
        self.lookup(data.draw(st.sampled_from([*self.seen_hashes[-20:], made_up]), label="hash"))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.both("reset_prefix_cache()", lambda pool, _: pool.reset_prefix_cache())

    @precondition(lambda self: self.events_on)
    @rule()
    def take_events(self) -> None:
        """Drain both event queues (equal batches); a consumer replaying them holds the index."""
        outcome = self.both(
            "take_events()", lambda pool, _: cast(EmitsKVEvents, pool).take_events()
        )
        if outcome.ok and outcome.result is not None:
            check_consumer(self.consumer, outcome.result, self.spec.snapshot().index)

    @rule(data=st.data())
    def hostile_call(self, data: st.DataObject) -> None:
        """A call of the hostile catalog (wrong types, NaN, unhashable keys): refused by both,
        nothing changed."""
        if not self.draw_misuse(data):
            return
        if self.sequences:
            sequence = data.draw(st.sampled_from(self.sequences), label="sequence")
            request, block_ids = sequence.request, tuple(sequence.block_ids)
            stored = tuple(sequence.spec_hashes)
        else:
            request, block_ids, stored = self.draw_request(data), (), ()
        scene = PoolScene(request, block_ids, stored, self.block_size, self.hash_fn)
        shown, call = draw_hostile_call(data, POOL_HOSTILE_CALLS, scene)
        self.both(shown, call)

    # -- after every step ---------------------------------------------------------------------

    def state_key(self) -> int:
        return hash((self.num_gpu_blocks, self.enable_caching))

    def agree_beyond_snapshots(self) -> None:
        for sequence in self.sequences:
            if sequence.spec_hashes != sequence.impl_hashes:
                raise Divergence(
                    f"stored hashes of {sequence.request.request_id} differ: spec "
                    f"{sequence.spec_hashes}, impl {sequence.impl_hashes}"
                )

    # -- helpers ------------------------------------------------------------------------------

    def free(self, block_ids: list[int]) -> bool:
        """free_blocks on both; on success the references leave `held`."""
        if not self.outcome_ok(
            f"free_blocks({block_ids})", lambda pool, _: pool.free_blocks(block_ids)
        ):
            return False
        for block_id in block_ids:
            if block_id != 0:
                self.held.remove(block_id)
        return True

    def seal(self, sequence: _Sequence, num_cached: int, num_full: int) -> bool:
        """cache_full_blocks on both, each side with its own stored hashes."""
        name = (
            f"cache_full_blocks({sequence.request!r}, {sequence.block_ids}, "
            f"{num_cached}, {num_full})"
        )

        def call(pool: PoolUnderTest, side: str) -> None:
            hashes = sequence.spec_hashes if side == "spec" else sequence.impl_hashes
            pool.cache_full_blocks(
                sequence.request,
                sequence.block_ids,
                hashes,
                num_cached,
                num_full,
                self.block_size,
                self.hash_fn,
            )

        ok = self.outcome_ok(name, call)
        if ok and num_cached == sequence.num_cached:
            sequence.num_cached = num_full
            self.seen_hashes.extend(sequence.spec_hashes)
        return ok

    def lookup_prefix(self, hashes: list[BlockHashType]) -> list[int]:
        """The cached prefix of a chain, looked up hash by hash on both sides until a miss."""
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup(self, block_hash: BlockHashType) -> int | None:
        """get_cached_block on both; the block id found, or None."""
        outcome = self.both(
            f"get_cached_block({block_hash})", lambda pool, _: pool.get_cached_block(block_hash)
        )
        return outcome.result

    def draw_request(self, data: st.DataObject) -> Request:
        """A fresh request, or a follow-up that extends an earlier one (same tokens and extra
        keys, then more tokens): follow-ups are what make prefix hits common."""
        self.num_requests += 1
        request_id = f"req-{self.num_requests}"
        short = [r for r in self.drawn[-8:] if r.num_tokens <= 4 * self.block_size]
        if short and data.draw(st.sampled_from((False, True)), label="follow-up"):
            earlier = data.draw(st.sampled_from(short), label="earlier")
            more = data.draw(
                st.lists(st.integers(0, self.alphabet - 1), max_size=2 * self.block_size),
                label="more tokens",
            )
            request = Request(
                request_id,
                [*earlier.all_token_ids, *more],
                mm_positions=earlier.mm_positions,
                mm_hashes=earlier.mm_hashes,
                lora_id=earlier.lora_id,
                cache_salt=earlier.cache_salt,
            )
        else:
            request = data.draw(
                requests(
                    request_id,
                    alphabet=self.alphabet,
                    max_tokens=4 * self.block_size,
                    extra_keys=data.draw(st.booleans(), label="extra keys"),
                    salts=self.semantics != VLLM_0_8_5,  # vLLM 0.8.5 has no cache salt
                    block_size=self.block_size,
                ),
                label="request",
            )
            request = self.domain.admit(request)
        self.drawn.append(request)
        return request

    def chain(self, request: Request) -> list[BlockHashType]:
        hashes = request_block_hashes(self.hash_fn, self.block_size, request)
        self.seen_hashes.extend(hashes)
        return hashes

    def max_valid_full(self, sequence: _Sequence) -> int:
        """The largest num_full_blocks a valid call may pass for this sequence now."""
        snapshot = self.spec.snapshot() if self.spec is not None else None
        assert snapshot is not None
        num_full = sequence.num_cached
        in_pool = range(1, self.num_gpu_blocks)
        if num_full > 0:
            parent = sequence.block_ids[num_full - 1]
            if parent not in in_pool or snapshot.block_hash[parent] is None:
                return num_full  # nothing to chain to
        limit = max(len(sequence.spec_hashes), sequence.request.num_tokens // self.block_size)
        seen: set[int] = set()
        while num_full < min(len(sequence.block_ids), limit):
            block_id = sequence.block_ids[num_full]
            if (
                block_id not in in_pool
                or block_id in seen
                or snapshot.ref_cnt[block_id] <= 0
                or snapshot.block_hash[block_id] is not None
            ):
                break
            seen.add(block_id)
            num_full += 1
        return num_full


def check_consumer(
    consumer: Counter[int], batch: list[KVCacheEvent], index: Iterable[BlockHashType]
) -> None:
    """Replay a taken `batch` into `consumer`, which must then count the keys of `index` (the
    queue is empty right after a take, so the consumer holds everything emitted).

    Raises:
        Divergence: the replay fails or differs from the index.
    """
    try:
        replay_hash_counts(batch, consumer)
    except KVEventReplayError as error:
        raise Divergence(f"a consumer cannot replay the events taken: {error}") from None
    expected = index_hash_counts(index)
    if consumer != expected:
        raise Divergence(
            f"a consumer replaying the events holds {dict(consumer)}, the index {dict(expected)}"
        )


def make_pool_machine(
    factory: PoolFactory,
    *,
    semantics: Semantics = PAGEDKV,
    misuse: bool = True,
    stats: CampaignStats | None = None,
    domain: Domain = FULL_DOMAIN,
    kv_events: bool | None = None,
) -> type[PoolMachine]:
    """A `PoolMachine` subclass that checks `factory`'s pools against the spec, on `domain`.

    pagedkv's own pool must also word every refusal exactly as the spec does; other pools are
    held to the error class. `kv_events` (default: only for pagedkv's own pool) says the factory
    is a `KVEventPoolFactory` whose events are compared.
    """
    return type(
        "PoolMachine",
        (PoolMachine,),
        {
            "factory": staticmethod(factory),
            "semantics": semantics,
            "misuse": misuse,
            "domain": domain,
            "same_messages": factory is pagedkv_pool,
            "kv_events": factory is pagedkv_pool if kv_events is None else kv_events,
            "stats": stats if stats is not None else CampaignStats(),
        },
    )
