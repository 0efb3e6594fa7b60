"""ARC (the spec's `pagedkv.spec.offload.arc`) over four ordered dicts, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence, Set

from pagedkv.offload.policy import CachePolicy
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import OffloadKey, OffloadRequest


class ARCPolicy(CachePolicy):
    """ARC: every call O(1) per key named, `evict` O(keys scanned past)."""

    def __init__(self, capacity: int, refs: dict[OffloadKey, int]) -> None:
        super().__init__(capacity, refs)
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target = 0.0

    def insert(self, key: OffloadKey, request: OffloadRequest) -> None:
        self.t1[key] = None
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def _adapt(self, key: OffloadKey) -> None:
        b1, b2 = self.b1, self.b2
        if key in b1:
            self.target = min(self.target + max(1, len(b2) / len(b1)), self.capacity)
            b1.move_to_end(key)
        elif key in b2:
            self.target = max(self.target - max(1, len(b1) / len(b2)), 0.0)
            b2.move_to_end(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                if self.refs[key] < 0:  # pending: only just offered, not a second use
                    self.t1.move_to_end(key)
                else:
                    del self.t1[key]
                    self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            self._adapt(key)

    def on_request_finished(
        self,
        ordered_keys: Sequence[OffloadKey],
        insertion_only: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(ordered_keys):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        refs = self.refs

        def candidates(keys: Iterator[OffloadKey]) -> Iterator[OffloadKey]:
            return (key for key in keys if refs[key] == 0 and key not in protected)

        # Each list is scanned once, from its least recent end: a key passed is never due.
        from_t1, from_t2 = candidates(iter(self.t1)), candidates(iter(self.t2))
        t1_size, threshold = len(self.t1), int(self.target)
        chosen: list[tuple[OffloadKey, bool]] = []
        for _ in range(n):
            key = next(from_t1, None) if t1_size >= threshold else None
            in_t1 = key is not None
            if key is None:
                key = next(from_t2, None)
            if key is None:
                key = next(from_t1, None)
                in_t1 = True
            if key is None:
                return None
            if in_t1:
                t1_size -= 1
            chosen.append((key, in_t1))
        for key, in_t1 in chosen:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [key for key, _ in chosen]

    def clear(self) -> None:
        for keys in (self.t1, self.t2, self.b1, self.b2):
            keys.clear()
        self.target = 0.0

    def snapshot(self) -> tuple[tuple[str, object], ...]:
        return (
            ("t1", tuple(self.t1)),
            ("t2", tuple(self.t2)),
            ("b1", tuple(self.b1)),
            ("b2", tuple(self.b2)),
            ("target", self.target),
        )

    def check_invariants(self) -> None:
        t1, t2, b1, b2 = self.t1.keys(), self.t2.keys(), self.b1.keys(), self.b2.keys()
        overlaps = (t1 & t2) | ((t1 | t2) & (b1 | b2)) | (b1 & b2)
        if overlaps:
            raise InvariantViolation(
                "every ARC key is in exactly one list",
                f"in two lists: {sorted(key.hex() for key in overlaps)}",
            )
        if (t1 | t2) != self.refs.keys():
            raise InvariantViolation(
                "T1 and T2 hold exactly the held keys",
                f"T1 {len(t1)} + T2 {len(t2)} keys, {len(self.refs)} held",
            )
        if len(t1) + len(t2) > self.capacity:
            raise InvariantViolation("|T1| + |T2| <= c", f"{len(t1)} + {len(t2)} > {self.capacity}")
        if len(b1) > self.capacity or len(b2) > self.capacity:
            raise InvariantViolation(
                "each ghost list holds at most c keys",
                f"|B1| {len(b1)}, |B2| {len(b2)}, c {self.capacity}",
            )
        if not 0 <= self.target <= self.capacity:
            raise InvariantViolation("0 <= target <= c", f"target {self.target}, c {self.capacity}")
