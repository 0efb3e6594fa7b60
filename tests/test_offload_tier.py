"""The CPU offload tier: pagedkv.offload against pagedkv.spec.offload, step by step.

A hypothesis state machine drives both tiers with the same calls (both policies, thresholds
on and off): stores with evictions, completions that succeed or fail, loads and their
completions, touches, lookups, finished requests, resets, events, and misuse. Every answer
and every error must be equal, every refused call must leave both tiers as they were, and after
every step the two whole states must be equal and both `check_invariants()` must pass. The
scenario tests below name the rules one by one, on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.offload import (
    LookupResult,
    OffloadChunkError,
    OffloadEvent,
    OffloadKey,
    OffloadRequest,
    OffloadTier,
    OffloadTierConfig,
    StoreOutput,
    make_offload_key,
)
from pagedkv.spec.offload import SpecOffloadTier
from pagedkv.vocab.errors import InvalidArgumentError, PagedKVError, RequestError
from pagedkv.vocab.offload import OffloadTierSnapshot

NUM_BLOCKS = 6
NUM_GROUPS = 2
BLOCK_TOKENS = 4
KEYS = [
    make_offload_key(bytes([block]) * 2, group)
    for block in range(NUM_BLOCKS)
    for group in range(NUM_GROUPS)
]


def end_token(key: OffloadKey) -> int:
    """Where a test key's chunk ends: its block's index, in tokens."""
    return (key[0] + 1) * BLOCK_TOKENS


class Tier(Protocol):
    def lookup(self, key: OffloadKey, request: OffloadRequest) -> LookupResult: ...
    def prepare_load(self, keys: list[OffloadKey], request: OffloadRequest) -> tuple[int, ...]: ...
    def complete_load(self, keys: list[OffloadKey], request: OffloadRequest) -> None: ...
    def touch(self, keys: list[OffloadKey], request: OffloadRequest) -> None: ...
    def prepare_store(
        self, keys: list[OffloadKey], request: OffloadRequest
    ) -> StoreOutput | None: ...
    def complete_store(
        self, keys: list[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None: ...
    def on_request_finished(self, request: OffloadRequest) -> None: ...
    def reset_cache(self) -> None: ...
    def take_events(self) -> list[OffloadEvent]: ...
    def snapshot(self) -> OffloadTierSnapshot: ...
    def check_invariants(self) -> None: ...


SIDES: dict[str, Callable[[OffloadTierConfig], Tier]] = {
    "spec": SpecOffloadTier,
    "impl": OffloadTier,
}


@dataclass
class Outcome:
    value: Any = None
    error: PagedKVError | None = None

    def same_as(self, other: Outcome) -> bool:
        if self.error is None or other.error is None:
            return self.error is None and other.error is None and self.value == other.value
        return type(self.error) is type(other.error) and str(self.error) == str(other.error)


def run(tier: Tier, call: str, *args: Any) -> Outcome:
    before = tier.snapshot()
    try:
        return Outcome(getattr(tier, call)(*args))
    except PagedKVError as error:
        assert tier.snapshot() == before, f"a refused {call} changed the tier"
        return Outcome(error=error)


@dataclass
class Job:
    request: OffloadRequest
    keys: list[OffloadKey]


@dataclass
class Requests:
    live: list[OffloadRequest] = field(default_factory=list)
    finished: list[OffloadRequest] = field(default_factory=list)
    placing: dict[str, str] = field(default_factory=dict)  # "all", "none", "group 0"
    count: int = 0


class OffloadTierMachine(RuleBasedStateMachine):
    """Spec and implementation side by side; a divergence fails the step it happens in."""

    def __init__(self) -> None:
        super().__init__()
        self.spec: Tier = SpecOffloadTier(OffloadTierConfig(1))
        self.impl: Tier = OffloadTier(OffloadTierConfig(1))
        self.requests = Requests()
        self.stores: list[Job] = []
        self.loads: list[Job] = []

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        num_chunks=st.integers(1, 5),
        threshold=st.sampled_from([1, 1, 2, 3]),
        tracker=st.integers(1, 8),
    )
    def build(self, policy: Any, num_chunks: int, threshold: int, tracker: int) -> None:
        config = OffloadTierConfig(num_chunks, policy, threshold, tracker)
        self.spec, self.impl = SpecOffloadTier(config), OffloadTier(config)

    def both(self, call: str, *args: Any) -> Any:
        ours, theirs = run(self.spec, call, *args), run(self.impl, call, *args)
        assert ours.same_as(theirs), f"{call}{args}: spec {ours}, impl {theirs}"
        return ours.value if ours.error is None else ours.error

    def request(self, index: int) -> OffloadRequest:
        """A live request (one is opened, placing every key, if none is live)."""
        if not self.requests.live:
            self.open_request("all")
        live = self.requests.live
        return live[index % len(live)]

    def placed(self, request: OffloadRequest, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Place `keys` in `request` as the scheduler would, before it passes them."""
        how = self.requests.placing[request.req_id]
        for key in keys:
            if how == "all" or (how == "group 0" and key[-1] == 0):
                request.place(key, end_token(key))
        return keys

    @rule(placing=st.sampled_from(["all", "all", "none", "group 0"]))
    def open_request(self, placing: str) -> None:
        """A new request (at most four live), placing all, none or group 0's keys."""
        if len(self.requests.live) < 4:
            request = OffloadRequest(f"r{self.requests.count}")
            self.requests.count += 1
            self.requests.live.append(request)
            self.requests.placing[request.req_id] = placing

    @rule(index=st.integers(0, 3), key=st.sampled_from(KEYS))
    def lookup(self, index: int, key: OffloadKey) -> None:
        request = self.request(index)
        self.both("lookup", key, request)

    @rule(
        index=st.integers(0, 3),
        keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=3),
        then=st.sampled_from(["complete", "complete", "fail", "later"]),
    )
    def prepare_store(self, index: int, keys: list[OffloadKey], then: str) -> None:
        """Offer keys; the store completes now (or fails), or stays pending for a while."""
        request = self.request(index)
        out = self.both("prepare_store", self.placed(request, keys), request)
        if isinstance(out, StoreOutput) and out.keys_to_store:
            if then == "later":
                self.stores.append(Job(request, list(out.keys_to_store)))
            else:
                self.both("complete_store", list(out.keys_to_store), request, then == "complete")

    @precondition(lambda self: self.stores)
    @rule(index=st.integers(0, 7), success=st.booleans(), part=st.booleans())
    def complete_store(self, index: int, success: bool, part: bool) -> None:
        job = self.stores.pop(index % len(self.stores))
        keys = job.keys
        if part and len(keys) > 1:  # a job's keys may be completed in two calls
            keys, rest = keys[:1], keys[1:]
            self.stores.append(Job(job.request, rest))
        self.both("complete_store", keys, job.request, success)

    @rule(
        index=st.integers(0, 3),
        keys=st.lists(st.sampled_from(KEYS), max_size=4),
        later=st.booleans(),
    )
    def prepare_load(self, index: int, keys: list[OffloadKey], later: bool) -> None:
        """Load the drawn keys that are ready (a key may come twice); completed now or later."""
        request = self.request(index)
        ready = [k for k in keys if self.spec.lookup(k, request) is LookupResult.HIT]
        if ready:
            self.both("prepare_load", self.placed(request, ready), request)
            if later:
                self.loads.append(Job(request, ready))
            else:
                self.both("complete_load", ready, request)

    @precondition(lambda self: self.loads)
    @rule(index=st.integers(0, 7))
    def complete_load(self, index: int) -> None:
        job = self.loads.pop(index % len(self.loads))
        self.both("complete_load", job.keys, job.request)

    @rule(index=st.integers(0, 3), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, index: int, keys: list[OffloadKey]) -> None:
        request = self.request(index)
        self.both("touch", keys, request)

    @rule(index=st.integers(0, 3), draw=st.integers(0, 2))
    def finish(self, index: int, draw: int) -> None:
        if draw:  # a request lives a few steps
            return
        request = self.request(index)
        self.both("on_request_finished", request)
        self.requests.live.remove(request)
        self.requests.finished.append(request)

    @rule(draw=st.integers(0, 9))
    def reset(self, draw: int) -> None:
        if draw:  # one time in ten: a reset ends most of what a run builds
            return
        self.both("reset_cache")
        self.stores, self.loads = [], []  # completions of older jobs never come (vLLM's rule)

    @rule(draw=st.integers(0, 2))
    def take_events(self, draw: int) -> None:
        if not draw:
            self.both("take_events")

    @rule(
        call=st.sampled_from(["prepare_load", "complete_load", "complete_store", "prepare_store"]),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        finished=st.booleans(),
    )
    def misuse(self, call: str, keys: list[OffloadKey], finished: bool) -> None:
        """Calls a scheduler must not make: both sides answer alike (an error, atomically)."""
        pool = self.requests.finished if finished else self.requests.live
        if not pool:
            return
        request = pool[0]
        if call == "prepare_store":
            keys = [*keys, keys[0]]  # a key offered twice
        if call == "complete_store":
            self.both(call, keys, request, False)
        else:
            self.both(call, keys, request)

    @invariant()
    def same_state_and_invariants_hold(self) -> None:
        self.spec.check_invariants()
        self.impl.check_invariants()
        assert self.spec.snapshot() == self.impl.snapshot()


