"""What the tier remembers of one request (the spec's `pagedkv.spec.offload.access`)."""

from __future__ import annotations

from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import (
    AccessSnapshot,
    OffloadKey,
    OffloadRequest,
    offload_key_group,
)


class RequestAccess:
    """One request's seen keys per group (first-seen order), and how it used them."""

    __slots__ = ("finished", "inserted", "key_groups", "reused", "seen", "store_misses")

    def __init__(self) -> None:
        self.key_groups: dict[int, list[OffloadKey]] = {}
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_misses: set[OffloadKey] = set()
        self.finished = False

    def see(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Record `keys` as seen; return those new, in order. O(len(keys))."""
        seen, groups = self.seen, self.key_groups
        new: list[OffloadKey] = []
        for key in keys:
            if key not in seen:
                seen.add(key)
                group = offload_key_group(key)
                if group in groups:
                    groups[group].append(key)
                else:
                    groups[group] = [key]
                new.append(key)
        return new

    def ordered_keys(self, request: OffloadRequest) -> list[OffloadKey]:
        """Seen keys head to tail (the spec's order). O(k log k)."""
        positions = request.key_positions
        ordered: list[OffloadKey] = []
        for group in sorted(self.key_groups):
            keys = self.key_groups[group]
            if all(key in positions for key in keys):
                keys = sorted(keys, key=positions.__getitem__)
            ordered.extend(keys)
        if all(key in positions for key in ordered):
            ordered.sort(key=positions.__getitem__)
        return ordered

    def snapshot(self) -> AccessSnapshot:
        return AccessSnapshot(
            tuple((group, tuple(self.key_groups[group])) for group in sorted(self.key_groups)),
            tuple(sorted(self.inserted)),
            tuple(sorted(self.reused)),
            tuple(sorted(self.store_misses)),
            self.finished,
        )

    def check_invariants(self, request_id: str) -> None:
        listed = [key for keys in self.key_groups.values() for key in keys]
        if (
            len(listed) != len(self.seen)
            or set(listed) != self.seen
            or any(
                offload_key_group(key) != group
                for group, keys in self.key_groups.items()
                for key in keys
            )
        ):
            raise InvariantViolation(
                "a request's seen keys are listed once, under their group",
                f"request {request_id!r}: {len(listed)} listed, {len(self.seen)} seen",
            )
        unseen = (self.inserted | self.reused | self.store_misses) - self.seen
        if unseen:
            raise InvariantViolation(
                "a request stored, reused or missed only keys it saw",
                f"request {request_id!r}: {sorted(k.hex() for k in unseen)}",
            )
