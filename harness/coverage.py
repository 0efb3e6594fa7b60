"""What a swarm campaign exercised, and the targets it must meet.

The clients count events as they happen, always on the spec's side (so the counts describe the
drive, whatever the implementation under test does): `Coverage.counts`. Targets are minimum
counts per 100,000 steps, each written down once in `MANAGER_TARGETS` / `POOL_TARGETS` with the
reason for its number. A campaign's counts depend only on its seed and its number of steps, never
on CPU speed, so the CI campaign (a fixed seed and step count) meets or misses its targets the
same way on every machine.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field

CI_SEED = 2_025
"""The CI campaign's seed (`tests/test_swarm_ci_campaign.py`, the planted bugs' campaign
checker)."""
CI_MANAGER_STEPS = 200_000
CI_POOL_STEPS = 100_000
CI_HYBRID_STEPS = 100_000

MIN_STEPS_FOR_TARGETS = 100_000
"""Shorter campaigns print their counts but are not held to targets (too few runs to judge)."""


@dataclass
class Coverage:
    """Counters of one campaign.

    Attributes:
        counts: event -> how often it happened (names as in the targets).
        histogram: configuration bucket, feature or operation -> runs that had it.
        states: hashes of the distinct states seen (each client's digest of the spec's state).
        steps: steps run.
        runs: runs started.
        outcomes: (operation, "returned" / "returned None" / error class) -> calls compared.
    """

    counts: Counter[str] = field(default_factory=Counter)
    histogram: Counter[str] = field(default_factory=Counter)
    states: set[int] = field(default_factory=set)
    steps: int = 0
    runs: int = 0
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def start_run(self, histogram_keys: list[str]) -> None:
        """Count a run, and each configuration bucket, feature and operation it has."""
        self.runs += 1
        for key in histogram_keys:
            self.histogram[key] += 1

    def count_error(self, operation: str, error: Exception) -> None:
        """A call both sides refused: counted by class and by the operation's refusal kind."""
        self.counts[f"typed error {type(error).__name__}"] += 1
        self.counts[f"refusal {operation}: {refusal_kind(error)}"] += 1

    def digest(self) -> str:
        """16 hex digits of SHA-256 over the counts, histogram, states, steps and runs: equal
        digests mean equal coverage (a fixed seed and step count give one on every machine)."""
        text = repr(
            (
                sorted(self.counts.items()),
                sorted(self.histogram.items()),
                sorted(self.states),
                self.steps,
                self.runs,
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def merge(self, other: Coverage) -> None:
        """Add `other`'s counts to these (the coverage of both campaigns' runs together):
        counters summed, distinct states united. Runs are independent, so a campaign split into
        parts and merged has the coverage, and the digest, of the whole."""
        self.counts.update(other.counts)
        self.histogram.update(other.histogram)
        self.states |= other.states
        self.steps += other.steps
        self.runs += other.runs
        self.outcomes.update(other.outcomes)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready form that `from_json` reads back equal (states as a sorted list)."""
        return {
            "counts": dict(sorted(self.counts.items())),
            "histogram": dict(sorted(self.histogram.items())),
            "states": sorted(self.states),
            "steps": self.steps,
            "runs": self.runs,
            "outcomes": [[op, kind, n] for (op, kind), n in sorted(self.outcomes.items())],
        }

    @classmethod
    def from_json(cls, data: object) -> Coverage:
        """The coverage `to_json` wrote.

        Raises:
            ValueError: `data` is not such a form.
        """
        try:
            assert isinstance(data, dict)
            counts, histogram = data["counts"], data["histogram"]
            assert isinstance(counts, dict) and isinstance(histogram, dict)
            coverage = cls(
                Counter({str(k): _count(n) for k, n in counts.items()}),
                Counter({str(k): _count(n) for k, n in histogram.items()}),
                {_count(state, signed=True) for state in data["states"]},
                _count(data["steps"]),
                _count(data["runs"]),
                Counter({(str(op), str(kind)): _count(n) for op, kind, n in data["outcomes"]}),
            )
        except (AssertionError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a coverage record: {error!r}") from None
        return coverage

    def refusals(self, operation: str) -> dict[str, int]:
        """Refusal kind -> count, for one operation (e.g. "allocate_slots")."""
        prefix = f"refusal {operation}: "
        return {
            name.removeprefix(prefix): count
            for name, count in sorted(self.counts.items())
            if name.startswith(prefix)
        }


def _count(value: object, *, signed: bool = False) -> int:
    if type(value) is not int or (value < 0 and not signed):
        raise ValueError(f"expected {'an int' if signed else 'a count'}, got {value!r}")
    return value


def refusal_kind(error: Exception) -> str:
    """The rule an error names: its `rule` attribute, else its message without the request id
    and with every number written N (so one rule is one kind, whatever the arguments)."""
    rule = getattr(error, "rule", None)
    text = str(rule) if rule else str(error)
    if text.startswith("request '"):
        text = text.split("': ", 1)[-1]
    words = ["N" if word.strip("(),.:").lstrip("-").isdigit() else word for word in text.split()]
    return f"{type(error).__name__}: {' '.join(words)}"


@dataclass(frozen=True)
class Target:
    """A minimum count per 100,000 steps, and why that number.

    Attributes:
        counter: the `Coverage.counts` key, or "distinct states", or "kinds of <operation>
            refusals".
        per_100k: the minimum per 100,000 steps (or, without `scales`, the minimum).
        why: why the event matters, in one line.
        needs: the campaign modes it applies to ("misuse", "pagedkv semantics", "kv events":
            the implementation emits KV cache events; "sparse retention": the domain draws a
            retention interval other than dense; "evict_blocks": the manager offers it; "mamba
            groups": it serves Mamba groups (beside attention groups in the hybrid layer, alone
            in the manager layer); "full-sequence gate": it takes
            vLLM 0.33's admission gate; "cache_blocks": it has `cache_blocks`; "offload
            tier": it keeps a CPU offload tier behind its connector; "mamba align": it
            serves Mamba prefix caching, in the hybrid layer; "mixed block sizes": it serves
            groups of several block sizes with caching; "partial prefix keys": with them, under
            semantics that index partial keys); it is shown but not enforced otherwise.
        scales: whether the minimum grows with the campaign's length.
    """

    counter: str
    per_100k: float
    why: str
    needs: frozenset[str] = frozenset()
    scales: bool = True

    def required(self, steps: int) -> int:
        if not self.scales:
            return math.ceil(self.per_100k)
        return math.ceil(self.per_100k * steps / 100_000)


def _t(counter: str, per_100k: float, why: str, *needs: str) -> Target:
    return Target(counter, per_100k, why, frozenset(needs))


def _connector_targets(
    sync: int,
    async_: int,
    landed: int,
    cached: int,
    pushed_out: int,
    refused: int,
    gated: int,
    dropped: int,
    whole: int,
    failed: int,
    failed_first: int,
    held: int,
    sends: int,
) -> tuple[Target, ...]:
    """A KV connector's targets (runs of a manager that takes external tokens), each count per
    100,000 steps."""
    need = "external tokens"
    return (
        _t("KV connector: sync loads", sync, "external tokens cached at the step", need),
        _t(
            "KV connector: async loads", async_, "num_tokens 0, nothing cached until it lands", need
        ),
        _t("KV connector: async loads landed", landed, "cache_blocks when the load lands", need),
        _t(
            "KV connector: blocks cached when a load landed",
            cached,
            "a block being loaded has no hash: no lookup hits it before it lands",
            need,
        ),
        _t(
            "KV connector: hits pushed out, left free for the allocation",
            pushed_out,
            "hits the external tokens move out of a window or chunk: untouched, not counted",
            need,
        ),
        _t(
            "KV connector: admissions refused for lack of blocks",
            refused,
            "every group's external and new blocks fit together, or nothing changes",
            need,
        ),
        _t(
            "KV connector: loads admitted through the full-sequence gate",
            gated,
            "the gate counts each group from its adopted prefix",
            need,
            "full-sequence gate",
        ),
        _t(
            "KV connector: requests aborted while their load was in flight",
            dropped,
            "their blocks stay held until the load finishes, then freed uncached",
            need,
        ),
        _t(
            "KV connector: frees delayed while a send read the blocks",
            sends,
            "a finished request's blocks stay held until finished_sending",
            need,
        ),
        _t(
            "KV connector: admissions while a transfer held a finished request's blocks",
            held,
            "a block a load writes or a send reads is never handed out (vLLM #32255)",
            need,
        ),
        _t(
            "KV connector: whole prompts loaded, the last token recomputed",
            whole,
            "vLLM recomputes the last token of a prompt a load covered (full attention only)",
            need,
        ),
        _t(
            "KV connector: loads failed part-way, the valid prefix cached",
            failed,
            "only the valid prefix is cached; the rest is recomputed in the blocks held",
            need,
        ),
        _t(
            "KV connector: loads failed at their first block, freed",
            failed_first,
            "nothing valid: the request is freed and looked up again",
            need,
        ),
    )


CONNECTOR_TARGETS_MANAGER = _connector_targets(
    750, 900, 700, 90, 25, 110, 450, 30, 130, 20, 22, 120, 40
)
"""About half the CI manager campaign's rates (seed 2025, 200,000 steps: 1,570 sync and 1,882
async loads, 1,565 landed, 490 with blocks cached on landing, 71 pushing hits out, 289 refused,
937 gated, 60 aborted while loading, 684 whole prompts, 44 failed part-way, 107 failed at their
first block, 86 frees delayed by a send, 305 admissions while a transfer held a finished
request's blocks, per 100,000). Since half the connector runs with caching keep a CPU tier,
whose hits are the external tokens (rarer than a drawn length), per 100,000: 226 with blocks
cached on landing, 27 pushing hits out, 330 whole prompts, 56 failed at their first block (CI,
201,511 steps); 189, 99, 264 and 44 (`pagedkv verify --seed 2025`, 400,550 steps); so 90, 25,
130 and 22."""

CONNECTOR_TARGETS_HYBRID = _connector_targets(
    700, 750, 450, 300, 170, 350, 100, 30, 1, 8, 24, 100, 100
)
"""About half the CI hybrid campaign's rates (seed 2025, 100,000 steps: 1,736 sync and 1,768
async loads, 928 landed, 642 with blocks cached on landing, 348 pushing hits out, 1,608
refused, 207 gated, 66 aborted while loading, 49 failed at their first block, 205 frees
delayed by a send, 1,885 admissions while a transfer held a finished request's blocks (small
pools: a send holds its blocks until the next step; 213 to 1,316 against vLLM 0.33.0, seeds
1-5, so 100); 11 whole prompts, hybrids of full attention only, so that target is lower).
Failed part-way: 40 here, 13 to 39 against vLLM 0.33.0 (seeds 1-5, 150,000 steps: its
engine's groups have fewer windows a failure may recompute in), so 8. Whole prompts: 2 since
half the connector runs with caching keep a CPU tier (its hits are rarer), so 1."""


def _offload_tier_targets(hits: int, stored: int, failed: int, resets: int) -> tuple[Target, ...]:
    """The targets of the CPU offload tier behind the connector (connector runs of a manager
    that keeps one), each count per 100,000 steps."""
    need = "offload tier"
    return (
        _t(
            "offload tier: tier hits used as external tokens",
            hits,
            "a chunk loads what its store copied: the attention-truth check reads it",
            need,
        ),
        _t(
            "offload tier: chunks stored from the GPU pool",
            stored,
            "whole chunks of computed blocks, null positions skipped",
            need,
        ),
        _t(
            "offload tier: loads failed",
            failed,
            "a failed load from the tier unpins its chunks; the request recomputes",
            need,
        ),
        _t(
            "offload tier: resets clearing both tiers",
            resets,
            "KV computed before a reset is never read after it (vLLM #57727)",
            need,
        ),
    )


OFFLOAD_TIER_TARGETS_MANAGER = _offload_tier_targets(35, 1_500, 5, 50)
"""About half the CI manager campaign's rates (seed 2025, 201,511 steps: 144 tier hits used,
6,446 chunks stored, 22 loads failed, 216 resets with chunks in the tier), per 100,000."""

OFFLOAD_TIER_TARGETS_HYBRID = _offload_tier_targets(35, 2_000, 1, 15)
"""About half the CI hybrid campaign's rates (seed 2025, 100,071 steps: 71 tier hits used,
9,094 chunks stored, 2 loads failed (no sync failures with several groups), 30 resets with
chunks in the tier)."""


def _deferred_free_targets(
    popped: int, released: int, hit: int, several: int = 0
) -> tuple[Target, ...]:
    """Deferred frees' targets (connector runs of a manager that has `pop_blocks_for_free`),
    each count per 100,000 steps; `several`: batches holding blocks of two groups or more
    (the hybrid layer)."""
    need = "deferred frees"
    targets = [
        _t(
            "deferred frees: requests whose blocks were popped",
            popped,
            "a popped request is gone, its blocks still referenced",
            need,
        ),
        _t(
            "deferred frees: batches released",
            released,
            "each batch released once, at the next step, in free's order",
            need,
        ),
        _t(
            "deferred frees: hits on popped blocks before release",
            hit,
            "a popped cached block may be hit: one reference each, none lost",
            need,
        ),
    ]
    if several:
        targets.append(
            _t(
                "deferred frees: batches of several groups",
                several,
                "group by group, each tail first: the order vLLM #48489 lost",
                need,
            )
        )
    return tuple(targets)


DEFERRED_FREE_TARGETS_MANAGER = _deferred_free_targets(270, 100, 20)
"""About half the CI manager campaign's rates (seed 2025, 201,511 steps: 1,117 requests popped,
411 non-empty batches released, 80 lookups hitting a popped block)."""

DEFERRED_FREE_TARGETS_HYBRID = _deferred_free_targets(380, 220, 30, 220)
"""About half the CI hybrid campaign's rates (seed 2025, 100,071 steps: 758 popped, 452
released, every one holding blocks of several groups, 126 lookups hitting a popped block;
against vLLM 0.33.0, seed 1, 45 such lookups per 100,000: its engine's groups, so 30)."""

