"""The CPU offload tier: host chunks keyed by `OffloadKey`, the contract of vLLM 0.33's
`OffloadingManager` as its `CPUOffloadingManager` keeps it.

A held chunk is in one of three states, by its count `refs`:

    -1  store pending: being written; `lookup` says HIT_PENDING; not loadable, not evictable
     0  ready: loadable and evictable
    n>0 pinned by n loads in flight: loadable, not evictable

    prepare_store --> -1 --complete_store(success)--> 0 <--prepare_load/complete_load--> n > 0
                       \\--complete_store(failure)--> not held (the chunk is freed)
    0 --evicted by a prepare_store that needs room--> not held

Host chunk ids are handed out fresh (0, 1, ...) until all `num_chunks` were used, then from
the freed ones, the last freed first. Every public call checks its preconditions, in the order
its docstring lists them, before it changes anything (a refused call changes nothing). Every
invariant is stated once, in `check_invariants`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv.spec.offload.access import SpecRequestAccess
from pagedkv.spec.offload.arc import SpecARC
from pagedkv.spec.offload.lru import SpecLRU
from pagedkv.spec.offload.policy import SpecPolicy
from pagedkv.vocab import refusals
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import (
    GROUP_INDEX_BYTES,
    LookupResult,
    OffloadEvent,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    OffloadTierSnapshot,
    StoreOutput,
)

PENDING = -1
READY = 0


def _check_keys(keys: Sequence[OffloadKey]) -> None:
    """Every key is bytes holding a group index (an argument rule, checked first)."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) < GROUP_INDEX_BYTES:
            raise refusals.offload_key_type(key)


