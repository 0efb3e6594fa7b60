"""KV cache events in a swarm run: when both sides' events are taken, and how a take is compared.

A run with events on (`harness/swarm_runs.py`) builds both sides with `enable_kv_cache_events`.
The events not yet taken are part of every full snapshot (`PoolSnapshot.kv_events`), and both
`check_invariants()` replay them against the index. Before each operation, with chance
`TAKE_EVENTS_CHANCE`, the driver makes a `TakeEvents` operation instead: `take_events()` on both
sides, whose lists must be equal (a divergence otherwise, shrunk and replayed like any other).
Taking them often keeps the queue short, so a full check (which replays it) stays cheap however
long the run.
"""

from __future__ import annotations

import random
from typing import Any, cast

from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.protocol import EmitsKVEvents
from pagedkv.vocab.kv_events import KVCacheEvent

TAKE_EVENTS_CHANCE = 1 / 8
"""The chance, before each operation of a run with events on, that the events are taken first
(a scheduler takes them once a step). Between takes the queue holds about 8 operations' events
on average (the gap is geometric: about 8 ln n operations at most in a run of n)."""

TAKES_STREAM = 0x5BD1E9955BD1E995
"""Mixed into a run's seed for the stream that decides when events are taken. It is not the
stream of operations, so a run with events on makes the operations it would make with events
off, with takes between them."""


class EventTakes:
    """When a run takes events: `due()` before each operation drawn (never with events off)."""

    def __init__(self, run_seed: int, kv_events: bool) -> None:
        self._rng = random.Random(run_seed ^ TAKES_STREAM) if kv_events else None

    def due(self) -> bool:
        return self._rng is not None and self._rng.random() < TAKE_EVENTS_CHANCE


def take_events(pair: ComparedPair[Any], coverage: Coverage) -> None:
    """`take_events()` on both sides, the lists compared; each event the spec's list holds is
    counted by class ("BlockStored events taken", ...)."""
    taken, _ = pair.call(lambda: "take_events()", _take)
    for event in taken or ():
        coverage.counts[f"{type(event).__name__} events taken"] += 1


def _take(side: Any) -> list[KVCacheEvent]:
    return cast(EmitsKVEvents, side).take_events()
