"""The swarm engine: reproducible runs, broken implementations caught and shrunk, replays exact."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from typing import ClassVar

import broken_managers
import broken_pools
import pytest

from pagedkv.block_pool import BlockPool
from pagedkv.cli import main
from pagedkv.harness.adapters import (
    ObjectManagerAdapter,
    ObjectPoolAdapter,
    pagedkv_manager,
    pagedkv_pool,
    spec_manager,
)
from pagedkv.harness.client.catalog import MANAGER_HOSTILE_CALLS, POOL_HOSTILE_CALLS, ManagerScene
from pagedkv.harness.client.hostile import Scene
from pagedkv.harness.client.manager_ops import Admit, Arrive, Step, TakeEvents
from pagedkv.harness.client.pool import MISUSE
from pagedkv.harness.client.pool_ops import TakeEvents as TakePoolEvents
from pagedkv.harness.comparison import describe_difference
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence, signature_of
from pagedkv.harness.domain import Domain
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest, PoolFactory, PoolUnderTest
from pagedkv.harness.swarm import (
    Layer,
    execute_run,
    manager_layer,
    pool_layer,
    replay,
    run_campaign,
)
from pagedkv.harness.swarm.runs import (
    MAX_DRAFTS,
    draw_manager_run,
    draw_pool_run,
    is_mamba_align,
    run_seed,
)
from pagedkv.harness.swarm.shrink import shrink
from pagedkv.manager import KVCacheManager
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
)
from pagedkv.vocab.kv_events import BlockRemoved, KVCacheEvent
from pagedkv.vocab.semantics import Semantics
from proofs.planted.catalog import VARIANTS_BY_NAME, planted


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)  # refused prefix-cache resets log a warning each
    yield
    logging.disable(logging.NOTSET)


def test_run_seeds_are_fixed_functions_of_campaign_seed_layer_and_index() -> None:
    """A seed printed in a report must name the same run in every process and version."""
    assert run_seed(2025, "manager", 0) == 7_098_989_252_853_240_242
    assert run_seed(2025, "manager", 1) != run_seed(2025, "manager", 0)
    assert run_seed(2025, "pool", 0) != run_seed(2025, "manager", 0)


def test_a_campaign_seed_reproduces_every_count() -> None:
    first = run_campaign(manager_layer(pagedkv_manager), seed=11, max_steps=4_000).coverage
    second = run_campaign(manager_layer(pagedkv_manager), seed=11, max_steps=4_000).coverage
    assert first.counts == second.counts
    assert first.histogram == second.histogram
    assert first.states == second.states
    assert (first.steps, first.runs) == (second.steps, second.runs)
    other = run_campaign(manager_layer(pagedkv_manager), seed=12, max_steps=4_000).coverage
    assert other.counts != first.counts


def test_runs_draw_small_and_large_pools_and_every_block_size() -> None:
    runs = [draw_manager_run(run_seed(5, "manager", index)) for index in range(400)]
    sizes = [run.num_blocks for run in runs]
    assert sum(size <= 16 for size in sizes) > len(runs) * 0.4  # small pools stay frequent
    assert max(sizes) > 200  # a few hundred blocks appear
    assert {run.block_size for run in runs} >= {1, 2, 4, 8, 16}
    assert {run.sliding_window is None for run in runs} == {True, False}
    assert all(run.weights.keys() >= {"arrive", "admit", "step"} for run in runs)
    assert len({frozenset(run.weights) for run in runs}) > 50  # swarm: many operation subsets
    assert len({run.features for run in runs}) > 50
    pools = [draw_pool_run(run_seed(5, "pool", index)) for index in range(100)]
    assert len({run.num_blocks for run in pools}) > 30


def test_a_recorded_run_replays_to_the_same_state() -> None:
    layer = manager_layer(pagedkv_manager)
    run = draw_manager_run(run_seed(3, "manager", 7), steps_per_run=300)
    ops, error = execute_run(layer, run, Coverage())
    assert error is None and len(ops) == 300
    log: list[list[str]] = []
    executed, error = replay(layer, run, ops, log=log)
    assert (executed, error) == (300, None)
    assert len(log) == 300 and any(log)


@pytest.mark.parametrize(
    ("factory", "attention"),
    [
        (broken_managers.forward_free, "full"),
        (broken_managers.no_last_block_rule, "full"),
        (broken_managers.window_off_by_one, "sliding"),
        (broken_managers.dense_despite_retention, "sliding"),
        (broken_managers.no_junction, "hybrid"),
    ],
)
def test_a_broken_manager_is_caught_and_shrunk(factory: object, attention: str) -> None:
    layer = manager_layer(factory, attention=attention)
    result = run_campaign(layer, seed=1, max_steps=50_000)
    failure = result.failure
    assert failure is not None
    shrunk = shrink(layer, failure.run, failure.ops, failure.error)
    assert shrunk.complete
    # A junction needs a prefix cached by one request, cut short for a second, kept for a third.
    max_ops = 16 if factory is broken_managers.no_junction else 10
    assert 1 <= len(shrunk.ops) <= max_ops, shrunk.render()
    assert shrunk.run.num_blocks <= failure.run.num_blocks
    failing = replay(layer, shrunk.run, shrunk.ops)[1]
    assert failing is not None  # the shrunk run still fails, and the same way
    assert (
        signature_of(failing)
        == shrunk.signature
        == signature_of(replay(layer, failure.run, failure.ops)[1])
    )
    assert "did not reproduce" not in shrunk.error
    assert any(shrunk.calls)  # every call of the minimal run is shown


@pytest.mark.parametrize(
    "factory",
    [broken_pools.free_to_head, broken_pools.touch_keeps_queued, broken_pools.eviction_keeps_hash],
)
def test_a_broken_pool_is_caught_and_shrunk(factory: PoolFactory) -> None:
    layer = pool_layer(factory)
    result = run_campaign(layer, seed=1, max_steps=50_000)
    failure = result.failure
    assert failure is not None
    shrunk = shrink(layer, failure.run, failure.ops, failure.error)
    assert 1 <= len(shrunk.ops) <= 10, shrunk.render()
    assert replay(layer, shrunk.run, shrunk.ops)[1] is not None


def test_shrinking_moves_a_large_pool_failure_to_a_small_pool() -> None:
    """Eviction needs a trip through the whole free queue: on 300 blocks, hundreds of calls."""
    layer = pool_layer(broken_pools.eviction_keeps_hash)
    runs = (draw_pool_run(run_seed(9, "pool", index)) for index in range(2_000))
    large = (run for run in runs if run.num_blocks >= 200 and run.enable_caching)
    failing = ((run, *execute_run(layer, run, Coverage())) for run in large)
    run, ops, error = next(found for found in failing if found[2] is not None)
    shrunk = shrink(layer, run, ops, error)
    assert shrunk.run.num_blocks <= 8
    assert len(shrunk.ops) < len(ops)


def _unobserved_probe_manager(config: ManagerConfig) -> ManagerUnderTest:
    """pagedkv's manager behind an adapter the probes do not know: digests come from
    snapshots."""

    class Forwarding:
        def __init__(self) -> None:
            self.inner = pagedkv_manager(config)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    return Forwarding()  # type: ignore[return-value]


def test_an_unknown_manager_is_compared_through_its_snapshots() -> None:
    result = run_campaign(manager_layer(_unobserved_probe_manager), seed=4, max_steps=3_000)
    assert result.failure is None
    assert result.coverage.counts["calls compared"] > 3_000


def test_the_hostile_call_catalog_is_a_plug_in() -> None:
    made: list[str] = []

    def free_twice(scene: Scene) -> None:
        made.append(scene.request.request_id)
        scene.refuse("free", "free(stranger)", lambda manager: manager.free(scene.request))

    layer = manager_layer(pagedkv_manager, hostile_calls={"free twice": free_twice})
    result = run_campaign(layer, seed=2, max_steps=5_000)
    assert result.failure is None
    assert made
    assert result.coverage.counts["hostile call free twice"] == len(made)


def test_the_swarm_draws_every_entry_of_the_state_machines_hostile_catalog() -> None:
    """Core's catalog (`harness/client/catalog.py`) is a swarm operation on both layers: each
    entry is made, refused alike by both sides, and counted as a typed error."""
    manager = run_campaign(manager_layer(pagedkv_manager), seed=3, max_steps=12_000)
    pool = run_campaign(pool_layer(pagedkv_pool), seed=3, max_steps=8_000)
    assert manager.failure is None and pool.failure is None
    counts = manager.coverage.counts
    for name in MANAGER_HOSTILE_CALLS:
        assert counts[f"hostile call catalog: {name}"] > 0, name
    assert counts["typed error ArgumentTypeError"] > 0
    assert counts["typed error FrozenRequestFieldError"] > 0
    assert any(key.startswith("refusal hostile catalog: ") for key in counts)
    assert pool.coverage.counts["typed error ArgumentTypeError"] > 0
    assert {f"catalog: {name}" for name in POOL_HOSTILE_CALLS} <= set(MISUSE)


def test_a_catalog_entry_makes_the_same_call_for_the_same_arg() -> None:
    """A recorded Hostile operation replays the same call: the entry's values come from a
    generator seeded by the operation's `arg`."""
    import random

    from pagedkv.vocab.request import Request

    scene = ManagerScene(Request("r", [0, 1]))
    for name, entry in MANAGER_HOSTILE_CALLS.items():
        shown = {entry(random.Random(arg), scene)[0] for arg in (5, 5, 5)}
        assert len(shown) == 1, name
    shown = {
        MANAGER_HOSTILE_CALLS["no Request at all"](random.Random(a), scene)[0] for a in range(40)
    }
    assert len(shown) > 5  # and other args make other calls