MAMBA_ALONE_TARGETS: tuple[Target, ...] = (
    _t(
        "Mamba alone: allocations",
        450,
        "a model of state layers only: one Mamba group, vLLM 0.33's coordinator without caching",
        "mamba groups",
    ),
    _t(
        "Mamba alone: allocations taking no block",
        240,
        "a running request's state is updated in place: one block whatever its length",
        "mamba groups",
    ),
    _t(
        "Mamba alone: speculative state blocks taken",
        60,
        "num_speculative_blocks more blocks per request (MTP's draft states)",
        "mamba groups",
    ),
    _t(
        "Mamba alone: allocations refused for lack of blocks",
        15,
        "the pool holds a few requests' states: one more request finds none free",
        "mamba groups",
    ),
    _t(
        "Mamba alone: requests freed holding state blocks",
        190,
        "the state blocks back to the free queue, each tail first",
        "mamba groups",
    ),
)
"""A manager campaign's runs of one Mamba group (`mamba_alone`: 10-20 runs in 400,000 steps,
so their counts vary by seed). Per 100,000 steps, the CI campaign (seed 2025, 201,511 steps)
reaches 1,905 allocations, 1,182 of them taking no block, 753 speculative blocks, 55
refusals, 717 requests freed holding states; `--against vllm==0.33.0` seeds 1-5 (400,000 steps
each) 934-1,658, 484-873, 122-828, 34-111 and 382-865. Each target is about half the lowest."""

