"""`pagedkv verify`: check an implementation against pagedkv's executable spec, and report.

One campaign per layer: the block pool (`--impl module:factory`; `factory(num_gpu_blocks,
enable_caching, semantics)` returns a `pagedkv.harness.PoolUnderTest`), then the request-level
manager, full attention and sliding window drawn run by run (`--manager-impl module:factory`;
`factory(ManagerConfig)` returns a `ManagerUnderTest`), then the hybrid layer: configurations
of 2 to `--max-groups` KV cache groups (full attention, sliding windows, chunked local attention)
over one pool, through the same factory and protocol (pagedkv's own manager and vLLM 0.33's; a
third-party factory only with `--max-groups`). Wrap objects in `ObjectPoolAdapter`,
`ObjectManagerAdapter` (a manager shaped like pagedkv's) or `FlatObjectManagerAdapter` (a
one-group manager shaped like vLLM 0.8.5's, whose answers are flat lists). A
campaign is a sequence of seeded swarm runs (`pagedkv.harness.swarm`), each a simulated client
(`pagedkv.harness.client`) driving the spec and the implementation in lock-step.

`--against vllm==0.8.5` (or `vllm==0.32.0`, `vllm==0.33.0`, `vllm==latest`) checks a vllm
release's own pool and manager: its KV cache modules are fetched from PyPI at run time and run
under the semantics they conform to (`pagedkv.harness.vllm`), on the same swarm engine and
coverage table, within the domain (`pagedkv.harness.domain`) the release supports, with valid
calls only (vLLM leaves misuse undefined).

`--jobs N` runs each campaign's runs in N worker processes and `--shard K/N` runs one shard of
them (`pagedkv.harness.swarm.parallel`: the runs are fixed by index before anything runs);
`--json PATH` writes the report as JSON, and `--merge REPORT...` combines the JSON reports of
every shard into the report of the whole campaign: for any N, the same coverage and digest as
the campaign run in one process.

`--replay-trace FILE` re-drives pagedkv's manager (`--trace-side impl`, `spec` or `both`) from
a call trace that the vLLM plugin wrote (`pagedkv.vllm_plugin`: shadow mode dumps one at a
divergence) and reports the first call where pagedkv and vLLM's recorded answers part.

Every report ends with the one command that replays it. Exit status: 0 when no divergence was
found and every coverage target was met; 1 with the shrunk failing run when one was; 2 on bad
arguments or a setup error (a factory that cannot be loaded or built, a release that cannot be
fetched: nothing was checked); 3 when no divergence was found but a coverage target was missed;
4 when the harness itself failed (a bug of pagedkv's harness, never of the implementation).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

from pagedkv.harness.adapters import load_factory, pagedkv_manager, pagedkv_pool
from pagedkv.harness.comparison import quiet_refusal_warnings
from pagedkv.harness.coverage import (
    HYBRID_TARGETS,
    MANAGER_TARGETS,
    POOL_TARGETS,
    Coverage,
    evaluate,
    unmet,
)
from pagedkv.harness.divergence import signature_of
from pagedkv.harness.domain import FULL_DOMAIN, MAX_GROUPS, Domain
from pagedkv.harness.offload_campaign import (
    DEFAULT_OFFLOAD_STEPS,
    format_offload_report,
    run_offload_campaign,
)
from pagedkv.harness.offload_runs import TierUnderTest
from pagedkv.harness.setup_check import (
    Guarded,
    SetupError,
    check_manager_factory,
    check_pool_factory,
)
from pagedkv.harness.swarm.engine import (
    Campaign,
    CampaignRun,
    Layer,
    RunFailure,
    execute_run,
    manager_layer,
    offers_cache_blocks,
    offers_deferred_frees,
    offers_evict_blocks,
    offers_external_tokens,
    offers_full_sequence_gate,
    offers_kv_events,
    offers_mamba_align,
    offers_mamba_groups,
    offers_mixed_block_sizes,
    pool_layer,
    run_campaign,
)
from pagedkv.harness.swarm.parallel import (
    campaign_indices,
    rerun_failure,
    run_indices,
    shard_indices,
)
from pagedkv.harness.swarm.report import (
    format_report,
    render_harness_error,
    render_shrunk,
)
from pagedkv.harness.swarm.runs import run_seed
from pagedkv.harness.swarm.shrink import shrink
from pagedkv.harness.vllm import offload_0_33
from pagedkv.harness.vllm.against import Against, parse_against, prepare
from pagedkv.harness.vllm.wheel import FetchError, source_tree
from pagedkv.offload import OffloadTier
from pagedkv.progress import ProgressBar
from pagedkv.spec.arguments import VLLM_0_8_5_ONLY
from pagedkv.spec.known_bugs import FATAL_ENV
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.offload import OffloadTierConfig
from pagedkv.vocab.semantics import VLLM_0_8_5, VLLM_0_32, VLLM_0_33, Semantics

DEFAULT_POOL_IMPL = "pagedkv.harness.adapters:pagedkv_pool"
DEFAULT_MANAGER_IMPL = "pagedkv.harness.adapters:pagedkv_manager"
DEFAULT_POOL_STEPS = 200_000
DEFAULT_MANAGER_STEPS = 400_000
DEFAULT_HYBRID_STEPS = 150_000
SEMANTICS: dict[str, Semantics] = {
    "pagedkv": PAGEDKV_SEMANTICS,
    "vllm-0.8.5": VLLM_0_8_5,
    "vllm-0.32": VLLM_0_32,
    "vllm-0.33": VLLM_0_33,
}
"""`--semantics` names: pagedkv's (as the spec states it), and the vLLM releases'."""
EXIT_DIVERGENCE = 1
EXIT_SETUP = 2
EXIT_COVERAGE = 3
EXIT_HARNESS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the campaign seed (default: random, printed in the report)",
    )
    parser.add_argument(
        "--replay-run",
        type=int,
        default=None,
        metavar="SEED",
        help="run only the run of this seed (as a report names it) and shrink it if it fails",
    )
    parser.add_argument(
        "--replay-trace",
        default=None,
        metavar="FILE",
        help="re-drive pagedkv from a vLLM plugin trace and compare with vLLM's answers in it",
    )
    parser.add_argument(
        "--trace-side",
        choices=("impl", "spec", "both"),
        default="both",
        help="with --replay-trace: the implementation, the spec, or both (default)",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=None,
        metavar="K",
        help="compare whole snapshots and run the invariant checks every K steps "
        "(1: every step; default: drawn per run, by pool size)",
    )
    parser.add_argument(
        "--steps-per-run",
        type=int,
        default=None,
        help="the length of every run (default: drawn, 20-2,000 steps)",
    )
    parser.add_argument(
        "--layer",
        choices=("pool", "manager", "hybrid", "offload", "all"),
        default="all",
        help="block pool, request-level manager (one KV cache group), hybrid manager (several "
        "groups), the CPU offload tier, or each of them (default: all; the hybrid layer where "
        "--max-groups > 1; the offload tier, pagedkv's own, only with the default --impl and "
        "--manager-impl and no --semantics or --against: name it to check vLLM's)",
    )
    parser.add_argument(
        "--max-groups",
        type=int,
        default=None,
        metavar="N",
        help=f"the hybrid layer's most KV cache groups, 2-{MAX_GROUPS} (1: no hybrid layer; "
        f"default: {MAX_GROUPS} for pagedkv's managers and vLLM releases that have hybrid "
        "managers, 1 for a --manager-impl of your own)",
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
        help=f"steps per campaign (default: {DEFAULT_POOL_STEPS:,} for the pool, "
        f"{DEFAULT_MANAGER_STEPS:,} for the manager, {DEFAULT_HYBRID_STEPS:,} for the hybrid "
        "manager)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop each campaign after this many seconds (with no --steps: run until then)",
    )
    parser.add_argument(
        "--semantics",
        choices=sorted(SEMANTICS),
        default=None,
        help="pagedkv's deliberate differences, or a vLLM release's behaviour (default: pagedkv)",
    )
    parser.add_argument(
        "--against",
        default=None,
        metavar="vllm==VERSION",
        help="check a vllm release's own BlockPool and KVCacheManager, fetched from PyPI "
        "(vllm==0.8.5, vllm==0.32.0, vllm==0.33.0 or vllm==latest); sets the implementations, "
        "the semantics and the domain",
    )
    parser.add_argument(
        "--vllm-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --against vllm==0.32.0 or 0.33.0: an engine setting other than vLLM's "
        "default, e.g. prefix_cache_retention_interval=None for dense retention (repeatable; "
        "the report names every setting in force)",
    )
    parser.add_argument(
        "--no-misuse",
        action="store_true",
        help="only valid calls (for implementations that leave misuse undefined, like vLLM); "
        "implied by --semantics other than pagedkv and by --against",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run each campaign's runs in N worker processes (0: one per core); the report "
        "and its coverage digest are those of the campaign run in one process",
    )
    parser.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="K/N",
        help="run shard K of N of each campaign: its runs of index i with i %% N == K - 1 (for "
        "a CI matrix or a batch system; combine the shards' --json reports with --merge)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the report as JSON to PATH (for --merge, or a record)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="REPORT",
        help="run nothing: combine the --json reports of every shard of a campaign into its "
        "report (the same coverage and digest as the campaign run whole)",
    )
    parser.add_argument(
        "--known-bugs",
        choices=("count", "fail"),
        default="count",
        help="the states a vLLM release's known bugs lead to under its semantics "
        "(pagedkv.spec.known_bugs): counted in the report (default), or failures like any "
        "broken invariant, shrunk to a replay",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _shard(text: str) -> tuple[int, int]:
    """`--shard K/N`: (K, N), 1 <= K <= N."""
    shard, _, num_shards = text.partition("/")
    try:
        k, n = int(shard), int(num_shards)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"need 1 <= K <= N, got {text!r}")
    return k, n


def plan(args: argparse.Namespace, against: Against | None) -> list[Campaign]:
    """The campaigns the arguments ask for, pool first; each factory tried first.

    Raises:
        SetupError: a factory raised, or built an object that cannot be observed.
        InvalidArgumentError, ImportError: a factory cannot be loaded.
    """
    semantics = SEMANTICS[args.semantics or "pagedkv"]
    domain = FULL_DOMAIN
    if against is not None:
        semantics, domain = against.adapter.semantics, against.domain
    misuse = against is None and not args.no_misuse and semantics == PAGEDKV_SEMANTICS
    unbounded = args.seconds is not None and args.steps is None
    campaigns = []
    if args.layer in ("pool", "all"):
        name = args.impl if against is None else against.name
        factory: Any = against.pool_factory if against else load_factory(args.impl, "--impl")
        with _naming(_option(args, "--impl")):
            check_pool_factory(factory, name, semantics)
        layer = pool_layer(
            _guarded(factory, f"{_option(args, '--impl')} {name}"),
            semantics=semantics,
            misuse=misuse,
            steps_per_run=args.steps_per_run,
            kv_events=offers_kv_events(factory),
            domain=domain,
        )
        steps = args.steps or (sys.maxsize if unbounded else DEFAULT_POOL_STEPS)
        flags = _flags(args, "pool")
        campaigns.append(
            Campaign(
                "block pool", name, layer, semantics, misuse, domain, steps, POOL_TARGETS, flags
            )
        )
    name = args.manager_impl if against is None else against.name
    manager_factory: Any = None
    if args.layer in ("manager", "hybrid", "all"):
        manager_factory = (
            against.manager_factory
            if against
            else load_factory(args.manager_impl, "--manager-impl")
        )
        with _naming(_option(args, "--manager-impl")):
            check_manager_factory(manager_factory, name, semantics)
    if args.layer in ("manager", "all"):
        campaigns.append(
            _manager_campaign(args, manager_factory, name, semantics, misuse, domain, unbounded)
        )
    domain = dataclasses.replace(domain, max_groups=_max_groups(args, domain, semantics))
    if args.layer == "hybrid" or (args.layer == "all" and domain.max_groups > 1):
        if domain.max_groups < 2:
            raise InvalidArgumentError(
                f"--layer hybrid needs --max-groups 2-{MAX_GROUPS} (the manager checked, "
                f"{name}, is not known to serve several KV cache groups)"
            )
        args = argparse.Namespace(**{**vars(args), "attention": "hybrid"})
        campaigns.append(
            _manager_campaign(args, manager_factory, name, semantics, misuse, domain, unbounded)
        )
    return campaigns


def _manager_campaign(
    args: argparse.Namespace,
    factory: Any,
    name: str,
    semantics: Semantics,
    misuse: bool,
    domain: Domain,
    unbounded: bool,
) -> Campaign:
    """The manager layer's campaign (`args.attention`: "hybrid" for the hybrid layer)."""
    hybrid = args.attention == "hybrid"
    layer = manager_layer(
        _guarded(factory, f"{_option(args, '--manager-impl')} {name}"),
        semantics=semantics,
        misuse=misuse,
        attention=args.attention,
        steps_per_run=args.steps_per_run,
        kv_events=offers_kv_events(factory),
        domain=domain,
        evict_blocks=offers_evict_blocks(factory),
        mamba_groups=offers_mamba_groups(factory),
        full_sequence_gate=offers_full_sequence_gate(factory),
        cache_blocks=offers_cache_blocks(factory),
        external_tokens=offers_external_tokens(factory),
        deferred_frees=offers_deferred_frees(factory),
        mamba_align=offers_mamba_align(factory),
        mixed_block_sizes=offers_mixed_block_sizes(factory),
    )
    kinds = {
        "full": ", full attention",
        "sliding": ", sliding window",
        "hybrid": f", hybrid (2-{domain.max_groups} KV cache groups)",
    }
    title = "KV cache manager" + kinds.get(args.attention, "")
    steps = args.steps or (
        sys.maxsize if unbounded else DEFAULT_HYBRID_STEPS if hybrid else DEFAULT_MANAGER_STEPS
    )
    flags = _flags(args, "hybrid" if hybrid else "manager")
    targets = HYBRID_TARGETS if hybrid else MANAGER_TARGETS
    return Campaign(title, name, layer, semantics, misuse, domain, steps, targets, flags)