def test_full_mode_compares_whole_snapshots_after_every_step() -> None:
    layer = manager_layer(pagedkv_manager)
    run = draw_manager_run(run_seed(6, "manager", 2), steps_per_run=200)
    coverage = Coverage()
    ops, error = execute_run(layer, run, coverage, check_every=1)
    assert error is None
    assert coverage.counts["full checks"] >= len(ops)


def test_a_divergence_in_a_large_pool_is_shown_position_by_position() -> None:
    config = draw_manager_run(run_seed(1, "manager", 0)).config
    spec = spec_manager(config).snapshot()
    other = spec.pool.__class__(
        free_order=spec.pool.free_order[::-1],
        ref_cnt=spec.pool.ref_cnt,
        block_hash=spec.pool.block_hash,
        index=spec.pool.index,
        num_free_blocks=spec.pool.num_free_blocks,
        usage=spec.pool.usage,
    )
    text = describe_difference(spec.pool, other)
    assert text.startswith("  free_order[0]: spec 1, impl ")
    assert len(text.splitlines()) <= 7  # at most six positions, then a count


def test_ops_clamp_what_they_ask_for_so_any_subsequence_runs() -> None:
    layer = manager_layer(pagedkv_manager)
    run = draw_manager_run(run_seed(2, "manager", 0), steps_per_run=10)
    ops = [
        Step(which=5, chunk=99, drafts=(0, 0, 0), accepted=3, lookahead=99, token=0),  # no one
        Admit(which=3, chunk=0, lookahead=0),  # no one waits
        Arrive(
            (0, 1, 0, 1),
            share=4,
            share_len=999,
            share_keys=True,
            lora=None,
            mm=(),
            salt=None,
            logprobs=False,
        ),
        Admit(which=7, chunk=1, lookahead=99),
        Step(which=1, chunk=99, drafts=(1, 1, 1), accepted=2, lookahead=99, token=1),
    ]
    assert replay(layer, run, ops)[1] is None


