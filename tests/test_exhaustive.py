"""Exhaustive state search (proofs/exhaustive/): the CI scope passes, planted bugs fail.

Every configuration of the `ci` scope is searched completely, the implementation in lock-step
with the spec. Each broken pool and manager must fail with the shortest trace, whose length is
known here (breadth-first order makes the first failure found a shortest one).
"""

from __future__ import annotations

import dataclasses

import broken_managers
import broken_pools
import pytest

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.protocol import ManagerFactory, PoolFactory
from pagedkv.spec.block_state import BlockState, state_of
from proofs.exhaustive import explore as exhaustive
from proofs.exhaustive.explore import MANAGER_SCOPES, POOL_SCOPES, explore_manager, explore_pool
from proofs.exhaustive.fingerprint import canonical, fingerprint
from proofs.exhaustive.manager_world import (
    ManagerSearchConfig,
    ManagerWorld,
    RequestKeys,
    initial_manager_world,
)
from proofs.exhaustive.pool_world import PoolSearchConfig, PoolWorld
from proofs.exhaustive.search import SearchResult
from proofs.planted.catalog import VARIANTS_BY_NAME, planted

POOL = PoolSearchConfig(3, 1, ((0, 0), (0, 1)))
FULL = ManagerSearchConfig(4, 1, 4, ((0, 1), (0, 1, 1)))
WINDOW = ManagerSearchConfig(4, 1, 5, ((0, 1), (0, 1, 1)), sliding_window=2, samples=(0,))
BUSY = ManagerSearchConfig(4, 1, 5, ((0, 1), (0, 1, 1)))  # both requests may run at once
SPECULATIVE = ManagerSearchConfig(
    4, 1, 4, ((0,), (0, 1)), samples=(0,), drafts=(0, 1), lookaheads=(0, 1)
)


def _failure(result: SearchResult) -> tuple[tuple[str, ...], str]:
    assert result.failure is not None, result.summary()
    return result.failure.trace, result.failure.error


# -- the CI scope passes ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", POOL_SCOPES["ci"], ids=lambda config: config.name)
def test_ci_pool_configuration_has_no_divergence(config: PoolSearchConfig) -> None:
    result = explore_pool(pagedkv_pool, config)
    assert result.ok, result.failure.render() if result.failure else result.summary()
    assert result.states > 1
    assert result.transitions >= result.states - 1


@pytest.mark.slow
@pytest.mark.parametrize("config", MANAGER_SCOPES["ci"], ids=lambda config: config.name)
def test_ci_manager_configuration_has_no_divergence(config: ManagerSearchConfig) -> None:
    result = explore_manager(pagedkv_manager, config)
    assert result.ok, result.failure.render() if result.failure else result.summary()
    assert result.states > 1


# -- the search reaches the states that matter ------------------------------------------------


def test_pool_search_reaches_every_block_state() -> None:
    """Free, free+cached, in use, in use+cached and shared blocks all occur in a 3-block pool."""
    seen: set[BlockState] = set()

    def visit(world: PoolWorld) -> None:
        state = world.pair.state
        for block_id in range(1, POOL.num_blocks):
            seen.add(state_of(state.ref_cnt[block_id], state.block_hash[block_id] is not None))

    assert explore_pool(pagedkv_pool, POOL, visit=visit).ok
    assert seen == set(BlockState)


def test_window_search_reaches_states_holding_null_blocks() -> None:
    """max_model_len is long enough that a request keeps running after a block left its window."""
    with_nulls = 0

    def visit(world: ManagerWorld) -> None:
        nonlocal with_nulls
        with_nulls += any(
            0 in group for groups in world.pair.state.blocks.values() for group in groups
        )

    assert explore_manager(pagedkv_manager, WINDOW, visit=visit).ok
    assert with_nulls > 0


def test_manager_search_reaches_shared_blocks_and_preemption() -> None:
    """Two requests run at once sharing cached blocks; a request is preempted after sampling."""
    shared = preempted = 0

    def visit(world: ManagerWorld) -> None:
        nonlocal shared, preempted
        shared += max(world.pair.state.pool.ref_cnt) >= 2
        preempted += any(
            not live.running and live.record.num_tokens > len(live.record.prompt)
            for live in world.client.live
        )

    assert explore_manager(pagedkv_manager, BUSY, visit=visit).ok
    assert shared > 0
    assert preempted > 0


def test_drafts_and_lookahead_reach_states_plain_steps_do_not() -> None:
    """Rejected drafts and lookahead slots leave blocks reserved past the tokens; accepted
    drafts advance a request by two tokens at once."""
    plain = dataclasses.replace(SPECULATIVE, drafts=(0,), lookaheads=(0,))
    with_drafts = dataclasses.replace(SPECULATIVE, lookaheads=(0,))
    counts = [explore_manager(pagedkv_manager, c).states for c in (plain, with_drafts)]
    assert counts[0] < counts[1]


@pytest.mark.parametrize(
    ("keys", "shared"),
    [
        ((RequestKeys(lora_id=1), RequestKeys(lora_id=1)), True),
        ((RequestKeys(lora_id=1), RequestKeys(lora_id=2)), False),
        ((RequestKeys(cache_salt="tenant-1"), None), False),
        ((RequestKeys(mm=((0, 1, "img-a"),)), RequestKeys(mm=((0, 1, "img-b"),))), False),
    ],
)
def test_extra_keys_decide_whether_equal_tokens_share_blocks(
    keys: tuple[RequestKeys | None, ...], shared: bool
) -> None:
    config = ManagerSearchConfig(4, 1, 5, ((0, 1), (0, 1, 1)), samples=(0,), keys=keys)
    most = 0

    def visit(world: ManagerWorld) -> None:
        nonlocal most
        most = max(most, *world.pair.state.pool.ref_cnt)

    assert explore_manager(pagedkv_manager, config, visit=visit).ok
    assert (most >= 2) == shared