UNALIGNED_TARGET = 4
"""Per 100,000 steps: chunks sent uncut from inside a Mamba block across its end, refused
(misuse, so pagedkv's semantics only; CI: 8)."""

RELOCATED_TARGET = 10
PROMOTED_TARGET = 14
DRAFT_STATES_TARGET = 42
CROSSED_TARGET = 1
"""The targets of Mamba-align runs with drafts (`with_mamba_align` with 3 speculative blocks:
half the align runs whose block size exceeds 3, a few runs a campaign, so their counts vary
much by seed), per 100,000 steps. The CI campaign (seed 2025, 100,071 steps; first) and
`--against vllm==0.33.0` seeds 1-5 (150,161-151,280 steps; in order) reach: 21, 515, 924, 132,
381, 203 speculative blocks relocated (relocation needs a step that passes them:
a prefill chunk or accepted drafts); 28, 722, 523, 50, 409, 1,206 promoted to
running; 362, 2,051, 2,480, 127, 1,104, 3,615 draft states written; 2, 163, 136, 5,
113, 357 boundaries crossed by accepted drafts. Each target is about half the lowest
per 100,000 steps."""

MAMBA_ALIGN_TARGETS: tuple[Target, ...] = (
    _t(
        "Mamba align: scheduler steps",
        900,
        "new_step_starts between calls: the states keyed before it may be hit",
        "mamba align",
    ),
    _t(
        "Mamba align: allocations",
        1_300,
        "full attention and Mamba groups in mode 'align' of one block size, caching on",
        "mamba align",
    ),
    _t(
        "Mamba align: hits",
        55,
        "a cached state after null columns, at a boundary full attention also hits",
        "mamba align",
    ),
    _t(
        "Mamba align: hits adopted",
        40,
        "the request runs on from the hit state; the hit's columns stay null",
        "mamba align",
    ),
    _t(
        "Mamba align: hits cut to a lower state boundary than full attention's",
        20,
        "full attention's hit goes further, but no state is cached there: cut back to one",
        "mamba align",
    ),
    _t(
        "Mamba align: full-attention hits cut to nothing by the Mamba group",
        35,
        "no state cached at any boundary of full attention's hit: no hit at all",
        "mamba align",
    ),
    _t(
        "Mamba align: hits refused in the step that keyed their state",
        9,
        "the state is written by the step's forward pass: the allocation waits for the next step",
        "mamba align",
    ),
    _t(
        "Mamba align: lookups finding a shared-prefix junction",
        75,
        "the scheduler cuts a chunk there so that the state at the junction is cached",
        "mamba align",
    ),
    _t(
        "Mamba align: previous states freed",
        550,
        "a step past a boundary frees the state it started from, walking over null columns",
        "mamba align",
    ),
    _t(
        "Mamba align: decode steps crossing a block boundary",
        450,
        "a decode token past a boundary takes a new running column",
        "mamba align",
    ),
    _t(
        "Mamba align: readmissions hitting a state again",
        30,
        "a preempted request's lookup finds a state cached (its own, or a sibling's)",
        "mamba align",
    ),
    _t(
        "Mamba align: cached states evicted when their block was reused",
        190,
        "a state left in the free queue with its key loses it to a new running column",
        "mamba align",
    ),
    _t(
        "Mamba align: allocations refused for lack of blocks",
        110,
        "the running columns every group lacks exceed the free blocks",
        "mamba align",
    ),
    _t(
        "Mamba align: requests freed holding state blocks",
        200,
        "the running and previous states back to the free queue, null columns skipped",
        "mamba align",
    ),
    _t(
        "Mamba align: evict_blocks of a state a request holds",
        6,
        "a connector evicts a held state: its key goes, the request keeps it",
        "mamba align",
        "evict_blocks",
    ),
    _t(
        "Mamba align: speculative blocks relocated",
        RELOCATED_TARGET,
        "a speculative block the running column passed moves to the table's end, its column null",
        "mamba align",
    ),
    _t(
        "Mamba align: speculative blocks promoted to running",
        PROMOTED_TARGET,
        "the table grows and a speculative block left in place becomes the running column",
        "mamba align",
    ),
    _t(
        "attention truth: Mamba draft states written",
        DRAFT_STATES_TARGET,
        "the worker writes the state after each draft into the speculative columns",
        "mamba align",
    ),
    _t(
        "attention truth: boundaries crossed by accepted drafts",
        CROSSED_TARGET,
        "accepted drafts pass a boundary: its state is copied into its column, then keyed",
        "mamba align",
    ),
    _t(
        "refusal allocate_slots: RequestError: a step starting inside a Mamba block ends by "
        "that block's end",
        UNALIGNED_TARGET,
        "misuse: a chunk vLLM's scheduler never cuts, refused alike, changing nothing",
        "mamba align",
        "misuse",
        "pagedkv semantics",
    ),
)
"""The hybrid campaign's runs of Mamba-align hybrids (`with_mamba_align`: a quarter of the
hybrid runs with caching on and without EAGLE, the gate or a connector, about 7%; 15-25 runs
in 100,000 steps, so their counts vary by seed). Per 100,000 steps, the CI campaign (seed
2025, 100,071 steps; first) and `--against vllm==0.33.0` seeds 1-5 (about 150,000 steps
each; lowest-highest) reach: 2,268 and 1,885-3,528 scheduler steps; 2,917 and 2,746-4,356
allocations; 288 and 113-913 Mamba hits, 177 and 79-259 adopted, 40 and 49-183 cut to a lower
state boundary than full attention's, 117 and 73-254 full-attention hits cut to nothing; 62
and 19-84 same-step refusals; 157 and 185-423 junctions; 1,157 and 1,521-2,011 previous states
freed; 981 and 964-1,501 decode steps crossing a boundary; 217 and 60-848 readmissions hitting
a state; 417 and 589-1,573 cached states evicted at reuse; 267 and 225-1,030 refusals for lack
of blocks; 655 and 439-793 requests freed holding states; 13 and 13-33 evict_blocks of a held
state. Each target is about half the lowest."""

