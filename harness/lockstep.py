"""Lock-step machinery shared by the differential state machines.

A `LockstepMachine` (hypothesis drives it) and a `LockstepPair` (the exhaustive search and
other deterministic drivers call it) each hold a spec object and an object under test, both with
`snapshot()` and `check_invariants()`. `both()` applies one call to each and demands the same
outcome: equal results, or the same exception class with neither side changed; with
`same_messages` (pagedkv's own objects) the same message too, so the spec's wording of each
refusal is the one to keep.
After every step the snapshots must be equal and both invariant checks must pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from pagedkv.vocab.errors import InvariantViolation

T = TypeVar("T")

ONE_IN_FIVE = (False, False, False, False, True)  # shrinks towards False


@contextmanager
def quiet_refusal_warnings() -> Iterator[None]:
    """Silence the warnings refused prefix-cache resets log (thousands in a search or campaign)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


class Divergence(AssertionError):
    """The object under test and the spec disagree."""


@dataclass
class CampaignStats:
    """Counters shared by every example of a campaign; `on_progress` is called ~10x a second.

    `outcomes` counts (operation, outcome) pairs: the method name, and "returned", "returned
    None" or the class of the error both sides raised. It shows what a campaign exercised.
    """

    steps: int = 0
    examples: int = 0
    state_keys: set[int] = field(default_factory=set)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    on_progress: Callable[[CampaignStats], None] | None = None
    _last_progress: float = 0.0

    def step(self, state_key: int) -> None:
        self.steps += 1
        self.state_keys.add(state_key)
        if self.on_progress is not None:
            now = time.monotonic()
            if now - self._last_progress >= 0.1:
                self._last_progress = now
                self.on_progress(self)

    def record(self, name: str, outcome: Outcome[Any]) -> None:
        """Count one compared call; `name` is the call as shown, e.g. "touch([1, 2])"."""
        if outcome.error is not None:
            kind = type(outcome.error).__name__
        else:
            kind = "returned None" if outcome.result is None else "returned"
        self.outcomes[name.partition("(")[0], kind] += 1

    def outcomes_by_operation(self) -> dict[str, set[str]]:
        """Operation name -> the outcomes it had ("returned", "returned None", error classes)."""
        seen: dict[str, set[str]] = {}
        for operation, kind in self.outcomes:
            seen.setdefault(operation, set()).add(kind)
        return seen

    @property
    def invariant_checks(self) -> int:
        """Each step runs the spec's and the implementation's check_invariants()."""
        return 2 * self.steps

    @property
    def operations(self) -> int:
        return sum(self.outcomes.values())

    @property
    def matched_errors(self) -> int:
        """Calls that raised the same error class on both sides (and changed neither)."""
        return sum(n for (_, kind), n in self.outcomes.items() if not kind.startswith("returned"))


@dataclass
class Outcome(Generic[T]):
    """What one call did on both sides: a result, or an exception of the same class on both."""

    result: T | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def describe(spec_state: object, impl_state: object, prefix: str = "") -> str:
    """The fields on which two snapshots (dataclasses, maybe nested) differ, spec side first."""
    lines = []
    for item in dataclasses.fields(spec_state):  # type: ignore[arg-type]
        a, b = getattr(spec_state, item.name), getattr(impl_state, item.name)
        if a == b:
            continue
        name = prefix + item.name
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            lines.append(describe(a, b, name + "."))
        else:
            lines.append(f"  {name}: spec {a!r}\n  {' ' * len(name)}  impl {b!r}")
    return "\n".join(lines)


def attempt(call: Callable[[], T]) -> Outcome[T]:
    try:
        return Outcome(result=call())
    except Exception as error:  # compared by class with the other side
        return Outcome(error=error)


def show(outcome: Outcome[Any]) -> str:
    if outcome.error is None:
        return f"returned {outcome.result!r}"
    return f"raised {type(outcome.error).__name__}: {outcome.error}"


def compare_call(
    name: str,
    spec: Any,
    impl: Any,
    call: Callable[[Any, str], T],
    spec_before: object,
    impl_before: object,
    on_outcomes: Callable[[Outcome[T], Outcome[T]], None] | None = None,
    same_messages: bool = False,
) -> Outcome[T]:
    """Apply `call` to `spec`, then to `impl` (both with `snapshot()`), and demand one outcome.

    Equal results, or the same exception class (and, with `same_messages`, the same message)
    with each side's snapshot still equal to its `*_before`. `on_outcomes` sees both outcomes
    before they are compared (to log them).

    Raises:
        Divergence: different error classes or messages, different results, or a failed call
            that changed the object under test.
        InvariantViolation: the spec broke an invariant, or a failed call changed the spec.
    """
    spec_outcome = attempt(lambda: call(spec, "spec"))
    if isinstance(spec_outcome.error, InvariantViolation):
        raise spec_outcome.error  # the spec itself is broken
    impl_outcome = attempt(lambda: call(impl, "impl"))
    if on_outcomes is not None:
        on_outcomes(spec_outcome, impl_outcome)
    if type(spec_outcome.error) is not type(impl_outcome.error):
        raise Divergence(
            f"{name}: spec {show(spec_outcome)}, but the one under test {show(impl_outcome)}"
        )
    if not spec_outcome.ok:
        if same_messages and str(spec_outcome.error) != str(impl_outcome.error):
            raise Divergence(
                f"{name}: both raised {type(spec_outcome.error).__name__}, but the spec says "
                f"{str(spec_outcome.error)!r} and the one under test {str(impl_outcome.error)!r}"
            )
        if spec.snapshot() != spec_before:
            raise InvariantViolation("a failed call changes nothing", f"spec, {name}")
        impl_after = impl.snapshot()
        if impl_after != impl_before:
            raise Divergence(
                f"{name} raised {show(impl_outcome)} but changed the one under test:\n"
                + describe(impl_before, impl_after)
            )
        return spec_outcome
    if spec_outcome.result != impl_outcome.result:
        raise Divergence(
            f"{name}: spec returned {spec_outcome.result!r}, "
            f"the one under test {impl_outcome.result!r}"
        )
    return spec_outcome


