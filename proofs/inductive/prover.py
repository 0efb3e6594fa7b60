"""Induction over a transition system written against `algebra.Algebra`, with z3.

A system (`System`) gives its parameters and state as fresh z3 constants, its initial state,
its steps (each a guard and a successor state over symbolic arguments), its invariant as named
conjuncts, and lemmas (hypothesis and conclusion over one step). `prove` discharges:

- `Init => I_j` for every conjunct j (with the parameters' assumptions);
- `I and guard and T => I_j'` for every step and every conjunct j, over symbolic parameters
  (the pool size unbounded), one query each, so that a failure names the step and the conjunct;
- every lemma.

An obligation is proved when z3 finds its negation unsatisfiable. When it cannot, `prove`
looks for a counterexample to induction at the smallest sizes (`System.bounded`: the
quantifiers expanded over a concrete size, which z3 decides), turns z3's model into a concrete
state, and replays the step on it with the plain-Python interpretation (`algebra.CONCRETE`):
the counterexample is reported only if, concretely, the state satisfies the invariant, the
guard holds, and the step's successor breaks the conjunct. So a weakened invariant fails with
a state anyone can check by hand, never with an artefact of the encoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import z3

from proofs.inductive.algebra import CONCRETE, Algebra, Bool
from proofs.inductive.symbolic import Symbolic

TIMEOUT_MS = 120_000
"""A wall-clock safety net on each z3 query; `RLIMIT` bounds them first (the proofs take
milliseconds each)."""

RLIMIT = 10_000_000
"""z3's deterministic resource bound per query (a proof here takes under 1,000,000): an obligation
z3 cannot settle gives up at the same point on any machine, under any load."""

MAX_COUNTEREXAMPLE_SIZE = 6
"""Sizes tried, from the smallest up, when an obligation is not proved."""

P = TypeVar("P")
S = TypeVar("S")

Conjunct = Callable[[Algebra, Any, Any], Bool]
"""(algebra, parameters, state) -> the conjunct."""


@dataclass(frozen=True)
class Step:
    """One single step of a system.

    Attributes:
        name: as reports say it ("pop", "release(b, ahead)").
        arguments: the z3 sorts of its arguments, by name ("b": Int, "k": Key).
        guard: (algebra, parameters, state, arguments) -> when it may run.
        apply: (algebra, parameters, state, arguments) -> the successor state.
    """

    name: str
    arguments: Mapping[str, Any]
    guard: Callable[[Algebra, Any, Any, dict[str, Any]], Bool]
    apply: Callable[[Algebra, Any, Any, dict[str, Any]], Any]


@dataclass(frozen=True)
class Lemma:
    """A fact about one step (or, with no step, about any state): the invariant, the step's
    guard and `hypothesis` imply `conclusion` (both over the algebra, the parameters, the
    state, the successor and the arguments, with `extra` more integer variables)."""

    name: str
    step: str | None
    conclusion: Callable[[Algebra, Any, Any, Any, dict[str, Any]], Bool]
    hypothesis: Callable[[Algebra, Any, Any, Any, dict[str, Any]], Bool] | None = None
    extra: Sequence[str] = ()


class System(Protocol, Generic[P, S]):
    """What `prove` needs of a transition system (`pool_proof.POOL`, `manager_proof.MANAGER`)."""

    name: str
    steps: Sequence[Step]
    lemmas: Sequence[Lemma]
    bounded: bool
    """Whether `finite`, `concretize`, `value` and `describe` support the counterexample search."""

    def params(self, size: int | None) -> P:
        """Fresh parameters: the size symbolic (None) or `size`."""
        ...

    def assumptions(self, m: Algebra, p: P) -> Bool:
        """What every parameter value satisfies (the pool has its null block, ...)."""
        ...

    def state(self, tag: str) -> S:
        """A state of fresh z3 constants."""
        ...

    def init(self, m: Algebra, p: P) -> S: ...

    def finite(self, s: S, args: dict[str, Any], size: int) -> dict[Any, list[Any]]:
        """Per uninterpreted sort, the terms a bounded query quantifies over (those the state
        and the step's arguments can name)."""
        ...

    def concretize(
        self, model: z3.ModelRef, p: P, s: S, finite: dict[Any, list[Any]], size: int
    ) -> tuple[Any, Any]:
        """(parameters, state) of `model`, as plain Python values (`algebra.Table`s)."""
        ...

    def value(self, model: z3.ModelRef, term: Any) -> Any:
        """An argument's plain Python value in `model`."""
        ...

    def describe(self, p: Any, s: Any) -> str:
        """A concrete state, for a counterexample."""
        ...


@dataclass
class Outcome:
    """One obligation's outcome.

    Attributes:
        obligation: what was to be shown ("pop preserves: ref_cnt >= 0").
        status: "proved", "refuted" (a replayed counterexample to induction) or "unknown".
        seconds: solver time.
        counterexample: the replayed counterexample, printed.
    """

    obligation: str
    status: str
    seconds: float
    counterexample: str | None = None


@dataclass
class Report:
    """Every obligation of one system."""

    system: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def proved(self) -> bool:
        return all(outcome.status == "proved" for outcome in self.outcomes)

    @property
    def seconds(self) -> float:
        return sum(outcome.seconds for outcome in self.outcomes)


def _check(formulas: Sequence[Any], rlimit: int) -> tuple[Any, z3.Solver]:
    solver = z3.Solver()
    solver.set("timeout", TIMEOUT_MS)
    solver.set("rlimit", rlimit)
    solver.add(*formulas)
    return solver.check(), solver


def _arguments(step: Step, tag: str) -> dict[str, Any]:
    return {name: z3.Const(f"{name}{tag}", sort) for name, sort in step.arguments.items()}


def prove(
    system: System[Any, Any],
    invariants: Mapping[str, Conjunct],
    *,
    only: Callable[[str], bool] | None = None,
    rlimit: int = RLIMIT,
) -> Report:
    """Every obligation of `system` for the invariant `invariants` (module docstring), or
    those whose text `only` accepts; each query bounded by `rlimit`."""
    report = Report(system.name)
    wanted = only or (lambda obligation: True)
    m = Symbolic()
    p = system.params(None)
    assumed = system.assumptions(m, p)
    s0 = system.init(m, p)
    for name, conjunct in invariants.items():
        if wanted(f"init establishes: {name}"):
            obligation = f"init establishes: {name}"
            formulas = [assumed, z3.Not(conjunct(m, p, s0))]
            report.outcomes.append(_obligation(obligation, formulas, rlimit))
    s = system.state("")
    hypothesis = z3.And(assumed, *(conjunct(m, p, s) for conjunct in invariants.values()))
    for step in system.steps:
        args = _arguments(step, "")
        guard = step.guard(m, p, s, args)
        after = step.apply(m, p, s, args)
        for name, conjunct in invariants.items():
            obligation = f"{step.name} preserves: {name}"
            if not wanted(obligation):
                continue
            formulas = [hypothesis, guard, z3.Not(conjunct(m, p, after))]
            outcome = _obligation(obligation, formulas, rlimit)
            if outcome.status != "proved" and system.bounded:
                outcome = _refute(system, invariants, step, name, outcome, rlimit)
            report.outcomes.append(outcome)
    for lemma in system.lemmas:
        if not wanted(lemma.name):
            continue
        facts = [hypothesis]
        args = {name: z3.Int(name) for name in lemma.extra}
        after = s
        if lemma.step is not None:
            step = next(step for step in system.steps if step.name == lemma.step)
            args.update(_arguments(step, ""))
            after = step.apply(m, p, s, args)
            facts.append(step.guard(m, p, s, args))
        if lemma.hypothesis is not None:
            facts.append(lemma.hypothesis(m, p, s, after, args))
        conclusion = lemma.conclusion(m, p, s, after, args)
        report.outcomes.append(_obligation(lemma.name, [*facts, z3.Not(conclusion)], rlimit))
    return report


def _obligation(name: str, formulas: Sequence[Any], rlimit: int) -> Outcome:
    start = time.process_time()
    result, _ = _check(formulas, rlimit)
    status = "proved" if result == z3.unsat else "unknown"
    return Outcome(name, status, time.process_time() - start)


class Bounded(Symbolic):
    """z3 terms with every quantifier expanded over a concrete size: integers in [-1, size],
    an uninterpreted sort's elements among `finite[sort]` (set once the state is built).
    Quantifier-free, so z3 decides it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.finite: dict[Any, list[Any]] = {}

    def forall(self, lo: Any, hi: Any, holds: Callable[[Any], Bool]) -> Bool:
        if isinstance(lo, int) and isinstance(hi, int):
            return z3.And(*(holds(i) for i in range(lo, hi)), True)
        return z3.And(
            *(z3.Implies(z3.And(lo <= i, i < hi), holds(i)) for i in range(-1, self.size + 1)),
            True,
        )

    def forall_entries(self, array: Any, holds: Callable[[Any, Any], Bool]) -> Bool:
        if array.domain() != z3.IntSort():
            return z3.And(*(holds(k, array[k]) for k in self.finite[array.domain()]), True)
        return z3.And(*(holds(i, array[i]) for i in range(-1, self.size + 1)), True)


def _refute(
    system: System[Any, Any],
    invariants: Mapping[str, Conjunct],
    step: Step,
    broken: str,
    outcome: Outcome,
    rlimit: int,
) -> Outcome:
    """Look for a counterexample to induction at sizes 1.. and replay it concretely."""
    spent = outcome.seconds
    for size in range(1, MAX_COUNTEREXAMPLE_SIZE + 1):
        m = Bounded(size)
        p = system.params(size)
        s = system.state("")
        args = _arguments(step, "")
        m.finite = system.finite(s, args, size)
        after = step.apply(m, p, s, args)
        formulas = [
            system.assumptions(m, p),
            *(conjunct(m, p, s) for conjunct in invariants.values()),
            step.guard(m, p, s, args),
            z3.Not(invariants[broken](m, p, after)),
        ]
        start = time.process_time()
        result, solver = _check(formulas, rlimit)
        spent += time.process_time() - start
        if result != z3.sat:
            continue
        model = solver.model()
        cp, cs = system.concretize(model, p, s, m.finite, size)
        cargs = {name: system.value(model, term) for name, term in args.items()}
        shown = _replay(system, invariants, step, broken, cp, cs, cargs)
        if shown is not None:
            return Outcome(outcome.obligation, "refuted", spent, shown)
    return Outcome(outcome.obligation, "unknown", spent)


def _replay(
    system: System[Any, Any],
    invariants: Mapping[str, Conjunct],
    step: Step,
    broken: str,
    p: Any,
    s: Any,
    args: dict[str, Any],
) -> str | None:
    """The counterexample, printed, if it holds concretely; else None."""
    m = CONCRETE
    if not system.assumptions(m, p) or not all(c(m, p, s) for c in invariants.values()):
        return None
    if not step.guard(m, p, s, args):
        return None
    after = step.apply(m, p, s, args)
    if invariants[broken](m, p, after):
        return None
    call = ", ".join(f"{name}={value!r}" for name, value in args.items())
    return (
        f"counterexample to induction: {step.name} breaks {broken!r}\n"
        f"  a state where the invariant holds:\n{system.describe(p, s)}\n"
        f"  the step: {step.name.split('(')[0]}({call})\n"
        f"  the state after it:\n{system.describe(p, after)}"
    )


def render(report: Report, verbose: bool = False) -> str:
    """The report: one line per obligation not proved (every one with `verbose`), a total."""
    lines = [f"{report.system}:"]
    for outcome in report.outcomes:
        if verbose or outcome.status != "proved":
            lines.append(f"  {outcome.status:<8} {outcome.seconds:6.2f} s  {outcome.obligation}")
            if outcome.counterexample:
                lines.append(_indent(outcome.counterexample, "    "))
    proved = sum(outcome.status == "proved" for outcome in report.outcomes)
    total = len(report.outcomes)
    lines.append(f"  {proved}/{total} obligations proved, {report.seconds:.1f} s of solver time")
    return "\n".join(lines)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())
