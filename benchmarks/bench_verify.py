"""`pagedkv verify`'s cost: steps per CPU second, and the share of a step the compared calls take.

Each configuration runs a fixed-seed campaign of a fixed number of steps (the same operations in
every round), timed in CPU seconds (`time.process_time_ns`: wall-clock time is unreliable on a
loaded machine). Configurations alternate round by round and the report gives medians:

- the swarm engine on each layer (block pool, manager, hybrid manager), comparing as it does by
  default (every call, a digest every step, whole snapshots and invariants on a cadence), and
  the pool and manager in full mode (whole snapshots and both invariant checks every step);
- the hypothesis state machines, which draw the same client's operations (the anchor: fewer
  steps, they are slow).

Then the cost as a ratio a varying machine can check: for each layer and each anchor, in one
process, the share of the run's CPU time spent inside the spec's and the implementation's own
calls (`call_share.py`: every part of the harness charged separately, the ledger's own cost
taken out). The goal: the harness costs at most half of what the calls cost (calls >= 67% of a
step). The table below it says where the rest goes.

    ./dev bench verify                       # defaults
    ./dev bench verify --steps 20000 --rounds 1
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from call_share import CALLS, Share, calibrate, measure
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.machines.manager import make_manager_machine
from pagedkv.harness.machines.pool import make_pool_machine
from pagedkv.harness.swarm import Layer, manager_layer, pool_layer, run_campaign

SEED = 2_025
GOAL = 2 / 3
"""Calls' share of a step the goal asks for: the harness at most half of what the calls cost."""

Measure = Callable[[], int]
"""Runs one campaign; the number of steps it ran."""


def swarm(layer: Layer, steps: int, check_every: int | None = None) -> Measure:
    def measure_run() -> int:
        result = run_campaign(layer, seed=SEED, max_steps=steps, check_every=check_every)
        if result.failure is not None:
            raise RuntimeError(f"the campaign diverged: {result.failure.error}")
        return result.coverage.steps

    return measure_run


def machine(layer: str, steps: int) -> Measure:
    """The hypothesis machine, about `steps` steps (derandomized examples of up to 50 steps)."""

    def measure_run() -> int:
        coverage = Coverage()
        built = (
            make_pool_machine(pagedkv_pool, coverage=coverage)
            if layer == "pool"
            else make_manager_machine(pagedkv_manager, sliding_window=False, coverage=coverage)
        )
        examples = max(1, steps // 30)
        run_state_machine_as_test(
            built, settings=settings(max_examples=examples, derandomize=True, database=None)
        )
        return coverage.steps

    return measure_run


def cpu_rate(run: Measure) -> float:
    start = time.process_time_ns()
    steps = run()
    return steps / ((time.process_time_ns() - start) / 1e9)


def throughput(args: argparse.Namespace) -> None:
    configurations: list[tuple[str, Measure]] = [
        ("pool, swarm", swarm(pool_layer(pagedkv_pool), args.steps)),
        ("pool, swarm, full check every step", swarm(pool_layer(pagedkv_pool), args.steps, 1)),
        ("pool, hypothesis machine", machine("pool", args.machine_steps)),
        ("manager, swarm", swarm(manager_layer(pagedkv_manager), args.steps)),
        (
            "manager, swarm, full check every step",
            swarm(manager_layer(pagedkv_manager), args.steps, 1),
        ),
        ("manager, hypothesis machine", machine("manager", args.machine_steps)),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _ in configurations}
    for _ in range(args.rounds):
        for name, run in configurations:  # alternating: every round runs each once
            rates[name].append(cpu_rate(run))
    print(
        f"pagedkv verify throughput: seed {SEED}, {args.steps:,} swarm steps "
        f"(about {args.machine_steps:,} machine steps) per campaign, median of {args.rounds} "
        "rounds, CPU time"
    )
    for name, values in rates.items():
        print(f"  {name:<40} {statistics.median(values):>9,.0f} steps/CPU-s")


def call_shares(args: argparse.Namespace) -> dict[str, list[Share]]:
    """Each layer's and each anchor's shares, one per round, rounds alternating."""
    steps, machine_steps = args.share_steps, args.machine_steps
    configurations: list[tuple[str, Measure]] = [
        ("pool, swarm", swarm(pool_layer(pagedkv_pool), steps)),
        ("manager, swarm", swarm(manager_layer(pagedkv_manager), steps)),
        ("hybrid, swarm", swarm(manager_layer(pagedkv_manager, attention="hybrid"), steps)),
        ("pool, hypothesis machine (anchor)", machine("pool", machine_steps)),
        ("manager, hypothesis machine (anchor)", machine("manager", machine_steps)),
    ]
    overhead = calibrate()
    shares: dict[str, list[Share]] = {name: [] for name, _ in configurations}
    for _ in range(args.rounds):
        for name, run in configurations:
            shares[name].append(measure(run, overhead))
    return shares


def report_shares(shares: dict[str, list[Share]], args: argparse.Namespace) -> None:
    print(
        f"\nwhere a step's CPU time goes: seed {SEED}, {args.share_steps:,} swarm steps a layer "
        f"(about {args.machine_steps:,} machine steps), median of {args.rounds} rounds, one "
        "process"
    )
    print(
        f"  {'':<38} {'calls':>6} {'harness/calls':>14}   goal: calls >= {GOAL:.0%} "
        "(harness <= calls / 2)"
    )
    for name, runs in shares.items():
        calls = statistics.median(share.calls for share in runs)
        per_call = (1 - calls) / calls
        verdict = "met" if calls >= GOAL else f"unmet (harness {per_call / 0.5:.1f}x the goal)"
        print(f"  {name:<38} {calls:>6.0%} {per_call:>14.2f}   {verdict}")
    names = list(shares)
    parts = sorted(
        {part for runs in shares.values() for share in runs for part in share.parts},
        key=lambda part: (part not in CALLS, -_median_share(shares[names[1]], part)),
    )
    heads = ("pool", "manager", "hybrid", "pool anchor", "manager anchor")
    print(f"\n  {'share of the run':<54}" + "".join(f"{head:>15}" for head in heads[: len(names)]))
    for part in parts:
        cells = "".join(f"{_median_share(shares[name], part):>15.1%}" for name in names)
        print(f"  {part:<54}{cells}")
    per_step = "".join(
        f"{statistics.median(s.total / s.steps for s in shares[name]) / 1e3:>15.1f}"
        for name in names
    )
    plain = "".join(
        f"{statistics.median(s.plain_ns / s.steps for s in shares[name]) / 1e3:>15.1f}"
        for name in names
    )
    print(f"  {'CPU us a step, the ledger taken out':<54}{per_step}")
    print(f"  {'CPU us a step, run without the ledger':<54}{plain}")


def _median_share(runs: list[Share], part: str) -> float:
    return statistics.median(share.parts.get(part, 0.0) / share.total for share in runs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="swarm steps per campaign")
    parser.add_argument("--machine-steps", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--share-steps", type=int, default=20_000, help="swarm steps per call-share run"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    if not args.skip_throughput:
        throughput(args)
    report_shares(call_shares(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
