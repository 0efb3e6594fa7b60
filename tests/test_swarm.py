"""The swarm engine: reproducible runs, broken implementations caught and shrunk, replays exact."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import broken_managers
import broken_pools
import pytest
from hypothesis import strategies as st

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool, spec_manager
from pagedkv.harness.catalog_draws import SeededData
from pagedkv.harness.comparison import describe_difference
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.hostile_calls import MANAGER_HOSTILE_CALLS, POOL_HOSTILE_CALLS
from pagedkv.harness.lockstep import Divergence
from pagedkv.harness.manager_hostile import Scene
from pagedkv.harness.manager_ops import Admit, Arrive, Step
from pagedkv.harness.pool_driver import MISUSE
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest, PoolFactory
from pagedkv.harness.shrink import shrink
from pagedkv.harness.swarm import (
    Layer,
    execute_run,
    manager_layer,
    pool_layer,
    replay,
    run_campaign,
)
from pagedkv.harness.swarm_runs import draw_manager_run, draw_pool_run, run_seed


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
    ],
)
def test_a_broken_manager_is_caught_and_shrunk(factory: object, attention: str) -> None:
    layer = manager_layer(factory, attention=attention)  # type: ignore[arg-type]
    result = run_campaign(layer, seed=1, max_steps=50_000)
    failure = result.failure
    assert failure is not None
    shrunk = shrink(layer, failure.run, failure.ops, failure.error)
    assert shrunk.complete
    assert 1 <= len(shrunk.ops) <= 10, shrunk.render()
    assert shrunk.run.num_blocks <= failure.run.num_blocks
    assert replay(layer, shrunk.run, shrunk.ops)[1] is not None  # the shrunk run still fails
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
    """Core's catalog (`harness/hostile_calls.py`) is a swarm operation on both layers: each
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


def test_seeded_data_draws_only_what_hypothesis_would() -> None:
    data = SeededData(7)
    values = {data.draw(st.sampled_from((1, 2, 3)), label="x") for _ in range(50)}
    assert values == {1, 2, 3}
    assert SeededData(7).draw(st.sampled_from((1, 2, 3))) == SeededData(7).draw(
        st.sampled_from((1, 2, 3))
    )
    with pytest.raises(TypeError, match="sampled_from"):
        data.draw(st.integers())
    with pytest.raises(TypeError, match="sampled_from"):
        data.draw(st.sampled_from((1, 2)).map(str))


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

    args = ["--steps", "1000", "--hypothesis-steps", "100", "--rounds", "1"]
    assert bench_verify.main([*args, "--profile-steps", "1000"]) == 0
    report = capsys.readouterr().out
    assert "manager, swarm  " in report and "steps/CPU-s" in report
    assert "spec (manager, pool, hashing)" in report
