"""A continuous-batching scheduler over `KVCacheManager` (one KV cache group or several), vLLM
V1's policy in small.

One step, under a token budget::

    1. running requests, oldest first: the rest of a prompt (a chunk if the budget is short)
       or one decode token; when `allocate_slots` says None, preempt the newest running
       request (recompute later) and retry, down to the request itself;
    2. only if nobody was preempted: admit waiting requests, first come first served
       (preempted ones at the head), each with a prefix-cache lookup, while the budget,
       `max_num_seqs` and the pool allow (by default only a request whose whole prompt will
       fit: vLLM 0.33's full-sequence gate, `EngineConfig.reserve_full_sequence`).

After the model ran, `update_from_output` advances `num_computed_tokens`, appends each sampled
token, and finishes requests (`free` then `free_block_hashes`). A request whose last scheduled
token is its last token samples; a prompt chunk that stops short does not.

Whatever the number of KV cache groups the decisions are the same: a lookup's hits (one list per
group) go back to `allocate_slots` whole, an allocation fits in every group or preempts, and a
request must fit in the pool on its own with all its groups' blocks together
(`pagedkv.engine.kv_layout.max_blocks_per_request`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine_request import EngineRequest, RequestStatus
from pagedkv.engine.evictions import EvictionCounter
from pagedkv.engine.kv_layout import max_blocks_per_request
from pagedkv.engine.metrics import SchedulerStats
from pagedkv.manager import KVCacheBlocks, KVCacheManager
from pagedkv.vocab.errors import InvalidArgumentError, InvariantViolation, RequestError


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[num_computed_tokens, num_computed_tokens + num_tokens)` of one request.

    Attributes:
        item: the request.
        num_computed_tokens: its tokens in the cache before the step.
        num_tokens: tokens computed this step.
        samples: the chunk reaches the request's last token, so the model samples the next.
        is_decode: the one token sampled last step (or a recompute's last token, the same).
    """

    item: EngineRequest
    num_computed_tokens: int
    num_tokens: int
    samples: bool
    is_decode: bool

    @classmethod
    def of(cls, item: EngineRequest, num_tokens: int) -> ScheduledChunk:
        """The chunk of `num_tokens` tokens after the request's computed ones."""
        request = item.request
        computed = request.num_computed_tokens
        samples = computed + num_tokens == request.num_tokens
        past_prompt = request.num_tokens > request.num_prompt_tokens
        return cls(item, computed, num_tokens, samples, samples and num_tokens == 1 and past_prompt)


