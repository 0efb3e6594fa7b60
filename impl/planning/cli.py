"""Plan a model's KV cache: page size, blocks, token capacity and concurrency for a memory budget.

The model's shape comes from a local Hugging Face config.json or model directory (read as
transformers reads it), from flags, or both (flags win). The budget is given per GPU in bytes,
or as a GPU's memory, the share the model may use, its weights (split over
--tensor-parallel-size GPUs; estimated from config.json when --weights is not given) and the
other memory each GPU needs. Dtypes and the tensor-parallel split are vLLM 0.8.5's; the plan is
what `get_kv_cache_config` builds on each GPU. A model with window or chunked layers also gets
vLLM 0.33's hybrid layout on the same budget. A Mamba hybrid (`pagedkv.planning.hf_mamba`) is
planned as vLLM 0.33 plans it (`pagedkv.planning.mamba_plan`); a config.json with layers pagedkv
does not plan is refused, naming them. When one request of max_model_len does not fit, the
error says the largest that does.

Exit status: 0 with a plan; 1 when the model does not fit (its KV cache, or its weights and the
other memory leave nothing for one); 2 on bad arguments, each message naming the option. With
--json, statuses 0 and 1 print one JSON document on stdout (schema "pagedkv-plan/1", see
docs/planning.md). Nothing here imports torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pagedkv.planning.available_memory import GPUMemoryBudget, NoKVCacheMemoryError
from pagedkv.planning.byte_sizes import GiB, parse_size
from pagedkv.planning.hf_config import read_hf_config, text_config
from pagedkv.planning.hf_mamba import (
    mamba_model_type,
    read_mamba_hybrid_config,
    resolve_dtypes_0_33,
)
from pagedkv.planning.hybrid_layout import SERVE_MAX_NUM_BATCHED_TOKENS
from pagedkv.planning.mamba_model import MAMBA_DTYPES, MambaHybridModel
from pagedkv.planning.mamba_plan import GDN_PREFILL_BACKENDS, MambaPlan, make_mamba_plan
from pagedkv.planning.plan import (
    PLAN_JSON_SCHEMA,
    KVCachePlan,
    ModelShape,
    RequestDoesNotFitError,
    make_plan,
    resolve_dtypes,
)
from pagedkv.planning.weights import WeightsEstimate, estimate_weights
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError

BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
"""vLLM 0.8.5's `--block-size` choices (`BlockSize`)."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= `minimum` (argparse names the option in its message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _share(text: str) -> float:
    """An argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pagedkv plan` flags."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model (from --config, flags, or both: flags win)")
    model.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="a local HF config.json, or a model directory holding one",
    )
    model.add_argument("--num-layers", type=_count(1), metavar="N", help="attention layers")
    model.add_argument(
        "--num-kv-heads", type=_count(1), metavar="N", help="KV heads per layer, all GPUs"
    )
    model.add_argument("--head-size", type=_count(1), metavar="N", help="elements per head")
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
    model.add_argument("--sliding-window", type=_count(1), metavar="W", help="window in tokens")
    model.add_argument(
        "--sliding-window-layers",
        type=_count(0),
        metavar="N",
        help="layers that use the window (default: config.json's layer_types, else the "
        "layout transformers builds for its model type, else all)",
    )
    model.add_argument(
        "--no-sliding-window", action="store_true", help="ignore config.json's window"
    )
    mamba = parser.add_argument_group(
        "Mamba hybrids (Jamba, Falcon-H1, Nemotron-H, Granite-4.0-H, Qwen3-Next: planned as "
        "vLLM 0.33 plans them)"
    )
    mamba.add_argument(
        "--mamba-cache-dtype",
        choices=MAMBA_DTYPES,
        metavar="DTYPE",
        help="the recurrent states' dtype: auto (the model's), float32, float16, bfloat16",
    )
    mamba.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=MAMBA_DTYPES,
        metavar="DTYPE",
        help="the ssm state's own dtype (default auto: --mamba-cache-dtype's; Nemotron-H: "
        "config.json's mamba_ssm_cache_dtype)",
    )
    mamba.add_argument(
        "--no-enable-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="vLLM's prefix caching off: one state per recurrent layer and request, not 2 or 3",
    )
    mamba.add_argument(
        "--gdn-prefill-backend",
        choices=GDN_PREFILL_BACKENDS,
        metavar="NAME",
        help="Qwen3-Next's linear-attention prefill: flashinfer (Hopper, vLLM 0.33's choice "
        "there; the default) or triton",
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=_count(1),
        default=1,
        metavar="N",
        help="GPUs sharing every layer; budgets and blocks are per GPU (default: 1)",
    )
    memory = parser.add_argument_group(
        "memory (a budget, or a GPU's memory; per GPU; sizes take a unit: 80GiB, 80GB, 80G)"
    )
    memory.add_argument(
        "--memory-budget", type=_size, metavar="SIZE", help="bytes for the KV cache, e.g. 40GiB"
    )
    memory.add_argument("--gpu-memory", type=_size, metavar="SIZE", help="e.g. 80GiB")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=_share,
        default=0.9,
        metavar="F",
        help="share of --gpu-memory the model may use (default: 0.9)",
    )
    memory.add_argument(
        "--weights",
        type=_size,
        metavar="SIZE",
        help="the model's weights over all GPUs; each holds 1/N of them (default: estimated "
        "from --config: parameters x dtype, per GPU)",
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
        "--block-size",
        type=int,
        choices=BLOCK_SIZES,
        default=16,
        metavar="N",
        help=f"tokens per block: {', '.join(map(str, BLOCK_SIZES))} (default: 16)",
    )
    limits.add_argument(
        "--max-model-len",
        type=_count(1),
        metavar="N",
        help="longest request (default: config.json's max_position_embeddings)",
    )
    limits.add_argument(
        "--max-num-batched-tokens",
        type=_count(1),
        metavar="N",
        help="most tokens per step; window layers need it (default: max_model_len; for vLLM "
        f"0.33's hybrid layout, its vllm serve default {SERVE_MAX_NUM_BATCHED_TOKENS:,})",
    )
    limits.add_argument(
        "--num-gpu-blocks-override",
        type=_count(1),
        metavar="N",
        help="use N blocks, whatever fits",
    )
    limits.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="vLLM 0.33's hybrid layout with one batch in flight, not two",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document (schema pagedkv-plan/1)"
    )


def _config_path(path: Path) -> Path:
    """`path`, or the config.json inside it when it is a directory (a model's checkout)."""
    if path.is_dir():
        inside = path / "config.json"
        if not inside.is_file():
            raise InvalidArgumentError(f"--config {path}: a directory without a config.json")
        return inside
    return path


def _load_config(path: Path) -> dict[str, Any]:
    path = _config_path(path)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"--config: cannot read {path}: {error}") from None
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(f"--config {path}: not a JSON object")
    return loaded