def _max_groups(args: argparse.Namespace, domain: Domain, semantics: Semantics) -> int:
    """The hybrid layer's most groups: 1 under vLLM 0.8.5's semantics (it had no hybrid
    manager); as given; else as the domain says for vLLM releases and pagedkv's own managers;
    else 1 (a third-party manager may serve one group only).

    Raises:
        InvalidArgumentError: a number outside 1-MAX_GROUPS.
    """
    if any(getattr(semantics, name) for name in VLLM_0_8_5_ONLY):
        return 1  # vLLM 0.8.5's behaviour: it had no hybrid manager
    if args.max_groups is not None:
        if not 1 <= args.max_groups <= MAX_GROUPS:
            raise InvalidArgumentError(
                f"--max-groups must be 1-{MAX_GROUPS}, got {args.max_groups}"
            )
        return min(int(args.max_groups), domain.max_groups)
    if args.against is not None or args.manager_impl == DEFAULT_MANAGER_IMPL:
        return domain.max_groups
    return 1


@contextlib.contextmanager
def _naming(option: str) -> Iterator[None]:
    """A setup error raised inside starts with the option that chose what failed."""
    try:
        yield
    except SetupError as error:
        raise SetupError(f"{option} {error}") from error.__cause__


def _option(args: argparse.Namespace, option: str) -> str:
    """The option that chose the implementation: `option`, or `--against RELEASE:`."""
    return option if args.against is None else f"--against {args.against}:"


