"""The request-level manager as a finite world: a simulated scheduler over a few fixed prompts.

Each request slot `r0, r1, ...` has a fixed prompt and is absent, waiting or running. The
scheduler's moves (each a transition, every manager call applied to both managers in lock-step):

- `admit(r, t)`: an absent request arrives (a fresh `Request` with the slot's prompt and extra
  keys), or a waiting one is retried: `get_computed_blocks`, then `allocate_slots` for the rest
  of the prompt with the hits (and, with `lookaheads`, each lookahead count: `admit(r, t,
  la=l)`). On success it runs; when every token is computed, token `t` is sampled.
- `admit_chunk(r)` (with `chunked_prefill`): the same, scheduling one token only.
- `step(r, t)`: a running request's pending tokens (the rest of its prompt, or the last sampled
  token); `allocate_slots`; None preempts it (as a scheduler does), else token `t` is sampled.
  With `drafts`, a decode step also schedules d draft tokens (`step(r, t, d=d, a=a)`), of which
  none or all are accepted (appended before `t`); with `lookaheads`, each lookahead count.
- `preempt(r)`: `free`, computed tokens back to 0, waiting (its stored hashes stay).
- `finish(r)`: `free` + `free_block_hashes`; the slot is absent again (it may arrive anew).
- `reset_prefix_cache()`.
- misuse (with `misuse`): zero tokens, more tokens than the request has, past max_model_len, a
  hit outside the pool, an impostor `Request` with a tracked id, freeing an unknown request, and
  the common-prefix query; each must fail (or change nothing) identically on both sides.

A request whose length reaches `max_model_len` after sampling finishes, so token lists and hence
the state space stay finite.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.harness.adapters import pagedkv_manager, spec_manager
from pagedkv.harness.lockstep import LockstepPair
from pagedkv.harness.protocol import (
    ManagerConfig,
    ManagerFactory,
    ManagerSnapshot,
    ManagerUnderTest,
)
from pagedkv.harness.swarm_runs import attention_spec
from pagedkv.vocab.kv_cache_interface import (
    uniform_kv_cache_config,
)
from pagedkv.vocab.request import PlaceholderRange, Request
from pagedkv.vocab.semantics import PAGEDKV, Semantics
from proofs.exhaustive.fingerprint import fingerprint
from proofs.exhaustive.pool_world import pool_key
from proofs.exhaustive.search import Frozen, Transition, World, freeze, thaw

ABSENT, WAITING, RUNNING = "absent", "waiting", "running"


@dataclass(frozen=True)
class ManagerSearchConfig:
    """One manager configuration to search exhaustively.

    Attributes:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block.
        max_model_len: the longest request; a request reaching it finishes.
        prompts: one prompt per request slot (r0, r1, ...), tokens from a tiny alphabet.
        sliding_window: the window in tokens, or None for full attention.
        samples: the tokens a step may sample (each one a separate transition).
        enable_caching: prefix caching on or off.
        use_eagle: drop the last block of every hit.
        chunked_prefill: also admit with a one-token chunk.
        misuse: include invalid calls (each must fail identically and change nothing).
        semantics: pagedkv's or vLLM 0.8.5's side of the deliberate differences.
        hash_algo: "sha256" or "builtin".
        drafts: the numbers of draft tokens a decode step may schedule (each a transition).
        lookaheads: the lookahead counts admissions and steps may ask for (each a transition).
        keys: per request slot, its extra keys (LoRA id, multimodal inputs, cache salt), or
            None for none; slots past the end have none.
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    prompts: tuple[tuple[int, ...], ...]
    sliding_window: int | None = None
    samples: tuple[int, ...] = (0, 1)
    enable_caching: bool = True
    use_eagle: bool = False
    chunked_prefill: bool = False
    misuse: bool = True
    semantics: Semantics = PAGEDKV
    hash_algo: str = "sha256"
    drafts: tuple[int, ...] = (0,)
    lookaheads: tuple[int, ...] = (0,)
    keys: tuple[RequestKeys | None, ...] = ()

    def __post_init__(self) -> None:
        assert all(0 < len(p) <= self.max_model_len for p in self.prompts), "prompts must fit"

    @property
    def name(self) -> str:
        attention = "full" if self.sliding_window is None else f"window={self.sliding_window}"
        flags = "".join(
            f" {flag}"
            for flag, on in (
                ("no-caching", not self.enable_caching),
                ("eagle", self.use_eagle),
                ("chunked", self.chunked_prefill),
                (f"drafts={list(self.drafts)}", self.drafts != (0,)),
                (f"lookaheads={list(self.lookaheads)}", self.lookaheads != (0,)),
                ("keys=" + "/".join(map(_show_keys, self.keys)), bool(self.keys)),
                (self.semantics.name, self.semantics != PAGEDKV),
            )
            if on
        )
        prompts = " ".join("".join(map(str, p)) for p in self.prompts)
        return (
            f"manager {attention} N={self.num_blocks} B={self.block_size} "
            f"max_len={self.max_model_len} prompts=[{prompts}] samples={list(self.samples)}"
            f"{flags}"
        )

    def manager_config(self) -> ManagerConfig:
        """The `ManagerConfig` both managers are built from."""
        kv_cache_spec = attention_spec(self.block_size, self.sliding_window)
        return ManagerConfig(
            uniform_kv_cache_config(kv_cache_spec, self.num_blocks),
            self.max_model_len,
            self.enable_caching,
            self.hash_algo,
            self.use_eagle,
            False,  # stats counters grow without bound: they would make the state space infinite
            self.semantics,
            enable_kv_cache_events=True,  # compared, not part of a state's key (history)
        )