class LockstepMachine(RuleBasedStateMachine):
    """Base of the differential machines: `both()`, misuse draws, and the per-step comparison.

    Subclasses set `self.spec` and `self.impl` in their `@initialize` rule and may extend
    `agree_beyond_snapshots()` with comparisons of state the snapshots do not hold.
    """

    misuse: ClassVar[bool] = True
    same_messages: ClassVar[bool] = False  # pagedkv's own objects word refusals as the spec does
    stats: ClassVar[CampaignStats] = CampaignStats()

    def __init__(self) -> None:
        super().__init__()
        self.spec: Any = None
        self.impl: Any = None

    def state_key(self) -> int:
        """What distinguishes this run's configuration in the distinct-state count."""
        return 0

    def both(self, name: str, call: Callable[[Any, str], T]) -> Outcome[T]:
        """Apply `call` to the spec, then to the object under test, and compare what happened."""
        outcome = compare_call(
            name,
            self.spec,
            self.impl,
            call,
            self.spec.snapshot(),
            self.impl.snapshot(),
            same_messages=self.same_messages,
        )
        self.stats.record(name, outcome)
        return outcome

    def outcome_ok(self, name: str, call: Callable[[Any, str], Any]) -> bool:
        return self.both(name, call).ok

    def draw_misuse(self, data: st.DataObject) -> bool:
        """Whether this call should break a precondition: one call in five, if misuse is on."""
        return self.misuse and data.draw(st.sampled_from(ONE_IN_FIVE), label="misuse")

    def agree_beyond_snapshots(self) -> None:
        """Compare state the snapshots do not hold (override)."""

    @invariant()
    def spec_and_impl_agree(self) -> None:
        if self.spec is None or self.impl is None:
            return
        spec_state, impl_state = self.spec.snapshot(), self.impl.snapshot()
        if spec_state != impl_state:
            raise Divergence("states differ after the step:\n" + describe(spec_state, impl_state))
        self.agree_beyond_snapshots()
        self.spec.check_invariants()
        self.impl.check_invariants()
        self.stats.step(hash((self.state_key(), spec_state.key())))


# -- deterministic drivers ---------------------------------------------------------------------

R = TypeVar("R")


class Observable(Protocol):
    """What a pool or manager under test offers for comparison (see `harness/protocol.py`)."""

    def snapshot(self) -> Any: ...

    def check_invariants(self) -> None: ...


S = TypeVar("S", bound=Observable)

SideCall = Callable[[S, str], R]
"""A call applied to one side; the second argument is "spec" or "impl"."""


class LockstepPair(Generic[S]):
    """A spec object and an object under test that have agreed on every call so far.

    Attributes:
        spec: the reference side.
        impl: the side under test.
        state: the spec's snapshot, equal to the impl's, after the last call.
        log: when not None, every call is appended to it with its outcome (for traces).
        same_messages: whether a refusal must also carry the spec's message, word for word.
    """

    def __init__(self, spec: S, impl: S, same_messages: bool = False) -> None:
        self.spec = spec
        self.impl = impl
        self.same_messages = same_messages
        self.log: list[str] | None = None
        self.state: Any = None
        self.settle("initial state")

    @classmethod
    def restored(cls, spec: S, impl: S, state: Any, same_messages: bool = False) -> LockstepPair[S]:
        """A pair rebuilt from copies of two sides that already agreed on `state`."""
        pair = cls.__new__(cls)
        pair.spec, pair.impl, pair.state, pair.log = spec, impl, state, None
        pair.same_messages = same_messages
        return pair

    def both(self, name: str, call: SideCall[S, R]) -> Outcome[R]:
        """Apply `call` to both sides and demand the same outcome.

        Raises:
            Divergence: different error classes, different results, a failed call that changed
                the object under test, or different states after the call.
            InvariantViolation: a failed call changed the spec, or an invariant check failed.
        """
        log = self.log

        def record(spec_outcome: Outcome[R], _: Outcome[R]) -> None:
            if log is not None:
                log.append(f"{name} {show(spec_outcome)}")

        outcome = compare_call(
            name,
            self.spec,
            self.impl,
            call,
            self.state,
            self.state,
            record,
            same_messages=self.same_messages,
        )
        if outcome.ok:
            self.settle(name)
        return outcome

    def settle(self, after: str) -> None:
        """Demand equal snapshots and passing invariant checks on both sides; record the state."""
        spec_state, impl_state = self.spec.snapshot(), self.impl.snapshot()
        if spec_state != impl_state:
            raise Divergence(f"states differ after {after}:\n" + describe(spec_state, impl_state))
        self.spec.check_invariants()
        self.impl.check_invariants()
        self.state = spec_state
