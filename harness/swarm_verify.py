"""`pagedkv verify` with the swarm engine (the default): campaigns, the report, exit status.

One campaign per layer: the block pool, then the request-level manager (full attention and
sliding window drawn run by run). Each report gives the campaign seed, steps and runs, calls
compared, full checks, throughput in steps per CPU second, distinct states, the coverage table
with each target met or not, the configurations drawn, and every kind of refusal seen. On a
divergence it prints the failing run's seed and configuration and the shrunk sequence of
operations with every call and outcome.

Exit status: 0 no divergence and every coverage target met; 1 a divergence; 3 no divergence
but a coverage target unmet (the campaign did not reach what it promises to exercise). A factory
that raises is a `SetupError` for `verify` to report, never a divergence.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.adapters import load_factory, pagedkv_manager, pagedkv_pool
from pagedkv.harness.campaign import ProgressBar
from pagedkv.harness.coverage import (
    MANAGER_TARGETS,
    MIN_STEPS_FOR_TARGETS,
    POOL_TARGETS,
    Coverage,
    Target,
    TargetResult,
    evaluate,
    render_histogram,
    render_refusals,
    render_targets,
    unmet,
)
from pagedkv.harness.setup_check import (
    Guarded,
    SetupError,
    check_manager_factory,
    check_pool_factory,
)
from pagedkv.harness.shrink import Shrunk, shrink
from pagedkv.harness.swarm import (
    CampaignRun,
    Layer,
    execute_run,
    manager_layer,
    offers_kv_events,
    pool_layer,
    run_campaign,
)
from pagedkv.vocab.semantics import PAGEDKV, SEMANTICS_BY_NAME, Semantics

DEFAULT_POOL_IMPL = "pagedkv.harness.adapters:pagedkv_pool"
DEFAULT_MANAGER_IMPL = "pagedkv.harness.adapters:pagedkv_manager"
DEFAULT_POOL_STEPS = 200_000
DEFAULT_MANAGER_STEPS = 400_000
EXIT_DIVERGENCE = 1
EXIT_COVERAGE = 3


@dataclass(frozen=True)
class SwarmCampaign:
    """One campaign `verify` runs: a layer, what it checks, its budget and its targets."""

    title: str
    impl: str
    layer: Layer
    semantics: Semantics
    misuse: bool
    steps: int
    targets: tuple[Target, ...]
    replay_flags: str

    @property
    def modes(self) -> frozenset[str]:
        modes = {"misuse"} if self.misuse else set()
        if self.semantics == PAGEDKV:
            modes.add("pagedkv semantics")
        if self.layer.kv_events:
            modes.add("kv events")
        return frozenset(modes)


def plan(args: argparse.Namespace) -> list[SwarmCampaign]:
    """The campaigns the arguments ask for, pool first; each factory tried first.

    Raises:
        SetupError: a factory raised, or built an object that cannot be observed.
    """
    semantics = SEMANTICS_BY_NAME[args.semantics or "pagedkv"]
    misuse = not args.no_misuse and semantics == PAGEDKV
    campaigns = []
    unbounded = args.seconds is not None and args.steps is None
    if args.layer in ("pool", "all"):
        steps = args.steps or (sys.maxsize if unbounded else DEFAULT_POOL_STEPS)
        pool_factory = load_factory(args.impl)
        check_pool_factory(pool_factory, args.impl, semantics)
        layer = pool_layer(
            _guarded(pool_factory, args.impl),
            semantics=semantics,
            misuse=misuse,
            steps_per_run=args.steps_per_run,
            kv_events=offers_kv_events(pool_factory),
        )
        flags = _replay_flags(args, "pool")
        campaigns.append(
            SwarmCampaign(
                "block pool", args.impl, layer, semantics, misuse, steps, POOL_TARGETS, flags
            )
        )
    if args.layer in ("manager", "all"):
        steps = args.steps or (sys.maxsize if unbounded else DEFAULT_MANAGER_STEPS)
        manager_factory = load_factory(args.manager_impl)
        check_manager_factory(manager_factory, args.manager_impl, semantics)
        layer = manager_layer(
            _guarded(manager_factory, args.manager_impl),
            semantics=semantics,
            misuse=misuse,
            attention=args.attention,
            steps_per_run=args.steps_per_run,
            kv_events=offers_kv_events(manager_factory),
        )
        kinds = {"full": ", full attention", "sliding": ", sliding window"}
        title = "KV cache manager" + kinds.get(args.attention, "")
        flags = _replay_flags(args, "manager")
        campaigns.append(
            SwarmCampaign(
                title, args.manager_impl, layer, semantics, misuse, steps, MANAGER_TARGETS, flags
            )
        )
    return campaigns


def _guarded(factory: Any, target: str) -> Any:
    """`factory`, wrapped so that an error it raises mid-campaign is a setup error; pagedkv's
    own factories stay as they are (the drivers recognize them to demand the spec's wording)."""
    return factory if factory in (pagedkv_pool, pagedkv_manager) else Guarded(factory, target)


def _setup_error(failure: BaseException) -> SetupError | None:
    """The setup error behind a failed run: the factory raised (not a divergence)."""
    for error in (failure, failure.__cause__, failure.__context__):
        if isinstance(error, SetupError):
            return error
    return None


def _replay_flags(args: argparse.Namespace, layer: str) -> str:
    """The options that, with --replay-run, rebuild the same run (the seed decides the rest)."""
    flags = [f"--layer {layer}"]
    if layer == "pool" and args.impl != DEFAULT_POOL_IMPL:
        flags.append(f"--impl {args.impl}")
    if layer == "manager" and args.manager_impl != DEFAULT_MANAGER_IMPL:
        flags.append(f"--manager-impl {args.manager_impl}")
    if layer == "manager" and args.attention != "both":
        flags.append(f"--attention {args.attention}")
    if args.semantics not in (None, "pagedkv"):
        flags.append(f"--semantics {args.semantics}")
    if args.no_misuse:
        flags.append("--no-misuse")
    if args.steps_per_run is not None:
        flags.append(f"--steps-per-run {args.steps_per_run}")
    return " ".join(flags)


def run_swarm(args: argparse.Namespace) -> int:
    """`pagedkv verify` with the swarm engine; the exit status."""
    campaigns = plan(args)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    if args.replay_run is not None:
        return replay_one(campaigns[-1] if args.layer != "pool" else campaigns[0], args.replay_run)
    status = 0
    for index, campaign in enumerate(campaigns):
        progress = None if args.quiet else ProgressBar(campaign.steps)
        result = run_campaign(
            campaign.layer,
            seed=seed,
            max_steps=campaign.steps,
            max_seconds=args.seconds,
            check_every=args.check_every,
            progress=None if progress is None else _show(progress),
        )
        if progress is not None:
            progress.show(result.coverage.steps, len(result.coverage.states), final=True)
        shrunk = None
        if result.failure is not None:
            failure = result.failure
            setup_error = _setup_error(failure.error)
            if setup_error is not None:
                raise setup_error
            print("pagedkv verify: shrinking the failing run ...", file=sys.stderr, flush=True)
            shrunk = shrink(campaign.layer, failure.run, failure.ops, failure.error)
        if index:
            print()
        results = evaluate(result.coverage, campaign.targets, campaign.modes)
        print("\n".join(format_report(campaign, result, results, shrunk)), flush=True)
        if result.failure is not None:
            return EXIT_DIVERGENCE
        if unmet(results):
            status = EXIT_COVERAGE
    return status


def _show(progress: ProgressBar) -> Callable[[Coverage], None]:
    def update(coverage: Coverage) -> None:
        progress.show(coverage.steps, len(coverage.states))

    return update


def replay_one(campaign: SwarmCampaign, seed: int) -> int:
    """Run one run by its seed, as its campaign ran it; shrink and print it if it fails (the
    same lines the campaign's report printed)."""
    run = campaign.layer.draw(seed)
    coverage = Coverage()
    ops, error = execute_run(campaign.layer, run, coverage)
    print(f"pagedkv verify — {campaign.title}, run {seed}: spec vs {campaign.impl}")
    print(f"  run                    {run.describe()}")
    print(f"  steps                  {len(ops):,}")
    if error is None:
        print("  result                 OK: no divergence")
        return 0
    shrunk = shrink(campaign.layer, run, ops, error)
    print("  result                 DIVERGENCE")
    print()
    print("\n".join(_render_shrunk(shrunk, campaign, seed)))
    return EXIT_DIVERGENCE


def format_report(
    campaign: SwarmCampaign,
    result: CampaignRun,
    targets: list[TargetResult],
    shrunk: Shrunk | None,
) -> list[str]:
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
        f"  campaign seed          {result.seed} (--seed {result.seed} reproduces it)",
        f"  steps                  {coverage.steps:,} in {coverage.runs:,} runs",
        f"  calls compared         {counts['calls compared']:,} "
        f"({_errors(coverage):,} refused alike by both, changing nothing)",
        f"  full checks            {counts['full checks']:,} "
        "(whole snapshots and both invariant checks)",
        f"  steps per CPU second   {result.steps_per_cpu_second:,.0f} "
        f"({result.cpu_seconds:.1f} s CPU, {result.wall_seconds:.1f} s wall)",
        f"  distinct states        {len(coverage.states):,}",
        f"  coverage digest        {coverage.digest()} (equal for this seed and step count "
        "on any machine, at any load)",
        f"  result                 {verdict}",
    ]
    if result.failure is not None and shrunk is not None:
        lines += ["", *_render_shrunk(shrunk, campaign, result.failure.run.seed)]
        return lines
    lines += ["", *render_targets(targets)]
    lines += ["", "  configurations (share of runs)", *render_histogram(coverage, "    ")]
    operations = ("allocate_slots", "get_computed_blocks", "free", "free_block_hashes")
    for operation in (*operations, "hostile catalog"):
        refusals = render_refusals(coverage, operation, "    ")
        if refusals:
            lines += ["", f"  refusals of {operation}", *refusals]
    return lines


def _errors(coverage: Coverage) -> int:
    return sum(n for name, n in coverage.counts.items() if name.startswith("typed error "))


def _render_shrunk(shrunk: Shrunk, campaign: SwarmCampaign, seed: int) -> list[str]:
    cut = "" if shrunk.complete else " (shrinking stopped at its bound)"
    lines = [
        f"Failing run {seed}: {shrunk.run.describe()}",
        f"Shrunk from {shrunk.original_length} operations to {len(shrunk.ops)} "
        f"in {shrunk.replays} replays{cut}.",
        f"Replay it: pagedkv verify {campaign.replay_flags} --replay-run {seed}",
        "",
        *shrunk.render(),
    ]
    return lines