@dataclass
class SchedulerOutput:
    """One step's decisions, in batch order (running requests first, then admissions)."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    num_admitted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.scheduled)


class Scheduler:
    """Owns the waiting queue and the running list; drives one `KVCacheManager`.

    Args:
        config: the limits.
        manager: the KV cache manager (its block size and pool must be the config's).
        stats: where to count (e.g. a `RunSummary`); None: a new `SchedulerStats`.

    Invariants: `check_invariants()`.
    """

    def __init__(
        self,
        config: EngineConfig,
        manager: KVCacheManager,
        stats: SchedulerStats | None = None,
    ) -> None:
        if manager.block_size != config.block_size or manager.num_gpu_blocks != config.num_blocks:
            raise InvalidArgumentError(
                f"the manager has {manager.num_gpu_blocks} blocks of {manager.block_size} tokens, "
                f"the config {config.num_blocks} of {config.block_size}"
            )
        self.config = config
        self.manager = manager
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.live_request_ids: set[str] = set()
        self.stats = SchedulerStats() if stats is None else stats
        self.evictions = EvictionCounter()

    def check_request(self, item: EngineRequest) -> None:
        """Whether `item` may be added: new, and able to finish in this pool and length.

        Raises:
            RequestError: it is not new (tokens generated or computed, or not WAITING), it can
                outgrow `max_model_len`, or it could not fit in the whole pool alone (it would
                wait forever).
        """
        rid = item.request_id
        if (
            item.status is not RequestStatus.WAITING
            or item.request.num_computed_tokens
            or item.output_token_ids
        ):
            raise RequestError(
                rid,
                "only new requests can be added",
                f"status {item.status.value}, {item.request.num_computed_tokens} computed, "
                f"{len(item.output_token_ids)} generated",
            )
        if item.max_total_tokens > self.config.max_model_len:
            raise RequestError(
                rid,
                "prompt + max_tokens must not exceed max_model_len",
                f"{item.request.num_prompt_tokens} + {item.max_tokens} > "
                f"{self.config.max_model_len}",
            )
        needed = max_blocks_per_request(
            self.manager.kv_cache_config, item.max_total_tokens, self.config.max_num_batched_tokens
        )
        num_groups = self.manager.num_groups
        groups = f" in its {num_groups} KV cache groups together" if num_groups > 1 else ""
        if needed > self.config.num_usable_blocks:
            raise RequestError(
                rid,
                "a request must fit in the pool on its own",
                f"{item.max_total_tokens} tokens need {needed} blocks of "
                f"{self.config.block_size}{groups}, the pool has "
                f"{self.config.num_usable_blocks}",
            )

    def add_request(self, item: EngineRequest) -> None:
        """Queue a request behind the waiting ones.

        Raises:
            RequestError: its id belongs to an unfinished request, or as `check_request`.
        """
        if item.request_id in self.live_request_ids:
            raise RequestError(
                item.request_id, "request id already in use by an unfinished request"
            )
        self.check_request(item)
        self.live_request_ids.add(item.request_id)
        self.waiting.append(item)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch (module docstring). Complexity: O(batch + new blocks)."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            item = self.running[index]
            num_tokens = min(item.num_tokens_to_compute, budget)
            while not self._allocate(item, num_tokens):
                victim = self.running.pop()  # the newest request makes room
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is item:
                    break
            else:
                output.scheduled.append(ScheduledChunk.of(item, num_tokens))
                budget -= num_tokens
                index += 1
        if output.preempted:
            return output  # vLLM admits nobody in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            item = self.waiting[0]
            hits, num_hit_tokens = self.manager.get_computed_blocks(item.request)
            num_tokens = min(item.request.num_tokens - num_hit_tokens, budget)
            if not self._allocate(item, num_tokens, hits, admission=True):
                break
            self.waiting.popleft()
            self.running.append(item)
            item.status = RequestStatus.RUNNING
            item.request.num_computed_tokens = num_hit_tokens
            output.scheduled.append(ScheduledChunk.of(item, num_tokens))
            self.stats.num_admissions += 1
            self.stats.num_lookup_tokens += item.request.num_tokens
            self.stats.num_hit_tokens += num_hit_tokens
            output.num_admitted += 1
            budget -= num_tokens
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[EngineRequest]:
        """Advance each scheduled request; append the sampled tokens; finish the done ones.

        Args:
            output: this step's `schedule()` result.
            sampled_token_ids: request id -> its sampled token, for every chunk that samples.

        Returns:
            The requests finished this step.

        Raises:
            InvalidArgumentError: a sampling chunk has no token (nothing changed).
        """
        missing = [
            c.item.request_id
            for c in output.scheduled
            if c.samples and c.item.request_id not in sampled_token_ids
        ]
        if missing:
            raise InvalidArgumentError(f"no sampled token for requests {missing}")
        finished = []
        for chunk in output.scheduled:
            item = chunk.item
            item.request.num_computed_tokens += chunk.num_tokens
            if chunk.samples and item.append_token(sampled_token_ids[item.request_id]):
                self._finish(item)
                finished.append(item)
        return finished

    def _allocate(
        self,
        item: EngineRequest,
        num_tokens: int,
        hits: KVCacheBlocks | None = None,
        *,
        admission: bool = False,
    ) -> bool:
        """allocate_slots; an admission passes the full-sequence gate when the config reserves
        the full sequence (vLLM 0.33's default)."""
        manager = self.manager
        request_id = item.request_id
        new_blocks = manager.allocate_slots(
            item.request,
            num_tokens,
            hits,
            full_sequence_must_fit=admission and self.config.reserve_full_sequence,
        )
        if new_blocks is None:
            return False
        self.evictions.after_allocation(
            request_id,
            manager.get_blocks(request_id),
            new_blocks,
            manager.block_pool.null_block,
        )
        return True

    def _num_positions(self, request_id: str) -> int:
        """Block positions the request holds (the same in every group); 0 for none."""
        return len(self.manager.get_blocks(request_id)[0])

    def _preempt(self, item: EngineRequest) -> None:
        """Free its blocks (their hashes stay for the recompute's lookup); back to the head."""
        self.manager.free(item.request)
        self.evictions.after_free(item.request_id)
        item.request.num_computed_tokens = 0
        item.status = RequestStatus.WAITING
        item.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(item)

    def _finish(self, item: EngineRequest) -> None:
        self.manager.free(item.request)
        self.manager.free_block_hashes(item.request)
        self.evictions.after_free(item.request_id)
        self.running.remove(item)
        self.live_request_ids.discard(item.request_id)
        item.status = RequestStatus.FINISHED
        self.stats.num_finished += 1

    def check_invariants(self) -> None:
        """The scheduler's invariants between steps, then the manager's.

        Raises:
            InvariantViolation: the first broken one and the state that breaks it.

        Complexity: O(live requests + their blocks) plus the manager's `check_invariants`.
        """
        block_size = self.config.block_size
        running_ids = [item.request_id for item in self.running]
        waiting_ids = [item.request_id for item in self.waiting]
        queued = running_ids + waiting_ids
        if len(set(queued)) != len(queued) or set(queued) != self.live_request_ids:
            raise InvariantViolation(
                "every live request is either running or waiting, once",
                f"running {running_ids}, waiting {waiting_ids}, live "
                f"{sorted(self.live_request_ids)}",
            )
        if len(self.running) > self.config.max_num_seqs:
            raise InvariantViolation(
                "at most max_num_seqs requests run", f"{len(self.running)} running"
            )
        for item in self.waiting:
            request = item.request
            if item.status is not RequestStatus.WAITING or request.num_computed_tokens:
                raise InvariantViolation(
                    "a waiting request has status WAITING and nothing computed",
                    f"{item.request_id!r}: {item.status}, {request.num_computed_tokens} computed",
                )
            if any(self.manager.get_blocks(item.request_id)):
                raise InvariantViolation(
                    "a waiting request holds no blocks", f"{item.request_id!r} holds blocks"
                )
        for item in self.running:
            request = item.request
            num_positions = self._num_positions(item.request_id)
            if item.status is not RequestStatus.RUNNING or not (
                request.num_computed_tokens < request.num_tokens
                and request.num_computed_tokens <= num_positions * block_size
            ):
                raise InvariantViolation(
                    "a running request has its computed tokens in its blocks and at least one "
                    "token left to compute",
                    f"{item.request_id!r}: {item.status}, {request.num_computed_tokens} of "
                    f"{request.num_tokens} computed, {num_positions} blocks of {block_size}",
                )
        self.manager.check_invariants()
