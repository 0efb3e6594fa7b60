"""One vLLM engine run on a tiny local model, in one plugin mode: the vLLM tier's driver.

    python -m pagedkv.harness.vllm_engine.run --model llama --requests 200 --mode shadow \\
        --strict --out shadow.json
    python -m pagedkv.harness.vllm_engine.run --compare off.json replace.json

A run makes the model if it is not cached yet (`models.ensure_model`), sets the plugin's
environment (`PAGEDKV_VLLM`, and `PAGEDKV_VLLM_STRICT=1` with `--strict`) before vLLM starts
(its engine core is a spawned process that reads it), builds `vllm.LLM` with prefix caching,
chunked prefill, a small token budget per step and a KV cache small enough that the scheduler
preempts (`ENGINE_SETTINGS`), generates the seeded workload (`workload.make_workload`) greedily
and writes one JSON object (`RunResult`): every request's output token ids, vLLM's own counters
(`llm.get_metrics()`: preemptions, prefix-cache queries and hits, prompt and generation tokens),
what the probe saw inside the engine core (`probe`: steps, scheduler CPU time, chunked
prefills, the KV cache manager's class), the plugin's JSON summary (`PAGEDKV_VLLM_REPORT`:
mirrored calls, divergences) in modes other than off, and the times.

vLLM is imported only in `main`'s process, after the environment is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.harness.vllm_engine.models import MODELS, MODELS_DIR, ensure_model
from pagedkv.harness.vllm_engine.probe import PROBE_ENV
from pagedkv.harness.vllm_engine.workload import (
    DEFAULT_SHAPE,
    Workload,
    WorkloadShape,
    make_workload,
)

MODES = ("off", "shadow", "replace")
MODE_ENV = "PAGEDKV_VLLM"
STRICT_ENV = "PAGEDKV_VLLM_STRICT"
REPORT_ENV = "PAGEDKV_VLLM_REPORT"

BLOCK_SIZE = 32
"""The CPU attention backend takes multiples of 32 only."""

SHUTDOWN_TIMEOUT_S = 120.0
"""How long the engine core may take to shut down before vLLM kills it."""

QWEN3_NEXT_BLOCKS = 16
"""Blocks of 160 tokens for the Qwen3-Next, shared by its attention and Mamba groups: a request
holds up to two attention blocks and two Mamba states, so eight running requests overrun them."""

KV_CACHE_BYTES = 256 * 2**20
"""The KV space vLLM's CPU worker sizes its cache from (a tiny model's block is 64 KiB a layer
pair); `EngineSettings.num_gpu_blocks` then sets the blocks."""


@dataclass(frozen=True)
class EngineSettings:
    """What a run sets on `vllm.LLM` beyond the fixed options (see `engine_kwargs`).

    Attributes:
        max_model_len: the longest sequence (prompt and output).
        max_num_batched_tokens: the token budget of one step: a prompt longer than it is
            prefilled in chunks.
        max_num_seqs: the most requests running at once.
        num_gpu_blocks: the KV cache's blocks (vLLM's `num_gpu_blocks_override`), shared by all
            groups: fewer than the running requests need, so the scheduler preempts.
        dtype: the model's dtype (`models.TinyModel.dtype`).
        workload: how the model's requests are drawn (its prefixes whole blocks of the block
            size vLLM ends up with: a Mamba hybrid's attention blocks grow to hold a state).
    """

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_gpu_blocks: int
    dtype: str = "float32"
    workload: WorkloadShape = DEFAULT_SHAPE


ENGINE_SETTINGS: dict[str, EngineSettings] = {
    "llama": EngineSettings(
        max_model_len=256, max_num_batched_tokens=96, max_num_seqs=16, num_gpu_blocks=24
    ),
    "gemma3": EngineSettings(
        max_model_len=256, max_num_batched_tokens=96, max_num_seqs=16, num_gpu_blocks=48
    ),
    # vLLM grows the attention block to 160 tokens (a page that holds a gated-delta-net state)
    # and keys Mamba states every 160 tokens ("align"): families share one whole block, and
    # most prompts pass it, so later ones hit its state.
    "qwen3_next": EngineSettings(
        max_model_len=320,
        max_num_batched_tokens=96,
        max_num_seqs=8,
        num_gpu_blocks=QWEN3_NEXT_BLOCKS,
        dtype=MODELS["qwen3_next"].dtype,
        workload=WorkloadShape(
            block_size=160,
            prefix_blocks=(1, 1),
            suffix_tokens=(4, 64),
            long_tokens=(200, 290),
            lone_tokens=(8, 120),
        ),
    ),
}


def engine_kwargs(model_path: Path, settings: EngineSettings) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for a run."""
    return {
        "model": str(model_path),
        "skip_tokenizer_init": True,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "dtype": settings.dtype,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": settings.max_model_len,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_num_seqs": settings.max_num_seqs,
        "num_gpu_blocks_override": settings.num_gpu_blocks,
        "disable_log_stats": False,
        # The KV space in bytes: without it the CPU worker reserves 92% of the machine's memory
        # (`gpu_memory_utilization`) and refuses to start when other processes hold more than 8%.
        # The blocks are `num_gpu_blocks_override`'s; this is only the ceiling.
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }


