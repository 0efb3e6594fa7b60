"""The swarm campaign engine: seeded runs, spec and implementation in lock-step, until a budget.

A campaign is a sequence of runs. Run i's seed is `run_seed(campaign_seed, layer, i)`; from it
come the run's configuration, features and operation weights (`harness/swarm/runs.py`) and the
stream its operations are drawn from, so a campaign seed reproduces every run and a run seed
reproduces one run. Each run builds a fresh client over a fresh spec and a fresh object under
test (`harness/client/`), samples its operations (`harness/swarm/sampling.py`) and has the client
execute them, comparing as `harness/comparison.py` schedules, and ends with a full check. The
campaign stops when it has run `max_steps` steps (it finishes the run in progress) or
`max_seconds` have passed, or at the first failure, which `pagedkv verify` shrinks
(`harness/swarm/shrink.py`).

The budget in steps, not seconds, is what makes coverage independent of CPU speed: a campaign
with a fixed seed and step count runs the same operations on every machine.

KV cache events are drawn on (in about a third of the runs) only for an implementation that can
emit them: pagedkv's own and the spec's, or a factory that says so with a `kv_events` attribute
set to True (a pool factory then takes `enable_kv_cache_events` as a fourth argument, as
`KVEventPoolFactory`; a manager factory gets it in `ManagerConfig`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool, spec_manager, spec_pool
from pagedkv.harness.client.hostile import HOSTILE_CALLS, HostileCall
from pagedkv.harness.client.manager import ManagerClient
from pagedkv.harness.client.pool import PoolClient
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage, Target
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.protocol import ManagerFactory, PoolFactory
from pagedkv.harness.swarm.runs import (
    ManagerRun,
    PoolRun,
    draw_manager_run,
    draw_pool_run,
    run_seed,
)
from pagedkv.harness.swarm.sampling import ManagerSampler, PoolSampler
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.semantics import SEVERAL_BLOCK_SIZES_SEMANTICS, Semantics

OPS_STREAM = 0x9E3779B97F4A7C15
"""Mixed into a run's seed for the stream its operations are drawn from (its configuration is
drawn from the seed itself), so that changing how operations are drawn leaves configurations."""


class Client(Protocol):
    """What the engine needs of a layer's client."""

    @property
    def pair(self) -> ComparedPair[Any]: ...

    def execute(self, op: Any) -> None: ...

    def finish_run(self) -> None: ...


class Sampler(Protocol):
    """What the engine needs of a layer's sampler."""

    def generate(self, rng: random.Random, client: Any) -> Any: ...


Run = ManagerRun | PoolRun


@dataclass(frozen=True)
class Layer:
    """One layer the engine can drive: how to draw a run, and how to build its client and the
    sampler of its operations.

    Attributes:
        name: "pool", "manager" or "hybrid" (part of every run seed).
        draw: run seed -> the run.
        client: (run, coverage, check_every override or None) -> a fresh client.
        sampler: run -> the sampler of its operations.
        kv_events: whether some runs turn KV cache events on.
        evict_blocks: whether some runs call `evict_blocks` (a manager layer).
        mamba_groups: whether some runs have Mamba groups (beside attention groups in the hybrid
            layer, alone in the manager layer).
        full_sequence_gate: whether some runs admit through the full-sequence gate.
        cache_blocks: whether runs with draft tokens call `cache_blocks` after each output.
        external_tokens: whether some runs play a KV connector (external tokens at admission).
        deferred_frees: whether those runs defer some frees (`pop_blocks_for_free`).
        offload_tier: whether some of those runs keep a CPU offload tier behind the connector.
        mamba_align: whether some hybrid runs cache Mamba states (`mamba_cache_mode="align"`).
        mixed_block_sizes: whether some hybrid runs with caching have groups of several block
            sizes.
    """

    name: str
    draw: Callable[[int], Run]
    client: Callable[[Any, Coverage, int | None], Client]
    sampler: Callable[[Any], Sampler]
    kv_events: bool = False
    evict_blocks: bool = False
    mamba_groups: bool = False
    full_sequence_gate: bool = False
    cache_blocks: bool = False
    external_tokens: bool = False
    deferred_frees: bool = False
    offload_tier: bool = False
    mamba_align: bool = False
    mixed_block_sizes: bool = False


