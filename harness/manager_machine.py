"""The request-level differential state machine: spec manager vs a manager under test.

The machine plays a scheduler over a handful of requests with prompts from a 2-3 token alphabet
(so shared prefixes and full hits are common), optional LoRA ids, multimodal ranges, cache salts
and prompt logprobs: it admits waiting requests (prefix lookup, then allocate_slots with the hits,
whole or chunked prefill), runs decode steps with speculative tokens and lookahead slots, preempts
(free, computed tokens back to 0), finishes (free + free_block_hashes), resets the prefix cache,
and makes invalid calls. After every step both managers must be in the same observable state and
pass their invariant checks. For pagedkv's own manager the state includes the token-level
prefix-cache stats and, in most examples, the KV cache events not yet taken; a rule takes them
from both and replays them into a consumer that must hold the index (`check_consumer`).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from pagedkv.block_counts import cdiv
from pagedkv.harness.adapters import SpecManagerAdapter, pagedkv_manager, spec_manager
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.hostile_calls import MANAGER_HOSTILE_CALLS, ManagerScene
from pagedkv.harness.lockstep import CampaignStats, LockstepMachine
from pagedkv.harness.pool_machine import check_consumer
from pagedkv.harness.protocol import EmitsKVEvents, ManagerConfig, ManagerFactory, ManagerUnderTest
from pagedkv.harness.requests import requests
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, Semantics


@dataclass
class _Live:
    """A request the simulated scheduler knows: waiting (not holding blocks) or running."""

    request: Request
    running: bool = False


class ManagerMachine(LockstepMachine):
    """Spec manager vs `factory`'s manager. Subclass via `make_manager_machine`."""

    factory: ClassVar[ManagerFactory] = staticmethod(pagedkv_manager)
    semantics: ClassVar[Semantics] = PAGEDKV
    sliding_window: ClassVar[bool] = False
    domain: ClassVar[Domain] = FULL_DOMAIN
    kv_events: ClassVar[bool] = True  # the factory's managers can emit KV cache events
    token_stats: ClassVar[bool] = True  # ... and count prefix-cache stats in tokens

    def __init__(self) -> None:
        super().__init__()
        self.spec: ManagerUnderTest
        self.impl: ManagerUnderTest
        self.live: dict[str, _Live] = {}
        self.prompts: list[tuple[int, ...]] = []
        self.num_arrived = 0
        self.consumer: Counter[int] = Counter()  # a replay of every event batch taken so far

    # -- set-up -------------------------------------------------------------------------------

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
    ) -> None:
        kv_cache_spec: KVCacheSpec
        if self.semantics == VLLM_0_8_5:
            # vLLM 0.8.5 fails an assert (it chains a hash through the null block) when the
            # window skips the parent of the next block to cache: a window at most a block
            # wide, or accepted draft tokens reaching past it. Real windows are far wider than
            # a block plus a few drafts (up to 2 here); pagedkv chains through the stored hash.
            window = max(window, block_size + 3)
        window = max(window, self.domain.min_window)
        if self.sliding_window and not self.domain.eagle_with_sliding_window:
            use_eagle = False
        if self.sliding_window:
            kv_cache_spec = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype="float16",
                sliding_window=window,
            )
        else:
            kv_cache_spec = FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16"
            )
        config = ManagerConfig(
            uniform_kv_cache_config(kv_cache_spec, num_blocks),
            max_model_len,
            enable_caching,
            hash_algo,
            use_eagle,
            log_stats,
            self.semantics,
            enable_kv_cache_events=kv_events and self.kv_events,
        )
        self.config = config
        self.block_size = block_size
        self.max_blocks = cdiv(max_model_len, block_size)
        self.alphabet = alphabet
        self.spec = spec_manager(config)
        self.impl = type(self).factory(config)
        self.stats.examples += 1

    def state_key(self) -> int:
        return hash((self.config.kv_cache_config.num_blocks, self.block_size, self.sliding_window))

    # -- the scheduler's calls ----------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 4)
    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        """A new request joins the waiting queue."""
        self.num_arrived += 1
        request_id = f"req-{self.num_arrived}"
        longest = max(1, min(self.config.max_model_len, 4 * self.block_size + 1))
        request = data.draw(
            requests(
                request_id,
                alphabet=self.alphabet,
                max_tokens=longest,
                min_tokens=1,
                extra_keys=data.draw(st.booleans(), label="extra keys"),
                salts=self.semantics != VLLM_0_8_5,  # vLLM 0.8.5 has no cache salt
                block_size=self.block_size,
            ),
            label="request",
        )
        request = self.domain.admit(request)
        shares_a_prefix = data.draw(st.booleans(), label="shares a prefix")
        if self.prompts and shares_a_prefix:
            # Most traffic shares system prompts: start with blocks of an earlier prompt.
            earlier = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            num_shared = min(
                len(earlier),
                self.block_size * data.draw(st.integers(1, 4), label="shared blocks")
                + data.draw(st.sampled_from((0, 0, 1)), label="and tokens"),
            )
            tokens = [*earlier[:num_shared], *request.prompt_token_ids][:longest]
            request = Request(
                request_id,
                tokens,
                lora_id=request.lora_id if data.draw(st.booleans(), label="lora") else None,
                cache_salt=data.draw(st.sampled_from((None, "tenant-1")), label="salt")
                if self.semantics != VLLM_0_8_5
                else None,
            )
        request.prompt_logprobs = data.draw(st.sampled_from((False,) * 9 + (True,)), label="lp")
        self.prompts.append(request.prompt_token_ids)
        self.live[request_id] = _Live(request)

    @precondition(lambda self: any(not live.running for live in self.live.values()))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Look a waiting request up, then reserve slots for its prefill (all or a chunk)."""
        live = self.pick(data, running=False)
        request = live.request
        lookup = self.both(
            f"get_computed_blocks({request!r})",
            lambda manager, _: manager.get_computed_blocks(request),
        )
        if not lookup.ok or lookup.result is None:
            return
        hits, num_hit_tokens = lookup.result
        remaining = request.num_tokens - num_hit_tokens
        chunk = data.draw(st.sampled_from((remaining, remaining, 1 + remaining // 2)), label="n")
        lookahead = self.fitting_lookahead(data, num_hit_tokens + chunk)
        if lookahead is None:
            self.finish_request(request)  # the prompt alone exceeds max_model_len
            return
        outcome = self.both(
            f"allocate_slots({request!r}, {chunk}, {hits}, {lookahead})",
            lambda manager, _: manager.allocate_slots(request, chunk, hits, lookahead),
        )
        if outcome.ok and outcome.result is not None:
            live.running = True
            request.num_computed_tokens = num_hit_tokens + chunk
            self.maybe_sample(live, accepted=[])

    @precondition(lambda self: any(live.running for live in self.live.values()))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One more prefill chunk, or a decode step with speculative tokens; preempt on None."""
        live = self.pick(data, running=True)
        request = live.request
        pending = request.num_tokens - request.num_computed_tokens
        drafts: list[int] = []
        if pending > 1:
            chunk = data.draw(st.integers(1, pending), label="chunk")
        else:
            chunk = 1
            drafts = data.draw(
                st.lists(st.integers(0, self.alphabet - 1), max_size=2), label="drafts"
            )
        lookahead = self.fitting_lookahead(data, request.num_computed_tokens + chunk + len(drafts))
        if lookahead is None:
            self.finish_request(request)  # reached max_model_len
            return
        request.spec_token_ids = drafts
        num_tokens = chunk + len(drafts)
        outcome = self.both(
            f"allocate_slots({request!r}, {num_tokens}, None, {lookahead}) "
            f"with spec_token_ids={drafts}",
            lambda manager, _: manager.allocate_slots(request, num_tokens, None, lookahead),
        )
        request.spec_token_ids = []
        if not outcome.ok:
            return
        if outcome.result is None:
            self.preempt_request(live)
            return
        accepted = drafts[: data.draw(st.integers(0, len(drafts)), label="accepted")]
        request.num_computed_tokens += chunk + len(accepted)
        self.maybe_sample(live, accepted)

    @precondition(lambda self: any(live.running for live in self.live.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.preempt_request(self.pick(data, running=True))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        live = data.draw(st.sampled_from(list(self.live.values())), label="request")
        self.finish_request(live.request)

    @rule(data=st.data())
    def housekeeping(self, data: st.DataObject) -> None:
        """What a scheduler asks between steps: stats, the common prefix, a prefix-cache reset."""
        # A reset empties the prefix cache whenever no request holds blocks: keep it rare.
        call = data.draw(
            st.sampled_from(("stats",) * 5 + ("common prefix",) * 4 + ("reset",)), label="call"
        )
        running = [live.request for live in self.live.values() if live.running]
        if call == "reset":
            self.both("reset_prefix_cache()", lambda manager, _: manager.reset_prefix_cache())
        elif call == "common prefix" and running:
            request = data.draw(st.sampled_from(running), label="request")
            self.both(
                f"get_num_common_prefix_blocks({request!r}, {len(running)})",
                lambda manager, _: manager.get_num_common_prefix_blocks(request, len(running)),
            )
        else:
            self.both(
                "make_prefix_cache_stats()",
                lambda manager, _: _compared_stats(manager.make_prefix_cache_stats(), self),
            )

    @precondition(lambda self: self.config.enable_kv_cache_events)
    @rule()
    def take_events(self) -> None:
        """The scheduler drains both event queues (equal batches) and publishes them."""
        outcome = self.both(
            "take_events()", lambda manager, _: cast(EmitsKVEvents, manager).take_events()
        )
        if outcome.ok and outcome.result is not None:
            check_consumer(self.consumer, outcome.result, self.spec.snapshot().pool.index)

    # -- invalid calls ------------------------------------------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def hostile_call(self, data: st.DataObject) -> None:
        """A call a careless or malicious caller might make: typed error, nothing changed."""
        if not self.misuse:
            return
        live = data.draw(st.sampled_from(list(self.live.values())), label="request")
        request = live.request
        kind = data.draw(
            st.sampled_from(
                (
                    "bad counts",
                    "more tokens than the request has",
                    "past max_model_len",
                    "impostor",
                    "foreign hits",
                    "computed outside slots",
                    "more drafts than scheduled",
                    "hashes dropped while running",
                    "unknown request",
                    *MANAGER_HOSTILE_CALLS,  # wrong types, NaN, mutations, identity changes
                )
            ),
            label="kind",
        )
        if kind in MANAGER_HOSTILE_CALLS:
            shown, hostile = MANAGER_HOSTILE_CALLS[kind](data, ManagerScene(request))
            self.both(shown, hostile)
            return
        if kind == "bad counts":
            num_tokens, lookahead = data.draw(
                st.sampled_from(((0, 0), (-1, 0), (1, -1))), label="counts"
            )
            self.both(
                f"allocate_slots({request!r}, {num_tokens}, None, {lookahead})",
                lambda manager, _: manager.allocate_slots(request, num_tokens, None, lookahead),
            )
        elif kind == "more tokens than the request has":
            extra = request.num_tokens - request.num_computed_tokens + 1
            self.both(
                f"allocate_slots({request!r}, {extra})",
                lambda manager, _: manager.allocate_slots(request, extra),
            )
        elif kind == "past max_model_len":
            lookahead = self.config.max_model_len + 1
            self.both(
                f"allocate_slots({request!r}, 1, None, {lookahead})",
                lambda manager, _: manager.allocate_slots(request, 1, None, lookahead),
            )
        elif kind == "impostor" and self.spec_tracks(request):
            impostor = copy.copy(request)  # same id, same tokens, another object
            call = data.draw(st.sampled_from(("lookup", "allocate", "free")), label="call")
            self.both(f"{call}(impostor of {request!r})", _impostor_call(impostor, call))
        elif kind == "foreign hits":
            hits = data.draw(
                st.lists(
                    st.integers(-1, self.config.kv_cache_config.num_blocks), min_size=1, max_size=3
                ),
                label="hits",
            )
            self.both(
                f"allocate_slots({request!r}, 1, {hits})",
                lambda manager, _: manager.allocate_slots(request, 1, hits),
            )
        elif kind == "computed outside slots":
            saved = request.num_computed_tokens
            request.num_computed_tokens = data.draw(
                st.sampled_from((-1, saved + 4 * self.block_size + 1)), label="computed"
            )
            try:
                self.both(
                    f"allocate_slots({request!r}, 1)",
                    lambda manager, _: manager.allocate_slots(request, 1),
                )
            finally:
                request.num_computed_tokens = saved
        elif kind == "more drafts than scheduled":
            request.spec_token_ids = [0, 0]
            try:
                self.both(
                    f"allocate_slots({request!r}, 1) with 2 drafts",
                    lambda manager, _: manager.allocate_slots(request, 1),
                )
            finally:
                request.spec_token_ids = []
        elif kind == "hashes dropped while running":
            self.both(
                f"free_block_hashes({request!r})",
                lambda manager, _: manager.free_block_hashes(request),
            )
        elif kind == "unknown request":
            stranger = Request("never-seen", [0])
            self.both("free(never-seen)", lambda manager, _: manager.free(stranger))

    # -- helpers ------------------------------------------------------------------------------

    def spec_tracks(self, request: Request) -> bool:
        """Whether the spec manager ties this request's id to its object (blocks or hashes)."""
        assert isinstance(self.spec, SpecManagerAdapter)
        return request.request_id in self.spec.manager.requests

    def pick(self, data: st.DataObject, *, running: bool) -> _Live:
        candidates = [live for live in self.live.values() if live.running == running]
        return data.draw(st.sampled_from(candidates), label="request")

    def fitting_lookahead(self, data: st.DataObject, tokens_after: int) -> int | None:
        """Lookahead slots (0-2, only with eagle) that keep the request within max_model_len."""
        if cdiv(tokens_after, self.block_size) > self.max_blocks:
            return None
        lookahead = data.draw(st.integers(0, 2), label="lookahead") if self.config.use_eagle else 0
        while lookahead and cdiv(tokens_after + lookahead, self.block_size) > self.max_blocks:
            lookahead -= 1
        return lookahead

    def maybe_sample(self, live: _Live, accepted: list[int]) -> None:
        """Once every token is computed, the step yields the accepted drafts and one new token."""
        request = live.request
        if request.num_computed_tokens < request.num_tokens:
            return  # a prefill chunk: nothing sampled yet
        request.append_output_token_ids([*accepted, len(accepted) % self.alphabet])
        if request.num_tokens >= self.config.max_model_len:
            self.finish_request(request)  # length limit: the request stops

    def preempt_request(self, live: _Live) -> None:
        request = live.request
        if self.outcome_ok(f"free({request!r})", lambda manager, _: manager.free(request)):
            request.num_computed_tokens = 0
            live.running = False

    def finish_request(self, request: Request) -> None:
        self.both(f"free({request!r})", lambda manager, _: manager.free(request))
        self.both(
            f"free_block_hashes({request!r})",
            lambda manager, _: manager.free_block_hashes(request),
        )
        self.live.pop(request.request_id, None)


def _compared_stats(
    stats: PrefixCacheStats | None, machine: ManagerMachine
) -> PrefixCacheStats | tuple[bool, int, int, int] | None:
    """The stats as compared: whole for a manager that counts tokens, else the block counts."""
    if stats is None or machine.token_stats or not hasattr(stats, "queries"):
        return stats  # `not hasattr`: a value the adapter does not expose (vLLM 0.33's stats)
    return (stats.reset, stats.requests, stats.queries, stats.hits)


def _impostor_call(impostor: Request, call: str) -> Callable[[ManagerUnderTest, str], object]:
    def run(manager: ManagerUnderTest, _: str) -> object:
        if call == "lookup":
            return manager.get_computed_blocks(impostor)
        if call == "allocate":
            return manager.allocate_slots(impostor, 1)
        manager.free(impostor)
        return None

    return run


def make_manager_machine(
    factory: ManagerFactory,
    *,
    sliding_window: bool,
    semantics: Semantics = PAGEDKV,
    misuse: bool = True,
    stats: CampaignStats | None = None,
    domain: Domain = FULL_DOMAIN,
    kv_events: bool | None = None,
) -> type[ManagerMachine]:
    """A `ManagerMachine` subclass checking `factory`'s managers for one attention type, on
    `domain`.

    pagedkv's own manager must also word every refusal exactly as the spec does, and count
    prefix-cache stats in tokens; other managers are held to the error class and the block
    counts. `kv_events` (default: only for pagedkv's own manager) says the factory's managers
    take `enable_kv_cache_events` and emit events to compare.
    """
    own = factory is pagedkv_manager
    return type(
        "SlidingWindowManagerMachine" if sliding_window else "FullAttentionManagerMachine",
        (ManagerMachine,),
        {
            "factory": staticmethod(factory),
            "semantics": semantics,
            "sliding_window": sliding_window,
            "misuse": misuse,
            "domain": domain,
            "same_messages": own,
            "kv_events": own if kv_events is None else kv_events,
            "token_stats": own,
            "stats": stats if stats is not None else CampaignStats(),
        },
    )
