"""The block pool's hypothesis machine: it draws the pool client's operations.

Each rule draws one operation (`harness/client/pool_ops.py`) and has the client
(`harness/client/pool.py`) execute it on a pair in full mode: a call must succeed in both pools
with equal results, or raise the same exception class in both and leave both unchanged; after
every step the whole observable state (free order, ref counts, hashes, index, counters, the KV
cache events not yet taken) must be equal and both `check_invariants()` must pass; each batch of
events taken is replayed by the client's consumer, which must then hold the index. Pools are tiny
(2-16 blocks) and tokens come from a 2-3 letter alphabet, so exhaustion, eviction, reuse and
prefix collisions happen constantly.
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from pagedkv.harness.adapters import pagedkv_pool
from pagedkv.harness.client.pool import MAX_SEQUENCES, MISUSE, PoolClient
from pagedkv.harness.client.pool_ops import (
    Admit,
    Adopt,
    CacheBlocks,
    Finish,
    FreeAll,
    FreeSome,
    Grow,
    Hit,
    Lookup,
    Misuse,
    NewBlocks,
    NewRequest,
    Reset,
    TakeEvents,
    Touch,
)
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.machines.storage import keep_out_of_working_directory
from pagedkv.harness.machines.strategies import new_requests
from pagedkv.harness.protocol import PoolFactory
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.semantics import Semantics

PICK = st.integers(0, 15)
"""An index among candidates (taken modulo their number by the client)."""


class PoolMachine(RuleBasedStateMachine):
    """Spec vs `factory` pool through the client. Subclass via `make_pool_machine`."""

    factory: ClassVar[PoolFactory] = staticmethod(pagedkv_pool)
    semantics: ClassVar[Semantics] = PAGEDKV_SEMANTICS
    domain: ClassVar[Domain] = FULL_DOMAIN
    misuse: ClassVar[bool] = True
    kv_events: ClassVar[bool] = True  # the factory is a KVEventPoolFactory: compare events
    coverage: ClassVar[Coverage] = Coverage()

    def __init__(self) -> None:
        super().__init__()
        self.client: PoolClient

    @initialize(
        num_gpu_blocks=st.one_of(st.integers(2, 6), st.integers(2, 16)),  # mostly tiny
        enable_caching=st.sampled_from((True, True, True, False)),
        block_size=st.integers(1, 4),
        alphabet=st.integers(2, 3),
        hash_algo=st.sampled_from(("sha256", "builtin")),
        kv_events=st.sampled_from((True, True, True, False)),
    )
    def setup(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        block_size: int,
        alphabet: int,
        hash_algo: str,
        kv_events: bool,
    ) -> None:
        self.alphabet = alphabet
        self.coverage.runs += 1
        self.client = PoolClient.build(
            type(self).factory,
            self.coverage,
            num_blocks=num_gpu_blocks,
            enable_caching=enable_caching,
            semantics=self.semantics,
            kv_events=kv_events and self.kv_events,
            block_size=block_size,
            hash_algo=hash_algo,
            check_every=1,
            domain=self.domain,
        )

    def _request(self, data: st.DataObject) -> NewRequest:
        client = self.client
        return data.draw(
            new_requests(
                self.alphabet,
                client.block_size,
                num_earlier=len(client.requests),
                domain=self.domain,
            ),
            label="request",
        )

    @rule(num_blocks=st.integers(0, 16))
    def get_new_blocks(self, num_blocks: int) -> None:
        self.client.execute(NewBlocks(num_blocks))

    @rule(block_ids=st.lists(st.integers(0, 15), max_size=3), as_iterator=st.booleans())
    def touch(self, block_ids: list[int], as_iterator: bool) -> None:
        self.client.execute(Touch(tuple(block_ids), as_iterator))

    @rule(picks=st.lists(PICK, max_size=4))
    def free_blocks(self, picks: list[int]) -> None:
        self.client.execute(FreeSome(tuple(picks)))

    @rule(order=st.integers(0, 2**16))
    def free_everything(self, order: int) -> None:
        """Release every held reference, in rounds of distinct blocks, in a drawn order."""
        self.client.execute(FreeAll(order))

    @precondition(lambda self: len(self.client.sequences) < MAX_SEQUENCES)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """What a manager does for a new request: hit, touch, allocate the rest, cache them."""
        self.client.execute(Admit(self._request(data)))

    @precondition(lambda self: len(self.client.sequences) < MAX_SEQUENCES)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        """A request that looks its prefix up and touches the hits."""
        self.client.execute(Hit(self._request(data)))

    @precondition(lambda self: len(self.client.sequences) < MAX_SEQUENCES)
    @rule(data=st.data(), picks=st.lists(PICK, max_size=4), num_stored=st.integers(0, 4))
    def adopt(self, data: st.DataObject, picks: list[int], num_stored: int) -> None:
        """A request over held blocks with some of its hashes already stored."""
        self.client.execute(Adopt(self._request(data), tuple(picks), num_stored))

    @precondition(lambda self: bool(self.client.sequences))
    @rule(which=PICK, tokens=st.lists(st.integers(0, 2), max_size=8))
    def grow(self, which: int, tokens: list[int]) -> None:
        """Generated tokens, the blocks they need, and the blocks that became full cached."""
        self.client.execute(Grow(which, tuple(token % self.alphabet for token in tokens)))

    @precondition(lambda self: bool(self.client.sequences))
    @rule(which=PICK, num_full=st.integers(0, 8))
    def cache_full_blocks(self, which: int, num_full: int) -> None:
        self.client.execute(CacheBlocks(which, num_full))

    @precondition(lambda self: bool(self.client.sequences))
    @rule(which=PICK)
    def finish(self, which: int) -> None:
        """Free a sequence's blocks tail first (the manager's eviction order) and drop it."""
        self.client.execute(Finish(which))

    @rule(pick=st.integers(0, 40))
    def get_cached_block(self, pick: int) -> None:
        self.client.execute(Lookup(pick))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.client.execute(Reset())

    @precondition(lambda self: self.client.spec.enable_kv_cache_events)
    @rule()
    def take_events(self) -> None:
        """Drain both event queues (equal batches); the consumer replaying them holds the index."""
        self.client.execute(TakeEvents())

    @precondition(lambda self: self.misuse)
    @rule(kind=st.sampled_from(MISUSE), arg=st.integers(0, 2**16))
    def misuse_call(self, kind: str, arg: int) -> None:
        """An invalid call (wrong types, NaN, unhashable keys, bad ranges, free blocks): refused
        by both, nothing changed."""
        self.client.execute(Misuse(kind, arg))


def make_pool_machine(
    factory: PoolFactory,
    *,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    coverage: Coverage | None = None,
    domain: Domain = FULL_DOMAIN,
    kv_events: bool | None = None,
) -> type[PoolMachine]:
    """A `PoolMachine` subclass checking `factory`'s pools on `domain`, counting what it
    exercised in `coverage`; `kv_events` (default: only for pagedkv's own pool) says the factory
    is a `KVEventPoolFactory`."""
    own = factory is pagedkv_pool
    return keep_out_of_working_directory(
        type(
            "PoolMachine",
            (PoolMachine,),
            {
                "factory": staticmethod(factory),
                "semantics": semantics,
                "misuse": misuse,
                "domain": domain,
                "kv_events": own if kv_events is None else kv_events,
                "coverage": coverage if coverage is not None else Coverage(),
            },
        )
    )