TestOffloadTier = OffloadTierMachine.TestCase
# Steps are cheap (well under a millisecond): three times the profile's examples, so that the
# ci profile reaches evictions, ghost hits and threshold stores under every policy.
TestOffloadTier.settings = settings(max_examples=3 * settings().max_examples, deadline=None)


# -- scenarios: each rule by name, on both sides -----------------------------------------------


@pytest.fixture(params=sorted(SIDES))
def side(request: pytest.FixtureRequest) -> Callable[[OffloadTierConfig], Tier]:
    return SIDES[request.param]


def key(block: int, group: int = 0) -> OffloadKey:
    return KEYS[block * NUM_GROUPS + group]


def placed_request(req_id: str, *keys: OffloadKey) -> OffloadRequest:
    request = OffloadRequest(req_id)
    for k in keys:
        request.place(k, end_token(k))
    return request


def stored(tier: Tier, request: OffloadRequest, *keys: OffloadKey) -> StoreOutput:
    out = tier.prepare_store(list(keys), request)
    assert out is not None
    tier.complete_store(list(out.keys_to_store), request)
    return out


def test_lru_evicts_a_finished_requests_tail_first(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(3, "lru"))
    a = placed_request("a", key(0), key(1), key(2))
    stored(tier, a, key(0), key(1), key(2))
    tier.on_request_finished(a)
    b = placed_request("b", key(3), key(4))
    out = tier.prepare_store([key(3), key(4)], b)
    # The tail (key 2) goes first; freed chunks are reused last freed first.
    assert out == StoreOutput((key(3), key(4)), (1, 2), (key(2), key(1)))
    tier.check_invariants()


