"""The swarm engine's manager driver: a simulated scheduler, spec and implementation in lock-step.

`ManagerDriver` holds a `ComparedPair` of managers built from a `ManagerRun`, draws operations
(`generate`, from a `random.Random`) among those the run enables, and executes them
(`execute`): arrivals with prompts that share prefixes with earlier requests (their output tokens
included, so sliding-window hits with leading null blocks happen), admissions (prefix lookup,
then allocate_slots with the hits, whole or chunked, with lookahead slots), prefill chunks and
decode steps with draft tokens, preemption when allocate_slots returns None, finishing, resets,
stats, common-prefix queries, hostile calls (`harness/manager_hostile.py`) and, in runs with KV
cache events on, takes of both managers' events (`harness/swarm_events.py`). Every event the
coverage table names is counted on the spec's side (`harness/coverage.py`).

Execution depends only on the operation and the state, never on the random generator, so a
recorded list of operations replays exactly, and any subsequence of it still runs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.adapters import SpecManagerAdapter, pagedkv_manager, spec_manager
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.manager_hostile import HOSTILE_CALLS, HostileCall, Scene
from pagedkv.harness.manager_ops import (
    Admit,
    Arrive,
    CommonPrefix,
    Finish,
    Hostile,
    ManagerOp,
    Preempt,
    Reset,
    Stats,
    Step,
    TakeEvents,
)
from pagedkv.harness.probes import manager_probe
from pagedkv.harness.protocol import ManagerFactory, ManagerUnderTest
from pagedkv.harness.requests import MM_HASHES, SALTS
from pagedkv.harness.swarm_events import EventTakes, take_events
from pagedkv.harness.swarm_runs import ManagerRun, OperationPicker
from pagedkv.vocab.request import PlaceholderRange, Request

HISTORY = 32
"""Earlier token lists a new prompt may start with (the most recent ones)."""


@dataclass
class _Live:
    """A request the scheduler knows: waiting (no blocks) or running."""

    request: Request
    running: bool = False


@dataclass(frozen=True)
class _Earlier:
    """Tokens of an earlier request (prompt, or all tokens when it left) and its extra keys."""

    tokens: tuple[int, ...]
    lora: int | None
    mm: tuple[tuple[int, int, str], ...]
    salt: str | None


class ManagerDriver:
    """Plays a scheduler against a spec manager and a manager under test (module docstring).

    Attributes:
        run: what this run is.
        pair: the two managers and the comparison schedule.
        coverage: where events are counted (shared by every run of a campaign).
    """

    def __init__(
        self,
        run: ManagerRun,
        factory: ManagerFactory,
        coverage: Coverage,
        *,
        check_every: int | None = None,
        hostile_calls: Mapping[str, HostileCall] = HOSTILE_CALLS,
    ) -> None:
        self.run = run
        config = run.config
        spec = spec_manager(config)
        impl = factory(config)
        self.pair: ComparedPair[ManagerUnderTest] = ComparedPair(
            spec,
            impl,
            manager_probe(spec),
            manager_probe(impl),
            check_every=check_every or run.check_every,
            same_messages=factory is pagedkv_manager,
        )
        assert isinstance(spec, SpecManagerAdapter)
        self._spec = spec.manager  # read for coverage only
        self.coverage = coverage
        self.hostile_calls = hostile_calls
        self._hostile_kinds = tuple(hostile_calls)
        self.block_size = run.block_size
        self.window = run.sliding_window
        self.max_tokens = -(-config.max_model_len // self.block_size) * self.block_size
        self.caching = config.enable_caching
        self.live: list[_Live] = []
        self.history: list[_Earlier] = []
        self.num_arrived = 0
        # No None inside: before Python 3.12, hash(None) differs from process to process.
        self._config_key = hash((run.num_blocks, self.block_size, self.window or 0, self.caching))
        features = run.features
        self._drafts = "draft tokens" in features
        self._lookahead = "lookahead" in features
        self._chunked = "chunked prefill" in features
        self._shared = "shared prefixes" in features
        self._lora = "lora" in features
        self._mm = "multimodal" in features
        self._salts = "salts" in features
        self._logprobs = "prompt logprobs" in features
        self._picker = OperationPicker(run.weights)
        self._takes = EventTakes(run.seed, run.kv_events)
        coverage.start_run(run.histogram_keys())

    # -- drawing operations -------------------------------------------------------------------

    def generate(self, rng: random.Random) -> ManagerOp:
        """The next operation: a take of the events when due, else a kind drawn by the run's
        weights among those that apply now."""
        if self._takes.due():
            return TakeEvents()
        live = self.live
        num_live = len(live)
        waiting = sum(1 for entry in live if not entry.running)
        running = num_live - waiting
        pick = self._picker.pick
        for _ in range(4):
            kind = pick(rng)
            if kind in ("step", "preempt", "common prefix"):
                applies = running > 0
            elif kind == "admit":
                applies = waiting > 0
            elif kind == "arrive":
                applies = num_live < self.run.max_live
            elif kind in ("finish", "hostile"):
                applies = num_live > 0
            else:
                applies = True
            if applies:
                return self._draw(kind, rng)
        if num_live < self.run.max_live:
            return self._draw("arrive", rng)
        return self._draw("admit" if waiting else "step", rng)

    def _draw(self, kind: str, rng: random.Random) -> ManagerOp:
        which = rng.getrandbits(16)
        block_size = self.block_size
        if kind == "step":
            drafts: tuple[int, ...] = ()
            if self._drafts and rng.random() < 0.6:
                drafts = tuple(rng.choices(range(self.run.alphabet), k=rng.randint(1, 3)))
            return Step(
                which,
                self._draw_chunk(rng),
                drafts,
                rng.randint(0, len(drafts)),
                self._draw_lookahead(rng),
                rng.randrange(self.run.alphabet),
            )
        if kind == "admit":
            return Admit(which, self._draw_chunk(rng), self._draw_lookahead(rng))
        if kind == "arrive":
            return self._draw_arrival(rng)
        if kind == "preempt":
            return Preempt(which)
        if kind == "finish":
            return Finish(which)
        if kind == "common prefix":
            return CommonPrefix(which)
        if kind == "reset":
            return Reset()
        if kind == "stats":
            return Stats()
        return Hostile(rng.choice(self._hostile_kinds), which, rng.getrandbits(8) + block_size)

    def _draw_chunk(self, rng: random.Random) -> int:
        if self._chunked and rng.random() < 0.5:
            return rng.randint(1, 2 * self.block_size)
        return 0

    def _draw_lookahead(self, rng: random.Random) -> int:
        if self._lookahead and rng.random() < 0.5:
            return rng.randint(1, self.block_size + 2)
        return 0

    def _draw_arrival(self, rng: random.Random) -> Arrive:
        block_size = self.block_size
        share, share_len, share_keys = -1, 0, False
        if self._shared and self.history and rng.random() < 0.6:
            share = rng.randrange(len(self.history))
            # Whole blocks of the earlier request, sometimes a token more or less.
            share_len = block_size * rng.randint(1, 8) + rng.choice((0, 0, 0, 1, -1))
            share_keys = rng.random() < 0.8
        longest = max(1, min(self.run.config.max_model_len, 4 * block_size + 1))
        num_tokens = rng.randint(0 if share >= 0 else 1, longest)
        tokens = tuple(rng.choices(range(self.run.alphabet), k=num_tokens))
        mm: tuple[tuple[int, int, str], ...] = ()
        if self._mm and num_tokens and rng.random() < 0.5:
            start = rng.randrange(num_tokens)
            if rng.random() < 0.5:
                start -= start % block_size  # on a block boundary
            length = rng.randint(1, num_tokens - start)
            last_boundary = num_tokens - num_tokens % block_size
            if last_boundary > start and rng.random() < 0.25:
                # Ends where the first block hashed after the prompt (by a decode) starts.
                length = last_boundary - start
            mm = ((start, length, rng.choice(MM_HASHES)),)
        return Arrive(
            tokens,
            share,
            share_len,
            share_keys,
            rng.choice((None, 1, 2)) if self._lora else None,
            mm,
            rng.choice((None, *SALTS)) if self._salts else None,
            self._logprobs and rng.random() < 0.15,
        )

    # -- executing operations -----------------------------------------------------------------

    def execute(self, op: ManagerOp) -> None:
        """Apply one operation to both managers, compare, and count what it exercised."""
        if isinstance(op, Step):
            self._step(op)
        elif isinstance(op, Admit):
            self._admit(op)
        elif isinstance(op, Arrive):
            self._arrive(op)
        elif isinstance(op, Preempt):
            self._preempt(op)
        elif isinstance(op, Finish):
            self._finish(op)
        elif isinstance(op, Reset):
            self._reset()
        elif isinstance(op, Stats):
            self.pair.call(lambda: "make_prefix_cache_stats()", _stats)
            self._end(())
        elif isinstance(op, CommonPrefix):
            self._common_prefix(op)
        elif isinstance(op, TakeEvents):
            take_events(self.pair, self.coverage)
            self._end(())
        else:
            self._hostile(op)

    def finish_run(self) -> None:
        """The end of the run: a full check of both managers."""
        self.pair.full_check("the end of the run")

    def _end(self, touched: tuple[str, ...]) -> None:
        self.pair.end_step(touched)
        coverage = self.coverage
        coverage.steps += 1
        spec = self._spec
        coverage.states.add(
            hash(
                (
                    self._config_key,
                    spec.pool.get_num_free_blocks(),
                    len(spec.pool.index),
                    *map(tuple, spec.blocks.values()),
                )
            )
        )

    def _pick(self, which: int, *, running: bool | None) -> _Live | None:
        if running is None:
            candidates = self.live
        else:
            candidates = [entry for entry in self.live if entry.running == running]
        return candidates[which % len(candidates)] if candidates else None

    def _arrive(self, op: Arrive) -> None:
        self.num_arrived += 1
        request_id = f"req-{self.num_arrived}"
        tokens = list(op.tokens)
        lora, mm, salt = op.lora, op.mm, op.salt
        if op.share >= 0 and self.history:
            earlier = self.history[op.share % len(self.history)]
            shared = earlier.tokens[: max(op.share_len, 0)]
            tokens = [*shared, *tokens]
            if op.share_keys:
                lora, salt = earlier.lora, earlier.salt
                mm = earlier.mm
            else:
                mm = tuple((start + len(shared), length, h) for start, length, h in mm)
        tokens = tokens[: self.run.config.max_model_len] or [0]
        mm = tuple(entry for entry in mm if entry[0] + entry[1] <= len(tokens))
        request = Request(
            request_id,
            tokens,
            mm_positions=[PlaceholderRange(start, length) for start, length, _ in mm],
            mm_hashes=[h for _, _, h in mm],
            lora_id=lora,
            cache_salt=salt,
            prompt_logprobs=op.logprobs,
        )
        if lora is not None or mm or salt is not None:
            self.coverage.counts["requests with extra keys"] += 1
        self.live.append(_Live(request))
        self._remember(request, lora, mm, salt)
        self._end(())

    def _remember(
        self,
        request: Request,
        lora: int | None,
        mm: tuple[tuple[int, int, str], ...],
        salt: str | None,
    ) -> None:
        self.history.append(_Earlier(tuple(request.all_token_ids), lora, mm, salt))
        if len(self.history) > HISTORY:
            del self.history[0]

    def _admit(self, op: Admit) -> None:
        live = self._pick(op.which, running=False)
        if live is None:
            self._end(())
            return
        request = live.request
        request_id = request.request_id
        lookup, error = self.pair.call(
            lambda: f"get_computed_blocks({request_id})",
            lambda manager: manager.get_computed_blocks(request),
        )
        if error is not None or lookup is None:
            self._error("get_computed_blocks", error)
            self._end((request_id,))
            return
        hits, num_hit_tokens = lookup
        self._count_lookup(request, hits)
        remaining = request.num_tokens - num_hit_tokens
        chunk = remaining if op.chunk <= 0 or op.chunk >= remaining else op.chunk
        if chunk < remaining:
            self.coverage.counts["chunked prefill steps"] += 1
        room = self.max_tokens - num_hit_tokens - chunk
        if room < 0:
            self._finish_request(live)  # the prompt alone is past max_model_len
            self._end((request_id,))
            return
        lookahead = min(op.lookahead, room)
        allocated = self._allocate(request, chunk, hits, lookahead, decode=False)
        if allocated:
            live.running = True
            request.num_computed_tokens = num_hit_tokens + chunk
            self._maybe_sample(live, (), op_token=0)
        self._end((request_id,))

    def _step(self, op: Step) -> None:
        live = self._pick(op.which, running=True)
        if live is None:
            self._end(())
            return
        request = live.request
        request_id = request.request_id
        computed = request.num_computed_tokens
        pending = request.num_tokens - computed
        drafts: tuple[int, ...] = ()
        if pending > 1:
            chunk = pending if op.chunk <= 0 or op.chunk >= pending else op.chunk
            self.coverage.counts["chunked prefill steps"] += 1
        else:
            chunk, drafts = 1, op.drafts
        room = self.max_tokens - computed - chunk
        if room < 0:
            self._finish_request(live)  # reached max_model_len
            self._end((request_id,))
            return
        drafts = drafts[:room]
        lookahead = min(op.lookahead, room - len(drafts))
        request.spec_token_ids = list(drafts)
        try:
            allocated = self._allocate(
                request, chunk + len(drafts), None, lookahead, decode=pending == 1
            )
        finally:
            request.spec_token_ids = []
        if allocated is None:
            self._end((request_id,))
            return
        if not allocated:
            self.coverage.counts["preemptions for lack of blocks"] += 1
            self._preempt_request(live)
            self._end((request_id,))
            return
        accepted = drafts[: op.accepted]
        request.num_computed_tokens = computed + chunk + len(accepted)
        self._maybe_sample(live, accepted, op.token)
        self._end((request_id,))

    def _allocate(
        self,
        request: Request,
        num_tokens: int,
        hits: list[int] | None,
        lookahead: int,
        *,
        decode: bool,
    ) -> bool | None:
        """allocate_slots on both sides: True (allocated), False (None: no room), None (both
        refused). Counts what the call exercised, from the spec's state before and after."""
        spec = self._spec
        counts = self.coverage.counts
        request_id = request.request_id
        block_size = self.block_size
        computed = request.num_computed_tokens
        num_drafts = len(request.spec_token_ids)
        held = spec.blocks.get(request_id)
        num_held = len(held) if held else 0
        nulls_before = held.count(0) if held and self.window is not None else 0
        hashed_before: dict[int, bool] = {}
        if self.caching:
            # New blocks come from the free queue's head (after the hits leave it), or are the
            # request's own blocks the window frees first: note which of them are cached, to
            # count evictions.
            start = computed + (len(hits) * block_size if hits else 0)
            most = -(-(start + num_tokens + lookahead) // block_size) - num_held
            block_hash = spec.pool.block_hash
            hashed_before = {
                block_id: block_hash[block_id] is not None
                for block_id in (*spec.pool.free_order[: max(most, 0)], *(held or ()))
            }
        result, error = self.pair.call(
            lambda: (
                f"allocate_slots({request_id}, {num_tokens}, {hits}, {lookahead})"
                + (f" with spec_token_ids={request.spec_token_ids}" if num_drafts else "")
            ),
            lambda manager: manager.allocate_slots(request, num_tokens, hits, lookahead),
        )
        if error is not None:
            self._error("allocate_slots", error)
            return None
        if result is None:
            counts["allocate_slots refused for lack of blocks"] += 1
            return False
        start = computed + (len(hits) * block_size if hits else 0)
        real_end = start + num_tokens - num_drafts
        if result:
            counts["new-block allocations"] += 1
            if hashed_before:
                evicted = sum(1 for block_id in result if hashed_before.get(block_id, False))
                counts["evictions of cached blocks"] += evicted
            needed_without_lookahead = -(-(start + num_tokens) // block_size)
            if lookahead and needed_without_lookahead <= num_held + (len(hits) if hits else 0):
                counts["new blocks for lookahead slots only"] += 1
        elif decode:
            counts["decode steps inside a block"] += 1
        num_filled = real_end // block_size - start // block_size
        if num_filled > 0:
            counts["block fills"] += 1
        if held and not hits:  # a running request: the ground of allocate_slots' fast path
            if len(result) == 1 and num_filled <= 0:
                counts["running steps taking one new block"] += 1
            elif not result and num_filled == 1:
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
            freed = spec.blocks[request_id].count(0) - nulls_before
            if freed > 0:
                counts["blocks freed by the sliding window"] += freed
        return True

    def _count_lookup(self, request: Request, hits: list[int]) -> None:
        counts = self.coverage.counts
        if request.prompt_logprobs and self.caching:
            counts["prompt-logprobs lookups"] += 1
        if not hits:
            return
        if self.window is None:
            counts["prefix hits, full attention"] += 1
        else:
            counts["prefix hits, sliding window"] += 1
            if hits[0] == 0:
                counts["sliding-window hits with leading null blocks"] += 1
        num_full = request.num_tokens // self.block_size
        lookup_length = num_full - (num_full * self.block_size == request.num_tokens)
        if len(hits) + self.run.config.use_eagle >= lookup_length:
            counts["hits that use every cached block"] += 1

    def _maybe_sample(self, live: _Live, accepted: tuple[int, ...], op_token: int) -> None:
        """Once every token is computed the step yields the accepted drafts and one token; a
        request reaching max_model_len finishes."""
        request = live.request
        if request.num_computed_tokens < request.num_tokens:
            return  # a prefill chunk: nothing sampled yet
        request.append_output_token_ids([*accepted, op_token])
        if request.num_tokens >= self.run.config.max_model_len:
            self._finish_request(live)

    def _preempt(self, op: Preempt) -> None:
        live = self._pick(op.which, running=True)
        if live is not None:
            self.coverage.counts["requests preempted by the scheduler"] += 1
            self._preempt_request(live)
        self._end((live.request.request_id,) if live else ())

    def _preempt_request(self, live: _Live) -> None:
        request = live.request
        _, error = self.pair.call(
            lambda: f"free({request.request_id})", lambda manager: manager.free(request)
        )
        if error is not None:
            self._error("free", error)
            return
        request.num_computed_tokens = 0
        live.running = False

    def _finish(self, op: Finish) -> None:
        live = self._pick(op.which, running=None)
        if live is not None:
            self._finish_request(live)
        self._end((live.request.request_id,) if live else ())

    def _finish_request(self, live: _Live) -> None:
        request = live.request
        request_id = request.request_id
        _, error = self.pair.call(
            lambda: f"free({request_id})", lambda manager: manager.free(request)
        )
        self._error("free", error)
        _, error = self.pair.call(
            lambda: f"free_block_hashes({request_id})",
            lambda manager: manager.free_block_hashes(request),
        )
        self._error("free_block_hashes", error)
        self.live.remove(live)
        self.coverage.counts["finished requests"] += 1
        mm = tuple(
            (position.offset, position.length, h)
            for position, h in zip(request.mm_positions, request.mm_hashes, strict=True)
        )
        self._remember(request, request.lora_id, mm, request.cache_salt)

    def _reset(self) -> None:
        reset, error = self.pair.call(
            lambda: "reset_prefix_cache()", lambda manager: manager.reset_prefix_cache()
        )
        if error is not None:
            self._error("reset_prefix_cache", error)
        elif reset:
            self.coverage.counts["successful prefix-cache resets"] += 1
            self.pair.full_check("a prefix-cache reset")
        else:
            self.coverage.counts["refused prefix-cache resets"] += 1
        self._end(())

    def _common_prefix(self, op: CommonPrefix) -> None:
        live = self._pick(op.which, running=True)
        if live is not None:
            request = live.request
            num_running = sum(1 for entry in self.live if entry.running)
            self.pair.call(
                lambda: f"get_num_common_prefix_blocks({request.request_id}, {num_running})",
                lambda manager: manager.get_num_common_prefix_blocks(request, num_running),
            )
        self._end(())

    def _hostile(self, op: Hostile) -> None:
        live = self._pick(op.which, running=None)
        call = self.hostile_calls.get(op.kind)
        if live is None or call is None:
            self._end(())
            return
        request = live.request
        config = self.run.config
        scene = Scene(
            pair=self.pair,
            request=request,
            running=live.running,
            tracked=request.request_id in self._spec.requests,
            num_stored_hashes=len(self._spec.hashes.get(request.request_id, ())),
            num_blocks=self.run.num_blocks,
            max_model_len=config.max_model_len,
            block_size=self.block_size,
            sliding_window=self.window,
            enable_caching=self.caching,
            arg=op.arg,
            on_refusal=self._error,
        )
        call(scene)
        self.coverage.counts[f"hostile call {op.kind}"] += 1
        self._end((request.request_id,))

    def _error(self, operation: str, error: Exception | None) -> None:
        if error is not None:
            self.coverage.count_error(operation, error)


def _stats(manager: ManagerUnderTest) -> Any:
    return manager.make_prefix_cache_stats()
