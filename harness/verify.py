"""Check an implementation against pagedkv's executable spec, step by step, and report.

Runs the differential state machine (spec vs the implementation under test) for a budget of
steps or seconds. Exit status: 0 when no divergence was found, 1 with the shrunk failing sequence
when one was, 2 on bad arguments.

The implementation under test is `--impl module:factory`; `factory(num_gpu_blocks,
enable_caching, semantics)` must return a `pagedkv.harness.protocol.PoolUnderTest` (wrap a
vLLM-shaped pool in `pagedkv.harness.adapters.ObjectPoolAdapter`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError
from pagedkv.harness.adapters import load_factory
from pagedkv.harness.campaign import CampaignResult, ProgressBar, run_campaign
from pagedkv.harness.pool_machine import CampaignStats, make_pool_machine
from pagedkv.semantics import SEMANTICS_BY_NAME, Semantics

DEFAULT_POOL_IMPL = "pagedkv.harness.adapters:pagedkv_pool"
DEFAULT_STEPS = 25_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--impl",
        default=DEFAULT_POOL_IMPL,
        metavar="MODULE:FACTORY",
        help=f"block pool factory to check (default: {DEFAULT_POOL_IMPL})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"stop after this many steps (default: {DEFAULT_STEPS:,})",
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this many seconds (default: none)"
    )
    parser.add_argument(
        "--steps-per-example",
        type=int,
        default=50,
        help="longest operation sequence before a fresh pool (default: 50)",
    )
    parser.add_argument(
        "--semantics",
        choices=sorted(SEMANTICS_BY_NAME),
        default="pagedkv",
        help="pagedkv's deliberate differences, or vLLM 0.8.5 conformance (default: pagedkv)",
    )
    parser.add_argument(
        "--no-misuse",
        action="store_true",
        help="only valid calls (for implementations that leave misuse undefined, like vLLM); "
        "implied by --semantics vllm-0.8.5",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class Campaign:
    """One campaign's parameters, for the report heading."""

    layer: str
    impl: str
    semantics: Semantics
    misuse: bool


def run(args: argparse.Namespace) -> int:
    if args.steps <= 0 or (args.seconds is not None and args.seconds <= 0):
        print("pagedkv verify: --steps and --seconds must be positive", file=sys.stderr)
        return 2
    semantics = SEMANTICS_BY_NAME[args.semantics]
    misuse = not args.no_misuse and semantics == SEMANTICS_BY_NAME["pagedkv"]
    try:
        factory = load_factory(args.impl)
    except (InvalidArgumentError, ImportError) as error:
        print(f"pagedkv verify: cannot load --impl {args.impl}: {error}", file=sys.stderr)
        return 2
    campaign = Campaign("block pool", args.impl, semantics, misuse)
    stats = CampaignStats()
    progress = None if args.quiet else ProgressBar(args.steps)
    stats.on_progress = progress
    machine = make_pool_machine(factory, semantics=semantics, misuse=misuse, stats=stats)
    # Refused prefix-cache resets log a warning each; thousands of them are noise here.
    logging.getLogger("pagedkv").setLevel(logging.ERROR)
    result = run_campaign(
        machine,
        stats,
        max_steps=args.steps,
        max_seconds=args.seconds,
        steps_per_example=args.steps_per_example,
    )
    if progress is not None:
        progress.close(stats)
    print(format_report(campaign, result))
    return 0 if result.ok else 1


def format_report(campaign: Campaign, result: CampaignResult) -> str:
    stats = result.stats
    lines = [
        f"pagedkv verify — {campaign.layer}: spec vs {campaign.impl}",
        f"  semantics              {campaign.semantics.name}"
        f"{'' if campaign.misuse else ' (valid calls only)'}",
        f"  steps                  {stats.steps:,} in {stats.examples:,} runs",
        f"  operations checked     {stats.operations:,} "
        f"({stats.matched_errors:,} raised the same error in both and changed nothing)",
        f"  steps per second       {result.steps_per_second:,.0f}",
        f"  distinct states seen   {len(stats.state_keys):,}",
        f"  invariant checks run   {stats.invariant_checks:,}",
        f"  time                   {result.seconds:.1f} s",
    ]
    if result.failure is None:
        lines.append("  result                 OK: no divergence")
    else:
        lines += [
            "  result                 DIVERGENCE",
            "",
            "Shrunk failing sequence:",
            result.failure,
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv verify", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