def _guarded(factory: Any, target: str) -> Any:
    """`factory`, wrapped so that an error it raises mid-campaign is a setup error; pagedkv's
    own factories stay as they are (the clients recognize them to demand the spec's wording)."""
    return factory if factory in (pagedkv_pool, pagedkv_manager) else Guarded(factory, target)


def _flags(args: argparse.Namespace, layer: str) -> str:
    """The options that rebuild one layer's campaign (the seed and budget apart)."""
    flags = [f"--layer {layer}"]
    if args.against is not None:
        flags.append(f"--against {args.against}")
        flags.extend(f"--vllm-setting {shlex.quote(text)}" for text in args.vllm_setting)
    if layer == "pool" and args.impl != DEFAULT_POOL_IMPL:
        flags.append(f"--impl {args.impl}")
    if layer in ("manager", "hybrid") and args.manager_impl != DEFAULT_MANAGER_IMPL:
        flags.append(f"--manager-impl {args.manager_impl}")
    if layer == "manager" and args.attention != "both":
        flags.append(f"--attention {args.attention}")
    if layer == "hybrid" and args.max_groups is not None:
        flags.append(f"--max-groups {args.max_groups}")
    if args.semantics not in (None, "pagedkv"):
        flags.append(f"--semantics {args.semantics}")
    if args.no_misuse:
        flags.append("--no-misuse")
    if args.steps_per_run is not None:
        flags.append(f"--steps-per-run {args.steps_per_run}")
    if args.check_every is not None:
        flags.append(f"--check-every {args.check_every}")
    if args.known_bugs != "count":
        flags.append(f"--known-bugs {args.known_bugs}")
    return " ".join(flags)


