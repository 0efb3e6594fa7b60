"""Run every CrossHair contract and spec/impl diffbehavior pair, bounded; replay counterexamples.

    python -m proofs.crosshair                     # every contract and pair
    python -m proofs.crosshair --only window       # the checks whose name contains it
    python -m proofs.crosshair --suite proofs.crosshair.planted   # the planted bugs

A suite is a module with `CONTRACTS` (`proofs.crosshair.contracts.Contract`) and/or `PAIRS`
(`proofs.crosshair.pairs.Pair`). Each check runs in its own `crosshair` process, several at a
time: `crosshair check --analysis_kind asserts` for a contract (without that flag plain asserts
are silently not checked), `crosshair diffbehavior` for a pair. Bounds: CPU seconds per check
(`--per-condition-timeout`) and per path (`--per-path-timeout`), consecutive uninteresting
iterations (`--max-iterations`), and wall-clock seconds for the whole run (`--total-timeout`).

Before CrossHair runs, every contract's and pair's examples run concretely: each must meet the
preconditions (else a contract could hold vacuously) and pass. Every counterexample CrossHair
reports is then replayed concretely in this process: a contract is called with the reported
arguments, a pair's two functions are called and their results compared. Only a counterexample
that reproduces counts; one that does not (CrossHair has false positives) is listed as discarded.

Exit status:
    0  no counterexample: each check confirmed over all paths, or none found within the bounds
    1  a counterexample that reproduces concretely (also a failing example)
    2  setup error, and no counterexample: a suite that does not import, an example outside the
       preconditions, CrossHair failing or reporting nothing for a contract, a counterexample
       that cannot be evaluated, a check or the whole run past its time limit
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from proofs.crosshair.contracts import Contract
from proofs.crosshair.pairs import Pair

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SUITES = (
    "proofs.crosshair.contracts",
    "proofs.crosshair.manager_contracts",
    "proofs.crosshair.pairs",
)

Status = Literal["confirmed", "bounded", "counterexample", "error"]
STATUS_TEXT: dict[Status, str] = {
    "confirmed": "confirmed over all paths",
    "bounded": "no counterexample within bounds",
    "counterexample": "COUNTEREXAMPLE",
    "error": "SETUP ERROR",
}

PASSES = "passes on replay"

_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<level>error|warning|info): (?P<text>.*)$")


@dataclass(frozen=True)
class Bounds:
    """How long CrossHair may search (CPU seconds, except `total_timeout`)."""

    per_condition_timeout: float = 10.0
    per_path_timeout: float = 2.0
    max_iterations: int = 1000
    total_timeout: float = 300.0

    def crosshair_options(self) -> list[str]:
        return [
            "--per_condition_timeout",
            str(self.per_condition_timeout),
            "--per_path_timeout",
            str(self.per_path_timeout),
            "--max_uninteresting_iterations",
            str(self.max_iterations),
        ]

    @property
    def check_timeout(self) -> float:
        """Wall-clock seconds one crosshair process may take: CPU budget, start-up, slack."""
        return 2 * self.per_condition_timeout + 30


@dataclass(frozen=True)
class Check:
    """One CrossHair run: a contract of a suite, or a pair of a suite."""

    suite: str
    item: Contract | Pair

    @property
    def kind(self) -> Literal["contract", "diffbehavior"]:
        return "contract" if isinstance(self.item, Contract) else "diffbehavior"

    @property
    def name(self) -> str:
        return self.item.name

    def command(self, bounds: Bounds) -> list[str]:
        crosshair = [sys.executable, "-m", "crosshair"]
        if isinstance(self.item, Contract):
            target = f"{self.suite}.{self.item.check.__name__}"
            return [
                *crosshair,
                "check",
                "--analysis_kind",
                "asserts",
                "--report_all",
                *bounds.crosshair_options(),
                target,
            ]
        return [
            *crosshair,
            "diffbehavior",
            "--exception_equivalence",
            "SAME_TYPE",
            *bounds.crosshair_options(),
            f"{self.suite}.{self.item.impl.__name__}",
            f"{self.suite}.{self.item.spec.__name__}",
        ]


@dataclass
class Outcome:
    """What a check found, after replay."""

    kind: str
    name: str
    status: Status
    seconds: float
    detail: str = ""
    discarded: list[str] = field(default_factory=list)  # false counterexamples, not reproduced


# -- replay ------------------------------------------------------------------------------------


class Unreplayable(Exception):
    """CrossHair's counterexample is not a literal the runner can evaluate."""