COUNTERS = {
    "vllm:num_preemptions": "num_preemptions",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:request_success": "requests_finished",
}
"""vLLM's Prometheus counters a run records (summed over their labels), by the key it uses.
Prefix-cache queries and hits count tokens."""


@dataclass
class RunResult:
    """What one run writes (`--out`), as JSON.

    Attributes:
        outputs: each request's generated token ids, in the workload's order.
        vllm: vLLM's counters (`COUNTERS`).
        probe: the engine core's probe summary (`probe.ProbeSummary`), or empty if none came.
        plugin: the plugin's JSON summary, or empty (mode off, or the plugin wrote none).
        wall_s: seconds of `LLM.generate` alone; start_s: building `vllm.LLM`.
        cpu_s: this process's CPU seconds over `generate` (the engine core's are in `probe`).
        tokens_per_s: generated tokens per wall second of `generate`.
    """

    model: str
    mode: str
    strict: bool
    num_requests: int
    seed: int
    settings: dict[str, Any]
    workload: dict[str, int]
    outputs: list[list[int]]
    vllm: dict[str, int]
    probe: dict[str, Any] = field(default_factory=dict)
    plugin: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    start_s: float = 0.0
    cpu_s: float = 0.0
    tokens_per_s: float = 0.0


def counters(metrics: Sequence[Any]) -> dict[str, int]:
    """`COUNTERS` read from `llm.get_metrics()`: each summed over its labels, 0 if absent."""
    values = dict.fromkeys(COUNTERS.values(), 0)
    for metric in metrics:
        key = COUNTERS.get(metric.name)
        if key is not None and hasattr(metric, "value"):
            values[key] += int(metric.value)
    return values


def run(
    model: str,
    num_requests: int,
    mode: str,
    *,
    strict: bool = False,
    seed: int = 0,
    models_dir: Path = MODELS_DIR,
    settings: EngineSettings | None = None,
) -> RunResult:
    """Generate the seeded workload on vLLM's engine in `mode` (see the module's docstring).

    Sets the plugin's and the probe's environment variables in this process (the engine core
    inherits them) and leaves them set.
    """
    engine = settings or ENGINE_SETTINGS[model]
    path = ensure_model(model, models_dir)
    workload = make_workload(num_requests, seed, engine.workload)
    scratch = Path(tempfile.mkdtemp(prefix="pagedkv-vllm-run-"))
    probe_path = scratch / "probe.json"
    report_path = scratch / "plugin.json"
    os.environ[PROBE_ENV] = str(probe_path)
    os.environ[MODE_ENV] = mode
    os.environ.pop(STRICT_ENV, None)
    os.environ.pop(REPORT_ENV, None)
    if strict:
        os.environ[STRICT_ENV] = "1"
    if mode != "off":
        os.environ[REPORT_ENV] = str(report_path)

    import vllm
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = vllm.LLM(**engine_kwargs(path, engine))
    start_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in workload.prompts]
    sampling = [
        vllm.SamplingParams(
            temperature=0.0, max_tokens=count, ignore_eos=True, detokenize=False, seed=seed
        )
        for count in workload.max_tokens
    ]
    cpu_before = time.process_time()
    wall_before = time.perf_counter()
    generated = llm.generate(prompts, sampling, use_tqdm=False)
    wall_s = time.perf_counter() - wall_before
    cpu_s = time.process_time() - cpu_before
    outputs = [list(request.outputs[0].token_ids) for request in generated]
    vllm_counters = counters(llm.get_metrics())
    # vLLM's default grace is 5 s, then the engine core is killed; it shuts its worker down
    # before its scheduler, whose shutdown writes the probe's and the plugin's final summaries.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    num_tokens = sum(len(tokens) for tokens in outputs)
    return RunResult(
        model=model,
        mode=mode,
        strict=strict,
        num_requests=num_requests,
        seed=seed,
        settings=asdict(engine),
        workload=workload_counts(workload, engine),
        outputs=outputs,
        vllm=vllm_counters,
        probe=_read_json(probe_path),
        plugin=_read_json(report_path),
        wall_s=round(wall_s, 3),
        start_s=round(start_s, 3),
        cpu_s=round(cpu_s, 3),
        tokens_per_s=round(num_tokens / wall_s, 2) if wall_s > 0 else 0.0,
    )


