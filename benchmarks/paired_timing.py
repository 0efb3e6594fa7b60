"""CPU time of two competitors on the same work, in alternating rounds, compared by paired medians.

On a shared machine wall-clock time measures the neighbours as much as the code, so each run is
timed with `time.process_time_ns` (this process's CPU time). A round times both competitors, each
on freshly prepared state (preparation is not timed), and which one goes first alternates from
round to round, so drifts in machine load fall on both. The ratio is taken within each round and
its median reported; garbage collection is run before and disabled during each timed run.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

Run = Callable[[], object]
Prepare = Callable[[], tuple[Run, Callable[[object], None]]]
"""Builds fresh state untimed; returns the run to time and a check of its result (untimed)."""


@dataclass(frozen=True)
class Paired:
    """CPU nanoseconds per round of a baseline and a contender, `ops` operations per run."""

    baseline_ns: tuple[int, ...]
    contender_ns: tuple[int, ...]
    ops: int

    @property
    def ratios(self) -> list[float]:
        return [c / b for b, c in zip(self.baseline_ns, self.contender_ns, strict=True)]

    @property
    def ratio(self) -> float:
        """Median over rounds of contender / baseline time: below 1, the contender is faster."""
        return statistics.median(self.ratios)

    def minus(self, overhead: Paired) -> Paired:
        """These times less the median of `overhead`'s, side by side (the cost of a harness)."""
        baseline = statistics.median(overhead.baseline_ns)
        contender = statistics.median(overhead.contender_ns)
        return Paired(
            tuple(round(ns - baseline) for ns in self.baseline_ns),
            tuple(round(ns - contender) for ns in self.contender_ns),
            self.ops,
        )

    @property
    def baseline_ns_per_op(self) -> float:
        return statistics.median(self.baseline_ns) / self.ops

    @property
    def contender_ns_per_op(self) -> float:
        return statistics.median(self.contender_ns) / self.ops


def time_once(prepare: Prepare) -> int:
    """CPU nanoseconds of one run on fresh state; its result is checked afterwards."""
    run, check = prepare()
    gc.collect()
    gc.disable()
    try:
        start = time.process_time_ns()
        result = run()
        elapsed = time.process_time_ns() - start
    finally:
        gc.enable()
    check(result)
    return elapsed


def paired_rounds(baseline: Prepare, contender: Prepare, rounds: int, ops: int) -> Paired:
    """Time both competitors `rounds` times, alternating which goes first."""
    baseline_ns: list[int] = []
    contender_ns: list[int] = []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            baseline_ns.append(time_once(baseline))
            contender_ns.append(time_once(contender))
        else:
            contender_ns.append(time_once(contender))
            baseline_ns.append(time_once(baseline))
    return Paired(tuple(baseline_ns), tuple(contender_ns), ops)
