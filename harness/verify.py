"""Check an implementation against pagedkv's executable spec, step by step, and report.

Runs differential campaigns (spec vs the implementation under test) for a budget of steps or
seconds: by default the swarm engine (`pagedkv.harness.swarm_verify`: seeded runs drawn from the
whole configuration space, a coverage table with targets), or with `--engine hypothesis` the
hypothesis state machines. Exit status: 0 when no divergence was found (and, for the swarm,
every coverage target was met), 1 with the shrunk failing sequence when one was, 2 on bad
arguments, 3 when a swarm campaign found no divergence but missed a coverage target.

Two layers: the block pool (`--impl module:factory`; `factory(num_gpu_blocks, enable_caching,
semantics)` returns a `pagedkv.harness.protocol.PoolUnderTest`) and the request-level manager,
for full attention and sliding window (`--manager-impl module:factory`; `factory(ManagerConfig)`
returns a `ManagerUnderTest`). Wrap vLLM-shaped objects in `ObjectPoolAdapter` or
`ObjectManagerAdapter` (`pagedkv.harness.adapters`). The default runs every campaign.

`--against vllm==0.8.5` (or `vllm==latest`) checks a vllm release's own pool and manager: its
KV cache modules are fetched from PyPI at run time and run under the semantics they conform to
(`pagedkv.harness.vllm_against`), on the hypothesis state machines, which hold the domain
restrictions (`pagedkv.harness.domain`) such a release needs. A factory that cannot be loaded or
built, or a release that cannot be fetched, is a setup error (exit status 2, with its
traceback), never a divergence.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from pagedkv.harness.adapters import load_factory, pagedkv_manager, pagedkv_pool
from pagedkv.harness.campaign import CampaignResult, ProgressBar, run_campaign
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.lockstep import CampaignStats
from pagedkv.harness.manager_machine import make_manager_machine
from pagedkv.harness.pool_machine import make_pool_machine
from pagedkv.harness.setup_check import (
    Guarded,
    SetupError,
    check_manager_factory,
    check_pool_factory,
)
from pagedkv.harness.vllm_against import Against, prepare
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME, Semantics

DEFAULT_POOL_IMPL = "pagedkv.harness.adapters:pagedkv_pool"
DEFAULT_MANAGER_IMPL = "pagedkv.harness.adapters:pagedkv_manager"
DEFAULT_POOL_STEPS = 25_000
DEFAULT_MANAGER_STEPS = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("swarm", "hypothesis"),
        default="swarm",
        help="the swarm campaign engine, or the hypothesis state machines (default: swarm)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="swarm: the campaign seed (default: random, printed in the report)",
    )
    parser.add_argument(
        "--replay-run",
        type=int,
        default=None,
        metavar="SEED",
        help="swarm: run only the run of this seed (as a report names it) and shrink it",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=None,
        metavar="K",
        help="swarm: compare whole snapshots and run the invariant checks every K steps "
        "(1: every step; default: drawn per run, by pool size)",
    )
    parser.add_argument(
        "--steps-per-run",
        type=int,
        default=None,
        help="swarm: the length of every run (default: drawn, 20-2,000 steps)",
    )
    parser.add_argument(
        "--layer",
        choices=("pool", "manager", "all"),
        default="all",
        help="block pool, request-level manager, or both (default: all)",
    )
    parser.add_argument(
        "--attention",
        choices=("full", "sliding", "both"),
        default="both",
        help="manager layer: full attention, sliding window, or both (default: both)",
    )
    parser.add_argument(
        "--impl",
        default=DEFAULT_POOL_IMPL,
        metavar="MODULE:FACTORY",
        help=f"block pool factory to check (default: {DEFAULT_POOL_IMPL})",
    )
    parser.add_argument(
        "--manager-impl",
        default=DEFAULT_MANAGER_IMPL,
        metavar="MODULE:FACTORY",
        help=f"KV cache manager factory to check (default: {DEFAULT_MANAGER_IMPL})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per campaign (default: swarm 200,000 for the pool and 400,000 for the "
        f"manager; hypothesis {DEFAULT_POOL_STEPS:,} for the pool, "
        f"{DEFAULT_MANAGER_STEPS:,} per attention type for the manager)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop each campaign after this many seconds (default: none; with the swarm and "
        "no --steps, run until then: nightly runs)",
    )
    parser.add_argument(
        "--steps-per-example",
        type=int,
        default=50,
        help="hypothesis: longest operation sequence before a fresh pool or manager (default: 50)",
    )
    parser.add_argument(
        "--semantics",
        choices=sorted(SEMANTICS_BY_NAME),
        default=None,
        help="pagedkv's deliberate differences, or vLLM 0.8.5 conformance (default: pagedkv)",
    )
    parser.add_argument(
        "--against",
        default=None,
        metavar="vllm==VERSION",
        help="check a vllm release's own BlockPool and KVCacheManager, fetched from PyPI "
        "(vllm==0.8.5, or vllm==latest); sets the implementations and the semantics",
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
    """One campaign: what is checked, against which implementation, with which machine."""

    layer: str
    impl: str
    semantics: Semantics
    misuse: bool
    machine: type[RuleBasedStateMachine]
    stats: CampaignStats
    steps: int
    factory: Guarded | None = field(default=None, compare=False)
    domain: Domain = FULL_DOMAIN


def plan_campaigns(args: argparse.Namespace, against: Against | None = None) -> list[Campaign]:
    """The campaigns the arguments ask for, in order (pool first).

    Raises:
        SetupError: a factory raised, or built an object that cannot be observed.
    """
    semantics = SEMANTICS_BY_NAME[args.semantics or "pagedkv"]
    if against is not None:
        semantics = against.adapter.semantics
    misuse = against is None and not args.no_misuse and semantics == SEMANTICS_BY_NAME["pagedkv"]
    domain = FULL_DOMAIN if against is None else against.adapter.domain
    campaigns = []
    if args.layer in ("pool", "all"):
        pool_name = args.impl if against is None else against.name
        pool_factory = against.pool_factory if against else load_factory(args.impl)
        check_pool_factory(pool_factory, pool_name, semantics)
        pool_guard = _guard(pool_factory, pool_name)
        stats = CampaignStats()
        machine = make_pool_machine(
            pool_guard or pool_factory,
            semantics=semantics,
            misuse=misuse,
            stats=stats,
            domain=domain,
        )
        steps = args.steps or DEFAULT_POOL_STEPS
        campaigns.append(
            Campaign(
                "block pool",
                pool_name,
                semantics,
                misuse,
                machine,
                stats,
                steps,
                pool_guard,
                domain,
            )
        )
    if args.layer in ("manager", "all"):
        manager_name = args.manager_impl if against is None else against.name
        manager_factory = against.manager_factory if against else load_factory(args.manager_impl)
        check_manager_factory(manager_factory, manager_name, semantics)
        manager_guard = _guard(manager_factory, manager_name)
        for attention in ("full", "sliding"):
            if args.attention not in (attention, "both"):
                continue
            stats = CampaignStats()
            manager_machine = make_manager_machine(
                manager_guard or manager_factory,
                sliding_window=attention == "sliding",
                semantics=semantics,
                misuse=misuse,
                stats=stats,
                domain=domain,
            )
            kind = "sliding window" if attention == "sliding" else "full attention"
            steps = args.steps or DEFAULT_MANAGER_STEPS
            campaigns.append(
                Campaign(
                    f"KV cache manager, {kind}",
                    manager_name,
                    semantics,
                    misuse,
                    manager_machine,
                    stats,
                    steps,
                    manager_guard,
                    domain,
                )
            )
    return campaigns


def report_setup_error(error: BaseException) -> int:
    """Print a setup error with the traceback of its cause; the exit status for it (2)."""
    cause = error.__cause__
    if cause is not None:
        traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
    print(f"pagedkv verify: setup error (nothing was checked): {error}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if (args.steps is not None and args.steps <= 0) or (
        args.seconds is not None and args.seconds <= 0
    ):
        print("pagedkv verify: --steps and --seconds must be positive", file=sys.stderr)
        return 2
    if args.engine == "swarm" and args.against is None:
        return _run_swarm(args)
    against = None
    if args.against is not None:
        chosen = [f"--{name.replace('_', '-')}" for name in ("impl", "manager_impl", "semantics")]
        chosen = [flag for flag, given in zip(chosen, _explicit(args), strict=True) if given]
        if chosen:
            print(f"pagedkv verify: --against sets {', '.join(chosen)} itself", file=sys.stderr)
            return 2
        try:
            against = prepare(args.against)
        except SetupError as error:
            return report_setup_error(error)
        for note in against.notes:
            print(f"pagedkv verify: {note}", file=sys.stderr)
        for name in against.adapter.loggers:
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        campaigns = plan_campaigns(args, against)
    except (InvalidArgumentError, ImportError) as error:
        print(f"pagedkv verify: cannot load the implementation: {error}", file=sys.stderr)
        return 2
    except SetupError as error:
        return report_setup_error(error)
    # Refused prefix-cache resets log a warning each; thousands of them are noise here.
    logging.getLogger("pagedkv").setLevel(logging.ERROR)
    for index, campaign in enumerate(campaigns):
        progress = None if args.quiet else ProgressBar(campaign.steps)
        campaign.stats.on_progress = progress
        result = run_campaign(
            campaign.machine,
            campaign.stats,
            max_steps=campaign.steps,
            max_seconds=args.seconds,
            steps_per_example=args.steps_per_example,
        )
        if progress is not None:
            progress.close(campaign.stats)
        if campaign.factory is not None and campaign.factory.error is not None:
            return report_setup_error(campaign.factory.error)
        if index:
            print()
        print(format_report(campaign, result), flush=True)
        if not result.ok:
            return 1
    return 0


def _run_swarm(args: argparse.Namespace) -> int:
    from pagedkv.harness.swarm_verify import run_swarm

    if any(value is not None and value <= 0 for value in (args.check_every, args.steps_per_run)):
        print("pagedkv verify: --check-every and --steps-per-run must be positive", file=sys.stderr)
        return 2
    logging.getLogger("pagedkv").setLevel(logging.ERROR)
    try:
        return run_swarm(args)
    except (InvalidArgumentError, ImportError) as error:
        print(f"pagedkv verify: cannot load the implementation: {error}", file=sys.stderr)
        return 2
    except SetupError as error:
        return report_setup_error(error)


def _guard(factory: Any, target: str) -> Guarded | None:
    """A guard that tells set-up errors from divergences; none for pagedkv's own factories,
    which the machines recognize by identity to hold them to the spec's wording."""
    return None if factory in (pagedkv_pool, pagedkv_manager) else Guarded(factory, target)


def _explicit(args: argparse.Namespace) -> tuple[bool, bool, bool]:
    """Whether --impl, --manager-impl and --semantics were given (not left at their defaults)."""
    return (
        args.impl != DEFAULT_POOL_IMPL,
        args.manager_impl != DEFAULT_MANAGER_IMPL,
        args.semantics is not None,
    )


def format_report(campaign: Campaign, result: CampaignResult) -> str:
    stats = result.stats
    lines = [
        f"pagedkv verify — {campaign.layer}: spec vs {campaign.impl}",
        f"  semantics              {campaign.semantics.name}"
        f"{'' if campaign.misuse else ' (valid calls only)'}",
        *(
            [f"  domain                 {campaign.domain.describe()}"]
            * bool(campaign.domain.describe())
        ),
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