MANAGER_TARGETS: tuple[Target, ...] = (
    _t("decode steps inside a block", 10_000, "the O(1) decode path, the hot path in serving"),
    _t("block fills", 10_000, "each fill caches a block: the prefix cache is built here"),
    _t("new-block allocations", 15_000, "block boundaries crossed by prefill and decode"),
    _t(
        "running steps filling one block",
        2_200,
        "allocate_slots' fast path caches the block (issue 11): a running request, no hits",
    ),
    _t(
        "running steps taking one new block",
        2_000,
        "allocate_slots' fast path hands out the block (issue 11): a running request, no hits",
    ),
    _t(
        "evictions of cached blocks",
        7_000,
        "lazy eviction at reuse time is where a stale hash would leak into later hits",
    ),
    _t("prefix hits, full attention", 500, "shared system prompts hit on admission"),
    _t("prefix hits, sliding window", 500, "a window hit needs a run of cdiv(W - 1, B) blocks"),
    _t(
        "sliding-window hits with leading null blocks",
        170,
        "the hardest hit shape; CI's fixed-seed machine never saw one (issue 10); --against "
        "vllm==0.33.0 seeds 1-5: 198-277 per 100k",
    ),
    _t(
        "hits that use every cached block",
        600,
        "a fully cached prompt must still recompute its last block",
    ),
    _t(
        "preemptions for lack of blocks",
        400,
        "a step's allocate_slots returned None: the request is freed and waits",
    ),
    _t("allocate_slots refused for lack of blocks", 2_000, "the capacity check's False side"),
    _t("decode steps with draft tokens", 5_000, "speculative tokens: scheduled, never cached"),
    _t(
        "blocks left uncached because of draft tokens",
        2_000,
        "where the planted bug 'drafts counted as full blocks' shows",
    ),
    _t("allocations with lookahead slots", 6_000, "lookahead slots get blocks, never hashes"),
    _t(
        "new blocks for lookahead slots only",
        900,
        "where the planted bug 'lookahead ignored' shows",
    ),
    _t("blocks freed by the sliding window", 3_000, "remove_skipped_blocks on the decode path"),
    _t(
        "windows skipping at the boundary token",
        1_500,
        "the window just left a block: where window off-by-one bugs show",
    ),
    _t("chunked prefill steps", 2_000, "a prefill split over several steps"),
    _t("requests with extra keys", 7_000, "LoRA, multimodal and salts change every block hash"),
    _t("prompt-logprobs lookups", 800, "lookups that must skip the cache"),
    _t("successful prefix-cache resets", 1_000, "only when no request holds a block"),
    _t("refused prefix-cache resets", 500, "a reset while blocks are in use changes nothing"),
    _t("finished requests", 10_000, "free + free_block_hashes"),
    _t(
        "BlockStored events taken",
        2_000,
        "keys entering the index, as a router mirroring the cache learns of them",
        "kv events",
    ),
    _t(
        "BlockRemoved events taken",
        1_700,
        "keys leaving at eviction: a missing or duplicate removal misleads every router",
        "kv events",
    ),
    _t("AllBlocksCleared events taken", 280, "a successful reset announced once", "kv events"),
    _t("typed error InvalidArgumentError", 550, "bad counts, drafts, uncached hits", "misuse"),
    _t("typed error RequestError", 300, "impostors, foreign hits, computed tokens", "misuse"),
    _t("typed error BlockStateError", 30, "hits outside the pool, null hits", "misuse"),
    _t("typed error MaxModelLenExceededError", 120, "allocations past max_model_len", "misuse"),
    _t(
        "typed error ArgumentTypeError",
        1_000,
        "the hostile catalog: wrong types, NaN, no Request, mutated scheduler fields",
        "misuse",
    ),
    _t(
        "typed error FrozenRequestFieldError",
        140,
        "the hostile catalog: a request's identity (id, tokens, keys) cannot change",
        "misuse",
    ),
    Target(
        "kinds of allocate_slots refusals",
        12,
        "each precondition of allocate_slots refused at least once (listed below the table)",
        frozenset({"misuse"}),
        scales=False,
    ),
    _t(
        "attention truth: hits checked",
        1_000,
        "every position a hit's next token reads holds the request's own KV (ghost content)",
    ),
    _t(
        "attention truth: hits past null blocks checked, sliding window",
        170,
        "a window hit's nulls must lie wholly before the window of its next token",
    ),
    _t(
        "attention truth: EAGLE hits checked",
        100,
        "the dropped block must leave every position the next token reads cached",
    ),
    _t(
        "attention truth: steps checked",
        25_000,
        "every allocation's tokens read their own KV (windows freed too early show here)",
    ),
    _t(
        "retention: blocks left uncached",
        1_100,
        "sparse retention leaves a window's unreachable blocks out of the index (issue 35)",
        "sparse retention",
    ),
    _t(
        "retention: hits under sparse retention",
        300,
        "each is checked by the attention-truth invariant: a hit uses cached blocks only",
        "sparse retention",
    ),
    _t(
        "retention: hits at a replay boundary",
        110,
        "a resend or a longer sibling hits the run kept at the prompt's replay boundary",
        "sparse retention",
    ),
    _t(
        "retention: hits cut short by blocks not retained",
        150,
        "a hit a dense cache would have made longer: the blocks left out are really gone",
        "sparse retention",
    ),
    _t(
        "evict_blocks: a running request's cached block",
        90,
        "a connector drops a block a request holds: it stays held, never cached again",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a failed load's blocks",
        100,
        "a load that failed part-way: every group's blocks from that position on",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a cached block in the free queue",
        280,
        "the block keeps its place in the queue, its hash gone",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a block two requests share",
        1,
        "the one way to a shared block without a hash (rare: 7 per 100k in CI, 1 with --against)",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a block without a hash (passed over)",
        600,
        "evicting what is not cached changes nothing",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: blocks cached past an evicted one",
        280,
        "the chain goes on through the stored hash, not the block's",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: lookups stopped at an evicted block",
        100,
        "a later request recomputes from the failed block",
        "evict_blocks",
    ),
    _t(
        "full-sequence gate: admissions",
        3_000,
        "vLLM 0.33's scheduler admits through the gate by default (scheduler_reserve_full_isl)",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: admissions refused that the step alone would fit",
        4,
        "the whole prompt must fit before its first chunk is admitted; nothing changes",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: admissions under a window or chunk's cap",
        60,
        "a window or chunk group reserves at most what its reads and the tokens in flight span",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: capped admissions admitted",
        60,
        "the cap lets in a request whose every block would not fit at once",
        "full-sequence gate",
    ),
    _t(
        "cache_blocks after an output",
        10_000,
        "vLLM 0.33's scheduler caches after each output when it decodes speculatively",
        "cache_blocks",
    ),
    _t(
        "cache_blocks after an output: blocks cached before the next step",
        800,
        "accepted draft tokens filled a block: cached now, not at the next allocation",
        "cache_blocks",
    ),
    *CONNECTOR_TARGETS_MANAGER,
    _t(
        "KV connector: sync loads failed, their blocks evicted",
        60,
        "vLLM's \"fail\" policy: a failed sync load's blocks lose their hashes before any lookup",
        "external tokens",
        "evict_blocks",
    ),
    *DEFERRED_FREE_TARGETS_MANAGER,
    *OFFLOAD_TIER_TARGETS_MANAGER,
    *MAMBA_ALONE_TARGETS,
    _t("distinct states", 10_000, "block tables, free and cached counts: the drive goes wide"),
)
"""The manager campaign's targets: each about half the rate the CI campaign (`CI_SEED`,
`CI_MANAGER_STEPS`) reaches, so that they catch a drive that stopped exercising something
(a feature never drawn, an operation that always fails early) without flapping when the drive
changes a little."""

