"""Breadth-first search over every reachable state of a finite world, with shortest traces.

A *world* is a spec object and an object under test in lock-step (`ComparedPair`, full mode)
plus whatever the driver keeps (the simulated client's requests). It names its state with a
hashable `key()` and offers a finite list of labelled transitions from it. The search applies
every transition to a copy of every state it reaches, once per distinct key. Transitions check
themselves (results, errors, unchanged state on failure, equal snapshots, invariants) and raise
on the first problem.

Soundness of the merge: two worlds with equal keys are explored once. The key holds the spec's
whole observable state and the driver's state, so the spec's future is the same from both; the
object under test is compared against the spec after every call, so it can differ only in state
its snapshot does not show.
"""

from __future__ import annotations

import copy
import pickle
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

from pagedkv.harness.comparison import ComparedPair

W = TypeVar("W", bound="World")


@dataclass(frozen=True)
class Transition:
    """One labelled step; `run` applies it to a world (a copy of the one that listed it)."""

    label: str
    run: Callable[[World], None]


class World(Protocol):
    """A state of the search: spec and impl in lock-step, plus the driver's state."""

    @property
    def pair(self) -> ComparedPair[Any]: ...

    def key(self) -> Hashable:
        """Equal for two worlds exactly when their futures must be the same (see module doc)."""
        ...

    def transitions(self) -> Sequence[Transition]:
        """Every step the driver may take from this state, each label unique."""
        ...

    def dump(self) -> Frozen:
        """Everything mutable in this world (both sides and the driver's state), frozen."""
        ...

    def load(self: W, frozen: Frozen, state: Any) -> W:
        """A world like this one holding a fresh copy of `frozen`, agreed on `state`."""
        ...


@dataclass(frozen=True)
class _Deepcopied:
    """Parts that pickle could not handle, kept as a deep copy."""

    parts: object


Frozen: TypeAlias = "bytes | _Deepcopied"
"""A copy of a world's mutable parts that stays unchanged while the world goes on."""


def freeze(parts: object) -> Frozen:
    """Pickle `parts` (fast), or deep-copy them if something in them cannot be pickled.

    Objects that refer to each other (a manager and the requests it holds) must be frozen in
    one call so that their copies refer to each other too.
    """
    try:
        return pickle.dumps(parts, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return _Deepcopied(copy.deepcopy(parts))


def thaw(frozen: Frozen) -> Any:
    """A fresh copy of the parts `freeze` kept."""
    if isinstance(frozen, bytes):
        return pickle.loads(frozen)
    return copy.deepcopy(frozen.parts)


@dataclass(frozen=True)
class Failure:
    """The shortest sequence of transitions from the initial state that goes wrong.

    Attributes:
        trace: transition labels, the failing one last.
        calls: for each transition of the trace, the calls it made with their outcomes (from a
            replay of the trace on fresh objects).
        error: what went wrong (exception class and message).
    """

    trace: tuple[str, ...]
    calls: tuple[tuple[str, ...], ...]
    error: str

    def render(self) -> str:
        """The trace as numbered steps, each with its calls, then the error."""
        lines = [f"shortest failing trace ({len(self.trace)} steps):"]
        for number, label in enumerate(self.trace, 1):
            lines.append(f"  {number}. {label}")
            calls = self.calls[number - 1] if number <= len(self.calls) else ()
            lines += [f"       {call}" for call in calls]
        lines.append(f"error: {self.error}")
        return "\n".join(lines)


@dataclass(frozen=True)
class SearchResult:
    """What one search explored, and the failure it found, if any.

    Attributes:
        name: the configuration searched.
        states: distinct states reached (the initial one included).
        transitions: transitions applied (each state's every transition, once).
        depth: the longest shortest path from the initial state to a state reached.
        seconds: wall-clock time of the search.
        complete: every reachable state was explored (False when `max_states` stopped it).
        failure: the shortest failing trace, or None.
    """

    name: str
    states: int
    transitions: int
    depth: int
    seconds: float
    complete: bool
    failure: Failure | None

    @property
    def ok(self) -> bool:
        return self.complete and self.failure is None

    def summary(self) -> str:
        verdict = "ok" if self.ok else ("FAILED" if self.failure else "INCOMPLETE")
        return (
            f"{self.name}: {verdict}: {self.states:,} states, {self.transitions:,} transitions, "
            f"depth {self.depth}, {self.seconds:.1f} s"
        )


def breadth_first(
    name: str,
    make_initial: Callable[[], W],
    *,
    max_states: int = 2_000_000,
    visit: Callable[[W], None] | None = None,
) -> SearchResult:
    """Explore every state reachable from `make_initial()`, breadth first.

    The first failing transition found is on a shortest failing path (breadth-first order), so
    its trace is shortest. `max_states` bounds a search that would run away. `visit`, if given,
    sees each distinct state once, when it is first reached (for coverage checks).
    """
    start = time.perf_counter()
    num_transitions = 0
    depth = 0
    try:
        initial = make_initial()
    except Exception as error:  # the initial states already disagree
        return SearchResult(name, 0, 0, 0, 0.0, True, Failure((), (), _describe(error)))
    root = initial.key()
    if visit is not None:
        visit(initial)
    parents: dict[Hashable, tuple[Hashable, str] | None] = {root: None}
    # Each state waiting to be expanded is kept frozen, with its (immutable) snapshot.
    frontier: deque[tuple[Hashable, Frozen, Any, int]] = deque(
        [(root, initial.dump(), initial.pair.state, 0)]
    )
    while frontier:
        key, frozen, state, level = frontier.popleft()
        depth = max(depth, level)
        work: W | None = initial.load(frozen, state)
        assert work is not None
        for transition in work.transitions():
            if work is None:
                work = initial.load(frozen, state)
            num_transitions += 1
            try:
                transition.run(work)
            except Exception as error:
                trace = (*_path(parents, key), transition.label)
                failure = _replay(make_initial, trace, error)
                seconds = time.perf_counter() - start
                return SearchResult(
                    name, len(parents), num_transitions, depth, seconds, True, failure
                )
            new_key = work.key()
            if new_key == key:
                continue  # nothing observable changed: reuse the copy for the next transition
            if new_key not in parents:
                if len(parents) >= max_states:
                    seconds = time.perf_counter() - start
                    return SearchResult(
                        name, len(parents), num_transitions, depth, seconds, False, None
                    )
                parents[new_key] = (key, transition.label)
                if visit is not None:
                    visit(work)
                frontier.append((new_key, work.dump(), work.pair.state, level + 1))
            work = None
    seconds = time.perf_counter() - start
    return SearchResult(name, len(parents), num_transitions, depth, seconds, True, None)


def _path(parents: dict[Hashable, tuple[Hashable, str] | None], key: Hashable) -> list[str]:
    labels: list[str] = []
    link = parents[key]
    while link is not None:
        key, label = link
        labels.append(label)
        link = parents[key]
    return labels[::-1]


def _replay(make_initial: Callable[[], W], trace: tuple[str, ...], error: Exception) -> Failure:
    """Run the trace again from the start with call logging on, to show every call made."""
    world = make_initial()
    calls: list[tuple[str, ...]] = []
    for label in trace:
        log: list[str] = []
        world.pair.log = log
        by_label = {transition.label: transition for transition in world.transitions()}
        try:
            by_label[label].run(world)
        except Exception as replayed:
            calls.append(tuple(log))
            return Failure(trace, tuple(calls), _describe(replayed))
        calls.append(tuple(log))
    # Not reproduced on fresh objects: report the original error, and say so.
    return Failure(trace, tuple(calls), _describe(error) + " (did not reproduce on replay)")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
