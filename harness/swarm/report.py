"""What `pagedkv verify` prints: a campaign's report, a shrunk failing run, a harness error.

A report gives the campaign seed, steps and runs, calls compared, full checks, throughput in
steps per CPU second, distinct states, the coverage table with each target met or not, the
configurations drawn, and every kind of refusal seen; it ends with the command that replays it.
On a divergence it prints the failing run's seed and configuration and the shrunk sequence of
operations with every call and outcome, and the command that replays that run.
"""

from __future__ import annotations

import traceback

from pagedkv.harness.coverage import (
    MIN_STEPS_FOR_TARGETS,
    Coverage,
    TargetResult,
    render_histogram,
    render_known_bugs,
    render_refusals,
    render_targets,
    unmet,
)
from pagedkv.harness.swarm.engine import Campaign, CampaignRun, RunFailure
from pagedkv.harness.swarm.shrink import Shrunk

REFUSING_OPERATIONS = (
    "allocate_slots",
    "get_computed_blocks",
    "free",
    "free_block_hashes",
    "hostile catalog",
)


def format_report(
    campaign: Campaign,
    result: CampaignRun,
    targets: list[TargetResult],
    *,
    parts: str | None = None,
    replay: str | None = None,
) -> list[str]:
    """The campaign's report; without a failure it ends with the command that replays it
    (`replay`, by default the campaign's flags, seed and steps). `parts` says where its runs
    ran, when not in this process alone ("2 worker processes", "shard 1 of 4")."""
    coverage = result.coverage
    counts = coverage.counts
    missing = unmet(targets)
    if result.failure is not None:
        verdict = "DIVERGENCE"
    elif coverage.steps < MIN_STEPS_FOR_TARGETS:
        verdict = f"OK: no divergence (targets need >= {MIN_STEPS_FOR_TARGETS:,} steps)"
    elif missing:
        verdict = f"OK: no divergence, but {len(missing)} coverage targets UNMET"
    else:
        verdict = "OK: no divergence; every coverage target met"
    semantics = campaign.semantics.name + ("" if campaign.misuse else " (valid calls only)")
    lines = [
        f"pagedkv verify — {campaign.title}: spec vs {campaign.impl}",
        f"  semantics              {semantics}",
        *(
            [f"  domain                 {campaign.domain.describe()}"]
            * bool(campaign.domain.describe())
        ),
        f"  campaign seed          {result.seed} (--seed {result.seed} reproduces it)",
        f"  steps                  {coverage.steps:,} in {coverage.runs:,} runs",
        f"  calls compared         {counts['calls compared']:,} "
        f"({_errors(coverage):,} refused alike by both, changing nothing)",
        f"  full checks            {counts['full checks']:,} "
        "(whole snapshots and both invariant checks)",
        f"  steps per CPU second   {result.steps_per_cpu_second:,.0f} "
        f"({result.cpu_seconds:.1f} s CPU, {result.wall_seconds:.1f} s wall)",
        *([f"  runs ran in            {parts}"] if parts else []),
        f"  distinct states        {len(coverage.states):,}",
        f"  coverage digest        {coverage.digest()} (equal for this seed and step count "
        "on any machine, at any load)",
        f"  result                 {verdict}",
    ]
    if result.failure is not None:
        return lines
    lines += ["", *render_targets(targets)]
    lines += ["", "  configurations (share of runs)", *render_histogram(coverage, "    ")]
    known_bugs = render_known_bugs(coverage, "    ")
    if known_bugs:
        lines += [
            "",
            "  known bugs reproduced (states the attention-truth invariant names; "
            "--known-bugs fail replays them as failures)",
            *known_bugs,
        ]
    for operation in REFUSING_OPERATIONS:
        refusals = render_refusals(coverage, operation, "    ")
        if refusals:
            lines += ["", f"  refusals of {operation}", *refusals]
    if replay is None:
        replay = f"pagedkv verify {campaign.flags} --seed {result.seed} --steps {coverage.steps}"
    lines += ["", f"Replay it: {replay}"]
    return lines


def _errors(coverage: Coverage) -> int:
    return sum(n for name, n in coverage.counts.items() if name.startswith("typed error "))


def render_shrunk(shrunk: Shrunk, flags: str, seed: int) -> list[str]:
    """The failing run, shrunk: its configuration, the operations with their calls, the error,
    and the command that replays it."""
    cut = "" if shrunk.complete else " (shrinking stopped at its bound)"
    kind, operation, rule = shrunk.signature
    where = f" in {operation}" if operation else ""
    what = f" ({rule})" if rule else ""
    return [
        f"Failing run {seed}: {shrunk.run.describe()}",
        f"Failure: {kind}{where}{what}",
        f"Shrunk from {shrunk.original_length} operations to {len(shrunk.ops)} "
        f"in {shrunk.replays} replays{cut}; each replay failed the same way.",
        "",
        *shrunk.render(),
        "",
        f"Replay it: pagedkv verify {flags} --replay-run {seed}",
    ]


def render_harness_error(failure: RunFailure, flags: str) -> list[str]:
    """A run in which the harness itself failed: not a divergence and not shrunk, but a bug of
    pagedkv's harness (the client, the sampler or the spec adapters), with its traceback."""
    error = failure.error
    tail = traceback.format_exception(type(error), error, error.__traceback__)
    return [
        f"HARNESS ERROR in run {failure.run.seed} after {len(failure.ops)} operations: "
        f"{type(error).__name__}: {error}",
        "This is a bug of pagedkv's harness, not of the implementation under test; please "
        "report it with this output.",
        f"Last operation: {failure.ops[-1]!r}" if failure.ops else "Before the first operation.",
        "",
        *"".join(tail).rstrip().splitlines(),
        "",
        f"Replay it: pagedkv verify {flags} --replay-run {failure.run.seed}",
    ]