def test_a_divergence_is_a_failure_of_the_run_not_of_the_engine() -> None:
    layer = manager_layer(broken_managers.forward_free, attention="full")
    result = run_campaign(layer, seed=1, max_steps=50_000)
    assert result.failure is not None
    assert isinstance(result.failure.error, Divergence)
    assert result.coverage.steps < 50_000  # it stopped at the failing run


def test_layers_are_named_for_their_seeds() -> None:
    layers: list[Layer] = [manager_layer(pagedkv_manager), pool_layer(pagedkv_pool)]
    assert [layer.name for layer in layers] == ["manager", "pool"]


def test_the_throughput_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_verify

    args = ["--steps", "1000", "--machine-steps", "100", "--rounds", "1"]
    assert bench_verify.main([*args, "--share-steps", "1000"]) == 0
    report = capsys.readouterr().out
    assert "manager, swarm  " in report and "steps/CPU-s" in report
    for layer in ("pool, swarm", "manager, swarm", "hybrid, swarm"):
        assert re.search(rf"{layer}\s+\d+%\s+\d+\.\d\d\s+(met|unmet)", report), layer
    assert re.search(r"manager, hypothesis machine \(anchor\)\s+\d+%", report)
    assert re.search(r"calls: the spec\s+[\d.]+%", report)
    assert "comparison: full checks" in report


