"""The five checkers a planted bug must face, each bounded and deterministic.

- campaign: the CI swarm campaign (`pagedkv.harness.swarm`: `CI_SEED`; `CI_MANAGER_STEPS`
  manager steps, `CI_HYBRID_STEPS` hybrid steps and `CI_POOL_STEPS` pool steps, the variant's
  own layer first), stopping at the first divergence.
- state machine: the differential state machines of `pagedkv.harness` (full-attention manager,
  sliding-window manager, hybrid manager, block pool, in that order; a hybrid variant meets the
  hybrid machine first), derandomized, `SM_EXAMPLES` examples of `SM_STEPS` steps each, no
  shrinking; the first machine that fails catches the bug.
- exhaustive: `proofs.exhaustive`'s `ci` scope, manager configurations first (the hybrid ones
  first for a hybrid variant), then the pool's; the first configuration whose search fails
  catches it.
- crosshair: the contracts and pairs rebound to the variant (`proofs.planted.crosshair_checks`),
  contracts first, then the contracts on `allocate_slots` itself with the variant planted in
  CrossHair's process (`proofs.planted.crosshair_manager`), each in its own `crosshair` process
  bounded by `CROSSHAIR_BOUNDS` (the manager contracts by `CROSSHAIR_MANAGER_BOUNDS`); only a
  counterexample that reproduces concretely counts.
- scenario tests: `SCENARIO_MODULES` under pytest in a subprocess with the variant planted by
  `proofs.planted.plugin` (the `ci` hypothesis profile); a failing test catches it.

The campaign, the state machines and the exhaustive search run in the calling process and expect
the variant to be planted there already (`proofs.planted.catalog.planted`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.comparison import quiet_refusal_warnings
from pagedkv.harness.coverage import CI_HYBRID_STEPS, CI_MANAGER_STEPS, CI_POOL_STEPS, CI_SEED
from pagedkv.harness.machines.manager import make_manager_machine
from pagedkv.harness.machines.pool import make_pool_machine
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign
from pagedkv.harness.swarm.engine import Layer
from proofs.crosshair.contracts import Contract
from proofs.crosshair.manager_contracts import CONTRACTS as MANAGER_CONTRACTS
from proofs.crosshair.runner import Bounds, Check, run_check
from proofs.exhaustive.explore import MANAGER_SCOPES, POOL_SCOPES, explore_manager, explore_pool
from proofs.exhaustive.search import SearchResult
from proofs.planted.catalog import PLANT_ENV, Variant, planted
from proofs.planted.crosshair_checks import CHECKS_BY_VARIANT

ROOT = Path(__file__).resolve().parents[2]

CheckerName = Literal["campaign", "state machine", "exhaustive", "crosshair", "scenario tests"]
CHECKERS: tuple[CheckerName, ...] = (
    "campaign",
    "state machine",
    "exhaustive",
    "crosshair",
    "scenario tests",
)

Status = Literal["caught", "missed", "error", "skipped"]


@dataclass(frozen=True)
class Verdict:
    """What one checker did with one variant.

    Attributes:
        checker: which checker.
        status: caught (it failed, as it must), missed (it passed), error (it could not run:
            a verdict nobody may count), skipped (not run: enough checkers had caught it).
        evidence: what caught it (the machine, configuration or test and the first line of the
            error), or why it is an error.
        seconds: wall-clock time spent.
    """

    checker: CheckerName
    status: Status
    evidence: str
    seconds: float


EVIDENCE_LENGTH = 200

_DIFFERING_FIELD = re.compile(r"^\s+(?P<field>[\w.]+): spec ", re.MULTILINE)


def summarize(text: str) -> str:
    """The first line of a failure, plus the names of the snapshot fields that differ (a
    divergence lists each as `  field: spec ...`), cut to `EVIDENCE_LENGTH` characters."""
    lines = text.strip().splitlines()
    summary = lines[0] if lines else ""
    fields = list(dict.fromkeys(match["field"] for match in _DIFFERING_FIELD.finditer(text)))
    if fields:
        summary += " " + ", ".join(fields)
    if len(summary) > EVIDENCE_LENGTH:
        summary = summary[: EVIDENCE_LENGTH - 3] + "..."
    return summary


def _first_line(error: BaseException) -> str:
    return summarize(f"{type(error).__name__}: {error}")


# -- the CI swarm campaign -----------------------------------------------------------------------


def check_campaign(variant: Variant | None) -> Verdict:
    """The CI campaign, the variant's own layer first (`Variant.layer`), then the others:
    caught at the first failing run (KV cache events are on in about a third of its runs, so a
    mistake only in the event stream shows too)."""
    start = time.monotonic()
    layers: dict[str, tuple[Callable[[], Layer], int]] = {
        "manager": (lambda: manager_layer(pagedkv_manager), CI_MANAGER_STEPS),
        "hybrid": (lambda: manager_layer(pagedkv_manager, attention="hybrid"), CI_HYBRID_STEPS),
        "pool": (lambda: pool_layer(pagedkv_pool), CI_POOL_STEPS),
    }
    first = variant.layer if variant is not None else "manager"
    for name in sorted(layers, key=lambda layer: layer != first):
        make_layer, steps = layers[name]
        with quiet_refusal_warnings():
            result = run_campaign(make_layer(), seed=CI_SEED, max_steps=steps)
        failure = result.failure
        if failure is not None:
            evidence = summarize(
                f"{name} run {failure.index} (seed {failure.run.seed}), operation "
                f"{len(failure.ops)}: {type(failure.error).__name__}: {failure.error}"
            )
            return Verdict("campaign", "caught", evidence, _since(start))
    summary = (
        f"{CI_MANAGER_STEPS:,} manager, {CI_HYBRID_STEPS:,} hybrid and {CI_POOL_STEPS:,} pool "
        "steps pass"
    )
    return Verdict("campaign", "missed", summary, _since(start))


# -- state machines ------------------------------------------------------------------------------

SM_EXAMPLES = 400
SM_STEPS = 50

SM_SETTINGS = settings(
    settings.get_profile("default"),  # not whatever profile the environment loaded (CI=true)
    max_examples=SM_EXAMPLES,
    stateful_step_count=SM_STEPS,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.generate,),
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
    print_blob=False,
)
"""Derandomized, no shrinking: a catch is all we need. Derandomized means the same examples for
the same code: hypothesis also draws constants it finds in the loaded local modules, so editing
those modules may change which examples run (and a borderline catch)."""

MACHINES: tuple[tuple[str, Callable[[], type[RuleBasedStateMachine]]], ...] = (
    ("full-attention manager", lambda: make_manager_machine(pagedkv_manager, sliding_window=False)),
    ("sliding-window manager", lambda: make_manager_machine(pagedkv_manager, sliding_window=True)),
    (
        "hybrid manager",
        lambda: make_manager_machine(pagedkv_manager, sliding_window=True, hybrid=True),
    ),
    ("block pool", lambda: make_pool_machine(pagedkv_pool)),
)
"""The machines in the order a variant faces them (a hybrid variant meets the hybrid machine
first, `Variant.layer`)."""


def _first_for(variant: Variant | None) -> str:
    return "hybrid manager" if variant is not None and variant.layer == "hybrid" else ""


def check_state_machines(variant: Variant | None) -> Verdict:
    """Run each machine until one fails (caught) or all pass their bounded run (missed)."""
    start = time.monotonic()
    first = _first_for(variant)
    for name, make_machine in sorted(MACHINES, key=lambda machine: machine[0] != first):
        try:
            with with_reporter(lambda _: None), quiet_refusal_warnings():
                run_state_machine_as_test(make_machine(), settings=SM_SETTINGS)
        except HypothesisException as error:
            return Verdict("state machine", "error", f"{name}: {_first_line(error)}", _since(start))
        except Exception as error:  # a divergence, a broken invariant, or what the impl raised
            return Verdict(
                "state machine", "caught", f"{name}: {_first_line(error)}", _since(start)
            )
    summary = f"{len(MACHINES)} machines x {SM_EXAMPLES} examples x {SM_STEPS} steps pass"
    return Verdict("state machine", "missed", summary, _since(start))


# -- exhaustive search ---------------------------------------------------------------------------

EXHAUSTIVE_MAX_STATES = 50_000
"""Far above the largest `ci` configuration (about 4,000 states): a bug that makes the state
space blow up is reported as an error, not searched for minutes."""


def check_exhaustive(variant: Variant | None) -> Verdict:
    """Search the `ci` scope, managers first; stop at the first failing configuration."""
    start = time.monotonic()
    hybrid_first = variant is not None and variant.layer == "hybrid"
    manager_configs = sorted(
        MANAGER_SCOPES["ci"], key=lambda config: bool(config.more_groups) != hybrid_first
    )
    searches: list[Callable[[], SearchResult]] = [
        *(
            (lambda c=config: explore_manager(pagedkv_manager, c, max_states=EXHAUSTIVE_MAX_STATES))
            for config in manager_configs
        ),
        *(
            (lambda c=config: explore_pool(pagedkv_pool, c, max_states=EXHAUSTIVE_MAX_STATES))
            for config in POOL_SCOPES["ci"]
        ),
    ]
    states = 0
    for search in searches:
        result = search()
        states += result.states
        if result.failure is not None:
            trace = result.failure.trace
            last = f", the last {trace[-1]}" if trace else ""
            evidence = summarize(
                f"{result.name}: {len(trace)}-step trace{last}: {result.failure.error}"
            )
            return Verdict("exhaustive", "caught", evidence, _since(start))
        if not result.complete:
            # Nothing planted, a search that stops short is a broken checker; with a variant it
            # is a bounded search that found no divergence within its bound, as CrossHair's.
            evidence = f"{result.name}: stopped at {EXHAUSTIVE_MAX_STATES:,} states, no failure"
            status: Status = "error" if variant is None else "missed"
            return Verdict("exhaustive", status, evidence, _since(start))
    evidence = f"{len(searches)} configurations, {states:,} states, no failure"
    return Verdict("exhaustive", "missed", evidence, _since(start))


# -- CrossHair -----------------------------------------------------------------------------------

CROSSHAIR_BOUNDS = Bounds(
    per_condition_timeout=10.0, per_path_timeout=2.0, max_iterations=1000, total_timeout=120.0
)
CROSSHAIR_MANAGER_BOUNDS = Bounds(
    per_condition_timeout=8.0, per_path_timeout=2.0, max_iterations=1000, total_timeout=120.0
)
"""The manager contracts with a variant planted: CrossHair refutes `drafts_as_full_blocks` after
about 3.5 CPU seconds of `contract_decode_step`; a variant they cannot see costs each contract
its whole budget."""
CROSSHAIR_SUITE = "proofs.planted.crosshair_checks"
CROSSHAIR_MANAGER_SUITE = "proofs.planted.crosshair_manager"


def check_crosshair(variant: Variant | None) -> Verdict:
    """Run the variant's rebound contracts, then its pairs, then the manager contracts with it
    planted; stop at the first counterexample that reproduces concretely."""
    start = time.monotonic()
    rebound = CHECKS_BY_VARIANT.get(variant.name, ()) if variant is not None else ()
    deadline = time.monotonic() + CROSSHAIR_BOUNDS.total_timeout
    errors: list[str] = []
    ordered = [
        *(Check(CROSSHAIR_SUITE, item) for item in rebound if isinstance(item, Contract)),
        *(Check(CROSSHAIR_SUITE, item) for item in rebound if not isinstance(item, Contract)),
        *(Check(CROSSHAIR_MANAGER_SUITE, contract) for contract in MANAGER_CONTRACTS),
    ]
    for check in ordered:
        if check.suite == CROSSHAIR_MANAGER_SUITE:
            with planted(variant), _environment(PLANT_ENV, variant.name if variant else None):
                outcome = run_check(check, CROSSHAIR_MANAGER_BOUNDS, deadline)
        else:
            outcome = run_check(check, CROSSHAIR_BOUNDS, deadline)
        if outcome.status == "counterexample":
            evidence = summarize(f"{outcome.name}: {outcome.detail}")
            return Verdict("crosshair", "caught", evidence, _since(start))
        if outcome.status == "error":
            errors.append(f"{outcome.name}: {outcome.detail.splitlines()[0]}")
    if errors:
        return Verdict("crosshair", "error", "; ".join(errors), _since(start))
    evidence = f"{len(ordered)} checks, no counterexample within bounds"
    return Verdict("crosshair", "missed", evidence, _since(start))


@contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """`os.environ[name]` set to `value` (None: unset) inside the block."""
    previous = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if previous is not None:
            os.environ[name] = previous


# -- scenario tests ------------------------------------------------------------------------------

SCENARIO_MODULES = (
    "tests/test_block_pool.py",
    "tests/test_manager.py",
    "tests/test_tenant_isolation.py",
    "tests/test_block_hash.py",
    "tests/test_readme.py",
    "tests/test_kv_events.py",
    "tests/test_hybrid_manager.py",
    "tests/test_evict_blocks.py",
    "tests/test_mamba_groups.py",
    "tests/test_mamba_align.py",
    "tests/test_full_sequence_gate.py",
    "tests/test_external_tokens.py",
    "tests/test_deferred_frees.py",
    "tests/test_offload_connector.py",
)
SCENARIO_TIMEOUT = 300.0

_FAILED = re.compile(r"^FAILED (?P<test>\S+)", re.MULTILINE)


def check_scenarios(variant: Variant | None) -> Verdict:
    """Run the scenario modules with the variant planted; a failing test catches it."""
    start = time.monotonic()
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
    env.pop(PLANT_ENV, None)
    if variant is not None:
        env[PLANT_ENV] = variant.name
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "proofs.planted.plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--no-header",
        "--tb=no",
        "-rf",
        *SCENARIO_MODULES,
    ]
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCENARIO_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Verdict("scenario tests", "error", "pytest timed out", _since(start))
    failed = [match["test"].removeprefix("tests/") for match in _FAILED.finditer(done.stdout)]
    if done.returncode == 0:
        return Verdict("scenario tests", "missed", "every test passes", _since(start))
    if done.returncode == 1 and failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        evidence = f"{len(failed)} failed: {shown}"
        return Verdict("scenario tests", "caught", evidence, _since(start))
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    evidence = summarize(f"pytest exit {done.returncode}: " + " | ".join(tail))
    return Verdict("scenario tests", "error", evidence, _since(start))


def _since(start: float) -> float:
    return round(time.monotonic() - start, 1)


CHECKER_FUNCTIONS: dict[CheckerName, Callable[[Variant | None], Verdict]] = {
    "campaign": check_campaign,
    "state machine": check_state_machines,
    "exhaustive": check_exhaustive,
    "crosshair": check_crosshair,
    "scenario tests": check_scenarios,
}
