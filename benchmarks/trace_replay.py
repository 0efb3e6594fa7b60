"""The serving trace as a stream of manager calls: recorded once, replayed on any manager.

`record_calls` runs the trace through bench_manager's scheduler loop on a pagedkv manager and
records every manager call with the request state the scheduler had set before it (tokens
computed, tokens generated so far) and its result in block ids. `prepare_replay` turns the
recording into a run over fresh requests of one `Side`: before each call it brings the request to
the recorded state (an attribute store, and appending the tokens generated since its last call),
then makes the call. Only the replay is timed, so the ratio is the managers' and not the
scheduler's. `check_replay` replays once comparing every result with the recording: a manager
that decides differently anywhere fails the benchmark.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench_manager import TraceScheduler
from kv_sides import BLOCK_SIZE, Side
from serving_trace import TraceConfig, make_trace

from pagedkv import FullAttentionSpec, KVCacheManager, Request, uniform_kv_cache_config
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME

LOOKUP, ALLOCATE, ALLOCATE_HITS, FREE, FREE_HASHES = range(5)

ISSUE_TRACE = TraceConfig(num_system_prompts=6, num_conversations=160, output_tokens=(16, 160))
"""Issue 11's shape: ~400 requests over 6 shared system prompts (~35k allocate_slots calls)."""
NUM_BLOCKS = 2_000
MAX_RUNNING = 32
TOKEN_BUDGET = 2_048


@dataclass(frozen=True)
class Call:
    """One recorded manager call and the request state the scheduler had set before it."""

    kind: int
    request: int  # index into Recording.prompts
    num_tokens: int  # allocate_slots' num_tokens (0 otherwise)
    num_computed_tokens: int
    num_tokens_before: int  # len(all_token_ids) at the call
    result: Any  # block ids (or None) / (hit ids, hit tokens) / None


@dataclass(frozen=True)
class Recording:
    """The calls of one trace, the requests' prompts and every token they end with."""

    calls: tuple[Call, ...]
    prompts: tuple[tuple[int, ...], ...]
    all_tokens: tuple[tuple[int, ...], ...]
    request_ids: tuple[str, ...]
    num_blocks: int

    def kinds(self) -> Counter[str]:
        """How many calls of each kind; decode steps split by what they do to blocks."""
        counts: Counter[str] = Counter()
        names = ("lookup", "prefill chunk", "prefill after lookup", "free", "free_block_hashes")
        for call in self.calls:
            if call.kind == ALLOCATE and call.num_tokens == 1:
                if call.result:
                    counts["decode needs a new block"] += 1
                elif (call.num_computed_tokens + 1) % BLOCK_SIZE == 0:
                    counts["decode fills a block"] += 1
                else:
                    counts["decode inside a block"] += 1
            else:
                counts[names[call.kind]] += 1
        return counts


class _Recorder:
    """A pagedkv manager that logs the calls the scheduler makes (bench_manager.TraceScheduler)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.calls: list[Call] = []
        self.index: dict[int, int] = {}
        self.requests: list[Request] = []

    def _log(self, kind: int, request: Request, num_tokens: int, result: object) -> None:
        position = self.index.get(id(request))
        if position is None:
            position = self.index[id(request)] = len(self.requests)
            self.requests.append(request)
        self.calls.append(
            Call(
                kind,
                position,
                num_tokens,
                request.num_computed_tokens,
                request.num_tokens,
                result,
            )
        )

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        self._log(LOOKUP, request, 0, ([b.block_id for b in hits[0]], num_hit_tokens))
        return hits, num_hit_tokens

    def allocate_slots(self, request: Request, num_tokens: int, hits: Any = None) -> Any:
        blocks = self.manager.allocate_slots(request, num_tokens, hits)
        ids = None if blocks is None else [block.block_id for block in blocks[0]]
        self._log(ALLOCATE if hits is None else ALLOCATE_HITS, request, num_tokens, ids)
        return blocks

    def free(self, request: Request) -> None:
        self._log(FREE, request, 0, None)
        self.manager.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self._log(FREE_HASHES, request, 0, None)
        self.manager.free_block_hashes(request)

    def make_prefix_cache_stats(self) -> None:
        return None


def record_calls(
    config: TraceConfig = ISSUE_TRACE, num_blocks: int = NUM_BLOCKS, semantics: str = "pagedkv"
) -> Recording:
    """Run the trace through the scheduler loop on pagedkv, under `semantics` (a name of
    `SEMANTICS_BY_NAME`: "vllm-0.33" for a recording vLLM 0.33.0 replays alike), and record
    every manager call."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bf16")
    manager = KVCacheManager(
        uniform_kv_cache_config(spec, num_blocks),
        1 << 18,
        semantics=SEMANTICS_BY_NAME[semantics],
    )
    recorder = _Recorder(manager)
    scheduler = TraceScheduler(recorder, max_running=MAX_RUNNING, token_budget=TOKEN_BUDGET)
    scheduler.replay(make_trace(config))
    requests = recorder.requests
    return Recording(
        tuple(recorder.calls),
        tuple(request.prompt_token_ids for request in requests),
        tuple(tuple(request.all_token_ids) for request in requests),
        tuple(request.request_id for request in requests),
        num_blocks,
    )