POOL_TARGETS: tuple[Target, ...] = (
    _t("blocks handed out", 35_000, "get_new_blocks from the free queue's head"),
    _t("evictions of cached blocks", 3_000, "lazy eviction at reuse time"),
    _t("touches of free cached blocks", 600, "a hit takes a block off the free queue"),
    _t("blocks freed", 30_000, "free_blocks appends to the tail in the caller's order"),
    _t("blocks cached", 4_000, "cache_full_blocks hashing and indexing"),
    _t("cache hits", 2_000, "get_cached_block finding a block"),
    _t("successful prefix-cache resets", 120, "only when nothing is in use"),
    _t(
        "BlockStored events taken",
        450,
        "cache_full_blocks announcing the keys new to the index",
        "kv events",
    ),
    _t("BlockRemoved events taken", 770, "the last block of a key evicted at reuse", "kv events"),
    _t(
        "AllBlocksCleared events taken",
        30,
        "a successful reset announced once (rare: resets, in runs with events on)",
        "kv events",
    ),
    _t("typed error BlockStateError", 750, "freeing free blocks, foreign ids", "misuse"),
    _t("typed error InvalidArgumentError", 380, "negative counts, bad cache ranges", "misuse"),
    _t("typed error NoFreeBlocksError", 190, "asking for more blocks than are free", "misuse"),
    _t(
        "typed error ArgumentTypeError",
        750,
        "the hostile catalog: wrong types, NaN, unhashable keys for every pool call",
        "misuse",
    ),
    _t("distinct states", 10_000, "ref counts and cached counts: the drive goes wide"),
)
"""The block-pool campaign's targets (about half the CI campaign's rates, `CI_POOL_STEPS`)."""