@dataclass(frozen=True)
class RequestKeys:
    """A request slot's extra keys: they join every block's hash (so equal tokens with other
    keys never share a block).

    Attributes:
        lora_id: the LoRA adapter, or None.
        mm: multimodal inputs as (offset, length, content hash), inside the slot's prompt.
        cache_salt: the tenant's salt, or None.
    """

    lora_id: int | None = None
    mm: tuple[tuple[int, int, str], ...] = ()
    cache_salt: str | None = None

    def request(self, request_id: str, prompt: tuple[int, ...]) -> Request:
        return Request(
            request_id,
            prompt,
            mm_positions=[PlaceholderRange(offset, length) for offset, length, _ in self.mm],
            mm_hashes=[content for _, _, content in self.mm],
            lora_id=self.lora_id,
            cache_salt=self.cache_salt,
        )


def _show_keys(keys: RequestKeys | None) -> str:
    if keys is None:
        return "-"
    parts = [f"lora{keys.lora_id}"] if keys.lora_id is not None else []
    parts += [f"mm{offset}+{length}:{content}" for offset, length, content in keys.mm]
    parts += ["salt"] if keys.cache_salt is not None else []
    return ",".join(parts) or "-"


@dataclass
class _Slot:
    """One request as the scheduler sees it; `request` is None while absent."""

    status: str
    request: Request | None = None


Step = Callable[["ManagerWorld"], None]