def test_lru_a_load_makes_the_head_the_most_recent(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(3, "lru"))
    a = placed_request("a", key(0), key(1), key(2))
    stored(tier, a, key(0), key(1), key(2))
    tier.on_request_finished(a)
    b = placed_request("b", key(2))
    tier.prepare_load([key(2)], b)
    tier.complete_load([key(2)], b)
    tier.on_request_finished(b)  # key 2, reused by b, is now more recent than keys 0 and 1
    c = placed_request("c", key(3))
    assert tier.prepare_store([key(3)], c) == StoreOutput((key(3),), (1,), (key(1),))


def test_arc_ghost_hit_grows_the_target(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(2, "arc"))
    a = placed_request("a", key(0), key(1))
    stored(tier, a, key(0), key(1))
    tier.on_request_finished(a)
    b = placed_request("b", key(2))
    assert stored(tier, b, key(2)).evicted_keys == (key(1),)  # T1's least recent: the tail
    assert tier.snapshot().policy[2] == ("b1", (key(1),))
    c = placed_request("c", key(1))
    out = tier.prepare_store([key(1)], c)  # key 1 was a B1 ghost: T1 was too small
    assert out is not None and out.evicted_keys == (key(0),)
    policy = dict(tier.snapshot().policy)
    assert policy["target"] == 1.0
    assert policy["t1"] == (key(2), key(1)) and policy["b1"] == (key(0),)
    tier.check_invariants()


