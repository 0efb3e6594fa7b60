"""KVCacheManager benchmark: a serving trace replayed through a small scheduler, impl vs spec.

The trace (`serving_trace.py`) has many requests sharing a few long system prompts, multi-turn
follow-ups, and outputs of tens to hundreds of tokens. A vLLM-V1-like scheduler loop (running
requests first, then admissions with prefix lookups, chunked prefill under a token budget,
preemption of the newest request when allocate_slots returns None) replays it on the
implementation and on the spec manager. Both replays must take the same decisions; the report
gives allocate_slots calls per second (time inside the manager), the prefix-cache hit rate, how
often requests were preempted, and the impl/spec speed ratio, all from one run.

    ./dev bench manager                 # default trace
    ./dev bench manager --conversations 40 --json results/manager.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving_trace import Conversation, TraceConfig, make_trace

from pagedkv import KVCacheManager, PrefixCachingMetrics, Request
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, uniform_kv_cache_config


@dataclass
class Running:
    """A request of the trace while the scheduler holds it."""

    request: Request
    conversation: Conversation
    turn: int
    outputs_left: deque[int]


@dataclass
class Summary:
    """What a replay did; the impl and the spec must agree on all of it."""

    steps: int = 0
    allocate_calls: int = 0
    allocate_seconds: float = 0.0
    preemptions: int = 0
    finished: int = 0
    queries: int = 0
    hits: int = 0
    decisions: list[int] = field(default_factory=list)  # per step: tokens scheduled

    def same_decisions(self, other: Summary) -> bool:
        return (self.decisions, self.preemptions, self.queries, self.hits) == (
            other.decisions,
            other.preemptions,
            other.queries,
            other.hits,
        )


class TraceScheduler:
    """A vLLM-V1-like scheduler loop over one manager (a KVCacheManager or the spec manager)."""

    def __init__(self, manager: Any, *, max_running: int, token_budget: int) -> None:
        self.manager = manager
        self.max_running = max_running
        self.token_budget = token_budget
        self.summary = Summary()
        self.metrics = PrefixCachingMetrics(max_recent_requests=1 << 30)
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.allocate = _timed_allocate(manager, self.summary)

    def replay(self, conversations: list[Conversation]) -> Summary:
        """Run the trace to completion."""
        arrivals = deque(sorted(conversations, key=lambda c: c.arrival_step))
        summary = self.summary
        while arrivals or self.waiting or self.running:
            while arrivals and arrivals[0].arrival_step <= summary.steps:
                self.enqueue(arrivals.popleft(), 0)
            budget = self.token_budget
            budget = self.schedule_running(budget)
            budget = self.schedule_waiting(budget)
            stats = self.manager.make_prefix_cache_stats()
            if stats is not None:
                self.metrics.observe(stats)
            summary.decisions.append(self.token_budget - budget)
            summary.steps += 1
        summary.queries = self.metrics.aggregated_query_total
        summary.hits = self.metrics.aggregated_query_hit
        return summary

    def schedule_running(self, budget: int) -> int:
        """Running requests first: their next tokens; preempt the newest when nothing fits."""
        for item in list(self.running):
            if item not in self.running or budget == 0:
                continue
            request = item.request
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.allocate(request, num_tokens) is None:
                victim = self.running.pop()  # the newest request makes room
                self.manager.free(victim.request)
                victim.request.num_computed_tokens = 0
                self.waiting.appendleft(victim)
                self.summary.preemptions += 1
                if victim is item:
                    break
            else:
                budget -= num_tokens
                self.computed(item, num_tokens)
        return budget

    def schedule_waiting(self, budget: int) -> int:
        """Then admissions, first come first served, each with a prefix lookup."""
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            item = self.waiting[0]
            hits, num_hit_tokens = self.manager.get_computed_blocks(item.request)
            num_tokens = min(item.request.num_tokens - num_hit_tokens, budget)
            if self.allocate(item.request, num_tokens, hits) is None:
                break
            self.waiting.popleft()
            self.running.append(item)
            item.request.num_computed_tokens = num_hit_tokens
            budget -= num_tokens
            self.computed(item, num_tokens)
        return budget

    def enqueue(self, conversation: Conversation, turn: int) -> None:
        if turn == 0:
            conversation.history = list(conversation.system_prompt)
        conversation.history += conversation.turns[turn].user_tokens
        request = Request(f"c{conversation.conversation_id}-t{turn}", conversation.history)
        outputs = deque(conversation.turns[turn].output_tokens)
        self.waiting.append(Running(request, conversation, turn, outputs))

    def computed(self, item: Running, num_tokens: int) -> None:
        """Record progress; once every token is computed, sample one or finish."""
        request = item.request
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens < request.num_tokens:
            return  # a prefill chunk
        if item.outputs_left:
            request.append_output_token_ids(item.outputs_left.popleft())
            return
        self.manager.free(request)
        self.manager.free_block_hashes(request)
        self.running.remove(item)
        self.summary.finished += 1
        item.conversation.history = list(request.all_token_ids)
        if item.turn + 1 < len(item.conversation.turns):
            self.enqueue(item.conversation, item.turn + 1)


def _timed_allocate(manager: Any, summary: Summary) -> Callable[..., Any]:
    allocate = manager.allocate_slots
    clock = time.perf_counter

    def timed(request: Request, num_tokens: int, hits: Any = None) -> Any:
        start = clock()
        result = allocate(request, num_tokens, hits)
        summary.allocate_seconds += clock() - start
        summary.allocate_calls += 1
        return result

    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=TraceConfig.num_conversations)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1_200, help="KV pool size")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=2_048, help="tokens per step")
    parser.add_argument("--skip-spec", action="store_true", help="impl only (no ratio)")
    parser.add_argument(
        "--check-every",
        type=int,
        default=0,
        metavar="N",
        help="also replay with debug_invariants=N (check after every N-th call), report the cost",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)

    config = TraceConfig(seed=args.seed, num_conversations=args.conversations)
    kv_cache_config = uniform_kv_cache_config(
        FullAttentionSpec(block_size=args.block_size, num_kv_heads=8, head_size=128, dtype="bf16"),
        args.num_blocks,
    )
    max_model_len = 16_384
    loop = {"max_running": args.max_running, "token_budget": args.token_budget}

    start = time.perf_counter()
    impl = TraceScheduler(
        KVCacheManager(kv_cache_config, max_model_len, log_stats=True), **loop
    ).replay(make_trace(config))
    impl_seconds = time.perf_counter() - start
    results: dict[str, float | int] = {
        "conversations": args.conversations,
        "requests": impl.finished,
        "steps": impl.steps,
        "allocate_slots_calls": impl.allocate_calls,
        "allocate_slots_calls_per_s": impl.allocate_calls / impl.allocate_seconds,
        "prefix_cache_hit_rate": impl.hits / impl.queries if impl.queries else 0.0,
        "preemptions": impl.preemptions,
        "impl_replay_s": impl_seconds,
    }
    if not args.skip_spec:
        start = time.perf_counter()
        spec = TraceScheduler(
            SpecKVCacheManager(kv_cache_config, max_model_len, log_stats=True), **loop
        ).replay(make_trace(config))
        results["spec_replay_s"] = time.perf_counter() - start
        if not spec.same_decisions(impl):
            print("spec and impl took different decisions on the same trace", file=sys.stderr)
            return 1
        results["impl_over_spec_speed"] = results["spec_replay_s"] / impl_seconds

    if args.check_every > 0:
        start = time.perf_counter()
        checked = TraceScheduler(
            KVCacheManager(
                kv_cache_config, max_model_len, log_stats=True, debug_invariants=args.check_every
            ),
            **loop,
        ).replay(make_trace(config))
        results["checked_replay_s"] = time.perf_counter() - start
        if not checked.same_decisions(impl):
            print("invariant checking changed a decision", file=sys.stderr)
            return 1
        results["check_overhead"] = results["checked_replay_s"] / impl_seconds

    print(
        f"pagedkv manager benchmark: {args.conversations} conversations, {impl.finished:,} "
        f"requests, block size {args.block_size}, {args.num_blocks:,} blocks"
    )
    print(f"  scheduler steps            {impl.steps:>10,}")
    print(f"  allocate_slots calls       {impl.allocate_calls:>10,}")
    print(
        f"  allocate_slots calls/s     {results['allocate_slots_calls_per_s']:>10,.0f}"
        "  (time inside the manager)"
    )
    print(
        f"  prefix-cache hit rate      {results['prefix_cache_hit_rate']:>10.1%}"
        f"  ({impl.hits:,} of {impl.queries:,} blocks looked up)"
    )
    print(f"  preemptions                {impl.preemptions:>10,}")
    print(f"  impl replay                {impl_seconds:>10.2f} s")
    if "spec_replay_s" in results:
        print(f"  spec replay                {results['spec_replay_s']:>10.2f} s")
        print(
            f"  impl / spec speed          {results['impl_over_spec_speed']:>10.1f}x"
            "  (same decisions)"
        )
    if "check_overhead" in results:
        print(f"  impl, invariants checked   {results['checked_replay_s']:>10.2f} s")
        print(
            f"  checking overhead          {results['check_overhead']:>10.1f}x"
            f"  (debug_invariants={args.check_every})"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
