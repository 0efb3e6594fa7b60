"""The words of the CPU offload tier that spec and implementation share.

A tier holds KV data for *chunks* in host memory, one chunk per `OffloadKey`: the bytes of a
block hash followed by the 4-byte big-endian index of its KV cache group (vLLM 0.33's
`make_offload_key`). The scheduler tells the tier, per request, where each key's chunk ends in
the request's tokens (`OffloadRequest.key_positions`), so that policies can order a request's
chunks head to tail. What the tier does with these is decided on each side:
`pagedkv.spec.offload` plainly, `pagedkv.offload` fast.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, NewType

from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError

OffloadKey = NewType("OffloadKey", bytes)
"""A chunk's key: block hash bytes + the group index as 4 big-endian bytes."""

GROUP_INDEX_BYTES = 4
PolicyName = Literal["lru", "arc"]
POLICY_NAMES: tuple[PolicyName, ...] = ("lru", "arc")


def make_offload_key(block_hash: bytes, group: int) -> OffloadKey:
    """The key of the chunk ending with `block_hash` in KV cache group `group`."""
    if not isinstance(block_hash, bytes):
        raise ArgumentTypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 1 << 32:
        raise InvalidArgumentError(f"group must be an int in [0, 2**32), got {group!r}")
    return OffloadKey(block_hash + group.to_bytes(GROUP_INDEX_BYTES, "big"))


def offload_key_group(key: OffloadKey) -> int:
    """The KV cache group index a key names."""
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")


def offload_key_hash(key: OffloadKey) -> bytes:
    """The block hash a key names."""
    return key[:-GROUP_INDEX_BYTES]


class LookupResult(enum.Enum):
    """What `lookup` says of one key (vLLM's `RETRY` is never an answer of a CPU tier)."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"


@dataclass(frozen=True)
class OffloadTierConfig:
    """A CPU tier's shape, validated on construction.

    Attributes:
        num_chunks: host chunks the tier holds at most (>= 1).
        policy: which chunk is evicted first: "lru" or "arc".
        store_threshold: a key is stored only once it was offered this many times (1: always);
            offers are counted by a tracker of at most `max_tracker_size` keys.
        max_tracker_size: how many keys the offer tracker remembers (>= 1).
    """

    num_chunks: int
    policy: PolicyName = "lru"
    store_threshold: int = 1
    max_tracker_size: int = 64_000

    def __post_init__(self) -> None:
        for name in ("num_chunks", "store_threshold", "max_tracker_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
        if self.policy not in POLICY_NAMES:
            raise InvalidArgumentError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")

    @property
    def tracks_offers(self) -> bool:
        """Whether offers are counted (a threshold of 2 or more)."""
        return self.store_threshold >= 2


@dataclass
class OffloadRequest:
    """What the tier is told of one request: its id and where its chunks end.

    `key_positions[key]` is the number of the request's tokens up to the end of `key`'s chunk.
    The scheduler adds a key's position before it first passes the key for this request and
    never changes it; a key without a position is ordered by when the tier sees it.
    """

    req_id: str
    key_positions: dict[OffloadKey, int] = field(default_factory=dict)

    def place(self, key: OffloadKey, end_token: int) -> None:
        """Record that `key`'s chunk ends at token `end_token` of this request."""
        self.key_positions[key] = end_token


@dataclass(frozen=True)
class StoreOutput:
    """`prepare_store`'s answer when the store can go ahead.

    Attributes:
        keys_to_store: the offered keys the caller must now write, in offer order (the others
            are held already, or not offered often enough yet).
        chunk_ids: the host chunk each of them is written to.
        evicted_keys: the keys evicted to make room, in eviction order.
    """

    keys_to_store: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    evicted_keys: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class OffloadEvent:
    """Keys stored in (`removed` False) or removed from (`removed` True) the tier.

    `metadata_only` marks the removal of a failed store: the chunk never held data, so no
    reader saw it; such a key is dropped from the event if a retry holds it again when the
    events are taken.
    """

    keys: tuple[OffloadKey, ...]
    removed: bool
    metadata_only: bool = False


@dataclass(frozen=True)
class AccessSnapshot:
    """One request's record: seen keys per group (first-seen order), and the sorted sets."""

    key_groups: tuple[tuple[int, tuple[OffloadKey, ...]], ...]
    inserted: tuple[OffloadKey, ...]
    reused: tuple[OffloadKey, ...]
    store_misses: tuple[OffloadKey, ...]
    finished: bool


@dataclass(frozen=True)
class OffloadTierSnapshot:
    """A tier's whole state in plain values, equal for two tiers in the same state.

    `policy` names each part of the policy's state: LRU's `ranks`, `next_rank`,
    `request_ranks`; ARC's `t1`, `t2`, `b1`, `b2` (least recent first) and `target`.
    """

    refs: tuple[tuple[OffloadKey, int], ...]
    chunk_ids: tuple[tuple[OffloadKey, int], ...]
    freed_ids: tuple[int, ...]
    num_fresh_used: int
    policy: tuple[tuple[str, object], ...]
    offer_counts: tuple[tuple[OffloadKey, int], ...]
    accesses: tuple[tuple[str, AccessSnapshot], ...]
    events: tuple[OffloadEvent, ...]
