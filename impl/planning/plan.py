"""Plan a model's KV cache on each GPU: page size, blocks, token capacity and concurrency.

The planner is pure: a `ModelShape` (from flags, or from a config.json through
`pagedkv.planning.hf_config`), one GPU's KV cache budget in bytes and the serving limits give a
`KVCachePlan`: the config `get_kv_cache_config` builds on that GPU, with the figures an operator
sizes a server by. It decides as vLLM 0.8.5 does:

- dtypes (`resolve_dtypes`): dtype "auto" is the model's own, except that a float32 model, or one
  whose config names no dtype, runs in float16; kv_cache_dtype "auto" is the model dtype.
- tensor parallelism (`ModelShape.num_kv_heads_per_gpu`): each GPU stores num_kv_heads // tp
  heads, at least one (a head is replicated when tp exceeds them); an MLA latent is on every GPU.
- a model with both full-attention and sliding-window layers gets one block table, so every
  layer is planned as full attention; so is a chunked-local layer (Llama-4), which 0.8.5 caches
  as full attention. vLLM checks one request of max_model_len against the budget on the layers
  as given; `make_plan` also checks it on the layers as planned, which vLLM 0.8.5 does not (it
  starts with a pool that such a request cannot fit in).

A model with window or chunked layers also gets what vLLM 0.33's hybrid KV cache manager plans
on the same budget (`pagedkv.planning.hybrid_layout`): its groups, blocks per group, the memory
a request saves against the uniform layout, and how many more requests fit.

Its command line is `pagedkv plan` (`pagedkv.planning.cli`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.block_counts import cdiv
from pagedkv.planning.byte_sizes import format_bytes
from pagedkv.planning.hybrid_layout import (
    CHUNKED_HYBRID_SWITCH,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    VLLM_VERSION,
    HybridLayout,
    make_hybrid_layout,
)
from pagedkv.planning.kv_cache_config import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    memory_needed_bytes,
    unify_hybrid_kv_cache_specs,
)
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    DTypeName,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    dtype_name,
)

MODEL_DTYPES: tuple[DTypeName, ...] = tuple(map(DTypeName, ("float16", "bfloat16", "float32")))
"""What vLLM 0.8.5's `--dtype` may name besides "auto" (aliases such as "half" or "bf16" too)."""

KV_CACHE_DTYPES: Mapping[str, DTypeName] = {
    "fp8": DTypeName("float8_e4m3fn"),
    "fp8_e4m3": DTypeName("float8_e4m3fn"),
    "fp8_e5m2": DTypeName("float8_e5m2"),
}
"""vLLM 0.8.5's `--kv-cache-dtype` choices besides "auto" (the model dtype), one byte each."""

PLAN_JSON_SCHEMA = "pagedkv-plan/1"
"""The `schema` of `pagedkv plan --json` documents; it changes when a key changes meaning."""


@dataclass(frozen=True)
class DTypeChoice:
    """The dtypes vLLM 0.8.5 runs a model and its KV cache in.

    Attributes:
        model_dtype: the weights' and activations' dtype.
        kv_cache_dtype: the KV cache's element type.
        note: why the model dtype is not the one config.json names, or None.
    """

    model_dtype: DTypeName
    kv_cache_dtype: DTypeName
    note: str | None = None


def resolve_dtypes(
    config_dtype: str | None, dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> DTypeChoice:
    """vLLM 0.8.5's dtype choice (`_get_and_verify_dtype`, then the model runner's cache dtype).

    dtype "auto" takes `config_dtype`, except float32, or no dtype at all (which vLLM reads as
    float32), which become float16. Any other dtype must be a 16- or 32-bit float. kv_cache_dtype
    "auto" is the model dtype; otherwise one of `KV_CACHE_DTYPES`.

    Args:
        config_dtype: config.json's `torch_dtype` (or `dtype`), None if it names none.
        dtype: "auto" or one of `MODEL_DTYPES`.
        kv_cache_dtype: "auto" or one of `KV_CACHE_DTYPES`.

    Raises:
        InvalidArgumentError: an unknown dtype or kv_cache_dtype, or a config dtype that is
            no dtype at all.

    Complexity: O(1).
    """
    note = None
    if dtype.strip().lower() == "auto":
        if config_dtype is None:
            model_dtype = DTypeName("float16")
            note = "config.json names no dtype: vLLM reads float32 and runs float16 (dtype=auto)"
        else:
            model_dtype = dtype_name(config_dtype)
            if model_dtype == "float32":
                model_dtype = DTypeName("float16")
                note = "float32 model: vLLM runs it and its KV cache in float16 (dtype=auto)"
    else:
        model_dtype = dtype_name(dtype)
        if model_dtype not in MODEL_DTYPES:
            raise InvalidArgumentError(
                f"dtype must be auto, float16, bfloat16 or float32 (the model's dtype), got "
                f"{dtype!r}; for an fp8 KV cache give kv_cache_dtype fp8"
            )
    choice = kv_cache_dtype.strip().lower()
    if choice == "auto":
        return DTypeChoice(model_dtype, model_dtype, note)
    if choice not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)} (vLLM 0.8.5's "
            f"choices), got {kv_cache_dtype!r}"
        )
    return DTypeChoice(model_dtype, KV_CACHE_DTYPES[choice], note)


