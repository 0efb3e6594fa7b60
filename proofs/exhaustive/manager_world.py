"""The request-level manager as a finite world: the simulated client over a few fixed prompts.

Each request slot `r0, r1, ...` has a fixed prompt and extra keys, and is absent, waiting or
running. Every transition is a short list of the client's own operations
(`pagedkv.harness.client.manager_ops`), executed by the one client (`ManagerClient`) on a pair
in full mode, exactly as the swarm and the hypothesis machines execute theirs:

- `admit(r, t)`: `Arrive` under the slot's name if it is absent, then `Admit` (lookup, then
  `allocate_slots` for the rest of the prompt with the hits; with `lookaheads`, each lookahead
  count: `admit(r, t, la=l)`); when every token is computed, token `t` is sampled.
- `admit_chunk(r)` (with `chunked_prefill`): the same, scheduling one token only.
- `step(r, t)`: `Step` of a running request (the rest of its prompt, or the last sampled token;
  None preempts it); with `drafts`, a decode step also schedules d draft tokens, none or all
  accepted (`step(r, t, d=d, a=a)`); with `lookaheads`, each lookahead count.
- `preempt(r)`, `finish(r)`, `reset_prefix_cache()`, `common_prefix(r)`.
- misuse (with `misuse`): the client's hostile calls with the arguments that make zero tokens,
  more tokens than the request has, a lookahead past max_model_len, a hit outside the pool, an
  impostor `Request` freeing a tracked id, and freeing an unknown request; each must fail (or
  change nothing) identically on both sides.

A request whose length reaches `max_model_len` after sampling finishes, so token lists and hence
the state space stay finite.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.client.manager import Live, ManagerClient
from pagedkv.harness.client.manager_ops import (
    Admit,
    Arrive,
    CommonPrefix,
    Finish,
    Hostile,
    ManagerOp,
    Preempt,
    Reset,
    Step,
)
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.protocol import (
    ManagerConfig,
    ManagerFactory,
    ManagerSnapshot,
)
from pagedkv.harness.swarm.runs import attention_spec, chunked_spec, hybrid_kv_cache_config
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.kv_cache_interface import uniform_kv_cache_config
from pagedkv.vocab.semantics import Semantics
from proofs.exhaustive.fingerprint import fingerprint
from proofs.exhaustive.pool_world import pool_key
from proofs.exhaustive.search import Frozen, Transition, World, freeze, thaw


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
        more_groups: KV cache groups after the first (a hybrid manager): ("full", 0),
            ("window", W) or ("chunk", C) each.
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
    semantics: Semantics = PAGEDKV_SEMANTICS
    hash_algo: str = "sha256"
    drafts: tuple[int, ...] = (0,)
    lookaheads: tuple[int, ...] = (0,)
    keys: tuple[RequestKeys | None, ...] = ()
    more_groups: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        assert all(0 < len(p) <= self.max_model_len for p in self.prompts), "prompts must fit"

    @property
    def name(self) -> str:
        attention = "full" if self.sliding_window is None else f"window={self.sliding_window}"
        for kind, size in self.more_groups:
            attention += "+full" if kind == "full" else f"+{kind}={size}"
        flags = "".join(
            f" {flag}"
            for flag, on in (
                ("no-caching", not self.enable_caching),
                ("eagle", self.use_eagle),
                ("chunked", self.chunked_prefill),
                (f"drafts={list(self.drafts)}", self.drafts != (0,)),
                (f"lookaheads={list(self.lookaheads)}", self.lookaheads != (0,)),
                ("keys=" + "/".join(map(_show_keys, self.keys)), bool(self.keys)),
                (self.semantics.name, self.semantics != PAGEDKV_SEMANTICS),
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
        specs = [attention_spec(self.block_size, self.sliding_window)]
        for kind, size in self.more_groups:
            if kind == "chunk":
                specs.append(chunked_spec(self.block_size, size))
            else:
                specs.append(attention_spec(self.block_size, size if kind == "window" else None))
        kv_cache_config = (
            hybrid_kv_cache_config(specs, self.num_blocks)
            if self.more_groups
            else uniform_kv_cache_config(specs[0], self.num_blocks)
        )
        return ManagerConfig(
            kv_cache_config,
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


def _show_keys(keys: RequestKeys | None) -> str:
    if keys is None:
        return "-"
    parts = [f"lora{keys.lora_id}"] if keys.lora_id is not None else []
    parts += [f"mm{offset}+{length}:{content}" for offset, length, content in keys.mm]
    parts += ["salt"] if keys.cache_salt is not None else []
    return ",".join(parts) or "-"


class ManagerWorld:
    """A state of the manager search: the client, its pair, and the slots' prompts."""

    def __init__(self, client: ManagerClient, config: ManagerSearchConfig) -> None:
        self.client = client
        self.config = config

    @property
    def pair(self) -> ComparedPair[Any]:
        return self.client.pair

    def dump(self) -> Frozen:
        return freeze(self.client)

    def load(self, frozen: Frozen, state: ManagerSnapshot) -> ManagerWorld:
        client: ManagerClient = thaw(frozen)
        client.pair.state = state
        return ManagerWorld(client, self.config)

    def key(self) -> Hashable:
        requests = tuple(
            sorted(
                (
                    live.record.request_id,
                    live.running,
                    tuple(live.record.tokens),
                    live.record.num_computed_tokens,
                )
                for live in self.client.live
            )
        )
        pool = self.client.spec.pool
        readable = [  # blocks a later read may reach: held, or cached for a hit
            block_id
            for block_id in range(1, pool.num_gpu_blocks)
            if pool.ref_cnt[block_id] or pool.block_hash[block_id] is not None
        ]
        return (
            manager_key(self.client.pair.state),
            requests,
            fingerprint(self.client.pair.impl),
            self.client.spec.truth.canonical(readable),
        )

    # -- transitions -------------------------------------------------------------------------

    def transitions(self) -> Sequence[Transition]:
        config = self.config
        live = {entry.record.request_id: entry for entry in self.client.live}
        steps: list[Transition] = []
        for number in range(len(config.prompts)):
            name = f"r{number}"
            entry = live.get(name)
            if entry is None or not entry.running:
                for token, lookahead in itertools.product(config.samples, config.lookaheads):
                    label = f"admit({name}, t={token}{_la(lookahead)})"
                    steps.append(_admit(label, number, 0, lookahead, token))
                if config.chunked_prefill:
                    steps.append(_admit(f"admit_chunk({name})", number, 1, 0, config.samples[0]))
            else:
                steps += self._steps(
                    name, entry.record.num_tokens - entry.record.num_computed_tokens
                )
                steps.append(_on(f"preempt({name})", name, True, lambda which: [Preempt(which)]))
            if entry is not None:
                steps.append(_on(f"finish({name})", name, None, lambda which: [Finish(which)]))
        steps.append(Transition("reset_prefix_cache()", _run([Reset()])))
        if config.misuse:
            steps += self._misuse(live)
        return steps

    def _steps(self, name: str, pending: int) -> list[Transition]:
        """Every step of a running request: each sampled token, draft count (decode steps
        only), accepted drafts (none or all) and lookahead that keeps it within max_model_len."""
        config = self.config
        entry = next(e for e in self.client.live if e.record.request_id == name)
        room = -(-config.max_model_len // config.block_size) * config.block_size
        room -= entry.record.num_computed_tokens + pending
        steps = []
        for token, drafts, lookahead in itertools.product(
            config.samples, config.drafts, config.lookaheads
        ):
            if (drafts and pending != 1) or drafts + lookahead > room:
                continue
            for accepted in sorted({0, drafts}):
                label = f"step({name}, t={token}{_drafts(drafts, accepted)}{_la(lookahead)})"
                op_drafts = (token,) * drafts

                def make(
                    which: int,
                    d: tuple[int, ...] = op_drafts,
                    a: int = accepted,
                    la: int = lookahead,
                    t: int = token,
                ) -> list[ManagerOp]:
                    return [Step(which, 0, d, a, la, t)]

                steps.append(_on(label, name, True, make))
        return steps

    def _misuse(self, live: dict[str, Live]) -> list[Transition]:
        config = self.config
        steps = [Transition("free(never-seen)", _run([Hostile("unknown request", 0, 0)]))]
        for name, entry in live.items():
            running = entry.running
            steps.append(_hostile(f"allocate_slots({name}, 0)", name, "bad counts", 0))
            if running:
                steps.append(
                    _hostile(
                        f"allocate_slots({name}, pending + 1)",
                        name,
                        "more tokens than the request has",
                        0,
                    )
                )
                if not config.semantics.cap_at_max_model_len:
                    steps.append(
                        _hostile(
                            f"allocate_slots({name}, 1, la=max_model_len + 1)",
                            name,
                            "past max_model_len",
                            0,
                        )
                    )
                steps.append(
                    _on(f"common_prefix({name})", name, True, lambda which: [CommonPrefix(which)])
                )
            elif config.enable_caching:
                steps.append(_hostile(f"allocate_slots({name}, 1, [N])", name, "foreign hits", 1))
            steps.append(_hostile(f"free(impostor of {name})", name, "impostor", 2))
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
    client = ManagerClient.build(config.manager_config(), factory, Coverage(), check_every=1)
    client.pair.full_check("the initial state")
    return ManagerWorld(client, config)


# -- transitions as the client's operations ----------------------------------------------------


def _run(ops: list[ManagerOp]) -> Callable[[World], None]:
    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        for op in ops:
            world.client.execute(op)

    return run


def _index(world: ManagerWorld, name: str, running: bool | None) -> int:
    """The index the client's `which` needs to name request `name` among its candidates."""
    candidates = [live for live in world.client.live if running is None or live.running == running]
    return next(i for i, live in enumerate(candidates) if live.record.request_id == name)


def _on(
    label: str,
    name: str,
    running: bool | None,
    make: Callable[[int], list[ManagerOp]],
) -> Transition:
    """A transition about request `name`: the operations `make` builds for its index."""

    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        for op in make(_index(world, name, running)):
            world.client.execute(op)

    return Transition(label, run)


def _admit(label: str, number: int, chunk: int, lookahead: int, token: int) -> Transition:
    """Arrive under the slot's name if absent, then admit it."""
    name = f"r{number}"

    def run(world: World) -> None:
        assert isinstance(world, ManagerWorld)
        client = world.client
        if all(live.record.request_id != name for live in client.live):
            config = world.config
            keys = config.keys[number] if number < len(config.keys) else None
            keys = keys or RequestKeys()
            client.execute(
                Arrive(
                    config.prompts[number],
                    -1,
                    0,
                    False,
                    keys.lora_id,
                    keys.mm,
                    keys.cache_salt,
                    False,
                    request_id=name,
                )
            )
        client.execute(Admit(_index(world, name, False), chunk, lookahead, token))

    return Transition(label, run)


def _hostile(label: str, name: str, kind: str, arg: int) -> Transition:
    return _on(label, name, None, lambda which: [Hostile(kind, which, arg)])