def test_arc_a_reuse_moves_a_chunk_to_t2_when_the_request_finishes(
    side: Callable[..., Tier],
) -> None:
    tier = side(OffloadTierConfig(2, "arc"))
    a = placed_request("a", key(0))
    stored(tier, a, key(0))
    b = placed_request("b", key(0))
    tier.prepare_load([key(0)], b)
    tier.complete_load([key(0)], b)
    assert dict(tier.snapshot().policy)["t2"] == ()
    tier.on_request_finished(b)
    assert dict(tier.snapshot().policy)["t2"] == (key(0),)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_pinned_chunk_is_never_evicted(side: Callable[..., Tier], policy: Any) -> None:
    tier = side(OffloadTierConfig(2, policy))
    a = placed_request("a", key(0), key(1))
    stored(tier, a, key(0), key(1))
    tier.on_request_finished(a)
    b = placed_request("b", key(0))
    tier.prepare_load([key(0)], b)
    c = placed_request("c", key(2), key(3))
    assert tier.prepare_store([key(2), key(3)], c) is None  # one chunk evictable, two needed
    out = tier.prepare_store([key(2)], c)
    assert out is not None and out.evicted_keys == (key(1),)
    assert tier.lookup(key(0), c) is LookupResult.HIT


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_store_that_cannot_make_room_holds_evicts_and_announces_nothing(
    side: Callable[..., Tier], policy: Any
) -> None:
    tier = side(OffloadTierConfig(2, policy))
    a = placed_request("a", key(0), key(1))
    assert tier.prepare_store([key(0), key(1)], a) is not None  # both pending: not evictable
    before = tier.snapshot()
    b = placed_request("b", key(2))
    assert tier.prepare_store([key(2)], b) is None
    after = tier.snapshot()
    assert (after.refs, after.chunk_ids, after.freed_ids, after.events) == (
        before.refs,
        before.chunk_ids,
        before.freed_ids,
        before.events,
    )
    assert dict(after.accesses)["b"].key_groups == ((0, (key(2),)),)  # the offer was seen
    tier.check_invariants()


def test_a_store_never_evicts_a_key_it_offers(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(2, "lru"))
    a = placed_request("a", key(0), key(1))
    stored(tier, a, key(0), key(1))
    b = placed_request("b", key(0), key(2))
    out = tier.prepare_store([key(0), key(2)], b)
    assert out == StoreOutput((key(2),), (1,), (key(1),))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reset_drops_every_chunk_whatever_its_state(side: Callable[..., Tier], policy: Any) -> None:
    tier = side(OffloadTierConfig(3, policy))
    a = placed_request("a", key(0), key(1), key(2))
    stored(tier, a, key(0), key(1))
    tier.prepare_load([key(0)], a)
    assert tier.prepare_store([key(2)], a) is not None
    tier.reset_cache()
    assert [tier.lookup(k, a) for k in (key(0), key(1), key(2))] == [LookupResult.MISS] * 3
    with pytest.raises(OffloadChunkError, match="complete_store of a chunk whose store is not"):
        tier.complete_store([key(2)], a)
    assert stored(tier, a, key(3)).chunk_ids == (0,)  # chunk ids start again
    tier.check_invariants()


def test_a_failed_store_frees_its_chunk_with_a_metadata_only_removal(
    side: Callable[..., Tier],
) -> None:
    tier = side(OffloadTierConfig(2, "lru"))
    a = placed_request("a", key(0), key(1))
    assert tier.prepare_store([key(0), key(1)], a) is not None
    tier.complete_store([key(0), key(1)], a, success=False)
    assert tier.lookup(key(0), a) is LookupResult.MISS
    assert tier.prepare_store([key(1)], a) == StoreOutput((key(1),), (1,), ())  # the last freed
    assert tier.take_events() == [OffloadEvent((key(0),), removed=True, metadata_only=True)]


