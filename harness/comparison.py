"""Spec and implementation side by side for the swarm engine: what is compared, and when.

`ComparedPair` applies every call to the spec, then to the object under test, and schedules the
comparisons so that a campaign stays fast on pools of a few hundred blocks:

- **every call**: equal results (block ids, hit lists, counts, stats), or the same exception
  class on both sides (for pagedkv's own objects the same message too);
- **every call the driver expects to be refused** (`refused_call`): full snapshots of both sides
  before and after; a call that fails must change neither side (atomic failure);
- **every step**: the digest of what the step could change (`harness/probes.py`): the number of
  free blocks, and each touched request's block ids, cached-block count and number of stored
  hashes (pool layer: each touched block's ref_cnt and hash);
- **every `check_every` steps, after every successful prefix-cache reset and at the end of every
  run** (`full_check`): the whole observable state (`snapshot()`) and both `check_invariants()`.

With `check_every=1` the pair is in *full mode*: every call is also checked for atomic failure
(`harness.lockstep.compare_call`) and every step ends with a full check, exactly the hypothesis
machines' comparison. A run that fails in fast mode is replayed in full mode to find the first
step at which the two sides differ (`harness/shrink.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from pagedkv.harness.lockstep import Divergence, Outcome, compare_call, show
from pagedkv.harness.probes import Probe
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.hashes import BlockHashType

R = TypeVar("R")
S = TypeVar("S")

Label = Callable[[], str]
"""Builds the text of a call (only when it is shown: a divergence, or a logged replay)."""


class ComparedPair(Generic[S]):
    """A spec object and an object under test that have agreed so far (see module docstring).

    Attributes:
        spec: the reference side.
        impl: the side under test.
        check_every: steps between full checks; 1 is full mode.
        log: when not None, every call is appended with the spec's outcome (for traces).
        steps: steps ended so far.
        calls: calls compared so far.
        full_checks: full checks run so far.
    """

    def __init__(
        self,
        spec: S,
        impl: S,
        spec_probe: Probe,
        impl_probe: Probe,
        *,
        check_every: int,
        same_messages: bool,
        beyond_snapshots: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.impl = impl
        self._spec_probe = spec_probe
        self._impl_probe = impl_probe
        self.check_every = check_every
        self.same_messages = same_messages
        self._beyond_snapshots = beyond_snapshots
        self.log: list[str] | None = None
        self.steps = 0
        self.calls = 0
        self.full_checks = 0

    @property
    def full_mode(self) -> bool:
        return self.check_every == 1

    def call(self, label: Label, fn: Callable[[S], R]) -> tuple[R | None, Exception | None]:
        """Apply `fn` to both sides and demand one outcome; the spec's (result, error).

        Raises:
            Divergence: different results, error classes or (same_messages) messages; in full
                mode also a failed call that changed the object under test.
            InvariantViolation: the spec broke an invariant (or, in full mode, a failed call
                changed the spec).
        """
        self.calls += 1
        if self.check_every == 1:
            return self._checked_call(label, fn)
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
        if spec_error is None and impl_error is None:
            if spec_result != impl_result:
                raise Divergence(
                    f"{label()}: spec returned {spec_result!r}, the one under test {impl_result!r}"
                )
        else:
            self._compare_errors(label, spec_error, impl_error)
        if self.log is not None:
            self.log.append(f"{label()} {show(Outcome(spec_result, spec_error))}")
        return spec_result, spec_error

    def refused_call(self, label: Label, fn: Callable[[S], R]) -> tuple[R | None, Exception | None]:
        """`call` for a call expected to fail: both sides must also be left unchanged by it."""
        self.calls += 1
        return self._checked_call(label, fn)

    def end_step(self, touched: Iterable[Any] = ()) -> None:
        """Compare the digests of the touched requests or blocks, and run the scheduled full
        check (see the module docstring)."""
        self.steps += 1
        if self.steps % self.check_every == 0:
            self.full_check("the step")
            return
        spec_probe, impl_probe = self._spec_probe, self._impl_probe
        if spec_probe.num_free() != impl_probe.num_free():
            raise Divergence(
                f"free blocks differ after the step: spec {spec_probe.num_free()}, "
                f"the one under test {impl_probe.num_free()}"
            )
        for key in touched:
            spec_view, impl_view = spec_probe.view(key), impl_probe.view(key)
            if spec_view != impl_view:
                raise Divergence(
                    f"{key!r} differs after the step: spec {spec_view!r}, "
                    f"the one under test {impl_view!r}"
                )

    def full_check(self, after: str) -> None:
        """Equal snapshots and passing invariant checks on both sides."""
        self.full_checks += 1
        spec_state, impl_state = self.spec.snapshot(), self.impl.snapshot()  # type: ignore[attr-defined]
        if spec_state != impl_state:
            raise Divergence(
                f"states differ after {after}:\n" + describe_difference(spec_state, impl_state)
            )
        if self._beyond_snapshots is not None:
            self._beyond_snapshots()
        self.spec.check_invariants()  # type: ignore[attr-defined]
        self.impl.check_invariants()  # type: ignore[attr-defined]

    def _checked_call(
        self, label: Label, fn: Callable[[S], R]
    ) -> tuple[R | None, Exception | None]:
        name = label()
        spec, impl = self.spec, self.impl
        log = self.log

        def record(spec_outcome: Outcome[R], _: Outcome[R]) -> None:
            if log is not None:
                log.append(f"{name} {show(spec_outcome)}")

        outcome = compare_call(
            name,
            spec,
            impl,
            lambda side, _: fn(side),
            spec.snapshot(),  # type: ignore[attr-defined]
            impl.snapshot(),  # type: ignore[attr-defined]
            record,
            same_messages=self.same_messages,
        )
        return outcome.result, outcome.error

    def _compare_errors(
        self, label: Label, spec_error: Exception | None, impl_error: Exception | None
    ) -> None:
        if type(spec_error) is not type(impl_error):
            raise Divergence(
                f"{label()}: spec {show(Outcome(error=spec_error))}, "
                f"but the one under test {show(Outcome(error=impl_error))}"
            )
        if self.same_messages and str(spec_error) != str(impl_error):
            raise Divergence(
                f"{label()}: both raised {type(spec_error).__name__}, but the spec says "
                f"{str(spec_error)!r} and the one under test {str(impl_error)!r}"
            )


MAX_SHOWN = 6
"""Differing positions or keys shown per field of a snapshot."""


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