MIXED_BLOCK_SIZE_TARGETS = (
    _t(
        "mixed block sizes: allocations",
        1_700,
        "groups of several block sizes with prefix caching: each group its own blocks",
        "mixed block sizes",
    ),
    _t(
        "mixed block sizes: hits of S-multiples, tables of different lengths",
        180,
        "a hit of a multiple of S tokens, hit/B_g blocks in each group",
        "mixed block sizes",
    ),
    _t(
        "mixed block sizes: full blocks left unhashed below S",
        3_600,
        "a group smaller than S hashes its full blocks only up to the last S boundary",
        "mixed block sizes",
    ),
    _t(
        "mixed block sizes: unhashed blocks freed early",
        600,
        "a window or chunk frees blocks whose hashes were still delayed",
        "mixed block sizes",
    ),
    _t(
        "mixed block sizes: window hits with leading null blocks",
        55,
        "a window group's hit masked below the blocks the window reads",
        "mixed block sizes",
    ),
    _t(
        "mixed block sizes: partial keys created",
        100,
        "vllm-0.33 indexes a block under the key of a shorter prefix too (partial_prefix_keys)",
        "mixed block sizes",
        "partial prefix keys",
    ),
)
"""The hybrid layer's targets for groups of several block sizes with caching (the mode "mixed
block sizes": the factory offers them, `offers_mixed_block_sizes`): about half the CI hybrid
campaign's counts (seed 2025, 100,000 steps, the Mamba-align hybrids drawn first: 4,342
allocations, 403 hits, 8,143 blocks left unhashed, 2,171 freed early, 114 window hits with
leading nulls; under `--semantics vllm-0.33` 4,661, 475, 8,604, 2,346, 171); partial keys,
made only under vllm-0.33's semantics (mode "partial prefix keys"), about half of
`--semantics vllm-0.33` on seed 2025 (214). `--against vllm==0.33.0` offers both modes; its
seeds 1-5 (150,000 steps) reach less per 100,000 steps (allocations 1,970, hits 210, blocks
left unhashed 4,210 at least), so those three targets sit below them: 1,700, 180, 3,600."""