def _check_count(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)
"""Each layer's attention, as transformers' `layer_types` names it."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache needs to know about a whole model's attention layers.

    Attributes:
        num_layers: attention layers (>= 1).
        num_kv_heads: KV heads per layer over all GPUs (>= 1; 1 for MLA).
        head_size: elements per head (for MLA: the latent width, kv_lora_rank + rope dims).
        dtype: the KV cache's element type.
        use_mla: the layers store one latent vector per token (DeepSeek-V2/V3 style).
        sliding_window: the window of the sliding-window layers, or None if there are none.
        num_sliding_window_layers: how many layers use the window (0 without one).
        num_attention_heads: query heads per layer (>= 1), None if unknown; tensor parallelism
            must divide them.
        attention_chunk_size: the chunk of the chunked-local layers (Llama-4), or None.
        num_chunked_local_layers: how many layers attend within their chunk (0 without one);
            the layers neither windowed nor chunked use full attention.
        layer_types: each layer's kind (`LAYER_KINDS`) in model order, None if unknown (then
            the window layers come first, the chunked ones next, full attention last); kept as
            None when it is that order anyway, so equal models compare equal.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: DTypeName
    use_mla: bool = False
    sliding_window: int | None = None
    num_sliding_window_layers: int = 0
    num_attention_heads: int | None = None
    attention_chunk_size: int | None = None
    num_chunked_local_layers: int = 0
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_count("num_layers", self.num_layers, 1)
        _check_count("num_kv_heads", self.num_kv_heads, 1)
        _check_count("head_size", self.head_size, 1)
        if self.num_attention_heads is not None:
            _check_count("num_attention_heads", self.num_attention_heads, 1)
        if self.attention_chunk_size is not None:
            _check_count("attention_chunk_size", self.attention_chunk_size, 1)
        if self.use_mla and self.sliding_window is not None:
            raise InvalidArgumentError("MLA is not supported with a sliding window")
        if self.use_mla and self.attention_chunk_size is not None:
            raise InvalidArgumentError("MLA is not supported with chunked local attention")
        if self.sliding_window is None and self.num_sliding_window_layers:
            raise InvalidArgumentError("sliding-window layers need a sliding window")
        if self.attention_chunk_size is None and self.num_chunked_local_layers:
            raise InvalidArgumentError("chunked local layers need an attention chunk size")
        local = self.num_sliding_window_layers + self.num_chunked_local_layers
        if min(self.num_sliding_window_layers, self.num_chunked_local_layers) < 0 or not (
            0 <= local <= self.num_layers
        ):
            raise InvalidArgumentError(
                f"num_sliding_window_layers + num_chunked_local_layers must be in "
                f"[0, {self.num_layers}], got {self.num_sliding_window_layers} + "
                f"{self.num_chunked_local_layers}"
            )
        if self.layer_types is not None:
            self._check_layer_types(self.layer_types)
            if self.layer_types == self._default_layer_kinds():
                object.__setattr__(self, "layer_types", None)  # one spelling of each shape

    def _check_layer_types(self, kinds: tuple[str, ...]) -> None:
        if not isinstance(kinds, tuple) or len(kinds) != self.num_layers:
            raise InvalidArgumentError(
                f"layer_types must be a tuple of {self.num_layers} kinds, got {kinds!r}"
            )
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown:
            raise InvalidArgumentError(f"layer_types: unknown kinds {unknown}; known {LAYER_KINDS}")
        counts = (kinds.count(SLIDING_ATTENTION), kinds.count(CHUNKED_ATTENTION))
        if counts != (self.num_sliding_window_layers, self.num_chunked_local_layers):
            raise InvalidArgumentError(
                f"layer_types has {counts[0]} sliding and {counts[1]} chunked layers, but "
                f"num_sliding_window_layers={self.num_sliding_window_layers} and "
                f"num_chunked_local_layers={self.num_chunked_local_layers}"
            )

    @property
    def num_full_attention_layers(self) -> int:
        """Layers that keep every token."""
        return self.num_layers - self.num_sliding_window_layers - self.num_chunked_local_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind in model order: `layer_types`, or else window layers first, then
        chunked-local ones, then full attention."""
        return self._default_layer_kinds() if self.layer_types is None else self.layer_types

    def _default_layer_kinds(self) -> tuple[str, ...]:
        return (
            (SLIDING_ATTENTION,) * self.num_sliding_window_layers
            + (CHUNKED_ATTENTION,) * self.num_chunked_local_layers
            + (FULL_ATTENTION,) * self.num_full_attention_layers
        )

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one kind: vLLM 0.33 gives each kind KV cache groups of its own."""
        kinds = (
            self.num_sliding_window_layers,
            self.num_chunked_local_layers,
            self.num_full_attention_layers,
        )
        return sum(1 for count in kinds if count) > 1

    @property
    def has_local_layers(self) -> bool:
        """Some layers keep only a window or a chunk of the tokens."""
        return self.num_full_attention_layers < self.num_layers

    @property
    def planned_as_full_attention(self) -> bool:
        """vLLM 0.8.5 plans every layer as full attention: window layers beside full ones
        share its one block table, and it has no chunked-local cache at all."""
        return self.num_chunked_local_layers > 0 or 0 < self.num_sliding_window_layers < (
            self.num_layers
        )

    def num_kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads one GPU stores when `tensor_parallel_size` GPUs share every layer.

        As vLLM 0.8.5 splits them: `num_kv_heads // tp`, or 1 when tp >= num_kv_heads (each
        head then on `tp // num_kv_heads` GPUs); 1 for MLA, whose latent every GPU keeps whole.

        Raises:
            InvalidArgumentError: tp < 1; tp does not divide num_attention_heads; or, without
                MLA, neither of tp and num_kv_heads divides the other (vLLM refuses these).

        Complexity: O(1).
        """
        tp = tensor_parallel_size
        _check_count("tensor_parallel_size", tp, 1)
        if self.num_attention_heads is not None and self.num_attention_heads % tp:
            raise InvalidArgumentError(
                f"tensor_parallel_size={tp} must divide num_attention_heads="
                f"{self.num_attention_heads}: each GPU gets the same number of query heads"
            )
        if self.use_mla:
            return 1
        if tp >= self.num_kv_heads:
            if tp % self.num_kv_heads:
                raise InvalidArgumentError(
                    f"tensor_parallel_size={tp} must be a multiple of num_kv_heads="
                    f"{self.num_kv_heads}: each KV head is replicated on tp // num_kv_heads GPUs"
                )
            return 1
        if self.num_kv_heads % tp:
            raise InvalidArgumentError(
                f"tensor_parallel_size={tp} must divide num_kv_heads={self.num_kv_heads}: "
                f"each GPU gets the same number of KV heads"
            )
        return self.num_kv_heads // tp

    def kv_cache_specs(
        self, block_size: int, tensor_parallel_size: int = 1
    ) -> dict[str, KVCacheSpec]:
        """One GPU's layer name (`layers.{i}`) -> spec, each layer's own kind (`layer_kinds`).

        Raises:
            InvalidArgumentError, KVCacheConfigError: as `num_kv_heads_per_gpu` and the specs'
                constructors.

        Complexity: O(layers).
        """
        heads = self.num_kv_heads_per_gpu(tensor_parallel_size)
        size, dtype, mla = self.head_size, self.dtype, self.use_mla
        by_kind: dict[str, KVCacheSpec] = {
            FULL_ATTENTION: FullAttentionSpec(
                block_size=block_size, num_kv_heads=heads, head_size=size, dtype=dtype, use_mla=mla
            )
        }
        if self.sliding_window is not None:
            by_kind[SLIDING_ATTENTION] = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=size,
                dtype=dtype,
                sliding_window=self.sliding_window,
                use_mla=mla,
            )
        if self.attention_chunk_size is not None:
            by_kind[CHUNKED_ATTENTION] = ChunkedLocalAttentionSpec(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=size,
                dtype=dtype,
                attention_chunk_size=self.attention_chunk_size,
                use_mla=mla,
            )
        return {f"layers.{i}": by_kind[kind] for i, kind in enumerate(self.layer_kinds)}

    def describe(self) -> str:
        """One line: layers, attention kinds, heads and dtype."""
        kinds = []
        if self.num_sliding_window_layers:
            kinds.append(
                (self.num_sliding_window_layers, f"sliding window {self.sliding_window:,}")
            )
        if self.num_chunked_local_layers:
            kinds.append(
                (self.num_chunked_local_layers, f"chunked local {self.attention_chunk_size:,}")
            )
        if self.num_full_attention_layers:
            kinds.append((self.num_full_attention_layers, "full attention"))
        if len(kinds) == 1:
            kind = kinds[0][1]
        else:
            kind = " + ".join(f"{count} {name}" for count, name in kinds)
        heads = (
            f"MLA latent of {self.head_size}"
            if self.use_mla
            else f"{self.num_kv_heads} KV heads x {self.head_size}"
        )
        return f"{self.num_layers} layers, {kind}, {heads}, {self.dtype}"

    def as_json(self) -> dict[str, Any]:
        """The shape's fields, `describe()` as `description`, and each kind's layer count."""
        return {
            "description": self.describe(),
            "num_layers": self.num_layers,
            "num_full_attention_layers": self.num_full_attention_layers,
            "num_sliding_window_layers": self.num_sliding_window_layers,
            "sliding_window": self.sliding_window,
            "num_chunked_local_layers": self.num_chunked_local_layers,
            "attention_chunk_size": self.attention_chunk_size,
            "layer_types": list(self.layer_kinds),
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "use_mla": self.use_mla,
            "kv_cache_dtype": self.dtype,
        }


