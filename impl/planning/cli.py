"""Plan a model's KV cache: page size, blocks, token capacity and concurrency for a memory budget.

The model's shape comes from a local Hugging Face config.json (read as transformers reads it),
from flags, or both (flags win). The budget is given per GPU in bytes, or as a GPU's memory, the
share the model may use, its weights (split over --tensor-parallel-size GPUs) and the other memory
each GPU needs. Dtypes and the tensor-parallel split are vLLM 0.8.5's; the plan is what
`get_kv_cache_config` builds on each GPU. When one request of max_model_len does not fit, the
error says the largest that does.

Exit status: 0 with a plan; 1 when the model does not fit; 2 on bad arguments. With --json,
statuses 0 and 1 print one JSON document on stdout (schema "pagedkv-plan/1", see the README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from pagedkv.planning.available_memory import GPUMemoryBudget, NoKVCacheMemoryError
from pagedkv.planning.byte_sizes import parse_size
from pagedkv.planning.hf_config import HFModelConfig, read_hf_config
from pagedkv.planning.plan import (
    PLAN_JSON_SCHEMA,
    ModelShape,
    RequestDoesNotFitError,
    make_plan,
    resolve_dtypes,
)
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pagedkv plan` flags."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model (from --config, flags, or both: flags win)")
    model.add_argument("--config", type=Path, metavar="PATH", help="a local HF config.json")
    model.add_argument("--num-layers", type=int, metavar="N", help="attention layers")
    model.add_argument("--num-kv-heads", type=int, metavar="N", help="KV heads per layer, all GPUs")
    model.add_argument("--head-size", type=int, metavar="N", help="elements per head")
    model.add_argument(
        "--dtype",
        default="auto",
        help="the model's dtype: auto (config.json's; float32 runs in float16), float16, "
        "bfloat16, float32 (default: auto)",
    )
    model.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help="auto (the model's dtype), fp8, fp8_e4m3 or fp8_e5m2 (default: auto)",
    )
    model.add_argument("--mla", action="store_true", help="one latent vector per token (MLA)")
    model.add_argument("--sliding-window", type=int, metavar="W", help="window in tokens")
    model.add_argument(
        "--sliding-window-layers",
        type=int,
        metavar="N",
        help="layers that use the window (default: config.json's layer_types, else the "
        "layout transformers builds for its model type, else all)",
    )
    model.add_argument(
        "--no-sliding-window", action="store_true", help="ignore config.json's window"
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="GPUs sharing every layer; budgets and blocks are per GPU (default: 1)",
    )
    memory = parser.add_argument_group("memory (a budget, or a GPU's memory; per GPU)")
    memory.add_argument(
        "--memory-budget", type=_size, metavar="SIZE", help="bytes for the KV cache, e.g. 40GiB"
    )
    memory.add_argument("--gpu-memory", type=_size, metavar="SIZE", help="e.g. 80GiB")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of --gpu-memory the model may use (default: 0.9)",
    )
    memory.add_argument(
        "--weights",
        type=_size,
        metavar="SIZE",
        help="the model's weights over all GPUs; each holds 1/N of them (default: 0)",
    )
    memory.add_argument(
        "--non-kv-memory",
        type=_size,
        metavar="SIZE",
        help="each GPU's peak memory besides the KV cache and --weights: activations, CUDA "
        "context (default: 0)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="tokens per block (default: 16)"
    )
    limits.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="longest request (default: config.json's max_position_embeddings)",
    )
    limits.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="most tokens per step; sliding-window layers need it (default: max_model_len)",
    )
    limits.add_argument(
        "--num-gpu-blocks-override", type=int, metavar="N", help="use N blocks, whatever fits"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document (schema pagedkv-plan/1)"
    )


def _load_config(path: Path, args: argparse.Namespace) -> HFModelConfig:
    try:
        loaded = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"cannot read {path}: {error}") from None
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(f"{path}: not a JSON object")
    return read_hf_config(loaded, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)


def _shape_from_flags(args: argparse.Namespace) -> ModelShape:
    missing = [
        flag
        for flag, value in (
            ("--num-layers", args.num_layers),
            ("--num-kv-heads", args.num_kv_heads),
            ("--head-size", args.head_size),
            ("--dtype", None if args.dtype.strip().lower() == "auto" else args.dtype),
        )
        if value is None
    ]
    if missing:
        raise InvalidArgumentError(
            f"give --config or {', '.join(missing)} (without a config.json, --dtype cannot be auto)"
        )
    return ModelShape(
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype=resolve_dtypes(None, args.dtype, args.kv_cache_dtype).kv_cache_dtype,
    )


def _shape_from_args(args: argparse.Namespace) -> tuple[ModelShape, int | None, tuple[str, ...]]:
    """The model shape, config.json's max_position_embeddings (None without one), the notes."""
    notes: tuple[str | None, ...] = ()
    if args.config is not None:
        read = _load_config(args.config, args)
        base, positions = read.shape, read.max_position_embeddings
        window_flags = (args.sliding_window, args.sliding_window_layers, args.num_layers)
        layers_changed = args.no_sliding_window or any(flag is not None for flag in window_flags)
        notes = (read.dtype_note,) if layers_changed else (read.layer_types_note, read.dtype_note)
    else:
        base, positions = _shape_from_flags(args), None
    num_layers = base.num_layers if args.num_layers is None else args.num_layers
    window = base.sliding_window if args.sliding_window is None else args.sliding_window
    if args.no_sliding_window:
        window = None
    if window is None:
        num_window_layers = 0
    elif args.sliding_window_layers is not None:
        num_window_layers = args.sliding_window_layers
    elif args.sliding_window is None and base.num_sliding_window_layers < base.num_layers:
        num_window_layers = min(base.num_sliding_window_layers, num_layers)  # config's mix
    else:
        num_window_layers = num_layers
    shape = ModelShape(
        num_layers=num_layers,
        num_kv_heads=base.num_kv_heads if args.num_kv_heads is None else args.num_kv_heads,
        head_size=base.head_size if args.head_size is None else args.head_size,
        dtype=base.dtype,
        use_mla=base.use_mla or args.mla,
        sliding_window=window,
        num_sliding_window_layers=num_window_layers,
        num_attention_heads=base.num_attention_heads,
    )
    return shape, positions, tuple(note for note in notes if note)