def report_setup_error(error: BaseException) -> int:
    """Print a setup error with the traceback of its cause; the exit status for it (2)."""
    cause = error.__cause__
    frames = None if cause is None else _users_frames(cause.__traceback__)
    if cause is not None and frames is not None:
        traceback.print_exception(type(cause), cause, frames, file=sys.stderr)
    print(f"pagedkv verify: setup error (nothing was checked): {error}", file=sys.stderr)
    return EXIT_SETUP


def _users_frames(frames: TracebackType | None) -> TracebackType | None:
    """The traceback from its first frame of the user's code (neither pagedkv's nor the import
    system's); None when it has none (the error says it all: a factory called with arguments it
    does not take)."""
    ours = (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
        os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep,
    )
    while frames is not None:
        file = frames.tb_frame.f_code.co_filename
        if not file.startswith("<frozen ") and not os.path.abspath(file).startswith(ours):
            break
        frames = frames.tb_next
    return frames


def _setup_error(failure: BaseException) -> SetupError | None:
    """The setup error behind a failed run: the factory raised (not a divergence)."""
    for error in (failure, failure.__cause__, failure.__context__):
        if isinstance(error, SetupError):
            return error
    return None


def run(args: argparse.Namespace) -> int:
    """`pagedkv verify` with parsed arguments; the exit status."""
    if args.merge is not None:
        return merge_reports(args.merge, args.json)
    if args.replay_trace is not None:
        return replay_vllm_trace(args.replay_trace, args.trace_side)
    with _known_bugs(args.known_bugs):
        return _run(args)


