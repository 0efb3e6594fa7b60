"""What a spec eviction policy is told, and what it decides: which held chunk goes first.

The tier (`tier.py`) owns the chunks and their states; a policy owns only an order over the
held keys (and, for ARC, ghosts of evicted ones). The tier tells it of every change to the set
of held keys (`insert`, `remove`, `evict`, `clear`) and of every use (`touch`,
`on_store_miss`, `on_request_access`, `on_request_finished`), and asks it to pick victims
among the candidates it names (ready, unpinned, not offered by the store that needs room).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set

from pagedkv.vocab.offload import OffloadKey, OffloadRequest


class SpecPolicy(ABC):
    """The operations every spec policy answers; `capacity` is the tier's number of chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: OffloadKey, request: OffloadRequest) -> None:
        """`key` is newly held (its store pending), stored by `request`."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """`key` is no longer held: its store failed (no ghost is kept)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        """`keys` were used, the first most recently (`ready`: the held keys that are ready)."""

    @abstractmethod
    def on_store_miss(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        """`keys`, not held, are about to be stored (each once per request)."""

    @abstractmethod
    def on_request_access(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        """`request` saw `keys` for the first time (held or not)."""

    @abstractmethod
    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        """A request finished; `ordered_keys` is every key it saw, head to tail; it stored the
        keys of `insertion_only` and read (loaded, or found stored) those of `reused`."""

    @abstractmethod
    def evict(self, n: int, candidates: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Choose `n` of `candidates` and forget them as held, in eviction order; None (and
        nothing changed) when fewer than `n` can be chosen."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (a reset)."""

    @abstractmethod
    def snapshot(self) -> tuple[tuple[str, object], ...]:
        """The policy's state, part by part (`OffloadTierSnapshot.policy`)."""

    @abstractmethod
    def check_invariants(self, held: Set[OffloadKey]) -> None:
        """Raise `InvariantViolation` unless the policy's state fits the tier's `held` keys."""