class RequestDoesNotFitError(KVCacheConfigError):
    """One request of max_model_len needs more KV cache than one GPU's budget.

    Attributes:
        max_model_len: the request's length.
        needed_bytes: the KV cache it needs on one GPU, over all layers.
        available_bytes: the budget.
        largest_max_model_len: the longest request that fits (0: none).
        planned_as_full_attention: the check that failed is the one on the layers as planned
            (window and chunked layers as full attention), which vLLM 0.8.5 does not make.
        hybrid: what vLLM 0.33's hybrid layout would hold on the same budget, if it fits there.
    """

    def __init__(
        self,
        message: str,
        *,
        max_model_len: int,
        needed_bytes: int,
        available_bytes: int,
        largest_max_model_len: int,
        planned_as_full_attention: bool,
        hybrid: HybridLayout | None = None,
    ) -> None:
        super().__init__(message)
        self.max_model_len = max_model_len
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.largest_max_model_len = largest_max_model_len
        self.planned_as_full_attention = planned_as_full_attention
        self.hybrid = hybrid

    def with_hybrid(self, hybrid: HybridLayout) -> RequestDoesNotFitError:
        """This refusal, saying what vLLM 0.33's hybrid layout would hold instead."""
        default = "" if hybrid.enabled_by_default else f" with {CHUNKED_HYBRID_SWITCH}"
        return RequestDoesNotFitError(
            f"{self} vLLM {VLLM_VERSION}'s hybrid KV cache manager{default} would fit it: "
            f"{hybrid.config.num_blocks:,} blocks in {len(hybrid.groups)} groups, "
            f"{hybrid.max_whole_requests:,} whole requests at once.",
            max_model_len=self.max_model_len,
            needed_bytes=self.needed_bytes,
            available_bytes=self.available_bytes,
            largest_max_model_len=self.largest_max_model_len,
            planned_as_full_attention=self.planned_as_full_attention,
            hybrid=hybrid,
        )


