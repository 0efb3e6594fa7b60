"""The CPU offload tier (`OffloadTier`): the contract of `pagedkv.spec.offload.tier`, fast.

Chunk states live in one dict (`refs`: -1 store pending, 0 ready, n > 0 pinned by n loads),
shared with the policy; counts of evictable and pending chunks make the "cannot evict enough"
answer O(1). Every public call checks all its preconditions before it changes anything, in the
spec's order, and raises the spec's error for the same misuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from pagedkv.offload.access import RequestAccess
from pagedkv.offload.arc import ARCPolicy
from pagedkv.offload.lru import LRUPolicy
from pagedkv.offload.policy import CachePolicy
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

_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def _key_list(keys: Collection[OffloadKey]) -> list[OffloadKey]:
    keys = list(keys)
    for key in keys:
        if not isinstance(key, bytes) or len(key) < GROUP_INDEX_BYTES:
            raise refusals.offload_key_type(key)
    return keys


def _first_repeated(keys: list[OffloadKey]) -> OffloadKey | None:
    if len(set(keys)) == len(keys):
        return None
    seen: set[OffloadKey] = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    return None  # pragma: no cover - unreachable: a repeat exists


class OffloadTier:
    """Host chunks keyed by `OffloadKey`, with an LRU or ARC eviction policy.

    Args:
        config: the number of chunks, the policy and the store threshold.

    `check_invariants()` states what holds between calls (the spec's invariants).
    """

    def __init__(self, config: OffloadTierConfig) -> None:
        self.config = config
        self.refs: dict[OffloadKey, int] = {}
        self._chunk_ids: dict[OffloadKey, int] = {}
        self._num_fresh_used = 0
        self._freed_ids: list[int] = []
        self._num_evictable = 0
        self._num_pending = 0
        self.policy: CachePolicy = _POLICIES[config.policy](config.num_chunks, self.refs)
        self._offer_counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._accesses: dict[str, RequestAccess] = {}
        self._events: list[OffloadEvent] = []

    def lookup(self, key: OffloadKey, request: OffloadRequest) -> LookupResult:
        """MISS, HIT_PENDING (store pending) or HIT. Complexity: O(1)."""
        _key_list((key,))
        refs = self.refs.get(key)
        if refs is None:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if refs < 0 else LookupResult.HIT

    def prepare_load(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> tuple[int, ...]:
        """Pin `keys` until `complete_load`; return their chunk ids.

        Raises:
            RequestError: the request finished.
            OffloadChunkError: a key is not held, or its store is pending.

        Complexity: O(len(keys)).
        """
        keys = _key_list(keys)
        self._check_not_finished(request, "prepare_load")
        refs = self.refs
        for key in keys:
            state = refs.get(key)
            if state is None:
                raise refusals.load_of_absent_chunk(key)
            if state < 0:
                raise refusals.load_of_pending_chunk(key)
        for key in keys:
            if refs[key] == 0:
                self._num_evictable -= 1
                self.policy.mark_pinned(key)
            refs[key] += 1
        self._record_access(keys, request, keys)
        return tuple(self._chunk_ids[key] for key in keys)

    def complete_load(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None:
        """Unpin `keys`.

        Raises:
            OffloadChunkError: a key is pinned fewer times than it is named.

        Complexity: O(len(keys)).
        """
        keys = _key_list(keys)
        refs = self.refs
        needed: dict[OffloadKey, int] = {}
        for key in keys:
            needed[key] = needed.get(key, 0) + 1
        for key, count in needed.items():
            if refs.get(key, -1) < count:
                raise refusals.complete_load_of_unpinned_chunk(key, refs.get(key, -1), count)
        for key in keys:
            refs[key] -= 1
            if refs[key] == 0:
                self._num_evictable += 1
                self.policy.mark_evictable(key)

    def touch(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None:
        """Mark the held ones of `keys` used, the first most recently. Complexity: O(k log n)."""
        self.policy.touch(_key_list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> StoreOutput | None:
        """Offer `keys` for storing (the spec's contract); None when room cannot be made.

        Raises:
            RequestError: the request finished.
            OffloadChunkError: a key is offered twice.

        Complexity: O(len(keys)) plus the policy's eviction.
        """
        keys = _key_list(keys)
        self._check_not_finished(request, "prepare_store")
        repeated = _first_repeated(keys)
        if repeated is not None:
            raise refusals.key_offered_twice(repeated, "prepare_store")

        refs = self.refs
        tracks_offers = self.config.tracks_offers
        if tracks_offers:
            self._count_offers(keys)
        to_store: list[OffloadKey] = []
        found_ready: list[OffloadKey] = []
        for key in keys:
            state = refs.get(key)
            if state is None:
                to_store.append(key)
            elif state >= 0:
                found_ready.append(key)
        if tracks_offers:
            counts, threshold = self._offer_counts, self.config.store_threshold
            to_store = [key for key in to_store if counts.get(key, 0) >= threshold]
        access = self._access(request)
        new_misses = [key for key in to_store if key not in access.store_misses]
        if new_misses:
            self.policy.on_store_miss(new_misses)
            access.store_misses.update(new_misses)
        if len(to_store) + len(found_ready) == len(keys):
            self._record_access(keys, request, found_ready)
        else:
            recorded = set(to_store)
            recorded.update(found_ready)
            self._record_access([key for key in keys if key in recorded], request, found_ready)
        if not to_store:
            return StoreOutput((), (), ())

        shortfall = len(to_store) - (self.config.num_chunks - len(refs))
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if shortfall > self._num_evictable:
                return None
            chosen = self.policy.evict(shortfall, set(keys))
            if chosen is None:
                return None
            evicted = chosen
            self._num_evictable -= len(evicted)
            for key in evicted:
                del refs[key]
                self._freed_ids.append(self._chunk_ids.pop(key))
            self._events.append(OffloadEvent(tuple(evicted), removed=True))

        num_fresh = min(len(to_store), self.config.num_chunks - self._num_fresh_used)
        new_ids = list(range(self._num_fresh_used, self._num_fresh_used + num_fresh))
        self._num_fresh_used += num_fresh
        freed = self._freed_ids
        new_ids.extend(freed.pop() for _ in range(len(to_store) - num_fresh))
        for key, chunk_id in zip(to_store, new_ids, strict=True):
            refs[key] = -1
            self._chunk_ids[key] = chunk_id
            self.policy.insert(key, request)
        self._num_pending += len(to_store)
        access.inserted.update(to_store)
        return StoreOutput(tuple(to_store), tuple(new_ids), tuple(evicted))

    def complete_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None:
        """End the stores of `keys`: ready on success, else freed.

        Raises:
            OffloadChunkError: a key is named twice, or its store is not pending.

        Complexity: O(len(keys)).
        """
        keys = _key_list(keys)
        repeated = _first_repeated(keys)
        if repeated is not None:
            raise refusals.key_offered_twice(repeated, "complete_store")
        refs = self.refs
        for key in keys:
            if refs.get(key) != -1:
                raise refusals.complete_store_of_chunk_not_pending(key, key in refs)
        if not keys:
            return
        self._num_pending -= len(keys)
        if success:
            for key in keys:
                refs[key] = 0
                self.policy.mark_evictable(key)
            self._num_evictable += len(keys)
        else:
            for key in keys:
                del refs[key]
                self._freed_ids.append(self._chunk_ids.pop(key))
                self.policy.remove(key)
        self._events.append(
            OffloadEvent(tuple(keys), removed=not success, metadata_only=not success)
        )

    def on_request_finished(self, request: OffloadRequest) -> None:
        """Commit the request's uses to the policy once. Complexity: O(k log k)."""
        access = self._accesses.get(request.req_id)
        if access is None or access.finished:
            return
        access.finished = True
        self.policy.on_request_finished(
            access.ordered_keys(request), access.inserted - access.reused, access.reused
        )

    def reset_cache(self) -> None:
        """Drop every chunk and request record; keep offer counts and untaken events. O(n)."""
        self.refs.clear()
        self._chunk_ids.clear()
        self._num_fresh_used = 0
        self._freed_ids.clear()
        self._num_evictable = 0
        self._num_pending = 0
        self.policy.clear()
        self._accesses.clear()

    def take_events(self) -> list[OffloadEvent]:
        """The events since the last call (the spec's filtering). Complexity: O(events)."""
        events, self._events = self._events, []
        taken: list[OffloadEvent] = []
        for event in events:
            if event.metadata_only:
                keys = tuple(key for key in event.keys if key not in self.refs)
                if not keys:
                    continue
                if len(keys) != len(event.keys):
                    taken.append(OffloadEvent(keys, event.removed, event.metadata_only))
                    continue
            taken.append(event)
        return taken

    def _check_not_finished(self, request: OffloadRequest, call: str) -> None:
        access = self._accesses.get(request.req_id)
        if access is not None and access.finished:
            raise refusals.submit_after_finish(request.req_id, call)

    def _access(self, request: OffloadRequest) -> RequestAccess:
        access = self._accesses.get(request.req_id)
        if access is None:
            access = self._accesses[request.req_id] = RequestAccess()
        return access

    def _record_access(
        self, keys: list[OffloadKey], request: OffloadRequest, reused: list[OffloadKey]
    ) -> None:
        access = self._access(request)
        new = access.see(keys)
        if new:
            self.policy.on_request_access(new, request)
        inserted = access.inserted
        access.reused.update(key for key in reused if key not in inserted)

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        counts = self._offer_counts
        offered_again = 0
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered_again += 1
        num_evictable = len(counts) - offered_again
        limit = self.config.max_tracker_size
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if num_evictable == 0:
                    continue
                counts.popitem(last=False)
                num_evictable -= 1
            counts[key] = 1

    def snapshot(self) -> OffloadTierSnapshot:
        """The whole state in plain values (the spec's form). Complexity: O(n log n)."""
        return OffloadTierSnapshot(
            refs=tuple(sorted(self.refs.items())),
            chunk_ids=tuple(sorted(self._chunk_ids.items())),
            freed_ids=tuple(self._freed_ids),
            num_fresh_used=self._num_fresh_used,
            policy=self.policy.snapshot(),
            offer_counts=tuple(self._offer_counts.items()),
            accesses=tuple((rid, self._accesses[rid].snapshot()) for rid in sorted(self._accesses)),
            events=tuple(self._events),
        )

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` naming the first broken invariant (the spec's). O(n)."""
        refs = self.refs
        bad = {key.hex(): state for key, state in refs.items() if state < -1}
        if bad:
            raise InvariantViolation(
                "a chunk is store pending (-1), ready (0) or pinned by n loads (n > 0)", str(bad)
            )
        if len(refs) > self.config.num_chunks:
            raise InvariantViolation(
                "the tier holds at most num_chunks chunks",
                f"{len(refs)} held, {self.config.num_chunks} chunks",
            )
        if self._chunk_ids.keys() != refs.keys():
            raise InvariantViolation("every held key has a chunk id, and only they", "")
        ids = sorted([*self._chunk_ids.values(), *self._freed_ids])
        if (
            ids != list(range(self._num_fresh_used))
            or self._num_fresh_used > self.config.num_chunks
        ):
            raise InvariantViolation(
                "each chunk id handed out is held by one key or freed, once",
                f"held {sorted(self._chunk_ids.values())}, freed {self._freed_ids}, "
                f"{self._num_fresh_used} handed out",
            )
        num_evictable = sum(1 for state in refs.values() if state == 0)
        num_pending = sum(1 for state in refs.values() if state == -1)
        if (self._num_evictable, self._num_pending) != (num_evictable, num_pending):
            raise InvariantViolation(
                "the tier's counts of evictable and pending chunks are right",
                f"counted {self._num_evictable} evictable and {self._num_pending} pending, "
                f"hold {num_evictable} and {num_pending}",
            )
        self.policy.check_invariants()
        if len(self._offer_counts) > self.config.max_tracker_size or (
            not self.config.tracks_offers and self._offer_counts
        ):
            raise InvariantViolation(
                "the offer tracker counts at most max_tracker_size keys, and only with a threshold",
                f"{len(self._offer_counts)} counted",
            )
        for request_id, access in self._accesses.items():
            access.check_invariants(request_id)