Step = tuple[int, Any, int, int, Sequence[int] | None]


def _steps(recording: Recording, side: Side) -> list[Step]:
    """The calls over fresh requests of `side`, with the tokens to append before each."""
    requests = [
        side.make_request(request_id, prompt)
        for request_id, prompt in zip(recording.request_ids, recording.prompts, strict=True)
    ]
    num_tokens = [len(prompt) for prompt in recording.prompts]
    steps: list[Step] = []
    for call in recording.calls:
        index = call.request
        new_tokens = None
        if call.num_tokens_before > num_tokens[index]:
            new_tokens = recording.all_tokens[index][num_tokens[index] : call.num_tokens_before]
            num_tokens[index] = call.num_tokens_before
        steps.append(
            (call.kind, requests[index], call.num_tokens, call.num_computed_tokens, new_tokens)
        )
    return steps


def _run(manager: Any, steps: list[Step], results: list[Any] | None) -> None:
    lookup = manager.get_computed_blocks
    allocate = manager.allocate_slots
    free = manager.free
    free_hashes = manager.free_block_hashes
    hits: Any = None
    for kind, request, num_tokens, num_computed_tokens, new_tokens in steps:
        if new_tokens:
            request.append_output_token_ids(new_tokens)
        request.num_computed_tokens = num_computed_tokens
        if kind == ALLOCATE:
            result: object = allocate(request, num_tokens)
        elif kind == ALLOCATE_HITS:
            result = allocate(request, num_tokens, hits)
        elif kind == LOOKUP:
            result = hits = lookup(request)[0]
        elif kind == FREE:
            result = free(request)
        else:
            result = free_hashes(request)
        if results is not None:
            results.append(result)


def free_order(manager: Any) -> tuple[int, ...]:
    """The manager's free queue, head to tail, in block ids (vLLM's and pagedkv's alike)."""
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    return tuple(block.block_id for block in queue)


def check_replay(recording: Recording, side: Side, hash_algo: str) -> tuple[int, ...]:
    """Replay once comparing every result with the recording; the final free queue.

    Raises:
        AssertionError: the side answered a call differently from the recording.
    """
    manager = side.make_manager(recording.num_blocks, hash_algo)
    results: list[Any] = []
    _run(manager, _steps(recording, side), results)
    for position, (call, result) in enumerate(zip(recording.calls, results, strict=True)):
        if call.kind == LOOKUP:
            hit_ids = [block.block_id for block in side.blocks_of(result)]
            observed: object = (hit_ids, len(hit_ids) * BLOCK_SIZE)
            expected: object = tuple(call.result)
        elif call.kind in (ALLOCATE, ALLOCATE_HITS):
            observed = (
                None if result is None else [block.block_id for block in side.blocks_of(result)]
            )
            expected = call.result
        else:
            continue
        if observed != expected:
            raise AssertionError(
                f"{side.name} ({hash_algo}) decided differently at call {position} "
                f"({call}): {observed} instead of {expected}"
            )
    return free_order(manager)


class NullManager:
    """Answers every call at once: a replay on it costs the loop and the request updates only."""

    def get_computed_blocks(self, request: object) -> tuple[list[object], int]:
        return [], 0

    def allocate_slots(self, request: object, num_tokens: int, hits: object = None) -> list[object]:
        return []

    def free(self, request: object) -> None:
        return None

    def free_block_hashes(self, request: object) -> None:
        return None


def prepare_null_replay(
    recording: Recording, side: Side
) -> Callable[[], tuple[Callable[[], object], Callable[[object], None]]]:
    """A `paired_timing.Prepare` of the replay's own cost with `side`'s requests (no manager)."""

    def prepare() -> tuple[Callable[[], object], Callable[[object], None]]:
        steps = _steps(recording, side)
        return lambda: _run(NullManager(), steps, None), lambda _: None

    return prepare


def prepare_replay(
    recording: Recording, side: Side, hash_algo: str, final_free_order: tuple[int, ...]
) -> Callable[[], tuple[Callable[[], object], Callable[[object], None]]]:
    """A `paired_timing.Prepare`: a fresh manager and requests; the check is the final queue."""

    def prepare() -> tuple[Callable[[], object], Callable[[object], None]]:
        manager = side.make_manager(recording.num_blocks, hash_algo)
        steps = _steps(recording, side)

        def check(_: object) -> None:
            if free_order(manager) != final_free_order:
                raise AssertionError(f"a timed replay on {side.name} diverged from the recording")

        return lambda: _run(manager, steps, None), check

    return prepare
