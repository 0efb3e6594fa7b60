"""Seeded runs of the CPU offload tier: the spec and another tier, side by side.

`run_pair(seed, config, other, num_steps)` draws a scheduler's calls from `random.Random(seed)`
(the same calls for the same seed) and makes each on `pagedkv.spec.offload`'s tier and on
`other`: stores completed at once, failed or left pending, loads of ready keys completed at
once or later, touches, lookups, finished requests, resets, taken events. Only calls a scheduler
makes are drawn (no misuse: vLLM asserts or corrupts on it), so a tier that refuses one
diverges. Answers are compared at every call, whole snapshots after every step; the first
divergence ends the run.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedkv.spec.offload import SpecOffloadTier
from pagedkv.vocab.offload import (
    LookupResult,
    OffloadEvent,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    OffloadTierSnapshot,
    StoreOutput,
    make_offload_key,
)

NUM_BLOCKS = 6
NUM_GROUPS = 2
BLOCK_TOKENS = 4
KEYS = [make_offload_key(bytes([b]) * 2, g) for b in range(NUM_BLOCKS) for g in range(NUM_GROUPS)]


class TierUnderTest(Protocol):
    """The calls a tier under test answers (pagedkv's, the spec's, vLLM's through an adapter)."""

    def lookup(self, key: OffloadKey, request: OffloadRequest) -> LookupResult: ...
    def prepare_load(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> tuple[int, ...]: ...
    def complete_load(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None: ...
    def touch(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None: ...
    def prepare_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> StoreOutput | None: ...
    def complete_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None: ...
    def on_request_finished(self, request: OffloadRequest) -> None: ...
    def reset_cache(self) -> None: ...
    def take_events(self) -> list[OffloadEvent]: ...
    def snapshot(self) -> OffloadTierSnapshot: ...
    def check_invariants(self) -> None: ...


@dataclass
class RunReport:
    """What one seeded run did, and where it first diverged (None: it never did)."""

    seed: int
    config: OffloadTierConfig
    num_steps: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    divergence: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "policy": self.config.policy,
            "num_chunks": self.config.num_chunks,
            "store_threshold": self.config.store_threshold,
            "max_tracker_size": self.config.max_tracker_size,
            "steps": self.num_steps,
            "calls": dict(sorted(self.calls.items())),
            "divergence": self.divergence,
        }


class Divergence(AssertionError):
    """The two tiers answered one call differently, or ended a step in different states."""


class _Pair:
    def __init__(self, other: TierUnderTest, config: OffloadTierConfig, report: RunReport) -> None:
        self.spec = SpecOffloadTier(config)
        self.other = other
        self.report = report
        self.target: object = None  # ARC's adaptive target after the last step

    def call(self, name: str, *args: Any) -> Any:
        ours = getattr(self.spec, name)(*args)
        theirs = getattr(self.other, name)(*args)
        calls = self.report.calls
        calls[name] += 1
        if ours != theirs:
            raise Divergence(f"{name}{args!r}: spec {ours!r}, other {theirs!r}")
        if isinstance(ours, StoreOutput) and ours.evicted_keys:
            calls["prepare_store evicting"] += 1
        if isinstance(ours, StoreOutput) and args[0] and not ours.keys_to_store:
            calls["prepare_store with every key held already"] += 1
        if name == "prepare_store" and ours is None:
            calls["prepare_store refused room"] += 1
        if name == "complete_store" and len(args) > 2 and args[2] is False:
            calls["complete_store failed"] += 1
        if isinstance(ours, LookupResult):
            calls[f"lookup answered {ours.name}"] += 1
        if name == "reset_cache":
            self.target = None  # a reset zeroes ARC's target: no ghost hit
        return ours

    def compare_states(self) -> None:
        self.spec.check_invariants()
        self.other.check_invariants()
        ours, theirs = self.spec.snapshot(), self.other.snapshot()
        target = dict(ours.policy).get("target")
        if target is not None and self.target is not None and target != self.target:
            self.report.calls["ARC target adapted (a ghost hit)"] += 1
        self.target = target
        if ours != theirs:
            differing = [
                name
                for name in ours.__dataclass_fields__
                if getattr(ours, name) != getattr(theirs, name)
            ]
            raise Divergence(f"states differ in {differing}: spec {ours!r}, other {theirs!r}")


MOVES = (
    "store",
    "complete_store",
    "load",
    "complete_load",
    "touch",
    "lookup",
    "finish",
    "reset",
    "events",
)
WEIGHTS = (30, 8, 14, 6, 6, 8, 8, 1, 4)


class _Scheduler:
    """The scheduler's side of a run: live requests, and the transfers it has in flight."""

    def __init__(self, rng: random.Random, pair: _Pair) -> None:
        self.rng = rng
        self.pair = pair
        self.live: list[OffloadRequest] = []
        self.placing: dict[str, str] = {}
        self.stores: list[tuple[OffloadRequest, list[OffloadKey]]] = []
        self.loads: list[tuple[OffloadRequest, list[OffloadKey]]] = []
        self.count = 0

    def request(self) -> OffloadRequest:
        """A live request; now and then a new one (at most four live)."""
        if not self.live or (len(self.live) < 4 and self.rng.random() < 0.1):
            self.live.append(OffloadRequest(f"r{self.count}"))
            self.placing[self.live[-1].req_id] = self.rng.choice(["all", "all", "none", "group 0"])
            self.count += 1
        return self.rng.choice(self.live)

    def placed(self, req: OffloadRequest, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Place `keys` in `req` (all, none, or group 0's) before they are passed."""
        how = self.placing[req.req_id]
        for key in keys:
            if how == "all" or (how == "group 0" and key[-1] == 0):
                req.place(key, (key[0] + 1) * BLOCK_TOKENS)
        return keys

    def store(self) -> None:
        rng, req = self.rng, self.request()
        keys = self.placed(req, rng.sample(KEYS, rng.randint(0, 3)))
        out = self.pair.call("prepare_store", keys, req)
        if out is not None and out.keys_to_store:
            then = rng.choice(["complete", "complete", "fail", "later"])
            if then == "later":
                self.stores.append((req, list(out.keys_to_store)))
            else:
                self.pair.call("complete_store", list(out.keys_to_store), req, then == "complete")

    def complete_store(self) -> None:
        if self.stores:
            req, keys = self.stores.pop(self.rng.randrange(len(self.stores)))
            self.pair.call("complete_store", keys, req, self.rng.random() < 0.8)

    def load(self) -> None:
        rng, req = self.rng, self.request()
        drawn = [rng.choice(KEYS) for _ in range(rng.randint(1, 4))]
        ready = [k for k in drawn if self.pair.spec.lookup(k, req) is LookupResult.HIT]
        if ready:
            self.pair.call("prepare_load", self.placed(req, ready), req)
            if rng.random() < 0.5:
                self.loads.append((req, ready))
            else:
                self.pair.call("complete_load", ready, req)

    def complete_load(self) -> None:
        if self.loads:
            req, keys = self.loads.pop(self.rng.randrange(len(self.loads)))
            self.pair.call("complete_load", keys, req)

    def touch(self) -> None:
        keys = [self.rng.choice(KEYS) for _ in range(self.rng.randint(0, 3))]
        self.pair.call("touch", keys, self.request())

    def lookup(self) -> None:
        self.pair.call("lookup", self.rng.choice(KEYS), self.request())

    def finish(self) -> None:
        req = self.request()
        self.pair.call("on_request_finished", req)
        self.live.remove(req)

    def reset(self) -> None:
        self.pair.call("reset_cache")
        self.stores, self.loads = [], []  # completions of older jobs never come (vLLM's rule)

    def events(self) -> None:
        self.pair.call("take_events")


def run_pair(
    seed: int,
    config: OffloadTierConfig,
    other: Callable[[OffloadTierConfig], TierUnderTest],
    num_steps: int,
) -> RunReport:
    """Run `num_steps` steps drawn from `seed` on the spec and `other(config)`."""
    rng = random.Random(seed)
    report = RunReport(seed, config)
    scheduler = _Scheduler(rng, _Pair(other(config), config, report))
    try:
        for _ in range(num_steps):
            report.num_steps += 1
            getattr(scheduler, rng.choices(MOVES, weights=WEIGHTS)[0])()
            scheduler.pair.compare_states()
    except Divergence as divergence:
        report.divergence = f"step {report.num_steps}: {divergence}"
    return report
