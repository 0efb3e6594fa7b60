"""KV cache events: a take compares both sides' lists, and a consumer replays what was taken.

A client whose pair was built with events on takes them (`TakeEvents`, an operation of each
layer): `take_events()` on both sides must return equal lists (the events not yet taken are also
part of every full snapshot, and both `check_invariants()` replay them against the index). The
client also keeps a consumer, a router mirroring the cache from the events it was sent: after
each take it holds, per hash value, exactly the keys of the spec's index
(replayed the spec's way, `pagedkv.spec.block_pool.replayed_hash_counts`), since the queue is
empty right after a take.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.protocol import EmitsKVEvents
from pagedkv.spec.block_pool import replayed_hash_counts
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.hashes import CacheKey, key_group, key_hash
from pagedkv.vocab.kv_events import KVCacheEvent


class EventConsumer:
    """A mirror of the index kept from the events taken: (group, hash value) -> keys."""

    def __init__(self) -> None:
        self.hash_counts: dict[tuple[int, int], int] = {}

    def take(self, pair: ComparedPair[Any], coverage: Coverage, index: Iterable[CacheKey]) -> None:
        """`take_events()` on both sides, the lists compared; the batch replayed here, which
        must then count the keys of `index` (the spec's); each event counted by class.

        Raises:
            Divergence: the lists differ, or the replay fails or differs from the index.
        """
        taken, error = pair.call("take_events", _take, lambda: "take_events()")
        if error is not None or taken is None:
            return
        for event in taken:
            coverage.counts[f"{type(event).__name__} events taken"] += 1
        try:
            self.hash_counts = replayed_hash_counts(self.hash_counts, taken)
        except InvariantViolation as failure:
            raise Divergence(
                f"a consumer cannot replay the events taken: {failure}",
                "events",
                "take_events",
                "replay",
            ) from None
        expected: dict[tuple[int, int], int] = {}
        for key in index:
            counted = (key_group(key), key_hash(key).hash_value)
            expected[counted] = expected.get(counted, 0) + 1
        if self.hash_counts != expected:
            raise Divergence(
                f"a consumer replaying the events holds {self.hash_counts}, the index {expected}",
                "events",
                "take_events",
                "replay",
            )


def _take(side: Any) -> list[KVCacheEvent]:
    return cast(EmitsKVEvents, side).take_events()
