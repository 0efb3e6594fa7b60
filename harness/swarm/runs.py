"""What one swarm run is: its configuration, features and operations, all drawn from its seed.

Swarm testing (Groce et al., "Swarm Testing", ISSTA 2012): instead of enabling every operation
in every run at fixed rates, each run enables a random subset of operations and features, with
random weights. A run without `finish` keeps requests alive until the pool fills; a run without
`admit` chunks never sees chunked prefill ... so interleavings that a uniform mix makes rare
become common in some runs. Each run's configuration is drawn from the whole space, small pools
(where edge cases are dense) most often.

A run's seed is derived from the campaign seed, the layer and the run's index
(`run_seed`), so `--seed` reproduces a campaign and `--replay-run SEED` one run of it.

KV cache events are on in about a third of the runs of an implementation that can emit them,
drawn last from the run's seed, so that every other draw of a seed is the same as before events
were drawn at all (`harness/client/events.py` says when such a run takes them). A hybrid run
(`attention="hybrid"`: 2-4 KV cache groups of mixed attention types over one pool) draws the
single-group configuration first and extends it after every other draw, for the same reason.
A configuration with a sliding-window group then draws its prefix-cache retention interval
(`Domain.retention`), for the same reason again. Then a run of a manager that offers
`evict_blocks` (a KV connector's call) enables it in about half the runs. Last of all, a hybrid
run drawn with prefix caching off and without EAGLE, of a manager that serves Mamba groups
(`offers_mamba_groups`), turns, in two runs out of three, into a Mamba hybrid (vLLM 0.33 caches
Mamba states only in its "align" mode, which pagedkv does not serve yet): one or two Mamba
groups of `max_model_len` tokens a block (vLLM's block size for them with caching off) beside
the attention groups: groups of several block sizes. After that, a run of a manager that
offers vLLM 0.33's full-sequence admission gate (`offers_full_sequence_gate`) admits, in a third
of the runs, every waiting request with `full_sequence_must_fit=True`, as vLLM 0.33's scheduler
does by default (`scheduler_reserve_full_isl`), under a drawn `max_in_flight_tokens`
(`with_full_sequence_gate`), if a request of `max_model_len` tokens fits the empty pool through
the gate (vLLM would not start otherwise: `admits_max_model_len`); such a run chunks its
prefills, as vLLM does by default (the gate decides nothing a whole-prompt step does not).
Last, a run of a manager that takes a KV connector's external tokens (`offers_external_tokens`)
and has no Mamba group plays, in a third of the runs, a connector beside the scheduler: most
admissions then adopt external tokens past their hit, loaded synchronously or asynchronously
(`Admit.external`, `Admit.load_async`). Last of all, a connector run with prefix caching on,
of a manager that keeps a CPU offload tier behind its connector (`offers_offload_tier`), has
one in half the runs (`draw_offload_tier`): the connector's external hits are then the tier's
answer, and every step stores the blocks it computed. The very last draw: a single-group run
with prefix caching off and without EAGLE, the gate or a connector, of a manager that serves
Mamba groups, is in half the runs a model of state layers only (`mamba_alone`), one Mamba group.
After it, in the same place for the hybrid layer: a hybrid run with prefix caching on and
without EAGLE, the gate or a connector, of a manager that serves Mamba prefix caching
(`offers_mamba_align`), is in a quarter of the runs a Mamba-align hybrid
(`with_mamba_align`): one full-attention group and one or two Mamba groups in mode "align" of
the same block size (vLLM 0.33's layout whenever prefix caching is on for a Mamba hybrid), its
retention drawn again; in half of those whose block size exceeds a step's drafts (3) the Mamba
groups have 3 speculative blocks, draft tokens are on and lookahead stays as drawn, in the
others both are off; the run's client plays scheduler steps (`NewStep`, drawn with weight
`NEW_STEP_WEIGHT`) and cuts its chunks as vLLM's scheduler does (`mamba_chunk`), but for a
few unaligned ones (misuse). A quarter, not more: those runs are taken from the hybrid runs
with caching, whose chunked groups' hits are rare already.
After those, a hybrid run with prefix caching on, without EAGLE or a connector and not a
Mamba-align hybrid, of a manager that serves groups of several block sizes with caching
(`offers_mixed_block_sizes`), has in half the runs groups of 1, 2 or 4 times the drawn block
size, chunked groups at their LCM (`with_mixed_block_sizes`).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.protocol import ManagerConfig
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.spec.single_type import SPEC_SINGLE_TYPE_MANAGERS
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.offload import OffloadTierConfig
from pagedkv.vocab.semantics import Semantics

MANAGER_FEATURES = (
    "shared prefixes",  # prompts start with tokens of an earlier request (system prompts)
    "lora",
    "multimodal",
    "salts",
    "prompt logprobs",
    "draft tokens",
    "lookahead",
    "chunked prefill",
)
"""Request and scheduling features a manager run may enable (each on in about half the runs)."""

MANAGER_OPERATIONS: dict[str, tuple[int, int]] = {
    "arrive": (2, 8),
    "admit": (2, 8),
    "step": (8, 32),  # decode steps dominate serving
    "preempt": (1, 3),
    "finish": (1, 4),
    "reset": (1, 1),  # a successful reset empties the cache: rare, as in serving
    "stats": (1, 2),
    "common prefix": (1, 2),
    "hostile": (1, 4),
}
"""The simulated scheduler's moves (`harness/swarm/sampling.py`) and the range each one's weight
is drawn from when a run enables it."""

ALWAYS_ON = frozenset({"arrive", "admit", "step"})
"""Without these a run does nothing a scheduler would."""

POOL_OPERATIONS: dict[str, tuple[int, int]] = {
    "get_new_blocks": (2, 8),
    "touch": (1, 4),
    "free_blocks": (2, 8),
    "free everything": (1, 2),
    "admit": (2, 8),
    "hit": (1, 4),
    "grow": (2, 8),
    "cache_full_blocks": (1, 4),
    "finish": (2, 6),
    "get_cached_block": (1, 4),
    "reset": (1, 1),
    "misuse": (1, 4),
}
"""The block-pool client's moves (`harness/swarm/sampling.py`) and their weight ranges."""