def _literal_call(text: str) -> tuple[list[Any], dict[str, Any]]:
    """The arguments of a call written as `f(1, [True], x=(0, 2))`, literals only."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call):
            raise Unreplayable(f"not a call: {text!r}")
        args = [ast.literal_eval(arg) for arg in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError) as error:
        raise Unreplayable(f"cannot evaluate {text!r}: {error}") from None
    if len(kwargs) != len(node.keywords):
        raise Unreplayable(f"cannot evaluate {text!r}: ** arguments")
    return args, kwargs


@functools.cache
def precondition_lines(function: Callable[..., Any]) -> frozenset[int]:
    """Source lines of the leading `assert` statements of `function`: its preconditions."""
    lines, first = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef)
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    numbers: set[int] = set()
    for statement in body:
        if not isinstance(statement, ast.Assert):
            break
        end = statement.end_lineno or statement.lineno
        numbers.update(range(statement.lineno + first - 1, end + first))
    return frozenset(numbers)


def replay_contract(contract: Callable[..., None], call: str) -> tuple[bool, str]:
    """Call the contract as CrossHair reported it (`name(args)`): (reproduced, what happened)."""
    args, kwargs = _literal_call(call)
    return call_contract(contract, args, kwargs)


def call_contract(
    contract: Callable[..., None], args: Sequence[object], kwargs: dict[str, Any]
) -> tuple[bool, str]:
    """Call the contract concretely: (a postcondition or the code under test failed, what).

    Not reproduced: the call returns, or a leading assert (a precondition) fails.
    """
    try:
        contract(*args, **kwargs)
    except AssertionError as error:
        frames = traceback.extract_tb(error.__traceback__)
        own = [frame for frame in frames if frame.name == contract.__name__]
        failed_line = own[-1].lineno if own else None
        if failed_line in precondition_lines(contract):
            return False, f"precondition fails on replay (line {failed_line})"
        return True, f"AssertionError: {error}"
    except Exception as error:
        return True, f"{type(error).__name__}: {error}"
    return False, PASSES


def _outcome_of(function: Callable[..., object], kwargs: dict[str, Any]) -> tuple[str, object]:
    try:
        return "returns", function(**kwargs)
    except Exception as error:
        return "raises", type(error).__name__


def replay_pair(pair: Pair, given: str) -> tuple[bool, str]:
    """Call both functions of a pair with a reported input: (they differ, what each did)."""
    _, kwargs = _literal_call(f"f({given})")
    impl = _outcome_of(pair.impl, kwargs)
    spec = _outcome_of(pair.spec, kwargs)
    text = f"({given}): impl {impl[0]} {impl[1]!r}, spec {spec[0]} {spec[1]!r}"
    return impl != spec, text


# -- running one check -------------------------------------------------------------------------


def contract_outcome(check: Check, contract: Contract, output: str, rc: int) -> Outcome:
    outcome = Outcome(check.kind, check.name, "bounded", 0.0)
    reported = False
    for line in output.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        text = match["text"]
        if match["level"] == "info":
            reported = True
            if text.startswith("Confirmed over all paths"):
                outcome.status = "confirmed"
            elif not text.startswith("Not confirmed"):
                return _error(outcome, f"unexpected CrossHair report: {line}")
            continue
        if match["level"] != "error":
            continue
        reported = True
        head, sep, call = text.rpartition(" when calling ")
        if not sep:
            return _error(outcome, f"CrossHair error: {line}")
        try:
            reproduced, what = replay_contract(contract.check, call)
        except Unreplayable as error:
            return _error(outcome, str(error))
        if reproduced:
            outcome.status = "counterexample"
            outcome.detail = f"{call} -> {what} (CrossHair: {head})"
            return outcome
        outcome.discarded.append(f"{call}: CrossHair said {head}; {what}")
    if rc == 2 or not reported:
        return _error(outcome, f"CrossHair exit {rc}, no report:\n{output.strip()}")
    return outcome


def pair_outcome(check: Check, pair: Pair, output: str, rc: int) -> Outcome:
    outcome = Outcome(check.kind, check.name, "bounded", 0.0)
    if rc == 0:
        if "All paths exhausted" in output:
            outcome.status = "confirmed"
        return outcome
    given = re.search(r"^Given: \((?P<args>.*)\),$", output, re.MULTILINE)
    if rc != 1 or given is None:
        return _error(outcome, f"CrossHair exit {rc}:\n{output.strip()}")
    try:
        differ, what = replay_pair(pair, given["args"])
    except Unreplayable as error:
        return _error(outcome, str(error))
    if differ:
        outcome.status = "counterexample"
        outcome.detail = what
    else:
        outcome.discarded.append(f"{what}: the same on replay")
    return outcome


def _error(outcome: Outcome, detail: str) -> Outcome:
    outcome.status = "error"
    outcome.detail = detail
    return outcome


def run_check(check: Check, bounds: Bounds, deadline: float) -> Outcome:
    """Run one check's crosshair process and replay what it reports."""
    start = time.monotonic()
    timeout = min(bounds.check_timeout, deadline - start)
    if timeout <= 0:
        return Outcome(check.kind, check.name, "error", 0.0, "not started: total time exceeded")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    try:
        done = subprocess.run(
            check.command(bounds),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - start
        return Outcome(check.kind, check.name, "error", seconds, f"killed after {timeout:.0f} s")
    output = done.stdout + done.stderr
    if isinstance(check.item, Contract):
        outcome = contract_outcome(check, check.item, output, done.returncode)
    else:
        outcome = pair_outcome(check, check.item, output, done.returncode)
    outcome.seconds = time.monotonic() - start
    return outcome


# -- examples ----------------------------------------------------------------------------------


def run_examples(check: Check) -> Outcome | None:
    """Run the check's concrete examples: None if all meet the preconditions and pass."""
    item = check.item
    for example in item.examples:
        if isinstance(item, Contract):
            failed, what = call_contract(item.check, example, {})
            if failed or what != PASSES:
                status: Status = "counterexample" if failed else "error"
                detail = f"example {example!r}: {what}"
                return Outcome(check.kind, check.name, status, 0.0, detail)
        else:
            params = list(inspect.signature(item.impl).parameters)
            kwargs = dict(zip(params, example, strict=True))
            impl, spec = _outcome_of(item.impl, kwargs), _outcome_of(item.spec, kwargs)
            if impl != spec:
                detail = f"example {example!r}: impl {impl}, spec {spec}"
                return Outcome(check.kind, check.name, "counterexample", 0.0, detail)
            if impl[1] is None:
                detail = f"example {example!r} is outside the pair's domain"
                return Outcome(check.kind, check.name, "error", 0.0, detail)
    return None


# -- the whole run -----------------------------------------------------------------------------


def load_checks(suites: Sequence[str], only: Sequence[str]) -> list[Check]:
    """Every check of the suites (imported here, so a bad suite fails before CrossHair runs)."""
    checks: list[Check] = []
    for suite in suites:
        module = importlib.import_module(suite)
        items: list[Contract | Pair] = [
            *getattr(module, "CONTRACTS", ()),
            *getattr(module, "PAIRS", ()),
        ]
        if not items:
            raise ValueError(f"suite {suite} has no CONTRACTS or PAIRS")
        for item in items:
            _check_exported(module, item)
            checks.append(Check(suite, item))
    return [check for check in checks if not only or any(word in check.name for word in only)]


def _check_exported(module: types.ModuleType, item: Contract | Pair) -> None:
    functions = [item.check] if isinstance(item, Contract) else [item.impl, item.spec]
    for function in functions:
        if getattr(module, function.__name__, None) is not function:
            raise ValueError(f"{module.__name__}.{function.__name__} is not the registered one")


def run(checks: Sequence[Check], bounds: Bounds, jobs: int) -> list[Outcome]:
    """Examples first (all of them, in order), then CrossHair, `jobs` processes at a time."""
    failed = [outcome for check in checks if (outcome := run_examples(check)) is not None]
    if failed:
        return failed
    deadline = time.monotonic() + bounds.total_timeout
    # diffbehavior rarely exhausts its paths, so it takes its whole budget: start those first.
    order = sorted(range(len(checks)), key=lambda i: checks[i].kind != "diffbehavior")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {i: pool.submit(run_check, checks[i], bounds, deadline) for i in order}
        return [futures[i].result() for i in range(len(checks))]


def exit_status(outcomes: Sequence[Outcome]) -> int:
    if any(outcome.status == "counterexample" for outcome in outcomes):
        return 1
    if any(outcome.status == "error" for outcome in outcomes):
        return 2
    return 0


def report(outcomes: Sequence[Outcome], seconds: float) -> str:
    lines = []
    for outcome in outcomes:
        lines.append(
            f"{outcome.kind:12} {outcome.name:42} {STATUS_TEXT[outcome.status]:32} "
            f"{outcome.seconds:5.1f} s"
        )
        if outcome.detail:
            lines.append(textwrap.indent(outcome.detail, "    "))
        lines.extend(f"    discarded false counterexample: {text}" for text in outcome.discarded)
    counts = {status: sum(o.status == status for o in outcomes) for status in STATUS_TEXT}
    discarded = sum(len(o.discarded) for o in outcomes)
    lines.append(
        f"crosshair: {len(outcomes)} checks in {seconds:.1f} s: {counts['confirmed']} confirmed "
        f"over all paths, {counts['bounded']} without counterexample within bounds, "
        f"{counts['counterexample']} counterexamples (replayed), {discarded} false "
        f"counterexamples discarded, {counts['error']} setup errors"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proofs.crosshair",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--suite", action="append", help="module with CONTRACTS/PAIRS")
    parser.add_argument("--only", action="append", default=[], help="check name substring")
    parser.add_argument("--per-condition-timeout", type=float, default=Bounds.per_condition_timeout)
    parser.add_argument("--per-path-timeout", type=float, default=Bounds.per_path_timeout)
    parser.add_argument("--max-iterations", type=int, default=Bounds.max_iterations)
    parser.add_argument("--total-timeout", type=float, default=Bounds.total_timeout)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args(argv)
    bounds = Bounds(
        args.per_condition_timeout, args.per_path_timeout, args.max_iterations, args.total_timeout
    )
    start = time.monotonic()
    try:
        checks = load_checks(args.suite or DEFAULT_SUITES, args.only)
    except Exception as error:
        print(f"crosshair: setup error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    if not checks:
        print(f"crosshair: no check matches {args.only}", file=sys.stderr)
        return 2
    outcomes = run(checks, bounds, max(args.jobs, 1))
    seconds = time.monotonic() - start
    print(report(outcomes, seconds))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "bounds": asdict(bounds),
                    "seconds": round(seconds, 1),
                    "outcomes": [asdict(o) for o in outcomes],
                },
                indent=2,
            )
        )
    return exit_status(outcomes)


if __name__ == "__main__":
    sys.exit(main())
