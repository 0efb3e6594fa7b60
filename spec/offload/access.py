"""What the tier remembers of one request: every key it saw, and how (vLLM 0.33's record).

A key is *seen* the first time the request loads it or offers it for storing (if it is to be
stored, or already stored and ready); keys are kept per KV cache group in the order first seen.
*Inserted* keys are those this request stored; *reused* ones those it loaded or found stored
and ready, unless it had stored them itself first; *store misses* are keys it offered for
storing while they were not held (each told to the policy once). A finished request sees no new
key. The record lives until the request finishes, and a reset forgets every record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import (
    AccessSnapshot,
    OffloadKey,
    OffloadRequest,
    offload_key_group,
)


@dataclass
class SpecRequestAccess:
    """One request's record; `key_groups[g]` lists group g's keys in the order first seen."""

    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False

    @property
    def seen(self) -> set[OffloadKey]:
        return {key for keys in self.key_groups.values() for key in keys}

    def see(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Record `keys` as seen; return those seen for the first time, in order."""
        new: list[OffloadKey] = []
        for key in keys:
            if key not in self.seen and key not in new:
                self.key_groups.setdefault(offload_key_group(key), []).append(key)
                new.append(key)
        return new

    def ordered_keys(self, request: OffloadRequest) -> list[OffloadKey]:
        """Every seen key, head to tail: groups in index order, each by position when all its
        keys have one, then the whole by position when all keys have one (stable sorts)."""

        def by_position(keys: list[OffloadKey]) -> list[OffloadKey]:
            if all(key in request.key_positions for key in keys):
                return sorted(keys, key=lambda key: request.key_positions[key])
            return list(keys)

        groups = [by_position(self.key_groups[group]) for group in sorted(self.key_groups)]
        return by_position([key for keys in groups for key in keys])

    def snapshot(self) -> AccessSnapshot:
        return AccessSnapshot(
            tuple((group, tuple(self.key_groups[group])) for group in sorted(self.key_groups)),
            tuple(sorted(self.inserted)),
            tuple(sorted(self.reused)),
            tuple(sorted(self.store_misses)),
            self.finished,
        )

    def check_invariants(self, request_id: str) -> None:
        for group, keys in self.key_groups.items():
            if len(set(keys)) != len(keys) or any(offload_key_group(k) != group for k in keys):
                raise InvariantViolation(
                    "a request's seen keys are listed once, under their group",
                    f"request {request_id!r}, group {group}: {[k.hex() for k in keys]}",
                )
        unseen = (self.inserted | self.reused | self.store_misses) - self.seen
        if unseen:
            raise InvariantViolation(
                "a request stored, reused or missed only keys it saw",
                f"request {request_id!r}: {sorted(k.hex() for k in unseen)}",
            )
