"""The swarm's choice of the next operation: sampled by a run's weights from the client's state.

A sampler reads the client (which requests are waiting or running, how many sequences it holds)
and draws the next operation from a `random.Random`, among the kinds the run enables
(`harness/swarm/runs.py`). Execution is the client's (`harness/client/`): it depends only on the
operation and the state, so a recorded list of operations replays exactly without the sampler.

In a run with KV cache events on, before each operation with chance `TAKE_EVENTS_CHANCE`, the
events are taken instead (a scheduler takes them once a step), from a stream of its own: a run
with events on makes the operations it would make with events off, with takes between them.
"""

from __future__ import annotations

import random

from pagedkv.harness.client.hostile import HOSTILE_CALLS, HYBRID_ONLY_CALLS
from pagedkv.harness.client.manager import ManagerClient
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
from pagedkv.harness.client.pool import MISUSE, PoolClient
from pagedkv.harness.client.pool_ops import (
    Admit as PoolAdmit,
)
from pagedkv.harness.client.pool_ops import (
    Adopt,
    CacheBlocks,
    FreeAll,
    FreeSome,
    Grow,
    Hit,
    Lookup,
    Misuse,
    NewBlocks,
    NewRequest,
    PoolOp,
    Touch,
)
from pagedkv.harness.client.pool_ops import (
    Finish as PoolFinish,
)
from pagedkv.harness.client.pool_ops import (
    Reset as PoolReset,
)
from pagedkv.harness.client.pool_ops import (
    TakeEvents as TakePoolEvents,
)
from pagedkv.harness.client.requests import MM_HASHES, SALTS
from pagedkv.harness.swarm.runs import (
    MAX_DRAFTS,
    ManagerRun,
    OperationPicker,
    PoolRun,
    is_mamba_align,
)

TAKE_EVENTS_CHANCE = 1 / 8
"""The chance, before each operation of a run with events on, that the events are taken first.
Between takes the queue holds about 8 operations' events on average."""

UNALIGNED_CHANCE = 1 / 4
"""The chance that a chunk of a Mamba-align hybrid with misuse on is sent uncut, as vLLM's
scheduler would not cut it (`ManagerClient._align_chunk`): from a block boundary it may end
inside a block (allowed); from inside a block it is sent across its end, and refused alike
(`mamba_unaligned_chunk`)."""

TAKES_STREAM = 0x5BD1E9955BD1E995
"""Mixed into a run's seed for the stream that decides when events are taken (not the stream
of operations)."""


class EventTakes:
    """When a run takes events: `due()` before each operation drawn (never with events off)."""

    def __init__(self, run_seed: int, kv_events: bool) -> None:
        self._rng = random.Random(run_seed ^ TAKES_STREAM) if kv_events else None

    def due(self) -> bool:
        return self._rng is not None and self._rng.random() < TAKE_EVENTS_CHANCE


class ManagerSampler:
    """Draws a manager run's operations (the run's weights, features and sizes)."""

    def __init__(self, run: ManagerRun, hostile_kinds: tuple[str, ...] = tuple(HOSTILE_CALLS)):
        self.run = run
        self.block_size = run.block_size
        self.hostile_kinds = tuple(
            kind for kind in hostile_kinds if run.hybrid or kind not in HYBRID_ONLY_CALLS
        )
        features = run.features
        self._drafts = "draft tokens" in features
        self._lookahead = "lookahead" in features
        self._chunked = "chunked prefill" in features
        # Hybrid runs always share prefixes: hits are where their groups disagree.
        self._shared = "shared prefixes" in features or run.hybrid
        self._lora = "lora" in features
        self._mm = "multimodal" in features
        self._salts = "salts" in features
        self._logprobs = "prompt logprobs" in features
        self._picker = OperationPicker(run.weights)
        self._takes = EventTakes(run.seed, run.kv_events)
        self._unaligned = run.misuse and is_mamba_align(run.config)

    def generate(self, rng: random.Random, client: ManagerClient) -> ManagerOp:
        """The next operation: a take of the events when due, else a kind drawn by the run's
        weights among those that apply now."""
        if self._takes.due():
            return TakeEvents()
        live = client.live
        num_live = len(live)
        waiting = [entry.running for entry in live].count(False)
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
                return self._draw(kind, rng, client)
        if num_live < self.run.max_live:
            return self._draw("arrive", rng, client)
        return self._draw("admit" if waiting else "step", rng, client)

    def _draw(self, kind: str, rng: random.Random, client: ManagerClient) -> ManagerOp:
        which = rng.getrandbits(16)
        if kind == "step":
            drafts: tuple[int, ...] = ()
            if self._drafts and rng.random() < 0.6:
                drafts = tuple(rng.choices(range(self.run.alphabet), k=rng.randint(1, MAX_DRAFTS)))
            step = Step(
                which,
                self._draw_chunk(rng),
                drafts,
                rng.randint(0, len(drafts)),
                self._draw_lookahead(rng),
                rng.randrange(self.run.alphabet),
            )
            if self.run.external_tokens and rng.random() < 0.25:  # a load that fails
                step = step._replace(fail_at=rng.randrange(4))
            if self.run.deferred_frees and self.run.misuse and rng.random() < 0.1:
                step = step._replace(release_twice=True)  # misuse: a batch released twice
            if self.run.offload_tier is not None:  # the oldest store: done, failed, pending
                step = step._replace(store=rng.choice((0, 0, 0, 0, 1, 2)))
            if self._unaligned and rng.random() < UNALIGNED_CHANCE:
                step = step._replace(unaligned=True)
            return step
        if kind == "admit":
            chunk, lookahead = self._draw_chunk(rng), self._draw_lookahead(rng)
            if self.run.external_tokens and rng.random() < 0.7:  # a connector's hit
                external = rng.randint(1, 4 * self.block_size + 2)
                load_async = rng.random() < 0.5
                if self.run.sync_failures and not load_async and rng.random() < 0.25:
                    fail_at = rng.randrange(4)  # the sync load fails from this block on
                    return Admit(which, chunk, lookahead, 0, external, False, fail_at)
                return Admit(which, chunk, lookahead, 0, external, load_async)
            if self._unaligned and rng.random() < UNALIGNED_CHANCE:
                return Admit(which, chunk, lookahead, unaligned=True)
            return Admit(which, chunk, lookahead)
        if kind == "arrive":
            return self._draw_arrival(rng, client)
        if kind == "preempt":
            if self.run.deferred_frees and rng.random() < 1 / 3:  # a step in flight
                return Preempt(which, True)
            return Preempt(which)
        if kind == "finish":
            if self.run.external_tokens and rng.random() < 1 / 3:  # the connector sends
                return Finish(which, True)
            if self.run.deferred_frees and rng.random() < 1 / 2:  # a step in flight
                return Finish(which, False, True)
            return Finish(which)
        if kind == "common prefix":
            return CommonPrefix(which)
        if kind == "reset":
            return Reset()
        if kind == "stats":
            return Stats()
        if kind == "new step":
            return NewStep()
        if kind == "evict":
            return Evict(which, rng.randrange(4), rng.getrandbits(8))
        return Hostile(rng.choice(self.hostile_kinds), which, rng.getrandbits(8) + self.block_size)

    def _draw_chunk(self, rng: random.Random) -> int:
        if self._chunked and rng.random() < 0.5:
            return rng.randint(1, 2 * self.block_size)
        return 0

    def _draw_lookahead(self, rng: random.Random) -> int:
        if self._lookahead and rng.random() < 0.5:
            return rng.randint(1, self.block_size + 2)
        return 0

    def _draw_arrival(self, rng: random.Random, client: ManagerClient) -> Arrive:
        block_size = self.block_size
        share, share_len, share_keys = -1, 0, False
        if self._shared and client.history and rng.random() < 0.6:
            share = rng.randrange(len(client.history))
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


