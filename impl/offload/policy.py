"""What the tier's eviction policies answer (`CachePolicy`), in the tier's fast form.

A policy shares the tier's `refs` (key -> -1 store pending, 0 ready, n > 0 pinned) and is told
when a chunk becomes evictable (`mark_evictable`: refs reached 0) or stops being so
(`mark_pinned`: a load pinned a ready chunk). The contract of each call is the spec's
(`pagedkv.spec.offload.policy`); here `evict` is given the keys it must not take instead of
the candidates, and finds the candidates itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence, Set

from pagedkv.vocab.offload import OffloadKey, OffloadRequest


class CachePolicy(ABC):
    """The operations every policy answers; `capacity` is the tier's number of chunks."""

    def __init__(self, capacity: int, refs: dict[OffloadKey, int]) -> None:
        self.capacity = capacity
        self.refs = refs

    @abstractmethod
    def insert(self, key: OffloadKey, request: OffloadRequest) -> None: ...

    @abstractmethod
    def remove(self, key: OffloadKey) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None: ...

    def on_request_access(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        return

    @abstractmethod
    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None: ...

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None: ...

    @abstractmethod
    def clear(self) -> None: ...

    def mark_evictable(self, key: OffloadKey) -> None:
        return

    def mark_pinned(self, key: OffloadKey) -> None:
        return

    @abstractmethod
    def snapshot(self) -> tuple[tuple[str, object], ...]:
        """The policy's state, part by part (`OffloadTierSnapshot.policy`)."""

    @abstractmethod
    def check_invariants(self) -> None: ...
