"""The one lock-step comparison: a spec object and an object under test, call by call.

`ComparedPair` applies every call to the spec, then to the object under test, and schedules the
comparisons so that a campaign stays fast on pools of a few hundred blocks:

- **every call**: equal results (block ids, hit lists, counts, stats), or the same exception
  class on both sides (with `same_messages`, pagedkv's own objects, the same message too);
- **every call the client expects to be refused** (`refused_call`): full snapshots of both sides
  before and after; a call that fails must change neither side (atomic failure);
- **every step**: the digest of what the step could change (`harness/probes.py`): the number of
  free blocks, and each touched request's block ids, cached-block count and number of stored
  hashes (pool layer: each touched block's ref_cnt and hash);
- **every `check_every` steps, after every successful prefix-cache reset and at the end of every
  run** (`full_check`): the whole observable state (`snapshot()`) and both `check_invariants()`.

A side changes only inside a call made through the pair, so a snapshot stays the side's state until
the next call: the snapshots a refused call or a full check took are reused by the next one when
no call ran in between (a refused call's "after" is the following full check's state; a step's
full check is the next refused call's "before"). The same states are compared, each read once.

With `check_every=1` the pair is in *full mode*: every call is also checked for atomic failure
and every step ends with a full check. The hypothesis machines and the exhaustive search use full
mode; the swarm uses it in some runs and to shrink.

Every failure is a `Divergence` whose `signature` (kind, operation, rule) says what went wrong,
so a shrinker can demand that a shorter run fail the same way. A spec that breaks its own
invariant raises `InvariantViolation` (a spec bug). Anything else raised while a client drives
the pair is a bug of the harness itself (`harness.swarm.engine.HarnessError`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pagedkv.harness.divergence import Divergence, operation_of
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.hashes import BlockHashType

if TYPE_CHECKING:
    from pagedkv.harness.probes import Probe

R = TypeVar("R")
S = TypeVar("S")

Label = Callable[[], str]
"""Builds the text of a call (only when it is shown: a divergence, or a logged replay)."""


@contextmanager
def quiet_refusal_warnings() -> Iterator[None]:
    """Silence the warnings refused prefix-cache resets log (thousands in a search or campaign)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


@dataclass
class Outcome(Generic[R]):
    """What one call did on both sides: a result, or an exception of the same class on both."""

    result: R | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def show(outcome: Outcome[Any]) -> str:
    if outcome.error is None:
        return f"returned {outcome.result!r}"
    return f"raised {type(outcome.error).__name__}: {outcome.error}"


def _kind(error: Exception | None) -> str:
    return "returned" if error is None else type(error).__name__


