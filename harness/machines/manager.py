"""The request-level hypothesis machine: it draws the simulated client's operations.

Each rule draws one operation (`harness/client/manager_ops.py`) with hypothesis strategies and
has the client (`harness/client/manager.py`) execute it on a pair in full mode (after every step
whole snapshots and both invariant checks; every refused call leaves both sides unchanged). The
client is the swarm's and the exhaustive search's: this machine differs only in how operations
are chosen (hypothesis draws and shrinks them), on tiny configurations: 2-16 blocks, block size
1-4, a 2-3 token alphabet, at most four live requests.
"""

from __future__ import annotations

import random
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.harness.client.hostile import HOSTILE_CALLS, SWARM_HOSTILE_CALLS
from pagedkv.harness.client.manager import ManagerClient
from pagedkv.harness.client.manager_ops import (
    Admit,
    CommonPrefix,
    Finish,
    Hostile,
    ManagerOp,
    NewStep,
    Preempt,
    Reset,
    Stats,
    Step,
    TakeEvents,
)
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.machines.storage import keep_out_of_working_directory
from pagedkv.harness.machines.strategies import arrivals
from pagedkv.harness.protocol import ManagerConfig, ManagerFactory
from pagedkv.harness.swarm.engine import (
    offers_mamba_align,
    offers_mamba_groups,
    offers_mixed_block_sizes,
)
from pagedkv.harness.swarm.runs import (
    attention_spec,
    hybrid_config,
    with_mamba_align,
    with_mamba_groups,
    with_mixed_block_sizes,
    with_retention,
)
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.kv_cache_interface import uniform_kv_cache_config
from pagedkv.vocab.semantics import Semantics

HYBRID_KINDS = ("attention", "attention", "mamba", "mamba align", "mixed block sizes")
"""What a hybrid machine's groups are, as the swarm's hybrid layer draws them: attention
groups only (`hybrid_config`), with Mamba groups in mode "none" (`with_mamba_groups`: caching
off), with Mamba groups in mode "align" (`with_mamba_align`: caching on), or of several block
sizes (`with_mixed_block_sizes`: caching on). A kind the factory does not offer, or that the
drawn configuration cannot take, stays "attention"."""

CATALOG_KINDS = sorted(set(HOSTILE_CALLS) - set(SWARM_HOSTILE_CALLS))
"""The hostile calls of the value catalog (`harness/client/catalog.py`)."""

WHICH = st.integers(0, 3)
"""A request index (taken modulo the candidates by the client; shrinks towards the first)."""