def replay_vllm_trace(path: str, side: str) -> int:
    """`pagedkv verify --replay-trace FILE`: exit 0 when every side agrees with every vLLM
    answer the trace holds, 1 at a divergence or a pagedkv failure, 2 for an unreadable file."""
    from pagedkv.vllm_plugin.replay import replay_trace
    from pagedkv.vllm_plugin.trace import TraceFormatError

    status = 0
    for each in ("impl", "spec") if side == "both" else (side,):
        try:
            result = replay_trace(path, each)
        except (OSError, TraceFormatError) as error:
            print(f"pagedkv verify: {error}", file=sys.stderr)
            return EXIT_SETUP
        header = result.header
        print(
            f"replay of {path}: vLLM {header['vllm']}, {header['mode']} mode, semantics "
            f"{header['semantics']}, pagedkv's {each}: {result.calls} calls"
        )
        for message in result.recorded:
            print(f"  the run recorded: {message}")
        if result.divergence is not None:
            print(f"  DIVERGENCE at {result.divergence}")
            status = EXIT_DIVERGENCE
        elif result.failure is not None:
            print(f"  pagedkv FAILED at {result.failure}")
            status = EXIT_DIVERGENCE
        elif result.recorded:
            print(
                "  no divergence: this build's pagedkv answers every call as vLLM did, so the "
                "run's divergence came from the build that ran it"
            )
        else:
            print("  no divergence")
    return status


@contextlib.contextmanager
def _known_bugs(setting: str) -> Iterator[None]:
    """`--known-bugs` for every spec manager the campaign builds, in this process and the
    workers it starts (`pagedkv.spec.known_bugs.FATAL_ENV`), until the campaign ends."""
    previous = os.environ.get(FATAL_ENV)
    os.environ[FATAL_ENV] = setting
    try:
        yield
    finally:
        if previous is None:
            del os.environ[FATAL_ENV]
        else:
            os.environ[FATAL_ENV] = previous


def _run(args: argparse.Namespace) -> int:
    if args.jobs < 0:
        print("pagedkv verify: --jobs must be >= 0 (0: one per core)", file=sys.stderr)
        return EXIT_SETUP
    if any(
        value is not None and value <= 0
        for value in (args.steps, args.seconds, args.check_every, args.steps_per_run)
    ):
        print(
            "pagedkv verify: --steps, --seconds, --check-every and --steps-per-run must be "
            "positive",
            file=sys.stderr,
        )
        return EXIT_SETUP
    if args.vllm_setting and args.against is None:
        print("pagedkv verify: --vllm-setting needs --against vllm==VERSION", file=sys.stderr)
        return EXIT_SETUP
    if args.layer == "offload":
        return _offload_campaign(args)
    against = None
    if args.against is not None:
        chosen = [
            flag
            for flag, given in (
                ("--impl", args.impl != DEFAULT_POOL_IMPL),
                ("--manager-impl", args.manager_impl != DEFAULT_MANAGER_IMPL),
                ("--semantics", args.semantics is not None),
            )
            if given
        ]
        if chosen:
            print(f"pagedkv verify: --against sets {', '.join(chosen)} itself", file=sys.stderr)
            return EXIT_SETUP
        try:
            against = prepare(args.against, args.vllm_setting)
        except SetupError as error:
            return report_setup_error(error)
        for note in against.notes:
            print(f"pagedkv verify: {note}", file=sys.stderr)
        for name in against.adapter.loggers:
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        campaigns = plan(args, against)
    except (InvalidArgumentError, ImportError) as error:
        print(f"pagedkv verify: cannot load the implementation: {error}", file=sys.stderr)
        return EXIT_SETUP
    except SetupError as error:
        return report_setup_error(error)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    with quiet_refusal_warnings():
        if args.replay_run is not None:
            wanted = "manager" if args.layer == "all" else args.layer
            campaign = next(c for c in campaigns if c.layer.name == wanted)
            return replay_one(campaign, args.replay_run)
        status = _run_campaigns(args, campaigns, seed)
    own = (args.impl, args.manager_impl) == (DEFAULT_POOL_IMPL, DEFAULT_MANAGER_IMPL)
    if args.layer == "all" and own and against is None and args.semantics is None:
        if args.shard is not None or status == EXIT_DIVERGENCE:
            return status
        print()
        offload = _offload_campaign(args, seed)
        status = offload if offload == EXIT_DIVERGENCE else status or offload
    return status


