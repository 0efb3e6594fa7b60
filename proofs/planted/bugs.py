"""Planted bugs: which checker catches each deliberately broken variant of impl.

Every variant of `proofs.planted.catalog` faces every checker of `proofs.planted.checkers`
(the CI swarm campaign, state machine, exhaustive search, CrossHair, scenario tests), each
bounded and deterministic.
Each variant runs in its own process (`--worker`), several at a time, so that planting one never
leaks into another. Every variant must be caught by at least two checkers.

    python -m proofs.planted [--variant NAME]... [--jobs N] [--write] [--worker-timeout S]
    python -m proofs.planted --stop-after 1   # the CI gate: the campaign must catch each variant
    python -m proofs.planted --control        # nothing planted: every checker must pass

`--write` regenerates `proofs/planted/planted-bugs.md` (only from a run of every variant).

Exit status: 0 when every variant ran is caught by at least `MIN_CATCHES` checkers (with
`--stop-after K`: by at least min(K, `MIN_CATCHES`)) and no checker failed to run (with
`--control`: when no checker fails at all), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from pagedkv.harness.coverage import CI_HYBRID_STEPS, CI_MANAGER_STEPS, CI_POOL_STEPS, CI_SEED
from pagedkv.spec.attention_truth import ATTENTION_TRUTH
from proofs.planted.catalog import VARIANTS, VARIANTS_BY_NAME, Variant, planted
from proofs.planted.checkers import (
    CHECKER_FUNCTIONS,
    CHECKERS,
    CROSSHAIR_BOUNDS,
    CROSSHAIR_MANAGER_BOUNDS,
    ROOT,
    SCENARIO_MODULES,
    SM_EXAMPLES,
    SM_STEPS,
    CheckerName,
    Verdict,
)

MIN_CATCHES = 2
TABLE_PATH = ROOT / "proofs" / "planted" / "planted-bugs.md"
WORKER_TIMEOUT = 600.0
IN_PROCESS: frozenset[CheckerName] = frozenset({"campaign", "state machine", "exhaustive"})
CONTROL = "control"
"""The pseudo-variant that plants nothing."""

Results = dict[str, list[Verdict]]
"""Variant name -> one verdict per checker, in `CHECKERS` order."""


GATE_ORDER: tuple[CheckerName, ...] = (
    "campaign",
    "state machine",
    "scenario tests",
    "crosshair",
    "exhaustive",
)
"""The quick gate's order (`--stop-after`): cheapest to miss first. A checker that misses runs
to its bound, and the exhaustive search's bound is the longest (390 s of the 530 s
hybrid_hit_cut took with every checker, which only the campaign and the scenario tests catch)."""


def run_variant(variant: Variant | None, stop_after: int | None = None) -> list[Verdict]:
    """Every checker against `variant` (None: nothing planted), planted in this process for the
    checkers that run here; CrossHair and the scenario tests reach it in their own processes.
    With `stop_after`, the checkers run in `GATE_ORDER` and those after the one that makes that
    many catches are skipped (the campaign always runs). Verdicts come in `CHECKERS`' order."""
    verdicts: dict[str, Verdict] = {}
    for checker in CHECKERS if stop_after is None else GATE_ORDER:
        if stop_after is not None and catches(list(verdicts.values())) >= stop_after:
            verdicts[checker] = Verdict(checker, "skipped", f"{stop_after} checkers caught it", 0.0)
            continue
        with planted(variant if checker in IN_PROCESS else None):
            verdicts[checker] = CHECKER_FUNCTIONS[checker](variant)
    return [verdicts[checker] for checker in CHECKERS]


def _worker_command(name: str, stop_after: int | None = None) -> list[str]:
    stop = [] if stop_after is None else ["--stop-after", str(stop_after)]
    return [sys.executable, "-m", "proofs.planted.bugs", "--worker", name, *stop]