def offers_kv_events(factory: object) -> bool:
    """Whether `factory`'s pools or managers can emit KV cache events (module docstring)."""
    own = (pagedkv_manager, spec_manager, pagedkv_pool, spec_pool)
    return factory in own or getattr(factory, "kv_events", False) is True


def offers_evict_blocks(factory: object) -> bool:
    """Whether `factory`'s managers have `evict_blocks` (vLLM 0.33's, a KV connector's call):
    pagedkv's and the spec's, or a factory that says so with an `evict_blocks` attribute that
    is True (a manager that wraps pagedkv's for other checks, such as the proof's
    `model_checked_manager`, does not, and is not sent it)."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "evict_blocks", False) is True


def offers_mamba_groups(factory: object) -> bool:
    """Whether `factory`'s managers serve Mamba groups (`MambaSpec`, mode "none", caching off,
    next to attention groups of another block size): pagedkv's and the spec's, or a factory
    that says so with a `mamba_groups` attribute that is True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "mamba_groups", False) is True


def offers_mamba_align(factory: object) -> bool:
    """Whether `factory`'s managers serve Mamba prefix caching (`MambaSpec` in mode "align",
    caching on, beside full attention of the same block size) and have `new_step_starts`:
    pagedkv's and the spec's, or a factory that says so with a `mamba_align` attribute that is
    True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "mamba_align", False) is True


def offers_full_sequence_gate(factory: object) -> bool:
    """Whether `factory`'s managers take `allocate_slots(..., full_sequence_must_fit=True)` and
    a `max_in_flight_tokens` constructor argument (vLLM 0.33's admission gate): pagedkv's and
    the spec's, or a factory that says so with a `full_sequence_must_fit` attribute that is
    True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "full_sequence_must_fit", False) is True


def offers_cache_blocks(factory: object) -> bool:
    """Whether `factory`'s managers have `cache_blocks(request, num_computed_tokens)` (vLLM
    0.33's, which its scheduler calls after each output when it decodes speculatively):
    pagedkv's and the spec's, or a factory that says so with a `cache_blocks` attribute that is
    True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "cache_blocks", False) is True


def offers_external_tokens(factory: object) -> bool:
    """Whether `factory`'s managers take a KV connector's external tokens
    (`allocate_slots(..., num_external_computed_tokens=n, delay_cache_blocks=b)`, vLLM 0.33's)
    and have `cache_blocks` (an async load lands through it): pagedkv's and the spec's, or a
    factory that says so with an `external_tokens` attribute that is True and offers
    `cache_blocks`."""
    own = (pagedkv_manager, spec_manager)
    if factory in own:
        return True
    return getattr(factory, "external_tokens", False) is True and offers_cache_blocks(factory)


def offers_deferred_frees(factory: object) -> bool:
    """Whether `factory`'s managers have `pop_blocks_for_free` and `free_popped_blocks` (vLLM
    0.33's deferred frees: its scheduler pops a request's blocks while a step in flight may
    read them and releases them once that step is processed): pagedkv's and the spec's, or a
    factory that says so with a `deferred_frees` attribute that is True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "deferred_frees", False) is True


