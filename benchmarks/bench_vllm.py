"""pagedkv vs vLLM 0.8.5 and 0.33.0: the serving trace, each operation, O(1) at scale.

vLLM's KV cache modules are fetched at run time (from its wheels, no dependencies; nothing of it
is committed). One worker process per vLLM release and pagedkv build (pure, and compiled when a
build exists at --compiled-site) drives vLLM's manager and pagedkv's with the same work, in CPU
time (`time.process_time_ns`), alternating rounds, and reports paired medians
(`paired_timing.py`). Ratios are pagedkv / vLLM: below 1, pagedkv is faster.

- The serving trace (issue 11's shape: ~400 requests over 6 system prompts, 32 running, block
  size 16, 2,000 blocks): bench_manager's scheduler loop runs it once on pagedkv and records
  every manager call; each manager then replays the calls (`trace_replay.py`), first checked call
  by call against the recording (same block ids, same hits: the same decisions), then timed.
- Each operation on prepared state (`op_timings.py`), with the builtin hash and with sha256.
- decode and new-block steps at 1k vs 1M blocks (flat when O(1)), building a 1M-block manager
  (with the garbage collector on, as a scheduler builds one; the rest of the process frozen, so
  only the construction's own objects are scanned), and looking up a 131,072-token prompt.

Against vLLM 0.33.0, pagedkv runs under the `vllm-0.33` semantics (`pagedkv.vocab.semantics`),
and so does the recording, so that both take the same decisions; vLLM 0.33.0 hashes blocks on
the request as its tokens arrive, which `kv_sides.Vllm033Manager` does inside the timed calls,
and has no builtin hash (`hash()` as 8 bytes stands in; `kv_sides.vllm_033_side`).

    ./dev bench vllm                       # both builds against both releases
    ./dev bench vllm --baseline vllm-0.8.5 # one release (or vllm-0.33)
    ./dev bench vllm --quick               # fewer calls and rounds, no 1M-block or 128k runs
    ./dev bench vllm --json results/vllm.json

`--baseline pagedkv` runs everything against pagedkv itself instead of vLLM (no download; the
benchmark's own test uses it). `--kv-events` builds the pagedkv contender with KV cache events
on, so `--baseline pagedkv --kv-events` is the cost of events (off vs on, paired), and
`--baseline pagedkv` alone the noise floor of the pairing (off vs off).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # proofs.vllm_conformance (appended: never shadows pagedkv)

from kv_sides import (  # noqa: E402
    VLLM_033,
    Side,
    fetch_vllm_modules,
    pagedkv_side,
    vllm_033_side,
    vllm_side,
)
from op_timings import (  # noqa: E402
    Operation,
    decode_inside_a_block,
    decode_needs_a_new_block,
    lookup_128k_tokens_cold,
    operations,
)
from paired_timing import Paired, paired_rounds  # noqa: E402
from trace_replay import (  # noqa: E402
    ISSUE_TRACE,
    MAX_RUNNING,
    NUM_BLOCKS,
    check_replay,
    prepare_null_replay,
    prepare_replay,
    record_calls,
)

HASHES = ("builtin", "sha256")
LARGE = 1_000_000
SMALL = 1_000
BASELINES = {
    # name: (vLLM release, pagedkv's semantics against it)
    "vllm-0.8.5": ("0.8.5", "pagedkv"),
    "vllm-0.33": (VLLM_033, "vllm-0.33"),
    "pagedkv": (None, "pagedkv"),
}
"""Each baseline a worker pairs pagedkv with; `--baseline vllm` runs both vLLM releases."""


def _paired_json(paired: Paired) -> dict[str, Any]:
    return {
        "baseline_ns_per_op": paired.baseline_ns_per_op,
        "pagedkv_ns_per_op": paired.contender_ns_per_op,
        "ratio": paired.ratio,
        "ratios": paired.ratios,
        "ops": paired.ops,
    }


def _operation(
    operation: Operation, baseline: Side, pagedkv: Side, hash_algo: str, rounds: int
) -> Paired:
    def prepare(side: Side) -> Callable[[], tuple[Any, Any]]:
        return lambda: operation.setup(
            side, side.make_manager(operation.num_blocks, hash_algo), operation.ops
        )

    return paired_rounds(prepare(baseline), prepare(pagedkv), rounds, operation.ops)


def _trace(
    baseline: Side, pagedkv: Side, rounds: int, conversations: int, semantics: str
) -> dict[str, Any]:
    recording = record_calls(
        replace(ISSUE_TRACE, num_conversations=conversations), semantics=semantics
    )
    result: dict[str, Any] = {
        "requests": len(recording.prompts),
        "calls": dict(recording.kinds()),
    }
    for hash_algo in HASHES:
        final = check_replay(recording, pagedkv, hash_algo)
        if check_replay(recording, baseline, hash_algo) != final:
            raise AssertionError(f"{baseline.name} ends the trace with another free queue")
        paired = paired_rounds(
            prepare_replay(recording, baseline, hash_algo, final),
            prepare_replay(recording, pagedkv, hash_algo, final),
            rounds,
            len(recording.calls),
        )
        loop = paired_rounds(
            prepare_null_replay(recording, baseline),
            prepare_null_replay(recording, pagedkv),
            rounds,
            len(recording.calls),
        )
        result[hash_algo] = {
            **_paired_json(paired.minus(loop)),
            "replay": _paired_json(paired),
            "loop": _paired_json(loop),
        }
    return result


def _at_scale(baseline: Side, pagedkv: Side, rounds: int) -> dict[str, Any]:
    """O(1) steps at 1k and 1M blocks, and building the 1M-block managers (reused, unfreed)."""
    large: dict[str, Any] = {}

    def build(side: Side) -> Callable[[], tuple[Any, Any]]:
        def prepare() -> tuple[Any, Any]:
            def keep(manager: object) -> None:
                large[side.name] = manager

            return lambda: _with_collector(lambda: side.make_manager(LARGE, "builtin")), keep

        return prepare

    construction = paired_rounds(build(baseline), build(pagedkv), max(rounds // 3, 1), 1)
    steps: dict[str, Any] = {}
    for name, setup, ops in (
        ("decode inside a block", decode_inside_a_block, 16_000),
        ("decode needs a new block", decode_needs_a_new_block, 450),
    ):
        for num_blocks in (SMALL, LARGE):

            def prepare(side: Side, num_blocks: int = num_blocks) -> Callable[[], Any]:
                def fresh_or_large() -> tuple[Any, Any]:
                    manager = (
                        large[side.name]
                        if num_blocks == LARGE
                        else side.make_manager(num_blocks, "builtin")
                    )
                    return setup(side, manager, ops)  # noqa: B023 (called within the loop)

                return fresh_or_large

            paired = paired_rounds(prepare(baseline), prepare(pagedkv), rounds, ops)
            steps[f"{name}, {num_blocks:,} blocks"] = _paired_json(paired)
    lookups = {}
    for hash_algo in HASHES:
        operation = Operation("lookup 128k", 1, NUM_BLOCKS, lookup_128k_tokens_cold)
        lookups[hash_algo] = _paired_json(
            _operation(operation, baseline, pagedkv, hash_algo, max(rounds // 2, 1))
        )
    return {
        "construction_1m": _paired_json(construction),
        "steps": steps,
        "lookup_128k": lookups,
    }


def _with_collector(make: Callable[[], Any]) -> Any:
    """`make()` with the garbage collector on (a timed run has it off), every object that
    exists already frozen: collections scan only what `make` creates, as at a server's start."""
    gc.freeze()
    gc.enable()
    try:
        return make()
    finally:
        gc.disable()
        gc.unfreeze()


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Everything, for the pagedkv build this process imports, against one baseline."""
    import pagedkv

    if pagedkv.COMPILED is not (args.worker == "compiled"):
        raise SystemExit(
            f"worker for the {args.worker} build imported a build with COMPILED="
            f"{pagedkv.COMPILED} ({pagedkv.__file__})"
        )
    release, semantics = BASELINES[args.baseline]
    contender = pagedkv_side(
        f"pagedkv ({args.worker})", kv_events=args.kv_events, semantics=semantics
    )
    if release is None:
        baseline = pagedkv_side("pagedkv (baseline)")
    elif release == VLLM_033:
        baseline = vllm_033_side(args.vllm_modules)
    else:
        baseline = vllm_side(args.vllm_modules)
    scale = 10 if args.quick else 1
    rounds = 3 if args.quick else args.rounds
    report: dict[str, Any] = {
        "build": args.worker,
        "baseline": baseline.name,
        "kv_events": args.kv_events,
        "compiled_modules": list(pagedkv.COMPILED_MODULES),
        "rounds": rounds,
        "trace_rounds": trace_rounds(rounds),
        "semantics": semantics,
        "trace": _trace(baseline, contender, trace_rounds(rounds), args.conversations, semantics),
        "ops": {
            hash_algo: {
                operation.name: _paired_json(
                    _operation(operation, baseline, contender, hash_algo, rounds)
                )
                for operation in operations(scale)
            }
            for hash_algo in HASHES
        },
    }
    if not args.quick:
        report["scale"] = _at_scale(baseline, contender, rounds)
    return report


def trace_rounds(rounds: int) -> int:
    """The trace's rounds: about twice the others' (one replay is a fifth of a second, and its
    per-round ratios spread widest: 0.5 to 0.9 within one run on the development machine)."""
    return 2 * rounds - 1


def _spawn(
    build: str, site: Path | None, baseline: str, modules: Path | None, args: argparse.Namespace
) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONHASHSEED"] = "0"  # both sides derive NONE_HASH from it, as vLLM does
    if site is not None:
        env["PYTHONPATH"] = str(site)
    command = [sys.executable, __file__, "--worker", build, "--baseline", baseline]
    command += ["--rounds", str(args.rounds), "--vllm-modules", str(modules)]
    command += ["--conversations", str(args.conversations)]
    if args.quick:
        command.append("--quick")
    if args.kv_events:
        command.append("--kv-events")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {build} worker against {baseline} failed:\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _line(
    label: str,
    pure: dict[str, Any],
    compiled: dict[str, Any] | None,
    unit: float = 1.0,
    digits: int = 0,
) -> None:
    """One row: the baseline's time, then each build's time and ratio (times / `unit` ns)."""
    cells = [f"{pure['baseline_ns_per_op'] / unit:>18,.{digits}f}"]
    for row in (pure, compiled):
        if row is None:
            cells.append(f"{'-':>10} {'-':>6}")
        else:
            cells.append(f"{row['pagedkv_ns_per_op'] / unit:>10,.{digits}f} {row['ratio']:>6.2f}")
    print(f"  {label:<42}" + " ".join(cells))


def _header(title: str, baseline: str) -> None:
    print(f"\n{title}")
    print(f"  {'':<42}{baseline:>18} {'pagedkv pure':>17} {'pagedkv compiled':>17}")


def print_report(reports: dict[str, dict[str, Any]], missing: str | None) -> None:
    """The tables: trace, per operation, at scale; a time and a ratio per build."""
    pure = reports["pure"]
    compiled = reports.get("compiled")
    baseline = pure["baseline"]
    trace = pure["trace"]
    print(
        f"pagedkv vs {baseline}: CPU time (process_time_ns), {pure['rounds']} alternating rounds"
        f" ({trace_rounds(pure['rounds'])} for the trace),"
        f" paired medians\nratio = pagedkv / {baseline} (below 1: pagedkv is faster), each build"
        " paired with\nthe baseline's runs in its own worker process"
    )
    if pure.get("kv_events"):
        print("pagedkv's managers queue KV cache events (--kv-events); the baseline's do not")
    if pure.get("semantics", "pagedkv") != "pagedkv":
        print(f"pagedkv runs, and the trace was recorded, under the {pure['semantics']} semantics")
    if baseline.endswith(VLLM_033):
        print(
            f"vLLM {VLLM_033} hashes blocks on the request: inside its calls here (kv_sides.py);"
            "\nits builtin hash is hash() as 8 bytes (it has none of its own)"
        )
    if missing:
        print(f"compiled build: not measured: {missing}")
    else:
        assert compiled is not None
        print(f"compiled build: {len(compiled['compiled_modules'])} modules compiled with mypyc")
    calls = sorted(trace["calls"].items(), key=lambda item: -item[1])
    print(
        f"\nserving trace: {trace['requests']:,} requests over {ISSUE_TRACE.num_system_prompts} "
        f"system prompts, {MAX_RUNNING} running, block size 16, {NUM_BLOCKS:,} blocks"
    )
    kinds = ", ".join(f"{count:,} {kind}" for kind, count in calls)
    print(
        textwrap.fill(
            f"{sum(trace['calls'].values()):,} calls: {kinds}",
            98,
            initial_indent="  ",
            subsequent_indent="    ",
        )
    )
    print("  each manager first replayed it checked call by call: same blocks, same hits")
    _header("serving trace (ns per call, averaged over every call)", baseline)
    for hash_algo in HASHES:
        row, other = trace[hash_algo], compiled["trace"][hash_algo] if compiled else None
        _line(f"{hash_algo}: inside the managers", row, other)
        _line(
            f"{hash_algo}: whole replay (+ request updates)",
            row["replay"],
            other["replay"] if other else None,
        )
    for hash_algo in HASHES:
        _header(f"per operation, {hash_algo} hash (ns per call)", baseline)
        for name, row in pure["ops"][hash_algo].items():
            _line(name, row, compiled["ops"][hash_algo][name] if compiled else None)
    if "scale" not in pure:
        return
    scale = pure["scale"]
    other_scale = compiled["scale"] if compiled else None
    _header("O(1) steps at 1k and 1M blocks, builtin hash (ns per call)", baseline)
    for name, row in scale["steps"].items():
        _line(name, row, other_scale["steps"][name] if other_scale else None)
    print("  time per call at 1M blocks / at 1k blocks")
    for name in ("decode inside a block", "decode needs a new block"):
        cells: list[float] = []
        for report in (pure, compiled):
            if report is None:
                continue
            small = report["scale"]["steps"][f"{name}, {SMALL:,} blocks"]
            large = report["scale"]["steps"][f"{name}, {LARGE:,} blocks"]
            if not cells:
                cells.append(large["baseline_ns_per_op"] / small["baseline_ns_per_op"])
            cells.append(large["pagedkv_ns_per_op"] / small["pagedkv_ns_per_op"])
        builds = " ".join(f"{cell:>10.2f} {'':>6}" for cell in cells[1:])
        print(f"  {name:<42}{cells[0]:>18.2f} {builds}".rstrip())
    _header("1M blocks and 128k tokens (ms)", baseline)
    _line(
        "build a 1M-block KVCacheManager",
        scale["construction_1m"],
        other_scale["construction_1m"] if other_scale else None,
        1e6,
        1,
    )
    for hash_algo in HASHES:
        _line(
            f"look up a 131,072-token prompt, {hash_algo}",
            scale["lookup_128k"][hash_algo],
            other_scale["lookup_128k"][hash_algo] if other_scale else None,
            1e6,
            1,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per timing")
    parser.add_argument("--quick", action="store_true", help="fewer calls, 3 rounds, no 1M/128k")
    parser.add_argument(
        "--conversations",
        type=int,
        default=ISSUE_TRACE.num_conversations,
        help="conversations in the trace (about 2.5 requests each)",
    )
    parser.add_argument(
        "--baseline",
        choices=("vllm", *BASELINES),
        default="vllm",
        help="what pagedkv is paired with (vllm: both vLLM releases, one after the other)",
    )
    parser.add_argument(
        "--kv-events", action="store_true", help="pagedkv's managers queue KV cache events"
    )
    parser.add_argument(
        "--compiled-site",
        type=Path,
        default=ROOT / "build" / "compiled" / "site",
        help="where the compiled build is installed (./dev compiled)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the reports here")
    parser.add_argument("--worker", choices=("pure", "compiled"), help=argparse.SUPPRESS)
    parser.add_argument("--vllm-modules", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        json.dump(run_worker(args), sys.stdout)
        return 0
    baselines = ["vllm-0.8.5", "vllm-0.33"] if args.baseline == "vllm" else [args.baseline]
    missing = None
    if not (args.compiled_site / "pagedkv").is_dir():
        missing = f"no build at {args.compiled_site} (./dev compiled builds it; needs a C compiler)"
    reports: dict[str, dict[str, dict[str, Any]]] = {}
    for position, baseline in enumerate(baselines):
        release = BASELINES[baseline][0]
        # cached after the first fetch; PAGEDKV_CACHE moves it
        modules = None if release is None else fetch_vllm_modules(release)
        reports[baseline] = {"pure": _spawn("pure", None, baseline, modules, args)}
        if missing is None:
            reports[baseline]["compiled"] = _spawn(
                "compiled", args.compiled_site, baseline, modules, args
            )
        if position:
            print("\n")
        print_report(reports[baseline], missing)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
