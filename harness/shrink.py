"""Shrinking a failing swarm run to a short sequence of operations that still fails.

1. The failing run's operations are replayed on smaller pools (2, 3, 4, 6, 8, ... blocks): the
   smallest on which they still fail replaces the run's pool (failures in pools of hundreds of
   blocks usually need a whole trip through the free queue, which a small pool makes short).
2. The operations are replayed in full mode (a full comparison after every step
   and an atomicity check on every failed call), which finds the first step at which the two
   sides differ; the operations after it are dropped.
3. Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing
   Input", TSE 2002) removes chunks of operations, then single ones, as long as a replay still
   fails: in the run's own comparison mode (fast; a full check at the end of every replay), or
   in full mode if that does not fail. Operations name their requests by index and clamp their
   sizes, so every subsequence executes (`harness/manager_ops.py`).
4. The result is replayed in full mode with every call logged, for the report.

Shrinking is bounded by a number of replays and by wall-clock time; the report says when a
bound cut it short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.swarm import Layer, Run, replay

MAX_REPLAYS = 3_000
MAX_SECONDS = 120.0


SMALLER_POOLS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Shrunk:
    """A failing run's shortest sequence found.

    Attributes:
        run: the run it fails in (the original, or the same on a smaller pool).
        ops: the operations, in order.
        calls: for each operation, the calls it made and their outcomes.
        error: what failed at the end (class and message).
        original_length: the operations the run executed before it failed.
        first_divergence: the step of the original run at which full mode saw it fail (0:
            full mode did not reproduce the failure).
        replays: replays spent.
        complete: delta debugging finished (no bound cut it short).
    """

    run: Run
    ops: tuple[Any, ...]
    calls: tuple[tuple[str, ...], ...]
    error: str
    original_length: int
    first_divergence: int
    replays: int
    complete: bool

    def render(self, indent: str = "  ") -> list[str]:
        """Numbered operations, each with its calls, then the error."""
        lines = []
        for number, (op, calls) in enumerate(zip(self.ops, self.calls, strict=False), 1):
            lines.append(f"{indent}{number}. {op!r}")
            lines += [f"{indent}     {call}" for call in calls]
        lines.append(f"{indent}error: {self.error}")
        return lines


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def shrink(
    layer: Layer,
    run: Run,
    ops: Sequence[Any],
    error: BaseException,
    *,
    max_replays: int = MAX_REPLAYS,
    max_seconds: float = MAX_SECONDS,
) -> Shrunk:
    """The shortest failing subsequence of `ops` that delta debugging finds (module docstring)."""
    deadline = time.monotonic() + max_seconds
    replays = 0
    for num_blocks in SMALLER_POOLS:
        if num_blocks >= run.num_blocks:
            break
        replays += 1
        smaller = run.with_num_blocks(num_blocks)
        if replay(layer, smaller, ops, check_every=smaller.check_every)[1] is not None:
            run = smaller
            break
    executed, full_error = replay(layer, run, ops)
    replays += 1
    current: list[Any] = list(ops)
    first = 0
    if full_error is not None:
        first = executed
        current = current[:executed]
    # Candidates are replayed in the run's own (fast) mode, a full check at their end; full
    # mode only if that does not fail (a divergence that the cadence would miss).
    check_every = run.check_every

    def fails(candidate: Sequence[Any]) -> bool:
        nonlocal replays
        replays += 1
        return replay(layer, run, candidate, check_every=check_every)[1] is not None

    complete = True
    if not fails(current):
        check_every = 1
    if check_every != 1 or full_error is not None:
        current, complete = _ddmin(
            current,
            fails,
            lambda: replays >= max_replays or time.monotonic() > deadline,
        )
    log: list[list[str]] = []
    _, final_error = replay(layer, run, current, log=log)
    replays += 1
    shown = describe_error(final_error or full_error or error)
    if final_error is None:
        shown += " (did not reproduce on replay)"
    return Shrunk(
        run,
        tuple(current),
        tuple(tuple(calls) for calls in log),
        shown,
        len(ops),
        first,
        replays,
        complete,
    )


def _ddmin(
    items: list[Any], fails: Callable[[Sequence[Any]], bool], out_of_budget: Callable[[], bool]
) -> tuple[list[Any], bool]:
    """Delta debugging: a 1-minimal failing subsequence of `items` (which must fail), unless
    the budget runs out first (then the shortest found, and False)."""
    granularity = 2
    while len(items) >= 2:
        if out_of_budget():
            return items, False
        size = -(-len(items) // granularity)
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        reduced = False
        for chunk in chunks:  # a chunk alone
            if len(chunks) > 1 and fails(chunk):
                items, granularity, reduced = chunk, 2, True
                break
        if not reduced:
            for index in range(len(chunks)):  # everything but one chunk
                rest = [op for other, c in enumerate(chunks) if other != index for op in c]
                if fails(rest):
                    items, granularity, reduced = rest, max(granularity - 1, 2), True
                    break
                if out_of_budget():
                    return items, False
        if not reduced:
            if granularity >= len(items):
                break
            granularity = min(len(items), 2 * granularity)
    return items, True