class ManagerMachine(RuleBasedStateMachine):
    """Spec manager vs `factory`'s manager through the client. Subclass via
    `make_manager_machine`."""

    factory: ClassVar[ManagerFactory] = staticmethod(pagedkv_manager)
    semantics: ClassVar[Semantics] = PAGEDKV_SEMANTICS
    sliding_window: ClassVar[bool] = False
    domain: ClassVar[Domain] = FULL_DOMAIN
    misuse: ClassVar[bool] = True
    kv_events: ClassVar[bool] = True  # the factory's managers can emit KV cache events
    coverage: ClassVar[Coverage] = Coverage()  # shared by every example of the machine

    def __init__(self) -> None:
        super().__init__()
        self.client: ManagerClient
        self.aligned = False  # a Mamba-align hybrid: scheduler steps, no drafts (k = 0)

    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.one_of(st.integers(2, 8), st.integers(2, 16)),
        max_model_len=st.integers(1, 24),
        window=st.integers(1, 13),
        enable_caching=st.sampled_from((True, True, True, False)),
        use_eagle=st.sampled_from((False, False, False, True)),
        log_stats=st.booleans(),
        hash_algo=st.sampled_from(("sha256", "builtin")),
        alphabet=st.integers(2, 3),
        kv_events=st.sampled_from((True, True, True, False)),
        retention_seed=st.integers(0, 255),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        window: int,
        enable_caching: bool,
        use_eagle: bool,
        log_stats: bool,
        hash_algo: str,
        alphabet: int,
        kv_events: bool,
        retention_seed: int,
    ) -> None:
        self._setup(
            block_size,
            num_blocks,
            max_model_len,
            window,
            enable_caching,
            use_eagle,
            log_stats,
            hash_algo,
            alphabet,
            kv_events,
            retention_seed=retention_seed,
        )

    def _setup(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        window: int,
        enable_caching: bool,
        use_eagle: bool,
        log_stats: bool,
        hash_algo: str,
        alphabet: int,
        kv_events: bool,
        groups_seed: int | None = None,
        *,
        retention_seed: int = 0,
        kind: str = "attention",
    ) -> None:
        """Build the client; with `groups_seed`, over 2-4 KV cache groups (the first group of
        the drawn type, the others as the swarm's hybrid runs draw them), then a retention
        interval for a sliding-window group (`with_retention`: from `groups_seed`'s draw,
        else from `retention_seed`), then the groups of `kind` (`HYBRID_KINDS`)."""
        domain = self.domain
        sliding = self.sliding_window
        if sliding and not domain.eagle_with_sliding_window:
            use_eagle = False
        if kind == "mamba":  # Mamba groups in mode "none" need caching and EAGLE off
            enable_caching = use_eagle = False
        elif kind != "attention":  # "align" and several block sizes: caching on, no EAGLE
            enable_caching, use_eagle = True, False
        spec = attention_spec(block_size, domain.window(window, block_size) if sliding else None)
        config = ManagerConfig(
            uniform_kv_cache_config(spec, num_blocks),
            max_model_len,
            enable_caching,
            hash_algo,
            use_eagle,
            log_stats,
            self.semantics,
            enable_kv_cache_events=kv_events and self.kv_events,
        )
        rng = random.Random(retention_seed)
        if groups_seed is not None:
            rng = random.Random(groups_seed)
            config = hybrid_config(rng, config, domain)
        config = with_retention(rng, config, domain)
        self.aligned = False
        if groups_seed is not None:
            config = self._with_kind(rng, config, kind)
        self.alphabet = alphabet
        self.block_size = block_size
        self.coverage.runs += 1
        self.client = ManagerClient.build(
            config, type(self).factory, self.coverage, check_every=1, domain=domain
        )

    def _with_kind(self, rng: random.Random, config: ManagerConfig, kind: str) -> ManagerConfig:
        """`config` (hybrid) with the groups of `kind`, where the factory serves them."""
        factory, domain = type(self).factory, self.domain
        if kind == "mamba" and offers_mamba_groups(factory):
            return with_mamba_groups(rng, config, domain)
        if kind == "mamba align" and offers_mamba_align(factory):
            self.aligned = True
            return with_mamba_align(rng, config, domain)
        if kind == "mixed block sizes" and offers_mixed_block_sizes(factory):
            return with_mixed_block_sizes(rng, config, domain)
        return config

    # -- the scheduler's calls ----------------------------------------------------------------

    @precondition(lambda self: len(self.client.live) < 4)
    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        """A new request joins the waiting queue, often sharing an earlier request's prefix."""
        longest = max(1, min(self.client.config.max_model_len, 4 * self.block_size + 1))
        op = data.draw(
            arrivals(
                self.alphabet,
                longest,
                self.block_size,
                num_earlier=len(self.client.history),
                domain=self.domain,
            ),
            label="arrival",
        )
        self.client.execute(op)

    @precondition(lambda self: bool(self.client.waiting()))
    @rule(
        which=WHICH,
        chunk=st.sampled_from((0, 0, 1, 2, 5)),
        lookahead=st.sampled_from((0, 0, 1, 2)),
        token=st.integers(0, 2),
    )
    def admit(self, which: int, chunk: int, lookahead: int, token: int) -> None:
        """Look a waiting request up, then reserve slots for its prefill (all or a chunk)."""
        if self.aligned:
            lookahead = 0
        self.client.execute(Admit(which, chunk, lookahead, token % self.alphabet))

    @precondition(lambda self: bool(self.client.running()))
    @rule(
        which=WHICH,
        chunk=st.sampled_from((0, 0, 1, 3)),
        drafts=st.lists(st.integers(0, 2), max_size=2),
        accepted=st.integers(0, 2),
        lookahead=st.sampled_from((0, 0, 1, 2)),
        token=st.integers(0, 2),
    )
    def step(
        self,
        which: int,
        chunk: int,
        drafts: list[int],
        accepted: int,
        lookahead: int,
        token: int,
    ) -> None:
        """One more prefill chunk, or a decode step with speculative tokens; preempted on None.
        A Mamba-align run draws neither drafts nor lookahead (its Mamba groups have no
        speculative blocks; the swarm draws them)."""
        alphabet = self.alphabet
        if self.aligned:
            drafts, lookahead = [], 0
        self.client.execute(
            Step(
                which,
                chunk,
                tuple(draft % alphabet for draft in drafts),
                accepted,
                lookahead,
                token % alphabet,
            )
        )

    @precondition(lambda self: self.aligned)
    @rule()
    def new_step(self) -> None:
        """A scheduler step starts (a Mamba-align run): states keyed before it become hits."""
        self.client.execute(NewStep())

    @precondition(lambda self: bool(self.client.running()))
    @rule(which=WHICH)
    def preempt(self, which: int) -> None:
        self.client.execute(Preempt(which))

    @precondition(lambda self: bool(self.client.live))
    @rule(which=WHICH)
    def finish(self, which: int) -> None:
        self.client.execute(Finish(which))

    @rule(call=st.sampled_from(("stats",) * 5 + ("common prefix",) * 4 + ("reset",)), which=WHICH)
    def housekeeping(self, call: str, which: int) -> None:
        """What a scheduler asks between steps: stats, the common prefix, a prefix-cache reset
        (rare: it empties the cache whenever no request holds blocks)."""
        ops: dict[str, ManagerOp] = {
            "stats": Stats(),
            "common prefix": CommonPrefix(which),
            "reset": Reset(),
        }
        op = ops[call]
        self.client.execute(op)

    @precondition(lambda self: self.client.config.enable_kv_cache_events)
    @rule()
    def take_events(self) -> None:
        """The scheduler drains both event queues (equal batches) and publishes them."""
        self.client.execute(TakeEvents())

    @precondition(lambda self: self.misuse and bool(self.client.live))
    @rule(kind=st.sampled_from(sorted(SWARM_HOSTILE_CALLS)), which=WHICH, arg=st.integers(0, 255))
    def hostile(self, kind: str, which: int, arg: int) -> None:
        """A call a careless or malicious caller makes: typed error, nothing changed."""
        self.client.execute(Hostile(kind, which, arg))

    @precondition(lambda self: self.misuse and bool(self.client.live))
    @rule(kind=st.sampled_from(CATALOG_KINDS), which=WHICH, arg=st.integers(0, 255))
    def hostile_value(self, kind: str, which: int, arg: int) -> None:
        """A value no call accepts (wrong types, NaN, mutated fields): typed error, nothing
        changed."""
        self.client.execute(Hostile(kind, which, arg))