class ComparedPair(Generic[S]):
    """A spec object and an object under test that have agreed so far (see module docstring).

    Attributes:
        spec: the reference side.
        impl: the side under test.
        check_every: steps between full checks; 1 is full mode.
        same_messages: a refusal must carry the spec's message, word for word.
        log: when not None, every call is appended with the spec's outcome (for traces).
        outcomes: (operation, "returned" / "returned None" / error class) -> calls (a
            campaign's counter, when given one).
        steps: steps ended so far.
        calls: calls compared so far.
        full_checks: full checks run so far.
        state: the spec's snapshot at the last full check (None before the first).
    """

    def __init__(
        self,
        spec: S,
        impl: S,
        probe: Callable[[Any], Probe],
        *,
        check_every: int,
        same_messages: bool,
        beyond_snapshots: Callable[[], None] | None = None,
        outcomes: Counter[tuple[str, str]] | None = None,
    ) -> None:
        self.spec = spec
        self.impl = impl
        self.probe = probe
        self._spec_probe = probe(spec)
        self._impl_probe = probe(impl)
        self.check_every = check_every
        self.same_messages = same_messages
        self.beyond_snapshots = beyond_snapshots
        self.log: list[str] | None = None
        self.outcomes: Counter[tuple[str, str]] = Counter() if outcomes is None else outcomes
        self.steps = 0
        self.calls = 0
        self.full_checks = 0
        self.state: Any = None
        self._unchanged: tuple[Any, Any] | None = None  # both snapshots, no call run since

    @property
    def full_mode(self) -> bool:
        return self.check_every == 1

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy: the exhaustive search's states) without the probes, which
        read the sides through closures; they are rebuilt over the copies."""
        state = dict(self.__dict__)
        del state["_spec_probe"], state["_impl_probe"]
        state["log"] = None
        state["state"] = None  # the last snapshot: an exhaustive search keeps it apart
        state["_unchanged"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._spec_probe = self.probe(self.spec)
        self._impl_probe = self.probe(self.impl)

    def call(
        self, operation: str, fn: Callable[[S], R], label: Label | None = None
    ) -> tuple[R | None, Exception | None]:
        """Apply `fn` to both sides and demand one outcome; the spec's (result, error).

        `operation` names the call ("allocate_slots"); `label` shows it with its arguments
        (built only when shown: a divergence, or a logged replay).

        Raises:
            Divergence: different results, error classes or (same_messages) messages; in full
                mode also a failed call that changed the object under test.
            InvariantViolation: the spec broke an invariant (or, in full mode, a failed call
                changed the spec).
        """
        if self.check_every == 1:
            return self.refused_call(operation, fn, label)
        self.calls += 1
        self._unchanged = None
        spec_error = impl_error = None
        try:
            spec_result: R | None = fn(self.spec)
        except Exception as error:  # compared with the other side's
            spec_result, spec_error = None, error
            if isinstance(error, InvariantViolation):
                raise
        try:
            impl_result: R | None = fn(self.impl)
        except Exception as error:  # compared with the spec's
            impl_result, impl_error = None, error
        both_returned = spec_error is None and impl_error is None
        if both_returned and self.log is None and spec_result == impl_result:
            # `_compare`'s first case, without building its records
            kind = "returned" if spec_result is not None else "returned None"
            self.outcomes[operation, kind] += 1
            return spec_result, None
        self._compare(
            operation, label, Outcome(spec_result, spec_error), Outcome(impl_result, impl_error)
        )
        return spec_result, spec_error

    def refused_call(
        self, operation: str, fn: Callable[[S], R], label: Label | None = None
    ) -> tuple[R | None, Exception | None]:
        """`call`, and a call that fails must leave both sides unchanged (whole snapshots are
        compared before and after it)."""
        self.calls += 1
        if label is None:
            label = lambda: operation  # noqa: E731
        if self._unchanged is None:
            spec_before = self.spec.snapshot()  # type: ignore[attr-defined]
            impl_before = self._observe(self.impl.snapshot, label)  # type: ignore[attr-defined]
        else:
            spec_before, impl_before = self._unchanged
            self._unchanged = None
        try:
            spec_outcome: Outcome[R] = Outcome(result=fn(self.spec))
        except Exception as error:  # compared with the other side's
            if isinstance(error, InvariantViolation):
                raise
            spec_outcome = Outcome(error=error)
        try:
            impl_outcome: Outcome[R] = Outcome(result=fn(self.impl))
        except Exception as error:  # compared with the spec's
            impl_outcome = Outcome(error=error)
        self._compare(operation, label, spec_outcome, impl_outcome)
        if spec_outcome.error is not None:
            if self.spec.snapshot() != spec_before:  # type: ignore[attr-defined]
                raise InvariantViolation("a failed call changes nothing", f"spec, {label()}")
            impl_after = self._observe(self.impl.snapshot, label)  # type: ignore[attr-defined]
            if impl_after != impl_before:
                name = label()
                raise Divergence(
                    f"{name} raised {show(impl_outcome)} but changed the one under test:\n"
                    + describe_difference(impl_before, impl_after),
                    "atomicity",
                    operation,
                    _kind(spec_outcome.error),
                )
            self._unchanged = spec_before, impl_before
        return spec_outcome.result, spec_outcome.error

    def end_step(self, touched: Iterable[Any] = ()) -> None:
        """Compare the digests of the touched requests or blocks, and run the scheduled full
        check (see the module docstring)."""
        self.steps += 1
        if self.steps % self.check_every == 0:
            self.full_check("the step")
            return
        keys = list(touched)
        spec_probe, impl_probe = self._spec_probe, self._impl_probe
        try:
            impl_free = impl_probe.num_free()
            impl_views = [impl_probe.view(key) for key in keys]
        except Exception as error:
            raise _unobservable(error, "the step") from error
        spec_free = spec_probe.num_free()
        if spec_free != impl_free:
            raise Divergence(
                f"free blocks differ after the step: spec {spec_free}, the one under test "
                f"{impl_free}",
                "digest",
                "step",
                "free blocks",
            )
        for key, impl_view in zip(keys, impl_views, strict=True):
            spec_view = spec_probe.view(key)
            if spec_view != impl_view:
                what, fields = spec_probe.subject
                raise Divergence(
                    f"{what} {key!r} differs after the step: spec {fields} = {spec_view!r}, "
                    f"the one under test {impl_view!r}",
                    "digest",
                    "step",
                    "a touched request or block",
                )

    def full_check(self, after: str) -> None:
        """Equal snapshots and passing invariant checks on both sides.

        Raises:
            Divergence: the snapshots differ ("state", named by the first differing field), the
                object under test's own check failed ("invariant"), or observing it raised.
            InvariantViolation: the spec's own check failed.
        """
        self.full_checks += 1
        label = lambda: after  # noqa: E731
        if self._unchanged is None:
            spec_state = self.spec.snapshot()  # type: ignore[attr-defined]
            impl_state = self._observe(self.impl.snapshot, label)  # type: ignore[attr-defined]
        else:
            spec_state, impl_state = self._unchanged
        if spec_state != impl_state:
            fields = differing_fields(spec_state, impl_state)
            raise Divergence(
                f"states differ after {after}:\n" + describe_difference(spec_state, impl_state),
                "state",
                "step",
                fields[0] if fields else "",
            )
        if self.beyond_snapshots is not None:
            self.beyond_snapshots()
        self.spec.check_invariants()  # type: ignore[attr-defined]
        try:
            self.impl.check_invariants()  # type: ignore[attr-defined]
        except InvariantViolation as error:
            raise Divergence(
                f"after {after}, the one under test breaks {error}",
                "invariant",
                "step",
                error.invariant,
            ) from error
        except AssertionError as error:  # a third party's own check (any AssertionError)
            raise Divergence(
                f"after {after}, the one under test fails its own check: {error!r}",
                "invariant",
                "step",
                type(error).__name__,
            ) from error
        except Exception as error:
            raise _unobservable(error, after) from error
        self.state = spec_state
        self._unchanged = spec_state, impl_state

    def _compare(
        self, operation: str, label: Label | None, spec: Outcome[R], impl: Outcome[R]
    ) -> None:
        """Demand one outcome of both sides (the comparison of `call` and `refused_call`)."""
        if self.log is not None:
            self.log.append(f"{label() if label else operation} {show(spec)}")
        if spec.error is None and impl.error is None:
            if spec.result != impl.result:
                raise Divergence(
                    f"{label() if label else operation}: spec returned {spec.result!r}, "
                    f"the one under test {impl.result!r}",
                    "result",
                    operation,
                )
            kind = "returned" if spec.result is not None else "returned None"
        elif type(spec.error) is not type(impl.error):
            raise Divergence(
                f"{label() if label else operation}: spec {show(spec)}, "
                f"but the one under test {show(impl)}",
                "error class",
                operation,
                f"spec {_kind(spec.error)}, impl {_kind(impl.error)}",
            )
        elif self.same_messages and str(spec.error) != str(impl.error):
            raise Divergence(
                f"{label() if label else operation}: both raised {type(spec.error).__name__}, "
                f"but the spec says {str(spec.error)!r} and the one under test "
                f"{str(impl.error)!r}",
                "message",
                operation,
                type(spec.error).__name__,
            )
        else:
            kind = type(spec.error).__name__
        self.outcomes[operation, kind] += 1

    def _observe(self, read: Callable[[], R], label: Label) -> R:
        """`read()` of the object under test; if it raises, a divergence ("observation")."""
        try:
            return read()
        except Exception as error:
            raise _unobservable(error, label()) from error


def _unobservable(error: Exception, after: str) -> Divergence:
    return Divergence(
        f"observing the one under test at {after} raised {type(error).__name__}: {error}",
        "observation",
        operation_of(after),
        type(error).__name__,
    )


MAX_SHOWN = 6
"""Differing positions or keys shown per field of a snapshot."""


def differing_fields(spec_state: object, impl_state: object, prefix: str = "") -> list[str]:
    """The dotted names of the fields two snapshots (dataclasses, maybe nested) differ in."""
    names = []
    for item in dataclasses.fields(spec_state):  # type: ignore[arg-type]
        a, b = getattr(spec_state, item.name), getattr(impl_state, item.name)
        if a == b:
            continue
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            names += differing_fields(a, b, f"{prefix}{item.name}.")
        else:
            names.append(prefix + item.name)
    return names


def describe_difference(spec_state: object, impl_state: object, prefix: str = "") -> str:
    """The fields of two snapshots (dataclasses, maybe nested) that differ, spec side first:
    for sequences of one length and for mappings only the differing positions or keys, and
    block hashes abbreviated, so that a pool of hundreds of blocks reads in a few lines."""
    lines = []
    for item in dataclasses.fields(spec_state):  # type: ignore[arg-type]
        a, b = getattr(spec_state, item.name), getattr(impl_state, item.name)
        if a == b:
            continue
        name = prefix + item.name
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            lines.append(describe_difference(a, b, name + "."))
        elif isinstance(a, Mapping) and isinstance(b, Mapping):
            keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
            lines += [
                f"  {name}[{_short(k)}]: spec {_short(a.get(k))}, impl {_short(b.get(k))}"
                for k in keys[:MAX_SHOWN]
            ]
            if len(keys) > MAX_SHOWN:
                lines.append(f"  {name}: {len(keys) - MAX_SHOWN} more keys differ")
        elif isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) > MAX_SHOWN:
            positions = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            lines += [
                f"  {name}[{i}]: spec {_short(a[i])}, impl {_short(b[i])}"
                for i in positions[:MAX_SHOWN]
            ]
            if len(positions) > MAX_SHOWN:
                lines.append(f"  {name}: {len(positions) - MAX_SHOWN} more positions differ")
        else:
            lines.append(f"  {name}: spec {_short(a)}\n  {' ' * len(name)}  impl {_short(b)}")
    return "\n".join(lines)


def _short(value: object) -> str:
    """A value's repr with every block hash abbreviated to its tokens, keys and 8 hex digits."""
    if isinstance(value, BlockHashType):
        keys = f", {value.extra_keys}" if value.extra_keys else ""
        return f"<{value.hash_value & 0xFFFFFFFF:08x} {value.token_ids}{keys}>"
    if isinstance(value, tuple):
        inner = ", ".join(_short(item) for item in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)