class ManagerWorld:
    """A state of the manager search (see the module docstring for the transitions)."""

    def __init__(
        self,
        pair: LockstepPair[ManagerUnderTest],
        config: ManagerSearchConfig,
        slots: dict[str, _Slot],
    ) -> None:
        self.pair = pair
        self.config = config
        self.slots = slots

    def dump(self) -> Frozen:
        # One freeze: the managers and the slots share the Request objects.
        return freeze((self.pair.spec, self.pair.impl, self.slots))

    def load(self, frozen: Frozen, state: ManagerSnapshot) -> ManagerWorld:
        spec, impl, slots = thaw(frozen)
        pair = LockstepPair.restored(spec, impl, state, self.pair.same_messages)
        return ManagerWorld(pair, self.config, slots)

    def key(self) -> Hashable:
        requests = tuple(
            (slot.status,)
            if slot.request is None
            else (slot.status, tuple(slot.request.all_token_ids), slot.request.num_computed_tokens)
            for slot in self.slots.values()
        )
        return manager_key(self.pair.state), requests, fingerprint(self.pair.impl)

    # -- transitions -------------------------------------------------------------------------

    def transitions(self) -> Sequence[Transition]:
        config = self.config
        steps: list[Transition] = []
        for request_id, slot in self.slots.items():
            if slot.status != RUNNING:
                for token, lookahead in itertools.product(config.samples, config.lookaheads):
                    label = f"admit({request_id}, t={token}{_la(lookahead)})"
                    steps.append(_transition(label, _admit, request_id, token, False, lookahead))
                if config.chunked_prefill:
                    steps.append(
                        _transition(f"admit_chunk({request_id})", _admit, request_id, None, True, 0)
                    )
            else:
                steps += self._steps(request_id)
                steps.append(_transition(f"preempt({request_id})", _preempt, request_id))
            if slot.status != ABSENT:
                steps.append(_transition(f"finish({request_id})", _finish, request_id))
        steps.append(_simple_call("reset_prefix_cache()", lambda m: m.reset_prefix_cache()))
        if config.misuse:
            steps += self._misuse()
        return steps

    def _steps(self, request_id: str) -> list[Transition]:
        """Every step of a running request: each sampled token, draft count (decode steps
        only), accepted drafts (none or all) and lookahead that keeps it within max_model_len."""
        config = self.config
        request = self.slots[request_id].request
        assert request is not None
        pending = request.num_tokens - request.num_computed_tokens
        room = -(-config.max_model_len // config.block_size) * config.block_size
        room -= request.num_computed_tokens + pending
        steps = []
        for token, drafts, lookahead in itertools.product(
            config.samples, config.drafts, config.lookaheads
        ):
            if (drafts and pending != 1) or drafts + lookahead > room:
                continue
            for accepted in sorted({0, drafts}):
                label = f"step({request_id}, t={token}{_drafts(drafts, accepted)}{_la(lookahead)})"
                steps.append(
                    _transition(label, _step, request_id, token, drafts, accepted, lookahead)
                )
        return steps

    def _misuse(self) -> list[Transition]:
        state: ManagerSnapshot = self.pair.state
        config = self.config
        running = [slot.request for slot in self.slots.values() if slot.status == RUNNING]
        steps = [_simple_call("free(never-seen)", lambda m: m.free(_STRANGER))]
        for request_id, slot in self.slots.items():
            request = slot.request
            if request is None:
                continue
            tracked = request_id in state.blocks or request_id in state.hashes
            steps.append(_bad_allocation(request_id, 0))
            if slot.status == RUNNING:
                pending = request.num_tokens - request.num_computed_tokens
                steps.append(_bad_allocation(request_id, pending + 1))
                if not config.semantics.cap_at_max_model_len:
                    steps.append(_bad_allocation(request_id, 1, lookahead=config.max_model_len + 1))
                steps.append(_common_prefix(request_id, len(running)))
            elif config.enable_caching:
                steps.append(_bad_allocation(request_id, 1, hits=(config.num_blocks,)))
            if tracked:
                steps.append(_impostor_free(request_id))
        return steps


def _la(lookahead: int) -> str:
    return f", la={lookahead}" if lookahead else ""


def _drafts(drafts: int, accepted: int) -> str:
    return f", d={drafts}, a={accepted}" if drafts else ""


def manager_key(state: ManagerSnapshot) -> Hashable:
    """Everything in a manager snapshot that can change what happens next."""
    return (
        pool_key(state.pool),
        frozenset(state.blocks.items()),
        frozenset(state.hashes.items()),
        frozenset(state.num_cached.items()),
        state.stats,
    )


def initial_manager_world(factory: ManagerFactory, config: ManagerSearchConfig) -> ManagerWorld:
    """A fresh spec manager and a fresh `factory` manager, every request slot absent."""
    manager_config = config.manager_config()
    pair = LockstepPair(
        spec_manager(manager_config),
        factory(manager_config),
        same_messages=factory is pagedkv_manager,
    )
    slots = {f"r{number}": _Slot(ABSENT) for number in range(len(config.prompts))}
    return ManagerWorld(pair, config, slots)


# -- the scheduler's moves -------------------------------------------------------------------

_STRANGER = Request("never-seen", [0])


def _transition(label: str, move: Callable[..., None], *args: object) -> Transition:
    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        move(world, *args)

    return Transition(label, run)


def _simple_call(label: str, call: Callable[[ManagerUnderTest], object]) -> Transition:
    """A transition that is one manager call, whatever its outcome (compared on both sides)."""

    def run(world: World) -> None:
        _both(world, label, call)

    return Transition(label, run)


def _both(world: World, name: str, call: Callable[[ManagerUnderTest], object]) -> object:
    """The call on both managers; its result if it succeeded, else None (errors must match)."""
    return world.pair.both(name, lambda manager, _: call(manager)).result


def _admit(
    world: ManagerWorld, request_id: str, token: int | None, chunked: bool, lookahead: int
) -> None:
    config = world.config
    slot = world.slots[request_id]
    if slot.request is None:
        number = int(request_id[1:])
        keys = config.keys[number] if number < len(config.keys) else None
        slot.request = (keys or RequestKeys()).request(request_id, config.prompts[number])
        slot.status = WAITING
    request = slot.request
    lookup = world.pair.both(
        f"get_computed_blocks({request_id})", lambda m, _: m.get_computed_blocks(request)
    )
    assert lookup.ok and lookup.result is not None, "a lookup of a fresh request cannot fail"
    hits, num_hit_tokens = lookup.result
    remaining = request.num_tokens - num_hit_tokens
    chunk = 1 if chunked else remaining
    room = -(-config.max_model_len // config.block_size) * config.block_size
    lookahead = min(lookahead, room - num_hit_tokens - chunk)
    allocated = world.pair.both(
        f"allocate_slots({request_id}, {chunk}, {hits}{_la(lookahead)})",
        lambda m, _: m.allocate_slots(request, chunk, hits, lookahead),
    )
    assert allocated.ok, f"admission of {request_id} raised {allocated.error!r}"
    if allocated.result is None:
        return  # does not fit: it stays waiting, with its hashes stored
    slot.status = RUNNING
    request.num_computed_tokens = num_hit_tokens + chunk
    _maybe_sample(world, request_id, token)


def _step(
    world: ManagerWorld, request_id: str, token: int, drafts: int, accepted: int, lookahead: int
) -> None:
    request = world.slots[request_id].request
    assert request is not None
    pending = request.num_tokens - request.num_computed_tokens
    request.spec_token_ids = [token] * drafts
    try:
        allocated = world.pair.both(
            f"allocate_slots({request_id}, {pending + drafts}{_la(lookahead)})"
            + (f" with {drafts} drafts" if drafts else ""),
            lambda m, _: m.allocate_slots(request, pending + drafts, None, lookahead),
        )
    finally:
        request.spec_token_ids = []
    assert allocated.ok, f"a step of {request_id} raised {allocated.error!r}"
    if allocated.result is None:
        _preempt(world, request_id)
        return
    request.num_computed_tokens += pending + accepted
    if accepted:
        request.append_output_token_ids([token] * accepted)
    _maybe_sample(world, request_id, token)


def _maybe_sample(world: ManagerWorld, request_id: str, token: int | None) -> None:
    """Once every token is computed, the step yields `token`; at max_model_len it finishes."""
    request = world.slots[request_id].request
    assert request is not None
    if token is None or request.num_computed_tokens < request.num_tokens:
        return  # a prefill chunk: nothing sampled yet
    request.append_output_token_ids(token)
    if request.num_tokens >= world.config.max_model_len:
        _finish(world, request_id)


def _preempt(world: ManagerWorld, request_id: str) -> None:
    slot = world.slots[request_id]
    request = slot.request
    assert request is not None
    _both(world, f"free({request_id})", lambda m: m.free(request))
    request.num_computed_tokens = 0
    slot.status = WAITING


def _finish(world: ManagerWorld, request_id: str) -> None:
    slot = world.slots[request_id]
    request = slot.request
    assert request is not None
    _both(world, f"free({request_id})", lambda m: m.free(request))
    _both(world, f"free_block_hashes({request_id})", lambda m: m.free_block_hashes(request))
    slot.status, slot.request = ABSENT, None


# -- misuse ----------------------------------------------------------------------------------


def _bad_allocation(
    request_id: str, num_tokens: int, *, hits: tuple[int, ...] = (), lookahead: int = 0
) -> Transition:
    label = f"allocate_slots({request_id}, {num_tokens}, {list(hits)}, lookahead={lookahead})"

    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        request = world.slots[request_id].request
        assert request is not None
        outcome = world.pair.both(
            label, lambda m, _: m.allocate_slots(request, num_tokens, hits or None, lookahead)
        )
        assert not outcome.ok, f"{label} is invalid but succeeded"

    return Transition(label, run)


def _impostor_free(request_id: str) -> Transition:
    label = f"free(impostor of {request_id})"

    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        request = world.slots[request_id].request
        assert request is not None
        impostor = copy.copy(request)  # same id, same tokens, another object
        outcome = world.pair.both(label, lambda m, _: m.free(impostor))
        assert not outcome.ok, f"{label} succeeded"

    return Transition(label, run)


def _common_prefix(request_id: str, num_running: int) -> Transition:
    label = f"get_num_common_prefix_blocks({request_id}, {num_running})"

    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        request = world.slots[request_id].request
        assert request is not None
        _both(world, label, lambda m: m.get_num_common_prefix_blocks(request, num_running))

    return Transition(label, run)
