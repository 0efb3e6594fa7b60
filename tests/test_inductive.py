"""The inductive proofs (proofs/inductive/): proved for every size, tied to the code by a
lock-step run, and failing as they must when the model or the invariant is planted wrong."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping
from typing import Any

import pytest
import z3

from pagedkv.cli import main as pagedkv_main
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.semantics import VLLM_0_8_5, VLLM_0_33, Semantics
from proofs.inductive import __main__ as cli
from proofs.inductive import pool_model
from proofs.inductive.algebra import CONCRETE, Table
from proofs.inductive.manager_executable import model_checked_manager
from proofs.inductive.manager_model import INVARIANTS as MANAGER_INVARIANTS
from proofs.inductive.manager_proof import MANAGER
from proofs.inductive.pool_executable import ModelPool, model_pool
from proofs.inductive.pool_model import INVARIANTS, PoolParams, PoolState
from proofs.inductive.pool_proof import POOL, STEPS
from proofs.inductive.prover import prove
from proofs.inductive.symbolic import KEY, Symbolic

MODEL = "proofs.inductive.pool_executable:model_pool"


def test_every_obligation_is_proved_for_every_size(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m proofs.inductive`: the pool's and the manager's invariants, every obligation
    (init, every step and conjunct, the batch and queue lemmas), with a symbolic size."""
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "88/88 obligations proved" in out
    assert "84/84 obligations proved" in out
    assert out.splitlines()[-1].startswith("proved:")


def test_the_proof_is_not_vacuous() -> None:
    """The invariant and each step's guard hold together on a concrete state (so no obligation
    is proved from a contradiction), and each conjunct is needed: the invariant without it is
    not inductive for some step (z3 finds no proof)."""
    m = Symbolic()
    p = POOL.params(None)
    s = POOL.state("")
    invariant = z3.And(POOL.assumptions(m, p), *(c(m, p, s) for c in INVARIANTS.values()))
    for step in STEPS:
        args = {name: z3.Const(name, sort) for name, sort in step.arguments.items()}
        solver = z3.Solver()
        solver.add(invariant, step.guard(m, p, s, args), p.n == 3)
        assert solver.check() != z3.unsat, step.name