LATE_POOL_OPERATIONS: dict[str, tuple[int, int]] = {"adopt": (1, 3)}
"""Pool moves added after the others, drawn after every other draw of a run's seed (on in
half the runs), so that the runs of every earlier seed keep their configuration."""

KV_EVENTS_SHARE = 1 / 3
"""The share of runs with KV cache events on (of an implementation that can emit them)."""

EVICT_SHARE = 1 / 2
EVICT_WEIGHT = (1, 3)
"""The share of runs that call `evict_blocks` (of a manager that offers it), and the range its
weight is drawn from: rare next to the scheduler's moves, as a connector's failed loads are."""

GATE_SHARE = 1 / 3
"""The share of runs that admit through the full-sequence gate (of a manager that offers it)."""

CONNECTOR_SHARE = 1 / 3
"""The share of runs that play a KV connector (of a manager that takes external tokens)."""

TIER_SHARE = 1 / 2
"""The share of connector runs with prefix caching on that keep a CPU offload tier behind the
connector (of a manager that offers one)."""

MAMBA_TYPES = ("mamba2", "mamba2", "mamba1", "gdn_attn", "linear", "short_conv")
"""The state layers a Mamba group's spec is drawn of (vLLM 0.33's `MambaAttentionBackendEnum`;
Mamba-2 most often): vLLM keeps each in a `MambaSpec` served by its `MambaManager`, Qwen3-Next's
gated delta net (`gdn_attn`) and MiniMax's linear attention (`linear`) included. Two groups of
different types are two groups (their specs differ), as vLLM plans them."""

MAMBA_SHARE = 2 / 3
MAMBA_SPECULATIVE_BLOCKS = (0, 0, 1, 2)
"""The share of hybrid runs with caching off and without EAGLE that become Mamba hybrids (of a
manager that serves Mamba groups), and the `num_speculative_blocks` each Mamba group draws from
(MTP keeps 1-2 draft states). Only runs drawn without caching: a Mamba hybrid takes nothing
from the prefix-cache coverage."""

MAMBA_ALONE_SHARE = 1 / 2
"""The share of single-group runs with caching off and without EAGLE whose group is a Mamba
group (of a manager that serves Mamba groups): a model of state layers only."""

MAMBA_ALIGN_SHARE = 1 / 4
NEW_STEP_WEIGHT = (4, 16)
"""The share of hybrid runs with caching on and without EAGLE, the gate or a connector that
become Mamba-align hybrids (of a manager that serves Mamba prefix caching), and the range the
weight of their scheduler steps (`NewStep`) is drawn from: a step every few calls, so that
hits on states keyed in the same step are refused now and then and adopted at other times."""

MAX_DRAFTS = 3
"""The most draft tokens a step draws (`pagedkv.harness.swarm.sampling`): a Mamba-align run
with drafts gives its Mamba groups that many speculative blocks."""

MIXED_SHARE = 1 / 2
MIXED_RATIOS = (1, 2, 4)
"""The share of hybrid runs with caching on, without EAGLE or a KV connector, whose groups
take several block sizes (of a manager that serves them: `offers_mixed_block_sizes`), and the
multiples of the drawn block size each group draws from (`with_mixed_block_sizes`)."""

ATTENTIONS = ("both", "full", "sliding", "hybrid")
"""What a manager layer draws: single-group runs of either attention type ("both"), of one, or
hybrid runs (the hybrid layer)."""


def attention_spec(block_size: int, sliding_window: int | None) -> KVCacheSpec:
    """The smallest layer of either attention type (one head of size 1): only the block size
    and the window matter to the managers."""
    if sliding_window is None:
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16"
        )
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float16",
        sliding_window=sliding_window,
    )


def chunked_spec(block_size: int, attention_chunk_size: int) -> ChunkedLocalAttentionSpec:
    """The smallest chunked-local-attention layer (one head of size 1)."""
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float16",
        attention_chunk_size=attention_chunk_size,
    )


def hybrid_kv_cache_config(specs: list[KVCacheSpec], num_blocks: int) -> KVCacheConfig:
    """One group of one layer ("layers.<g>") per spec, each layer with its own tensor of
    `num_blocks` pages."""
    names = [f"layers.{group}" for group in range(len(specs))]
    return KVCacheConfig(
        num_blocks,
        {
            name: KVCacheTensor(size=spec.page_size_bytes * num_blocks)
            for name, spec in zip(names, specs, strict=True)
        },
        [KVCacheGroupSpec([name], spec) for name, spec in zip(names, specs, strict=True)],
    )


def _draw_full(rng: random.Random, block_size: int, domain: Domain) -> KVCacheSpec:
    return attention_spec(block_size, None)


def _draw_window(rng: random.Random, block_size: int, domain: Domain) -> KVCacheSpec:
    """Windows of 1 to 4 blocks and a bit, or the domain's narrowest."""
    return attention_spec(
        block_size, domain.window(_log_uniform(rng, 1, 2 * block_size + 2), block_size)
    )


def _draw_chunked(rng: random.Random, block_size: int, domain: Domain) -> KVCacheSpec:
    """Chunks of 1-3 blocks."""
    return chunked_spec(block_size, block_size * rng.randint(1, 3))


