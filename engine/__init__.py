"""pagedkv's end-to-end engine: continuous batching of a `transformers` Llama, Gemma-3 or
Llama-4 text model on a paged KV cache (one KV cache group, or a hybrid model's several over one
pool).

Needs the `engine` extra (`pip install 'pagedkv[engine]'`: torch, transformers,
matplotlib). Importing this package imports none of them; each name below loads its module on
first use. Modules:

    config          EngineConfig: pool shape, token budget, batch size, runtime checks
    engine_request  EngineRequest: a prompt, max_tokens, stop tokens, status
    scheduler       continuous batching over KVCacheManager (one group or several):
                    chunked prefill, prefix lookups, decode, preemption by recompute, finishing
    kv_layout       each layer's KV cache spec, grouped as vLLM 0.33 groups a hybrid model
    evictions       counting prefix-cache evictions through the manager's public state
    executor        the AttentionExecutor interface and `make_executor`
    layer_caches    per-layer caches and one step's metadata as tensors (one per KV cache
                    group: GroupedStepMetadata)
    torch_executor  the torch reference executor (CPU or GPU)
    kernel_executor the CuPy kernels' executor, and its dry run
    model           the synthetic Llama, Gemma-3 and Llama-4 models (seeded, no downloads) and
                    local checkpoints
    paged_llama     a Llama's modules run token-packed through an executor
    paged_gemma3    a Gemma-3's modules likewise, each layer through its group and window
    paged_llama4    a Llama-4's modules likewise, each layer through its group and chunk
    stage_timer     time in K/V writes and attention (CUDA events on a GPU)
    llm_engine      LLMEngine: the step loop, RunResult
    metrics         StepRecord, RunSummary
    dense_check     engine vs `transformers` `generate`, token for token
    workload        the synthetic chat trace and JSONL prompts
    report, plot    the text report and the figure of `pagedkv run`
    run_command     `pagedkv run`
    dependencies    the optional-dependency check and its install hint
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.dense_check import DenseCheck, compare_with_dense
    from pagedkv.engine.engine_request import EngineRequest, FinishReason, RequestStatus
    from pagedkv.engine.executor import AttentionExecutor, make_executor
    from pagedkv.engine.kv_layout import KVLayout, kv_layout
    from pagedkv.engine.layer_caches import GroupedStepMetadata
    from pagedkv.engine.llm_engine import LLMEngine, RunResult
    from pagedkv.engine.model import (
        load_local_model,
        synthetic_gemma3,
        synthetic_llama,
        synthetic_llama4,
        synthetic_model,
    )
    from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
    from pagedkv.engine.workload import ChatTraceConfig, load_prompts_jsonl, synthetic_chat_trace

_EXPORTS = {
    "EngineConfig": "config",
    "DenseCheck": "dense_check",
    "compare_with_dense": "dense_check",
    "EngineRequest": "engine_request",
    "FinishReason": "engine_request",
    "RequestStatus": "engine_request",
    "AttentionExecutor": "executor",
    "make_executor": "executor",
    "KVLayout": "kv_layout",
    "kv_layout": "kv_layout",
    "GroupedStepMetadata": "layer_caches",
    "LLMEngine": "llm_engine",
    "RunResult": "llm_engine",
    "load_local_model": "model",
    "synthetic_gemma3": "model",
    "synthetic_llama": "model",
    "synthetic_llama4": "model",
    "synthetic_model": "model",
    "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler",
    "ChatTraceConfig": "workload",
    "load_prompts_jsonl": "workload",
    "synthetic_chat_trace": "workload",
}

__all__ = [
    "AttentionExecutor",
    "ChatTraceConfig",
    "DenseCheck",
    "EngineConfig",
    "EngineRequest",
    "FinishReason",
    "GroupedStepMetadata",
    "KVLayout",
    "LLMEngine",
    "RequestStatus",
    "RunResult",
    "Scheduler",
    "SchedulerOutput",
    "compare_with_dense",
    "kv_layout",
    "load_local_model",
    "load_prompts_jsonl",
    "make_executor",
    "synthetic_chat_trace",
    "synthetic_gemma3",
    "synthetic_llama",
    "synthetic_llama4",
    "synthetic_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedkv.engine.{module}"), name)