def _check_dtype_options(args: argparse.Namespace) -> None:
    """Refuse a --dtype or --kv-cache-dtype vLLM 0.8.5 does not take, naming the option."""
    for option, dtype, kv_cache_dtype in (
        ("--dtype", args.dtype, "auto"),
        ("--kv-cache-dtype", "auto", args.kv_cache_dtype),
    ):
        try:
            resolve_dtypes("float16", dtype, kv_cache_dtype)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{option}: {error}") from None


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


def _shape_from_args(
    args: argparse.Namespace, config: dict[str, Any] | None
) -> tuple[ModelShape, int | None, tuple[str, ...]]:
    """The model shape, config.json's max_position_embeddings (None without one), the notes."""
    notes: tuple[str | None, ...] = ()
    if config is not None:
        read = read_hf_config(config, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
        base, positions = read.shape, read.max_position_embeddings
        window_flags = (args.sliding_window, args.sliding_window_layers, args.num_layers)
        layers_changed = args.no_sliding_window or any(flag is not None for flag in window_flags)
        notes = (read.dtype_note,) if layers_changed else (read.layer_types_note, read.dtype_note)
    else:
        base, positions = _shape_from_flags(args), None
        layers_changed = True
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
    if num_window_layers > num_layers:
        raise InvalidArgumentError(
            f"--sliding-window-layers {num_window_layers}: more than the model's {num_layers} "
            f"layers"
        )
    if (base.use_mla or args.mla) and window is not None:
        raise InvalidArgumentError(
            "--mla: MLA is not supported with a sliding window (add --no-sliding-window)"
        )
    num_chunked = min(base.num_chunked_local_layers, num_layers - num_window_layers)
    shape = ModelShape(
        num_layers=num_layers,
        num_kv_heads=base.num_kv_heads if args.num_kv_heads is None else args.num_kv_heads,
        head_size=base.head_size if args.head_size is None else args.head_size,
        dtype=base.dtype,
        use_mla=base.use_mla or args.mla,
        sliding_window=window,
        num_sliding_window_layers=num_window_layers,
        num_attention_heads=base.num_attention_heads,
        attention_chunk_size=base.attention_chunk_size if num_chunked else None,
        num_chunked_local_layers=num_chunked,
        layer_types=None if layers_changed else base.layer_types,
    )
    return shape, positions, tuple(note for note in notes if note)


MAMBA_OPTIONS = (
    ("--mamba-cache-dtype", "mamba_cache_dtype"),
    ("--mamba-ssm-cache-dtype", "mamba_ssm_cache_dtype"),
    ("--gdn-prefill-backend", "gdn_prefill_backend"),
)
"""Options for a Mamba hybrid only (--no-enable-prefix-caching changes nothing elsewhere)."""

LAYER_OPTIONS = (
    ("--num-layers", "num_layers"),
    ("--num-kv-heads", "num_kv_heads"),
    ("--head-size", "head_size"),
    ("--mla", "mla"),
    ("--sliding-window", "sliding_window"),
    ("--sliding-window-layers", "sliding_window_layers"),
    ("--no-sliding-window", "no_sliding_window"),
)
"""Options that reshape an attention model's layers; a Mamba hybrid's come from config.json."""


def _refuse_mamba_options(args: argparse.Namespace) -> None:
    """Refuse an option for Mamba hybrids when the model has no recurrent layers."""
    for option, dest in MAMBA_OPTIONS:
        if getattr(args, dest) is not None:
            raise InvalidArgumentError(f"{option}: the model has no Mamba layers")


def _mamba_model(args: argparse.Namespace, config: dict[str, Any]) -> MambaHybridModel:
    """The Mamba hybrid of `config`, its options checked first, each refusal naming one."""
    model_type = mamba_model_type(config)
    for option, dest in LAYER_OPTIONS:
        if getattr(args, dest) not in (None, False):
            raise InvalidArgumentError(
                f"{option}: not for a Mamba hybrid (model_type {model_type!r}): its layers "
                f"come from config.json"
            )
    for option, dtype, kv_cache_dtype in (
        ("--dtype", args.dtype, "auto"),
        ("--kv-cache-dtype", "auto", args.kv_cache_dtype),
    ):
        try:
            resolve_dtypes_0_33("bfloat16", dtype, kv_cache_dtype)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{option}: {error}") from None
    model = read_mamba_hybrid_config(
        config,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_cache_dtype=args.mamba_cache_dtype or "auto",
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype or "auto",
    )
    try:  # refuse a bad split before anything is planned
        model.state_shapes(args.tensor_parallel_size)
        if model.attention is not None:
            model.attention.num_kv_heads_per_gpu(args.tensor_parallel_size)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"--tensor-parallel-size: {error}") from None
    return model


