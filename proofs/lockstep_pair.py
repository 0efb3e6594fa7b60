"""One spec object and one object under test, driven call by call in lock-step.

The comparison is the differential harness's (`pagedkv.harness.lockstep`), made deterministic:
each call is applied to the spec, then to the object under test; both must return equal results,
or raise the same exception class and leave both sides exactly as they were. After every
successful call the two snapshots must be equal and both `check_invariants()` must pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from pagedkv.harness.lockstep import Divergence, Outcome, compare_call, describe, show

R = TypeVar("R")


class Observable(Protocol):
    """What a pool or manager under test offers for comparison (see `harness/protocol.py`)."""

    def snapshot(self) -> Any: ...

    def check_invariants(self) -> None: ...


T = TypeVar("T", bound=Observable)

SideCall = Callable[[T, str], R]
"""A call applied to one side; the second argument is "spec" or "impl"."""


class LockstepPair(Generic[T]):
    """A spec object and an object under test that have agreed on every call so far.

    Attributes:
        spec: the reference side.
        impl: the side under test.
        state: the spec's snapshot, equal to the impl's, after the last call.
        log: when not None, every call is appended to it with its outcome (for traces).
        same_messages: whether a refusal must also carry the spec's message, word for word.
    """

    def __init__(self, spec: T, impl: T, same_messages: bool = False) -> None:
        self.spec = spec
        self.impl = impl
        self.same_messages = same_messages
        self.log: list[str] | None = None
        self.state: Any = None
        self.settle("initial state")

    @classmethod
    def restored(cls, spec: T, impl: T, state: Any, same_messages: bool = False) -> LockstepPair[T]:
        """A pair rebuilt from copies of two sides that already agreed on `state`."""
        pair = cls.__new__(cls)
        pair.spec, pair.impl, pair.state, pair.log = spec, impl, state, None
        pair.same_messages = same_messages
        return pair

    def both(self, name: str, call: SideCall[T, R]) -> Outcome[R]:
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
