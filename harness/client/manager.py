"""The simulated scheduler: the one client every manager check drives, spec and impl in lock-step.

`ManagerClient.execute` runs one operation (`harness/client/manager_ops.py`) on a `ComparedPair`
of managers: arrivals whose prompts may share prefixes with earlier requests (their output tokens
included, so sliding-window hits with leading null blocks happen), admissions (prefix lookup,
then `allocate_slots` with the hits, whole or chunked, with lookahead slots), prefill chunks and
decode steps with draft tokens, preemption when `allocate_slots` returns None, finishing, resets,
stats, common-prefix queries, hostile calls (`harness/client/hostile.py`) and takes of both
managers' KV cache events. A run with a KV connector adopts external tokens; with a CPU offload
tier behind it (both managers hold one), the connector looks the tier up past the local hit,
loads its hit chunks, stores every step's computed blocks, and tells the spec's ghost state what
each chunk holds (docs/semantics.md, "The tier behind the connector"). What an operation asks
for is clamped to what the state allows, so any subsequence of operations runs. Every event the
coverage table names is counted on the spec's side (`harness/coverage.py`).

The swarm samples operations (`harness/swarm/sampling.py`), the hypothesis machines draw them
(`harness/machines/manager.py`), the exhaustive search enumerates them
(`proofs/exhaustive/manager_world.py`): all three run them here. The client honours a `Domain`
(what an implementation under test supports): outside it, it sends nothing. It keeps its own
record of each request it sent (`harness/client/requests.py`) and holds the `Request` to it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.adapters import SpecManagerAdapter, pagedkv_manager, spec_manager
from pagedkv.harness.client.events import EventConsumer
from pagedkv.harness.client.hostile import HOSTILE_CALLS, HostileCall, Scene
from pagedkv.harness.client.manager_ops import (
    Admit,
    Arrive,
    CommonPrefix,
    Evict,
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
from pagedkv.harness.client.requests import RequestRecord, new_request
from pagedkv.harness.comparison import ComparedPair, describe_difference, differing_fields
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.divergence import Divergence
from pagedkv.harness.domain import FULL_DOMAIN, Domain, MultimodalInputs
from pagedkv.harness.probes import manager_probe
from pagedkv.harness.protocol import (
    NOT_REPORTED,
    GroupIds,
    ManagerConfig,
    ManagerFactory,
    ManagerUnderTest,
)
from pagedkv.offload import OffloadTier
from pagedkv.spec.block_pool import NULL_BLOCK_ID
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.offload import SpecOffloadTier
from pagedkv.spec.single_type.mamba import mamba_chunk
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.vocab.offload import (
    LookupResult,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    StoreOutput,
    make_offload_key,
)
from pagedkv.vocab.request import Request

HISTORY = 32
"""Earlier token lists a new prompt may start with (the most recent ones)."""


@dataclass
class Live:
    """A request the scheduler knows: waiting (no blocks) or running; `loading`: running,
    its external tokens' async load not landed yet (vLLM 0.33's WAITING_FOR_REMOTE_KVS)."""

    record: RequestRecord
    running: bool = False
    loading: bool = False
    load_start: int = 0
    """Where its async load starts (its local hit, in tokens)."""
    load_keys: tuple[OffloadKey, ...] = ()
    """The CPU tier chunks its async load pins until it lands, fails or finishes."""


@dataclass(frozen=True)
class StatesBefore:
    """What an allocation of a run with Mamba groups is counted against, read before it: the
    state blocks the request's Mamba groups held (mode "align"), whether its hits were
    deferred, and whether each block it may take was cached."""

    states: set[int]
    deferred: bool
    hashed: dict[int, bool]


@dataclass(frozen=True)
class Earlier:
    """Tokens of an earlier request (prompt, or all tokens when it left) and its extra keys."""

    tokens: tuple[int, ...]
    lora: int | None
    mm: MultimodalInputs
    salt: str | None


class ManagerClient:
    """Plays a scheduler against a spec manager and a manager under test (module docstring).

    Attributes:
        pair: the two managers and the comparison schedule.
        spec: the spec manager itself (read for coverage and to keep calls valid).
        config: what both managers were built from.
        coverage: where events are counted (a campaign shares one across its runs).
        live: the requests the scheduler knows, in arrival order.
        history: earlier requests a new prompt may share a prefix with, oldest first.
        num_arrived: requests arrived so far (numbers their ids).
    """

    def __init__(
        self,
        pair: ComparedPair[Any],
        spec: SpecKVCacheManager,
        config: ManagerConfig,
        coverage: Coverage,
        *,
        hostile_calls: Mapping[str, HostileCall] = HOSTILE_CALLS,
        domain: Domain = FULL_DOMAIN,
        full_sequence_gate: bool = False,
        cache_after_output: bool = False,
        external_tokens: bool = False,
        offload_tier: OffloadTierConfig | None = None,
    ) -> None:
        self.pair = pair
        self.offload_tier = offload_tier
        """The CPU offload tier behind the connector (both managers hold one), or None: then
        the connector's external hits are its word (`Admit.external`), else the tier's."""
        self.tier_requests: dict[str, OffloadRequest] = {}
        """What each live request's tier calls carry (where its keys' chunks end)."""
        self.store_cursor: dict[str, int] = {}
        """Request id -> the blocks of it offered to the tier so far."""
        self.store_jobs: list[tuple[OffloadRequest, tuple[OffloadKey, ...]]] = []
        """Store jobs in flight, oldest first: completed, failed or left pending at a step."""
        self.external_tokens = external_tokens
        """Whether admissions adopt a KV connector's external tokens (`Admit.external`)."""
        self.full_sequence_gate = full_sequence_gate
        """Whether admissions pass `full_sequence_must_fit=True` (vLLM 0.33's scheduler)."""
        self.cache_after_output = cache_after_output
        """Whether every output of a running request is followed by `cache_blocks(request,
        num_computed_tokens)`, as vLLM 0.33's scheduler does when it decodes speculatively."""
        self.spec = spec
        self.config = config
        self.coverage = coverage
        self.hostile_calls = hostile_calls
        self.domain = domain
        self.layers = tuple(group.kv_cache_spec for group in config.kv_cache_config.kv_cache_groups)
        self.hybrid = len(self.layers) > 1
        layer = self.layers[0]
        self.block_size = layer.block_size
        window = layer.sliding_window if isinstance(layer, SlidingWindowSpec) else None
        self.window = None if self.hybrid else window
        """The sliding window of a single-group manager (None for full attention, and for a
        hybrid manager, whose groups are in `layers`)."""
        # The most token slots a request may hold: max_model_len rounded up to whole blocks, of
        # every group's size (a Mamba group's block is max_model_len long).
        self.max_tokens = min(
            -(-config.max_model_len // layer.block_size) * layer.block_size for layer in self.layers
        )
        self.mamba_groups = tuple(
            group for group, layer in enumerate(self.layers) if isinstance(layer, MambaSpec)
        )
        """The Mamba groups (a Mamba hybrid run: caching off, groups of several block sizes;
        or a Mamba-align hybrid: caching on, one block size)."""
        self.align = any(
            isinstance(layer, MambaSpec) and layer.mamba_cache_mode == "align"
            for layer in self.layers
        )
        """Whether the Mamba groups cache states (mode "align"): the client then cuts chunks
        as vLLM's scheduler does (`mamba_chunk`) and counts what a Mamba-align hybrid
        exercised (`harness/coverage.py`, "mamba align")."""
        self.preempted: set[str] = set()
        """The requests preempted so far (their next lookup is a readmission)."""
        self.drops_blocks = any(manager.allows_null_blocks for manager in spec.managers)
        """Whether a request's leading blocks may be dropped for the null block (a window or a
        chunk boundary); under full attention alone they never are (a spec invariant)."""
        self.caching = config.enable_caching
        self.mixed = self.caching and len({layer.block_size for layer in self.layers}) > 1
        """Groups of several block sizes with prefix caching: hits are multiples of their LCM
        `scheduler_block_size`; group 0's hit blocks times its block size are the hit's
        tokens."""
        self.scheduler_block_size = config.kv_cache_config.scheduler_block_size
        self.live: list[Live] = []
        self.receiving: list[Live] = []
        """Requests aborted while their async load was in flight: they keep their blocks until
        the connector reports the load finished (vLLM 0.33: `finished_recving`), the oldest
        at the next step."""
        self.sending: list[Live] = []
        """Finished requests whose free the connector delays while it sends their KV (vLLM:
        `request_finished` returned True): freed at `finished_sending`, the oldest at the
        next step."""
        self.deferred: list[tuple[list[int], ...]] = []
        """Deferred frees (`pop_blocks_for_free`: a step in flight may read the blocks), each
        group's popped block ids: released together at the next step, as vLLM 0.33's
        scheduler releases them once the step's output is processed."""
        self.history: list[Earlier] = []
        self.num_arrived = 0
        self.events = EventConsumer()
        # No None inside: before Python 3.12, hash(None) differs from process to process.
        self._config_key = hash(
            (config.kv_cache_config.num_blocks, *map(_layer_key, self.layers), self.caching)
        )
        pair.beyond_snapshots = self.check_requests

    @classmethod
    def build(
        cls,
        config: ManagerConfig,
        factory: ManagerFactory,
        coverage: Coverage,
        *,
        check_every: int,
        hostile_calls: Mapping[str, HostileCall] = HOSTILE_CALLS,
        domain: Domain = FULL_DOMAIN,
        full_sequence_gate: bool = False,
        cache_after_output: bool = False,
        external_tokens: bool = False,
        offload_tier: OffloadTierConfig | None = None,
    ) -> ManagerClient:
        """A client over a fresh spec manager and a fresh `factory` manager built from `config`
        (pagedkv's own manager must also word each refusal as the spec does); with
        `offload_tier`, each holds a CPU offload tier of that shape (`attach_offload_tier`)."""
        spec = spec_manager(config)
        impl = factory(config)
        if offload_tier is not None:
            _manager_of(spec).attach_offload_tier(SpecOffloadTier(offload_tier))
            _manager_of(impl).attach_offload_tier(OffloadTier(offload_tier))
        pair: ComparedPair[Any] = ComparedPair(
            spec,
            impl,
            manager_probe,
            check_every=check_every,
            same_messages=factory is pagedkv_manager,
            outcomes=coverage.outcomes,
        )
        assert isinstance(spec, SpecManagerAdapter)
        return cls(
            pair,
            spec.manager,
            config,
            coverage,
            hostile_calls=hostile_calls,
            domain=domain,
            full_sequence_gate=full_sequence_gate,
            cache_after_output=cache_after_output,
            external_tokens=external_tokens,
            offload_tier=offload_tier,
        )

    def __getstate__(self) -> dict[str, object]:
        """A copy of the client and its pair (the exhaustive search's states); the copy counts
        its coverage afresh."""
        state = dict(self.__dict__)
        state["coverage"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.coverage = Coverage()

    # -- executing operations -----------------------------------------------------------------

    def execute(self, op: ManagerOp) -> None:
        """Apply one operation to both managers, compare, and count what it exercised.

        Raises:
            Divergence: the two managers (or a request and the client's record of it) differ.
            InvariantViolation: the spec broke an invariant.
        """
        if isinstance(op, Step):
            self._release_deferred(op.release_twice)
            if self.store_jobs:
                self._end_store(op.store)
            if self.receiving:
                self._load_finished(self.receiving.pop(0))
            if self.sending:
                self._send_finished(self.sending.pop(0))
            touched = self._step(op)
        elif isinstance(op, Admit):
            touched = self._admit(op)
        elif isinstance(op, Arrive):
            touched = self._arrive(op)
        elif isinstance(op, NewStep):
            touched = self._new_step()
        elif isinstance(op, Preempt):
            touched = self._preempt(op)
        elif isinstance(op, Finish):
            touched = self._finish(op)
        elif isinstance(op, Reset):
            touched = self._reset()
        elif isinstance(op, Stats):
            self.pair.call("make_prefix_cache_stats", _stats)
            touched = ()
        elif isinstance(op, CommonPrefix):
            touched = self._common_prefix(op)
        elif isinstance(op, TakeEvents):
            self.events.take(self.pair, self.coverage, self.spec.pool.index)
            touched = ()
        elif isinstance(op, Evict):
            touched = self._evict(op)
        else:
            touched = self._hostile(op)
        self._end(type(op).__name__, touched)

    def finish_run(self) -> None:
        """The end of the run: deferred frees are released, the loads of aborted requests
        finish; a full check of both managers and of every request."""
        self._release_deferred()
        while self.receiving:
            self._load_finished(self.receiving.pop(0))
        while self.sending:
            self._send_finished(self.sending.pop(0))
        self.pair.full_check("the end of the run")

    def check_requests(self) -> None:
        """Every live request against the client's record of it, and the two CPU tiers'
        whole states and invariants (each full check runs this)."""
        for live in self.live:
            live.record.check_all("step")
        if self.offload_tier is None:
            return
        spec_tier, impl_tier = _tier(self.pair.spec), _tier(self.pair.impl)
        spec_state, impl_state = spec_tier.snapshot(), impl_tier.snapshot()
        if spec_state != impl_state:
            fields = differing_fields(spec_state, impl_state)
            raise Divergence(
                "CPU offload tiers differ:\n" + describe_difference(spec_state, impl_state),
                "state",
                "step",
                f"offload tier {fields[0] if fields else ''}",
            )
        spec_tier.check_invariants()
        try:
            impl_tier.check_invariants()
        except InvariantViolation as error:
            raise Divergence(
                f"the CPU offload tier under test breaks {error}", "invariant", "step"
            ) from error

    def waiting(self) -> list[Live]:
        return [live for live in self.live if not live.running]

    def running(self) -> list[Live]:
        return [live for live in self.live if live.running]

    def _end(self, operation: str, touched: tuple[Live, ...]) -> None:
        self.pair.end_step([live.record.request_id for live in touched])
        for live in touched:
            live.record.check(operation)
        coverage = self.coverage
        coverage.steps += 1
        spec = self.spec
        if spec.truth.checks:
            coverage.counts.update(spec.truth.take_checks())
        if spec.retention_counts:
            coverage.counts.update(spec.take_retention_counts())
        if spec.evict_counts:
            coverage.counts.update(spec.take_evict_counts())
        coverage.states.add(
            hash(
                (
                    self._config_key,
                    spec.pool.get_num_free_blocks(),
                    len(spec.pool.index),
                    *(tuple(held) for group in spec.managers for held in group.blocks.values()),
                )
            )
        )

    def _new_step(self) -> tuple[Live, ...]:
        """A new scheduler step: `new_step_starts()` on both managers."""
        _, error = self.pair.call(
            "new_step_starts",
            lambda manager: manager.new_step_starts(),
            lambda: "new_step_starts()",
        )
        self._error("new_step_starts", error)
        self.coverage.counts["Mamba align: scheduler steps"] += 1
        return ()

    def _align_chunk(self, record: RequestRecord, start: int, wanted: int, unaligned: bool) -> int:
        """The tokens a step from `start` computes of the `wanted` ones: in a Mamba-align
        hybrid as vLLM 0.33's scheduler cuts them (`mamba_chunk`, at the request's
        shared-prefix junction too), unless `unaligned` (misuse: sent uncut, and from inside a
        block at least across its end); else `wanted`."""
        if not self.align:
            return wanted
        request = record.request
        cut = mamba_chunk(
            start,
            wanted,
            request.num_prompt_tokens,
            record.num_tokens,
            self.block_size,
            self.spec.shared_prefix_boundary(record.request_id),
        )
        if not unaligned:
            return cut
        boundary = -(-start // self.block_size) * self.block_size
        if start % self.block_size and boundary < record.num_tokens:
            # From inside a block, past its end: refused alike (`mamba_unaligned_chunk`).
            self.coverage.counts["Mamba align: unaligned chunks sent (misuse)"] += 1
            return min(max(wanted, boundary - start + 1), record.num_tokens - start)
        return wanted  # from a boundary: uncut, it may end inside a block (allowed)

    def _pick(self, which: int, *, running: bool | None) -> Live | None:
        if running is None:
            candidates = self.live
        else:
            candidates = [live for live in self.live if live.running == running]
        return candidates[which % len(candidates)] if candidates else None

    def _arrive(self, op: Arrive) -> tuple[Live, ...]:
        if op.request_id is not None and any(
            live.record.request_id == op.request_id
            for live in (*self.live, *self.receiving, *self.sending)
        ):
            return ()  # that name is taken: a request arrives under it once it has left
        self.num_arrived += 1
        request_id = op.request_id or f"req-{self.num_arrived}"
        tokens = list(op.tokens)
        lora, mm, salt = op.lora, self.domain.multimodal_inputs(op.mm), op.salt
        if op.share >= 0 and self.history:
            earlier = self.history[op.share % len(self.history)]
            shared = earlier.tokens[: max(op.share_len, 0)]
            tokens = [*shared, *tokens]
            if op.share_keys:
                lora, salt = earlier.lora, earlier.salt
                mm = earlier.mm
            else:
                mm = tuple((start + len(shared), length, h) for start, length, h in mm)
        tokens = tokens[: self.config.max_model_len] or [0]
        mm = tuple(entry for entry in mm if entry[0] + entry[1] <= len(tokens))
        if not self.domain.multimodal:
            mm = ()
        if not self.domain.cache_salts:
            salt = None
        record = new_request(request_id, tokens, mm, lora, salt, op.logprobs)
        if lora is not None or mm or salt is not None:
            self.coverage.counts["requests with extra keys"] += 1
        live = Live(record)
        self.live.append(live)
        self._remember(record)
        return (live,)

    def _remember(self, record: RequestRecord) -> None:
        self.history.append(
            Earlier(tuple(record.tokens), record.lora_id, record.mm, record.cache_salt)
        )
        if len(self.history) > HISTORY:
            del self.history[0]

    def _admit(self, op: Admit) -> tuple[Live, ...]:
        live = self._pick(op.which, running=False)
        if live is None:
            return ()
        if self.receiving or self.sending:
            counts = self.coverage.counts
            counts[
                "KV connector: admissions while a transfer held a finished request's blocks"
            ] += 1
        record = live.record
        request = record.request
        request_id = record.request_id
        lookup, error = self.pair.call(
            "get_computed_blocks",
            lambda manager: manager.get_computed_blocks(request),
            lambda: f"get_computed_blocks({request_id})",
        )
        if error is not None or lookup is None:
            self._error("get_computed_blocks", error)
            return (live,)
        hits, num_hit_tokens = lookup
        self._count_lookup(record, hits)
        if self.deferred:
            popped = {block for batch in self.deferred for blocks in batch for block in blocks}
            if any(block in popped for group_hits in hits for block in group_hits):
                self.coverage.counts["deferred frees: hits on popped blocks before release"] += 1
        remaining = record.num_tokens - num_hit_tokens
        external, load_async = 0, False
        sources: dict[tuple[int, int], OffloadKey] = {}
        if self.external_tokens and op.external > 0:
            # A connector's hit past the local one: an async load may reach the last token
            # (then it is recomputed: `_land`) under full attention alone (vLLM 0.33's
            # OffloadingConnector: a window or chunk has dropped what that token reads); a sync
            # one leaves a token to compute. With a CPU tier the hit is the tier's answer.
            load_async = op.load_async
            whole = load_async and not self.drops_blocks
            wanted = op.external
            if self.offload_tier is not None:
                wanted, sources = self._tier_hit(record, num_hit_tokens // self.block_size)
            external = min(wanted, remaining if whole else remaining - 1)
            load_async = load_async and external > 0
            end = -(-(num_hit_tokens + external) // self.block_size)  # the blocks it loads
            sources = {place: key for place, key in sources.items() if place[1] < end}
        remaining -= external
        if load_async:
            chunk = 0  # the prefill waits for the load
        else:
            chunk = remaining if op.chunk <= 0 or op.chunk >= remaining else op.chunk
            chunk = self._align_chunk(record, num_hit_tokens + external, chunk, op.unaligned)
            if chunk < remaining:
                self.coverage.counts["chunked prefill steps"] += 1
        room = self.max_tokens - num_hit_tokens - external - chunk
        if room < 0:
            self._finish_request(live)  # the prompt alone is past max_model_len
            return (live,)
        lookahead = 0 if load_async else min(op.lookahead, room)
        if sources:
            self.spec.offload_load_next(request, sources)
        allocated = self._allocate(
            record,
            chunk,
            hits,
            lookahead,
            decode=False,
            gate=self.full_sequence_gate,
            external=external,
            load_async=load_async,
        )
        if not allocated and sources:
            self.spec.offload_load_next(request, {})  # nothing loads
        if allocated:
            live.running = True
            live.loading = load_async
            live.load_start = num_hit_tokens
            record.set_computed(num_hit_tokens + external + chunk)
            if sources:
                self._start_load(live, sources)
            failed = external and not load_async and op.fail_at >= 0
            if failed and self._fail_sync(live, external, op.fail_at):
                return (live,)
            if not load_async:
                self._store(live)
                self._maybe_sample(live, (), op.token)
        return (live,)

    def _fail_sync(self, live: Live, external: int, fail_at: int) -> bool:
        """vLLM 0.33's "fail" policy for a sync load that failed from its `fail_at`-th block
        on, reported with the output of the step that ran it (before any other request is
        scheduled): the spec's ghost KV learns that the blocks from there hold garbage, the
        scheduler evicts every block of the request from there (`evict_blocks`: they were
        cached at the allocation) and finishes it with an error. Whether it failed (False: the
        failing block lies past the load)."""
        record = live.record
        block_size = self.block_size
        valid = (-(-live.load_start // block_size) + fail_at) * block_size
        if valid >= live.load_start + external:
            return False
        self.spec.external_load_failed(record.request, valid)
        if self.offload_tier is not None:
            self.coverage.counts["offload tier: loads failed"] += 1
        (table,) = self.spec.held(record.request_id) or ([],)
        invalid = [block_id for block_id in table[valid // block_size :] if block_id]
        _, error = self.pair.call(
            "evict_blocks",
            lambda manager: manager.evict_blocks(invalid),
            lambda: f"evict_blocks({invalid}) (a sync load failed)",
        )
        self._error("evict_blocks", error)
        self.coverage.counts["KV connector: sync loads failed, their blocks evicted"] += 1
        self._finish_request(live)
        return True

    def _land(self, live: Live, fail_at: int = -1) -> bool:
        """An async load lands: the caller caches what it loaded (vLLM 0.33's scheduler,
        `cache_blocks(request, num_computed_tokens)`); a load that reached the last token leaves
        it to recompute. `fail_at` >= 0: it failed from its `fail_at`-th block on (`_fail`).
        Whether the request still holds its blocks."""
        live.loading = False
        record = live.record
        counts = self.coverage.counts
        self._end_load(live)
        if fail_at >= 0:
            valid = self._valid_after_failure(live, fail_at)
            if valid is not None:
                if self.offload_tier is not None:
                    counts["offload tier: loads failed"] += 1
                return self._fail(live, valid)
        num_computed = record.num_computed_tokens
        cached_more = self._cache_blocks(record, " (an async load landed)")
        if cached_more is None:
            return True
        counts["KV connector: async loads landed"] += 1
        if cached_more:
            counts["KV connector: blocks cached when a load landed"] += 1
        if num_computed == record.num_tokens:
            counts["KV connector: whole prompts loaded, the last token recomputed"] += 1
            record.set_computed(num_computed - 1)
        return True

    def _valid_after_failure(self, live: Live, fail_at: int) -> int | None:
        """The tokens a load failing from its `fail_at`-th block leaves valid (a block
        boundary), or None when the load lands whole: the failing block lies past the load, or
        recomputing from there would read or write positions a window or chunk group dropped
        for the whole load (vLLM 0.33 would: its scheduler recomputes from the failed block,
        docs/semantics.md; the campaigns stay where it is sound)."""
        record = live.record
        block_size = self.block_size
        valid = (-(-live.load_start // block_size) + fail_at) * block_size
        if valid >= record.num_computed_tokens:
            return None
        if not valid:
            return 0  # freed and looked up again: nothing is recomputed in place
        held = self.spec.held(record.request_id) or ()
        end = -(-record.num_computed_tokens // block_size)  # the recompute writes up to there
        for manager, blocks in zip(self.spec.managers, held, strict=True):
            first = manager.first_read(valid) // block_size
            if any(block_id == 0 for block_id in blocks[first:end]):
                self.coverage.counts["KV connector: failures a window made unsound, landed"] += 1
                return None
        return valid

    def _fail(self, live: Live, valid: int) -> bool:
        """vLLM 0.33's "recompute" policy for an async load that failed from token `valid` on:
        the spec's ghost KV learns that the blocks from there hold garbage; with a valid prefix
        it is cached and the request recomputes the rest into the same blocks; without one the
        request is freed and looked up again."""
        record = live.record
        request = record.request
        counts = self.coverage.counts
        self.spec.external_load_failed(request, valid)
        if not valid:
            counts["KV connector: loads failed at their first block, freed"] += 1
            self._preempt_request(live)
            return False
        if self._cache_blocks(record, " (a load failed past it)", valid) is None:
            return True
        counts["KV connector: loads failed part-way, the valid prefix cached"] += 1
        record.set_computed(valid)
        return True

    def _step(self, op: Step) -> tuple[Live, ...]:
        live = self._pick(op.which, running=True)
        if live is None:
            return ()
        if live.loading and not self._land(live, op.fail_at):
            return (live,)  # the load failed from its first block: freed, waiting again
        record = live.record
        request = record.request
        computed = record.num_computed_tokens
        pending = record.num_tokens - computed
        drafts: tuple[int, ...] = ()
        if pending > 1:
            chunk = pending if op.chunk <= 0 or op.chunk >= pending else op.chunk
            chunk = self._align_chunk(record, computed, chunk, op.unaligned)
            self.coverage.counts["chunked prefill steps"] += 1
        else:
            chunk, drafts = 1, op.drafts
        room = self.max_tokens - computed - chunk
        if room < 0:
            self._finish_request(live)  # reached max_model_len
            return (live,)
        drafts = drafts[:room]
        lookahead = min(op.lookahead, room - len(drafts))
        request.spec_token_ids = list(drafts)
        try:
            allocated = self._allocate(
                record, chunk + len(drafts), None, lookahead, decode=pending == 1
            )
        finally:
            request.spec_token_ids = []
        if allocated is None:
            return (live,)
        if not allocated:
            self.coverage.counts["preemptions for lack of blocks"] += 1
            self._preempt_request(live)
            return (live,)
        accepted = drafts[: op.accepted]
        record.set_computed(computed + chunk + len(accepted))
        self._store(live)
        self._maybe_sample(live, accepted, op.token)
        return (live,)

    def _allocate(
        self,
        record: RequestRecord,
        num_tokens: int,
        hits: GroupIds | None,
        lookahead: int,
        *,
        decode: bool,
        gate: bool = False,
        external: int = 0,
        load_async: bool = False,
    ) -> bool | None:
        """allocate_slots on both sides (`gate`: through the full-sequence gate; `external`
        tokens past the hits, loaded asynchronously with `load_async`): True (allocated), False
        (None: no room), None (both refused). Counts what the call exercised, from the spec's
        state before and after."""
        spec = self.spec
        counts = self.coverage.counts
        request = record.request
        request_id = record.request_id
        block_size = self.block_size
        computed = record.num_computed_tokens
        num_drafts = len(request.spec_token_ids)
        held = spec.held(request_id) or ()
        num_held = len(held[0]) if held else 0
        hit_lists = hits or ()
        num_hits = len(hit_lists[0]) if hit_lists else 0
        nulls_before = [blocks.count(0) for blocks in held] if self.drops_blocks else []
        mixed_before = self._mixed_before(held)
        start = computed + num_hits * block_size + external
        hashed_before = self._cached_candidates(held, start + num_tokens + lookahead)
        before = StatesBefore(self._held_states(held), self._defers(hit_lists), hashed_before)
        result, error = self._call_allocate(
            request,
            num_tokens,
            hits,
            lookahead,
            gate,
            start + num_tokens + lookahead,
            external,
            load_async,
        )
        if error is not None:
            self._error("allocate_slots", error)
            return None
        if self.mamba_groups:
            self._count_state_groups(request_id, result, before, decode, num_hits)
        if result is None:
            counts["allocate_slots refused for lack of blocks"] += 1
            if self.hybrid:
                self._count_hybrid_refusal(request_id, start + num_tokens + lookahead, hit_lists)
            return False
        new_lists = result
        new_blocks = [block_id for blocks in new_lists for block_id in blocks]
        num_new = len(new_lists[0]) if new_lists else 0
        real_end = start + num_tokens - num_drafts
        if new_blocks:
            counts["new-block allocations"] += 1
            if hashed_before:
                evicted = sum(1 for block_id in new_blocks if hashed_before.get(block_id, False))
                counts["evictions of cached blocks"] += evicted
            needed_without_lookahead = -(-(start + num_tokens) // block_size)
            if lookahead and needed_without_lookahead <= num_held + num_hits:
                counts["new blocks for lookahead slots only"] += 1
        elif decode:
            counts["decode steps inside a block"] += 1
        num_filled = real_end // block_size - start // block_size
        if num_filled > 0:
            counts["block fills"] += 1
        if held and not num_hits and not self.hybrid:  # the ground of allocate_slots' fast path
            if num_new == 1 and num_filled <= 0:
                counts["running steps taking one new block"] += 1
            elif not num_new and num_filled == 1:
                counts["running steps filling one block"] += 1
        if num_drafts:
            counts["decode steps with draft tokens"] += 1
            if self.caching and (start + num_tokens) // block_size > real_end // block_size:
                counts["blocks left uncached because of draft tokens"] += 1
        if lookahead:
            counts["allocations with lookahead slots"] += 1
        if self.window is not None and held:
            window_start = computed - self.window + 1
            if window_start > 0 and window_start % block_size == 0:
                counts["windows skipping at the boundary token"] += 1
        self._count_after(request_id, nulls_before, mixed_before, real_end, bool(new_blocks))
        return True

    def _count_after(
        self,
        request_id: str,
        nulls_before: list[int],
        before: tuple[list[list[int]], int] | None,
        real_end: int,
        allocated: bool,
    ) -> None:
        """What an allocation freed (a window or chunk) and, with several block sizes and
        caching, what it left unhashed."""
        if self.drops_blocks:
            self._count_window_frees(request_id, nulls_before)
        if before is not None:
            self._count_mixed_step(request_id, before, real_end, allocated)

    def _mixed_before(self, held: tuple[list[int], ...]) -> tuple[list[list[int]], int] | None:
        """With several block sizes and caching, each group's blocks before an allocation (the
        spec changes its lists in place) and the partial keys the pool holds; else None."""
        if not self.mixed:
            return None
        partial = sum(map(len, self.spec.pool.partial_keys.values()))
        return [list(blocks) for blocks in held], partial

    def _count_mixed_step(
        self,
        request_id: str,
        before: tuple[list[list[int]], int],
        real_end: int,
        allocated: bool,
    ) -> None:
        """What an allocation of a mixed-size run with caching exercised: full blocks of a
        group smaller than S left unhashed until the next S boundary (vLLM 0.33 hashes a group's
        blocks only up to the last multiple of S), such blocks a window or chunk freed, and the
        partial keys it created (vllm-0.33's `partial_prefix_keys`)."""
        counts = self.coverage.counts
        held_before, partial_before = before
        if allocated:
            counts["mixed block sizes: allocations"] += 1
        pool = self.spec.pool
        after = self.spec.held(request_id) or ()
        boundary = real_end - real_end % self.scheduler_block_size
        for group, (layer, blocks) in enumerate(zip(self.layers, after, strict=False)):
            size = layer.block_size
            if size < self.scheduler_block_size:
                delayed = blocks[boundary // size : real_end // size]
                counts["mixed block sizes: full blocks left unhashed below S"] += sum(
                    1 for block_id in delayed if block_id and pool.block_hash[block_id] is None
                )
            earlier = held_before[group] if group < len(held_before) else []
            counts["mixed block sizes: unhashed blocks freed early"] += sum(
                1
                for position, block_id in enumerate(earlier)
                if block_id
                and position < len(blocks)
                and not blocks[position]
                and pool.block_hash[block_id] is None
            )
        partial = sum(map(len, pool.partial_keys.values()))
        counts["mixed block sizes: partial keys created"] += max(partial - partial_before, 0)

    def _call_allocate(
        self,
        request: Request,
        num_tokens: int,
        hits: GroupIds | None,
        lookahead: int,
        gate: bool,
        num_slots: int,
        external: int = 0,
        load_async: bool = False,
    ) -> tuple[Any, Exception | None]:
        """The allocate_slots call on both sides (`gate`: `full_sequence_must_fit=True`, the
        admission counted first; `num_slots`: the token slots the step itself needs; `external`
        and `load_async`: a connector's external tokens and delayed caching)."""
        options: dict[str, Any] = {}
        if gate:
            self._count_gate(request, hits or (), num_slots, external)
            options["full_sequence_must_fit"] = True
        if external:
            options["num_external_computed_tokens"] = external
            self._count_external(hits or (), num_slots - num_tokens - lookahead, load_async)
        if load_async:
            options["delay_cache_blocks"] = True
        num_drafts = len(request.spec_token_ids)
        result, error = self.pair.call(
            "allocate_slots",
            lambda manager: manager.allocate_slots(request, num_tokens, hits, lookahead, **options),
            lambda: (
                f"allocate_slots({request.request_id}, {num_tokens}, {hits}, {lookahead}"
                + "".join(f", {name}={value}" for name, value in options.items())
                + ")"
                + (f" with spec_token_ids={request.spec_token_ids}" if num_drafts else "")
            ),
        )
        if external and result is None and error is None:
            self.coverage.counts["KV connector: admissions refused for lack of blocks"] += 1
        return result, error

    def _count_external(self, hit_lists: GroupIds, num_computed: int, load_async: bool) -> None:
        """An admission adopting external tokens, counted from the spec's state before it:
        sync or async, and whether the tokens push hits out of a window or chunk (those hits
        stay untouched, free blocks for the allocation)."""
        counts = self.coverage.counts
        counts[f"KV connector: {'async' if load_async else 'sync'} loads"] += 1
        if self.full_sequence_gate:
            counts["KV connector: loads admitted through the full-sequence gate"] += 1
        for manager, hits in zip(self.spec.managers, hit_lists, strict=True):
            skipped = manager.num_skipped(num_computed)
            if any(hits[:skipped]):
                counts["KV connector: hits pushed out of a window or chunk"] += 1
                if any(self.spec.pool.ref_cnt[block_id] == 0 for block_id in hits[:skipped]):
                    counts["KV connector: hits pushed out, left free for the allocation"] += 1
                break

    def _count_gate(
        self, request: Request, hit_lists: GroupIds, num_slots: int, external: int = 0
    ) -> None:
        """An admission through the full-sequence gate (the request holds no blocks), counted
        from the spec's state before it: whether the gate alone refuses it (the step's own
        `num_slots` would fit), and whether a window or chunk group's admission cap binds.
        With `external` tokens each group counts the prefix it adopts (`SpecKVCacheManager`)."""
        counts = self.coverage.counts
        spec = self.spec
        counts["full-sequence gate: admissions"] += 1
        num_hits = len(hit_lists[0]) if hit_lists else 0
        adopted = [list(hits) for hits in hit_lists] or [[] for _ in spec.managers]
        if external:
            num_computed = num_hits * self.block_size + external
            adopted = [
                spec.adopted_prefix(manager, hits, num_computed)
                for manager, hits in zip(spec.managers, adopted, strict=True)
            ]
        num_free = spec.pool.get_num_free_blocks()
        num_free -= sum(
            1
            for hits in adopted
            for block_id in hits
            if block_id and spec.pool.ref_cnt[block_id] == 0
        )
        whole = min(request.num_tokens, self.config.max_model_len)
        needed = 0
        capped = False
        for manager, cap, hits in zip(spec.managers, spec.admission_caps, adopted, strict=True):
            required = manager.num_required(whole)
            if cap is not None and cap < required:
                required, capped = cap, True
            needed += max(required - len(hits), 0)
        step = sum(
            max(manager.num_required(num_slots) - len(hits), 0)
            for manager, hits in zip(spec.managers, adopted, strict=True)
        )
        if needed > num_free >= step:
            counts["full-sequence gate: admissions refused that the step alone would fit"] += 1
        if capped:
            counts["full-sequence gate: admissions under a window or chunk's cap"] += 1
            if needed <= num_free:
                counts["full-sequence gate: capped admissions admitted"] += 1

    @property
    def _mamba_label(self) -> str:
        """The coverage counters' prefix of a run with Mamba groups: beside attention groups
        (a hybrid; caching states in mode "align") or alone (a model of state layers only)."""
        if self.align:
            return "Mamba align"
        return "Mamba hybrids" if self.hybrid else "Mamba alone"

    def _count_mamba_step(self, new_lists: GroupIds) -> None:
        """An allocation of a run with Mamba groups: what the Mamba groups took, beside the
        attention groups of a hybrid (groups of several block sizes take different numbers of
        blocks)."""
        counts = self.coverage.counts
        label = self._mamba_label
        counts[f"{label}: allocations"] += 1
        if not any(new_lists):
            counts[f"{label}: allocations taking no block"] += 1
        if len({len(blocks) for blocks in new_lists}) > 1:
            counts[f"{label}: steps where groups took different numbers of blocks"] += 1
        for group in self.mamba_groups:
            if len(new_lists[group]) > 1 and not self.align:  # "align": null columns too
                counts[f"{label}: speculative state blocks taken"] += len(new_lists[group]) - 1

    def _held_states(self, held: tuple[list[int], ...] | GroupIds) -> set[int]:
        """The state blocks (not null) the Mamba groups of `held` hold (a Mamba-align
        hybrid; else none)."""
        if not self.align:
            return set()
        return {
            block_id
            for group in self.mamba_groups
            if group < len(held)
            for block_id in held[group]
            if block_id != NULL_BLOCK_ID
        }

    def _defers(self, hit_lists: GroupIds) -> bool:
        """Whether a Mamba group in mode "align" defers these hits (their state was keyed in
        this scheduler step), by the spec's state."""
        return self.align and any(
            self.spec.managers[group].defers(hit_lists[group])
            for group in self.mamba_groups
            if group < len(hit_lists)
        )

    def _count_state_groups(
        self,
        request_id: str,
        result: GroupIds | None,
        before: StatesBefore,
        decode: bool,
        num_hits: int,
    ) -> None:
        """An allocation of a run with Mamba groups, allocated (`result`) or refused (None)."""
        counts = self.coverage.counts
        if result is None:
            counts[f"{self._mamba_label}: allocations refused for lack of blocks"] += 1
            if before.deferred:
                counts["Mamba align: hits refused in the step that keyed their state"] += 1
            return
        self._count_mamba_step(result)
        if self.align:
            self._count_align_step(request_id, result, before, decode, num_hits)

    def _count_align_step(
        self,
        request_id: str,
        new_lists: GroupIds,
        before: StatesBefore,
        decode: bool,
        num_hits: int,
    ) -> None:
        """An allocation of a Mamba-align hybrid: previous states freed, a decode step
        crossing a block boundary (a new running column), cached states evicted when their
        block is taken again, a hit adopted; with speculative blocks, those moved to the
        table's end (relocated) and a growth whose running column is a speculative block
        left in place (promoted)."""
        counts = self.coverage.counts
        tables = self.spec.held(request_id) or ()
        after = self._held_states(tables)
        for group in self.mamba_groups:
            added = new_lists[group]
            moved = sum(1 for block_id in added if block_id in before.states)
            if moved:
                counts["Mamba align: speculative blocks relocated"] += moved
            speculative = self.spec.managers[group].extra_blocks
            if speculative and added and group < len(tables):
                table = tables[group]
                running = table[len(table) - 1 - speculative]
                if running in before.states and running not in added:
                    counts["Mamba align: speculative blocks promoted to running"] += 1
        if num_hits:
            counts["Mamba align: hits adopted"] += 1
        freed = before.states - after
        if freed:
            counts["Mamba align: previous states freed"] += len(freed)
        new_states = [
            block_id
            for group in self.mamba_groups
            for block_id in new_lists[group]
            if block_id != NULL_BLOCK_ID
        ]
        if decode and new_states:
            counts["Mamba align: decode steps crossing a block boundary"] += 1
        evicted = sum(1 for block_id in new_states if before.hashed.get(block_id, False))
        if evicted:
            counts["Mamba align: cached states evicted when their block was reused"] += evicted

    def _cached_candidates(self, held: tuple[list[int], ...], end_token: int) -> dict[int, bool]:
        """Whether each block an allocation may hand out is cached: new blocks come from the
        free queue's head (after the hits leave it), or are the request's own blocks a window
        frees first (to count evictions). Empty with caching off."""
        if not self.caching:
            return {}
        pool = self.spec.pool
        held_counts = [len(blocks) for blocks in held] or [0] * len(self.layers)
        most = sum(
            -(-end_token // layer.block_size) - num_held
            for layer, num_held in zip(self.layers, held_counts, strict=False)
        )
        candidates = (*pool.free_order[: max(most, 0)], *(b for blocks in held for b in blocks))
        return {block_id: pool.block_hash[block_id] is not None for block_id in candidates}

    def _count_window_frees(self, request_id: str, nulls_before: list[int]) -> None:
        """Blocks a window (or a chunk boundary) freed in the allocation just made."""
        counts = self.coverage.counts
        after = self.spec.held(request_id) or ()
        for layer, blocks, nulls in zip(self.layers, after, nulls_before, strict=False):
            freed = blocks.count(0) - nulls
            if freed <= 0 or (self.align and isinstance(layer, MambaSpec)):
                continue  # a Mamba group's nulls in mode "align": `_count_align_step`
            if not self.hybrid:
                counts["blocks freed by the sliding window"] += freed
            elif isinstance(layer, ChunkedLocalAttentionSpec):
                counts["hybrid blocks freed at a chunk boundary"] += freed
            else:
                counts["hybrid blocks freed by a sliding window"] += freed

    def _count_hybrid_refusal(
        self, request_id: str, end_token: int, hit_lists: tuple[list[int], ...]
    ) -> None:
        """A hybrid allocation refused: count it, and whether each group's blocks alone would
        have fit (where a capacity check made per group instead of in total goes wrong)."""
        counts = self.coverage.counts
        counts["hybrid allocations refused for lack of blocks"] += 1
        pool = self.spec.pool
        held = self.spec.held(request_id) or ()
        num_held = len(held[0]) if held else 0
        num_hits = len(hit_lists[0]) if hit_lists else 0
        required = min(-(-end_token // self.block_size), -(-self.max_tokens // self.block_size))
        missing = required - num_held - num_hits
        evictable = {b for hits in hit_lists for b in hits if b and pool.ref_cnt[b] == 0}
        if 0 < missing <= pool.get_num_free_blocks() - len(evictable):
            counts["hybrid refusals where each group alone would fit"] += 1

    def _count_lookup(self, record: RequestRecord, hit_lists: GroupIds) -> None:
        counts = self.coverage.counts
        if record.prompt_logprobs and self.caching:
            counts["prompt-logprobs lookups"] += 1
        num_hits = len(hit_lists[0]) if hit_lists else 0
        if self.align and not record.prompt_logprobs:
            self._count_align_lookup(record, num_hits)
        if self.mixed:
            self._count_mixed_lookup(hit_lists, num_hits)
            return
        if self.hybrid and self.caching and not record.prompt_logprobs:
            self._count_hybrid_lookup(record, hit_lists, num_hits)
        if not num_hits:
            return
        if self.hybrid:
            pass
        elif self.window is None:
            counts["prefix hits, full attention"] += 1
        else:
            counts["prefix hits, sliding window"] += 1
            if hit_lists[0][0] == 0:
                counts["sliding-window hits with leading null blocks"] += 1
        num_full = record.num_tokens // self.block_size
        lookup_length = num_full - (num_full * self.block_size == record.num_tokens)
        if num_hits + self.config.use_eagle >= lookup_length:
            counts["hits that use every cached block"] += 1

    def _count_align_lookup(self, record: RequestRecord, num_hits: int) -> None:
        """What a lookup of a Mamba-align hybrid exercised: a Mamba hit, one cut below full
        attention's hit alone (to a lower state boundary, or to nothing), a shared-prefix
        junction, a readmission hitting a state again."""
        spec = self.spec
        counts = self.coverage.counts
        request_id = record.request_id
        if spec.shared_prefix_boundary(request_id):
            counts["Mamba align: lookups finding a shared-prefix junction"] += 1
        stored = spec.hashes.get(request_id, [])
        lookup = stored[:-1] if len(stored) * self.block_size == record.num_tokens else stored
        trace = spec.trace_common_hit(lookup)
        full_alone = max(
            alone
            for alone, layer in zip(trace.alone, self.layers, strict=True)
            if not isinstance(layer, MambaSpec)
        )
        if num_hits:
            counts["Mamba align: hits"] += 1
            if request_id in self.preempted:
                counts["Mamba align: readmissions hitting a state again"] += 1
        if full_alone > num_hits:
            if num_hits:
                counts["Mamba align: hits cut to a lower state boundary than full attention's"] += 1
            else:
                counts["Mamba align: full-attention hits cut to nothing by the Mamba group"] += 1

    def _count_mixed_lookup(self, hit_lists: GroupIds, num_hits: int) -> None:
        """A hit of a mixed-size run with caching: a multiple of S tokens, each group's table
        as long as its own blocks of it (tables of different lengths), a window group's
        leading blocks null (masked below S)."""
        if not num_hits:
            return
        counts = self.coverage.counts
        tokens = num_hits * self.layers[0].block_size
        if tokens % self.scheduler_block_size == 0:
            counts["mixed block sizes: hits of S-multiples, tables of different lengths"] += 1
        if any(
            isinstance(layer, SlidingWindowSpec) and hits and hits[0] == 0
            for layer, hits in zip(self.layers, hit_lists, strict=False)
        ):
            counts["mixed block sizes: window hits with leading null blocks"] += 1

    def _count_hybrid_lookup(
        self, record: RequestRecord, hit_lists: tuple[list[int], ...], num_hits: int
    ) -> None:
        """What a hybrid lookup exercised, from how the spec finds the common hit."""
        spec = self.spec
        counts = self.coverage.counts
        stored = spec.hashes.get(record.request_id, [])
        lookup = stored[:-1] if len(stored) * self.block_size == record.num_tokens else stored
        trace = spec.trace_common_hit(lookup)
        if not trace.length:
            return
        counts["hybrid hits"] += 1
        if any(alone > trace.length for alone in trace.alone):
            counts["hybrid hits cut short by one group"] += 1
        if trace.undercut:
            counts["hybrid hits found again after a later group shortened them"] += 1
        if trace.passes >= 3:
            counts["hybrid hits checked again after a group shortened them"] += 1
        for layer, blocks in zip(self.layers, hit_lists, strict=True):
            if num_hits and blocks[0] == 0 and not isinstance(layer, MambaSpec):
                kind = "chunked" if isinstance(layer, ChunkedLocalAttentionSpec) else "windowed"
                counts[f"hybrid hits with leading null blocks, {kind} group"] += 1

    def _maybe_sample(self, live: Live, accepted: tuple[int, ...], token: int) -> None:
        """Once every token is computed the step yields the accepted drafts and one token; a
        request reaching max_model_len finishes."""
        record = live.record
        if record.num_computed_tokens < record.num_tokens:
            return  # a prefill chunk: nothing sampled yet
        record.append([*accepted, token])
        if self.cache_after_output:
            self._cache_after_output(record)
        if record.num_tokens >= self.config.max_model_len:
            self._finish_request(live)

    def _cache_after_output(self, record: RequestRecord) -> None:
        """cache_blocks(request, num_computed_tokens) on both sides, as vLLM 0.33's scheduler
        calls it after an output when it decodes speculatively: the blocks the accepted draft
        tokens filled are cached now, not at the next allocation."""
        counts = self.coverage.counts
        cached_more = self._cache_blocks(record)
        if cached_more is None:
            return
        counts["cache_blocks after an output"] += 1
        if cached_more:
            counts["cache_blocks after an output: blocks cached before the next step"] += 1

    def _cache_blocks(
        self, record: RequestRecord, why: str = "", num_tokens: int | None = None
    ) -> bool | None:
        """cache_blocks(request, num_tokens) on both sides (default: its num_computed_tokens):
        whether the spec's cached count grew, or None when the call failed (reported)."""
        request = record.request
        num_computed = record.num_computed_tokens if num_tokens is None else num_tokens
        before = self.spec.num_cached.get(record.request_id, 0)
        _, error = self.pair.call(
            "cache_blocks",
            lambda manager: manager.cache_blocks(request, num_computed),
            lambda: f"cache_blocks({record.request_id}, {num_computed}){why}",
        )
        if error is not None:
            self._error("cache_blocks", error)
            return None
        return self.spec.num_cached.get(record.request_id, 0) > before

    # -- the CPU offload tier behind the connector ------------------------------------------

    def _tier_call(self, operation: str, call: Any, label: str) -> Any:
        """`call` on both managers' CPU tiers, compared; the spec's result (None if refused)."""
        result, error = self.pair.call(
            f"offload tier: {operation}", lambda manager: call(_tier(manager)), lambda: label
        )
        self._error(f"offload tier: {operation}", error)
        return None if error is not None else result

    def _tier_request(self, request_id: str) -> OffloadRequest:
        tier_request = self.tier_requests.get(request_id)
        if tier_request is None:
            tier_request = self.tier_requests[request_id] = OffloadRequest(request_id)
        return tier_request

    def _tier_keys(
        self, request_id: str, block_hash: BlockHashType, position: int
    ) -> list[OffloadKey]:
        """The tier keys of the request's block at `position` (one chunk a block), one per
        group, placed in its request record. A key is the block's whole pagedkv hash (value,
        tokens, extra keys), as bytes: no two prefixes share one."""
        tier_request = self._tier_request(request_id)
        data = repr(tuple(block_hash)).encode()
        keys = [make_offload_key(data, group) for group in range(len(self.layers))]
        for key in keys:
            tier_request.place(key, (position + 1) * self.block_size)
        return keys

    def _tier_hit(
        self, record: RequestRecord, num_hits: int
    ) -> tuple[int, dict[tuple[int, int], OffloadKey]]:
        """The connector's lookup past a local hit of `num_hits` blocks (vLLM 0.33's
        OffloadingConnector): chunk by chunk, every group's key, up to the first that is not a
        HIT (a MISS, or a store still pending). The tokens it covers, and each (group,
        position)'s key."""
        request_id = record.request_id
        hashes = self.spec.hashes.get(request_id, [])
        sources: dict[tuple[int, int], OffloadKey] = {}
        tier_request = self._tier_request(request_id)
        position = num_hits
        counts = self.coverage.counts
        while position < len(hashes):
            keys = self._tier_keys(request_id, hashes[position], position)
            answers = [
                self._tier_call(
                    "lookup",
                    lambda tier, key=key: tier.lookup(key, tier_request),
                    f"lookup({key.hex()[:16]}..., {request_id})",
                )
                for key in keys
            ]
            if any(answer is not LookupResult.HIT for answer in answers):
                if LookupResult.HIT_PENDING in answers:
                    counts["offload tier: lookups stopped at a store still pending"] += 1
                break
            sources.update(((group, position), key) for group, key in enumerate(keys))
            position += 1
        if position > num_hits:
            counts["offload tier: lookups hitting chunks past the GPU hit"] += 1
        return (position - num_hits) * self.block_size, sources

    def _start_load(self, live: Live, sources: dict[tuple[int, int], OffloadKey]) -> None:
        """The admission adopted the tier's hit: pin the chunks its blocks load (positions a
        window or chunk left null load nothing); a sync load ran with the step and ends now."""
        record = live.record
        held = self.spec.held(record.request_id) or ()
        keys = tuple(
            key
            for (group, position), key in sorted(sources.items(), key=lambda item: item[0][::-1])
            if position < len(held[group]) and held[group][position] != NULL_BLOCK_ID
        )
        if not keys:
            return
        tier_request = self._tier_request(record.request_id)
        if (
            self._tier_call(
                "prepare_load",
                lambda tier: tier.prepare_load(keys, tier_request),
                f"prepare_load({len(keys)} keys, {record.request_id})",
            )
            is None
        ):
            return
        self.coverage.counts["offload tier: tier hits used as external tokens"] += 1
        live.load_keys = keys
        if not live.loading:
            self._end_load(live)

    def _end_load(self, live: Live) -> None:
        """The request's load from the tier ended (landed, failed or reported finished): its
        chunks are unpinned."""
        keys, live.load_keys = live.load_keys, ()
        if not keys:
            return
        tier_request = self._tier_request(live.record.request_id)
        self._tier_call(
            "complete_load",
            lambda tier: tier.complete_load(keys, tier_request),
            f"complete_load({len(keys)} keys, {live.record.request_id})",
        )

    def _store(self, live: Live) -> None:
        """The connector's store job for a request its step computed (vLLM 0.33's
        `_build_store_jobs`): every block it computed since the last offer, whole chunks of
        one block, each group's (null positions skipped), offered with `prepare_store`; the
        chunks the tier takes copy what their blocks hold (the spec's ghost state) and wait
        for the job to end. None (no room): offered again after the next step."""
        if self.offload_tier is None or live not in self.live:
            return
        record = live.record
        request_id = record.request_id
        held = self.spec.held(request_id)
        hashes = self.spec.hashes.get(request_id, [])
        start = self.store_cursor.get(request_id, 0)
        end = min(
            min(record.num_computed_tokens, record.num_tokens) // self.block_size, len(hashes)
        )
        if held is None or end <= start:
            return
        keys: list[OffloadKey] = []
        blocks: dict[OffloadKey, int] = {}
        for position in range(start, end):
            for key, table in zip(
                self._tier_keys(request_id, hashes[position], position), held, strict=True
            ):
                if position < len(table) and table[position] != NULL_BLOCK_ID:
                    keys.append(key)
                    blocks[key] = table[position]
        tier_request = self._tier_request(request_id)
        counts = self.coverage.counts
        output: StoreOutput | None = self._tier_call(
            "prepare_store",
            lambda tier: tier.prepare_store(keys, tier_request),
            f"prepare_store({len(keys)} keys, {request_id})",
        )
        if output is None:
            counts["offload tier: stores refused, nothing evictable"] += 1
            return
        self.store_cursor[request_id] = end
        if output.evicted_keys:
            self.spec.offload_dropped(output.evicted_keys)
            counts["offload tier: chunks evicted for a store"] += len(output.evicted_keys)
        if output.keys_to_store:
            self.spec.offload_stored([(key, blocks[key]) for key in output.keys_to_store])
            self.store_jobs.append((tier_request, output.keys_to_store))
            counts["offload tier: chunks stored from the GPU pool"] += len(output.keys_to_store)

    def _end_store(self, outcome: int) -> None:
        """The store jobs in flight at a step: `outcome` (modulo 3) 0, every one completes; 1,
        the oldest fails (its chunks are dropped) and the others complete; 2, every one stays
        pending. Then both tiers' events are taken and compared."""
        counts = self.coverage.counts
        if outcome % 3 == 2:
            counts["offload tier: stores left pending at a step"] += 1
            return
        jobs, self.store_jobs = self.store_jobs, []
        for index, (tier_request, keys) in enumerate(jobs):
            success = index > 0 or outcome % 3 == 0
            self._tier_call(
                "complete_store",
                lambda tier, keys=keys, req=tier_request, ok=success: tier.complete_store(
                    keys, req, ok
                ),
                f"complete_store({len(keys)} keys, {tier_request.req_id}, success={success})",
            )
            if not success:
                self.spec.offload_dropped(keys)
                counts["offload tier: stores failed"] += 1
        self._tier_call("take_events", lambda tier: tier.take_events(), "take_events()")

    def _preempt(self, op: Preempt) -> tuple[Live, ...]:
        live = self._pick(op.which, running=True)
        if live is None or live.loading:
            return ()  # vLLM preempts running requests only, never one waiting for its load
        self.coverage.counts["requests preempted by the scheduler"] += 1
        self._preempt_request(live, op.deferred)
        return (live,)

    def _preempt_request(self, live: Live, deferred: bool = False) -> None:
        record = live.record
        self._count_free(record.request_id)
        if not self._release_request(record, deferred):
            return
        self.preempted.add(record.request_id)
        record.set_computed(0)
        live.running = False

    def _release_request(self, record: RequestRecord, deferred: bool) -> bool:
        """Free the request's blocks, or (`deferred`) pop them for release at the next step;
        whether the call succeeded."""
        request, request_id = record.request, record.request_id
        if not deferred:
            _, error = self.pair.call(
                "free", lambda manager: manager.free(request), lambda: f"free({request_id})"
            )
            self._error("free", error)
            return error is None
        popped, error = self.pair.call(
            "pop_blocks_for_free",
            lambda manager: manager.pop_blocks_for_free(request),
            lambda: f"pop_blocks_for_free({request_id})",
        )
        self._error("pop_blocks_for_free", error)
        if error is not None or popped is None:
            return False
        self.coverage.counts["deferred frees: requests whose blocks were popped"] += 1
        if any(popped):
            self.deferred.append(popped)
        return True

    def _release_deferred(self, twice: bool = False) -> None:
        """The step the deferred frees waited for is processed: release every batch, oldest
        first. `twice` (misuse): then the first batch again, which both managers must refuse
        alike, changing nothing."""
        batches, self.deferred = self.deferred, []
        for batch in batches:
            if sum(1 for blocks in batch if blocks) >= 2:
                self.coverage.counts["deferred frees: batches of several groups"] += 1
            self._free_popped(batch)
        if twice and batches:
            batch = batches[0]
            _, error = self.pair.call(
                "free_popped_blocks",
                lambda manager: manager.free_popped_blocks(batch),
                lambda: f"free_popped_blocks({batch}) (misuse: released before)",
            )
            self._error("free_popped_blocks", error)

    def _free_popped(self, batch: tuple[list[int], ...]) -> None:
        _, error = self.pair.call(
            "free_popped_blocks",
            lambda manager: manager.free_popped_blocks(batch),
            lambda: f"free_popped_blocks({batch})",
        )
        self._error("free_popped_blocks", error)
        if error is None:
            self.coverage.counts["deferred frees: batches released"] += 1

    def _count_free(self, request_id: str) -> None:
        """A request about to be freed: a hybrid one holding blocks in several groups (the
        frees group by group, each tail first, decide the free queue's order), or one holding
        Mamba state blocks."""
        held = self.spec.held(request_id) or () if self.hybrid or self.mamba_groups else ()
        if self.hybrid and sum(1 for blocks in held if any(blocks)) >= 2:
            self.coverage.counts["hybrid requests freed from several groups"] += 1
        if held and any(held[group] for group in self.mamba_groups):
            self.coverage.counts[f"{self._mamba_label}: requests freed holding state blocks"] += 1

    def _finish(self, op: Finish) -> tuple[Live, ...]:
        live = self._pick(op.which, running=None)
        if live is None:
            return ()
        request = live.record.request
        if op.delay_free and not live.loading and self.spec.held(request.request_id):
            # The connector sends the request's KV: its free waits for finished_sending.
            self.spec.external_send_started(request)
            self.coverage.counts["KV connector: frees delayed while a send read the blocks"] += 1
            self.live.remove(live)
            self.sending.append(live)
            return (live,)
        self._finish_request(live, op.deferred)
        return (live,)

    def _send_finished(self, live: Live) -> None:
        """The connector reports a finished request's send done: the spec learns it, then the
        request is freed."""
        self.spec.external_send_finished(live.record.request)
        self.live.append(live)
        self._finish_request(live)

    def _finish_request(self, live: Live, deferred: bool = False) -> None:
        if live.loading:  # aborted while loading: freed once the load finishes
            self.coverage.counts[
                "KV connector: requests aborted while their load was in flight"
            ] += 1
            live.loading = False
            self.live.remove(live)
            self.receiving.append(live)
            return
        record = live.record
        request = record.request
        request_id = record.request_id
        self._count_free(request_id)
        self._release_request(record, deferred)
        _, error = self.pair.call(
            "free_block_hashes",
            lambda manager: manager.free_block_hashes(request),
            lambda: f"free_block_hashes({request_id})",
        )
        self._error("free_block_hashes", error)
        if live in self.live:
            self.live.remove(live)
            self.coverage.counts["finished requests"] += 1
            self._remember(record)
        tier_request = self.tier_requests.pop(request_id, None)
        self.store_cursor.pop(request_id, None)
        if tier_request is not None:
            self._tier_call(
                "on_request_finished",
                lambda tier: tier.on_request_finished(tier_request),
                f"on_request_finished({request_id})",
            )

    def _load_finished(self, live: Live) -> None:
        """The connector reports an aborted request's load finished: the spec learns it (its
        blocks may be reused from now on), then the request is freed as a finished one."""
        self.spec.external_load_finished(live.record.request)
        self._end_load(live)
        self.live.append(live)
        self._finish_request(live)

    def _reset(self) -> tuple[Live, ...]:
        tier = self.spec.offload_tier
        num_chunks = 0 if tier is None else len(tier.refs)
        reset, error = self.pair.call(
            "reset_prefix_cache", lambda manager: manager.reset_prefix_cache()
        )
        if error is not None:
            self._error("reset_prefix_cache", error)
        elif reset:
            self.coverage.counts["successful prefix-cache resets"] += 1
            if tier is not None:
                # Both tiers are cleared: jobs in flight are ignored, stores start over.
                self.store_jobs.clear()
                self.store_cursor.clear()
                if num_chunks:
                    self.coverage.counts["offload tier: resets clearing both tiers"] += 1
            self.pair.full_check("a prefix-cache reset")
        else:
            self.coverage.counts["refused prefix-cache resets"] += 1
        return ()

    def _common_prefix(self, op: CommonPrefix) -> tuple[Live, ...]:
        live = self._pick(op.which, running=True)
        if live is not None:
            request = live.record.request
            num_running = sum(1 for entry in self.live if entry.running)
            self.pair.call(
                "get_num_common_prefix_blocks",
                lambda manager: manager.get_num_common_prefix_blocks(request, num_running),
                lambda: f"get_num_common_prefix_blocks({live.record.request_id}, {num_running})",
            )
        return ()

    def _evict(self, op: Evict) -> tuple[Live, ...]:
        """evict_blocks of the blocks `op` picks (`Evict`), found in the spec's state; nothing
        when there are none of that kind."""
        pool = self.spec.pool
        kind = op.kind % 4
        touched: tuple[Live, ...] = ()
        if kind <= 1:
            live = self._pick(op.which, running=True)
            held = None if live is None else self.spec.held(live.record.request_id)
            if live is None or held is None:
                return ()
            cached = [
                (position, block_id)
                for blocks in held
                for position, block_id in enumerate(blocks)
                if block_id != NULL_BLOCK_ID and pool.block_hash[block_id] is not None
            ]
            if not cached:
                return ()
            shared = [entry for entry in cached if pool.ref_cnt[entry[1]] >= 2]
            if kind == 0 and op.arg % 2 and shared:
                cached = shared  # half the time a block other requests hit too, if any
            start, block_id = cached[op.arg // 2 % len(cached)]
            block_ids = [block_id] if kind == 0 else [b for p, b in cached if p >= start]
            touched = (live,)
            what = "a running request's cached block" if kind == 0 else "a failed load's blocks"
        elif kind == 2:
            queued = [b for b in pool.free_order if pool.block_hash[b] is not None]
            if not queued:
                return ()
            block_ids = [queued[op.arg % len(queued)]]
            what = "a cached block in the free queue"
        else:
            unhashed = [b for b in range(pool.num_gpu_blocks) if pool.block_hash[b] is None]
            block_ids = [unhashed[op.arg % len(unhashed)]]  # the null block is never hashed
            what = "a block without a hash (passed over)"
        counts = self.coverage.counts
        counts[f"evict_blocks: {what}"] += 1
        if self.align:
            held_states = {
                block_id
                for live in self.live
                for block_id in self._held_states(self.spec.held(live.record.request_id) or ())
            }
            if held_states.intersection(block_ids):
                counts["Mamba align: evict_blocks of a state a request holds"] += 1
        if any(pool.ref_cnt[block_id] >= 2 for block_id in block_ids):
            counts["evict_blocks: a block two requests share"] += 1
        _, error = self.pair.call(
            "evict_blocks",
            lambda manager: manager.evict_blocks(list(block_ids)),
            lambda: f"evict_blocks({block_ids})",
        )
        self._error("evict_blocks", error)
        return touched

    def _hostile(self, op: Hostile) -> tuple[Live, ...]:
        live = self._pick(op.which, running=None)
        call = self.hostile_calls.get(op.kind)
        if live is None or call is None:
            return ()
        record = live.record
        config = self.config
        scene = Scene(
            pair=self.pair,
            request=record.request,
            running=live.running,
            tracked=record.request_id in self.spec.requests,
            num_stored_hashes=len(self.spec.hashes.get(record.request_id, ())),
            num_blocks=config.kv_cache_config.num_blocks,
            max_model_len=config.max_model_len,
            block_size=self.block_size,
            sliding_window=self.window,
            num_groups=len(self.layers),
            enable_caching=self.caching,
            arg=op.arg,
            on_refusal=self._error,
        )
        call(scene)
        self.coverage.counts[f"hostile call {op.kind}"] += 1
        return (live,)

    def _error(self, operation: str, error: Exception | None) -> None:
        if error is not None:
            self.coverage.count_error(operation, error)


def _manager_of(manager: ManagerUnderTest) -> Any:
    """The manager an adapter drives (pagedkv's or the spec's), or the object itself."""
    return getattr(manager, "manager", manager)


def _tier(manager: ManagerUnderTest) -> Any:
    """The CPU offload tier a manager under test holds (`attach_offload_tier`)."""
    return _manager_of(manager).offload_tier


def _layer_key(layer: KVCacheSpec) -> tuple[int, int, int]:
    """A group's spec as far as the managers see it: type, block size, window or chunk. The
    type by a CRC of its name, not the name: `hash()` of a str differs from process to process
    (unless PYTHONHASHSEED is set), and the distinct states must not."""
    window = getattr(layer, "sliding_window", None) or getattr(layer, "attention_chunk_size", 0)
    return (zlib.crc32(type(layer).__name__.encode()), layer.block_size, int(window or 0))


def _stats(manager: ManagerUnderTest) -> Any:
    """The stats as compared: (reset, requests, queries, hits, (queried, hit tokens)); the token
    counts `NOT_REPORTED` for stats that count none (vLLM 0.8.5's); whatever an adapter returns
    when it exposes no counts at all (vLLM 0.33's)."""
    stats = manager.make_prefix_cache_stats()
    if stats is None or not hasattr(stats, "queries"):
        return stats
    tokens = (
        (stats.queried_tokens, stats.hit_tokens)
        if hasattr(stats, "queried_tokens")
        else NOT_REPORTED
    )
    return (stats.reset, stats.requests, stats.queries, stats.hits, tokens)