def _estimate(args: argparse.Namespace, config: dict[str, Any] | None) -> WeightsEstimate | None:
    """The weights estimated from config.json, when --gpu-memory needs them and --weights is
    not given (None otherwise)."""
    if args.gpu_memory is None or args.weights is not None:
        return None
    if config is None:
        raise InvalidArgumentError(
            "--gpu-memory without --config needs --weights (the model's weights over all "
            "GPUs, e.g. --weights 140GB; --weights 0B to plan without them)"
        )
    model_dtype = resolve_dtypes(_config_dtype(config), args.dtype, args.kv_cache_dtype).model_dtype
    return estimate_weights(config, model_dtype)


def _config_dtype(config: dict[str, Any]) -> str | None:
    fields, _ = text_config(config)
    dtype = fields.get("torch_dtype") or fields.get("dtype")
    return dtype if isinstance(dtype, str) else None


def _budget_from_args(
    args: argparse.Namespace, estimate: WeightsEstimate | None
) -> tuple[int, GPUMemoryBudget | None]:
    """One GPU's KV budget, and the GPU's numbers when it was given as a GPU (its weights
    `estimate`d when --weights is not given); exactly one of the two was given."""
    if args.memory_budget is not None:
        if args.weights is not None or args.non_kv_memory is not None:
            raise InvalidArgumentError(
                "--weights and --non-kv-memory go with --gpu-memory; --memory-budget is the KV "
                "cache's share already"
            )
        return int(args.memory_budget), None
    if args.gpu_memory < 1:
        raise InvalidArgumentError(f"--gpu-memory must be at least 1B, got {args.gpu_memory}")
    tp = args.tensor_parallel_size
    gpu = GPUMemoryBudget(
        gpu_memory_bytes=args.gpu_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weights_bytes=int(args.weights) if estimate is None else estimate.num_bytes,
        other_bytes=args.non_kv_memory or 0,
        tensor_parallel_size=tp,
        estimated_bytes_per_gpu=None if estimate is None else estimate.bytes_per_gpu(tp),
    )
    return gpu.require_kv_cache_bytes(), gpu