HYBRID_TARGETS: tuple[Target, ...] = (
    _t(
        "hybrid hits",
        1_700,  # 2,500 before --against drew mixed sizes: vLLM seeds 1-5 then 1,921 at least
        "a prefix hit valid in every KV cache group (CI: 4,087)",
    ),
    _t(
        "hybrid hits cut short by one group",
        450,
        "one group's longest hit is shorter than another's: the hit is the shortest",
    ),
    _t(
        "hybrid hits found again after a later group shortened them",
        2,
        "a windowed group's hit, cut to a shorter length, may be no hit: it must be found again "
        "(rare and clustered: 4-168 per 150,000 steps over 20 seeds against vLLM 0.33.0)",
    ),
    _t(
        "hybrid hits with leading null blocks, windowed group",
        900,  # 1,400 before --against drew mixed sizes: vLLM seeds 1-5 then 1,000 at least
        "a sliding-window group's hit skips what its window no longer reads (CI: 2,920)",
    ),
    _t(
        "hybrid hits with leading null blocks, chunked group",
        480,  # 900, 800 before Mamba-align, then mixed-size hybrids took runs: vLLM 532 at least
        "a chunked group's hit skips the chunks before its last (CI: 1,975)",
    ),
    _t(
        "hybrid allocations refused for lack of blocks",
        6_000,
        "all or nothing: a refused allocation changes no group",
    ),
    _t(
        "hybrid refusals where each group alone would fit",
        5_000,
        "capacity is counted over every group together, not group by group",
    ),
    _t("hybrid blocks freed by a sliding window", 20_000, "per-group frees of skipped blocks"),
    _t("hybrid blocks freed at a chunk boundary", 7_000, "a new chunk frees the last one's blocks"),
    _t(
        "hybrid requests freed from several groups",
        4_000,
        "free goes group by group, each tail first: the free queue's order shows it",
    ),
    _t("block fills", 12_000, "each fill caches a block in every group"),
    _t(
        "evictions of cached blocks",
        25_000,  # 30,000 before --against drew mixed sizes: vLLM seeds 1-5 then 27,054 at least
        "one group's allocation may evict another's blocks (CI: 57,713)",
    ),
    _t("decode steps with draft tokens", 5_500, "speculative tokens in every group"),
    _t("allocations with lookahead slots", 7_000, "lookahead slots in every group"),
    _t("requests with extra keys", 2_500, "extra keys change every group's keys alike"),
    _t("finished requests", 3_500, "free + free_block_hashes"),
    _t("successful prefix-cache resets", 500, "a reset empties every group's index"),
    _t(
        "BlockStored events taken",
        11_000,
        "every group's keys entering the index, each event naming its group",
        "kv events",
    ),
    _t("BlockRemoved events taken", 12_000, "every group's keys leaving the index", "kv events"),
    _t(
        "refusal allocate_slots: RequestError: new_computed_blocks must cover the same blocks in "
        "every KV cache group",
        2,
        "hits of unequal length are refused (8 in the CI campaign since runs call evict_blocks, "
        "3 since groups of several block sizes took a share of the runs with caching)",
        "misuse",
    ),
    _t(
        "typed error ArgumentTypeError",
        900,
        "the hostile catalog, hits not one list per group",
        "misuse",
    ),
    Target(
        "kinds of allocate_slots refusals",
        12,
        "each precondition of allocate_slots refused at least once",
        frozenset({"misuse"}),
        scales=False,
    ),
    _t(
        "attention truth: hits checked",
        2_000,  # 2,500 before --against drew mixed sizes: vLLM seeds 1-5 then 2,305 at least
        "every group's hit holds the request's own KV where its next token reads (2,800 before "
        "a third of the runs admitted through the full-sequence gate)",
    ),
    _t(
        "attention truth: hits past null blocks checked, sliding window",
        1_100,  # 1,400 before --against drew mixed sizes: vLLM seeds 1-5 then 1,268 at least
        "a windowed group's nulls lie wholly before the window of the hit's next token (CI: 2,938)",
    ),
    _t(
        "attention truth: hits past null blocks checked, chunked local attention",
        750,  # 800 before --against drew mixed sizes: vLLM seeds 1-5 then 841 at least
        "a chunked group's nulls lie wholly before the chunk of the hit's next token (CI: 1,986)",
    ),
    _t(
        "attention truth: EAGLE hits checked",
        300,
        "vLLM 0.33's EAGLE hit: one block past the length, then dropped, in every group",
    ),
    _t(
        "attention truth: steps checked",
        28_000,
        "every allocation's tokens read their own KV in every group",
    ),
    _t(
        "retention: blocks left uncached",
        7_000,
        "a sparse window group leaves blocks out while full attention caches them all",
        "sparse retention",
    ),
    _t(
        "retention: hits under sparse retention",
        950,
        "each is checked by the attention-truth invariant: a hit uses cached blocks only",
        "sparse retention",
    ),
    _t(
        "retention: hits at a replay boundary",
        330,
        "a resend or a longer sibling hits the run kept at the prompt's replay boundary",
        "sparse retention",
    ),
    _t(
        "retention: hits cut short by blocks not retained",
        600,
        "a window group's hit shortened (or refused) because its blocks were left out",
        "sparse retention",
    ),
    _t(
        "retention: lookups finding a shared-prefix junction",
        380,
        "a hybrid hit cut short by a sparse group pins the junction, whose tail is then kept",
        "sparse retention",
    ),
    _t(
        "evict_blocks: a running request's cached block",
        160,
        "a connector drops a block a request holds: it stays held, never cached again",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a failed load's blocks",
        190,
        "a load that failed part-way: every group's blocks from that position on",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a cached block in the free queue",
        320,
        "the block keeps its place in the queue, its hash gone",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a block two requests share",
        12,
        "the one way to a shared block without a hash",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: a block without a hash (passed over)",
        430,
        "evicting what is not cached changes nothing",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: blocks cached past an evicted one",
        650,
        "the chain goes on through the stored hash, not the block's",
        "evict_blocks",
    ),
    _t(
        "evict_blocks: lookups stopped at an evicted block",
        270,  # 1,360 before the connector runs, whose loads cache the evicted chains again: 561
        "a later request recomputes from the failed block",
        "evict_blocks",
    ),
    _t(
        "Mamba hybrids: allocations",
        1_000,
        "Mamba groups of max_model_len-token blocks beside attention groups, caching off",
        "mamba groups",
    ),
    _t(
        "Mamba hybrids: steps where groups took different numbers of blocks",
        500,
        "groups of several block sizes: each group's own count, all fitting together",
        "mamba groups",
    ),
    _t(
        "Mamba hybrids: allocations refused for lack of blocks",
        200,
        "the blocks every group lacks, summed, exceed the free ones",
        "mamba groups",
    ),
    _t(
        "Mamba hybrids: speculative state blocks taken",
        300,
        "num_speculative_blocks more blocks per Mamba group (MTP's draft states)",
        "mamba groups",
    ),
    _t(
        "Mamba hybrids: requests freed holding state blocks",
        160,
        "every group's blocks back, the state blocks too",
        "mamba groups",
    ),
    *MIXED_BLOCK_SIZE_TARGETS,
    _t(
        "full-sequence gate: admissions",
        1_000,
        "vLLM 0.33's scheduler admits through the gate by default (scheduler_reserve_full_isl)",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: admissions refused that the step alone would fit",
        15,
        "the whole prompt must fit before its first chunk is admitted; nothing changes",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: admissions under a window or chunk's cap",
        250,
        "a window or chunk group reserves at most what its reads and the tokens in flight span",
        "full-sequence gate",
    ),
    _t(
        "full-sequence gate: capped admissions admitted",
        250,
        "the cap lets in a request whose every block would not fit at once",
        "full-sequence gate",
    ),
    _t(
        "cache_blocks after an output",
        10_000,
        "vLLM 0.33's scheduler caches after each output when it decodes speculatively",
        "cache_blocks",
    ),
    _t(
        "cache_blocks after an output: blocks cached before the next step",
        1_000,
        "accepted draft tokens filled a block: cached now, not at the next allocation",
        "cache_blocks",
    ),
    *CONNECTOR_TARGETS_HYBRID,
    *DEFERRED_FREE_TARGETS_HYBRID,
    *OFFLOAD_TIER_TARGETS_HYBRID,
    *MAMBA_ALIGN_TARGETS,
    _t("distinct states", 20_000, "block tables of every group: the drive goes wide"),
)
"""The hybrid campaign's targets (`attention="hybrid"`): about half the CI hybrid campaign's
rates (`CI_SEED`, `CI_HYBRID_STEPS`)."""


