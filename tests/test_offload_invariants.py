"""Every invariant of the CPU offload tier can be broken, and is reported by its name.

Each case corrupts one thing in a tier in a known state (the spec's and the implementation's,
each in its own representation) and expects `check_invariants()` to name the broken invariant;
an invariant no corruption can break would not be checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedkv.offload import OffloadRequest, OffloadTier, OffloadTierConfig, make_offload_key
from pagedkv.spec.offload import SpecOffloadTier
from pagedkv.vocab.errors import InvariantViolation

KEYS = [make_offload_key(bytes([block]), block % 2) for block in range(6)]
ALIEN = make_offload_key(b"\xff", 0)


def built(side: str, policy: Any, threshold: int = 1) -> Any:
    """Three chunks: key 0 ready, key 1 pinned once, key 2 pending; key 3 evicted (a ghost)."""
    make = SpecOffloadTier if side == "spec" else OffloadTier
    tier = make(OffloadTierConfig(3, policy, store_threshold=threshold, max_tracker_size=8))
    request = OffloadRequest("a", {key: 4 * (i + 1) for i, key in enumerate(KEYS)})
    for _ in range(threshold):
        out = tier.prepare_store(KEYS[:3], request)
    assert out is not None
    tier.complete_store(list(out.keys_to_store), request)
    tier.prepare_load([KEYS[1]], request)
    for _ in range(threshold):
        out = tier.prepare_store([KEYS[3]], request)
    tier.complete_store([KEYS[3]], request)
    tier.on_request_finished(request)
    for _ in range(threshold):
        tier.prepare_store([KEYS[2]], OffloadRequest("b"))  # evicts key 3 or key 0
    tier.check_invariants()
    return tier


def refs(tier: Any) -> Any:
    return tier.refs


def chunk_ids(tier: Any) -> Any:
    return tier.chunk_ids if isinstance(tier, SpecOffloadTier) else tier._chunk_ids


def access(tier: Any) -> Any:
    accesses = tier.accesses if isinstance(tier, SpecOffloadTier) else tier._accesses
    return accesses["a"]


def lru_ranks(tier: Any) -> Any:
    policy: Any = tier.policy
    return policy.ranks if isinstance(tier, SpecOffloadTier) else policy._ranks


def held_key(tier: Any) -> Any:
    """A held key other than key 1 (the pinned one)."""
    return next(key for key in refs(tier) if key != KEYS[1])


def add_arc_ghost(tier: Any, which: str, key: bytes) -> None:
    ghosts = getattr(tier.policy, which)
    if isinstance(ghosts, list):
        ghosts.append(key)
    else:
        ghosts[key] = None


def add_ghosts(tier: Any, which: str, keys: list[bytes]) -> None:
    for key in keys:
        add_arc_ghost(tier, which, key)


Corruption = Callable[[Any], object]
SHARED: dict[str, tuple[str, Corruption]] = {
    "state below -1": (
        "a chunk is store pending (-1), ready (0) or pinned by n loads (n > 0)",
        lambda t: refs(t).__setitem__(held_key(t), -2),
    ),
    "id of a key not held": (
        "every held key has a chunk id, and only they",
        lambda t: chunk_ids(t).__setitem__(ALIEN, 7),
    ),
    "two keys on one chunk id": (
        "each chunk id handed out is held by one key or freed, once",
        lambda t: chunk_ids(t).__setitem__(held_key(t), chunk_ids(t)[KEYS[1]]),
    ),
    "seen twice": (
        "a request's seen keys are listed once, under their group",
        lambda t: access(t).key_groups[0].append(access(t).key_groups[0][0]),
    ),
    "reused unseen": (
        "a request stored, reused or missed only keys it saw",
        lambda t: access(t).reused.add(ALIEN),
    ),
}
LRU: dict[str, tuple[str, Corruption]] = {
    "rank of a key not held": (
        "LRU ranks exactly the held keys",
        lambda t: lru_ranks(t).__setitem__(ALIEN, (1, 0)),
    ),
    "rank never drawn": (
        "every LRU rank was drawn from the counter",
        lambda t: lru_ranks(t).__setitem__(KEYS[1], (10_000, 0)),  # pinned: in no heap entry
    ),
}
ARC: dict[str, tuple[str, Corruption]] = {
    "a key in T1 and B1": (
        "every ARC key is in exactly one list",
        lambda t: add_arc_ghost(t, "b1", next(iter(t.policy.t1))),
    ),
    "T1 holds a key not held": (
        "T1 and T2 hold exactly the held keys",
        lambda t: add_arc_ghost(t, "t1", ALIEN),
    ),
    "T1 and T2 over capacity": (
        "|T1| + |T2| <= c",
        lambda t: setattr(t.policy, "capacity", 1),
    ),
    "a ghost list over capacity": (
        "each ghost list holds at most c keys",
        lambda t: add_ghosts(t, "b2", [bytes([200 + i]) + bytes(4) for i in range(4)]),
    ),
    "target past c": ("0 <= target <= c", lambda t: setattr(t.policy, "target", 3.5)),
}


def cases() -> list[Any]:
    out = []
    for side in ("spec", "impl"):
        for policy, table in (("lru", {**SHARED, **LRU}), ("arc", {**SHARED, **ARC})):
            for name, (invariant, corrupt) in table.items():
                out.append(
                    pytest.param(side, policy, invariant, corrupt, id=f"{side}-{policy}-{name}")
                )
    return out


@pytest.mark.parametrize(("side", "policy", "invariant", "corrupt"), cases())
def test_a_corruption_is_reported_by_the_invariant_it_breaks(
    side: str, policy: str, invariant: str, corrupt: Corruption
) -> None:
    tier = built(side, policy)
    corrupt(tier)
    with pytest.raises(InvariantViolation) as info:
        tier.check_invariants()
    assert info.value.invariant == invariant


@pytest.mark.parametrize("side", ["spec", "impl"])
def test_a_tracker_over_its_bound_is_reported(side: str) -> None:
    tier = built(side, "lru", threshold=2)
    counts = tier.offer_counts if side == "spec" else tier._offer_counts
    for i in range(9):
        counts[bytes([100 + i]) + bytes(4)] = 1
    with pytest.raises(InvariantViolation, match="the offer tracker counts at most"):
        tier.check_invariants()


@pytest.mark.parametrize("side", ["spec", "impl"])
def test_more_chunks_than_the_tier_holds_are_reported(side: str) -> None:
    tier = built(side, "lru")
    refs(tier)[ALIEN] = 0
    chunk_ids(tier)[ALIEN] = 3
    with pytest.raises(InvariantViolation, match="the tier holds at most num_chunks chunks"):
        tier.check_invariants()


def test_the_implementations_own_counts_and_heap_are_checked() -> None:
    tier = built("impl", "lru")
    tier._num_evictable += 1
    with pytest.raises(InvariantViolation, match="counts of evictable and pending chunks"):
        tier.check_invariants()
    tier = built("impl", "lru")
    tier.policy._evictable.add(KEYS[1])  # pinned
    with pytest.raises(InvariantViolation, match="evictable keys are the ready, unpinned ones"):
        tier.check_invariants()
    tier = built("impl", "lru")
    tier.policy._heap.clear()
    with pytest.raises(InvariantViolation, match="every evictable key has a live heap entry"):
        tier.check_invariants()
