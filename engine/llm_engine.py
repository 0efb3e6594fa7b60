"""The engine loop: scheduler -> step metadata -> paged model -> greedy sampling -> scheduler.

    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    result = engine.run(requests)            # every request to completion
    result.outputs["req-0"]                  # its generated token ids

Each step: admit the requests that have arrived, `Scheduler.schedule()` (allocations,
preemptions, admissions), `scheduled_from_manager` + `build_step_metadata` (block tables, slot
mappings, positions, query offsets from the manager's block lists), the model's forward pass
through the executor, argmax, `Scheduler.update_from_output`. Sampling is greedy only.

The model's layers decide the KV cache (`pagedkv.engine.kv_layout`): one spec for every layer
(a Llama) is one group; sliding-window beside full-attention layers (a Gemma-3), or chunked local
beside full (a Llama-4), are vLLM 0.33's groups, all on one `KVCacheManager`; a model of several
groups then has one block table and slot mapping per group each step
(`GroupedStepMetadata`), sliding-window and chunked groups' tables holding the null block where
the window or chunk moved on (checked never to be read).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine_request import EngineRequest
from pagedkv.engine.executor import AttentionExecutor, ExecutorFactory, ExecutorName, make_executor
from pagedkv.engine.kv_layout import KVLayout, kv_layout, layer_specs
from pagedkv.engine.layer_caches import GroupedStepMetadata
from pagedkv.engine.metrics import RunSummary, StepRecord, percentile
from pagedkv.engine.model import check_model, layer_attention
from pagedkv.engine.paged_gemma3 import PagedGemma3Runner
from pagedkv.engine.paged_llama import PagedLlamaRunner
from pagedkv.engine.paged_llama4 import PagedLlama4Runner
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.engine.stage_timer import StageTimer
from pagedkv.gpu.kv_cache_tensors import allocate_kv_caches
from pagedkv.gpu.step_metadata import (
    StepMetadata,
    build_step_metadata,
    scheduled_from_manager,
)
from pagedkv.manager import KVCacheManager
from pagedkv.vocab.errors import InvalidArgumentError, InvariantViolation, RequestError
from pagedkv.vocab.request import Request

if TYPE_CHECKING:
    from pagedkv.events.metrics import KVCacheMetrics


@dataclass
class RunResult:
    """What `LLMEngine.run` produced.

    Attributes:
        requests: the requests, in the order given, all finished.
        steps: one record per engine step.
        summary: the totals.
        logits: request id -> float32 [generated, vocab] on the host, the logits each output
            token was sampled from (only with `keep_logits`).
    """

    requests: list[EngineRequest]
    steps: list[StepRecord]
    summary: RunSummary
    logits: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def outputs(self) -> dict[str, list[int]]:
        """Request id -> generated token ids."""
        return {item.request_id: list(item.output_token_ids) for item in self.requests}


class LLMEngine:
    """Continuous batching of greedy generation over pagedkv's `KVCacheManager` (one KV cache
    group, or a hybrid model's several).

    Args:
        model: a Llama, Gemma-3 or Llama-4 text causal LM (`pagedkv.engine.model.check_model`),
            in eval mode; its device and dtype are the caches'.
        config: pool and scheduling limits.
        executor: "reference" (torch, any device), "cupy" (the CUDA kernels),
            "cupy-dry-run" (the kernels' glue and checks, computing with the reference), or a
            factory making an executor from the per-layer caches.
        keep_logits: keep every sampled token's logits row (for the dense check).
        metrics: a Prometheus exporter fed after every step (usage, the manager's prefix-cache
            stats, evictions from its KV cache events, the step's preemptions); the manager
            gathers stats and events only then.

    Attributes:
        layout: the KV cache groups and each layer's group (`kv_layout`).
        manager: the `KVCacheManager` of every group.

    Raises:
        InvalidArgumentError: max_model_len beyond the model's positions, a bad executor, or the
            CUDA kernels for a model with chunked local attention.
        KVCacheConfigError: layers whose groups no manager serves.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        *,
        executor: ExecutorName | ExecutorFactory = "reference",
        keep_logits: bool = False,
        metrics: KVCacheMetrics | None = None,
    ) -> None:
        model_type = check_model(model)
        model_config = model.config
        if config.max_model_len > model_config.max_position_embeddings:
            raise InvalidArgumentError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        weight = next(model.parameters())
        layers = model.model.layers
        specs = layer_specs(
            layer_attention(model),
            block_size=config.block_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_size=layers[0].self_attn.head_dim,
            dtype=weight.dtype,
        )
        self.layout: KVLayout = kv_layout(specs, config.num_blocks)
        kv_cache_config = self.layout.kv_cache_config
        if config.prefix_cache_retention_interval is not None:
            kv_cache_config = kv_cache_config.with_retention(config.prefix_cache_retention_interval)
        self.config = config
        self.device: torch.device = weight.device
        self.manager = KVCacheManager(
            kv_cache_config,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            log_stats=metrics is not None,
            enable_kv_cache_events=metrics is not None,
            debug_invariants=config.runtime_checks,
            max_in_flight_tokens=config.max_num_batched_tokens,  # one batch: steps are synchronous
        )
        self.metrics = metrics
        caches = allocate_kv_caches(kv_cache_config, backend="torch", device=str(self.device))
        layer_caches = [caches[name] for name in self.layout.layer_names]
        self.executor: AttentionExecutor = (
            make_executor(executor, layer_caches)
            if isinstance(executor, str)
            else executor(layer_caches)
        )
        self.timer = StageTimer(self.device)
        self.runner: PagedLlamaRunner | PagedGemma3Runner | PagedLlama4Runner
        if model_type == "gemma3_text":
            self.runner = PagedGemma3Runner(model, self.executor, self.timer)
        elif model_type == "llama4_text":
            self.runner = PagedLlama4Runner(model, self.executor, self.timer)
        else:
            self.runner = PagedLlamaRunner(model, self.executor, self.timer)
        self.summary = RunSummary()
        self.scheduler = Scheduler(config, self.manager, self.summary)
        self.keep_logits = keep_logits
        self.step_index = 0
        self.steps: list[StepRecord] = []
        self.requests: list[EngineRequest] = []  # every request added, in order
        self.pending: list[EngineRequest] = []  # not arrived yet, by arrival step
        self.logit_rows: dict[str, list[torch.Tensor]] = {}
        self._known_ids: set[str] = set()

    # -- requests --------------------------------------------------------------------------

    def add_request(self, item: EngineRequest) -> None:
        """Accept a request; it joins the waiting queue at its arrival step.

        Raises:
            RequestError: a request id used before in this engine, a prompt token outside the
                model's vocabulary, or as `Scheduler.check_request`.
        """
        if item.request_id in self._known_ids:
            raise RequestError(item.request_id, "request id already used in this engine")
        vocab_size = self.runner.model.config.vocab_size
        for position, token in enumerate(item.prompt_token_ids):
            if not 0 <= token < vocab_size:
                raise RequestError(
                    item.request_id,
                    f"prompt token ids must be in the model's vocabulary [0, {vocab_size})",
                    f"token {token} at position {position}",
                )
        self.scheduler.check_request(item)
        self._known_ids.add(item.request_id)
        self.requests.append(item)
        bisect.insort(self.pending, item, key=lambda pending: pending.arrival_step)  # stable
        self.summary.num_prompt_tokens += item.request.num_prompt_tokens

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished_requests

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[EngineRequest]:
        """Run one step; return the requests it finished.

        Raises:
            InvariantViolation: nothing could be scheduled although nothing runs and requests
                wait (cannot happen for requests `check_request` accepted), or a runtime check
                failed.
        """
        began = time.perf_counter()
        while self.pending and self.pending[0].arrival_step <= self.step_index:
            item = self.pending.pop(0)
            item.arrival_time = began
            self.scheduler.add_request(item)
        output = self.scheduler.schedule()
        finished: list[EngineRequest] = []
        if output.scheduled:
            sampled = self._execute(output)
            finished = self.scheduler.update_from_output(output, sampled)
            sampled_at = time.perf_counter()
            for chunk in output.scheduled:
                if chunk.samples:
                    if chunk.item.first_token_time is None:
                        chunk.item.first_token_time = sampled_at
                    chunk.item.last_token_time = sampled_at
        elif self.scheduler.waiting and not self.scheduler.running:
            raise InvariantViolation(
                "a step with waiting requests and an idle pool schedules something",
                f"step {self.step_index}: {len(self.scheduler.waiting)} waiting, "
                f"{self.manager.block_pool.get_num_free_blocks()} free blocks",
            )
        self._record(output)
        if self.metrics is not None:
            manager = self.manager
            self.metrics.observe(
                usage=manager.usage,
                stats=manager.make_prefix_cache_stats(),
                events=manager.take_events(),
                num_preempted=len(output.preempted),
            )
        checks = self.config.runtime_checks
        if checks and self.step_index % checks == 0:
            self.scheduler.check_invariants()
        self.step_index += 1
        return finished

    def run(
        self,
        requests: Iterable[EngineRequest] = (),
        on_step: Callable[[StepRecord, list[EngineRequest]], None] | None = None,
    ) -> RunResult:
        """Add `requests`, step until every request added so far has finished, and report.

        Args:
            requests: new requests (ids unused in this engine).
            on_step: called after every step with its record and the requests it finished.

        Returns:
            The result over every request this engine was given, and every step it ran.

        Raises:
            RequestError: as `add_request` (before any step runs).
        """
        for item in requests:
            self.add_request(item)
        began, began_cpu = time.perf_counter(), time.process_time()
        while self.has_unfinished_requests:
            finished = self.step()
            if on_step is not None:
                on_step(self.steps[-1], finished)
        self.timer.collect()
        summary = self.summary
        summary.seconds += time.perf_counter() - began  # over every run() of this engine
        summary.cpu_seconds += time.process_time() - began_cpu
        summary.stage_seconds = dict(self.timer.seconds)
        items = list(self.requests)
        summary.num_requests = len(items)
        summary.num_generated_tokens = sum(len(item.output_token_ids) for item in items)
        ttfts = [item.ttft for item in items if item.ttft is not None]
        tpots = [item.tpot for item in items if item.tpot is not None]
        summary.ttft_median, summary.ttft_p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
        summary.tpot_median, summary.tpot_p90 = percentile(tpots, 0.5), percentile(tpots, 0.9)
        logits = {}
        if self.keep_logits:
            logits = {
                item.request_id: torch.stack(self.logit_rows[item.request_id]) for item in items
            }
        return RunResult(items, list(self.steps), summary, logits)

    def _execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Build the step's metadata, run the model, sample greedily."""
        chunks = output.scheduled
        requests = [chunk.item.request for chunk in chunks]
        num_scheduled = {chunk.item.request_id: chunk.num_tokens for chunk in chunks}
        step = self._step_metadata(requests, num_scheduled)
        metadata = step.groups[0] if isinstance(step, GroupedStepMetadata) else step
        token_ids: list[int] = []
        sample_rows: list[int] = []
        for index, chunk in enumerate(chunks):
            start = chunk.num_computed_tokens
            token_ids += chunk.item.request.all_token_ids[start : start + chunk.num_tokens]
            if chunk.samples:
                sample_rows.append(int(metadata.query_start_loc[index + 1]) - 1)
        device = self.device
        self.executor.begin_step(step)
        logits = self.runner.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.from_numpy(metadata.positions).to(device),
            torch.tensor(sample_rows, dtype=torch.int64, device=device),
        )
        tokens = logits.argmax(dim=-1).tolist()
        sampling = [chunk.item.request_id for chunk in chunks if chunk.samples]
        if self.keep_logits:
            host = logits.cpu()
            for row, request_id in enumerate(sampling):
                self.logit_rows.setdefault(request_id, []).append(host[row])
        self.summary.num_computed_tokens += len(token_ids)
        return dict(zip(sampling, tokens, strict=True))

    def _step_metadata(
        self, requests: list[Request], num_scheduled: dict[str, int]
    ) -> StepMetadata | GroupedStepMetadata:
        """The step's metadata: one `StepMetadata` for one group, else one per group (each from
        the group's block lists, its null blocks checked against the group's window or
        chunk)."""
        block_size = self.config.block_size
        windows, chunks = self.layout.group_windows, self.layout.group_chunks
        groups = tuple(
            build_step_metadata(
                scheduled_from_manager(group, requests, num_scheduled),
                block_size,
                sliding_window=window,
                attention_chunk_size=chunk,
            )
            for group, window, chunk in zip(
                self.manager.coordinator.single_type_managers, windows, chunks, strict=True
            )
        )
        if len(groups) == 1:
            return groups[0]
        return GroupedStepMetadata(groups, self.layout.layer_groups)

    def _record(self, output: SchedulerOutput) -> None:
        scheduler = self.scheduler
        stats = scheduler.stats
        decode = sum(1 for chunk in output.scheduled if chunk.is_decode)
        usage = self.manager.usage
        record = StepRecord(
            step=self.step_index,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_prefill_tokens=output.num_tokens - decode,
            num_decode_tokens=decode,
            num_partial_prefills=sum(1 for chunk in output.scheduled if not chunk.samples),
            pool_usage=usage,
            prefix_hit_rate=stats.prefix_hit_rate,
            num_preemptions=stats.num_preemptions,
            num_evictions=scheduler.evictions.num_evictions,
            num_finished=stats.num_finished,
        )
        self.steps.append(record)
        summary = self.summary
        summary.num_steps += 1
        summary.peak_pool_usage = max(summary.peak_pool_usage, usage)
        summary.num_evictions = scheduler.evictions.num_evictions