def _weights_note(gpu: GPUMemoryBudget, estimate: WeightsEstimate) -> str:
    per_gpu = "" if gpu.tensor_parallel_size == 1 else " on each GPU"
    return (
        f"weights estimated from config.json ({estimate.describe()}): "
        f"{gpu.weights_bytes_per_gpu / GiB:.2f} GiB{per_gpu}; --weights overrides"
    )


def _memory_json(gpu: GPUMemoryBudget | None, estimate: WeightsEstimate | None) -> Any:
    if gpu is None:
        return None
    document: dict[str, Any] = dict(gpu.as_json())
    document["weights_estimate"] = (
        None if estimate is None else estimate.as_json(gpu.tensor_parallel_size)
    )
    return document


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
            "hybrid": None if error.hybrid is None else error.hybrid.as_json(),
        }
    if isinstance(error, NoKVCacheMemoryError):
        return {"kind": "no_kv_cache_memory", "message": str(error), **error.budget.as_json()}
    return {"kind": "kv_cache_config", "message": str(error)}


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the plan for `args`, or the reason there is none. Returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    gpu: GPUMemoryBudget | None = None
    estimate: WeightsEstimate | None = None
    plan: KVCachePlan | MambaPlan
    try:
        _check_dtype_options(args)
        config = None if args.config is None else _load_config(args.config)
        model: MambaHybridModel | None = None
        notes: tuple[str, ...] = ()
        if config is not None and mamba_model_type(config) is not None:
            model = _mamba_model(args, config)
            positions = model.max_position_embeddings
        else:
            _refuse_mamba_options(args)
            shape, positions, notes = _shape_from_args(args, config)
            try:
                shape.num_kv_heads_per_gpu(args.tensor_parallel_size)  # refuse a bad split first
            except InvalidArgumentError as error:
                raise InvalidArgumentError(f"--tensor-parallel-size: {error}") from None
        max_model_len = args.max_model_len if args.max_model_len is not None else positions
        if max_model_len is None:
            raise InvalidArgumentError("give --max-model-len (no config.json to take it from)")
        if (args.memory_budget is None) == (args.gpu_memory is None):
            raise InvalidArgumentError("give exactly one of --memory-budget and --gpu-memory")
        estimate = _estimate(args, config)
        budget, gpu = _budget_from_args(args, estimate)
        if gpu is not None and estimate is not None:
            notes = (*notes, _weights_note(gpu, estimate))
        if model is not None:
            plan = make_mamba_plan(
                model,
                budget,
                block_size=args.block_size,
                max_model_len=max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                num_blocks_override=args.num_gpu_blocks_override,
                tensor_parallel_size=args.tensor_parallel_size,
                notes=notes,
                prefix_caching=args.prefix_caching,
                gdn_prefill_backend=args.gdn_prefill_backend or "flashinfer",
            )
        else:
            plan = make_plan(
                shape,
                budget,
                block_size=args.block_size,
                max_model_len=max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                num_blocks_override=args.num_gpu_blocks_override,
                tensor_parallel_size=args.tensor_parallel_size,
                notes=notes,
                async_scheduling=args.async_scheduling,
            )
    except InvalidArgumentError as error:
        print(f"pagedkv plan: error: {error}", file=err)
        return 2
    except KVCacheConfigError as error:
        print(f"pagedkv plan: does not fit: {error}", file=err)
        if args.json:
            memory = _memory_json(gpu, estimate)
            if isinstance(error, NoKVCacheMemoryError):
                memory = _memory_json(error.budget, estimate)
            document = {
                "schema": PLAN_JSON_SCHEMA,
                "fits": False,
                "memory": memory,
                "error": error_json(error),
            }
            print(json.dumps(document, indent=2), file=out)
        return 1
    if args.json:
        document = {**plan.as_json(), "memory": _memory_json(gpu, estimate)}
        print(json.dumps(document, indent=2), file=out)
    else:
        print(plan.format(), file=out)
    return 0