def _offload_campaign(args: argparse.Namespace, seed: int | None = None) -> int:
    """The CPU offload tier's campaign (`pagedkv.harness.offload_campaign`): pagedkv's tier, or
    with `--against vllm==0.33.0` vLLM 0.33.0's own; its exit status. Not in `--json` reports,
    shards or worker processes (a campaign of 100,000 steps takes about 10 s of CPU)."""
    name = "pagedkv.offload"
    tier: Callable[[OffloadTierConfig], TierUnderTest] = OffloadTier
    if args.against is not None:
        try:
            version = parse_against(args.against)
            if version != offload_0_33.VERSION:
                raise SetupError(
                    f"the CPU offload tier is checked against vllm=={offload_0_33.VERSION} "
                    f"only, not {args.against}"
                )
            root = source_tree(version, offload_0_33.MEMBERS, offload_0_33.STAND_INS)
        except FetchError as error:
            return report_setup_error(SetupError(f"cannot fetch vllm {version}: {error}"))
        except SetupError as error:
            return report_setup_error(error)
        name = f"vllm {version}"
        tier = functools.partial(offload_0_33.VllmOffloadTier, root)

    if seed is None:
        seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    campaign = run_offload_campaign(seed, args.steps or DEFAULT_OFFLOAD_STEPS, tier)
    print("\n".join(format_offload_report(campaign, name)))
    flags = f" --against {args.against}" if args.against else ""
    replay = f"--layer offload{flags} --seed {seed} --steps {campaign.steps}"
    print(f"Replay it: pagedkv verify {replay}")
    if campaign.failure is not None:
        return EXIT_DIVERGENCE
    return EXIT_COVERAGE if campaign.unmet() else 0


def _run_campaigns(args: argparse.Namespace, campaigns: list[Campaign], seed: int) -> int:
    status = 0
    records: list[dict[str, Any]] = []
    try:
        for index, campaign in enumerate(campaigns):
            result, parts, replay = _execute(args, campaign, seed)
            records.append(campaign_record(campaign, result))
            if index:
                print()
            outcome = _report(campaign, result, parts=parts, replay=replay)
            if outcome:
                return outcome
            if unmet(evaluate(result.coverage, campaign.targets, campaign.modes)):
                status = EXIT_COVERAGE
    finally:
        if args.json is not None:
            write_report(args.json, seed, args.shard, records)
    return status


def _execute(
    args: argparse.Namespace, campaign: Campaign, seed: int
) -> tuple[CampaignRun, str | None, str | None]:
    """Run one campaign as the arguments ask: in this process, in worker processes, or one
    shard of it; (its outcome, where its runs ran, the command that replays it)."""
    jobs = args.jobs or os.cpu_count() or 1
    bounded = campaign.steps != sys.maxsize
    total = campaign.steps
    if jobs == 1 and args.shard is None:
        parts = replay = None
        runner = functools.partial(run_campaign, max_steps=campaign.steps)
    else:
        layer = campaign.layer
        indices = campaign_indices(layer, seed, campaign.steps if bounded else None)
        parts = f"{jobs} worker processes" if jobs > 1 else None
        replay = None
        if args.shard is not None:
            shard, num_shards = args.shard
            indices = shard_indices(indices, shard, num_shards)
            if bounded:
                indices = list(indices)
                total = sum(layer.draw(run_seed(seed, layer.name, i)).num_steps for i in indices)
            parts = ", ".join(filter(None, [f"shard {shard} of {num_shards}", parts]))
            budget = f"--steps {campaign.steps}" if bounded else f"--seconds {args.seconds}"
            replay = f"pagedkv verify {campaign.flags} --seed {seed} {budget}"
            replay += f" --shard {shard}/{num_shards}"
        factory = functools.partial(build_layer, dict(vars(args)), layer.name)
        runner = functools.partial(run_indices, indices=indices, jobs=jobs, factory=factory)
    progress = None if args.quiet else ProgressBar(total, unit="steps")
    result = runner(
        campaign.layer,
        seed=seed,
        max_seconds=args.seconds,
        check_every=args.check_every,
        progress=None if progress is None else _show(progress),
    )
    if progress is not None:
        _show(progress)(result.coverage)
        progress.close()
    return result, parts, replay


