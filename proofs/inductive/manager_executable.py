"""The manager model's invariant, evaluated on every state pagedkv's manager reaches in a campaign.

`abstract` maps a `pagedkv.KVCacheManager` (one KV cache group) onto `manager_model`'s state:
each block's ref_cnt and whether it is hashed, each request's block table, and the witness
built by enumerating the tables (so the witness conjuncts hold by construction; the ones that
say something are checked). `model_checked_manager` is pagedkv's manager as a manager under
test whose `check_invariants()` also evaluates `manager_model.INVARIANTS` (the proved ones,
under the plain-Python interpretation) on that abstraction, at every full check:

    pagedkv verify --layer manager \\
        --manager-impl proofs.inductive.manager_executable:model_checked_manager

So the proof's invariant is not only inductive over the model's steps but true of every state
the implementation reaches there, in lock step with the spec; a conjunct stated wrongly (or a
model too strict for the code) fails the campaign. Only pagedkv's semantics: under vLLM
0.8.5's `cap_at_max_model_len` a request may hold more than cdiv(max_model_len, B) blocks.
"""

from __future__ import annotations

from typing import Any

from pagedkv.harness.adapters import ObjectManagerAdapter, pagedkv_manager
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.spec.block_counts import ceil_div
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.errors import InvariantViolation
from proofs.inductive.algebra import CONCRETE, Table
from proofs.inductive.manager_model import INVARIANTS, NULL, ManagerParams, ManagerState


def abstract(manager: Any, config: ManagerConfig) -> tuple[ManagerParams, ManagerState]:
    """The model's parameters (from the config the manager was built from) and state for a
    `KVCacheManager` (module docstring)."""
    blocks = manager.block_pool.blocks
    (group,) = manager.coordinator.single_type_managers
    req_to_blocks = group.req_to_blocks
    layer_spec = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    params = ManagerParams(
        n=config.kv_cache_config.num_blocks,
        max_blocks=ceil_div(config.max_model_len, layer_spec.block_size),
        allows_null=group.allows_null_blocks,
        caching=config.enable_caching,
    )
    holders: dict[int, list[tuple[str, int]]] = {}
    tables, slots = {}, {}
    for request_id, held in req_to_blocks.items():
        table = [block.block_id for block in held]
        tables[request_id] = Table(dict(enumerate(table)), NULL)
        slot = {}
        for position, block_id in enumerate(table):
            if block_id != NULL:
                entries = holders.setdefault(block_id, [])
                slot[position] = len(entries)
                entries.append((request_id, position))
        slots[request_id] = Table(slot, 0)
    state = ManagerState(
        ref=Table({block.block_id: block.ref_cnt for block in blocks}, 0),
        hashed=Table({block.block_id: block.block_hash is not None for block in blocks}, False),
        table=Table(tables, Table({}, NULL)),
        length=Table({r: len(held) for r, held in req_to_blocks.items()}, 0),
        holders=Table({b: len(entries) for b, entries in holders.items()}, 0),
        holder_req=Table(
            {b: Table({j: e[0] for j, e in enumerate(es)}, None) for b, es in holders.items()},
            Table({}, None),
        ),
        holder_pos=Table(
            {b: Table({j: e[1] for j, e in enumerate(es)}, 0) for b, es in holders.items()},
            Table({}, 0),
        ),
        slot=Table(slots, Table({}, 0)),
    )
    return params, state


def check_model_invariants(manager: Any, config: ManagerConfig) -> None:
    """`manager_model.INVARIANTS` on `abstract(manager, config)`.

    Raises:
        InvariantViolation: the first conjunct that does not hold ("model: ...").
    """
    params, state = abstract(manager, config)
    for name, holds in INVARIANTS.items():
        if not holds(CONCRETE, params, state):
            raise InvariantViolation(
                f"model: {name}", repr(manager.coordinator.single_type_managers[0].req_to_blocks)
            )


class ModelCheckedManager(ObjectManagerAdapter):
    """pagedkv's manager, its own invariants checked and then the model's."""

    def __init__(self, manager: Any, config: ManagerConfig) -> None:
        super().__init__(manager)
        self.config = config

    def check_invariants(self) -> None:
        super().check_invariants()
        check_model_invariants(self.manager, self.config)


def model_checked_manager(config: ManagerConfig) -> ManagerUnderTest:
    """`--manager-impl` factory: pagedkv's manager, checked against the model's invariant too
    (one KV cache group, pagedkv's semantics)."""
    if len(config.kv_cache_config.kv_cache_groups) > 1 or config.semantics != PAGEDKV_SEMANTICS:
        raise ValueError("the manager model has one KV cache group, under pagedkv's semantics")
    built = pagedkv_manager(config)
    assert isinstance(built, ObjectManagerAdapter)
    return ModelCheckedManager(built.manager, config)