def _check_one_request_fits(
    specs: Mapping[str, KVCacheSpec],
    budget_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    *,
    as_planned: bool,
) -> None:
    """`check_enough_kv_cache_memory`, its refusal raised as `RequestDoesNotFitError`."""
    try:
        check_enough_kv_cache_memory(
            specs,
            budget_bytes,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    except KVCacheConfigError as error:
        context = (
            "with its sliding-window layers planned as full attention (one block table for "
            "every layer, as vLLM 0.8.5 does; its start-up check counts them by their window "
            "and would pass), "
            if as_planned
            else ""
        )
        raise RequestDoesNotFitError(
            f"{context}{error}",
            max_model_len=max_model_len,
            needed_bytes=memory_needed_bytes(
                specs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
            ),
            available_bytes=budget_bytes,
            largest_max_model_len=estimate_max_model_len(
                specs,
                budget_bytes,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            ),
            planned_as_full_attention=as_planned,
        ) from None


@dataclass(frozen=True)
class KVCachePlan:
    """One GPU's KV cache config, with the numbers an operator sizes a server by.

    Every figure but `shape` is per GPU; token capacity and concurrency hold for the whole
    tensor-parallel group, since each GPU stores its share of the heads of every token.

    Attributes:
        shape: the model.
        budget_bytes: memory given to the KV cache on each GPU.
        max_model_len: the longest request.
        max_num_batched_tokens: the most tokens one step computes.
        config: what `get_kv_cache_config` built for one GPU.
        tensor_parallel_size: GPUs sharing every layer.
        notes: what the plan assumed, one sentence each.
        hybrid: for a model with window or chunked layers, what vLLM 0.33 plans on the same
            budget beside the uniform layout (None otherwise, or when vLLM 0.33 would refuse).
        hybrid_refusal: why vLLM 0.33 would refuse this model on this budget, or None.
    """

    shape: ModelShape
    budget_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    config: KVCacheConfig
    tensor_parallel_size: int = 1
    notes: tuple[str, ...] = ()
    hybrid: HybridLayout | None = None
    hybrid_refusal: str | None = None

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
    def num_kv_heads_per_gpu(self) -> int:
        return self.spec.num_kv_heads

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

    @property
    def all_notes(self) -> tuple[str, ...]:
        """`notes`, then why layers are planned as full attention, if they are."""
        notes = self.notes
        if self.shape.num_chunked_local_layers:
            notes += ("chunked local layers planned as full (vLLM 0.8.5 has no chunked cache)",)
        if self.shape.num_sliding_window_layers and self.shape.planned_as_full_attention:
            notes += ("sliding and full layers mixed: all planned as full",)
        return notes

    def _tensor_parallel_row(self) -> str:
        gpus = f"{self.tensor_parallel_size} GPUs"
        if self.shape.use_mla:
            heads = "each keeps the whole MLA latent"
        elif self.tensor_parallel_size > self.shape.num_kv_heads:
            copies = self.tensor_parallel_size // self.shape.num_kv_heads
            heads = f"1 of {self.shape.num_kv_heads} KV heads on each (each head on {copies})"
        else:
            heads = f"{self.num_kv_heads_per_gpu} of {self.shape.num_kv_heads} KV heads on each"
        return f"{gpus}, {heads}; sizes, budget and blocks below per GPU"

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (name, value) pairs, in the order `format` prints them."""
        rows = [("model", self.shape.describe())]
        if self.tensor_parallel_size > 1:
            rows.append(("tensor parallel", self._tensor_parallel_row()))
        rows += [("note", note) for note in self.all_notes]
        rows += [
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
        ]
        if self.shape.has_local_layers:
            rows.append(("max batched", f"{self.max_num_batched_tokens:,} tokens per step"))
        rows.append(
            (
                "max concurrency",
                f"{self.max_concurrency:.2f}x ({self.max_whole_requests:,} whole requests at once)",
            )
        )
        if self.hybrid is not None:
            rows += self.hybrid.rows()
        elif self.hybrid_refusal is not None:
            rows.append((f"vLLM {VLLM_VERSION}", f"would refuse: {self.hybrid_refusal}"))
        return rows

    def format(self) -> str:
        """The plan as aligned `name  value` lines."""
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def as_json(self) -> dict[str, Any]:
        """Every figure `format` prints, by name (the `pagedkv plan --json` schema, less
        `memory`): see docs/planning.md."""
        return {
            "schema": PLAN_JSON_SCHEMA,
            "fits": True,
            "model": self.shape.as_json(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "num_kv_heads_per_gpu": self.num_kv_heads_per_gpu,
            "planned_as_full_attention": self.shape.planned_as_full_attention,
            "notes": list(self.all_notes),
            "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes,
            "block_bytes": self.block_bytes,
            "bytes_per_token": self.bytes_per_token,
            "kv_budget_bytes": self.budget_bytes,
            "num_blocks": self.num_blocks,
            "kv_capacity_tokens": self.capacity_tokens,
            "max_model_len": self.max_model_len,
            "blocks_per_request": self.blocks_per_request,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_concurrency": self.max_concurrency,
            "max_whole_requests": self.max_whole_requests,
            "hybrid": None if self.hybrid is None else self.hybrid.as_json(),
            "hybrid_refusal": self.hybrid_refusal,
        }


def vllm_0_8_5_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The layers as vLLM 0.8.5 gives them to its planner: a chunked-local layer is a
    full-attention one (0.8.5 masks the chunk in the kernel but keeps every token's cache).

    Complexity: O(num_layers).
    """
    return {
        name: FullAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            use_mla=spec.use_mla,
        )
        if isinstance(spec, ChunkedLocalAttentionSpec)
        else spec
        for name, spec in kv_cache_specs.items()
    }