def test_a_threshold_stores_a_key_on_its_nth_offer(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(2, "lru", store_threshold=2))
    a = placed_request("a", key(0))
    assert tier.prepare_store([key(0)], a) == StoreOutput((), (), ())
    assert tier.prepare_store([key(0)], a) == StoreOutput((key(0),), (0,), ())


def test_a_full_tracker_forgets_its_least_recently_offered_key(side: Callable[..., Tier]) -> None:
    tier = side(OffloadTierConfig(4, "lru", store_threshold=2, max_tracker_size=2))
    a = placed_request("a")
    for k in (key(0), key(1), key(2)):  # key 0 is forgotten to count key 2
        tier.prepare_store([k], a)
    assert tier.prepare_store([key(0)], a) == StoreOutput((), (), ())
    assert tier.prepare_store([key(2)], a) == StoreOutput((key(2),), (0,), ())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("load absent", "prepare_load of a key the tier does not hold"),
        ("load pending", "prepare_load of a chunk whose store is pending"),
        ("complete unpinned load", "complete_load of a chunk no pending load pins"),
        ("complete ready store", "complete_store of a chunk whose store is not pending"),
        ("store twice", "prepare_store names the key twice"),
        ("store after finish", "prepare_store after on_request_finished"),
        ("not a key", "an offload key is bytes"),
    ],
)
def test_misuse_is_refused_by_name_and_changes_nothing(
    side: Callable[..., Tier], call: str, message: str
) -> None:
    tier = side(OffloadTierConfig(3, "arc"))
    a = placed_request("a", key(0), key(1))
    stored(tier, a, key(0))
    assert tier.prepare_store([key(1)], a) is not None
    done = placed_request("done")
    tier.prepare_store([key(4)], done)
    tier.on_request_finished(done)
    before = tier.snapshot()
    attempts: dict[str, Callable[[], object]] = {
        "load absent": lambda: tier.prepare_load([key(0), key(3)], a),
        "load pending": lambda: tier.prepare_load([key(0), key(1)], a),
        "complete unpinned load": lambda: tier.complete_load([key(0)], a),
        "complete ready store": lambda: tier.complete_store([key(1), key(0)], a),
        "store twice": lambda: tier.prepare_store([key(2), key(2)], a),
        "store after finish": lambda: tier.prepare_store([key(5)], done),
        "not a key": lambda: tier.touch([b"\x00"], a),  # type: ignore[list-item]
    }
    errors = (OffloadChunkError, RequestError, InvalidArgumentError)
    with pytest.raises(errors, match=message):
        attempts[call]()
    assert tier.snapshot() == before


def test_refusals_name_the_key_or_request_and_the_rule_word_for_word(
    side: Callable[..., Tier],
) -> None:
    tier = side(OffloadTierConfig(2, "lru"))
    a = placed_request("a", key(0), key(1))
    stored(tier, a, key(0))
    assert tier.prepare_store([key(1)], a) is not None
    with pytest.raises(OffloadChunkError) as pending:
        tier.prepare_load([key(1)], a)
    assert str(pending.value) == (
        f"offload key {key(1).hex()}: prepare_load of a chunk whose store is pending "
        "(lookup says HIT_PENDING)"
    )
    assert (pending.value.key, pending.value.rule) == (
        key(1),
        "prepare_load of a chunk whose store is pending",
    )
    with pytest.raises(OffloadChunkError) as unpinned:
        tier.complete_load([key(0), key(0)], a)
    assert str(unpinned.value) == (
        f"offload key {key(0).hex()}: complete_load of a chunk no pending load pins "
        "(2 completion(s) for 0 pin(s))"
    )
    with pytest.raises(OffloadChunkError) as ready:
        tier.complete_store([key(0)], a)
    assert str(ready.value).endswith(
        "complete_store of a chunk whose store is not pending (stored and ready)"
    )
    tier.on_request_finished(a)
    with pytest.raises(RequestError) as finished:
        tier.prepare_load([key(0)], a)
    assert str(finished.value) == (
        "request 'a': prepare_load after on_request_finished "
        "(a finished request submits no transfer)"
    )
    assert finished.value.request_id == "a"
