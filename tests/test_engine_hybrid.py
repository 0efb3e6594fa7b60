"""End to end on the paged hybrid cache (issue 20 item 6): a Gemma-3 text model of sliding-window
and full-attention layers, and a Llama-4 text model of chunked local and full-attention layers,
served by the engine over `KVCacheManager` (several groups), equal transformers' dense `generate`
token for token.

Two tiny seeded Gemma-3s (`pagedkv.engine.model.GEMMA3_PRESETS`): layers (sliding, full) x 2,
which vLLM 0.33 lays out as two KV cache groups, and (sliding, sliding, full) x 2, which it lays
out as three (the four sliding layers split into two groups beside the full one); and a tiny
Llama-4 (`LLAMA4_PRESETS`), layers (chunked, full) x 2 with two mixture-of-experts layers: two
groups. Each serves a chat trace with shared prefixes through a pool small enough that the
sliding-window and chunked groups drop the blocks their window or chunk left (null blocks in
their tables), prefix hits start with null blocks in those groups, and chunked prefills,
evictions and preemptions happen (asserted), every invariant checked after every call.
Executors with plausible hybrid bugs (the window or chunk ignored; a local layer reading the
full group's block table) fail the check, so the check can fail.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.dense_check import compare_with_dense  # noqa: E402
from pagedkv.engine.engine_request import EngineRequest, RequestStatus  # noqa: E402
from pagedkv.engine.kernel_executor import DryRunLaunches, KernelExecutor  # noqa: E402
from pagedkv.engine.layer_caches import GroupedStepMetadata  # noqa: E402
from pagedkv.engine.llm_engine import LLMEngine, RunResult  # noqa: E402
from pagedkv.engine.model import synthetic_gemma3, synthetic_llama, synthetic_model  # noqa: E402
from pagedkv.engine.torch_executor import TorchReferenceExecutor  # noqa: E402
from pagedkv.engine.workload import ChatTraceConfig, synthetic_chat_trace  # noqa: E402
from pagedkv.gpu.step_metadata import StepMetadata  # noqa: E402
from pagedkv.manager import KVCacheManager  # noqa: E402
from pagedkv.vocab.errors import InvalidArgumentError, RequestError  # noqa: E402

PRESETS = ("gemma3-2group", "gemma3-3group", "llama4-2group")
WINDOW = 16  # the Gemma-3 presets' sliding window and the Llama-4 preset's chunk: 4 blocks

# The longest request (80 prompt + 24 generated tokens) holds 26 blocks in a full-attention
# group and at most cdiv(15 + 32, 4) + 1 = 13 in a sliding or chunked one: 39 of 47 usable
# blocks with two groups, 52 of 63 with three.
CONFIGS = {
    "gemma3-2group": EngineConfig(
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        runtime_checks=1,
    ),
    "gemma3-3group": EngineConfig(
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        runtime_checks=1,
    ),
    "llama4-2group": EngineConfig(
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        runtime_checks=1,
    ),
}
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


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def model(preset: str) -> Any:
    return synthetic_model(preset, seed=0)


def trace(model: Any) -> list[EngineRequest]:
    return synthetic_chat_trace(TRACE, vocab_size=model.config.vocab_size)


@dataclass
class Observed:
    """What a recording run saw: hits per group at admission, null pages the steps' tables
    held inside a sequence (positions a window left), and the pages a window read."""

    hits_with_leading_nulls: int = 0
    null_pages_in_tables: int = 0
    grouped_steps: int = 0
    lookups: list[tuple[int, ...]] = field(default_factory=list)


class RecordingExecutor(TorchReferenceExecutor):
    """The reference executor, counting the null pages of each step's sliding-window tables."""

    observed = Observed()

    def begin_step(self, metadata: StepMetadata | GroupedStepMetadata) -> None:
        if isinstance(metadata, GroupedStepMetadata):
            type(self).observed.grouped_steps += 1
            block_size = self.caches[0].layout.block_size
            for group in metadata.groups:
                for row, seq_len in zip(group.block_table, group.seq_lens, strict=True):
                    pages = row[: -(-int(seq_len) // block_size)]
                    type(self).observed.null_pages_in_tables += int((pages == 0).sum())
        super().begin_step(metadata)


def recorded_run(model: Any, config: EngineConfig) -> tuple[RunResult, Observed, LLMEngine]:
    RecordingExecutor.observed = observed = Observed()
    engine = LLMEngine(model, config, executor=RecordingExecutor, keep_logits=True)
    manager = engine.manager
    assert manager.num_groups >= 2
    lookup = manager.get_computed_blocks
    null_block = manager.block_pool.null_block

    def recording_lookup(request: Any) -> Any:
        hits, num_hit_tokens = lookup(request)
        observed.lookups.append(tuple(len(group) for group in hits))
        if any(group and group[0] is null_block for group in hits):
            observed.hits_with_leading_nulls += 1
        return hits, num_hit_tokens

    manager.get_computed_blocks = recording_lookup  # type: ignore[method-assign]
    return engine.run(trace(model)), observed, engine


@pytest.fixture(scope="module")
def recorded(model: Any, preset: str) -> tuple[RunResult, Observed, LLMEngine]:
    return recorded_run(model, CONFIGS[preset])


def test_the_layouts_are_vllm_033s_groups_over_shared_tensors(preset: str, model: Any) -> None:
    engine = LLMEngine(model, CONFIGS[preset])
    assert isinstance(engine.manager, KVCacheManager) and engine.manager.num_groups >= 2
    groups = [list(group.layer_names) for group in engine.layout.kv_cache_config.kv_cache_groups]
    if preset == "gemma3-2group":
        assert groups == [["layers.0", "layers.2"], ["layers.1", "layers.3"]]
        assert engine.layout.group_windows == (WINDOW, None)
        assert engine.layout.layer_groups == (0, 1, 0, 1)
    elif preset == "llama4-2group":
        assert groups == [["layers.0", "layers.2"], ["layers.1", "layers.3"]]
        assert engine.layout.group_windows == (None, None)
        assert engine.layout.group_chunks == (WINDOW, None)
        assert engine.layout.layer_groups == (0, 1, 0, 1)
    else:
        assert groups == [
            ["layers.0", "layers.3"],
            ["layers.1", "layers.4"],
            ["layers.2", "layers.5"],
        ]
        assert engine.layout.group_windows == (WINDOW, WINDOW, None)
        assert engine.layout.layer_groups == (0, 1, 2, 0, 1, 2)
    caches = engine.executor.caches  # type: ignore[attr-defined]
    for position in range(2):  # the j-th layer of every group shares one tensor
        pointers = {caches[int(group[position].split(".")[1])].key.data_ptr() for group in groups}
        assert len(pointers) == 1
    assert caches[0].key.data_ptr() != caches[len(groups)].key.data_ptr()
    assert [cache.layout.sliding_window for cache in caches] == [
        WINDOW if kind == "sliding_attention" else None for kind in model.config.layer_types
    ]
    assert [cache.layout.attention_chunk_size for cache in caches] == [
        WINDOW if kind == "chunked_attention" else None for kind in model.config.layer_types
    ]


def test_a_llama_keeps_the_single_group_manager() -> None:
    engine = LLMEngine(synthetic_llama("tiny", seed=0), CONFIGS["gemma3-2group"])
    assert type(engine.manager) is KVCacheManager
    assert engine.layout.num_groups == 1 and engine.layout.group_windows == (None,)


def test_the_run_meets_every_hybrid_situation(
    recorded: tuple[RunResult, Observed, LLMEngine],
) -> None:
    run, observed, engine = recorded
    summary = run.summary
    assert summary.num_preemptions > 0
    assert summary.num_evictions > 0
    assert summary.num_hit_tokens > 0
    assert any(step.num_partial_prefills for step in run.steps)
    assert max(step.num_running for step in run.steps) > 1
    assert summary.peak_pool_usage == 1.0
    assert observed.grouped_steps == summary.num_steps - sum(
        1 for step in run.steps if not step.num_prefill_tokens + step.num_decode_tokens
    )
    assert observed.null_pages_in_tables > 0  # windows moved on: their blocks were freed
    assert observed.hits_with_leading_nulls > 0  # sliding hits need only the window's blocks
    assert all(len(set(lengths)) == 1 for lengths in observed.lookups)  # one length per group
    assert all(item.status is RequestStatus.FINISHED for item in run.requests)
    assert all(len(item.output_token_ids) == item.max_tokens for item in run.requests)
    pool = engine.manager.block_pool
    assert pool.get_num_free_blocks() == engine.config.num_usable_blocks  # every block back


def test_engine_tokens_equal_transformers_generate(
    model: Any, recorded: tuple[RunResult, Observed, LLMEngine]
) -> None:
    run = recorded[0]
    check = compare_with_dense(model, run.requests, run.logits)
    assert check.passed, check.failures
    assert check.num_tokens == run.summary.num_generated_tokens == 299


def test_the_kernels_dry_run_plans_each_group_with_its_window(model: Any, preset: str) -> None:
    config = CONFIGS[preset]
    if preset.startswith("llama4"):
        with pytest.raises(InvalidArgumentError, match=r"layers \[0, 2\] use chunked local"):
            LLMEngine(model, config, executor="cupy-dry-run")
        return
    reference = LLMEngine(model, config, keep_logits=True).run(trace(model)[:8])
    engine = LLMEngine(model, config, executor="cupy-dry-run", keep_logits=True)
    assert isinstance(engine.executor, KernelExecutor)
    launches = engine.executor.launches
    assert isinstance(launches, DryRunLaunches)
    dry = engine.run(trace(model)[:8])
    assert dry.outputs == reference.outputs
    for request_id, logits in reference.logits.items():
        assert torch.equal(dry.logits[request_id], logits)
    num_groups = engine.layout.num_groups
    busy = [s for s in dry.steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert len(launches.plans) == num_groups * len(busy)  # one plan per group and step
    windows = [plan.metadata.sliding_window for plan in launches.plans[:num_groups]]
    assert windows == list(engine.layout.group_windows)
    writes = [r for r in launches.records if r.kind == "write_kv"]
    assert sum(r.slots_checked_on_host for r in writes) == num_groups * len(busy)


class LocalMaskIgnoredExecutor(TorchReferenceExecutor):
    """A plausible bug: every layer attends to the whole sequence, sliding and chunked ones
    included (so they read the null pages their window or chunk left, and keys the dense model
    masks)."""

    def window_of(self, layer: int) -> int | None:
        return None

    def chunk_of(self, layer: int) -> int | None:
        return None


class FullTableExecutor(TorchReferenceExecutor):
    """A plausible bug: every layer reads the last group's (full attention's) block table,
    while writing through its own group's slots."""

    def attention(self, layer: int, query: Any, scale: float) -> Any:
        from pagedkv.gpu.reference import reference_paged_attention

        cache = self.layer(layer)
        step = self._steps[-1]
        return reference_paged_attention(
            query,
            cache.key,
            cache.value,
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            scale=scale,
            sliding_window=self.window_of(layer),
            attention_chunk_size=self.chunk_of(layer),
        )


@pytest.mark.parametrize("executor", [LocalMaskIgnoredExecutor, FullTableExecutor])
def test_the_check_fails_on_an_executor_with_a_hybrid_bug(
    model: Any, preset: str, executor: type[TorchReferenceExecutor]
) -> None:
    engine = LLMEngine(model, CONFIGS[preset], executor=executor, keep_logits=True)
    run = engine.run(trace(model)[:6])
    check = compare_with_dense(model, run.requests, run.logits)
    assert not check.passed
    assert all(c.max_logit_diff > 100 * check.atol for c in check.failures)


def test_a_request_must_fit_with_every_groups_blocks(model: Any, preset: str) -> None:
    """Each group takes blocks from one pool: a request too big for the groups together is
    refused when added, not left waiting forever."""
    config = CONFIGS[preset]
    engine = LLMEngine(model, config)
    # 120 tokens: 30 blocks in the full group, 13 in each sliding or chunked group.
    needed = {"gemma3-2group": 43, "gemma3-3group": 56, "llama4-2group": 43}[preset]
    assert engine.layout.max_blocks_per_request(120, config.max_num_batched_tokens) == needed
    assert needed > 30 and needed < config.num_usable_blocks
    engine.add_request(EngineRequest.from_prompt("fits", list(range(100)), 20))
    small = LLMEngine(
        model,
        EngineConfig(num_blocks=needed, block_size=4, max_num_batched_tokens=32, max_model_len=128),
    )
    with pytest.raises(RequestError, match="a request must fit in the pool on its own"):
        small.add_request(EngineRequest.from_prompt("big", list(range(100)), 20))


# -- `pagedkv run` ---------------------------------------------------------------------------

RUN = [
    "run",
    "--requests",
    "12",
    "--prompt-tokens",
    "80",
    "--max-tokens",
    "16",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "128",
    "--threads",
    "1",
    "--no-progress",
    "--check-dense",
]


def _field(report: str, name: str) -> str:
    match = re.search(rf"^  {name}\s+(.*)$", report, re.M)
    assert match, report
    return match.group(1)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """`--threads` sets torch's global thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("restore_threads")
def test_pagedkv_run_check_dense_passes_on_the_two_group_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    numbers = tmp_path / "run.json"
    args = [*RUN, "--preset", "gemma3-2group", "--num-blocks", "48", "--json", str(numbers)]
    assert main([*args, "--runtime-checks", "1"]) == 0
    report = capsys.readouterr().out
    assert _field(report, "model").startswith(
        "synthetic Gemma-3 'gemma3-2group' (seeded random weights, seed 0): 4 layers "
        "(2 sliding window 16, 2 full attention)"
    )
    assert _field(report, "KV cache groups") == (
        "2 groups: sliding window 16 (layers 0, 2); full attention (layers 1, 3); every "
        "group's blocks from the one pool"
    )
    assert _field(report, "dense check").startswith("OK: 12 of 12 requests equal")
    assert int(_field(report, "preemptions").split()[0]) > 0
    document = json.loads(numbers.read_text())
    assert document["dense_check"]["passed"] is True
    assert document["description"]["kv_cache_groups"].startswith("2 groups")


@pytest.mark.usefixtures("restore_threads")
def test_pagedkv_run_model_serves_a_local_three_group_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model PATH` with a Gemma-3 checkpoint written here (no download)."""
    checkpoint = tmp_path / "gemma3-3group"
    synthetic_gemma3("gemma3-3group", seed=1).save_pretrained(checkpoint)
    capsys.readouterr()
    assert main([*RUN, "--model", str(checkpoint), "--num-blocks", "64"]) == 0
    report = capsys.readouterr().out
    assert _field(report, "model").startswith(f"Gemma-3 from {checkpoint}: 6 layers")
    assert _field(report, "KV cache groups").startswith(
        "3 groups: sliding window 16 (layers 0, 3); sliding window 16 (layers 1, 4); full "
        "attention (layers 2, 5)"
    )
    assert _field(report, "dense check").startswith("OK: 12 of 12 requests equal")


@pytest.mark.usefixtures("restore_threads")
def test_pagedkv_run_refuses_a_pool_too_small_for_the_groups_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Every request of this trace fits in 23 blocks of one group (a Llama serves it in this
    # pool); the first, 40 tokens, needs 10 blocks in each of the three groups.
    assert main([*RUN, "--preset", "gemma3-3group", "--num-blocks", "24"]) == 2
    assert (
        "request 'chat-000': a request must fit in the pool on its own (40 tokens need 30 "
        "blocks of 4 in its 3 KV cache groups together, the pool has 23)"
    ) in capsys.readouterr().err


@pytest.mark.usefixtures("restore_threads")
def test_pagedkv_run_check_dense_passes_on_the_chunked_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*RUN, "--preset", "llama4-2group", "--num-blocks", "48"]) == 0
    report = capsys.readouterr().out
    assert _field(report, "model").startswith(
        "synthetic Llama-4 'llama4-2group' (seeded random weights, seed 0): 4 layers "
        "(2 chunked local attention 16, 2 full attention)"
    )
    assert _field(report, "KV cache groups").startswith(
        "2 groups: chunked local attention 16 (layers 0, 2); full attention (layers 1, 3)"
    )
    assert _field(report, "dense check").startswith("OK: 12 of 12 requests equal")
    assert main([*RUN, "--preset", "llama4-2group", "--executor", "cupy-dry-run"]) == 2
    assert "use chunked local attention, which the CUDA kernels do not" in capsys.readouterr().err
