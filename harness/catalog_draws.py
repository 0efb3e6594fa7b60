"""The hostile-call catalog of `harness/hostile_calls.py`, drawn by the seeded swarm drivers.

The catalog's entries draw their values through a hypothesis `DataObject`, from
`st.sampled_from(...)` strategies. `SeededData` stands in for that object in a swarm run: it
picks each value with a `random.Random` seeded by the operation's `arg`, so one recorded
operation replays the same call (the run's seed reproduces it, and shrinking keeps it).
`side_name` tells an entry's call which side it is applied to, as the catalog's protocol asks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pagedkv.harness.hostile_calls import HostileCall

T = TypeVar("T")

Entry = Callable[[Any, Any], HostileCall]
"""A catalog entry: (data, scene) -> (the call as shown, the call on one side)."""


class SeededData:
    """What a catalog entry needs of hypothesis's `DataObject`: `draw` from `sampled_from`.

    Raises TypeError for any other strategy (an entry drawing something else must be taught
    here, not silently drawn differently from what hypothesis would draw).
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.drawn: list[tuple[str | None, object]] = []

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        elements = getattr(strategy, "elements", None)
        if not isinstance(elements, tuple | list) or getattr(strategy, "_transformations", None):
            raise TypeError(f"SeededData draws only from st.sampled_from(...), not {strategy!r}")
        value = self._rng.choice(elements)
        self.drawn.append((label, value))
        return value


def draw_entry(
    catalog: Mapping[str, Entry], name: str, scene: object, seed: int
) -> tuple[str, Callable[[Any, str], object]]:
    """Entry `name` of `catalog`, its values drawn from `seed`, for `scene`."""
    return catalog[name](SeededData(seed), scene)


def side_name(obj: object, spec: object) -> str:
    """ "spec" when `obj` is the spec side, else "impl"."""
    return "spec" if obj is spec else "impl"