def offers_offload_tier(factory: object) -> bool:
    """Whether `factory`'s managers keep a CPU offload tier behind their KV connector
    (`attach_offload_tier`, cleared by `reset_prefix_cache`): pagedkv's and the spec's, or a
    factory that says so with an `offload_tier` attribute that is True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "offload_tier", False) is True


def offers_mixed_block_sizes(factory: object) -> bool:
    """Whether `factory`'s managers serve groups of several block sizes with prefix caching
    (docs/semantics.md, "Several block sizes with caching"): pagedkv's and the spec's, or a
    factory that says so with a `mixed_block_sizes` attribute that is True."""
    own = (pagedkv_manager, spec_manager)
    return factory in own or getattr(factory, "mixed_block_sizes", False) is True


def manager_layer(
    factory: ManagerFactory,
    *,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    attention: str = "both",
    steps_per_run: int | None = None,
    hostile_calls: Mapping[str, HostileCall] = HOSTILE_CALLS,
    kv_events: bool | None = None,
    domain: Domain = FULL_DOMAIN,
    evict_blocks: bool | None = None,
    mamba_groups: bool | None = None,
    full_sequence_gate: bool | None = None,
    cache_blocks: bool | None = None,
    external_tokens: bool | None = None,
    deferred_frees: bool | None = None,
    offload_tier: bool | None = None,
    mamba_align: bool | None = None,
    mixed_block_sizes: bool | None = None,
) -> Layer:
    """The request-level manager layer, checking `factory`'s managers on `domain`; `kv_events`
    (default: `offers_kv_events(factory)`) says whether they can emit KV cache events,
    `evict_blocks` (default: `offers_evict_blocks(factory)`) whether they have `evict_blocks`,
    `mamba_groups` (default: `offers_mamba_groups(factory)`) whether they serve Mamba groups,
    `full_sequence_gate` (default: `offers_full_sequence_gate(factory)`) whether they take the
    full-sequence admission gate, `cache_blocks` (default: `offers_cache_blocks(factory)`)
    whether they have `cache_blocks` (then runs with draft tokens call it after each output),
    `external_tokens` (default: `offers_external_tokens(factory)`) whether they take a KV
    connector's external tokens (then a third of the runs play a connector), `deferred_frees`
    (default: `offers_deferred_frees(factory)`) whether they defer frees (then a connector
    run pops a third of its frees and releases them at the next step), `offload_tier`
    (default: `offers_offload_tier(factory)`) whether they keep a CPU offload tier behind the
    connector (then half the connector runs with caching have one), `mamba_align` (default:
    `offers_mamba_align(factory)`) whether they serve Mamba prefix caching (then some hybrid
    runs with caching on have Mamba groups in mode "align": `with_mamba_align`),
    `mixed_block_sizes` (default: `offers_mixed_block_sizes(factory)`) whether they serve
    groups of several block sizes with caching (then half the other hybrid runs with caching,
    without EAGLE or a connector, have them).
    With `attention="hybrid"` it is the hybrid layer (named "hybrid": its runs have seeds of
    their own): configurations of 2 to `domain.max_groups` KV cache groups."""
    events = offers_kv_events(factory) if kv_events is None else kv_events
    evict = offers_evict_blocks(factory) if evict_blocks is None else evict_blocks
    mamba = offers_mamba_groups(factory) if mamba_groups is None else mamba_groups
    gate = offers_full_sequence_gate(factory) if full_sequence_gate is None else full_sequence_gate
    caches = offers_cache_blocks(factory) if cache_blocks is None else cache_blocks
    external = offers_external_tokens(factory) if external_tokens is None else external_tokens
    deferred = offers_deferred_frees(factory) if deferred_frees is None else deferred_frees
    tier = offers_offload_tier(factory) if offload_tier is None else offload_tier
    align = offers_mamba_align(factory) if mamba_align is None else mamba_align
    mixed = offers_mixed_block_sizes(factory) if mixed_block_sizes is None else mixed_block_sizes
    # only under semantics the managers serve them with (a flipped switch's are refused)
    mixed = mixed and attention == "hybrid" and domain.max_groups > 1
    mixed = mixed and semantics in SEVERAL_BLOCK_SIZES_SEMANTICS
    return Layer(
        "hybrid" if attention == "hybrid" else "manager",
        lambda seed: draw_manager_run(
            seed,
            semantics=semantics,
            misuse=misuse,
            attention=attention,
            steps_per_run=steps_per_run,
            kv_events=events,
            domain=domain,
            evict_blocks=evict,
            mamba_groups=mamba,
            full_sequence_gate=gate,
            external_tokens=external,
            deferred_frees=deferred,
            offload_tier=external and tier,
            mamba_align=align,
            mixed_block_sizes=mixed,
        ),
        lambda run, coverage, check_every: _manager_client(
            run, factory, coverage, check_every, hostile_calls, caches
        ),
        lambda run: ManagerSampler(run, tuple(hostile_calls)),
        events,
        evict,
        mamba,
        gate,
        caches,
        external,
        external and deferred,
        external and tier,
        align,
        mixed,
    )


def _manager_client(
    run: ManagerRun,
    factory: ManagerFactory,
    coverage: Coverage,
    check_every: int | None,
    hostile_calls: Mapping[str, HostileCall],
    cache_blocks: bool = False,
) -> ManagerClient:
    coverage.start_run(run.histogram_keys())
    return ManagerClient.build(
        run.config,
        factory,
        coverage,
        check_every=check_every or run.check_every,
        hostile_calls=hostile_calls,
        domain=run.domain,
        full_sequence_gate=run.full_sequence_gate,
        cache_after_output=cache_blocks and "draft tokens" in run.features,
        external_tokens=run.external_tokens,
        offload_tier=run.offload_tier,
    )


def pool_layer(
    factory: PoolFactory,
    *,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    steps_per_run: int | None = None,
    kv_events: bool | None = None,
    domain: Domain = FULL_DOMAIN,
) -> Layer:
    """The block-pool layer, checking `factory`'s pools on `domain`; `kv_events` (default:
    `offers_kv_events(factory)`) says whether it is a `KVEventPoolFactory`."""
    events = offers_kv_events(factory) if kv_events is None else kv_events
    return Layer(
        "pool",
        lambda seed: draw_pool_run(
            seed,
            semantics=semantics,
            misuse=misuse,
            steps_per_run=steps_per_run,
            kv_events=events,
            domain=domain,
        ),
        lambda run, coverage, check_every: _pool_client(run, factory, coverage, check_every),
        PoolSampler,
        events,
    )


def _pool_client(
    run: PoolRun, factory: PoolFactory, coverage: Coverage, check_every: int | None
) -> PoolClient:
    coverage.start_run(run.histogram_keys())
    return PoolClient.build(
        factory,
        coverage,
        num_blocks=run.num_blocks,
        enable_caching=run.enable_caching,
        semantics=run.semantics,
        kv_events=run.kv_events,
        block_size=run.block_size,
        hash_algo=run.hash_algo,
        check_every=check_every or run.check_every,
        domain=run.domain,
    )


@dataclass(frozen=True)
class RunFailure:
    """A run that failed: which, after which operations, and why.

    Attributes:
        run: the run (its seed reproduces it).
        index: its index in the campaign.
        ops: the operations executed, the failing one last (none: set-up failed).
        error: the exception.
    """

    run: Run
    index: int
    ops: tuple[Any, ...]
    error: BaseException


def execute_run(
    layer: Layer, run: Run, coverage: Coverage, check_every: int | None = None
) -> tuple[list[Any], BaseException | None]:
    """Draw and execute `run`'s operations; (the operations executed, the error or None)."""
    ops: list[Any] = []
    try:
        client = layer.client(run, coverage, check_every)
    except Exception as error:  # the factory failed
        return ops, error
    try:
        rng = random.Random(run.seed ^ OPS_STREAM)
        generate, execute = layer.sampler(run).generate, client.execute
        for _ in range(run.num_steps):
            op = generate(rng, client)
            ops.append(op)
            execute(op)
        client.finish_run()
    except Exception as error:
        return ops, error
    finally:
        pair = client.pair
        coverage.counts["calls compared"] += pair.calls
        coverage.counts["full checks"] += pair.full_checks
    return ops, None