class HybridManagerMachine(ManagerMachine):
    """The manager machine over 2-4 KV cache groups (the same `ManagerUnderTest`): the client
    and its rules are the same; only the configuration is hybrid."""

    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(4, 24),
        max_model_len=st.integers(4, 24),
        window=st.integers(1, 13),
        enable_caching=st.sampled_from((True, True, True, False)),
        use_eagle=st.sampled_from((False, False, False, True)),
        log_stats=st.booleans(),
        hash_algo=st.sampled_from(("sha256", "builtin")),
        alphabet=st.integers(2, 3),
        kv_events=st.sampled_from((True, True, True, False)),
        groups_seed=st.integers(0, 2**16 - 1),
        kind=st.sampled_from(HYBRID_KINDS),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        window: int,
        enable_caching: bool,
        use_eagle: bool,
        log_stats: bool,
        hash_algo: str,
        alphabet: int,
        kv_events: bool,
        groups_seed: int,
        kind: str,
    ) -> None:
        self._setup(
            block_size,
            num_blocks,
            max_model_len,
            window,
            enable_caching,
            use_eagle,
            log_stats,
            hash_algo,
            alphabet,
            kv_events,
            groups_seed,
            kind=kind,
        )


def make_manager_machine(
    factory: ManagerFactory,
    *,
    sliding_window: bool,
    hybrid: bool = False,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    coverage: Coverage | None = None,
    domain: Domain = FULL_DOMAIN,
    kv_events: bool | None = None,
) -> type[ManagerMachine]:
    """A `ManagerMachine` subclass checking `factory`'s managers for one attention type, on
    `domain`, counting what it exercised in `coverage`; with `hybrid`, over 2-4 KV cache groups
    (the first of that type).

    pagedkv's own manager must also word every refusal exactly as the spec does. `kv_events`
    (default: only for pagedkv's own manager) says the factory's managers take
    `enable_kv_cache_events` and emit events to compare.
    """
    own = factory is pagedkv_manager
    name = "SlidingWindowManagerMachine" if sliding_window else "FullAttentionManagerMachine"
    return keep_out_of_working_directory(
        type(
            "HybridManagerMachine" if hybrid else name,
            (HybridManagerMachine if hybrid else ManagerMachine,),
            {
                "factory": staticmethod(factory),
                "semantics": semantics,
                "sliding_window": sliding_window,
                "misuse": misuse,
                "domain": domain,
                "kv_events": own if kv_events is None else kv_events,
                "coverage": coverage if coverage is not None else Coverage(),
            },
        )
    )