# -- KV cache events ---------------------------------------------------------------------------


def test_old_seeds_draw_the_same_runs_with_the_events_flag_drawn_last() -> None:
    """Drawing the flag last left every other draw of every seed as it was (the strings are
    these runs' descriptions before events were drawn; "adopt", a pool operation added later,
    is drawn after the flag, for the same reason; so is the retention interval of a run with a
    sliding window, the last draw of all: pinned dense, the description is the old one)."""
    dense = Domain(retention_intervals=(None,))
    manager = draw_manager_run(run_seed(2025, "manager", 4), kv_events=True, domain=dense)
    assert manager.describe() == (
        "sliding window 7; 44 blocks; block size 2; max_model_len 4; caching; builtin; "
        "kv events; features: draft tokens, lora, salts; operations: admit, arrive, hostile, "
        "preempt, step"
    )
    assert draw_manager_run(run_seed(2025, "manager", 4), domain=dense).describe() == (
        "sliding window 7; 44 blocks; block size 2; max_model_len 4; caching; builtin; "
        "features: draft tokens, lora, salts; operations: admit, arrive, hostile, preempt, step"
    )
    drawn = draw_manager_run(run_seed(2025, "manager", 4))
    assert drawn.retention == 4
    assert drawn.describe() == manager.describe().replace(
        "builtin; kv events", "builtin; retention 4"
    )
    pool = draw_pool_run(run_seed(2025, "pool", 3), kv_events=True)
    assert pool.describe() == (
        "9 blocks; block size 1; caching; builtin; extra keys; kv events; operations: admit, "
        "adopt, cache_full_blocks, free everything, free_blocks, get_new_blocks, misuse, reset, "
        "touch"
    )
    managers_on = pools_on = 0
    for index in range(300):
        seed = run_seed(7, "manager", index)
        run = draw_manager_run(seed, kv_events=True)
        managers_on += run.kv_events
        config = dataclasses.replace(run.config, enable_kv_cache_events=False)
        assert dataclasses.replace(run, config=config) == draw_manager_run(seed)
        pool_run = draw_pool_run(seed, kv_events=True)
        pools_on += pool_run.kv_events
        assert dataclasses.replace(pool_run, kv_events=False) == draw_pool_run(seed)
    assert 75 <= managers_on <= 125 and 75 <= pools_on <= 125  # about a third


def test_a_run_with_events_on_takes_them_between_the_operations_it_makes_without() -> None:
    seed = run_seed(2025, "manager", 4)
    layer = manager_layer(pagedkv_manager)
    with_events = draw_manager_run(seed, steps_per_run=2_000, kv_events=True)
    coverage = Coverage()
    ops, error = execute_run(layer, with_events, coverage)
    assert error is None
    assert coverage.histogram["events on"] == 1
    for kind in ("BlockStored", "BlockRemoved"):
        assert coverage.counts[f"{kind} events taken"] > 0, kind
    without = draw_manager_run(seed, steps_per_run=2_000)
    plain, error = execute_run(layer, without, Coverage())
    assert error is None
    others = [op for op in ops if not isinstance(op, TakeEvents)]
    assert others == plain[: len(others)]
    # Taken often: the queue between two takes holds a few operations' events, never a run's.
    assert len(ops) - len(others) > 150
    gap = longest = 0
    for op in ops:
        gap = 0 if isinstance(op, TakeEvents) else gap + 1
        longest = max(longest, gap)
    assert longest < 100


