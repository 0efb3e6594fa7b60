"""`pagedkv verify` throughput: steps per CPU second per layer and engine, and where a step goes.

Each configuration runs a fixed-seed campaign of a fixed number of steps (the same operations in
every round), timed in CPU seconds (`time.process_time_ns`: wall-clock time is unreliable on a
loaded machine). Configurations alternate round by round and the report gives each one's median:

- the swarm engine on the block pool and on the manager, comparing as it does by default (every
  call, a digest every step, whole snapshots and invariants on a cadence);
- the same, in full mode (whole snapshots and both invariant checks after every step);
- the hypothesis state machines, which draw the same client's operations (fewer steps: slow).

Then one profiled manager campaign attributes a step's time to the spec, the implementation,
the comparison and the client (cProfile's own time per function, grouped by module; profiling
inflates small calls, so read the shares, not the absolute numbers; a built-in's time counts
for the code that calls it).

    ./dev bench verify                       # defaults
    ./dev bench verify --steps 20000 --rounds 1
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.machines.manager import make_manager_machine
from pagedkv.harness.machines.pool import make_pool_machine
from pagedkv.harness.swarm import Layer, manager_layer, pool_layer, run_campaign

SEED = 2_025

Measure = Callable[[], int]
"""Runs one campaign; the number of steps it ran."""


def swarm(layer: Layer, steps: int, check_every: int | None = None) -> Measure:
    def measure() -> int:
        result = run_campaign(layer, seed=SEED, max_steps=steps, check_every=check_every)
        if result.failure is not None:
            raise RuntimeError(f"the campaign diverged: {result.failure.error}")
        return result.coverage.steps

    return measure


def machine(layer: str, steps: int) -> Measure:
    """The hypothesis machine, about `steps` steps (derandomized examples of up to 50 steps)."""

    def measure() -> int:
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

    return measure


def cpu_rate(measure: Measure) -> float:
    start = time.process_time_ns()
    steps = measure()
    return steps / ((time.process_time_ns() - start) / 1e9)


def where_the_time_goes(steps: int) -> list[tuple[str, float]]:
    """Shares of a profiled manager campaign's own time, by part of the code."""
    profile = cProfile.Profile()
    profile.enable()
    swarm(manager_layer(pagedkv_manager), steps)()
    profile.disable()
    stats = pstats.Stats(profile)
    parts: dict[str, float] = {}
    for (filename, _, _), row in stats.stats.items():  # type: ignore[attr-defined]
        if filename != "~":
            parts[_part(filename)] = parts.get(_part(filename), 0.0) + row[2]
            continue
        # A built-in (len, dict.get, sha256, ...): its own time goes to the code calling it.
        for (caller, _, _), (_, _, own, _) in row[4].items():
            parts[_part(caller)] = parts.get(_part(caller), 0.0) + own
    total = sum(parts.values()) or 1.0
    return sorted(((name, own / total) for name, own in parts.items()), key=lambda x: -x[1])


def _part(filename: str) -> str:
    path = filename.replace("\\", "/")
    if "/pagedkv/spec/" in path:
        return "spec (manager, pool, hashing)"
    if "/pagedkv/harness/comparison.py" in path or "/pagedkv/harness/probes.py" in path:
        return "comparison (results, digests, full checks)"
    if "/pagedkv/harness/adapters.py" in path:
        return "snapshots and adapters"
    if "/pagedkv/harness/" in path:
        return "client and sampling (scheduling, records, coverage)"
    if "/pagedkv/vocab/" in path:
        return "vocabulary (argument checks, refusals, request)"
    if "/pagedkv/" in path:
        return "implementation (pagedkv)"
    return "the standard library (random, hashlib, ...)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="swarm steps per campaign")
    parser.add_argument("--machine-steps", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=30_000)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
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
        for name, measure in configurations:  # alternating: every round runs each once
            rates[name].append(cpu_rate(measure))
    print(
        f"pagedkv verify throughput: seed {SEED}, {args.steps:,} swarm steps "
        f"(about {args.machine_steps:,} machine steps) per campaign, median of {args.rounds} "
        "rounds, CPU time"
    )
    for name, values in rates.items():
        print(f"  {name:<40} {statistics.median(values):>9,.0f} steps/CPU-s")
    print(f"where a manager step's time goes (cProfile, {args.profile_steps:,} steps):")
    for part, share in where_the_time_goes(args.profile_steps):
        print(f"  {part:<56} {share:>5.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