def workload_counts(workload: Workload, settings: EngineSettings) -> dict[str, int]:
    """The workload's sizes a reader checks the run against."""
    return {
        "prompt_tokens": sum(len(prompt) for prompt in workload.prompts),
        "max_tokens": sum(workload.max_tokens),
        "in_families": sum(family is not None for family in workload.families),
        "longer_than_one_step": workload.num_longer_than(settings.max_num_batched_tokens),
    }


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


@dataclass(frozen=True)
class Comparison:
    """Two runs' outputs, request by request.

    Attributes:
        first_difference: the first request whose tokens differ, or None if every one is equal.
        detail: what differs there (or the request counts, if those differ).
    """

    num_requests: int
    first_difference: int | None
    detail: str

    @property
    def equal(self) -> bool:
        """Whether both runs generated the same tokens for every request."""
        return self.first_difference is None


def compare_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> Comparison:
    """Compare two runs' outputs token for token.

    Complexity: O(tokens).
    """
    for index, (left, right) in enumerate(zip(a, b, strict=False)):
        if list(left) != list(right):
            position = next(
                (i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y),
                min(len(left), len(right)),
            )
            return Comparison(
                len(a),
                index,
                f"request {index} differs at output token {position}: "
                f"{list(left[position : position + 8])} vs {list(right[position : position + 8])}"
                f" (lengths {len(left)} and {len(right)})",
            )
    if len(a) != len(b):
        return Comparison(len(a), min(len(a), len(b)), f"{len(a)} requests vs {len(b)}")
    return Comparison(len(a), None, f"all {len(a)} requests equal")


def compare_files(a: Path, b: Path) -> Comparison:
    """`compare_outputs` of two `--out` files."""
    left = json.loads(a.read_text())
    right = json.loads(b.read_text())
    return compare_outputs(left["outputs"], right["outputs"])


def summary_line(result: RunResult) -> str:
    """One line for a human: the run's size, time and vLLM's counters."""
    counts = result.vllm
    hit_rate = counts["prefix_cache_hits"] / max(1, counts["prefix_cache_queries"])
    probe = result.probe
    return (
        f"{result.model} {result.mode}{' strict' if result.strict else ''}: "
        f"{result.num_requests} requests in {result.wall_s:.1f} s "
        f"(+{result.start_s:.1f} s start), {result.tokens_per_s:.0f} tokens/s; "
        f"preemptions {counts['num_preemptions']}, prefix-cache hits "
        f"{counts['prefix_cache_hits']}/{counts['prefix_cache_queries']} tokens "
        f"({hit_rate:.0%}), chunked prefills {probe.get('chunked_prefill_chunks', '?')} "
        f"in {len(probe.get('chunked_requests', []))} requests, "
        f"steps {probe.get('steps', '?')}, manager {probe.get('manager_class', '?')}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring). Returns the exit status: with
    `--compare`, 1 if the outputs differ."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.harness.vllm_engine.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--mode", choices=MODES, default="off")
    parser.add_argument("--strict", action="store_true", help="PAGEDKV_VLLM_STRICT=1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"))
    args = parser.parse_args(argv)
    if args.compare is not None:
        comparison = compare_files(*args.compare)
        print(comparison.detail)
        return 0 if comparison.equal else 1
    result = run(
        args.model,
        args.requests,
        args.mode,
        strict=args.strict,
        seed=args.seed,
        models_dir=args.models_dir,
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(result), indent=1) + "\n")
    print(summary_line(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