def build_layer(arguments: dict[str, Any], name: str) -> Layer:
    """The layer `name` of the campaigns `arguments` (`vars()` of parsed arguments) ask for,
    built as `run` builds it: what a worker process runs (`--jobs`)."""
    args = argparse.Namespace(**arguments)
    against = None
    if args.against is not None:
        against = prepare(args.against, args.vllm_setting)
        for logger in against.adapter.loggers:
            logging.getLogger(logger).setLevel(logging.ERROR)
    return next(campaign.layer for campaign in plan(args, against) if campaign.layer.name == name)


def _report(
    campaign: Campaign,
    result: CampaignRun,
    *,
    parts: str | None = None,
    replay: str | None = None,
) -> int:
    """Print one campaign's report; the exit status of a failure (0: none)."""
    failure = result.failure
    targets = evaluate(result.coverage, campaign.targets, campaign.modes)
    lines = format_report(campaign, result, targets, parts=parts, replay=replay)
    if failure is None:
        print("\n".join(lines), flush=True)
        return 0
    setup_error = _setup_error(failure.error)
    if setup_error is not None:
        return report_setup_error(setup_error)
    if signature_of(failure.error)[0] == "harness error":
        print("\n".join([*lines, "", *render_harness_error(failure, campaign.flags)]))
        return EXIT_HARNESS
    print("pagedkv verify: shrinking the failing run ...", file=sys.stderr, flush=True)
    shrunk = shrink(campaign.layer, failure.run, failure.ops, failure.error)
    print("\n".join([*lines, "", *render_shrunk(shrunk, campaign.flags, failure.run.seed)]))
    return EXIT_DIVERGENCE


# -- JSON reports and --merge ------------------------------------------------------------------

REPORT_FORMAT = "pagedkv verify report 1"
"""The `format` of a JSON report (`--json`), for `--merge` to recognize."""


def campaign_record(campaign: Campaign, result: CampaignRun) -> dict[str, Any]:
    """One campaign of a JSON report: what rebuilds it (layer, flags, budget), its coverage and
    digest, its times, and its first failing run (index and run seed) or None."""
    failure = result.failure
    return {
        "layer": campaign.layer.name,
        "title": campaign.title,
        "impl": campaign.impl,
        "flags": campaign.flags,
        "steps": campaign.steps if campaign.steps != sys.maxsize else None,
        "digest": result.coverage.digest(),
        "cpu_seconds": result.cpu_seconds,
        "wall_seconds": result.wall_seconds,
        "failure": None if failure is None else {"index": failure.index, "seed": failure.run.seed},
        "coverage": result.coverage.to_json(),
    }


def write_report(
    path: str, seed: int, shard: tuple[int, int] | None, records: list[dict[str, Any]]
) -> None:
    """Write a JSON report: the campaign seed, the shard (None: every run), each campaign."""
    report = {
        "format": REPORT_FORMAT,
        "seed": seed,
        "shard": None if shard is None else list(shard),
        "campaigns": records,
    }
    with open(path, "w", encoding="utf-8") as file:
        json.dump(report, file)
        file.write("\n")


class MergeError(Exception):
    """Reports that do not make one campaign: why."""


def merge_reports(paths: list[str], json_path: str | None = None) -> int:
    """`pagedkv verify --merge`: the reports of every shard of one invocation (one seed, the
    same options), combined campaign by campaign, in their order, into the report of the whole
    (a failure: the failing run of lowest index, run again here, shrunk and printed); the exit
    status `pagedkv verify` run whole would have had."""
    try:
        seed, num_shards, by_layer = _load_shards(paths)
    except (MergeError, OSError, ValueError) as error:
        print(f"pagedkv verify --merge: {error}", file=sys.stderr)
        return EXIT_SETUP
    status = 0
    records: list[dict[str, Any]] = []
    try:
        for number, (name, parts) in enumerate(by_layer.items()):
            try:
                campaign, result = _merged(seed, name, parts, num_shards)
            except (MergeError, InvalidArgumentError, ImportError) as error:
                print(f"pagedkv verify --merge: {error}", file=sys.stderr)
                return EXIT_SETUP
            except SetupError as error:
                return report_setup_error(error)
            records.append(campaign_record(campaign, result))
            if number:
                print()
            with quiet_refusal_warnings():
                outcome = _report(campaign, result, parts=f"{len(parts)} shards, merged")
            if outcome:
                return outcome
            if unmet(evaluate(result.coverage, campaign.targets, campaign.modes)):
                status = EXIT_COVERAGE
    finally:
        if json_path is not None:
            write_report(json_path, seed, None, records)
    return status


