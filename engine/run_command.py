"""`pagedkv run`: serve a workload with the engine, report, and optionally prove it dense-equal.

    pagedkv run                                   # synthetic Llama, synthetic chat trace, CPU
    pagedkv run --check-dense --plot run.png      # + transformers' generate for every request
    pagedkv run --prompts prompts.jsonl --model ./my-llama --device cuda

Exit status: 0 done (and, with --check-dense, every request equal); 1 the dense check failed;
2 bad arguments or input, a missing dependency, or no device.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.engine.dependencies import MissingDependencyError, require
from pagedkv.vocab.errors import PagedKVError

if TYPE_CHECKING:
    from pagedkv.engine.dense_check import DenseCheck
    from pagedkv.engine.engine_request import EngineRequest
    from pagedkv.engine.llm_engine import RunResult

DTYPES = ("float32", "float16", "bfloat16")


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
    model.add_argument("--model", type=Path, metavar="PATH", help="a local Llama checkpoint")
    model.add_argument(
        "--preset", default="small", help="the synthetic Llama without --model: tiny or small"
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
    execution = parser.add_argument_group("execution")
    execution.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    execution.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for torch (default: torch's choice; small models run faster on 1)",
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
    checks.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `pagedkv run` with parsed `args`; return the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        require("torch", "transformers", *(["matplotlib"] if args.plot else []))
    except MissingDependencyError as error:
        print(f"pagedkv run: {error}", file=err)
        return 2
    try:
        session = _Session(args, err)
        result = session.serve()
        check = session.check_dense(result) if args.check_dense else None
    except PagedKVError as error:
        print(f"pagedkv run: error: {error}", file=err)
        return 2
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
    if args.plot:
        from pagedkv.engine.plot import plot_steps

        plot_steps(result.steps, args.plot, title=f"pagedkv run — {session.description.workload}")
        print(f"  figure written to {args.plot}", file=out)
    if args.json:
        _write_json(args.json, session, result, check)
    return 0 if check is None or check.passed else 1


class _Session:
    """One invocation: the model, the config, the requests, the engine."""

    def __init__(self, args: argparse.Namespace, err: TextIO) -> None:
        import torch

        from pagedkv.engine.config import EngineConfig
        from pagedkv.engine.report import RunDescription
        from pagedkv.vocab.errors import InvalidArgumentError

        self.args = args
        self.err = err
        self.progress = err.isatty() if args.progress is None else args.progress
        executor = args.executor
        if executor == "auto":
            executor = "cupy" if args.device == "cuda" else "reference"
        if args.device == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError("--device cuda: torch sees no CUDA device")
        if executor == "cupy" and args.device != "cuda":
            raise InvalidArgumentError("--executor cupy launches CUDA kernels: add --device cuda")
        self.executor = executor
        if args.threads is not None:
            if args.threads < 1:
                raise InvalidArgumentError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        self.model, model_text = self._load_model(getattr(torch, args.dtype))
        model_config = self.model.config
        self.config = EngineConfig(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len or model_config.max_position_embeddings,
            enable_prefix_caching=not args.no_prefix_caching,
            runtime_checks=args.runtime_checks,
        )
        self.requests, workload = self._load_requests(model_config.vocab_size)
        self.description = RunDescription(
            model=model_text, device=args.device, executor=executor, workload=workload
        )

    def _load_model(self, dtype: Any) -> tuple[Any, str]:
        from pagedkv.engine.model import load_local_model, synthetic_llama

        args = self.args
        device = args.device
        if args.model is not None:
            model = load_local_model(args.model, dtype=dtype, device=device)
            origin = f"Llama from {args.model}"
        else:
            model = synthetic_llama(args.preset, seed=args.seed, dtype=dtype, device=device)
            origin = f"synthetic Llama {args.preset!r} (seeded random weights, seed {args.seed})"
        config = model.config
        head_size = model.model.layers[0].self_attn.head_dim
        text = (
            f"{origin}: {config.num_hidden_layers} layers, {config.num_attention_heads} query / "
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
        from pagedkv.vocab.errors import InvalidArgumentError

        args = self.args
        stops = stop_token_ids(self.model)
        if args.max_tokens < 1:
            raise InvalidArgumentError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.prompts is not None:
            requests = load_prompts_jsonl(
                args.prompts,
                vocab_size=vocab_size,
                default_max_tokens=args.max_tokens,
                stop_token_ids=stops,
                tokenize=self._tokenizer(),
            )
            return requests, f"{len(requests)} requests from {args.prompts}"
        if args.requests < 1:
            raise InvalidArgumentError(f"--requests must be >= 1, got {args.requests}")
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
        )
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
