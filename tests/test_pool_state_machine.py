"""The block-pool hypothesis machine under pytest: spec vs pagedkv's BlockPool.

Run for pagedkv's semantics with misuse (invalid calls must raise the same error and change
nothing), and for vLLM 0.8.5 semantics with valid calls only. The machine draws the pool
client's operations (`pagedkv.harness.client`); the tests below check that it is not vacuous: it
reaches every operation and every refusal, and it fails on a pool that is wrong.
"""

from __future__ import annotations

import broken_pools
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.machines.pool import make_pool_machine
from pagedkv.harness.probes import pool_probe
from pagedkv.harness.protocol import PoolUnderTest
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.errors import NoFreeBlocksError
from pagedkv.vocab.semantics import VLLM_0_8_5

TestPagedKVPool = make_pool_machine(pagedkv_pool).TestCase
TestVllmConformantPool = make_pool_machine(
    pagedkv_pool, semantics=VLLM_0_8_5, misuse=False
).TestCase

POOL_OPERATIONS = {
    "get_new_blocks",
    "touch",
    "free_blocks",
    "cache_full_blocks",
    "get_cached_block",
    "reset_prefix_cache",
    "take_events",
}


def _outcomes(coverage: Coverage) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for operation, kind in coverage.outcomes:
        seen.setdefault(operation, set()).add(kind)
    return seen


@pytest.mark.slow
def test_the_machine_reaches_every_operation_and_every_refusal() -> None:
    coverage = Coverage()
    run_state_machine_as_test(
        make_pool_machine(pagedkv_pool, coverage=coverage),
        # derandomized under every profile: what the campaign reaches is a fixed-seed fact
        settings=settings(max_examples=150, derandomize=True, database=None),
    )
    seen = _outcomes(coverage)
    assert set(seen) >= POOL_OPERATIONS
    assert {"returned", "returned None"} <= seen["get_cached_block"]  # hits and misses
    assert {"NoFreeBlocksError", "InvalidArgumentError"} <= seen["get_new_blocks"]
    assert "BlockStateError" in seen["touch"]  # an id of no pool
    assert "BlockStateError" in seen["free_blocks"]  # already free, or twice in one call
    assert "InvalidArgumentError" in seen["cache_full_blocks"]
    assert "ArgumentTypeError" in seen["touch"]  # the value catalog
    assert coverage.counts["blocks cached"] > 0 and coverage.counts["cache hits"] > 0


@pytest.mark.slow
def test_the_vllm_machine_makes_valid_calls_only() -> None:
    """Without misuse every call must succeed: a matched error there would be a vacuous step."""
    coverage = Coverage()
    machine = make_pool_machine(pagedkv_pool, semantics=VLLM_0_8_5, misuse=False, coverage=coverage)
    run_state_machine_as_test(machine, settings=settings(max_examples=50))
    seen = _outcomes(coverage)
    assert coverage.steps > 0
    refused = {(op, kind) for op, kind in coverage.outcomes if not kind.startswith("returned")}
    assert not refused, refused
    assert "returned" in seen["get_cached_block"]


@pytest.mark.slow
def test_the_machine_fails_on_a_broken_pool() -> None:
    machine = make_pool_machine(broken_pools.touch_keeps_queued)
    with pytest.raises(Divergence, match=r"states differ|differs after the step"):
        run_state_machine_as_test(
            machine, settings=settings(settings.default, report_multiple_bugs=False)
        )


def _pair(same_messages: bool) -> ComparedPair[PoolUnderTest]:
    return ComparedPair(
        spec_pool(3, True, PAGEDKV_SEMANTICS),
        pagedkv_pool(3, True, PAGEDKV_SEMANTICS),
        pool_probe,
        check_every=1,
        same_messages=same_messages,
    )


def test_pagedkv_refusals_must_match_the_spec_word_for_word() -> None:
    """pagedkv's own pool is held to the spec's wording; a third party's only to the class."""
    spec_side: list[PoolUnderTest] = []

    def reworded(pool: PoolUnderTest) -> list[int]:
        if pool not in spec_side:
            raise NoFreeBlocksError(5, 1)  # the wrong free count
        return pool.get_new_blocks(5)

    for same_messages in (False, True):
        pair = _pair(same_messages)
        spec_side[:] = [pair.spec]
        _, error = pair.call("get_new_blocks", lambda pool: pool.get_new_blocks(5))
        assert isinstance(error, NoFreeBlocksError)
        if same_messages:
            with pytest.raises(Divergence, match="both raised NoFreeBlocksError, but the spec"):
                pair.call("get_new_blocks", reworded)
        else:
            assert isinstance(pair.call("get_new_blocks", reworded)[1], NoFreeBlocksError)


def test_a_divergence_says_what_kind_where_and_which_rule() -> None:
    """A shrinker keeps a shorter run only if it fails the same way: the signature says how."""
    pair = _pair(same_messages=True)
    pair.call("touch", lambda pool: pool.touch([1]) if pool is pair.spec else None)
    with pytest.raises(Divergence) as raised:
        pair.end_step()  # full mode: whole snapshots after the step
    assert raised.value.signature == ("state", "step", "free_order")
    pair = _pair(same_messages=True)
    with pytest.raises(Divergence) as raised:
        pair.call("get_usage", lambda pool: 0.5 if pool is pair.spec else 0.25)
    assert raised.value.signature == ("result", "get_usage", "")
    with pytest.raises(Divergence) as raised:
        pair.call("touch", lambda pool: pool.touch([9]) if pool is pair.spec else None)
    assert raised.value.signature == ("error class", "touch", "spec BlockStateError, impl returned")