@dataclass(frozen=True)
class TargetResult:
    target: Target
    count: int
    required: int
    enforced: bool

    @property
    def met(self) -> bool:
        return self.count >= self.required


def evaluate(
    coverage: Coverage, targets: tuple[Target, ...], modes: frozenset[str]
) -> list[TargetResult]:
    """Each target against the campaign's counts; enforced only when it applies to the
    campaign's modes and the campaign ran at least `MIN_STEPS_FOR_TARGETS` steps."""
    long_enough = coverage.steps >= MIN_STEPS_FOR_TARGETS
    results = []
    for target in targets:
        if target.counter == "distinct states":
            count = len(coverage.states)
        elif target.counter.startswith("kinds of ") and target.counter.endswith(" refusals"):
            operation = target.counter.removeprefix("kinds of ").removesuffix(" refusals")
            count = len(coverage.refusals(operation))
        else:
            count = coverage.counts[target.counter]
        enforced = long_enough and target.needs <= modes
        results.append(TargetResult(target, count, target.required(coverage.steps), enforced))
    return results


def unmet(results: list[TargetResult]) -> list[TargetResult]:
    return [result for result in results if result.enforced and not result.met]


def render_targets(results: list[TargetResult], indent: str = "  ") -> list[str]:
    """The coverage table: one line per target, with its count, minimum and verdict."""
    width = max(len(result.target.counter) for result in results)
    lines = [f"{indent}{'coverage':<{width}}  {'count':>11}  {'target':>10}"]
    for result in results:
        verdict = "(not enforced)" if not result.enforced else "met" if result.met else "UNMET"
        lines.append(
            f"{indent}{result.target.counter:<{width}}  {result.count:>11,}  "
            f">= {result.required:>7,}  {verdict}"
        )
    return lines


def render_histogram(coverage: Coverage, indent: str = "  ") -> list[str]:
    """Runs per configuration bucket, feature and operation, as a share of all runs."""
    runs = max(coverage.runs, 1)
    groups: dict[str, list[str]] = {}
    for key in sorted(coverage.histogram):
        group, _, value = key.partition(" ")
        if group in ("feature", "operation", "full"):
            group = {"full": "checks"}.get(group, group + "s")
            value = key.removeprefix("feature ").removeprefix("operation ")
        groups.setdefault(group, []).append(f"{value} {100 * coverage.histogram[key] / runs:.0f}%")
    return [f"{indent}{group:<11}{', '.join(values)}" for group, values in groups.items()]


KNOWN_BUG_STATES = "states of a known bug: "
"""The counters of the states each known bug (`pagedkv.spec.known_bugs`) led to."""


def render_known_bugs(coverage: Coverage, indent: str = "  ") -> list[str]:
    """Each known bug whose states the campaign reached, with their count."""
    return [
        f"{indent}{count:>9,}  {name.removeprefix(KNOWN_BUG_STATES)}"
        for name, count in sorted(coverage.counts.items())
        if name.startswith(KNOWN_BUG_STATES)
    ]


def render_refusals(coverage: Coverage, operation: str, indent: str = "  ") -> list[str]:
    """Each refusal kind of one operation seen, with its count."""
    return [f"{indent}{count:>9,}  {kind}" for kind, count in coverage.refusals(operation).items()]