# -- the merge key holds the implementation's whole state -------------------------------------


def test_equal_states_reached_in_other_orders_have_one_fingerprint() -> None:
    first: dict[str, object] = {"a": [1, 2], "b": (3, (4,))}
    second: dict[str, object] = {"b": (3, (4,)), "a": [1, 2]}
    assert fingerprint(first) == fingerprint(second)
    assert fingerprint({1, 2, 3}) == fingerprint({3, 2, 1})


def test_aliasing_of_mutable_objects_counts_and_of_immutable_values_does_not() -> None:
    shared = [0]
    assert canonical([shared, shared]) != canonical([[0], [0]])
    value = (1, (2,))
    assert canonical([value, value]) == canonical([(1, (2,)), (1, (2,))])


def test_hidden_state_of_the_implementation_changes_the_merge_key() -> None:
    """Two worlds whose managers agree on every snapshot but differ inside are not merged."""
    world = initial_manager_world(pagedkv_manager, FULL)
    twin = world.load(world.dump(), world.pair.state)
    assert twin.key() == world.key()
    manager = twin.pair.impl.manager  # type: ignore[attr-defined]
    manager.hidden_counter = 1  # invisible to snapshot(), visible to the search
    assert twin.pair.impl.snapshot() == world.pair.impl.snapshot()
    assert twin.key() != world.key()


# -- planted bugs fail with the shortest trace -------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "last"),
    [
        ("drafts_as_full_blocks", "step(r0, t=0, d=1, a=0)"),  # a draft's block is cached
        ("lookahead_ignored", "admit(r0, t=0, la=1)"),  # the lookahead slot gets no block
    ],
)
def test_issue_10_planted_bugs_fail_the_speculative_search(variant: str, last: str) -> None:
    with planted(VARIANTS_BY_NAME[variant]):
        trace, _ = _failure(explore_manager(pagedkv_manager, SPECULATIVE))
    assert trace[-1] == last
    assert len(trace) <= 2


@pytest.mark.parametrize(
    ("factory", "shortest", "symptom"),
    [
        (broken_pools.free_to_head, ("get_new_blocks(1)", "free_blocks([1])"), "free_order"),
        (broken_pools.touch_keeps_queued, ("touch([1])",), "free_order"),
        # cache a block, free it, reuse it: at least 4 calls, since it must be evicted.
        (
            broken_pools.eviction_keeps_hash,
            (
                "get_new_blocks(1)",
                "cache_full_blocks(p0, [1], stored=0, num_cached=0, num_full=1)",
                "free_blocks([1])",
                "get_new_blocks(2)",
            ),
            "index",
        ),
    ],
)
def test_broken_pool_fails_with_shortest_trace(
    factory: PoolFactory, shortest: tuple[str, ...], symptom: str
) -> None:
    trace, error = _failure(explore_pool(factory, POOL))
    assert trace == shortest
    assert symptom in error


@pytest.mark.parametrize(
    ("factory", "config", "length", "last", "symptom"),
    [
        # r1's prompt reaches max_model_len after its first token: it finishes, freed head first.
        (broken_managers.forward_free, FULL, 1, "admit(r1, t=0)", "free_order"),
        # r1 finishes with every block cached; r0's prompt is r1's prefix, fully cached.
        (broken_managers.no_last_block_rule, FULL, 2, "admit(r0, t=0)", "get_computed_blocks"),
        # the first decode step after the prompt drops a block still inside the window.
        (broken_managers.window_off_by_one, WINDOW, 2, "step(r0, t=0)", "blocks"),
    ],
)
def test_broken_manager_fails_with_shortest_trace(
    factory: ManagerFactory, config: ManagerSearchConfig, length: int, last: str, symptom: str
) -> None:
    trace, error = _failure(explore_manager(factory, config))
    assert len(trace) == length
    assert trace[-1] == last
    assert symptom in error


def test_failure_replays_every_call_of_the_trace() -> None:
    result = explore_pool(broken_pools.eviction_keeps_hash, POOL)
    assert result.failure is not None
    calls = result.failure.calls
    assert len(calls) == len(result.failure.trace)
    assert calls[-1] == ("get_new_blocks(2) returned [2, 1]",)
    rendered = result.failure.render()
    assert "shortest failing trace (4 steps):" in rendered
    assert "  4. get_new_blocks(2)" in rendered
    assert "did not reproduce" not in rendered


# -- the command line ------------------------------------------------------------------------


def test_cli_exits_0_and_reports_counts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(POOL_SCOPES, "ci", (POOL,))
    monkeypatch.setitem(MANAGER_SCOPES, "ci", (FULL,))
    assert exhaustive.main([]) == 0
    out = capsys.readouterr().out
    assert f"{POOL.name}: ok:" in out
    assert f"{FULL.name}: ok:" in out
    assert "exhaustive search, scope ci: ok: 2 configurations" in out


def test_cli_exits_1_with_the_trace_of_a_broken_pool(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(POOL_SCOPES, "ci", (POOL,))
    assert exhaustive.main(["--layer", "pool", "--impl", "broken_pools:free_to_head"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert "  2. free_blocks([1])" in out


def test_cli_exits_1_when_the_state_limit_stops_a_search(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(MANAGER_SCOPES, "ci", (FULL,))
    assert exhaustive.main(["--layer", "manager", "--max-states", "10"]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
