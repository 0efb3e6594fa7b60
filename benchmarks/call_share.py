"""Where a campaign's CPU time goes: the calls it compares, against the harness around them.

A `Ledger` charges every CPU nanosecond of a run to one part: the spec's own calls, the
implementation's own calls (each side's part of every `ComparedPair.call` and `refused_call`,
through the protocol's adapter), or a part of the harness (sampling, the client, the
comparisons, snapshots, invariant checks, the request records, run set-up; anything else is
"other": the engine loop, and for a hypothesis machine, hypothesis itself). Each part's time is
exclusive: a snapshot taken inside a full check is the snapshot's, not the check's. Parts are
charged by wrapping methods of the harness classes for the duration of a measurement
(`charging`), so the campaign runs unchanged (the same operations, the same coverage).

The wrappers cost time themselves: two reads of the thread's CPU clock per entry. `calibrate`
measures, on a wrapped no-op, how much of that lands inside the entered part and how much in
the part it was entered from; each part's total is corrected by its entries and the entries
made from it. The shares are the corrected times over their sum; the run's CPU time without
the ledger is reported beside them, so the correction can be checked against it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagedkv.block_pool import BlockPool
from pagedkv.harness import adapters
from pagedkv.harness.client import manager as manager_client
from pagedkv.harness.client import pool as pool_client
from pagedkv.harness.client import requests
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.swarm import sampling
from pagedkv.manager import KVCacheManager
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.manager import SpecKVCacheManager

SPEC_CALLS = "calls: the spec"
IMPL_CALLS = "calls: the implementation"
CALLS = (SPEC_CALLS, IMPL_CALLS)
OTHER = "other (engine loop; hypothesis itself for a machine)"

CHARGED: list[tuple[Any, str, str]] = [
    (ComparedPair, "call", "comparison: each call's results"),
    (ComparedPair, "refused_call", "comparison: refused calls (atomicity)"),
    (ComparedPair, "end_step", "comparison: step digests"),
    (ComparedPair, "full_check", "comparison: full checks"),
    *(
        (cls, "snapshot", "snapshots")
        for cls in (
            adapters.SpecPoolAdapter,
            adapters.ObjectPoolAdapter,
            adapters.SpecManagerAdapter,
            adapters.ObjectManagerAdapter,
        )
    ),
    *(
        (cls, "check_invariants", "invariant checks")
        for cls in (
            SpecBlockPool,
            BlockPool,
            SpecKVCacheManager,
            KVCacheManager,
        )
    ),
    (sampling.ManagerSampler, "generate", "sampling"),
    (sampling.PoolSampler, "generate", "sampling"),
    (requests.RequestRecord, "check", "request records"),
    (requests.RequestRecord, "check_all", "request records"),
    (manager_client.ManagerClient, "execute", "client (scheduling, coverage)"),
    (pool_client.PoolClient, "execute", "client (scheduling, coverage)"),
    (manager_client.ManagerClient, "build", "run set-up"),
    (pool_client.PoolClient, "build", "run set-up"),
]
"""(class, method, part): every call of the method is charged to the part."""

clock = time.thread_time_ns


class Ledger:
    """CPU nanoseconds per part, exclusive; entries into each part and entries made from it."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.entries: dict[str, int] = {}
        self.children: dict[str, int] = {}
        self._stack = [OTHER]
        self._last = clock()

    def enter(self, part: str) -> None:
        now = clock()
        top = self._stack[-1]
        self.ns[top] = self.ns.get(top, 0) + now - self._last
        self.children[top] = self.children.get(top, 0) + 1
        self.entries[part] = self.entries.get(part, 0) + 1
        self._stack.append(part)
        self._last = now

    def leave(self) -> None:
        now = clock()
        top = self._stack.pop()
        self.ns[top] = self.ns.get(top, 0) + now - self._last
        self._last = now

    def close(self) -> None:
        """Charge the time since the last entry or exit to the part now running."""
        now = clock()
        top = self._stack[-1]
        self.ns[top] = self.ns.get(top, 0) + now - self._last
        self._last = now


