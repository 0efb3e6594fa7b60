"""ARC (Megiddo and Modha's Adaptive Replacement Cache) as vLLM 0.33 runs it over chunks.

Four lists, each least recent first: T1 holds the chunks used once (every new store lands
there), T2 those reused; B1 and B2 are ghosts, keys recently evicted from T1 and T2. `target`
(the paper's p) is how large T1 should be. A store of a key found in a ghost list adapts it:
a B1 ghost says T1 was too small (`target` grows by max(1, |B2|/|B1|), up to the capacity), a
B2 ghost that T2 was (it shrinks by max(1, |B1|/|B2|), down to 0). Eviction takes T1's least
recent candidate while T1 holds at least `int(target)` chunks (counting those already taken),
else T2's, else T1's after all. vLLM's variant: a reuse is counted once per request, when the
request finishes (T1 -> T2), and each ghost list is bounded by the capacity on its own.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from pagedkv.spec.offload.policy import SpecPolicy
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import OffloadKey, OffloadRequest


def _move_to_end(keys: list[OffloadKey], key: OffloadKey) -> None:
    keys.remove(key)
    keys.append(key)


class SpecARC(SpecPolicy):
    """ARC over four plain lists (least recent first) and the target size of T1."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: list[OffloadKey] = []
        self.t2: list[OffloadKey] = []
        self.b1: list[OffloadKey] = []
        self.b2: list[OffloadKey] = []
        self.target = 0.0

    def insert(self, key: OffloadKey, request: OffloadRequest) -> None:
        self.t1.append(key)
        for ghosts in (self.b1, self.b2):
            if key in ghosts:
                ghosts.remove(key)

    def remove(self, key: OffloadKey) -> None:
        (self.t1 if key in self.t1 else self.t2).remove(key)

    def _adapt(self, key: OffloadKey) -> None:
        if key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
            _move_to_end(self.b1, key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0.0)
            _move_to_end(self.b2, key)

    def touch(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                self.t1.remove(key)
                # A pending chunk was only just offered for storing: not a second use.
                (self.t2 if key in ready else self.t1).append(key)
            elif key in self.t2:
                _move_to_end(self.t2, key)
            else:
                self._adapt(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], ready: Set[OffloadKey]) -> None:
        for key in reversed(keys):
            self._adapt(key)

    def on_request_access(self, keys: Sequence[OffloadKey], request: OffloadRequest) -> None:
        return  # ARC learns of a request's uses when it finishes

    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        for key in reversed(ordered_keys):
            if key in insertion_only:  # a store is recency, not a second use
                if key in self.t1:
                    _move_to_end(self.t1, key)
                elif key in self.t2:
                    _move_to_end(self.t2, key)
            elif key in reused and key in self.t1:
                self.t1.remove(key)
                self.t2.append(key)
            elif key in reused and key in self.t2:
                _move_to_end(self.t2, key)

    def evict(self, n: int, candidates: Set[OffloadKey]) -> list[OffloadKey] | None:
        chosen: list[OffloadKey] = []
        from_t1: set[OffloadKey] = set()
        t1_size = len(self.t1)

        def first(keys: list[OffloadKey]) -> OffloadKey | None:
            return next((k for k in keys if k in candidates and k not in chosen), None)

        for _ in range(n):
            key = first(self.t1) if t1_size >= int(self.target) else None
            if key is None:
                key = first(self.t2)
            if key is None:
                key = first(self.t1)
            if key is None:
                return None
            if key in self.t1:
                from_t1.add(key)
                t1_size -= 1
            chosen.append(key)
        for key in chosen:
            if key in from_t1:
                self.t1.remove(key)
                self.b1.append(key)
            else:
                self.t2.remove(key)
                self.b2.append(key)
        self.b1 = self.b1[max(0, len(self.b1) - self.capacity) :]
        self.b2 = self.b2[max(0, len(self.b2) - self.capacity) :]
        return chosen

    def clear(self) -> None:
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []
        self.target = 0.0

    def snapshot(self) -> tuple[tuple[str, object], ...]:
        return (
            ("t1", tuple(self.t1)),
            ("t2", tuple(self.t2)),
            ("b1", tuple(self.b1)),
            ("b2", tuple(self.b2)),
            ("target", self.target),
        )

    def check_invariants(self, held: Set[OffloadKey]) -> None:
        lists = {"T1": self.t1, "T2": self.t2, "B1": self.b1, "B2": self.b2}
        seen: dict[OffloadKey, str] = {}
        for name, keys in lists.items():
            for key in keys:
                if key in seen:
                    raise InvariantViolation(
                        "every ARC key is in exactly one list",
                        f"{key.hex()} is in {seen[key]} and in {name}",
                    )
                seen[key] = name
        if set(self.t1) | set(self.t2) != set(held):
            raise InvariantViolation(
                "T1 and T2 hold exactly the held keys",
                f"T1 {len(self.t1)} + T2 {len(self.t2)} keys, {len(held)} held",
            )
        if len(self.t1) + len(self.t2) > self.capacity:
            raise InvariantViolation(
                "|T1| + |T2| <= c", f"{len(self.t1)} + {len(self.t2)} > {self.capacity}"
            )
        if len(self.b1) > self.capacity or len(self.b2) > self.capacity:
            raise InvariantViolation(
                "each ghost list holds at most c keys",
                f"|B1| {len(self.b1)}, |B2| {len(self.b2)}, c {self.capacity}",
            )
        if not 0 <= self.target <= self.capacity:
            raise InvariantViolation("0 <= target <= c", f"target {self.target}, c {self.capacity}")