def make_plan(
    shape: ModelShape,
    budget_bytes: int,
    *,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_blocks_override: int | None = None,
    tensor_parallel_size: int = 1,
    notes: Iterable[str] = (),
    async_scheduling: bool = True,
) -> KVCachePlan:
    """The plan for `shape` within `budget_bytes` on each of `tensor_parallel_size` GPUs.

    One request of max_model_len must fit the budget on the layers as vLLM 0.8.5 gives them
    (its check) and, for a model it plans as all full attention, as planned; then
    `get_kv_cache_config` builds the GPU's config. A model with window or chunked layers also
    gets vLLM 0.33's hybrid layout (`make_hybrid_layout`) on the same budget, with
    max_num_batched_tokens as given or else `SERVE_MAX_NUM_BATCHED_TOKENS`.

    Args:
        shape: the model.
        budget_bytes: one GPU's KV cache budget.
        block_size: tokens per block.
        max_model_len: the longest request.
        max_num_batched_tokens: the most tokens one step computes; None means max_model_len
            (and vLLM 0.33's `vllm serve` default for the hybrid layout).
        num_blocks_override: use this many blocks, whatever the budget holds.
        tensor_parallel_size: GPUs sharing every layer (see `ModelShape.num_kv_heads_per_gpu`).
        notes: what the caller assumed, carried into the plan.
        async_scheduling: vLLM 0.33 schedules a batch while one runs (its default), so window
            layers keep two batches' tokens; False: one.

    Raises:
        RequestDoesNotFitError: one request of max_model_len does not fit (the message names
            the largest max_model_len that does, and what vLLM 0.33's hybrid layout would
            hold if it fits there).
        InvalidArgumentError: a size, limit, override or tensor-parallel size out of its domain.

    Complexity: O(num_layers + groups * log max_model_len).
    """
    if num_blocks_override is not None:  # a bad override is bad input, whatever fits
        _check_count("num_blocks_override", num_blocks_override, 1)
    batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    specs = shape.kv_cache_specs(block_size, tensor_parallel_size)
    given = vllm_0_8_5_specs(specs)
    hybrid, refusal = None, None
    if shape.has_local_layers:
        try:
            hybrid = make_hybrid_layout(
                specs,
                budget_bytes,
                max_model_len=max_model_len,
                max_num_batched_tokens=(
                    SERVE_MAX_NUM_BATCHED_TOKENS
                    if max_num_batched_tokens is None
                    else max_num_batched_tokens
                ),
                batches_in_flight=2 if async_scheduling else 1,
                num_blocks_override=num_blocks_override,
            )
        except KVCacheConfigError as error:
            refusal = str(error)
    try:
        _check_one_request_fits(given, budget_bytes, max_model_len, batched, as_planned=False)
        if shape.planned_as_full_attention:
            planned = unify_hybrid_kv_cache_specs(given)
            _check_one_request_fits(planned, budget_bytes, max_model_len, batched, as_planned=True)
    except RequestDoesNotFitError as error:
        if hybrid is None:
            raise
        raise error.with_hybrid(hybrid) from None
    config = get_kv_cache_config(
        given,
        budget_bytes,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        num_blocks_override=num_blocks_override,
    )
    return KVCachePlan(
        shape,
        budget_bytes,
        max_model_len,
        batched,
        config,
        tensor_parallel_size,
        tuple(notes),
        hybrid,
        refusal,
    )