@dataclass(frozen=True)
class Overhead:
    """What one entry and exit costs: `inside` lands in the entered part, `outside` in the part
    it was entered from (CPU nanoseconds)."""

    inside: float
    outside: float


def _charge(ledger: Ledger, part: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def charged(*args: Any, **kwargs: Any) -> Any:
        ledger.enter(part)
        try:
            return method(*args, **kwargs)
        finally:
            ledger.leave()

    return charged


def _sides(ledger: Ledger, pair: ComparedPair[Any], fn: Callable[[Any], Any]) -> Any:
    """`fn` charged to the side it is called on."""
    if getattr(fn, "charged_to_a_side", False):
        return fn

    def charged(side: Any) -> Any:
        ledger.enter(SPEC_CALLS if side is pair.spec else IMPL_CALLS)
        try:
            return fn(side)
        finally:
            ledger.leave()

    charged.charged_to_a_side = True  # type: ignore[attr-defined]
    return charged


@contextmanager
def charging(ledger: Ledger) -> Iterator[None]:
    """Within the block, every method of `CHARGED` charges its part, and each side's part of a
    compared call charges that side."""
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in CHARGED]
    call, refused_call = ComparedPair.call, ComparedPair.refused_call

    def split_call(
        pair: ComparedPair[Any], operation: str, fn: Any, label: Any = None
    ) -> tuple[Any, Exception | None]:
        return call(pair, operation, _sides(ledger, pair, fn), label)

    def split_refused(
        pair: ComparedPair[Any], operation: str, fn: Any, label: Any = None
    ) -> tuple[Any, Exception | None]:
        return refused_call(pair, operation, _sides(ledger, pair, fn), label)

    split = {"call": split_call, "refused_call": split_refused}
    try:
        for cls, name, part in CHARGED:
            method = split.get(name, getattr(cls, name)) if cls is ComparedPair else None
            wrapped = _charge(ledger, part, method or getattr(cls, name))
            setattr(cls, name, staticmethod(wrapped) if name == "build" else wrapped)
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


def calibrate(rounds: int = 5, calls: int = 20_000) -> Overhead:
    """The ledger's own cost per entry (the median round of wrapped no-ops)."""
    results = []
    for _ in range(rounds):
        ledger = Ledger()
        noop = _charge(ledger, "inside", lambda: None)
        start = clock()
        for _ in range(calls):
            noop()
        ledger.close()
        elapsed = clock() - start
        inside = ledger.ns.get("inside", 0) / calls
        results.append((inside, elapsed / calls - inside))
    results.sort()
    inside, outside = results[len(results) // 2]
    return Overhead(inside, outside)


@dataclass(frozen=True)
class Share:
    """One measured run: CPU nanoseconds per part (the ledger's cost taken out), its steps,
    and its CPU time without the ledger."""

    parts: dict[str, float]
    steps: int
    plain_ns: int

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def calls(self) -> float:
        """The share of the run spent in the two sides' own calls."""
        return sum(self.parts.get(part, 0.0) for part in CALLS) / self.total

    @property
    def harness_per_call(self) -> float:
        """The harness's time per unit of the calls' time (the goal: at most 0.5)."""
        calls = self.calls
        return (1 - calls) / calls if calls else float("inf")


def measure(run: Callable[[], int], overhead: Overhead) -> Share:
    """`run` (returns its steps) twice: plain, timed; then charged by a ledger."""
    start = time.process_time_ns()
    run()
    plain = time.process_time_ns() - start
    ledger = Ledger()
    with charging(ledger):
        steps = run()
    ledger.close()
    parts = {
        part: ns
        - ledger.entries.get(part, 0) * overhead.inside
        - ledger.children.get(part, 0) * overhead.outside
        for part, ns in ledger.ns.items()
    }
    return Share(parts, steps, plain)
