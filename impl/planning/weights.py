"""The weights' memory on each GPU, estimated from a config.json: parameters x bytes each.

`pagedkv plan --gpu-memory` needs the weights to know what is left for the KV cache. Given no
`--weights`, it counts the parameters the config describes, as transformers builds the model
(`tests/test_weights.py` checks the counts against transformers' own modules), in the dtype vLLM
runs it in, and splits them over tensor-parallel ranks as vLLM does:

    split       / tp     embeddings and the LM head (vocab-parallel), query and output
                         projections, MLPs, experts (each expert's hidden dim is sharded)
    KV heads    x max(num_kv_heads // tp, 1) / num_kv_heads   (a KV head is never split: with
                         tp > num_kv_heads each rank holds one, replicated)
    replicated  x 1      norms, MoE routers, an MLA latent's down-projection

Tied embeddings (`tie_word_embeddings`, the default of Gemma's classes) are counted once; an MoE
model counts every expert (all are resident, however few a token uses). A multimodal config's
vision tower and projector are counted too. gpt-oss stores its experts in MXFP4 (4 bits a
weight and one byte of scale per 32: 17/32 byte); other quantized checkpoints are refused, as
are model types whose layout is not known here: give `--weights` for those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.block_counts import cdiv
from pagedkv.planning.hf_config import text_config
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName, dtype_size

SPLIT = "split"
KV_HEADS = "kv_heads"
REPLICATED = "replicated"

MXFP4_BYTES = (17, 32)
"""Bytes per MXFP4 weight as a fraction: 32 four-bit values and one shared one-byte scale."""

_LLAMA = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
_MISTRAL = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
_QWEN2 = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}
_GEMMA = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "tie_word_embeddings": True,
    "attention_bias": False,
}

WEIGHT_DEFAULTS: Mapping[str, Mapping[str, int | bool]] = {
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    "ministral": _MISTRAL,
    "mixtral": {**_MISTRAL, "num_local_experts": 8},
    "qwen2": _QWEN2,
    "qwen3": {**_QWEN2, "head_dim": 128, "attention_bias": False},
    "qwen2_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
    },
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts": 128,
    },
    "gemma2": _GEMMA,
    "gemma3_text": {**_GEMMA, "vocab_size": 262208},
    "gpt_oss": {
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "attention_bias": True,
    },
    "llama4_text": {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "num_local_experts": 16,
        "interleave_moe_layer_step": 1,
        "attention_bias": False,
    },
    "deepseek_v2": {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "moe_intermediate_size": 1407,
    },
    "deepseek_v3": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "first_k_dense_replace": 3,
        "tie_word_embeddings": False,
    },
    "siglip_vision_model": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "vision_use_head": True,
    },
    "llama4_vision_model": {
        "hidden_size": 768,
        "num_hidden_layers": 34,
        "num_channels": 3,
        "intermediate_size": 5632,
        "vision_output_dim": 7680,
        "image_size": 448,
        "patch_size": 14,
        "projector_output_dim": 4096,
    },
}
"""transformers 5.24's class defaults of the fields read here (None-valued ones left out), by
model type: a config.json saved by transformers holds only the values that differ from them."""

_VISION_TYPES = {"gemma3": "siglip_vision_model", "llama4": "llama4_vision_model"}
"""A multimodal model type -> its vision config's model type when that names none."""


@dataclass(frozen=True)
class WeightPart:
    """Parameters of one kind and how tensor parallelism splits them.

    Attributes:
        name: what they are ("embeddings", "attention", "experts", ...).
        parameters: how many.
        num_bytes: their bytes in the dtype (or quantization) they are stored in.
        split: `SPLIT`, `KV_HEADS` or `REPLICATED` (see the module docstring).
    """

    name: str
    parameters: int
    num_bytes: int
    split: str