def mamba_spec(
    max_model_len: int,
    num_speculative_blocks: int,
    page_size_bytes: int | None,
    mamba_type: str = "mamba2",
) -> MambaSpec:
    """The smallest state layer of `mamba_type` (one float16 state value) in mode "none": one
    block of `max_model_len` tokens, its page padded to `page_size_bytes`, the attention page
    (as vLLM pads it), or not padded (None: no attention layer)."""
    return MambaSpec(
        block_size=max_model_len,
        shapes=[(1,)],
        dtypes=["float16"],
        page_size_padded=page_size_bytes,
        num_speculative_blocks=num_speculative_blocks,
        mamba_type=mamba_type,
    )


def mamba_align_spec(
    block_size: int, page_size_bytes: int, mamba_type: str, speculative: int = 0
) -> MambaSpec:
    """The smallest state layer of `mamba_type` in mode "align": blocks of `block_size`
    tokens (the attention groups'), its page padded to the attention page, with `speculative`
    speculative state blocks."""
    return MambaSpec(
        block_size=block_size,
        shapes=[(1,)],
        dtypes=["float16"],
        page_size_padded=page_size_bytes,
        mamba_type=mamba_type,
        mamba_cache_mode="align",
        num_speculative_blocks=speculative,
    )


def is_mamba_align(config: ManagerConfig) -> bool:
    """Whether `config` has a Mamba group in mode "align" (a Mamba-align hybrid)."""
    return any(
        isinstance(group.kv_cache_spec, MambaSpec)
        and group.kv_cache_spec.mamba_cache_mode == "align"
        for group in config.kv_cache_config.kv_cache_groups
    )


def _draw_mamba(rng: random.Random, config: ManagerConfig) -> KVCacheSpec:
    page = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    speculative = rng.choice(MAMBA_SPECULATIVE_BLOCKS)
    return mamba_spec(config.max_model_len, speculative, page, rng.choice(MAMBA_TYPES))


STATE_DRAWS: dict[type[KVCacheSpec], Callable[[random.Random, ManagerConfig], KVCacheSpec]] = {
    MambaSpec: _draw_mamba,
}
"""The harness's draw of each group type that keeps a state rather than attention KV (drawn by
`with_mamba_groups`), one entry per such entry of the registries of per-type managers."""

SpecDraw = Callable[[random.Random, int, Domain], KVCacheSpec]
"""`draw(rng, block_size, domain)`: one KV cache group's spec of an attention type."""

ATTENTION_DRAWS: dict[type[KVCacheSpec], tuple[float, SpecDraw]] = {
    FullAttentionSpec: (0.2, _draw_full),
    SlidingWindowSpec: (0.35, _draw_window),
    ChunkedLocalAttentionSpec: (0.3, _draw_chunked),
}
"""The harness's draw of each attention type (its share of a hybrid run's new groups, and how
to draw its spec), one entry per entry of the registries of per-type managers
(`pagedkv.single_type.SINGLE_TYPE_MANAGERS`, `pagedkv.spec.single_type`'s): a new attention
type is drawn as soon as it is registered here. The shares sum to 0.85: the rest repeats a
spec drawn before (two groups of one spec, which vLLM looks up together)."""


def draw_hybrid_specs(
    rng: random.Random, first: KVCacheSpec, num_groups: int, *, eagle: bool, domain: Domain
) -> list[KVCacheSpec]:
    """`first` and `num_groups - 1` more groups of one block size, each type drawn by its share
    of `ATTENTION_DRAWS` (an attention type without EAGLE replaced, with EAGLE, by the nearest
    one before it that has it), two groups of one spec now and then (vLLM looks those up
    together)."""
    block_size = first.block_size
    repeat_share = 1 - sum(share for share, _ in ATTENTION_DRAWS.values())
    specs = [first]
    while len(specs) < num_groups:
        roll = rng.random()
        if roll < repeat_share:
            specs.append(rng.choice(specs))  # one spec in two groups
            continue
        draw: SpecDraw = _draw_full
        bound = repeat_share
        for spec_type, (share, type_draw) in ATTENTION_DRAWS.items():
            if not eagle or SPEC_SINGLE_TYPE_MANAGERS[spec_type].supports_eagle:
                draw = type_draw
            bound += share
            if roll < bound:
                break
        specs.append(draw(rng, block_size, domain))
    return specs


