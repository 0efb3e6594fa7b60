"""The manager's per-request invariant is inductive, for every pool and every set of requests.

`MANAGER` hands `prover.prove` the model of `manager_model.py` with everything symbolic: the
pool size, the most blocks a request may hold (cdiv(max_model_len, block size) >= 1), whether
the attention allows null blocks, whether caching is on, the state (tables over an
uninterpreted sort of requests: any number of them) and each step's arguments.

Obligations: the empty manager satisfies each conjunct of `manager_model.INVARIANTS`; each step
preserves each conjunct under its guard. A failed obligation is reported without a replayed
counterexample (the bounded search of `prover` needs a finite set of requests, which this
system does not enumerate): the pool's proof carries the planted-weakening check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import z3

from proofs.inductive import manager_model as model
from proofs.inductive.algebra import Algebra, Bool
from proofs.inductive.manager_model import ManagerParams, ManagerState
from proofs.inductive.prover import Lemma, Step
from proofs.inductive.symbolic import REQUEST

INT = z3.IntSort()


class ManagerSystem:
    """The manager's request tables over an abstract pool, as a `prover.System`."""

    name = "KV cache manager, per request (every pool size, any number of requests)"
    bounded = False

    def __init__(self) -> None:
        self.steps: Sequence[Step] = STEPS
        self.lemmas: Sequence[Lemma] = []

    def params(self, size: int | None) -> ManagerParams:
        return ManagerParams(
            z3.Int("n") if size is None else size,
            z3.Int("max_blocks"),
            z3.Bool("allows_null"),
            z3.Bool("caching"),
        )

    def assumptions(self, m: Algebra, p: ManagerParams) -> Bool:
        return m.all_(p.n >= 1, p.max_blocks >= 1)

    def state(self, tag: str) -> ManagerState:
        per_block = z3.ArraySort(INT, INT)
        return ManagerState(
            ref=z3.Array(f"ref{tag}", INT, INT),
            hashed=z3.Array(f"hashed{tag}", INT, z3.BoolSort()),
            table=z3.Array(f"table{tag}", REQUEST, per_block),
            length=z3.Array(f"length{tag}", REQUEST, INT),
            holders=z3.Array(f"holders{tag}", INT, INT),
            holder_req=z3.Array(f"holder_req{tag}", INT, z3.ArraySort(INT, REQUEST)),
            holder_pos=z3.Array(f"holder_pos{tag}", INT, per_block),
            slot=z3.Array(f"slot{tag}", REQUEST, per_block),
        )

    def init(self, m: Algebra, p: ManagerParams) -> ManagerState:
        return model.init(m, p, z3.Const("any_request", REQUEST))

    def finite(self, s: ManagerState, args: dict[str, Any], size: int) -> dict[Any, list[Any]]:
        raise NotImplementedError("the manager system has no bounded search")

    def concretize(
        self,
        found: z3.ModelRef,
        p: ManagerParams,
        s: ManagerState,
        finite: dict[Any, list[Any]],
        size: int,
    ) -> tuple[Any, Any]:
        raise NotImplementedError("the manager system has no bounded search")

    def value(self, found: z3.ModelRef, term: Any) -> Any:
        raise NotImplementedError("the manager system has no bounded search")

    def describe(self, p: Any, s: Any) -> str:
        raise NotImplementedError("the manager system has no bounded search")


STEPS = [
    Step(
        "append_new(r, b)",
        {"r": REQUEST, "b": INT},
        lambda m, p, s, a: model.append_new_guard(m, p, s, a["r"], a["b"]),
        lambda m, p, s, a: model.append_new(m, p, s, a["r"], a["b"]),
    ),
    Step(
        "append_hit(r, b)",
        {"r": REQUEST, "b": INT},
        lambda m, p, s, a: model.append_hit_guard(m, p, s, a["r"], a["b"]),
        lambda m, p, s, a: model.append_hit(m, p, s, a["r"], a["b"]),
    ),
    Step(
        "seal(r, i)",
        {"r": REQUEST, "i": INT},
        lambda m, p, s, a: model.seal_guard(m, p, s, a["r"], a["i"]),
        lambda m, p, s, a: model.seal(m, p, s, a["r"], a["i"]),
    ),
    Step(
        "drop(r, i)",
        {"r": REQUEST, "i": INT},
        lambda m, p, s, a: model.drop_guard(m, p, s, a["r"], a["i"]),
        lambda m, p, s, a: model.drop(m, p, s, a["r"], a["i"]),
    ),
    Step(
        "pop_last(r)",
        {"r": REQUEST},
        lambda m, p, s, a: model.pop_last_guard(m, p, s, a["r"]),
        lambda m, p, s, a: model.pop_last(m, p, s, a["r"]),
    ),
    Step(
        "reset",
        {},
        lambda m, p, s, a: model.reset_guard(m, p, s),
        lambda m, p, s, a: model.reset(m, p, s),
    ),
]

MANAGER = ManagerSystem()