def run_in_worker(
    name: str, timeout: float = WORKER_TIMEOUT, stop_after: int | None = None
) -> list[Verdict]:
    """Run one variant (or the control) in a fresh process; a crash is an error verdict."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            _worker_command(name, stop_after),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return [Verdict(**verdict) for verdict in json.loads(lines[-1])]
        problem = f"worker exit {done.returncode}: " + " | ".join(
            (done.stdout + done.stderr).strip().splitlines()[-3:]
        )
    except subprocess.TimeoutExpired:
        problem = f"worker killed after {timeout:.0f} s"
    seconds = round(time.monotonic() - start, 1)
    return [Verdict(checker, "error", problem, seconds) for checker in CHECKERS]


def run_all(
    names: Sequence[str],
    jobs: int,
    timeout: float = WORKER_TIMEOUT,
    stop_after: int | None = None,
) -> Results:
    """Each named variant in its own worker process, `jobs` at a time, results in name order;
    a worker still running after `timeout` wall-clock seconds is killed (an error verdict).
    `stop_after`: see `run_variant`."""
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = {
            name: pool.submit(run_in_worker, name, timeout, stop_after)
            for name in _slowest_first(names)
        }
        return {name: futures[name].result() for name in names}


def _slowest_first(names: Sequence[str]) -> list[str]:
    """Variants the exhaustive search misses search the whole scope (about half a minute):
    start those first so the workers finish together. Known from the last written table."""
    slow = set(_recorded_misses("exhaustive"))
    return sorted(names, key=lambda name: name not in slow)


def _recorded_misses(checker: CheckerName) -> list[str]:
    recorded = read_table(TABLE_PATH) if TABLE_PATH.exists() else {}
    column = CHECKERS.index(checker)
    return [name for name, statuses in recorded.items() if statuses[column] == "missed"]


# -- verdicts and the table ------------------------------------------------------------------


def catches(verdicts: Sequence[Verdict]) -> int:
    return sum(verdict.status == "caught" for verdict in verdicts)


def problems(
    results: Results, *, control: bool = False, min_catches: int = MIN_CATCHES
) -> list[str]:
    """Why the run fails: a checker that could not run, a variant caught by fewer than
    `min_catches` checkers (a run stopped after fewer asks only for that many), or (for the
    control) a checker that fails with nothing planted."""
    found = []
    for name, verdicts in results.items():
        for verdict in verdicts:
            if verdict.status == "error":
                found.append(f"{name}: {verdict.checker} could not run: {verdict.evidence}")
            elif control and verdict.status == "caught":
                found.append(f"{name}: {verdict.checker} fails unplanted: {verdict.evidence}")
        if not control and catches(verdicts) < min_catches:
            found.append(
                f"{name}: caught by {catches(verdicts)} checkers, fewer than {min_catches}"
            )
    return found


def render_table(results: Results) -> str:
    """The markdown table: one row per variant, one column per checker."""
    header = ["variant", "the mistake", *CHECKERS, "caught by"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for name, verdicts in results.items():
        variant = VARIANTS_BY_NAME.get(name)
        description = "" if variant is None else variant.description
        if variant is not None and variant.decision:
            description = f"**decision:** {description}"
        cells = [f"`{name}`", description, *(v.status for v in verdicts), str(catches(verdicts))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_evidence(results: Results) -> str:
    """What each checker reported, variant by variant, with its time."""
    lines = []
    for name, verdicts in results.items():
        lines.append(f"- `{name}`")
        lines.extend(
            f"  - {v.checker} ({v.status}, {v.seconds:.1f} s): {v.evidence}" for v in verdicts
        )
    return "\n".join(lines)


def render_document(results: Results, seconds: float, jobs: int) -> str:
    return f"""# Planted bugs: which checker catches each

Generated by `python -m proofs.planted --write` ({seconds:.0f} s with {jobs} workers).
Each variant is a realistic mistake planted into impl (`proofs/planted/catalog.py`); every one
must be caught by at least {MIN_CATCHES} checkers. The gate (`tests/test_planted_bugs.py`) reruns
the CI campaign on every variant (`--stop-after 1`) and requires it to catch each; the full tier
(`tests/test_full_tier.py`) reruns this whole table and requires every catch (a cell may change
with the code: the state machines also draw constants found in the loaded modules, see
`checkers.SM_SETTINGS`).
Bounds (`proofs/planted/checkers.py`): the CI swarm campaign (seed {CI_SEED}, {CI_MANAGER_STEPS:,}
manager, {CI_HYBRID_STEPS:,} hybrid and {CI_POOL_STEPS:,} pool steps, the variant's layer first,
KV cache events on in about a third of its runs);
state machines derandomized, {SM_EXAMPLES} examples of {SM_STEPS} steps per machine, no
shrinking; exhaustive search: the `ci` scope; CrossHair: the contracts and pairs that call the
replaced function, rebound to it, {CROSSHAIR_BOUNDS.per_condition_timeout:.0f} s each, then the
contracts on `allocate_slots` with the variant planted,
{CROSSHAIR_MANAGER_BOUNDS.per_condition_timeout:.0f} s each; scenario tests:
{", ".join(f"`{m}`" for m in SCENARIO_MODULES)} with the `ci` profile.

The **decision** variants are a class of their own: a mistake in which block serves which tokens,
planted in the spec and the implementation alike, so that the two still agree and no
comparison can see it. Only what attention reads can: the campaign must catch each by the
spec's attention-truth invariant ("{ATTENTION_TRUTH}").

{render_table(results)}

## What caught each

{render_evidence(results)}
"""


def read_table(path: Path) -> dict[str, tuple[str, ...]]:
    """Variant name -> checker statuses, from a table `render_document` wrote."""
    rows: dict[str, tuple[str, ...]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = tuple(cells[2 : 2 + len(CHECKERS)])
    return rows


# -- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proofs.planted", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS_BY_NAME))
    parser.add_argument("--control", action="store_true", help="plant nothing")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--write", action="store_true", help=f"write {TABLE_PATH.name}")
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=WORKER_TIMEOUT,
        help="wall-clock seconds a variant's worker may take (a loaded machine needs more; "
        "the checkers' own bounds do not change)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="the quick gate: stop a variant's checkers once N caught it (the rest skipped; "
        "the campaign always runs)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        variant = None if args.worker == CONTROL else VARIANTS_BY_NAME[args.worker]
        verdicts = run_variant(variant, args.stop_after)
        print(json.dumps([asdict(verdict) for verdict in verdicts]))
        return 0
    if args.write and (args.variant or args.control or args.stop_after is not None):
        parser.error("--write needs a run of every variant by every checker")
    names = [CONTROL] if args.control else args.variant or [v.name for v in VARIANTS]
    start = time.monotonic()
    results = run_all(names, args.jobs, args.worker_timeout, args.stop_after)
    seconds = time.monotonic() - start
    print(render_table(results))
    print()
    print(render_evidence(results))
    wanted = MIN_CATCHES if args.stop_after is None else min(args.stop_after, MIN_CATCHES)
    found = problems(results, control=args.control, min_catches=wanted)
    for problem in found:
        print(f"PROBLEM: {problem}")
    verdict = "FAILED" if found else "ok"
    print(f"planted bugs: {verdict}: {len(names)} variants in {seconds:.0f} s, {args.jobs} workers")
    if args.write and not found:
        TABLE_PATH.write_text(render_document(results, seconds, args.jobs))
        print(f"wrote {TABLE_PATH.relative_to(ROOT)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
