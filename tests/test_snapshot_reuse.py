"""`ComparedPair` reads each unchanged state once: a snapshot taken by a refused call or a full
check is reused by the next one while no call ran in between, and the checks still catch what
they caught when every check read the state afresh."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.probes import pool_probe
from pagedkv.harness.protocol import PoolUnderTest
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.errors import ArgumentTypeError, NoFreeBlocksError


class Counted:
    """A side whose snapshots are counted."""

    def __init__(self, side: Any) -> None:
        self.side = side
        self.snapshots = 0

    def snapshot(self) -> Any:
        self.snapshots += 1
        return self.side.snapshot()

    def __getattr__(self, name: str) -> Any:
        if name == "side":  # a copy under construction has none yet
            raise AttributeError(name)
        return getattr(self.side, name)


def _pair(check_every: int = 1) -> tuple[ComparedPair[Any], Counted, Counted]:
    spec = Counted(spec_pool(4, True, PAGEDKV_SEMANTICS))
    impl = Counted(pagedkv_pool(4, True, PAGEDKV_SEMANTICS))
    pair: ComparedPair[Any] = ComparedPair(
        spec, impl, pool_probe, check_every=check_every, same_messages=True
    )
    return pair, spec, impl


def _too_many(pool: PoolUnderTest) -> list[int]:
    return pool.get_new_blocks(9)


def test_a_refused_call_after_a_full_check_reads_each_side_once() -> None:
    pair, spec, impl = _pair()
    pair.full_check("the start")
    assert (spec.snapshots, impl.snapshots) == (1, 1)
    _, error = pair.call("get_new_blocks", _too_many)  # full mode: a refused call
    assert isinstance(error, NoFreeBlocksError)
    assert (spec.snapshots, impl.snapshots) == (2, 2)  # "after" only: "before" is the check's
    pair.full_check("the step")  # nothing ran since the refusal's "after"
    assert (spec.snapshots, impl.snapshots) == (2, 2)


def test_a_call_that_returns_makes_the_next_check_read_again() -> None:
    pair, spec, impl = _pair()
    pair.full_check("the start")
    assert pair.call("get_new_blocks", lambda pool: pool.get_new_blocks(1))[0] == [1]
    reads = spec.snapshots, impl.snapshots
    pair.full_check("the step")
    assert (spec.snapshots, impl.snapshots) == (reads[0] + 1, reads[1] + 1)


def test_a_cadence_call_makes_the_next_refusal_read_before_it() -> None:
    """Off full mode a call is not checked for atomicity, so it may have changed either side
    even when it raised: the snapshots of before it are not reused after it."""
    pair, spec, impl = _pair(check_every=100)
    pair.full_check("the start")
    _, error = pair.call("get_new_blocks", _too_many)  # compared, not snapshotted
    assert isinstance(error, NoFreeBlocksError)
    assert (spec.snapshots, impl.snapshots) == (1, 1)
    pair.refused_call("get_new_blocks", _too_many)
    assert (spec.snapshots, impl.snapshots) == (3, 3)  # before and after, read afresh


def test_a_failed_call_that_changes_the_impl_is_caught_with_reused_snapshots() -> None:
    pair, _, _ = _pair()
    pair.full_check("the start")

    def leaks_then_refuses(pool: PoolUnderTest) -> None:
        if pool is pair.impl:
            pool.get_new_blocks(1)  # a change the refusal must not make
        raise ArgumentTypeError("num_blocks", "an int", "x")

    with pytest.raises(Divergence) as raised:
        pair.call("get_new_blocks", leaks_then_refuses)
    assert raised.value.signature[0] == "atomicity"


def test_a_state_that_differs_is_caught_by_a_full_check_on_reused_snapshots() -> None:
    """The reused snapshots are of both sides: a full check compares them with each other."""
    pair, _, _ = _pair()
    pair.impl.get_new_blocks(1)  # behind the pair's back, before any snapshot
    _, error = pair.call("get_new_blocks", lambda pool: pool.get_new_blocks("two"))
    assert isinstance(error, ArgumentTypeError)  # refused alike; its snapshots are reused below
    with pytest.raises(Divergence) as raised:
        pair.full_check("the step")
    assert raised.value.signature[0] == "state"


def test_a_copy_of_a_pair_reads_its_own_sides() -> None:
    """The exhaustive search copies pairs: a copy's checks read the copies' states."""
    pair, _, _ = _pair()
    pair.full_check("the start")
    twin = copy.deepcopy(pair)
    twin.impl.get_new_blocks(1)  # only the copy's impl; the original's snapshots stay true
    with pytest.raises(Divergence):
        twin.full_check("the step")
    pair.full_check("the step")
