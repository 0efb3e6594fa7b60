"""The engine's tokens equal transformers' dense `generate`, token for token (issue 13's proof).

A tiny seeded Llama serves a chat trace with shared prefixes through a pool small enough that
prefix hits, chunked prefills, evictions and preemptions all happen (asserted), with every
invariant checked after every call; then each request is regenerated densely. The same run
through the CuPy executor's dry run (every launch's arguments built and checked, the reference
computing) gives the same logits bit for bit, and an executor with a plausible bug (two pages of
each block table swapped) fails the check, so the check can fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.dense_check import MIN_LOGITS_ATOL, NOISE_FACTOR, compare_with_dense  # noqa: E402
from pagedkv.engine.engine_request import EngineRequest, RequestStatus  # noqa: E402
from pagedkv.engine.kernel_executor import DryRunLaunches, KernelExecutor  # noqa: E402
from pagedkv.engine.llm_engine import LLMEngine, RunResult  # noqa: E402
from pagedkv.engine.model import synthetic_llama  # noqa: E402
from pagedkv.engine.torch_executor import TorchReferenceExecutor  # noqa: E402
from pagedkv.engine.workload import ChatTraceConfig, synthetic_chat_trace  # noqa: E402
from pagedkv.gpu.step_metadata import StepMetadata  # noqa: E402
from pagedkv.vocab.errors import InvalidArgumentError, RequestError  # noqa: E402

CONFIG = EngineConfig(
    num_blocks=32,  # 31 usable blocks of 4 tokens: the longest request needs 30
    block_size=4,
    max_num_batched_tokens=32,  # shorter than most prompts: chunked prefill
    max_num_seqs=8,
    max_model_len=128,
    runtime_checks=1,  # every invariant after every manager call and every step
)
TRACE = ChatTraceConfig(
    num_requests=24,
    max_tokens=(4, 24),
    num_system_prompts=2,
    system_prompt_tokens=(12, 40),
    user_tokens=(2, 16),
    follow_up_share=0.3,
    max_prompt_tokens=80,
    arrivals_per_step=2.0,
    seed=0,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls on a shared 2-core machine: one thread is 20-40x cheaper than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> Any:
    return synthetic_llama("tiny", seed=0)


def trace(model: Any) -> list[EngineRequest]:
    return synthetic_chat_trace(TRACE, vocab_size=model.config.vocab_size)


@pytest.fixture(scope="module")
def reference_run(model: Any) -> RunResult:
    return LLMEngine(model, CONFIG, keep_logits=True).run(trace(model))


def test_the_run_meets_every_situation_the_proof_is_about(reference_run: RunResult) -> None:
    summary = reference_run.summary
    assert summary.num_preemptions > 0
    assert summary.num_evictions > 0
    assert summary.num_hit_tokens > 0
    assert any(step.num_partial_prefills for step in reference_run.steps)
    assert max(step.num_running for step in reference_run.steps) > 1  # batches, not one by one
    assert summary.peak_pool_usage == 1.0
    preempted = [item for item in reference_run.requests if item.num_preemptions]
    assert any(item.output_token_ids for item in preempted)  # recomputed prompt + outputs
    assert all(item.status is RequestStatus.FINISHED for item in reference_run.requests)
    assert all(
        len(item.output_token_ids) == item.max_tokens for item in reference_run.requests
    )  # no stop token: every request runs to max_tokens


def test_engine_tokens_equal_transformers_generate(model: Any, reference_run: RunResult) -> None:
    check = compare_with_dense(model, reference_run.requests, reference_run.logits)
    assert check.passed, check.failures
    assert check.num_tokens == reference_run.summary.num_generated_tokens
    assert check.atol == max(MIN_LOGITS_ATOL, NOISE_FACTOR * check.noise_floor)
    assert check.max_logit_diff <= check.atol
    assert check.min_margin > 10 * check.max_logit_diff  # no near-tie decided any token


def test_the_kernels_dry_run_builds_every_launch_and_gives_the_same_logits(
    model: Any, reference_run: RunResult
) -> None:
    engine = LLMEngine(model, CONFIG, executor="cupy-dry-run", keep_logits=True)
    assert isinstance(engine.executor, KernelExecutor)
    launches = engine.executor.launches
    assert isinstance(launches, DryRunLaunches)
    dry = engine.run(trace(model))
    assert dry.outputs == reference_run.outputs
    for request_id, logits in reference_run.logits.items():
        assert torch.equal(dry.logits[request_id], logits)
    num_layers = engine.runner.num_layers
    busy_steps = [s for s in dry.steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert len(launches.plans) == len(busy_steps)  # one plan per step, reused by every layer
    assert len(launches.records) == 2 * num_layers * len(busy_steps)
    writes = [r for r in launches.records if r.kind == "write_kv"]
    assert [r.slots_checked_on_host for r in writes[:num_layers]] == [True] + [False] * (
        num_layers - 1
    )  # slots checked on the host once per step, not once per layer
    attended = [r for r in launches.records if r.kind == "paged_attention"]
    assert {id(r.plan) for r in attended} == {id(plan) for plan in launches.plans}
    for plan in launches.plans:
        assert plan.head_size == 64 and plan.dtype == "float32"
        assert plan.metadata.block_size == CONFIG.block_size
        assert plan.metadata.num_blocks == CONFIG.num_blocks


def test_bad_requests_are_refused_before_anything_runs(model: Any) -> None:
    engine = LLMEngine(model, CONFIG)
    engine.add_request(EngineRequest.from_prompt("ok", [1, 2, 3], 2))
    with pytest.raises(RequestError, match=r"vocabulary \[0, 512\) \(token 512 at position 1\)"):
        engine.add_request(EngineRequest.from_prompt("big", [1, 512], 2))
    with pytest.raises(RequestError, match="request id already used in this engine"):
        engine.add_request(EngineRequest.from_prompt("ok", [1], 2))
    with pytest.raises(RequestError, match="must not exceed max_model_len"):
        engine.add_request(EngineRequest.from_prompt("long", [1] * 120, 9))
    assert [item.request_id for item in engine.requests] == ["ok"]
    assert engine.summary.num_prompt_tokens == 3
    with pytest.raises(InvalidArgumentError, match="max_model_len 2048 exceeds the model's"):
        LLMEngine(model, dataclasses.replace(CONFIG, max_model_len=2048))
    with pytest.raises(InvalidArgumentError, match="executor must be one of"):
        LLMEngine(model, CONFIG, executor="triton")  # type: ignore[arg-type]


class SwappedPagesExecutor(TorchReferenceExecutor):
    """A plausible bug: the first two pages of every block table in the wrong order."""

    def begin_step(self, metadata: StepMetadata) -> None:
        table = metadata.block_table.copy()
        two_pages = metadata.seq_lens > CONFIG.block_size
        table[two_pages, 0] = metadata.block_table[two_pages, 1]
        table[two_pages, 1] = metadata.block_table[two_pages, 0]
        super().begin_step(dataclasses.replace(metadata, block_table=table))


def test_the_check_fails_on_an_executor_that_reads_pages_in_the_wrong_order(model: Any) -> None:
    engine = LLMEngine(model, CONFIG, executor=SwappedPagesExecutor, keep_logits=True)
    run = engine.run(trace(model)[:6])
    check = compare_with_dense(model, run.requests, run.logits)
    assert not check.passed
    assert all(c.max_logit_diff > 100 * check.atol for c in check.failures)


def _cuda_and_cupy() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available()) and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_and_cupy(), reason="needs a CUDA device visible to cupy and torch")
def test_on_a_gpu_the_cupy_kernels_equal_transformers_generate(reference_run: RunResult) -> None:
    model = synthetic_llama("tiny", seed=0, device="cuda")
    run = LLMEngine(model, CONFIG, executor="cupy", keep_logits=True).run(trace(model))
    assert run.summary.num_preemptions == reference_run.summary.num_preemptions
    check = compare_with_dense(model, run.requests, run.logits)
    assert check.passed, check.failures
    assert run.outputs == reference_run.outputs  # and the CPU reference's tokens
    assert run.summary.stage_seconds["attention"] > 0
