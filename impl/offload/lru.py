"""LRU over ranks (the spec's `pagedkv.spec.offload.lru`), with a lazily cleaned min-heap.

The heap holds `(rank, key)` entries for evictable keys; an entry is live while its key is
evictable and still has that rank. Rank changes and pins leave stale entries behind, dropped
when popped and by a rebuild once stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence, Set

from pagedkv.offload.policy import CachePolicy
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import OffloadKey, OffloadRequest

Rank = tuple[int, int]
_MIN_REBUILD = 64


class LRUPolicy(CachePolicy):
    """LRU: `touch` O(k log n), `evict` O((n + stale) log n), the rest O(1) amortized."""

    def __init__(self, capacity: int, refs: dict[OffloadKey, int]) -> None:
        super().__init__(capacity, refs)
        self._ranks: dict[OffloadKey, Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[Rank, OffloadKey]] = []
        self._counter = 0
        self._request_ranks: dict[str, int] = {}

    def _draw(self) -> int:
        self._counter += 1
        return self._counter

    def _rerank(self, key: OffloadKey, rank: Rank) -> None:
        self._ranks[key] = rank
        if key in self._evictable:
            heapq.heappush(self._heap, (rank, key))

    def _request_rank(self, request: OffloadRequest) -> int:
        rank = self._request_ranks.get(request.req_id)
        if rank is None:
            rank = self._request_ranks[request.req_id] = self._draw()
        return rank

    def _maybe_rebuild(self) -> None:
        if len(self._heap) >= max(_MIN_REBUILD, 2 * len(self._evictable)):
            self._heap = [(self._ranks[key], key) for key in self._evictable]
            heapq.heapify(self._heap)

    def insert(self, key: OffloadKey, request: OffloadRequest) -> None:
        position = request.key_positions.get(key)
        if position is None:
            self._ranks[key] = (self._draw(), 0)
        else:
            self._ranks[key] = (self._request_rank(request), -position)

    def remove(self, key: OffloadKey) -> None:
        del self._ranks[key]
        self._evictable.discard(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        ranks = self._ranks
        for key in reversed(keys):
            if key in ranks:
                self._rerank(key, (self._draw(), 0))
        self._maybe_rebuild()

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        return  # a store miss names keys not held: no rank to change

    def on_request_access(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        request_rank = self._request_rank(request)
        positions = request.key_positions
        for key in keys:
            position = positions.get(key)
            current = self._ranks.get(key)
            if position is None or current is None:
                continue
            if current < (request_rank, -position):
                self._rerank(key, (request_rank, -position))
        self._maybe_rebuild()

    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self.touch(ordered_keys)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n == 0:
            return []
        heap = self._heap
        taken: list[tuple[Rank, OffloadKey]] = []
        skipped: list[tuple[Rank, OffloadKey]] = []
        taken_keys: set[OffloadKey] = set()
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in self._evictable or self._ranks[key] != rank or key in taken_keys:
                continue  # stale, or a second live entry of a key already taken
            if key in protected:
                skipped.append(entry)
            else:
                taken.append(entry)
                taken_keys.add(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(taken) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        for _, key in taken:
            self._evictable.remove(key)
            del self._ranks[key]
        self._maybe_rebuild()
        return [key for _, key in taken]

    def clear(self) -> None:
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._counter = 0
        self._request_ranks.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._maybe_rebuild()

    def mark_pinned(self, key: OffloadKey) -> None:
        self._evictable.remove(key)

    def snapshot(self) -> tuple[tuple[str, object], ...]:
        return (
            ("ranks", tuple(sorted(self._ranks.items()))),
            ("next_rank", self._counter),
            ("request_ranks", tuple(sorted(self._request_ranks.items()))),
        )

    def check_invariants(self) -> None:
        if self._ranks.keys() != self.refs.keys():
            raise InvariantViolation(
                "LRU ranks exactly the held keys",
                f"{len(self._ranks)} ranked, {len(self.refs)} held",
            )
        evictable = {key for key, refs in self.refs.items() if refs == 0}
        if self._evictable != evictable:
            raise InvariantViolation(
                "the LRU's evictable keys are the ready, unpinned ones",
                f"{len(self._evictable)} marked evictable, {len(evictable)} ready and unpinned",
            )
        live = {key for rank, key in self._heap if self._ranks.get(key) == rank}
        if not self._evictable <= live:
            raise InvariantViolation(
                "every evictable key has a live heap entry",
                f"missing: {sorted(key.hex() for key in self._evictable - live)}",
            )
        drawn = [rank for rank, _ in self._ranks.values()] + list(self._request_ranks.values())
        if any(not 1 <= rank <= self._counter for rank in drawn):
            raise InvariantViolation(
                "every LRU rank was drawn from the counter",
                f"ranks {sorted(drawn)}, counter at {self._counter}",
            )