class PoolSampler:
    """Draws a pool run's operations (the run's weights and sizes)."""

    def __init__(self, run: PoolRun) -> None:
        self.run = run
        self._pick = OperationPicker(run.weights).pick
        self._takes = EventTakes(run.seed, run.kv_events)

    def generate(self, rng: random.Random, client: PoolClient) -> PoolOp:
        if self._takes.due():
            return TakePoolEvents()
        kind = self._pick(rng)
        n = self.run.num_blocks
        if kind == "get_new_blocks":
            return NewBlocks(rng.randint(0, max(1, n // 4)))
        if kind == "touch":
            block_ids = tuple(rng.randrange(n) for _ in range(rng.randint(0, 3)))
            return Touch(block_ids, rng.random() < 0.25)
        if kind == "free_blocks":
            return FreeSome(tuple(rng.getrandbits(16) for _ in range(rng.randint(0, 4))))
        if kind == "free everything":
            return FreeAll(rng.getrandbits(32))
        if kind == "admit":
            return PoolAdmit(self._draw_request(rng, client))
        if kind == "hit":
            return Hit(self._draw_request(rng, client))
        if kind == "adopt":
            picks = tuple(rng.getrandbits(16) for _ in range(rng.randint(0, 4)))
            return Adopt(self._draw_request(rng, client), picks, rng.randint(0, 4))
        if kind == "grow":
            count = rng.randint(0, 2 * self.run.block_size)
            return Grow(rng.getrandbits(16), tuple(rng.choices(range(self.run.alphabet), k=count)))
        if kind == "cache_full_blocks":
            return CacheBlocks(rng.getrandbits(16), rng.randint(0, 8))
        if kind == "finish":
            return PoolFinish(rng.getrandbits(16))
        if kind == "get_cached_block":
            return Lookup(rng.getrandbits(16))
        if kind == "reset":
            return PoolReset()
        return Misuse(rng.choice(MISUSE), rng.getrandbits(16))

    def _draw_request(self, rng: random.Random, client: PoolClient) -> NewRequest:
        block_size = self.run.block_size
        follow, follow_len = -1, 0
        if client.requests and rng.random() < 0.5:
            follow = rng.randrange(len(client.requests))
            follow_len = block_size * rng.randint(1, 4) + rng.choice((0, 0, 1))
        count = rng.randint(0 if follow >= 0 else 1, 4 * block_size)
        tokens = tuple(rng.choices(range(self.run.alphabet), k=count))
        lora: int | None = None
        mm: tuple[tuple[int, int, str], ...] = ()
        salt: str | None = None
        if self.run.extra_keys and follow < 0:
            lora = rng.choice((None, None, 1, 2))
            if self.run.domain.cache_salts:
                salt = rng.choice((None, None, *SALTS))
            if count and rng.random() < 0.4 and self.run.domain.multimodal:
                start = rng.randrange(count)
                mm = ((start, rng.randint(1, count - start), rng.choice(MM_HASHES)),)
        return NewRequest(tokens, follow, follow_len, lora, mm, salt)