@dataclass(frozen=True)
class WeightsEstimate:
    """A model's weights as a config.json describes them.

    Attributes:
        parts: the parameters by kind.
        dtype: the dtype the unquantized weights run in.
        num_kv_heads: KV heads per layer (how the `KV_HEADS` part splits).
        quantization: what is stored quantized, e.g. "MXFP4 experts", or None.
    """

    parts: tuple[WeightPart, ...]
    dtype: DTypeName
    num_kv_heads: int
    quantization: str | None = None

    @property
    def parameters(self) -> int:
        return sum(part.parameters for part in self.parts)

    @property
    def num_bytes(self) -> int:
        """All the weights' bytes, on all GPUs together."""
        return sum(part.num_bytes for part in self.parts)

    def bytes_per_gpu(self, tensor_parallel_size: int) -> int:
        """Bytes each of `tensor_parallel_size` GPUs holds (see the module docstring).

        Raises:
            InvalidArgumentError: tensor_parallel_size < 1.

        Complexity: O(parts).
        """
        tp = tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise InvalidArgumentError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        heads = max(self.num_kv_heads // tp, 1)
        total = 0
        for part in self.parts:
            if part.split == SPLIT:
                total += cdiv(part.num_bytes, tp)
            elif part.split == KV_HEADS:
                total += cdiv(part.num_bytes * heads, self.num_kv_heads)
            else:
                total += part.num_bytes
        return total

    def describe(self) -> str:
        """ "116,829,156,672 parameters, MXFP4 experts, bfloat16 elsewhere"."""
        stored = f"{self.quantization}, {self.dtype} elsewhere" if self.quantization else self.dtype
        return f"{self.parameters:,} parameters, {stored}"

    def as_json(self, tensor_parallel_size: int) -> dict[str, Any]:
        """The estimate's figures (the `weights_estimate` object of `pagedkv plan --json`)."""
        return {
            "parameters": self.parameters,
            "bytes": self.num_bytes,
            "bytes_per_gpu": self.bytes_per_gpu(tensor_parallel_size),
            "dtype": self.dtype,
            "quantization": self.quantization,
            "parts": {
                part.name: {"parameters": part.parameters, "bytes": part.num_bytes}
                for part in self.parts
            },
        }


def _field(fields: Mapping[str, Any], key: str, *, minimum: int = 0) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(
            f"config.json: {key!r} must be an int >= {minimum} to estimate the weights, got "
            f"{value!r}; or give --weights"
        )
    return value


def _optional(fields: Mapping[str, Any], key: str) -> int | None:
    return None if fields.get(key) is None else _field(fields, key)


class _Counter:
    """Parameters added up by part: `add(name, count, split)`, quantized parts by their own
    bytes per parameter."""

    def __init__(self, dtype_bytes: int) -> None:
        self.dtype_bytes = dtype_bytes
        self.parts: dict[tuple[str, str], list[int]] = {}

    def add(
        self, name: str, parameters: int, split: str = SPLIT, per_param: tuple[int, int] = (0, 0)
    ) -> None:
        numerator, denominator = per_param if per_param[1] else (self.dtype_bytes, 1)
        entry = self.parts.setdefault((name, split), [0, 0])
        entry[0] += parameters
        entry[1] += cdiv(parameters * numerator, denominator)

    def result(self) -> tuple[WeightPart, ...]:
        return tuple(
            WeightPart(name, parameters, num_bytes, split)
            for (name, split), (parameters, num_bytes) in self.parts.items()
        )


def _attention(count: _Counter, f: Mapping[str, Any], model_type: str) -> None:
    """One layer's attention: query, KV and output projections, biases, norms, sinks."""
    hidden, heads = _field(f, "hidden_size", minimum=1), _field(f, "num_attention_heads", minimum=1)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        nope, rope = _field(f, "qk_nope_head_dim"), _field(f, "qk_rope_head_dim")
        latent, value = _field(f, "kv_lora_rank", minimum=1), _field(f, "v_head_dim", minimum=1)
        q_rank = _optional(f, "q_lora_rank")
        if q_rank is None:
            count.add("attention", hidden * heads * (nope + rope))
        else:
            count.add("attention", hidden * q_rank + q_rank, REPLICATED)
            count.add("attention", q_rank * heads * (nope + rope))
        count.add("attention", hidden * (latent + rope) + latent, REPLICATED)
        count.add("attention", latent * heads * (nope + value) + heads * value * hidden)
        return
    kv_heads = _optional(f, "num_key_value_heads") or heads
    head_dim = _optional(f, "head_dim") or hidden // heads
    query = hidden * heads * head_dim
    count.add("attention", 2 * query)  # query and output projections
    count.add("attention", 2 * hidden * kv_heads * head_dim, KV_HEADS)
    qkv_bias = model_type in {"qwen2", "qwen2_moe"} or bool(f.get("attention_bias"))
    if qkv_bias:
        count.add("attention", heads * head_dim)
        count.add("attention", 2 * kv_heads * head_dim, KV_HEADS)
    if bool(f.get("attention_bias")):
        count.add("attention", hidden)  # the output projection's bias
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        count.add("norms", 2 * head_dim, REPLICATED)  # q_norm, k_norm
    if model_type == "gpt_oss":
        count.add("attention", heads)  # attention sinks


def _mlp(count: _Counter, hidden: int, intermediate: int, bias: bool = False) -> None:
    count.add("mlp", 3 * hidden * intermediate + (2 * intermediate + hidden if bias else 0))


def _moe_layers(f: Mapping[str, Any], model_type: str, num_layers: int) -> list[bool]:
    """Whether each layer's MLP is a mixture of experts."""
    if model_type == "llama4_text":
        given = f.get("moe_layers")
        if given is None:
            step = _field(f, "interleave_moe_layer_step", minimum=1)
            given = list(range(step - 1, num_layers, step))
        return [i in given for i in range(num_layers)]
    if model_type in ("deepseek_v2", "deepseek_v3"):
        first, freq = _field(f, "first_k_dense_replace"), f.get("moe_layer_freq") or 1
        return [i >= first and i % freq == 0 for i in range(num_layers)]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step, dense = _field(f, "decoder_sparse_step", minimum=1), f.get("mlp_only_layers") or []
        return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return [model_type in ("gpt_oss", "mixtral")] * num_layers


def _experts(count: _Counter, f: Mapping[str, Any], model_type: str, quantized: bool) -> None:
    """One MoE layer: experts, router, shared experts."""
    hidden = _field(f, "hidden_size", minimum=1)
    experts = next(
        _field(f, key, minimum=1)
        for key in ("num_local_experts", "num_experts", "n_routed_experts")
        if f.get(key) is not None
    )
    inner = _field(
        f, "moe_intermediate_size" if f.get("moe_intermediate_size") else "intermediate_size"
    )
    per_param = MXFP4_BYTES if quantized else (0, 0)
    count.add("experts", experts * 3 * hidden * inner, SPLIT, per_param)
    count.add("router", hidden * experts, REPLICATED)
    if model_type == "gpt_oss":
        count.add("experts", experts * (2 * inner + hidden))  # expert biases, not quantized
        count.add("router", experts, REPLICATED)
    elif model_type == "llama4_text":
        _mlp(count, hidden, inner)  # the shared expert
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        _mlp(count, hidden, inner * _field(f, "n_shared_experts"))
    elif model_type == "qwen2_moe":
        _mlp(count, hidden, _field(f, "shared_expert_intermediate_size"))
        count.add("router", hidden, REPLICATED)  # the shared expert's gate


def _vision(count: _Counter, config: Mapping[str, Any], text_hidden: int) -> None:
    """A multimodal model's vision tower and projector (SigLIP for Gemma-3, Llama-4's own)."""
    vision_type = _VISION_TYPES.get(str(config.get("model_type")))
    given = config.get("vision_config")
    if vision_type is None or not (given is None or isinstance(given, Mapping)):
        return
    f = {**WEIGHT_DEFAULTS[vision_type], **(given or {})}
    hidden, inner = _field(f, "hidden_size", minimum=1), _field(f, "intermediate_size", minimum=1)
    patch = _field(f, "patch_size", minimum=1)
    positions = (_field(f, "image_size", minimum=1) // patch) ** 2
    per_layer = 4 * (hidden * hidden + hidden) + 2 * hidden * inner + inner + hidden + 4 * hidden
    count.add("vision", _field(f, "num_hidden_layers") * per_layer)
    count.add("vision", _field(f, "num_channels", minimum=1) * patch * patch * hidden)
    if vision_type == "siglip_vision_model":
        count.add("vision", hidden + positions * hidden + 2 * hidden)  # conv bias, positions
        if f.get("vision_use_head"):
            count.add("vision", 4 * hidden * hidden + 2 * hidden * inner + inner + 8 * hidden)
        count.add("vision", hidden * text_hidden + hidden)  # projector and its norm
    else:
        out = _field(f, "projector_output_dim", minimum=1)
        count.add("vision", hidden + (positions + 1) * hidden + 4 * hidden)
        count.add("vision", inner * out + out * out)  # pixel-shuffle adapter
        count.add("vision", _field(f, "vision_output_dim", minimum=1) * text_hidden)


def _quantized_experts(config: Mapping[str, Any]) -> bool:
    """Whether the experts are stored in MXFP4 (gpt-oss); refuse other quantizations."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    if method != "mxfp4":
        raise InvalidArgumentError(
            f"config.json is quantized (quant_method {method!r}): pagedkv estimates "
            f"unquantized and MXFP4 weights only; give --weights"
        )
    return True


def estimate_weights(config: Mapping[str, Any], dtype: DTypeName) -> WeightsEstimate:
    """The weights of the model `config` (a parsed config.json) describes, in `dtype`.

    Args:
        config: the parsed config.json.
        dtype: the dtype vLLM runs the weights in (`resolve_dtypes(...).model_dtype`).

    Raises:
        InvalidArgumentError: a model type whose layout is not known here, a quantization
            other than MXFP4, or a field missing or of the wrong type (each message says to
            give --weights instead).

    Complexity: O(layers).
    """
    fields, model_type = text_config(config)
    if model_type is None or model_type not in WEIGHT_DEFAULTS or "vision" in model_type:
        known = ", ".join(t for t in WEIGHT_DEFAULTS if not t.endswith("vision_model"))
        raise InvalidArgumentError(
            f"cannot estimate the weights of model_type {model_type!r} (pagedkv knows {known}); "
            f"give --weights"
        )
    f = {**WEIGHT_DEFAULTS[model_type], **fields}
    quantized = _quantized_experts(config)
    count = _Counter(dtype_size(dtype))
    hidden = _field(f, "hidden_size", minimum=1)
    vocab = _field(f, "vocab_size", minimum=1)
    num_layers = _field(f, "num_hidden_layers", minimum=1)
    tied = f.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    count.add("embeddings", vocab * hidden * (1 if tied else 2))
    norms_per_layer = 4 if model_type in ("gemma2", "gemma3_text") else 2
    count.add("norms", (num_layers * norms_per_layer + 1) * hidden, REPLICATED)
    dense = _field(
        f, "intermediate_size_mlp" if model_type == "llama4_text" else "intermediate_size"
    )
    for uses_experts in _moe_layers(f, model_type, num_layers):
        _attention(count, f, model_type)
        if uses_experts:
            _experts(count, f, model_type, quantized)
        else:
            _mlp(count, hidden, dense, bool(f.get("mlp_bias")))
    _vision(count, config, hidden)
    kv_heads = (
        1
        if model_type in ("deepseek_v2", "deepseek_v3")
        else _optional(f, "num_key_value_heads") or _field(f, "num_attention_heads", minimum=1)
    )
    return WeightsEstimate(
        count.result(), DTypeName(dtype), kv_heads, "MXFP4 experts" if quantized else None
    )