@pytest.mark.parametrize(
    ("conjunct", "step", "broken"),
    [
        ("ref_cnt >= 0", "touch(b)", "a block is in the free queue iff its ref_cnt is 0"),
        (
            "every index stamp is in the past",
            "seal(b, k)",
            "no two indexed blocks share a stamp (stamped inverts stamp)",
        ),
    ],
)
def test_a_weakened_invariant_fails_with_a_printed_counterexample_to_induction(
    conjunct: str, step: str, broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planted weakening: without one conjunct the invariant is not inductive; the CLI exits
    1 and prints a concrete state where it holds and the step that breaks it (replayed in
    plain Python before it is shown)."""
    assert cli.main(["--weaken", conjunct]) == 1
    out = capsys.readouterr().out
    assert f"counterexample to induction: {step} breaks {broken!r}" in out
    assert "a state where the invariant holds:" in out
    assert "the state after it:" in out
    assert out.splitlines()[-1].startswith("REFUTED")
    assert "81/82 obligations proved" in out  # the one conjunct named, and no other


def test_a_weakening_of_the_manager_invariant_is_not_proved() -> None:
    """Without the witness of each entry's slot, a release cannot find the entry it removes:
    "every held block's ref_cnt counts the request" is no longer proved."""
    invariant = dict(MANAGER_INVARIANTS)
    del invariant["witness: each entry naming a block is one of its holders"]
    obligation = "pop_last(r) preserves: every held block's ref_cnt counts the request (>= 1)"
    report = prove(MANAGER, invariant, only=lambda name: name == obligation, rlimit=2_000_000)
    assert [(o.obligation, o.status) for o in report.outcomes] == [(obligation, "unknown")]
    proved = prove(MANAGER, MANAGER_INVARIANTS, only=lambda name: name == obligation)
    assert [o.status for o in proved.outcomes] == ["proved"]


@pytest.mark.parametrize("semantics", [PAGEDKV_SEMANTICS, VLLM_0_8_5, VLLM_0_33], ids=repr)
def test_the_model_runs_in_lock_step_with_the_spec(semantics: Semantics) -> None:
    """The proved transition system, executed, agrees with the spec call by call (every
    result, refusal, free order, ref_cnt, hash and index entry) under each semantics; its own
    check_invariants() is the proved invariant."""
    logging.disable(logging.WARNING)
    try:
        result = run_campaign(pool_layer(model_pool, semantics=semantics), seed=34, max_steps=3000)
    finally:
        logging.disable(logging.NOTSET)
    assert result.failure is None, result.failure.error
    assert result.coverage.counts["blocks cached"] > 0
    assert result.coverage.counts["evictions of cached blocks"] > 0


def test_pagedkv_verify_runs_the_model_as_an_implementation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["verify", "--quiet", "--layer", "pool", "--impl", MODEL, "--steps", "2000"]
    assert pagedkv_main([*args, "--seed", "7"]) == 0
    assert "OK: no divergence" in capsys.readouterr().out


def _pop_keeping_the_hash(m: Any, p: PoolParams, s: PoolState) -> PoolState:
    """Planted model change: a pop hands out a cached block without evicting its hash."""
    b = pool_model.head(s)
    s = pool_model._move(m, p, s, 0, s.num_free - 1)
    return dataclasses.replace(s, num_free=s.num_free - 1, ref=m.store(s.ref, b, s.ref[b] + 1))


def test_a_planted_model_change_is_caught_by_the_lock_step_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One transition planted wrong (a pop keeps the block's hash): every invariant stays
    inductive and every lemma holds, so the proof cannot see it; the lock-step run against the
    spec does."""
    monkeypatch.setattr(pool_model, "pop", _pop_keeping_the_hash)
    assert all(o.status == "proved" for o in prove(POOL, INVARIANTS).outcomes)
    logging.disable(logging.WARNING)
    try:
        result = run_campaign(pool_layer(model_pool), seed=34, max_steps=3000)
    finally:
        logging.disable(logging.NOTSET)
    assert result.failure is not None
    assert isinstance(result.failure.error, Divergence), result.failure.error


def test_the_model_names_a_broken_conjunct() -> None:
    """check_invariants() evaluates the proved invariant: a corrupted state is named."""
    pool = ModelPool(4, True, PAGEDKV_SEMANTICS)
    pool.get_new_blocks(1)
    pool.check_invariants()
    pool.state = dataclasses.replace(pool.state, ref=CONCRETE.store(pool.state.ref, 2, 1))
    with pytest.raises(InvariantViolation) as raised:
        pool.check_invariants()
    assert raised.value.invariant == "a block is in the free queue iff its ref_cnt is 0"


def _z3_state(s: PoolState, n: int, keys: dict[Any, Any]) -> PoolState:
    """A concrete state as z3 terms (arrays as stores over constant arrays)."""

    def array(table: Table, sort: Any, convert: Any = lambda v: v) -> Any:
        term = z3.K(sort, _val(convert(table.default)))
        for index, value in table.stored():
            term = z3.Store(term, _val(index), _val(convert(value)))
        return term

    def key(value: Any) -> Any:
        return keys.get(value, Symbolic().no_key)

    index = z3.K(KEY, z3.K(z3.IntSort(), z3.BoolVal(False)))
    for k, row in s.index.stored():
        index = z3.Store(index, keys[k], array(row, z3.IntSort()))
    return PoolState(
        ref=array(s.ref, z3.IntSort()),
        order=array(s.order, z3.IntSort()),
        pos=array(s.pos, z3.IntSort()),
        num_free=z3.IntVal(s.num_free),
        hashed=array(s.hashed, z3.IntSort()),
        key=array(s.key, z3.IntSort(), key),
        index=index,
        stamp=array(s.stamp, z3.IntSort()),
        stamped=array(s.stamped, z3.IntSort()),
        clock=z3.IntVal(s.clock),
    )


def _val(value: Any) -> Any:
    if isinstance(value, bool):
        return z3.BoolVal(value)
    if isinstance(value, int):
        return z3.IntVal(value)
    return value


def test_the_two_interpretations_agree() -> None:
    """The same step code, run on Python values and on z3 terms for the same state, gives the
    same successor: the executed model is the proved one (states from a random run of a
    5-block pool; every step with every argument)."""
    rng = random.Random(34)
    n = 5
    pool = ModelPool(n, True, dataclasses.replace(PAGEDKV_SEMANTICS, free_uncached_to_head=True))
    hashes = [("h", i) for i in range(3)]
    keys = {h: z3.Const(f"key{i}", KEY) for i, h in enumerate(hashes)}
    m = Symbolic()
    solver = z3.Solver()
    solver.add(z3.Distinct(*keys.values(), m.no_key))
    assert solver.check() == z3.sat
    model = solver.model()  # the keys distinct: every other value is fixed by the state
    for _ in range(10):
        s, p = pool.state, pool.params
        zs = _z3_state(s, n, keys)
        zp = dataclasses.replace(p, caching=z3.BoolVal(True), null_refcounted=z3.BoolVal(False))
        zp = dataclasses.replace(zp, free_uncached_to_head=z3.BoolVal(True))
        for step in STEPS:
            for args in _arguments(step.arguments, n, hashes):
                if not step.guard(CONCRETE, p, s, args):
                    continue
                after = step.apply(CONCRETE, p, s, args)
                z_args = {k: keys[v] if k == "k" else z3.IntVal(v) for k, v in args.items()}
                z_after = step.apply(m, zp, zs, z_args)
                _same(after, z_after, n, keys, model, step.name)
        _random_call(pool, rng)


def _arguments(sorts: Mapping[str, Any], n: int, hashes: list[Any]) -> list[dict[str, Any]]:
    if not sorts:
        return [{}]
    if "k" in sorts:
        return [{"b": b, "k": h} for b in range(n) for h in hashes]
    if "ahead" in sorts:
        return [{"b": b, "ahead": a} for b in range(n) for a in range(n)]
    return [{"b": b} for b in range(n)]


def _same(
    after: PoolState,
    z_after: PoolState,
    n: int,
    keys: dict[Any, Any],
    model: z3.ModelRef,
    name: str,
) -> None:
    def value(term: Any) -> Any:
        found = model.eval(term, model_completion=True)
        if z3.is_int_value(found):
            return found.as_long()
        if z3.is_true(found) or z3.is_false(found):
            return z3.is_true(found)
        return next((k for k, z in keys.items() if model.eval(z).eq(found)), None)

    for field in ("ref", "order", "pos", "hashed", "stamp"):
        concrete, symbolic = getattr(after, field), getattr(z_after, field)
        for i in range(-1, n + 1):
            assert concrete[i] == value(symbolic[i]), (name, field, i)
    for b in range(n):
        if after.hashed[b]:
            assert after.key[b] == value(z_after.key[b]), (name, "key", b)
    assert after.num_free == value(z_after.num_free), name
    assert after.clock == value(z_after.clock), name
    for k, z in keys.items():
        for b in range(-1, n + 1):
            assert after.index[k][b] == value(z_after.index[z][b]), (name, "index", k, b)


def _random_call(pool: ModelPool, rng: random.Random) -> None:
    """One valid pool call on the model (the interpretations are compared on its states)."""
    s = pool.state
    held = [b for b in range(1, pool.params.n) if s.ref[b] > 0]
    unhashed = [b for b in held if not s.hashed[b]]
    choice = rng.randrange(4)
    if choice == 0 and s.num_free:
        pool.get_new_blocks(rng.randint(1, s.num_free))
    elif choice == 1 and held:
        pool.free_blocks(rng.sample(held, rng.randint(1, len(held))))
    elif choice == 2 and unhashed:
        b = rng.choice(unhashed)
        pool.state = pool_model.seal(CONCRETE, pool.params, s, b, ("h", rng.randrange(3)))
    else:
        pool.touch([rng.randrange(pool.params.n)])


def _manager_campaign(steps: int) -> Any:
    logging.disable(logging.WARNING)
    try:
        return run_campaign(manager_layer(model_checked_manager), seed=34, max_steps=steps)
    finally:
        logging.disable(logging.NOTSET)


def test_the_manager_models_invariant_holds_on_every_state_pagedkv_reaches() -> None:
    """The proved per-request invariant, evaluated on pagedkv's manager at every full check of
    a lock-step campaign (full attention and sliding windows)."""
    result = _manager_campaign(3000)
    assert result.failure is None, result.failure.error
    assert result.coverage.counts["full checks"] > 100
    assert result.coverage.counts["sliding-window hits with leading null blocks"] > 0


def test_a_manager_conjunct_the_code_breaks_fails_the_campaign(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conjunct stated too strictly (a request holds at most one block) is refuted by the
    states the implementation reaches."""
    monkeypatch.setitem(
        MANAGER_INVARIANTS,
        "a request holds at most one block",
        lambda m, p, s: m.forall_entries(s.length, lambda r, length: length <= 1),
    )
    result = _manager_campaign(3000)
    assert result.failure is not None
    error = result.failure.error
    assert isinstance(error, Divergence), error
    assert error.signature[-1] == "model: a request holds at most one block"
