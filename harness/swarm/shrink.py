"""Shrinking a failing swarm run to a short sequence of operations that fails the same way.

A shrunk run must fail the same way as the run it came from: with the same divergence kind, in
the same operation, breaking the same rule (`harness.comparison.signature_of`). Every replay is
in full mode (a full comparison after every step and an atomicity check on every failed call),
so the failure found is the first one, and shrinking cannot trade it for another: a replay that
fails differently, a harness error among them, does not count as failing.

1. The run is replayed in full mode: its failure there, at the first step the two sides differ,
   is the one to keep (its signature); the operations after it are dropped.
2. The operations are replayed on smaller pools (2, 3, 4, 6, 8, ... blocks): the smallest on
   which they fail the same way replaces the run's pool (failures in pools of hundreds of blocks
   usually need a whole trip through the free queue, which a small pool makes short).
3. Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing
   Input", TSE 2002) removes chunks of operations, then single ones, as long as a replay still
   fails the same way. Operations name their requests by index and clamp their sizes, so every
   subsequence executes (`harness/client/manager_ops.py`). Steps 2 and 3 repeat while a
   shorter sequence fails alike on a smaller pool.
4. The result is replayed with every call logged, for the report.

Shrinking is bounded by a number of replays and by wall-clock time; the report says when a
bound cut it short. A run whose failure is a harness error is not shrunk: it is a bug of the
harness, reported with its traceback (`harness/swarm/report.py`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.divergence import Signature, signature_of
from pagedkv.harness.swarm.engine import Layer, Run, replay

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
        signature: the failure's kind, operation and rule, the same for the run it came from.
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
    signature: Signature
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
    """The shortest subsequence of `ops` that delta debugging finds failing the same way
    (module docstring)."""
    deadline = time.monotonic() + max_seconds
    replays = 1
    executed, full_error = replay(layer, run, ops)
    reference = full_error if full_error is not None else error
    wanted = signature_of(reference)
    current: list[Any] = list(ops[:executed]) if full_error is not None else list(ops)
    first = executed if full_error is not None else 0

    def fails_alike(candidate_run: Run, candidate: Sequence[Any]) -> bool:
        nonlocal replays
        replays += 1
        failure = replay(layer, candidate_run, candidate)[1]
        return failure is not None and signature_of(failure) == wanted

    def out_of_budget() -> bool:
        return replays >= max_replays or time.monotonic() > deadline

    def smallest_pool(candidate: Sequence[Any]) -> Run | None:
        for num_blocks in SMALLER_POOLS:
            if num_blocks >= run.num_blocks or out_of_budget():
                return None
            smaller = run.with_num_blocks(num_blocks)
            if fails_alike(smaller, candidate):
                return smaller
        return None

    complete = True
    smaller = smallest_pool(current)
    run = smaller or run
    if fails_alike(run, current):
        while True:  # a shorter run may fail on a smaller pool, and a smaller pool shorten it
            current, complete = _ddmin(current, functools.partial(fails_alike, run), out_of_budget)
            smaller = smallest_pool(current) if complete else None
            if smaller is None:
                break
            run = smaller
    log: list[list[str]] = []
    _, final_error = replay(layer, run, current, log=log)
    replays += 1
    shown = describe_error(final_error or reference)
    if final_error is None:
        shown += " (did not reproduce on replay)"
    elif signature_of(final_error) != wanted:
        shown += f" (the run failed as {describe_error(reference)})"
    return Shrunk(
        run,
        tuple(current),
        tuple(tuple(calls) for calls in log),
        shown,
        wanted,
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