class _RemovalsLostManager(ObjectManagerAdapter):
    def take_events(self) -> list[KVCacheEvent]:
        return [e for e in super().take_events() if not isinstance(e, BlockRemoved)]


class _RemovalsLostPool(ObjectPoolAdapter):
    def take_events(self) -> list[KVCacheEvent]:
        return [e for e in super().take_events() if not isinstance(e, BlockRemoved)]


class RemovalsLostInTakeManagers:
    """Managers whose take_events() drops every BlockRemoved (the queue and the state are
    right): only the comparison of the taken lists sees it. It says it emits events."""

    kv_events: ClassVar[bool] = True

    def __call__(self, config: ManagerConfig) -> ManagerUnderTest:
        return _RemovalsLostManager(config.build(KVCacheManager))


class RemovalsLostInTakePools:
    """The same for pools (a `KVEventPoolFactory`)."""

    kv_events: ClassVar[bool] = True

    def __call__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        semantics: Semantics,
        enable_kv_cache_events: bool = False,
    ) -> PoolUnderTest:
        pool = BlockPool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events)
        return _RemovalsLostPool(pool)


@pytest.mark.parametrize(
    "layer",
    [manager_layer(RemovalsLostInTakeManagers()), pool_layer(RemovalsLostInTakePools())],
    ids=["manager", "pool"],
)
def test_a_take_is_compared_list_for_list(layer: Layer) -> None:
    assert layer.kv_events
    result = run_campaign(layer, seed=1, max_steps=20_000)
    failure = result.failure
    assert failure is not None
    assert str(failure.error).startswith("take_events(): spec returned [")
    assert isinstance(failure.ops[-1], (TakeEvents, TakePoolEvents))
    shrunk = shrink(layer, failure.run, failure.ops, failure.error)
    assert 1 <= len(shrunk.ops) <= 10, shrunk.render()
    assert shrunk.error.startswith("Divergence: take_events(): spec returned [")


REMOVALS_LOST_IN_TAKE = RemovalsLostInTakeManagers()
"""For `pagedkv verify --manager-impl test_swarm:REMOVALS_LOST_IN_TAKE`."""


