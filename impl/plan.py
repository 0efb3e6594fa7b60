"""Plan a model's KV cache: page size, blocks, token capacity and concurrency for a memory budget.

The model's shape comes from a local Hugging Face config.json, from flags, or both (flags win).
The budget is given in bytes, or as a GPU's memory, the share pagedkv may use, and the memory
the model needs besides its KV cache. The plan is what `get_kv_cache_config` would build on one
worker. When one request of max_model_len does not fit, the error says the largest that does.

Exit status: 0 with a plan; 1 when the model does not fit the budget; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pagedkv.available_memory import kv_cache_budget_bytes
from pagedkv.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.kv_cache_config import get_kv_cache_config
from pagedkv.kv_cache_interface import (
    AttentionSpec,
    DTypeLike,
    DTypeName,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
    dtype_name,
)

SIZE_UNITS: Mapping[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (B, KB..TB decimal, KiB..TiB binary).

    Raises:
        InvalidArgumentError: not a number with a known unit, or not a whole number of bytes.

    Complexity: O(len(text)).
    """
    match = _SIZE.fullmatch(text.lower())
    if match is None or match.group(2) not in SIZE_UNITS:
        raise InvalidArgumentError(
            f"not a memory size: {text!r} (a number with B, KB, MB, GB, TB, KiB, MiB, GiB or "
            f"TiB, e.g. 40GiB)"
        )
    number, unit = match.groups()
    scale = SIZE_UNITS[unit]
    if "." not in number:
        return int(number) * scale
    value = float(number) * scale
    if value != int(value):
        raise InvalidArgumentError(f"not a whole number of bytes: {text!r} = {value} bytes")
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` with thousands separators and in the largest binary unit that is >= 1."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes:,} bytes ({num_bytes / scale:.2f} {unit})"
    return f"{num_bytes:,} bytes"


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache needs to know about a model's attention layers.

    Attributes:
        num_layers: attention layers (>= 1).
        num_kv_heads: KV heads per layer (>= 1; 1 for MLA).
        head_size: elements per head (for MLA: the latent width, kv_lora_rank + rope dims).
        dtype: the KV cache's element type.
        use_mla: the layers store one latent vector per token (DeepSeek-V2/V3 style).
        sliding_window: the window of the sliding-window layers, or None if there are none.
        num_sliding_window_layers: how many layers use the window (0 without one); the rest
            use full attention, and a mix is planned as all full attention, as vLLM does.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: DTypeName
    use_mla: bool = False
    sliding_window: int | None = None
    num_sliding_window_layers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool):
            raise InvalidArgumentError(f"num_layers must be an int, got {self.num_layers!r}")
        if self.num_layers < 1:
            raise InvalidArgumentError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.use_mla and self.sliding_window is not None:
            raise InvalidArgumentError("MLA is not supported with a sliding window")
        if self.sliding_window is None and self.num_sliding_window_layers:
            raise InvalidArgumentError("sliding-window layers need a sliding window")
        if not 0 <= self.num_sliding_window_layers <= self.num_layers:
            raise InvalidArgumentError(
                f"num_sliding_window_layers must be in [0, {self.num_layers}], "
                f"got {self.num_sliding_window_layers}"
            )

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """Layer name (`layers.{i}`) -> spec; the window layers come first. Complexity: O(layers).

        Raises:
            InvalidArgumentError, KVCacheConfigError: as the specs' constructors.
        """
        full = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            use_mla=self.use_mla,
        )
        specs: dict[str, KVCacheSpec] = dict.fromkeys(
            (f"layers.{i}" for i in range(self.num_layers)), full
        )
        if self.sliding_window is not None:
            window = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                dtype=self.dtype,
                sliding_window=self.sliding_window,
                use_mla=self.use_mla,
            )
            for i in range(self.num_sliding_window_layers):
                specs[f"layers.{i}"] = window
        return specs

    def describe(self) -> str:
        """One line: layers, attention kind, heads and dtype."""
        if self.num_sliding_window_layers == self.num_layers:
            kind = f"sliding window {self.sliding_window:,}"
        elif self.num_sliding_window_layers:
            kind = (
                f"{self.num_sliding_window_layers} sliding window {self.sliding_window:,} + "
                f"{self.num_layers - self.num_sliding_window_layers} full attention"
            )
        else:
            kind = "full attention"
        heads = (
            f"MLA latent of {self.head_size}"
            if self.use_mla
            else f"{self.num_kv_heads} KV heads x {self.head_size}"
        )
        return f"{self.num_layers} layers, {kind}, {heads}, {self.dtype}"


def _hf_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"config.json: {key!r} must be an int, got {value!r}")
    return value


def shape_from_hf_config(config: Mapping[str, Any], dtype: DTypeLike | None = None) -> ModelShape:
    """The KV cache shape of a Hugging Face `config.json` (its `text_config` if it has one).

    Reads num_hidden_layers, num_key_value_heads (default num_attention_heads), head_dim
    (default hidden_size // num_attention_heads), torch_dtype (or dtype), and sliding_window
    (unless use_sliding_window is false; `layer_types` says which layers use it, else all do).
    A config with kv_lora_rank is MLA: 1 head of kv_lora_rank + qk_rope_head_dim.

    Args:
        config: the parsed config.json.
        dtype: the KV cache dtype, instead of the model's.

    Raises:
        InvalidArgumentError: a key missing or of the wrong type, or an unknown dtype.

    Complexity: O(layers).
    """
    text = config.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in config:
        config = {**config, **text}
    num_layers = _hf_int(config, "num_hidden_layers")
    if config.get("kv_lora_rank") is not None:
        num_kv_heads = 1
        head_size = _hf_int(config, "kv_lora_rank") + _hf_int(config, "qk_rope_head_dim")
        use_mla = True
    else:
        num_heads = _hf_int(config, "num_attention_heads")
        num_kv_heads = (
            _hf_int(config, "num_key_value_heads")
            if config.get("num_key_value_heads") is not None
            else num_heads
        )
        head_size = (
            _hf_int(config, "head_dim")
            if config.get("head_dim") is not None
            else _hf_int(config, "hidden_size") // num_heads
        )
        use_mla = False
    if dtype is None:
        dtype = config.get("torch_dtype") or config.get("dtype")
        if not isinstance(dtype, str):
            raise InvalidArgumentError("config.json names no torch_dtype: give --dtype")
    window: int | None = None
    num_window_layers = 0
    if config.get("sliding_window") is not None and config.get("use_sliding_window") is not False:
        window = _hf_int(config, "sliding_window")
        layer_types = config.get("layer_types")
        num_window_layers = (
            sum(kind == "sliding_attention" for kind in layer_types)
            if isinstance(layer_types, list)
            else num_layers
        )
        if not num_window_layers:
            window = None
    return ModelShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype_name(dtype),
        use_mla=use_mla,
        sliding_window=window,
        num_sliding_window_layers=num_window_layers,
    )


@dataclass(frozen=True)
class KVCachePlan:
    """A KV cache config for one worker, with the numbers an operator sizes a server by.

    Attributes:
        shape: the model.
        budget_bytes: memory given to the KV cache.
        max_model_len: the longest request.
        max_num_batched_tokens: the most tokens one step computes.
        config: what `get_kv_cache_config` built.
    """

    shape: ModelShape
    budget_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    config: KVCacheConfig

    @property
    def spec(self) -> AttentionSpec:
        """The one spec every layer has after unification."""
        spec = self.config.kv_cache_groups[0].kv_cache_spec
        assert isinstance(spec, AttentionSpec)  # plans are built from attention specs only
        return spec

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer."""
        return self.spec.page_size_bytes

    @property
    def block_bytes(self) -> int:
        """One block across all layers."""
        return self.page_size_bytes * self.shape.num_layers

    @property
    def bytes_per_token(self) -> int:
        """One token across all layers (a page holds `block_size` tokens exactly)."""
        return self.block_bytes // self.block_size

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """`num_blocks * block_size`, the figure vLLM logs as the KV cache size."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """`capacity_tokens / max_model_len`, the figure vLLM logs as maximum concurrency."""
        return self.capacity_tokens / self.max_model_len

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len holds at most (per layer, after unification)."""
        return cdiv(
            self.spec.max_memory_usage_bytes(self.max_model_len, self.max_num_batched_tokens),
            self.page_size_bytes,
        )

    @property
    def max_whole_requests(self) -> int:
        """Requests of max_model_len that fit at once; block 0 is the null block, never used."""
        return (self.num_blocks - 1) // self.blocks_per_request

    def format(self) -> str:
        """The plan as aligned `name  value` lines."""
        rows = [
            ("model", self.shape.describe()),
            ("block size", f"{self.block_size} tokens"),
            ("page size", f"{format_bytes(self.page_size_bytes)} per layer"),
            ("block", f"{format_bytes(self.block_bytes)} over {self.shape.num_layers} layers"),
            ("bytes per token", format_bytes(self.bytes_per_token)),
            ("KV budget", format_bytes(self.budget_bytes)),
            ("blocks", f"{self.num_blocks:,} (block 0 is the null block)"),
            ("KV capacity", f"{self.capacity_tokens:,} tokens"),
            (
                "max_model_len",
                f"{self.max_model_len:,} tokens ({self.blocks_per_request:,} blocks per request)",
            ),
            (
                "max concurrency",
                f"{self.max_concurrency:.2f}x ({self.max_whole_requests:,} whole requests at once)",
            ),
        ]
        if self.shape.num_sliding_window_layers:
            rows.insert(-1, ("max batched", f"{self.max_num_batched_tokens:,} tokens per step"))
        if 0 < self.shape.num_sliding_window_layers < self.shape.num_layers:
            rows.insert(1, ("note", "sliding and full layers mixed: all planned as full"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def make_plan(
    shape: ModelShape,
    budget_bytes: int,
    *,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_blocks_override: int | None = None,
) -> KVCachePlan:
    """The plan for `shape` within `budget_bytes` (see `get_kv_cache_config`).

    Raises:
        KVCacheConfigError: one request of max_model_len does not fit (the message names the
            largest max_model_len that does).
        InvalidArgumentError: a size, limit or override out of its domain.

    Complexity: O(num_layers + log max_model_len).
    """
    batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    config = get_kv_cache_config(
        shape.kv_cache_specs(block_size),
        budget_bytes,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        num_blocks_override=num_blocks_override,
    )
    return KVCachePlan(shape, budget_bytes, max_model_len, batched, config)


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
    model.add_argument("--num-kv-heads", type=int, metavar="N", help="KV heads per layer")
    model.add_argument("--head-size", type=int, metavar="N", help="elements per head")
    model.add_argument("--dtype", help="KV cache dtype: float16, bfloat16, fp8, ...")
    model.add_argument("--mla", action="store_true", help="one latent vector per token (MLA)")
    model.add_argument("--sliding-window", type=int, metavar="W", help="window in tokens")
    model.add_argument(
        "--sliding-window-layers",
        type=int,
        metavar="N",
        help="layers that use the window (default: all)",
    )
    model.add_argument(
        "--no-sliding-window", action="store_true", help="ignore config.json's window"
    )
    memory = parser.add_argument_group("memory (a budget, or a GPU's memory)")
    memory.add_argument(
        "--memory-budget", type=_size, metavar="SIZE", help="bytes for the KV cache, e.g. 40GiB"
    )
    memory.add_argument("--gpu-memory", type=_size, metavar="SIZE", help="e.g. 80GiB")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of --gpu-memory pagedkv may use (default: 0.9)",
    )
    memory.add_argument(
        "--non-kv-memory",
        type=_size,
        default=0,
        metavar="SIZE",
        help="peak memory besides the KV cache: weights, activations (default: 0)",
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


def _shape_from_args(args: argparse.Namespace) -> tuple[ModelShape, int | None]:
    """The model shape and config.json's max_position_embeddings (None without a config)."""
    if args.config is not None:
        try:
            loaded = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(f"cannot read {args.config}: {error}") from None
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(f"{args.config}: not a JSON object")
        base = shape_from_hf_config(loaded, args.dtype)
        positions = loaded.get("max_position_embeddings")
        if not isinstance(positions, int):
            positions = (loaded.get("text_config") or {}).get("max_position_embeddings")
    else:
        missing = [
            flag
            for flag, value in (
                ("--num-layers", args.num_layers),
                ("--num-kv-heads", args.num_kv_heads),
                ("--head-size", args.head_size),
                ("--dtype", args.dtype),
            )
            if value is None
        ]
        if missing:
            raise InvalidArgumentError(f"give --config or {', '.join(missing)}")
        base = ModelShape(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_size,
            dtype=dtype_name(args.dtype),
        )
        positions = None
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
        dtype=base.dtype if args.dtype is None else dtype_name(args.dtype),
        use_mla=base.use_mla or args.mla,
        sliding_window=window,
        num_sliding_window_layers=num_window_layers,
    )
    return shape, positions if isinstance(positions, int) else None


def _budget_from_args(args: argparse.Namespace) -> int:
    if (args.memory_budget is None) == (args.gpu_memory is None):
        raise InvalidArgumentError("give exactly one of --memory-budget and --gpu-memory")
    if args.memory_budget is not None:
        return int(args.memory_budget)
    return kv_cache_budget_bytes(args.gpu_memory, args.gpu_memory_utilization, args.non_kv_memory)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the plan for `args`, or the reason there is none. Returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        shape, positions = _shape_from_args(args)
        max_model_len = args.max_model_len if args.max_model_len is not None else positions
        if max_model_len is None:
            raise InvalidArgumentError("give --max-model-len (no config.json to take it from)")
        budget = _budget_from_args(args)
        plan = make_plan(
            shape,
            budget,
            block_size=args.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks_override=args.num_gpu_blocks_override,
        )
    except InvalidArgumentError as error:
        print(f"pagedkv plan: error: {error}", file=err)
        return 2
    except KVCacheConfigError as error:
        print(f"pagedkv plan: does not fit: {error}", file=err)
        return 1
    print(plan.format(), file=out)
    return 0
