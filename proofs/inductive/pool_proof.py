"""The block pool's invariant is inductive, for every pool size: the obligations and lemmas.

`POOL` hands `prover.prove` the model of `pool_model.py` with everything symbolic: the pool
size n (>= 1, unbounded), the three switches its steps read (caching, vLLM 0.8.5's counted null
block, vLLM 0.33's head insertion), the state arrays and each step's arguments. So one proof
covers every size and every semantics.

Obligations: `init(n)` establishes each conjunct of `pool_model.INVARIANTS`; each single-block
step (`pop`, `touch(b)`, `release(b, ahead)`, `seal(b, k)`, `reset`) preserves each conjunct
under its guard. A public call is a fold of those steps, so the lemmas below close the gap:

- batch lemmas: the call's preconditions, checked before its first step, keep every later
  step's guard true (a pop shortens the queue by exactly one; a release or a seal changes no
  other block's ref_cnt or hash and never shortens the queue, and `ahead` stays within it);
- queue-discipline lemmas: the permutation's prefix behaves as the spec's list: a pop removes
  the head and keeps the rest in order, a touch removes the block from its place, a release
  appends at the tail (or inserts at `ahead`), everything else in order.

By induction on the number of steps (and on a call's length), every state the model reaches
from `init` satisfies the invariant; a refused call changes nothing. `pool_executable.py` runs
this model in lock step with the spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import z3

from proofs.inductive import pool_model as model
from proofs.inductive.algebra import Algebra, Bool, Table
from proofs.inductive.pool_model import INVARIANTS, PoolParams, PoolState
from proofs.inductive.prover import Conjunct, Lemma, Step
from proofs.inductive.symbolic import KEY

INT = z3.IntSort()


class PoolSystem:
    """The block pool as a `prover.System`."""

    name = "block pool (every pool size, every semantics)"
    bounded = True

    def __init__(self) -> None:
        self.steps: Sequence[Step] = STEPS
        self.lemmas: Sequence[Lemma] = LEMMAS

    def params(self, size: int | None) -> PoolParams:
        return PoolParams(
            z3.Int("n") if size is None else size,
            z3.Bool("caching"),
            z3.Bool("null_refcounted"),
            z3.Bool("free_uncached_to_head"),
        )

    def assumptions(self, m: Algebra, p: PoolParams) -> Bool:
        return p.n >= 1

    def state(self, tag: str) -> PoolState:
        def array(name: str, values: Any) -> Any:
            return z3.Array(f"{name}{tag}", INT, values)

        return PoolState(
            ref=array("ref", INT),
            order=array("order", INT),
            pos=array("pos", INT),
            num_free=z3.Int(f"num_free{tag}"),
            hashed=array("hashed", z3.BoolSort()),
            key=array("key", KEY),
            index=z3.Array(f"index{tag}", KEY, z3.ArraySort(INT, z3.BoolSort())),
            stamp=array("stamp", INT),
            stamped=array("stamped", INT),
            clock=z3.Int(f"clock{tag}"),
        )

    def init(self, m: Algebra, p: PoolParams) -> PoolState:
        return model.init(m, p)

    def finite(self, s: PoolState, args: dict[str, Any], size: int) -> dict[Any, list[Any]]:
        keys = [s.key[b] for b in range(-1, size + 1)]
        return {KEY: keys + [term for term in args.values() if term.sort() == KEY]}

    def concretize(
        self,
        found: z3.ModelRef,
        p: PoolParams,
        s: PoolState,
        finite: dict[Any, list[Any]],
        size: int,
    ) -> tuple[PoolParams, PoolState]:
        def value(term: Any) -> Any:
            return self.value(found, term)

        span = range(-1, size + 1)

        def table(array: Any, default: Any) -> Table:
            return Table({i: value(array[i]) for i in span}, default)

        key = Table({b: self._key(found, s.key[b]) for b in span}, None)
        index = Table(
            {
                self._key(found, k): Table({b: value(s.index[k][b]) for b in span}, False)
                for k in finite[KEY]
            },
            Table({}, False),
        )
        times = {value(s.stamp[b]) for b in span} | {value(s.clock)}
        params = PoolParams(
            size, value(p.caching), value(p.null_refcounted), value(p.free_uncached_to_head)
        )
        state = PoolState(
            ref=table(s.ref, 0),
            order=table(s.order, 0),
            pos=table(s.pos, 0),
            num_free=value(s.num_free),
            hashed=table(s.hashed, False),
            key=key,
            index=index,
            stamp=table(s.stamp, 0),
            stamped=Table({t: value(s.stamped[t]) for t in times}, 0),
            clock=value(s.clock),
        )
        return params, state

    def value(self, found: z3.ModelRef, term: Any) -> Any:
        evaluated = found.eval(term, model_completion=True)
        if z3.is_int_value(evaluated):
            return evaluated.as_long()
        if z3.is_true(evaluated) or z3.is_false(evaluated):
            return z3.is_true(evaluated)
        return str(evaluated).replace("Key!val!", "K")

    def _key(self, found: z3.ModelRef, term: Any) -> Any:
        name = self.value(found, term)
        return None if name == self.value(found, z3.Const("no_key", KEY)) else name

    def describe(self, p: PoolParams, s: PoolState) -> str:
        n = p.n
        hashed = [b for b in range(n) if s.hashed[b]]
        index = {
            k: [b for b, listed in row.stored() if listed and 0 <= b < n]
            for k, row in s.index.stored()
        }
        lines = [
            f"    n = {n}, caching {p.caching}, null block counted {p.null_refcounted}, "
            f"free_uncached_to_head {p.free_uncached_to_head}",
            f"    ref_cnt     {[s.ref[b] for b in range(n)]}",
            f"    free queue  {[s.order[i] for i in range(max(0, min(s.num_free, n)))]} "
            f"(num_free {s.num_free}; order {[s.order[i] for i in range(max(0, n - 1))]}, "
            f"pos {[s.pos[b] for b in range(n)]})",
            f"    hashed      {[(b, s.key[b], s.stamp[b]) for b in hashed]} "
            f"(block, key, stamp); clock {s.clock}",
            f"    index       { {k: v for k, v in index.items() if v} }",
        ]
        return "\n".join(lines)


def _step(name: str, arguments: dict[str, Any], guard: Any, apply: Any) -> Step:
    return Step(name, arguments, guard, apply)


STEPS = [
    _step(
        "pop",
        {},
        lambda m, p, s, a: model.pop_guard(m, p, s),
        lambda m, p, s, a: model.pop(m, p, s),
    ),
    _step(
        "touch(b)",
        {"b": INT},
        lambda m, p, s, a: model.touch_guard(m, p, s, a["b"]),
        lambda m, p, s, a: model.touch(m, p, s, a["b"]),
    ),
    _step(
        "release(b, ahead)",
        {"b": INT, "ahead": INT},
        lambda m, p, s, a: model.release_guard(m, p, s, a["b"], a["ahead"]),
        lambda m, p, s, a: model.release(m, p, s, a["b"], a["ahead"]),
    ),
    _step(
        "seal(b, k)",
        {"b": INT, "k": KEY},
        lambda m, p, s, a: model.seal_guard(m, p, s, a["b"]),
        lambda m, p, s, a: model.seal(m, p, s, a["b"], a["k"]),
    ),
    _step(
        "reset",
        {},
        lambda m, p, s, a: model.reset_guard(m, p, s),
        lambda m, p, s, a: model.reset(m, p, s),
    ),
]


def _other_block_unchanged(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    c = a["c"]
    return m.implies(
        m.all_(c != a["b"], model.is_block(m, p, c)),
        m.all_(t.ref[c] == s.ref[c], t.hashed[c] == s.hashed[c]),
    )


def _release_keeps_ahead(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    to_head = model.released_to_head(m, p, s, a["b"])
    return m.all_(t.num_free >= s.num_free, a["ahead"] + m.ite(to_head, 1, 0) <= t.num_free)


def _same_prefix(m: Algebra, t: PoolState, s: PoolState, hi: Any, shift: int = 0) -> Bool:
    """t.order[i] == s.order[i + shift] for i in [0, hi)."""
    return m.forall(0, hi, lambda i: t.order[i] == s.order[i + shift])


def _pop_order(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    return _same_prefix(m, t, s, t.num_free, 1)


def _touch_order(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    b = a["b"]
    at = s.pos[b]
    removed = m.forall(
        0, t.num_free, lambda i: t.order[i] == m.ite(i < at, s.order[i], s.order[i + 1])
    )
    dequeued = m.all_(b != model.NULL, s.ref[b] == 0)
    unchanged = m.all_(t.num_free == s.num_free, _same_prefix(m, t, s, s.num_free))
    return m.ite(dequeued, m.all_(t.num_free == s.num_free - 1, removed), unchanged)


def _release_order(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    b, ahead = a["b"], a["ahead"]
    enqueued = m.all_(b != model.NULL, s.ref[b] == 1)
    at = m.ite(model.released_to_head(m, p, s, b), ahead, s.num_free)
    inserted = m.all_(
        t.num_free == s.num_free + 1,
        t.order[at] == b,
        m.forall(
            0,
            t.num_free,
            lambda i: m.implies(i != at, t.order[i] == m.ite(i < at, s.order[i], s.order[i - 1])),
        ),
    )
    unchanged = m.all_(t.num_free == s.num_free, _same_prefix(m, t, s, s.num_free))
    return m.ite(enqueued, inserted, unchanged)


def _queue_kept(m: Algebra, p: PoolParams, s: PoolState, t: PoolState, a: Any) -> Bool:
    return m.all_(t.num_free == s.num_free, _same_prefix(m, t, s, s.num_free))


def _lemma(name: str, step: str | None, conclusion: Any, extra: tuple[str, ...] = ()) -> Lemma:
    return Lemma(name, step, conclusion, extra=extra)


LEMMAS = [
    _lemma(
        "batch: a pop shortens the queue by exactly one (k <= free blocks: k pops are guarded)",
        "pop",
        lambda m, p, s, t, a: t.num_free == s.num_free - 1,
    ),
    _lemma(
        "batch: a release changes no other block's ref_cnt or hash",
        "release(b, ahead)",
        _other_block_unchanged,
        ("c",),
    ),
    _lemma(
        "batch: a release never shortens the queue, and `ahead` stays within it",
        "release(b, ahead)",
        _release_keeps_ahead,
    ),
    _lemma(
        "batch: a seal changes no other block's ref_cnt or hash",
        "seal(b, k)",
        _other_block_unchanged,
        ("c",),
    ),
    _lemma("queue: a pop takes the head, the rest in order", "pop", _pop_order),
    _lemma(
        "queue: a touch takes a free block out of its place, the rest in order",
        "touch(b)",
        _touch_order,
    ),
    _lemma(
        "queue: a release to ref_cnt 0 appends at the tail (or inserts at `ahead`), the rest "
        "in order",
        "release(b, ahead)",
        _release_order,
    ),
    _lemma("queue: a seal leaves the queue as it was", "seal(b, k)", _queue_kept),
    _lemma(
        "reset: the guard free blocks == n - 1 holds iff no block but the null block is in use "
        "(the manager model's reset guard)",
        None,
        lambda m, p, s, t, a: (
            model.reset_guard(m, p, s) == m.forall(1, p.n, lambda b: s.ref[b] == 0)
        ),
    ),
    _lemma("queue: a reset leaves the queue as it was", "reset", _queue_kept),
]

POOL = PoolSystem()


def weakened(name: str) -> dict[str, Conjunct]:
    """The invariant without the conjunct `name` (a planted weakening).

    Raises:
        KeyError: no conjunct is called `name`.
    """
    if name not in INVARIANTS:
        raise KeyError(name)
    return {other: conjunct for other, conjunct in INVARIANTS.items() if other != name}