class OperationPicker:
    """Draws operation names by a run's weights (a bisection over the cumulative weights)."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.names = list(weights)
        self.cumulative = list(itertools.accumulate(weights[name] for name in self.names))
        self._total = self.cumulative[-1]
        self._last = len(self.names) - 1

    def pick(self, rng: random.Random) -> str:
        index = bisect.bisect_right(self.cumulative, rng.random() * self._total)
        return self.names[min(index, self._last)]


def run_seed(campaign_seed: int, layer: str, index: int) -> int:
    """The seed of run `index` of a campaign: 63 bits of SHA-256 over the three, so that it is
    the same in every process and every Python version."""
    digest = hashlib.sha256(f"{campaign_seed}/{layer}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An int in [low, high], each order of magnitude about equally likely."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def draw_pool_size(rng: random.Random) -> int:
    """Blocks in the pool, the null block included: 2-16 in about half the runs (exhaustion,
    eviction and reuse on every run), up to 64 in a quarter, up to 384 in the rest."""
    roll = rng.random()
    if roll < 0.5:
        return rng.randint(2, 16)
    if roll < 0.75:
        return rng.randint(17, 64)
    return _log_uniform(rng, 65, 384)


def draw_block_size(rng: random.Random) -> int:
    """Tokens a block: 1-16, small ones most often (more block boundaries per token)."""
    return rng.choice((1, 1, 1, 2, 2, 2, 3, 4, 4, 5, 6, 8, 8, 12, 16))


def _draw_weights(
    rng: random.Random, ranges: dict[str, tuple[int, int]], always: frozenset[str]
) -> dict[str, float]:
    """The swarm: each operation off with probability 1/2 (unless always on); each one on gets
    a weight drawn from its range."""
    return {
        name: float(rng.randint(low, high))
        for name, (low, high) in ranges.items()
        if name in always or rng.random() < 0.5
    }


def check_cadence(rng: random.Random, num_blocks: int) -> int:
    """Steps between full checks: every step in one small-pool run in eight (full mode, as the
    hypothesis machines compare), else often enough that a full check costs about as much as a
    few steps (the check is O(pool size))."""
    if num_blocks <= 16 and rng.random() < 1 / 8:
        return 1
    return 16 + num_blocks // 4


@dataclass(frozen=True)
class ManagerRun:
    """One manager run: its seed, configuration, features, operation weights and length.

    Attributes:
        seed: the run's own seed (reproduces it).
        config: what both managers are built from.
        features: the enabled features of `MANAGER_FEATURES`.
        weights: enabled operation -> relative weight.
        alphabet: tokens are drawn from range(alphabet) (2-3: prefixes collide).
        max_live: most requests alive at once.
        num_steps: the run's length.
        check_every: steps between full checks (1: full mode).
        misuse: whether hostile calls may be made.
        domain: what the implementation under test supports (the client sends nothing else).
        full_sequence_gate: whether admissions pass `full_sequence_must_fit=True`.
        external_tokens: whether admissions may adopt a connector's external tokens.
        deferred_frees: whether (a connector run) some frees are deferred.
        sync_failures: whether (a connector run of one group, of a manager with
            `evict_blocks`) some sync loads fail, under vLLM 0.33's "fail" policy.
        offload_tier: the CPU offload tier behind the connector (a connector run), or None.
    """

    seed: int
    config: ManagerConfig
    features: frozenset[str]
    weights: dict[str, float] = field(hash=False)
    alphabet: int
    max_live: int
    num_steps: int
    check_every: int
    misuse: bool
    domain: Domain = FULL_DOMAIN
    full_sequence_gate: bool = False
    external_tokens: bool = False
    deferred_frees: bool = False
    sync_failures: bool = False
    offload_tier: OffloadTierConfig | None = None

    @property
    def block_size(self) -> int:
        return self.config.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.config.kv_cache_config.num_blocks

    @property
    def kv_events(self) -> bool:
        return self.config.enable_kv_cache_events

    @property
    def sliding_window(self) -> int | None:
        """The window of a single-group run (None: full attention, or a hybrid run)."""
        if self.hybrid:
            return None
        spec = self.config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None

    @property
    def specs(self) -> list[KVCacheSpec]:
        return [group.kv_cache_spec for group in self.config.kv_cache_config.kv_cache_groups]

    @property
    def hybrid(self) -> bool:
        return len(self.config.kv_cache_config.kv_cache_groups) > 1

    @property
    def retention(self) -> int | None:
        """The prefix-cache retention interval (None: dense)."""
        return self.config.kv_cache_config.prefix_cache_retention_interval

    def with_num_blocks(self, num_blocks: int) -> ManagerRun:
        """The same run on a pool of `num_blocks` blocks (shrinking tries smaller pools)."""
        specs = self.specs
        kv_cache_config = (
            hybrid_kv_cache_config(specs, num_blocks)
            if self.hybrid
            else uniform_kv_cache_config(specs[0], num_blocks)
        ).with_retention(self.retention)
        config = dataclasses.replace(self.config, kv_cache_config=kv_cache_config)
        return dataclasses.replace(self, config=config)

    def describe(self) -> str:
        """One line: the configuration and what is on."""
        config = self.config
        if self.hybrid:
            attention = "hybrid: " + " + ".join(map(describe_spec, self.specs))
        else:
            attention = describe_spec(self.specs[0])
        flags = [
            attention,
            f"{self.num_blocks} blocks",
            f"block size {self.block_size}",
            f"max_model_len {config.max_model_len}",
            "caching" if config.enable_caching else "no caching",
            config.caching_hash_algo,
        ]
        if config.use_eagle:
            flags.append("eagle")
        if self.retention is not None:
            flags.append(f"retention {self.retention}")
        if config.log_stats:
            flags.append("stats")
        if config.enable_kv_cache_events:
            flags.append("kv events")
        if config.semantics != PAGEDKV_SEMANTICS:
            flags.append(config.semantics.name)
        if self.external_tokens:
            flags.append("KV connector")
        if self.offload_tier is not None:
            tier = self.offload_tier
            threshold = f", store threshold {tier.store_threshold}" * tier.tracks_offers
            flags.append(f"CPU tier of {tier.num_chunks} chunks, {tier.policy}{threshold}")
        on = ", ".join(sorted(self.features)) or "none"
        ops = ", ".join(sorted(self.weights))
        return f"{'; '.join(flags)}; features: {on}; operations: {ops}"

    def histogram_keys(self) -> list[str]:
        """The configuration buckets this run counts in (the coverage table's histogram)."""
        window = self.sliding_window
        if is_mamba_align(self.config):
            attention = f"attention Mamba-align hybrid, {len(self.specs)} groups"
        elif self.hybrid:
            attention = f"attention hybrid, {len(self.specs)} groups"
        elif isinstance(self.specs[0], MambaSpec):
            attention = "attention Mamba states alone"
        else:
            attention = "attention full" if window is None else "attention sliding window"
        keys = [
            f"pool {_size_bucket(self.num_blocks)}",
            f"block size {_block_size_bucket(self.block_size)}",
            attention,
            f"caching {'on' if self.config.enable_caching else 'off'}",
            f"hash {self.config.caching_hash_algo}",
            f"eagle {'on' if self.config.use_eagle else 'off'}",
            f"retention {_retention_bucket(self.retention)}",
            f"events {'on' if self.kv_events else 'off'}",
            "full check every step" if self.check_every == 1 else "full check on a cadence",
        ]
        if self.full_sequence_gate:
            keys.append("admission full-sequence gate")
        if self.external_tokens:
            keys.append("KV connector: external tokens")
        if self.offload_tier is not None:
            keys.append(f"KV connector: CPU offload tier, {self.offload_tier.policy}")
        keys += [f"feature {name}" for name in self.features]
        keys += [f"operation {name}" for name in self.weights]
        return keys


def describe_spec(spec: KVCacheSpec) -> str:
    """A group's attention in words: "full attention", "sliding window 5", "chunks of 8",
    "mamba2 states", "gdn_attn states, 2 speculative"."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding window {spec.sliding_window}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunks of {spec.attention_chunk_size}"
    if isinstance(spec, MambaSpec):
        speculative = spec.num_speculative_blocks
        if spec.mamba_cache_mode == "align":
            return f"{spec.mamba_type} states, align"
        return f"{spec.mamba_type} states" + f", {speculative} speculative" * (speculative > 0)
    return "full attention"


def _retention_bucket(interval: int | None) -> str:
    if interval is None:
        return "dense"
    return "0" if interval == 0 else "per segment"


def _size_bucket(num_blocks: int) -> str:
    if num_blocks <= 16:
        return "2-16 blocks"
    if num_blocks <= 64:
        return "17-64 blocks"
    return "65-384 blocks"


def _block_size_bucket(block_size: int) -> str:
    if block_size <= 2:
        return str(block_size)
    if block_size <= 4:
        return "3-4"
    return "5-16"


def draw_manager_run(
    seed: int,
    *,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    attention: str = "both",
    steps_per_run: int | None = None,
    kv_events: bool = False,
    domain: Domain = FULL_DOMAIN,
    evict_blocks: bool = False,
    mamba_groups: bool = False,
    full_sequence_gate: bool = False,
    external_tokens: bool = False,
    deferred_frees: bool = False,
    offload_tier: bool = False,
    mamba_align: bool = False,
    mixed_block_sizes: bool = False,
) -> ManagerRun:
    """The run of this seed. `attention` (`ATTENTIONS`) restricts the draw;
    `steps_per_run` fixes the run length (default: drawn, 20-2,000 steps, log-uniform);
    `kv_events` says whether the manager under test can emit KV cache events (then they are on
    in about a third of the runs; the layer knows, `harness/swarm/engine.py`); `domain` bounds
    the configurations and features drawn; `evict_blocks` says whether the manager offers
    `evict_blocks` (then about half the runs call it), `mamba_groups` whether it serves Mamba
    groups (then a quarter of the hybrid runs have some: `with_mamba_groups`),
    `full_sequence_gate` whether it offers vLLM 0.33's admission gate (then a third of the runs
    admit through it: `with_full_sequence_gate`), `external_tokens` whether it takes a KV
    connector's external tokens (then a third of the runs without a Mamba group play one),
    `deferred_frees` whether it defers frees (then every connector run pops some),
    `offload_tier` whether it keeps a CPU offload tier behind its connector (then half the
    connector runs with caching have one: `draw_offload_tier`), `mamba_align` whether it
    serves Mamba prefix caching (then a quarter of the hybrid runs with caching on and
    without EAGLE, the gate or a connector are Mamba-align hybrids: `with_mamba_align`),
    `mixed_block_sizes` whether it serves groups of several block sizes with caching (then half
    the other hybrid runs with caching, without EAGLE or a connector, have them:
    `with_mixed_block_sizes`)."""
    rng = random.Random(seed)
    block_size = draw_block_size(rng)
    num_blocks = draw_pool_size(rng)
    # A request may hold up to a quarter of a large pool, at least 1-12 blocks; sometimes more
    # than the whole pool, so that one request alone runs out of blocks and is preempted.
    max_blocks = _log_uniform(rng, 1, max(12, num_blocks // 4))
    max_model_len = max(1, max_blocks * block_size - rng.randint(0, block_size - 1))
    sliding = {"full": False, "sliding": True}.get(attention, rng.random() < 0.45)
    window = _log_uniform(rng, 1, 4 * block_size + 4) if sliding else None
    if window is not None:
        window = domain.window(window, block_size)
    kv_cache_spec = attention_spec(block_size, window)
    config = ManagerConfig(
        uniform_kv_cache_config(kv_cache_spec, num_blocks),
        max_model_len,
        enable_caching=rng.random() < 0.85,
        caching_hash_algo=rng.choice(("sha256", "builtin")),
        use_eagle=rng.random() < 0.25,
        log_stats=rng.random() < 0.5,
        semantics=semantics,
    )
    features = frozenset(name for name in MANAGER_FEATURES if rng.random() < 0.5)
    if not domain.cache_salts:
        features -= {"salts"}
    if not domain.multimodal:
        features -= {"multimodal"}
    if window is not None and not domain.eagle_with_sliding_window:
        config = dataclasses.replace(config, use_eagle=False)
    weights = _draw_weights(rng, MANAGER_OPERATIONS, ALWAYS_ON)
    if not misuse:
        weights.pop("hostile", None)
    num_steps = steps_per_run or _log_uniform(rng, 20, 2_000)
    alphabet = rng.randint(2, 3)
    max_live = _log_uniform(rng, 1, 8 if num_blocks <= 64 else 16)
    check_every = check_cadence(rng, num_blocks)
    if rng.random() < KV_EVENTS_SHARE and kv_events:  # after the others (module docstring)
        config = dataclasses.replace(config, enable_kv_cache_events=True)
    if attention == "hybrid" and domain.max_groups > 1:
        config = hybrid_config(rng, config, domain)
    config = with_retention(rng, config, domain)
    if evict_blocks and rng.random() < EVICT_SHARE:  # late draws (module docstring)
        weights["evict"] = float(rng.randint(*EVICT_WEIGHT))
    hybrid = attention == "hybrid" and domain.max_groups > 1
    cacheless = not config.enable_caching and not config.use_eagle
    if mamba_groups and hybrid and cacheless and rng.random() < MAMBA_SHARE:
        config = with_mamba_groups(rng, config, domain)
    gate = full_sequence_gate and rng.random() < GATE_SHARE  # the last draws
    if gate:
        gated = with_full_sequence_gate(rng, config)
        gate = admits_max_model_len(gated)  # else vLLM would not start: no gate, as before
        config = gated if gate else config
        if gate:  # vLLM chunks prefills by default: the gate acts on chunked admissions
            features |= {"chunked prefill"}
    connector = (
        external_tokens
        and rng.random() < CONNECTOR_SHARE
        and not any(
            isinstance(group.kv_cache_spec, MambaSpec)
            for group in config.kv_cache_config.kv_cache_groups
        )
    )
    tier = (
        draw_offload_tier(rng, num_blocks)
        if connector and offload_tier and config.enable_caching and rng.random() < TIER_SHARE
        else None
    )
    if (  # the last draw of all (module docstring)
        mamba_groups
        and not hybrid
        and cacheless
        and not gate
        and not connector
        and rng.random() < MAMBA_ALONE_SHARE
    ):
        config = mamba_alone(rng, config, max_live)
    aligned = (  # the last draws of a hybrid run (module docstring)
        mamba_align
        and hybrid
        and config.enable_caching
        and not config.use_eagle
        and not gate
        and not connector
        and rng.random() < MAMBA_ALIGN_SHARE
    )
    if aligned:
        # Half the align runs whose blocks hold more than a step's 3 drafts draw drafts, and
        # lookahead as drawn, with 3 speculative state blocks (k < B); the others neither.
        speculative = MAX_DRAFTS if block_size > MAX_DRAFTS and rng.random() < 0.5 else 0
        config = with_mamba_align(rng, config, domain, speculative)
        features = (
            features | {"draft tokens"} if speculative else features - {"draft tokens", "lookahead"}
        )
        weights["new step"] = float(rng.randint(*NEW_STEP_WEIGHT))
    if (  # after the last draw of all: every other run draws as before
        not aligned
        and mixed_block_sizes
        and hybrid
        and config.enable_caching
        and not config.use_eagle
        and not connector
        and rng.random() < MIXED_SHARE
    ):
        mixed = with_mixed_block_sizes(rng, config, domain)
        if not gate or admits_max_model_len(mixed):
            config = mixed
    return ManagerRun(
        seed=seed,
        config=config,
        features=features,
        weights=weights,
        alphabet=alphabet,
        max_live=max_live,
        num_steps=num_steps,
        check_every=check_every,
        misuse=misuse,
        domain=domain,
        full_sequence_gate=gate,
        external_tokens=connector,
        deferred_frees=connector and deferred_frees,
        # vLLM's scheduler handles block-level failures for one group only
        sync_failures=connector
        and evict_blocks
        and len(config.kv_cache_config.kv_cache_groups) == 1,
        offload_tier=tier,
    )


def draw_offload_tier(rng: random.Random, num_blocks: int) -> OffloadTierConfig:
    """A CPU tier behind a connector run's manager, in chunks of one block: in three runs out
    of four 1 to 4 times the GPU pool's blocks (it keeps what the pool evicted: hits past the
    GPU's), else up to the pool's (log-uniform: it evicts); LRU or ARC; in a quarter of the
    runs a store threshold of 2 (a chunk is stored the second time it is offered)."""
    if rng.random() < 3 / 4:
        num_chunks = rng.randint(num_blocks, 4 * num_blocks)
    else:
        num_chunks = _log_uniform(rng, 1, num_blocks)
    return OffloadTierConfig(
        num_chunks=num_chunks,
        policy=rng.choice(("lru", "arc")),
        store_threshold=2 if rng.random() < 0.25 else 1,
    )


def with_full_sequence_gate(rng: random.Random, config: ManagerConfig) -> ManagerConfig:
    """`config` with the `max_in_flight_tokens` a gated run's manager is built with: a third of
    the time max_model_len (no window or chunk group's admission cap binds: vLLM 0.33's default
    engine, whose in-flight tokens dwarf the harness's max_model_len), else 1 to max_model_len
    tokens, log-uniform (a small `max_num_batched_tokens`: the caps bind)."""
    max_model_len = config.max_model_len
    if rng.random() < 1 / 3:
        return dataclasses.replace(config, max_in_flight_tokens=max_model_len)
    return dataclasses.replace(config, max_in_flight_tokens=_log_uniform(rng, 1, max_model_len))


def admits_max_model_len(config: ManagerConfig) -> bool:
    """Whether a request of max_model_len tokens passes the full-sequence gate in the empty pool
    (every group's blocks for it, a window or chunk group's at most its admission cap): vLLM
    0.33 refuses to start otherwise (`check_enough_kv_cache_memory`), and a gated run of such a
    config would leave its long requests waiting for good."""
    max_model_len = config.max_model_len
    in_flight = config.max_in_flight_tokens or max_model_len
    needed = 0
    for group in config.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            needed += spec.blocks_per_request
            continue
        blocks = -(-max_model_len // spec.block_size)
        cap = spec.max_admission_blocks(max_model_len, in_flight)
        needed += blocks if cap is None else min(blocks, cap)
    return needed <= config.kv_cache_config.num_blocks - 1


def with_retention(rng: random.Random, config: ManagerConfig, domain: Domain) -> ManagerConfig:
    """`config` with a prefix-cache retention interval the domain allows
    (`Domain.retention`), if it has a sliding-window group; unchanged otherwise (no draw)."""
    kv_cache_config = config.kv_cache_config
    if not any(
        isinstance(group.kv_cache_spec, SlidingWindowSpec)
        for group in kv_cache_config.kv_cache_groups
    ):
        return config
    interval = domain.retention(rng, kv_cache_config.scheduler_block_size)
    return dataclasses.replace(config, kv_cache_config=kv_cache_config.with_retention(interval))


def mamba_alone(rng: random.Random, config: ManagerConfig, max_live: int) -> ManagerConfig:
    """`config` (one group, caching off) as a model of state layers only (Mamba-1/2 models,
    Falcon-Mamba): its one group becomes a Mamba group (drawn as `_draw_mamba` draws one),
    whose page is the state itself (no attention page to pad to). Its pool holds the states of
    one request to `max_live` requests, uniformly, and the null block: a pool of states is a
    number of concurrent requests, and the drive runs out of it. vLLM 0.33 serves such a model
    through its coordinator without prefix caching and one `MambaManager`."""
    speculative = rng.choice(MAMBA_SPECULATIVE_BLOCKS)
    alone = mamba_spec(config.max_model_len, speculative, None, rng.choice(MAMBA_TYPES))
    per_request = alone.blocks_per_request
    num_blocks = rng.randint(per_request + 1, per_request * max_live + 1)
    return dataclasses.replace(config, kv_cache_config=hybrid_kv_cache_config([alone], num_blocks))


def with_mamba_groups(rng: random.Random, config: ManagerConfig, domain: Domain) -> ManagerConfig:
    """`config` (caching off) as a Mamba hybrid (module docstring): one or two Mamba
    groups (`STATE_DRAWS`) after the attention groups, the last attention groups giving way
    where the domain's `max_groups` leaves no room; dense retention (caching is off)."""
    num_mamba = rng.randint(1, 2)
    specs = [group.kv_cache_spec for group in config.kv_cache_config.kv_cache_groups]
    keep = max(min(len(specs), domain.max_groups - num_mamba), 1)
    specs = specs[:keep] + [
        STATE_DRAWS[MambaSpec](rng, config) for _ in range(min(num_mamba, domain.max_groups - 1))
    ]
    specs = domain.plan_groups(specs)  # no draw: two equal Mamba specs may make one group
    return dataclasses.replace(
        config, kv_cache_config=hybrid_kv_cache_config(specs, config.kv_cache_config.num_blocks)
    )


def with_mamba_align(
    rng: random.Random, config: ManagerConfig, domain: Domain, speculative: int = 0
) -> ManagerConfig:
    """`config` (a hybrid run with caching on, no EAGLE) as a Mamba-align hybrid (module
    docstring): its first group as full attention, then one or two Mamba groups in mode
    "align" of its block size (as many as the domain's `max_groups` leaves room for), each
    with `speculative` speculative blocks, in the same pool; the retention interval drawn
    again (`Domain.retention`: the Mamba groups keep states by it)."""
    block_size = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    full = attention_spec(block_size, None)
    num_mamba = min(rng.randint(1, 2), domain.max_groups - 1)
    specs: list[KVCacheSpec] = [full]
    specs += [
        mamba_align_spec(block_size, full.page_size_bytes, rng.choice(MAMBA_TYPES), speculative)
        for _ in range(num_mamba)
    ]
    specs = domain.plan_groups(specs)  # no draw: two equal Mamba specs may make one group
    interval = domain.retention(rng, block_size)
    kv_cache_config = hybrid_kv_cache_config(specs, config.kv_cache_config.num_blocks)
    return dataclasses.replace(config, kv_cache_config=kv_cache_config.with_retention(interval))


def with_mixed_block_sizes(
    rng: random.Random, config: ManagerConfig, domain: Domain
) -> ManagerConfig:
    """`config` (a hybrid run with caching, no EAGLE, no Mamba group) with groups of several
    block sizes: each attention group's block size times 1, 2 or 4 (`MIXED_RATIOS`; two sizes
    at least), a chunked group's at the LCM S of the others (vLLM 0.33 asserts it), its chunk
    rounded up to S (at twice the other groups' size if they have one); windows kept (as the
    domain allows them at the new size); a retention interval rounded up to S. Unchanged if
    every group is chunked."""
    kv_cache_config = config.kv_cache_config
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    ratios = [rng.choice(MIXED_RATIOS) for _ in specs]
    if len(set(ratios)) == 1:
        ratios[rng.randrange(len(ratios))] = 2 if ratios[0] != 2 else 4
    plain = [
        spec.block_size * ratio
        for spec, ratio in zip(specs, ratios, strict=True)
        if not isinstance(spec, ChunkedLocalAttentionSpec)
    ]
    if not plain:  # chunked groups alone: one size, S
        return config
    scheduler_size = math.lcm(*plain)
    if len(set(plain)) == 1:  # the chunked groups at twice the one other size
        scheduler_size *= 2
    resized: list[KVCacheSpec] = []
    for spec, ratio in zip(specs, ratios, strict=True):
        if isinstance(spec, ChunkedLocalAttentionSpec):
            chunk = -(-spec.attention_chunk_size // scheduler_size) * scheduler_size
            resized.append(chunked_spec(scheduler_size, chunk))
        else:
            size = spec.block_size * ratio
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            resized.append(
                attention_spec(size, None if window is None else domain.window(window, size))
            )
    resized = domain.plan_groups(resized)
    interval = kv_cache_config.prefix_cache_retention_interval
    new_config = hybrid_kv_cache_config(resized, kv_cache_config.num_blocks)
    if interval:
        interval = -(-interval // scheduler_size) * scheduler_size
    if interval is not None:
        new_config = new_config.with_retention(interval)
    return dataclasses.replace(config, kv_cache_config=new_config)


def hybrid_config(rng: random.Random, config: ManagerConfig, domain: Domain) -> ManagerConfig:
    """`config` with 2 to `domain.max_groups` groups, its own spec first (module docstring)."""
    if config.use_eagle and not (domain.eagle_with_hybrid and domain.eagle_with_sliding_window):
        config = dataclasses.replace(config, use_eagle=False)
    kv_cache_config = config.kv_cache_config
    num_groups = rng.randint(2, domain.max_groups)
    first = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    specs = draw_hybrid_specs(rng, first, num_groups, eagle=config.use_eagle, domain=domain)
    specs = domain.plan_groups(specs)  # no draw: the same stream with or without a plan
    # Every group takes a block at each boundary: a pool as many times larger keeps the
    # pressure (exhaustion, eviction) of the single-group draw.
    num_blocks = kv_cache_config.num_blocks * num_groups
    # Requests long against windows and chunks, so that groups free different blocks.
    max_model_len = max(config.max_model_len, first.block_size * rng.randint(6, 24))
    return dataclasses.replace(
        config,
        kv_cache_config=hybrid_kv_cache_config(specs, num_blocks),
        max_model_len=max_model_len,
    )


@dataclass(frozen=True)
class PoolRun:
    """One block-pool run: its seed, configuration, operation weights and length.

    Attributes:
        seed: the run's own seed.
        num_blocks: blocks in the pool, the null block included.
        enable_caching: prefix caching on or off.
        block_size: tokens a block (for the requests whose blocks are cached).
        hash_algo: "sha256" or "builtin".
        semantics: pagedkv's or vLLM 0.8.5's side of the deliberate differences.
        extra_keys: requests may carry LoRA ids, multimodal ranges and (pagedkv) salts.
        weights: enabled operation -> relative weight.
        alphabet: tokens are drawn from range(alphabet).
        num_steps: the run's length.
        check_every: steps between full checks (1: full mode).
        misuse: whether invalid calls may be made.
        kv_events: both pools are built with KV cache events on.
        domain: what the pool under test supports (requests outside it are never drawn).
    """

    seed: int
    num_blocks: int
    enable_caching: bool
    block_size: int
    hash_algo: str
    semantics: Semantics
    extra_keys: bool
    weights: dict[str, float] = field(hash=False)
    alphabet: int
    num_steps: int
    check_every: int
    misuse: bool
    kv_events: bool
    domain: Domain = FULL_DOMAIN

    def with_num_blocks(self, num_blocks: int) -> PoolRun:
        """The same run on a pool of `num_blocks` blocks (shrinking tries smaller pools)."""
        return dataclasses.replace(self, num_blocks=num_blocks)

    def describe(self) -> str:
        ops = ", ".join(sorted(self.weights))
        flags = [
            f"{self.num_blocks} blocks",
            f"block size {self.block_size}",
            "caching" if self.enable_caching else "no caching",
            self.hash_algo,
            "extra keys" if self.extra_keys else "",
            self.semantics.name if self.semantics != PAGEDKV_SEMANTICS else "",
            "kv events" if self.kv_events else "",
        ]
        return f"{'; '.join(flag for flag in flags if flag)}; operations: {ops}"

    def histogram_keys(self) -> list[str]:
        keys = [
            f"pool {_size_bucket(self.num_blocks)}",
            f"block size {_block_size_bucket(self.block_size)}",
            f"caching {'on' if self.enable_caching else 'off'}",
            f"hash {self.hash_algo}",
            f"events {'on' if self.kv_events else 'off'}",
            "full check every step" if self.check_every == 1 else "full check on a cadence",
        ]
        if self.extra_keys:
            keys.append("feature extra keys")
        keys += [f"operation {name}" for name in self.weights]
        return keys


def draw_pool_run(
    seed: int,
    *,
    semantics: Semantics = PAGEDKV_SEMANTICS,
    misuse: bool = True,
    steps_per_run: int | None = None,
    kv_events: bool = False,
    domain: Domain = FULL_DOMAIN,
) -> PoolRun:
    """The pool run of this seed (see `draw_manager_run`); `kv_events` says whether the pool
    under test can emit KV cache events."""
    rng = random.Random(seed)
    num_blocks = draw_pool_size(rng)
    weights = _draw_weights(rng, POOL_OPERATIONS, frozenset({"get_new_blocks", "admit"}))
    if not misuse:
        weights.pop("misuse", None)
    enable_caching = rng.random() < 0.85
    block_size = draw_block_size(rng)
    hash_algo = rng.choice(("sha256", "builtin"))
    extra_keys = rng.random() < 0.5
    alphabet = rng.randint(2, 3)
    num_steps = steps_per_run or _log_uniform(rng, 20, 1_000)
    check_every = check_cadence(rng, num_blocks)
    events_on = rng.random() < KV_EVENTS_SHARE and kv_events
    weights |= _draw_weights(rng, LATE_POOL_OPERATIONS, frozenset())  # after every older draw
    return PoolRun(
        seed=seed,
        num_blocks=num_blocks,
        enable_caching=enable_caching,
        block_size=block_size,
        hash_algo=hash_algo,
        semantics=semantics,
        extra_keys=extra_keys,
        weights=weights,
        alphabet=alphabet,
        num_steps=num_steps,
        check_every=check_every,
        misuse=misuse,
        kv_events=events_on,
        domain=domain,
    )