def _budget_from_args(args: argparse.Namespace) -> tuple[int, GPUMemoryBudget | None]:
    """One GPU's KV budget, and the GPU's numbers when it was given as a GPU."""
    if (args.memory_budget is None) == (args.gpu_memory is None):
        raise InvalidArgumentError("give exactly one of --memory-budget and --gpu-memory")
    if args.memory_budget is not None:
        if args.weights is not None or args.non_kv_memory is not None:
            raise InvalidArgumentError(
                "--weights and --non-kv-memory go with --gpu-memory; --memory-budget is the KV "
                "cache's share already"
            )
        return int(args.memory_budget), None
    gpu = GPUMemoryBudget(
        gpu_memory_bytes=args.gpu_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weights_bytes=args.weights or 0,
        other_bytes=args.non_kv_memory or 0,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return gpu.require_kv_cache_bytes(), gpu


def error_json(error: KVCacheConfigError) -> dict[str, Any]:
    """The `error` object of a --json document whose plan does not fit."""
    if isinstance(error, RequestDoesNotFitError):
        return {
            "kind": "request_does_not_fit",
            "message": str(error),
            "max_model_len": error.max_model_len,
            "needed_bytes": error.needed_bytes,
            "available_bytes": error.available_bytes,
            "largest_max_model_len": error.largest_max_model_len,
            "planned_as_full_attention": error.planned_as_full_attention,
        }
    if isinstance(error, NoKVCacheMemoryError):
        return {"kind": "no_kv_cache_memory", "message": str(error), **error.budget.as_json()}
    return {"kind": "kv_cache_config", "message": str(error)}


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the plan for `args`, or the reason there is none. Returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    gpu: GPUMemoryBudget | None = None
    try:
        shape, positions, notes = _shape_from_args(args)
        shape.num_kv_heads_per_gpu(args.tensor_parallel_size)  # refuse a bad split first
        max_model_len = args.max_model_len if args.max_model_len is not None else positions
        if max_model_len is None:
            raise InvalidArgumentError("give --max-model-len (no config.json to take it from)")
        budget, gpu = _budget_from_args(args)
        plan = make_plan(
            shape,
            budget,
            block_size=args.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks_override=args.num_gpu_blocks_override,
            tensor_parallel_size=args.tensor_parallel_size,
            notes=notes,
        )
    except InvalidArgumentError as error:
        print(f"pagedkv plan: error: {error}", file=err)
        return 2
    except KVCacheConfigError as error:
        print(f"pagedkv plan: does not fit: {error}", file=err)
        if args.json:
            memory = None if gpu is None else gpu.as_json()
            if isinstance(error, NoKVCacheMemoryError):
                memory = error.budget.as_json()
            document = {
                "schema": PLAN_JSON_SCHEMA,
                "fits": False,
                "memory": memory,
                "error": error_json(error),
            }
            print(json.dumps(document, indent=2), file=out)
        return 1
    if args.json:
        document = {**plan.as_json(), "memory": None if gpu is None else gpu.as_json()}
        print(json.dumps(document, indent=2), file=out)
    else:
        print(plan.format(), file=out)
    return 0