def _load_shards(paths: list[str]) -> tuple[int, int, dict[str, list[dict[str, Any]]]]:
    """The campaign seed, the number of shards, and each layer's campaign records from every
    shard, in the order the campaigns ran.

    Raises:
        MergeError: not reports of every shard (each once) of one invocation.
    """
    reports = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            report = json.load(file)
        if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
            raise MergeError(f"{path} is not a pagedkv verify --json report")
        reports.append((path, report))
    seeds = {report["seed"] for _, report in reports}
    if len(seeds) != 1:
        raise MergeError(f"the reports are of different campaign seeds: {sorted(seeds)}")
    shards = [tuple(report["shard"] or (1, 1)) for _, report in reports]
    num_shards = {n for _, n in shards}
    if len(num_shards) != 1:
        raise MergeError(f"the reports split the campaign differently: {sorted(shards)}")
    (n,) = num_shards
    if sorted(k for k, _ in shards) != list(range(1, n + 1)):
        raise MergeError(
            f"need every shard of {n} once; got {', '.join(f'{k}/{n}' for k, _ in sorted(shards))}"
        )
    by_layer: dict[str, list[dict[str, Any]]] = {}
    for _, report in sorted(reports, key=lambda entry: entry[1]["shard"] or [1]):
        for record in report["campaigns"]:
            by_layer.setdefault(record["layer"], []).append(record)
    return seeds.pop(), n, by_layer


def _merged(
    seed: int, name: str, parts: list[dict[str, Any]], num_shards: int
) -> tuple[Campaign, CampaignRun]:
    """The campaign of layer `name` rebuilt from its flags, and its outcome merged from the
    shards' records (a failure run again here).

    Raises:
        MergeError: the shards ran it with different options, or not every shard did.
        InvalidArgumentError, ImportError, SetupError: as the campaign's own options would.
    """
    if len(parts) != num_shards:
        raise MergeError(f"{len(parts)} of the {num_shards} shards ran the {name} campaign")
    first = parts[0]
    if any(part["flags"] != first["flags"] or part["steps"] != first["steps"] for part in parts):
        raise MergeError(f"the shards ran the {name} campaign with different options")
    parser = argparse.ArgumentParser(prog="pagedkv verify")
    add_arguments(parser)
    argv = [*shlex.split(first["flags"]), "--seed", str(seed), "--quiet"]
    if first["steps"] is not None:
        argv += ["--steps", str(first["steps"])]
    args = parser.parse_args(argv)
    against = prepare(args.against, args.vllm_setting) if args.against is not None else None
    campaign = next(c for c in plan(args, against) if c.layer.name == name)
    coverage = Coverage()
    for part in parts:
        coverage.merge(Coverage.from_json(part["coverage"]))
    failures = [part["failure"] for part in parts if part["failure"] is not None]
    failure = None
    if failures:
        first_failure = min(failures, key=lambda entry: int(entry["index"]))
        failure = rerun_failure(
            campaign.layer, first_failure["index"], first_failure["seed"], args.check_every
        )
    result = CampaignRun(
        name,
        seed,
        coverage,
        sum(float(part["cpu_seconds"]) for part in parts),
        max(float(part["wall_seconds"]) for part in parts),
        failure,
    )
    return campaign, result


def _show(progress: ProgressBar) -> Callable[[Coverage], None]:
    def update(coverage: Coverage) -> None:
        progress.update(coverage.steps, f"{len(coverage.states):,} states")

    return update


def replay_one(campaign: Campaign, seed: int) -> int:
    """Run one run by its seed, as its campaign ran it; shrink and print it if it fails."""
    run = campaign.layer.draw(seed)
    coverage = Coverage()
    ops, error = execute_run(campaign.layer, run, coverage)
    print(f"pagedkv verify — {campaign.title}, run {seed}: spec vs {campaign.impl}")
    print(f"  run                    {run.describe()}")
    print(f"  steps                  {len(ops):,}")
    if error is None:
        print("  result                 OK: no divergence")
        print(f"  replay                 pagedkv verify {campaign.flags} --replay-run {seed}")
        return 0
    setup_error = _setup_error(error)
    if setup_error is not None:
        return report_setup_error(setup_error)
    print()
    if signature_of(error)[0] == "harness error":
        failure = RunFailure(run, 0, tuple(ops), error)
        print("\n".join(render_harness_error(failure, campaign.flags)))
        return EXIT_HARNESS
    shrunk = shrink(campaign.layer, run, ops, error)
    print("  result                 DIVERGENCE")
    print()
    print("\n".join(render_shrunk(shrunk, campaign.flags, seed)))
    return EXIT_DIVERGENCE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv verify", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
