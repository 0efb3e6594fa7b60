"""`pagedkv run`: serve a workload with the engine, report, and optionally prove it dense-equal.

    pagedkv run                                   # synthetic Llama, synthetic chat trace, CPU
    pagedkv run --check-dense --plot run.png      # + transformers' generate for every request
    pagedkv run --prompts prompts.jsonl --model ./my-llama --device cuda
    pagedkv run --preset gemma3-3group --check-dense  # a hybrid model: 3 KV cache groups

Exit status: 0 done (and, with --check-dense, every request equal); 1 the dense check failed;
2 bad arguments or input, a missing dependency, or no device. Arguments are checked, and errors
name the option, before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.engine.dependencies import MissingDependencyError, require
from pagedkv.engine.presets import PRESETS, max_positions
from pagedkv.vocab.errors import InvalidArgumentError, PagedKVError

if TYPE_CHECKING:
    from pagedkv.engine.dense_check import DenseCheck
    from pagedkv.engine.engine_request import EngineRequest
    from pagedkv.engine.llm_engine import RunResult
    from pagedkv.events.metrics import KVCacheMetrics, MetricsServer

DTYPES = ("float32", "float16", "bfloat16")
SMALL_MODEL_PARAMETERS = 100_000_000
"""On CPU, a model with fewer parameters runs on one torch thread unless --threads says
otherwise: its matrices are too small to split, and on a busy small machine each extra thread
waits for a core at every parallel region (19x the CPU time of one thread on the default run)."""
MINIMUMS = {
    "requests": 1,
    "prompt_tokens": 8,
    "max_tokens": 1,
    "num_blocks": 2,
    "block_size": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "max_model_len": 1,
    "runtime_checks": 0,
    "threads": 1,
    "metrics_port": 0,
    "prefix_cache_retention_interval": 0,
}
"""Each integer option's least value (None, where an option may be left out, is not checked)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--requests", type=int, default=48, metavar="N", help="synthetic chat requests (48)"
    )
    workload.add_argument(
        "--prompts", type=Path, metavar="FILE.jsonl", help="requests from a JSONL file instead"
    )
    workload.add_argument(
        "--prompt-tokens",
        type=int,
        default=384,
        metavar="N",
        help="synthetic prompts: system prompts of N/8 to 5N/12 tokens, user messages of N/48 "
        "to N/6, follow-up turns while shorter than N (384)",
    )
    workload.add_argument(
        "--max-tokens",
        type=int,
        default=48,
        metavar="N",
        help="most tokens a request generates (synthetic: drawn from [N/4, N]; JSONL: the "
        "default for lines without max_tokens) (48)",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        type=Path,
        metavar="PATH",
        help="a local Llama, Gemma-3 or Llama-4 text checkpoint",
    )
    model.add_argument(
        "--preset",
        default="small",
        choices=PRESETS,
        help="the synthetic model without --model: tiny or small (Llama); gemma3-2group or "
        "gemma3-3group (Gemma-3, sliding-window and full-attention layers: a hybrid KV cache "
        "of 2 or 3 groups); llama4-2group (Llama-4, chunked local and full attention)",
    )
    model.add_argument("--dtype", choices=DTYPES, default="float32")
    model.add_argument(
        "--seed", type=int, default=0, help="seeds the synthetic weights and trace (0)"
    )
    pool = parser.add_argument_group("KV pool and scheduling")
    pool.add_argument("--num-blocks", type=int, default=64, help="blocks in the pool (64)")
    pool.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    pool.add_argument("--max-num-seqs", type=int, default=16, help="running requests (16)")
    pool.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="token budget per step (512)"
    )
    pool.add_argument(
        "--max-model-len", type=int, help="longest request (default: the model's positions)"
    )
    pool.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    pool.add_argument(
        "--no-reserve-full-sequence",
        action="store_true",
        help="admit a waiting request as soon as its first chunk fits (default: only once its "
        "whole prompt will, vLLM 0.33's full-sequence gate, scheduler_reserve_full_isl)",
    )
    pool.add_argument(
        "--prefix-cache-retention-interval",
        type=int,
        metavar="N",
        help="cache only the sliding-window blocks a later hit can use: 0 (vLLM 0.33's engine "
        "default) at each prompt's replay boundary, N > 0 (a multiple of the block size) also "
        "once per N tokens (default: every full block)",
    )
    execution = parser.add_argument_group("execution")
    execution.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    execution.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for torch (default on cpu: 1 for a model under 100M parameters, "
        "such as the synthetic ones, else torch's choice)",
    )
    execution.add_argument(
        "--executor",
        choices=("auto", "reference", "cupy", "cupy-dry-run"),
        default="auto",
        help="auto: the CuPy kernels on cuda, the torch reference on cpu",
    )
    checks = parser.add_argument_group("checks and output")
    checks.add_argument(
        "--check-dense",
        action="store_true",
        help="compare every request with transformers' dense generate (exit 1 if any differs)",
    )
    checks.add_argument(
        "--runtime-checks",
        type=int,
        default=0,
        metavar="N",
        help="check the manager's and scheduler's invariants every N calls/steps (0: off)",
    )
    checks.add_argument("--plot", type=Path, metavar="OUT.png", help="write the run's figure")
    checks.add_argument("--json", type=Path, metavar="OUT.json", help="write the run's numbers")
    served = parser.add_argument_group("metrics (the metrics extra: prometheus_client)")
    served.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics under vLLM's names at http://HOST:PORT/metrics during "
        "the run (0: any free port)",
    )
    served.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port listens on (127.0.0.1; 0.0.0.0 for every interface)",
    )
    served.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the metrics' model_name label (default: --model as given, or synthetic-PRESET)",
    )
    checks.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Every check that needs no model: done before torch is imported.

    Raises:
        InvalidArgumentError: names the option (`--block-size must be ...`).
    """
    for name, minimum in MINIMUMS.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise InvalidArgumentError(f"{_option(name)} must be >= {minimum}, got {value}")
    if args.block_size & (args.block_size - 1):
        raise InvalidArgumentError(
            f"--block-size must be a power of two (the kernels shift by it), got {args.block_size}"
        )
    if args.metrics_port is not None and args.metrics_port > 65535:
        raise InvalidArgumentError(f"--metrics-port must be <= 65535, got {args.metrics_port}")
    if args.executor == "cupy" and args.device != "cuda":
        raise InvalidArgumentError("--executor cupy launches CUDA kernels: add --device cuda")
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise InvalidArgumentError(
                f"--model {args.model}: no config.json there (a local directory)"
            )
    elif args.max_model_len is not None and args.max_model_len > max_positions(args.preset):
        raise InvalidArgumentError(
            f"--max-model-len {args.max_model_len} exceeds the {args.preset!r} model's "
            f"{max_positions(args.preset)} positions"
        )
    if args.prompts is not None and not args.prompts.is_file():
        raise InvalidArgumentError(f"--prompts {args.prompts}: no such file")
    for name in ("plot", "json"):
        path = getattr(args, name)
        if path is not None and not path.resolve().parent.is_dir():
            raise InvalidArgumentError(
                f"--{name} {path}: the directory {path.resolve().parent} does not exist"
            )
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InvalidArgumentError("--served-model-name must not be empty")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `pagedkv run` with parsed `args`; return the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        check_arguments(args)
        require("torch", "transformers", *(["matplotlib"] if args.plot else []))
        if args.metrics_port is not None:
            require("prometheus_client", purpose="pagedkv run --metrics-port", extra="metrics")
    except MissingDependencyError as error:
        print(f"pagedkv run: {error}", file=err)
        return 2
    except PagedKVError as error:
        print(f"pagedkv run: error: {error}", file=err)
        return 2
    # Threads that wait for a busy core sleep instead of spinning on it (libgomp reads this
    # when torch is first imported; a user's own setting wins).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    metrics, server = None, None
    try:
        if args.metrics_port is not None:
            metrics, server = _serve_metrics(args)
        session = _Session(args, err, metrics)
        result = session.serve()
        check = session.check_dense(result) if args.check_dense else None
    except PagedKVError as error:
        print(f"pagedkv run: error: {error}", file=err)
        return 2
    finally:
        if server is not None:
            server.close()
    from pagedkv.engine.report import format_report

    preempted = sum(1 for item in result.requests if item.num_preemptions)
    print(
        format_report(
            session.description,
            session.config,
            result.summary,
            num_preempted_requests=preempted,
            check=check,
        ),
        file=out,
        flush=True,
    )
    if server is not None and metrics is not None:
        name, engine = metrics.labels
        print(
            f"  {'metrics':<22} served at {server.url} during the run "
            f"(model_name={name!r}, engine={engine!r})",
            file=out,
        )
    if args.plot:
        from pagedkv.engine.plot import plot_steps

        plot_steps(result.steps, args.plot, title=f"pagedkv run — {session.description.workload}")
        print(f"  figure written to {args.plot}", file=out)
    if args.json:
        _write_json(args.json, session, result, check)
    return 0 if check is None or check.passed else 1


def served_model_name(args: argparse.Namespace) -> str:
    """The metrics' `model_name`: --served-model-name, else --model as given (vLLM's default),
    else `synthetic-PRESET`."""
    if args.served_model_name is not None:
        return str(args.served_model_name)
    return str(args.model) if args.model is not None else f"synthetic-{args.preset}"


def _serve_metrics(args: argparse.Namespace) -> tuple[KVCacheMetrics, MetricsServer]:
    """The run's exporter (prometheus_client's default registry) and its HTTP endpoint."""
    from pagedkv.events.metrics import KVCacheMetrics, serve_metrics

    metrics = KVCacheMetrics(model_name=served_model_name(args), engine=0)
    try:
        server = serve_metrics(args.metrics_port, args.metrics_host)
    except InvalidArgumentError as error:
        metrics.close()
        raise InvalidArgumentError(
            f"--metrics-port {args.metrics_port} --metrics-host {args.metrics_host}: {error}"
        ) from None
    return metrics, server


class _Session:
    """One invocation: the model, the config, the requests, the engine."""

    def __init__(
        self, args: argparse.Namespace, err: TextIO, metrics: KVCacheMetrics | None = None
    ) -> None:
        import torch

        from pagedkv.engine.config import EngineConfig
        from pagedkv.engine.report import RunDescription

        self.args = args
        self.err = err
        self.metrics = metrics
        self.progress = err.isatty() if args.progress is None else args.progress
        executor = args.executor
        if executor == "auto":
            executor = "cupy" if args.device == "cuda" else "reference"
        if args.device == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError("--device cuda: torch sees no CUDA device")
        self.executor = executor
        self.model, model_text = self._load_model(getattr(torch, args.dtype))
        model_config = self.model.config
        threads = args.threads
        if threads is None and args.device == "cpu":
            num_parameters = sum(weight.numel() for weight in self.model.parameters())
            threads = 1 if num_parameters < SMALL_MODEL_PARAMETERS else None
        if threads is not None:
            torch.set_num_threads(threads)
        positions = model_config.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > positions:
            raise InvalidArgumentError(
                f"--max-model-len {args.max_model_len} exceeds the model's "
                f"max_position_embeddings {positions}"
            )
        self.config = EngineConfig(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len or model_config.max_position_embeddings,
            enable_prefix_caching=not args.no_prefix_caching,
            runtime_checks=args.runtime_checks,
            prefix_cache_retention_interval=args.prefix_cache_retention_interval,
            reserve_full_sequence=not args.no_reserve_full_sequence,
        )
        self.requests, workload = self._load_requests(model_config.vocab_size)
        self.description = RunDescription(
            model=model_text,
            device=args.device,
            executor=executor,
            workload=workload,
            threads=torch.get_num_threads() if args.device == "cpu" else None,
        )

    def _load_model(self, dtype: Any) -> tuple[Any, str]:
        from pagedkv.engine.model import layer_attention, load_local_model, synthetic_model

        args = self.args
        device = args.device
        if args.model is not None:
            model = load_local_model(args.model, dtype=dtype, device=device)
        else:
            model = synthetic_model(args.preset, seed=args.seed, dtype=dtype, device=device)
        config = model.config
        kind = {"gemma3_text": "Gemma-3", "llama4_text": "Llama-4"}.get(config.model_type, "Llama")
        origin = (
            f"{kind} from {args.model}"
            if args.model is not None
            else f"synthetic {kind} {args.preset!r} (seeded random weights, seed {args.seed})"
        )
        attention = layer_attention(model)
        sliding = sorted({a.sliding_window for a in attention if a.sliding_window})
        chunks = sorted({a.attention_chunk_size for a in attention if a.attention_chunk_size})
        num_full = sum(1 for a in attention if not a.sliding_window and not a.attention_chunk_size)
        kinds = []
        if sliding:
            count = sum(1 for a in attention if a.sliding_window)
            kinds.append(f"{count} sliding window {'/'.join(map(str, sliding))}")
        if chunks:
            count = sum(1 for a in attention if a.attention_chunk_size)
            kinds.append(f"{count} chunked local attention {'/'.join(map(str, chunks))}")
        layers = f"{config.num_hidden_layers} layers"
        if kinds:
            layers += f" ({', '.join(kinds)}, {num_full} full attention)"
        head_size = model.model.layers[0].self_attn.head_dim
        text = (
            f"{origin}: {layers}, {config.num_attention_heads} query / "
            f"{config.num_key_value_heads} KV heads x {head_size}, vocab {config.vocab_size:,}, "
            f"{args.dtype}"
        )
        return model, text

    def _load_requests(self, vocab_size: int) -> tuple[list[EngineRequest], str]:
        from pagedkv.engine.model import stop_token_ids
        from pagedkv.engine.workload import (
            ChatTraceConfig,
            load_prompts_jsonl,
            synthetic_chat_trace,
        )

        args = self.args
        stops = stop_token_ids(self.model)
        if args.prompts is not None:
            requests = load_prompts_jsonl(
                args.prompts,
                vocab_size=vocab_size,
                default_max_tokens=args.max_tokens,
                stop_token_ids=stops,
                tokenize=self._tokenizer(),
            )
            return requests, f"{len(requests)} requests from {args.prompts}"
        trace = ChatTraceConfig.scaled(
            num_requests=args.requests,
            max_prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        requests = synthetic_chat_trace(trace, vocab_size=vocab_size, stop_token_ids=stops)
        return requests, (
            f"{len(requests)} requests, synthetic chat trace "
            f"({trace.num_system_prompts} shared system prompts, follow-up turns, seed {args.seed})"
        )

    def _tokenizer(self) -> Any:
        """Text -> ids with the checkpoint's tokenizer, or None (no --model, or none there)."""
        if self.args.model is None:
            return None
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.args.model, local_files_only=True)
        except (OSError, ValueError):
            return None

        def tokenize(text: str) -> list[int]:
            return list(tokenizer(text)["input_ids"])

        return tokenize

    def serve(self) -> RunResult:
        from pagedkv.engine.llm_engine import LLMEngine
        from pagedkv.progress import ProgressBar

        engine = LLMEngine(
            self.model,
            self.config,
            executor=self.executor,
            keep_logits=self.args.check_dense,
            metrics=self.metrics,
        )
        if engine.layout.num_groups > 1:
            self.description = replace(self.description, kv_cache_groups=engine.layout.describe())
        if any(window is not None for window in engine.layout.group_windows):
            from pagedkv.engine.report import retention_text

            interval = engine.manager.kv_cache_config.prefix_cache_retention_interval
            self.description = replace(self.description, retention=retention_text(interval))
        for item in self.requests:
            engine.add_request(item)  # every request is checked before the first step
        bar = ProgressBar(
            len(self.requests), unit="req", label="serving", stream=self.err, enabled=self.progress
        )
        with bar:

            def on_step(record: Any, finished: list[EngineRequest]) -> None:
                bar.advance(
                    len(finished),
                    f"step {record.step}, {record.num_running} running, "
                    f"{record.num_waiting} waiting, pool {record.pool_usage:.0%}",
                )

            return engine.run(on_step=on_step)

    def check_dense(self, result: RunResult) -> DenseCheck:
        from pagedkv.engine.dense_check import compare_with_dense
        from pagedkv.progress import ProgressBar

        with ProgressBar(
            len(result.requests),
            unit="req",
            label="dense check",
            stream=self.err,
            enabled=self.progress,
        ) as bar:
            return compare_with_dense(
                self.model, result.requests, result.logits, on_request=lambda _: bar.advance()
            )


def _write_json(path: Path, session: _Session, result: RunResult, check: DenseCheck | None) -> None:
    summary = result.summary
    document = {
        "description": asdict(session.description),
        "config": asdict(session.config),
        "summary": {
            **asdict(summary),
            "prefix_hit_rate": summary.prefix_hit_rate,
            "generated_tokens_per_second": summary.generated_tokens_per_second,
            "computed_tokens_per_second": summary.computed_tokens_per_second,
            "attention_share": summary.attention_share,
        },
        "requests": [
            {
                "id": item.request_id,
                "num_prompt_tokens": len(item.prompt_token_ids),
                "num_output_tokens": len(item.output_token_ids),
                "num_preemptions": item.num_preemptions,
                "ttft": item.ttft,
                "tpot": item.tpot,
            }
            for item in result.requests
        ],
        "steps": [asdict(record) for record in result.steps],
        "dense_check": None
        if check is None
        else {
            "passed": check.passed,
            "atol": check.atol,
            "noise_floor": check.noise_floor,
            "max_logit_diff": check.max_logit_diff,
            "min_margin": check.min_margin,
            "failures": [c.request_id for c in check.failures],
        },
    }
    path.write_text(json.dumps(document, indent=1) + "\n")