class SpecOffloadTier:
    """The tier, plainly: a dict of chunk states, a dict of chunk ids, a policy's order."""

    def __init__(self, config: OffloadTierConfig) -> None:
        self.config = config
        self.refs: dict[OffloadKey, int] = {}
        self.chunk_ids: dict[OffloadKey, int] = {}
        self.num_fresh_used = 0
        self.freed_ids: list[int] = []
        policies: dict[str, type[SpecPolicy]] = {"lru": SpecLRU, "arc": SpecARC}
        self.policy = policies[config.policy](config.num_chunks)
        self.offer_counts: dict[OffloadKey, int] = {}  # least recently offered first
        self.accesses: dict[str, SpecRequestAccess] = {}
        self.events: list[OffloadEvent] = []

    # -- questions ---------------------------------------------------------------------------

    def ready_keys(self) -> set[OffloadKey]:
        return {key for key, refs in self.refs.items() if refs >= READY}

    def num_free_chunks(self) -> int:
        return self.config.num_chunks - len(self.refs)

    def lookup(self, key: OffloadKey, request: OffloadRequest) -> LookupResult:
        """MISS if `key` is not held, HIT_PENDING while its store is pending, else HIT."""
        _check_keys([key])
        if key not in self.refs:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if self.refs[key] == PENDING else LookupResult.HIT

    # -- loads -------------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> tuple[int, ...]:
        """Pin `keys` (once per occurrence) until `complete_load`; return their chunk ids.

        Preconditions, in order: the request has not finished; every key is held; every key
        is ready (its store completed).
        """
        keys = list(keys)
        _check_keys(keys)
        self._check_not_finished(request, "prepare_load")
        for key in keys:
            if key not in self.refs:
                raise refusals.load_of_absent_chunk(key)
            if self.refs[key] == PENDING:
                raise refusals.load_of_pending_chunk(key)
        for key in keys:
            self.refs[key] += 1
        self._record_access(keys, request, reused=keys)
        return tuple(self.chunk_ids[key] for key in keys)

    def complete_load(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        """Unpin `keys` (once per occurrence); a chunk with no pin left is evictable again.

        Preconditions: every key is held and pinned at least as many times as it is named.
        """
        keys = list(keys)
        _check_keys(keys)
        for key, num_completions in Counter(keys).items():
            if self.refs.get(key, PENDING) < num_completions:
                raise refusals.complete_load_of_unpinned_chunk(
                    key, self.refs.get(key, PENDING), num_completions
                )
        for key in keys:
            self.refs[key] -= 1

    def touch(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        """Mark the held ones of `keys` as used, the first most recently (others are ignored)."""
        keys = list(keys)
        _check_keys(keys)
        self.policy.touch(keys, self.ready_keys())

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], request: OffloadRequest
    ) -> StoreOutput | None:
        """Offer `keys` for storing: hold the new ones, store pending, evicting if need be.

        Preconditions, in order: the request has not finished; no key is offered twice.

        With a threshold, every offer is counted first. The keys to store are the offered
        keys not held (and, with a threshold, offered often enough), in offer order. If fewer
        chunks are free than they need, the shortfall is evicted from the ready, unpinned
        chunks not offered here, as the policy chooses; if it cannot be, the answer is None:
        nothing is held, evicted or announced (the offer was still counted and seen, as in
        vLLM). Evictions are announced in one removal event.
        """
        keys = list(keys)
        _check_keys(keys)
        self._check_not_finished(request, "prepare_store")
        for index, key in enumerate(keys):
            if key in keys[:index]:  # the first key named a second time
                raise refusals.key_offered_twice(key, "prepare_store")

        if self.config.tracks_offers:
            self._count_offers(keys)
        to_store = [key for key in keys if key not in self.refs]
        found_ready = [key for key in keys if self.refs.get(key, PENDING) >= READY]
        if self.config.tracks_offers:
            threshold = self.config.store_threshold
            to_store = [key for key in to_store if self.offer_counts.get(key, 0) >= threshold]
        access = self._access(request)
        new_misses = [key for key in to_store if key not in access.store_misses]
        if new_misses:
            self.policy.on_store_miss(new_misses, self.ready_keys())
            access.store_misses.update(new_misses)
        recorded = set(to_store) | set(found_ready)
        self._record_access([key for key in keys if key in recorded], request, found_ready)
        if not to_store:
            return StoreOutput((), (), ())

        shortfall = len(to_store) - self.num_free_chunks()
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            candidates = {
                key for key, refs in self.refs.items() if refs == READY and key not in keys
            }
            chosen = self.policy.evict(shortfall, candidates)
            if chosen is None:
                return None
            evicted = chosen
            for key in evicted:
                del self.refs[key]
                self.freed_ids.append(self.chunk_ids.pop(key))
            self.events.append(OffloadEvent(tuple(evicted), removed=True))

        new_ids: list[int] = []
        for _ in to_store:
            if self.num_fresh_used < self.config.num_chunks:
                new_ids.append(self.num_fresh_used)
                self.num_fresh_used += 1
            else:
                new_ids.append(self.freed_ids.pop())
        for key, chunk_id in zip(to_store, new_ids, strict=True):
            self.refs[key] = PENDING
            self.chunk_ids[key] = chunk_id
            self.policy.insert(key, request)
        access.inserted.update(to_store)
        return StoreOutput(tuple(to_store), tuple(new_ids), tuple(evicted))

    def complete_store(
        self, keys: Sequence[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None:
        """End the stores of `keys`: ready on success (one stored event), else freed (one
        metadata-only removal event).

        Preconditions: no key is named twice; every key's store is pending.
        """
        keys = list(keys)
        _check_keys(keys)
        for index, key in enumerate(keys):
            if key in keys[:index]:  # the first key named a second time
                raise refusals.key_offered_twice(key, "complete_store")
        for key in keys:
            if self.refs.get(key) != PENDING:
                raise refusals.complete_store_of_chunk_not_pending(key, key in self.refs)
        if not keys:
            return
        for key in keys:
            if success:
                self.refs[key] = READY
            else:
                del self.refs[key]
                self.freed_ids.append(self.chunk_ids.pop(key))
                self.policy.remove(key)
        self.events.append(
            OffloadEvent(tuple(keys), removed=not success, metadata_only=not success)
        )

    # -- requests, reset, events -------------------------------------------------------------

    def on_request_finished(self, request: OffloadRequest) -> None:
        """Commit the request's uses to the policy, head to tail; later calls do nothing.

        Completions of its transfers may still come; it submits no new one.
        """
        access = self.accesses.get(request.req_id)
        if access is None or access.finished:
            return
        access.finished = True
        self.policy.on_request_finished(
            access.ordered_keys(request), access.inserted - access.reused, access.reused
        )

    def reset_cache(self) -> None:
        """Drop every chunk, whatever its state, every request's record and the policy's
        order; chunk ids start again from 0. The offer counts and untaken events stay."""
        self.refs = {}
        self.chunk_ids = {}
        self.num_fresh_used = 0
        self.freed_ids = []
        self.policy.clear()
        self.accesses = {}

    def take_events(self) -> list[OffloadEvent]:
        """The events since the last call, oldest first; a failed store's key that is held
        again by now is left out of its removal (and an event left empty is dropped)."""
        taken: list[OffloadEvent] = []
        for event in self.events:
            if event.metadata_only:
                keys = tuple(key for key in event.keys if key not in self.refs)
                if keys:
                    taken.append(OffloadEvent(keys, event.removed, event.metadata_only))
            else:
                taken.append(event)
        self.events = []
        return taken

    # -- the request record and the offer counts ---------------------------------------------

    def _check_not_finished(self, request: OffloadRequest, call: str) -> None:
        access = self.accesses.get(request.req_id)
        if access is not None and access.finished:
            raise refusals.submit_after_finish(request.req_id, call)

    def _access(self, request: OffloadRequest) -> SpecRequestAccess:
        return self.accesses.setdefault(request.req_id, SpecRequestAccess())

    def _record_access(
        self, keys: list[OffloadKey], request: OffloadRequest, reused: list[OffloadKey]
    ) -> None:
        access = self._access(request)
        new = access.see(keys)
        if new:
            self.policy.on_request_access(new, request)
        access.reused.update(key for key in reused if key not in access.inserted)

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        """Count one offer of each key. A counted key offered again becomes the most recent; a
        key not yet counted is added as the most recent. If the tracker is full, the least
        recently offered key that was counted before this offer and is not offered now makes
        room; if there is none, the new key is not counted."""
        replaceable = [key for key in self.offer_counts if key not in keys]
        for key in keys:
            if key in self.offer_counts:
                self.offer_counts[key] = self.offer_counts.pop(key) + 1
        for key in keys:
            if key in self.offer_counts:
                continue
            if len(self.offer_counts) >= self.config.max_tracker_size:
                if not replaceable:
                    continue
                del self.offer_counts[replaceable.pop(0)]
            self.offer_counts[key] = 1

    def snapshot(self) -> OffloadTierSnapshot:
        """The whole state in plain values (equal for tiers in the same state)."""
        return OffloadTierSnapshot(
            refs=tuple(sorted(self.refs.items())),
            chunk_ids=tuple(sorted(self.chunk_ids.items())),
            freed_ids=tuple(self.freed_ids),
            num_fresh_used=self.num_fresh_used,
            policy=self.policy.snapshot(),
            offer_counts=tuple(self.offer_counts.items()),
            accesses=tuple((rid, self.accesses[rid].snapshot()) for rid in sorted(self.accesses)),
            events=tuple(self.events),
        )

    # -- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` naming the first invariant the state breaks."""
        bad = {key.hex(): refs for key, refs in self.refs.items() if refs < PENDING}
        if bad:
            raise InvariantViolation(
                "a chunk is store pending (-1), ready (0) or pinned by n loads (n > 0)", str(bad)
            )
        if len(self.refs) > self.config.num_chunks:
            raise InvariantViolation(
                "the tier holds at most num_chunks chunks",
                f"{len(self.refs)} held, {self.config.num_chunks} chunks",
            )
        if set(self.chunk_ids) != set(self.refs):
            raise InvariantViolation("every held key has a chunk id, and only they", "")
        ids = sorted([*self.chunk_ids.values(), *self.freed_ids])
        if ids != list(range(self.num_fresh_used)) or self.num_fresh_used > self.config.num_chunks:
            raise InvariantViolation(
                "each chunk id handed out is held by one key or freed, once",
                f"held {sorted(self.chunk_ids.values())}, freed {self.freed_ids}, "
                f"{self.num_fresh_used} handed out",
            )
        self.policy.check_invariants(set(self.refs))
        if len(self.offer_counts) > self.config.max_tracker_size or (
            not self.config.tracks_offers and self.offer_counts
        ):
            raise InvariantViolation(
                "the offer tracker counts at most max_tracker_size keys, and only with a threshold",
                f"{len(self.offer_counts)} counted",
            )
        for request_id, access in self.accesses.items():
            access.check_invariants(request_id)