def replay(
    layer: Layer,
    run: Run,
    ops: Sequence[Any],
    *,
    check_every: int = 1,
    log: list[list[str]] | None = None,
) -> tuple[int, BaseException | None]:
    """Execute recorded operations on a fresh pair (full mode by default): (how many executed,
    the error or None). With `log`, each operation's calls are appended as one list."""
    coverage = Coverage()
    try:
        client = layer.client(run, coverage, check_every)
    except Exception as error:
        return 0, error
    for number, op in enumerate(ops):
        calls: list[str] = []
        if log is not None:
            client.pair.log = calls
            log.append(calls)
        try:
            client.execute(op)
        except Exception as error:
            return number + 1, error
    try:
        client.finish_run()
    except Exception as error:
        return len(ops), error
    return len(ops), None


@dataclass(frozen=True)
class Campaign:
    """One campaign `verify` runs: a layer, what it checks, its budget and its targets.

    Attributes:
        title: what the report calls it ("block pool", "KV cache manager").
        impl: the implementation checked, as the user named it.
        layer: what the swarm engine drives.
        semantics: the spec's semantics.
        misuse: whether invalid calls are made.
        domain: what the implementation supports.
        steps: the budget.
        targets: the coverage targets.
        flags: the options that rebuild the campaign (the report's replay command).
    """

    title: str
    impl: str
    layer: Layer
    semantics: Semantics
    misuse: bool
    domain: Domain
    steps: int
    targets: tuple[Target, ...]
    flags: str

    @property
    def modes(self) -> frozenset[str]:
        """What the coverage targets may assume ("misuse", "pagedkv semantics", "kv events",
        "sparse retention", "evict_blocks", "mamba groups", "full-sequence gate",
        "cache_blocks", "external tokens", "deferred frees", "offload tier", "mamba align",
        "mixed block sizes", "partial prefix keys")."""
        modes = {"misuse"} if self.misuse else set()
        if self.domain.draws_sparse_retention:
            modes.add("sparse retention")
        if self.semantics == PAGEDKV_SEMANTICS:
            modes.add("pagedkv semantics")
        if self.layer.kv_events:
            modes.add("kv events")
        if self.layer.evict_blocks:
            modes.add("evict_blocks")
        if self.layer.mamba_groups and (self.layer.name == "manager" or self.domain.max_groups > 1):
            modes.add("mamba groups")
        if self.layer.mamba_align and self.layer.name == "hybrid" and self.domain.max_groups > 1:
            modes.add("mamba align")
        if self.layer.full_sequence_gate:
            modes.add("full-sequence gate")
        if self.layer.cache_blocks:
            modes.add("cache_blocks")
        if self.layer.external_tokens:
            modes.add("external tokens")
        if self.layer.deferred_frees:
            modes.add("deferred frees")
        if self.layer.offload_tier:
            modes.add("offload tier")
        if self.layer.mixed_block_sizes:
            modes.add("mixed block sizes")
            if self.semantics.partial_prefix_keys:
                modes.add("partial prefix keys")
        return frozenset(modes)