def test_verify_reads_the_events_flag_of_the_factory_it_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command line wraps a third-party factory (to report its errors as set-up errors):
    the flag is read from the factory itself."""
    args = ["verify", "--quiet", "--layer", "manager", "--seed", "1"]
    assert main([*args, "--manager-impl", "test_swarm:REMOVALS_LOST_IN_TAKE"]) == 1
    report = capsys.readouterr().out
    assert "kv events" in report.split("Failing run", 1)[1].splitlines()[0]
    assert "error: Divergence: take_events(): spec returned [" in report


def test_a_third_party_implementation_gets_events_only_when_it_says_it_emits_them() -> None:
    layers = [manager_layer(broken_managers.forward_free), pool_layer(broken_pools.free_to_head)]
    for layer in layers:
        assert not layer.kv_events
        assert not any(layer.draw(run_seed(2025, layer.name, i)).kv_events for i in range(60))
    assert manager_layer(pagedkv_manager).kv_events and pool_layer(pagedkv_pool).kv_events
    assert manager_layer(spec_manager).kv_events
    assert not manager_layer(pagedkv_manager, kv_events=False).kv_events


@pytest.mark.parametrize("variant", ["event_removed_per_block", "event_eviction_unannounced"])
@pytest.mark.parametrize("name", ["manager", "pool"])
def test_a_planted_event_bug_is_found_by_a_short_campaign_and_shrunk(
    variant: str, name: str
) -> None:
    # Without connector runs: their picks chain through more requests, so the first failing
    # run (seed 1) shrinks to 20 operations, not the few this test is about.
    layer = (
        manager_layer(pagedkv_manager, external_tokens=False)
        if name == "manager"
        else pool_layer(pagedkv_pool)
    )
    with planted(VARIANTS_BY_NAME[variant]):
        result = run_campaign(layer, seed=1, max_steps=20_000)
        failure = result.failure
        assert failure is not None
        assert failure.run.kv_events
        shrunk = shrink(layer, failure.run, failure.ops, failure.error)
    assert 1 <= len(shrunk.ops) <= 10, shrunk.render()
    assert "kv_events" in shrunk.error or "take_events()" in shrunk.error, shrunk.error


def test_a_free_queue_whose_links_loop_is_a_broken_invariant_not_an_endless_walk() -> None:
    """A queue corrupted by a bug (touch_keeps_queued leaves a block linked) can loop; the
    snapshot walks at most the pool's size and names the broken invariant (it once grew a list
    until the machine ran out of memory)."""
    pool = BlockPool(6, enable_caching=True)
    adapter = ObjectPoolAdapter(pool)
    assert adapter.snapshot().free_order == (1, 2, 3, 4, 5)
    queue = pool.free_block_queue
    queue.free_list_tail.next_free_block = queue.free_list_head  # 5 -> 1: the links loop
    with pytest.raises(InvariantViolation, match="block 1 is reached twice from the head"):
        adapter.snapshot()


def test_models_of_state_layers_only_are_the_last_draw_of_a_manager_run() -> None:
    """A manager that serves Mamba groups gets, in some single-group runs drawn with caching
    off (no EAGLE, gate or connector), one Mamba group alone (`mamba_alone`), its pool holding
    one to `max_live` requests' states and the null block; every other run is drawn as for a
    manager that does not."""
    flags = {"evict_blocks": True, "external_tokens": True, "full_sequence_gate": True}
    alone = 0
    for index in range(400):
        seed = run_seed(2025, "manager", index)
        run = draw_manager_run(seed, mamba_groups=True, **flags)
        before = draw_manager_run(seed, **flags)
        groups = run.config.kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, MambaSpec):
            assert run == before
            continue
        alone += 1
        assert len(groups) == 1 and spec.page_size_padded is None
        assert spec.block_size == run.config.max_model_len
        assert not (run.config.enable_caching or run.config.use_eagle)
        assert not (run.full_sequence_gate or run.external_tokens)
        per_request = spec.blocks_per_request
        assert per_request < run.config.kv_cache_config.num_blocks
        assert run.config.kv_cache_config.num_blocks <= per_request * run.max_live + 1
        assert dataclasses.replace(run, config=before.config) == before
    assert 4 <= alone <= 25  # half of the ~5% of runs eligible


def test_mamba_align_hybrids_are_the_last_draw_of_a_hybrid_run() -> None:
    """A manager that serves Mamba prefix caching gets, in some hybrid runs drawn with caching
    on (no EAGLE, gate or connector), one full-attention group and one or two Mamba groups in
    mode "align" of its block size (`with_mamba_align`), with scheduler steps; in about half of
    those whose block size exceeds a step's drafts, each Mamba group has that many speculative
    blocks, draft tokens are on and lookahead stays as drawn, in the others neither; every other
    run is drawn as for a manager that does not."""
    flags = {
        "evict_blocks": True,
        "external_tokens": True,
        "full_sequence_gate": True,
        "mamba_groups": True,
        "deferred_frees": True,
        "offload_tier": True,
    }
    align = drafting = 0
    for index in range(400):
        seed = run_seed(2025, "hybrid", index)
        run = draw_manager_run(seed, attention="hybrid", mamba_align=True, **flags)
        before = draw_manager_run(seed, attention="hybrid", **flags)
        if not is_mamba_align(run.config):
            assert run == before
            continue
        align += 1
        specs = run.specs
        assert isinstance(specs[0], FullAttentionSpec)
        assert 2 <= len(specs) <= 3
        speculative = {spec.num_speculative_blocks for spec in specs[1:]}
        assert speculative in ({0}, {MAX_DRAFTS})
        for spec in specs[1:]:
            assert isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
            assert spec.block_size == specs[0].block_size
            assert spec.page_size_bytes == specs[0].page_size_bytes
        assert run.config.enable_caching and not run.config.use_eagle
        assert not (run.full_sequence_gate or run.external_tokens or run.offload_tier)
        if speculative == {MAX_DRAFTS}:
            drafting += 1
            assert specs[0].block_size > MAX_DRAFTS
            assert run.features == before.features | {"draft tokens"}
        else:
            assert run.features == before.features - {"draft tokens", "lookahead"}
        assert run.weights.pop("new step") >= 1 and run.weights == before.weights
        assert run.config.max_model_len == before.config.max_model_len
        assert run.num_blocks == before.num_blocks
    assert 12 <= align <= 45  # a quarter of the ~28% of hybrid runs eligible
    assert 3 <= drafting <= align // 2 + 5  # half of those whose blocks exceed 3 tokens


def test_mixed_block_sizes_are_the_last_draw_of_a_hybrid_run() -> None:
    """A manager that serves groups of several block sizes with caching gets them in some
    hybrid runs drawn with caching on (no EAGLE or connector): each attention group 1, 2 or 4
    times the drawn block size, chunked groups at their LCM S; every other run, and every other
    draw of those, is as for a manager that does not."""
    flags = {
        "attention": "hybrid",
        "kv_events": True,
        "evict_blocks": True,
        "mamba_groups": True,
        "full_sequence_gate": True,
        "external_tokens": True,
        "deferred_frees": True,
        "offload_tier": True,
    }
    mixed = 0
    for index in range(400):
        seed = run_seed(2025, "hybrid", index)
        run = draw_manager_run(seed, mixed_block_sizes=True, **flags)
        before = draw_manager_run(seed, **flags)
        kv_cache_config = run.config.kv_cache_config
        if len(set(kv_cache_config.block_sizes)) == 1 or not run.config.enable_caching:
            assert run == before
            continue
        mixed += 1
        assert not (run.config.use_eagle or run.external_tokens)
        base = before.config.kv_cache_config.block_sizes[0]
        scheduler_size = kv_cache_config.scheduler_block_size
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            if isinstance(spec, ChunkedLocalAttentionSpec):
                assert spec.block_size == scheduler_size
            else:
                assert spec.block_size // base in (1, 2, 4)
        assert len(kv_cache_config.kv_cache_groups) == len(
            before.config.kv_cache_config.kv_cache_groups
        )
        assert dataclasses.replace(run, config=before.config) == before
    assert 40 <= mixed <= 110  # half of the ~37% of hybrid runs eligible


def test_mixed_block_sizes_are_drawn_only_under_semantics_that_serve_them() -> None:
    """A manager offering several block sizes gets them in its hybrid layer under `pagedkv`,
    `vllm-0.33` and `vllm-0.32` only: under any other semantics (a switch flipped, as the
    conformance tests flip one) the managers refuse them, so the layer does not draw them."""
    from pagedkv.harness.adapters import pagedkv_manager
    from pagedkv.harness.swarm import manager_layer
    from pagedkv.vocab.semantics import SEVERAL_BLOCK_SIZES_SEMANTICS, VLLM_0_33

    for semantics in SEVERAL_BLOCK_SIZES_SEMANTICS:
        layer = manager_layer(pagedkv_manager, semantics=semantics, attention="hybrid")
        assert layer.mixed_block_sizes

    def mixed_with_caching(layer: Layer, seed: int) -> bool:
        config = layer.draw(seed).config
        return config.enable_caching and len(set(config.kv_cache_config.block_sizes)) > 1

    served = manager_layer(pagedkv_manager, semantics=VLLM_0_33, attention="hybrid")
    assert any(mixed_with_caching(served, seed) for seed in range(200))
    flipped = dataclasses.replace(VLLM_0_33, deferred_free_flattened=False)
    layer = manager_layer(pagedkv_manager, semantics=flipped, attention="hybrid")
    assert not layer.mixed_block_sizes
    assert not any(mixed_with_caching(layer, seed) for seed in range(200))
