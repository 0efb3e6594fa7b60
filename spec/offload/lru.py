"""LRU as vLLM 0.33 ranks it: every held key has a rank, the lowest rank is evicted first.

A rank is a pair compared in order: `(n, 0)` for a use outside a request's order (a touch, a
finished request's recommit, a store of a key without a position), where `n` counts up from 1
(`next_rank`); `(r, -position)` for a key a running request placed, where `r` is the request's
own number, drawn from the same counter the first time the request needs one. So, within one
request, the tail (the highest position) ranks below the head and is evicted first. Ties (two
keys of one request at one position, in two groups) are broken by the key's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from pagedkv.spec.offload.policy import SpecPolicy
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import OffloadKey, OffloadRequest

Rank = tuple[int, int]


class SpecLRU(SpecPolicy):
    """LRU over ranks, stated plainly: eviction sorts the candidates by (rank, key)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ranks: dict[OffloadKey, Rank] = {}
        self.next_rank = 0
        self.request_ranks: dict[str, int] = {}

    def _fresh_rank(self) -> Rank:
        self.next_rank += 1
        return (self.next_rank, 0)

    def _request_rank(self, request: OffloadRequest) -> int:
        if request.req_id not in self.request_ranks:
            self.next_rank += 1
            self.request_ranks[request.req_id] = self.next_rank
        return self.request_ranks[request.req_id]

    def insert(self, key: OffloadKey, request: OffloadRequest) -> None:
        position = request.key_positions.get(key)
        if position is None:
            self.ranks[key] = self._fresh_rank()
        else:
            self.ranks[key] = (self._request_rank(request), -position)

    def remove(self, key: OffloadKey) -> None:
        del self.ranks[key]

    def touch(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        # The last key gets the first new rank: the first key ends up the most recent.
        for key in reversed(keys):
            if key in self.ranks:
                self.ranks[key] = self._fresh_rank()

    def on_store_miss(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        self.touch(keys, ready)  # the keys are not held: nothing changes

    def on_request_access(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        request_rank = self._request_rank(request)  # drawn even if no key is held
        for key in keys:
            position = request.key_positions.get(key)
            if position is None or key not in self.ranks:
                continue
            # A placed key's rank only ever rises.
            self.ranks[key] = max(self.ranks[key], (request_rank, -position))

    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self.touch(ordered_keys, set())

    def evict(self, n: int, candidates: Set[OffloadKey]) -> list[OffloadKey] | None:
        order = sorted(candidates, key=lambda key: (self.ranks[key], key))
        if len(order) < n:
            return None
        chosen = order[:n]
        for key in chosen:
            del self.ranks[key]
        return chosen

    def clear(self) -> None:
        self.ranks = {}
        self.next_rank = 0
        self.request_ranks = {}

    def snapshot(self) -> tuple[tuple[str, object], ...]:
        return (
            ("ranks", tuple(sorted(self.ranks.items()))),
            ("next_rank", self.next_rank),
            ("request_ranks", tuple(sorted(self.request_ranks.items()))),
        )

    def check_invariants(self, held: Set[OffloadKey]) -> None:
        if set(self.ranks) != set(held):
            raise InvariantViolation(
                "LRU ranks exactly the held keys",
                f"ranked but not held: {sorted(set(self.ranks) - set(held))}, held but not "
                f"ranked: {sorted(set(held) - set(self.ranks))}",
            )
        drawn = [rank for rank, _ in self.ranks.values()] + list(self.request_ranks.values())
        if any(not 1 <= rank <= self.next_rank for rank in drawn):
            raise InvariantViolation(
                "every LRU rank was drawn from the counter",
                f"ranks {sorted(drawn)}, counter at {self.next_rank}",
            )