@dataclass
class CampaignRun:
    """A campaign's outcome.

    Attributes:
        layer: "pool", "manager" or "hybrid".
        seed: the campaign seed.
        coverage: what it exercised.
        cpu_seconds: CPU time spent running (shrinking excluded).
        wall_seconds: wall-clock time spent running (shrinking excluded).
        failure: the first failing run, or None.
    """

    layer: str
    seed: int
    coverage: Coverage
    cpu_seconds: float
    wall_seconds: float
    failure: RunFailure | None

    @property
    def steps_per_cpu_second(self) -> float:
        return self.coverage.steps / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


def run_campaign(
    layer: Layer,
    *,
    seed: int,
    max_steps: int,
    max_seconds: float | None = None,
    check_every: int | None = None,
    progress: Callable[[Coverage], None] | None = None,
) -> CampaignRun:
    """Run `layer`'s runs from `seed` until `max_steps` steps (the last run completes) or
    `max_seconds` of wall-clock time, or the first failure (not shrunk here)."""
    coverage = Coverage()
    start_cpu, start_wall = time.process_time(), time.monotonic()
    last_progress = start_wall
    index = 0
    failure = None
    while coverage.steps < max_steps:
        now = time.monotonic()
        if max_seconds is not None and now - start_wall >= max_seconds:
            break
        if progress is not None and now - last_progress >= 0.1:
            last_progress = now
            progress(coverage)
        run = layer.draw(run_seed(seed, layer.name, index))
        ops, error = execute_run(layer, run, coverage, check_every)
        if error is not None:
            failure = RunFailure(run, index, tuple(ops), error)
            break
        index += 1
    return CampaignRun(
        layer.name,
        seed,
        coverage,
        time.process_time() - start_cpu,
        time.monotonic() - start_wall,
        failure,
    )
