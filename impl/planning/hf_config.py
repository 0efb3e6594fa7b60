"""Read a Hugging Face config.json as transformers reads it, to plan the model's KV cache.

transformers fills what a config.json leaves out from the model type's config class, and some
classes derive which layers use the sliding window (`layer_types`) from other fields. A
config.json saved before its class had `layer_types` has none: Gemma-2's layers alternate
between the window and full attention, and taking `sliding_window` for every layer plans a
model that needs twice the memory per request. Llama-4's layers attend within chunks of
`attention_chunk_size` tokens except every fourth (`no_rope_layers`), which attends to all.
`TRANSFORMERS_DEFAULTS` holds, for the model types whose layers may use a window or a chunk, the
class defaults of the fields read here and the rules that build `layer_types`, as of
transformers 5.24; `tests/test_hf_config.py` checks both against transformers itself. Other
model types take `layer_types` from the config, or else the window on every layer, as vLLM 0.8.5
applies a model-wide `sliding_window`.

A model with layers of another type than attention is refused by name, never planned as
attention (`refuse_unplanned_layers`): the Mamba hybrids pagedkv plans are read by
`pagedkv.planning.hf_mamba`; any other recurrent or sparse model is named with its layer type
(the layer's index too, where config.json lists `layer_types`).

Fields read (from `text_config` when the config has one and no `num_hidden_layers` of its own):
num_hidden_layers, num_attention_heads, num_key_value_heads (default: num_attention_heads),
head_dim (default: hidden_size // num_attention_heads), kv_lora_rank and qk_rope_head_dim (MLA),
sliding_window, use_sliding_window, max_window_layers, sliding_window_pattern, layer_types,
attention_chunk_size, no_rope_layers, no_rope_layer_interval, max_position_embeddings, and
torch_dtype or dtype (the text config's, else the top level's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.planning.mamba_model import MAMBA_MODEL_TYPES
from pagedkv.planning.plan import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LAYER_KINDS,
    SLIDING_ATTENTION,
    ModelShape,
    resolve_dtypes,
)
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName

__all__ = [
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "OTHER_LAYER_MODEL_TYPES",
    "SLIDING_ATTENTION",
    "TRANSFORMERS_DEFAULTS",
    "HFModelConfig",
    "layer_types",
    "read_hf_config",
    "refuse_unplanned_layers",
    "text_config",
]

LayerRule = Callable[[Mapping[str, Any], int], list[bool]]
"""(config with defaults, num_layers) -> whether each layer uses the window (or the chunk)."""


def _every_nth_layer_full(pattern_key: str | None, default: int) -> LayerRule:
    """Layer i uses the window unless i + 1 is a multiple of the pattern (the config's
    `pattern_key`, else `default`)."""

    def rule(config: Mapping[str, Any], num_layers: int) -> list[bool]:
        pattern = default if pattern_key is None else config.get(pattern_key, default)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise InvalidArgumentError(
                f"config.json: {pattern_key!r} must be an int >= 1, got {pattern!r}"
            )
        return [(i + 1) % pattern != 0 for i in range(num_layers)]

    return rule


def _from_max_window_layers(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Qwen2/Qwen3: the layers from `max_window_layers` on use the window."""
    first = _int(config, "max_window_layers")
    return [i >= first for i in range(num_layers)]


def _odd_below_max_window_layers(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Qwen2-MoE: every other layer (0, 2, ...) below `max_window_layers` uses the window."""
    end = _int(config, "max_window_layers")
    return [i % 2 == 0 and i < end for i in range(num_layers)]


def _every_layer(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    return [True] * num_layers


def _rope_layers(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Llama-4: the layers with RoPE (`no_rope_layers[i] == 1`) attend within their chunk; the
    list defaults to a NoPE (full attention) layer every `no_rope_layer_interval` layers."""
    given = config.get("no_rope_layers")
    if given:
        if not isinstance(given, list) or len(given) != num_layers:
            raise InvalidArgumentError(
                f"config.json: 'no_rope_layers' must list 0 or 1 for each of the {num_layers} "
                f"layers, got {given!r}"
            )
        return [bool(flag) for flag in given]
    interval = _int(config, "no_rope_layer_interval")
    if interval < 1:
        raise InvalidArgumentError(
            f"config.json: 'no_rope_layer_interval' must be an int >= 1, got {interval}"
        )
    return [(i + 1) % interval != 0 for i in range(num_layers)]


@dataclass(frozen=True)
class ModelTypeDefaults:
    """What transformers' config class for one model type gives a config.json that lacks it.

    Attributes:
        fields: class defaults of the fields read here (None-valued defaults left out).
        sliding_layers: the rule that builds `layer_types` when the config has none.
        window_needs_switch: the window applies only when `use_sliding_window` is true
            (Qwen); otherwise a `sliding_window` that is not None applies.
        chunked_layers: for a model with chunked local attention, the rule that says which
            layers attend within their chunk when the config has no `layer_types`.
    """

    fields: Mapping[str, int | bool]
    sliding_layers: LayerRule
    window_needs_switch: bool = False
    chunked_layers: LayerRule | None = None


_MISTRAL_FIELDS: Mapping[str, int | bool] = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
}

_QWEN2_FIELDS: Mapping[str, int | bool] = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_size": 4096,
    "max_position_embeddings": 32_768,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "max_window_layers": 28,
}

TRANSFORMERS_DEFAULTS: Mapping[str, ModelTypeDefaults] = {
    "gemma2": ModelTypeDefaults(
        {
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2304,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
        },
        _every_nth_layer_full(None, 2),
    ),
    "gemma3_text": ModelTypeDefaults(
        {
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2304,
            "max_position_embeddings": 131_072,
            "sliding_window": 4096,
        },
        _every_nth_layer_full("sliding_window_pattern", 6),
    ),
    "cohere2": ModelTypeDefaults(
        {
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "hidden_size": 8192,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
        },
        _every_nth_layer_full("sliding_window_pattern", 4),
    ),
    "gpt_oss": ModelTypeDefaults(
        {
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_size": 2880,
            "max_position_embeddings": 131_072,
            "sliding_window": 128,
        },
        _every_nth_layer_full(None, 2),
    ),
    "llama4_text": ModelTypeDefaults(
        {
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 5120,
            "max_position_embeddings": 131_072,
            "attention_chunk_size": 8192,
            "no_rope_layer_interval": 4,
        },
        _every_layer,
        chunked_layers=_rope_layers,
    ),
    "mistral": ModelTypeDefaults(_MISTRAL_FIELDS, _every_layer),
    "ministral": ModelTypeDefaults(_MISTRAL_FIELDS, _every_layer),
    "qwen2": ModelTypeDefaults(_QWEN2_FIELDS, _from_max_window_layers, window_needs_switch=True),
    "qwen2_moe": ModelTypeDefaults(
        {
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "hidden_size": 2048,
            "max_position_embeddings": 32_768,
            "sliding_window": 4096,
            "use_sliding_window": False,
            "max_window_layers": 28,
        },
        _odd_below_max_window_layers,
        window_needs_switch=True,
    ),
    "qwen3": ModelTypeDefaults(
        {**_QWEN2_FIELDS, "head_dim": 128}, _from_max_window_layers, window_needs_switch=True
    ),
    "qwen3_moe": ModelTypeDefaults(
        {
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "hidden_size": 2048,
            "max_position_embeddings": 32_768,
            "sliding_window": 4096,
            "use_sliding_window": False,
        },
        _every_layer,
        window_needs_switch=True,
    ),
}
"""Model type -> transformers' defaults, for the model types whose layers may use a window or a
chunk."""

TEXT_MODEL_TYPES: Mapping[str, str] = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
"""A multimodal model type -> the model type of its `text_config` when that names none."""


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"config.json: {key!r} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class HFModelConfig:
    """A config.json as pagedkv plans it, transformers' defaults filled in.

    Attributes:
        model_type: the text model's type (None if the config names none).
        shape: the model's KV cache shape.
        layer_types: each layer's attention, `FULL_ATTENTION`, `SLIDING_ATTENTION` or
            `CHUNKED_ATTENTION` (all full when no window or chunk applies).
        max_position_embeddings: the model's longest sequence, None if the config has none.
        layer_types_note: where `layer_types` came from when the config has none, or None.
        dtype_note: why the model runs in another dtype than the config's, or None.
        model_dtype: the dtype vLLM runs the weights in (`resolve_dtypes`), None if unknown.
    """

    model_type: str | None
    shape: ModelShape
    layer_types: tuple[str, ...]
    max_position_embeddings: int | None
    layer_types_note: str | None = None
    dtype_note: str | None = None
    model_dtype: DTypeName | None = None

    @property
    def notes(self) -> tuple[str, ...]:
        """The notes that are not None."""
        return tuple(note for note in (self.layer_types_note, self.dtype_note) if note)


def text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The fields of the model's language model and its model type, transformers' defaults
    for that type filled in: a multimodal config's `text_config` over the top level.

    Complexity: O(fields).
    """
    root_type = config.get("model_type")
    nested = config.get("text_config")
    if isinstance(nested, Mapping) and "num_hidden_layers" not in config:
        model_type = nested.get("model_type") or TEXT_MODEL_TYPES.get(str(root_type))
        fields = {key: value for key, value in config.items() if key != "text_config"}
        fields.update(nested)
        if not (nested.get("torch_dtype") or nested.get("dtype")):
            fields["torch_dtype"] = config.get("torch_dtype") or config.get("dtype")
    else:
        model_type, fields = root_type, dict(config)
    if not isinstance(model_type, str):
        model_type = None
    defaults = TRANSFORMERS_DEFAULTS.get(model_type) if model_type else None
    if defaults is not None:
        fields = {**defaults.fields, **fields}  # a key given as null stays null, as in transformers
    return fields, model_type


def _window(fields: Mapping[str, Any], model_type: str | None) -> int | None:
    """The sliding window, or None where none applies (as transformers' classes and vLLM read
    `use_sliding_window`)."""
    defaults = TRANSFORMERS_DEFAULTS.get(model_type) if model_type else None
    switch = fields.get("use_sliding_window")
    if switch is False or (defaults is not None and defaults.window_needs_switch and not switch):
        return None
    if fields.get("sliding_window") is None:
        return None
    window = _int(fields, "sliding_window")
    return window if window > 0 else None


def _chunk(fields: Mapping[str, Any]) -> int | None:
    """The attention chunk of the chunked-local layers, or None where none applies."""
    if fields.get("attention_chunk_size") is None:
        return None
    chunk = _int(fields, "attention_chunk_size")
    return chunk if chunk > 0 else None


LEGACY_LAYER_KINDS: Mapping[str, str] = {"attention": FULL_ATTENTION}
"""Older layer type names transformers reads as one of `LAYER_KINDS` ("mamba", which it reads
as "linear_attention", is refused like it)."""

RECURRENT_FIELDS = (
    "hybrid_override_pattern",
    "layers_block_type",
    "block_types",
    "attn_layer_indices",
    "attn_layer_period",
    "attn_layer_offset",
    "conv_L_cache",
    "recurrent_kv_cache_mode",
)
RECURRENT_FIELD_PREFIXES = (
    "mamba_",
    "ssm_",
    "linear_num_",
    "linear_key_",
    "linear_value_",
    "linear_conv_",
    "linear_head_",
    "short_conv",
    "time_step_",
    "lru_",
)
"""Fields of a config.json whose model has layers other than attention (a Mamba or
linear-attention state, a short convolution, a recurrence): such a config is refused unless its
model type is one pagedkv plans (`MAMBA_MODEL_TYPES`)."""

OTHER_LAYER_MODEL_TYPES: Mapping[str, str] = {
    "axk2": "indexed_attention",
    "deepseek_v32": "indexed_attention",
    "deepseek_v4": "compressed_sparse_attention",
    "dots3_note": "indexed_attention",
    "dots3_note_text": "indexed_attention",
    "glm_moe_dsa": "indexed_attention",
    "hy_v4": "indexed_attention",
    "hy_v4_vl": "indexed_attention",
    "hy_v4_vl_text": "indexed_attention",
    "inkling2": "hybrid_sliding",
    "inkling2_loop": "hybrid_sliding",
    "inkling2_loop_text": "hybrid_sliding",
    "inkling2_text": "hybrid_sliding",
    "inkling_mm_model": "hybrid_sliding",
    "inkling_text": "hybrid_sliding",
    "lfm3_vl_vision": "conv",
    "minimax": "linear_attention",
    "mistral_large4": "indexed_attention",
    "mistral_large4_text": "indexed_attention",
    "muse_glimmer_vision": "window_attention",
    "muse_spark_vision": "window_attention",
    "unlimited_ocr": "reference_sliding_attention",
    "unlimited_ocr_text": "reference_sliding_attention",
    "zaya": "hybrid",
}
"""Model types whose transformers config class gives layers of another type than attention
without saving their list or a field of `RECURRENT_FIELDS` in config.json (the type named is
one of them); `tests/test_hf_config.py` checks every model type transformers knows."""

_PLANNED_ELSEWHERE = (
    f"pagedkv plans {', '.join(map(repr, LAYER_KINDS))} layers, and the Mamba and "
    f"linear-attention layers of {', '.join(MAMBA_MODEL_TYPES)} only"
)


def refuse_unplanned_layers(fields: Mapping[str, Any], model_type: str | None) -> None:
    """Refuse, by name, a config.json whose model has layers pagedkv's attention planner would
    plan as something else: a Mamba hybrid it plans elsewhere (`pagedkv.planning.hf_mamba`),
    another recurrent or sparse model, or a `layer_types` entry other than full, sliding or
    chunked attention (its index, its type and the known types named).

    Raises:
        InvalidArgumentError: as above.

    Complexity: O(fields + layers).
    """
    named = f"model_type {model_type!r}" if model_type else "a config without model_type"
    if model_type in MAMBA_MODEL_TYPES:
        raise InvalidArgumentError(
            f"config.json: {named} has Mamba or linear-attention layers: read it with "
            f"pagedkv.planning.hf_mamba.read_mamba_hybrid_config (pagedkv plan does)"
        )
    given = fields.get("layer_types")
    if isinstance(given, list):
        for index, kind in enumerate(given):
            if LEGACY_LAYER_KINDS.get(kind, kind) not in LAYER_KINDS:
                raise InvalidArgumentError(
                    f"config.json: layer {index} is {kind!r}; {_PLANNED_ELSEWHERE}"
                )
    other = OTHER_LAYER_MODEL_TYPES.get(model_type) if model_type else None
    if other is not None:
        raise InvalidArgumentError(
            f"config.json: {named} has {other!r} layers; {_PLANNED_ELSEWHERE}"
        )
    markers = [
        key for key in fields if key in RECURRENT_FIELDS or key.startswith(RECURRENT_FIELD_PREFIXES)
    ]
    if markers:
        shown = ", ".join(markers[:4]) + (", ..." if len(markers) > 4 else "")
        raise InvalidArgumentError(
            f"config.json: {named} has layers other than attention ({shown}); {_PLANNED_ELSEWHERE}"
        )


def _layer_types(
    fields: Mapping[str, Any], model_type: str | None, num_layers: int
) -> tuple[tuple[str, ...], str | None]:
    """Each layer's attention and, when the config did not say, a note on where it came from."""
    window, chunk = _window(fields, model_type), _chunk(fields)
    defaults = TRANSFORMERS_DEFAULTS.get(model_type) if model_type else None
    given = fields.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != num_layers:
            raise InvalidArgumentError(
                f"config.json: 'layer_types' must list one type for each of the {num_layers} "
                f"layers, got {given!r}"
            )
        given = [LEGACY_LAYER_KINDS.get(kind, kind) for kind in given]
        for index, kind in enumerate(given):
            if kind not in LAYER_KINDS:
                raise InvalidArgumentError(
                    f"config.json: layer {index} is {kind!r}; {_PLANNED_ELSEWHERE}"
                )
        sliding = [kind == SLIDING_ATTENTION and window is not None for kind in given]
        chunked = [kind == CHUNKED_ATTENTION and chunk is not None for kind in given]
        note = None
    else:
        note = None
        if window is None:
            sliding = [False] * num_layers
        elif defaults is not None:
            sliding = defaults.sliding_layers(fields, num_layers)
            if not all(sliding):
                note = f"no layer_types in config.json: transformers' {model_type} layout"
        else:
            sliding = [True] * num_layers
            known = f"model_type {model_type!r}" if model_type else "a config without model_type"
            note = f"no layer_types, and {known} has no layout pagedkv knows: window on every layer"
        if chunk is not None and defaults is not None and defaults.chunked_layers is not None:
            chunked = defaults.chunked_layers(fields, num_layers)
            note = f"no layer_types in config.json: transformers' {model_type} layout"
        else:
            chunked = [False] * num_layers
    kinds = tuple(
        SLIDING_ATTENTION if in_window else CHUNKED_ATTENTION if in_chunk else FULL_ATTENTION
        for in_window, in_chunk in zip(sliding, chunked, strict=True)
    )
    return kinds, note


def layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Each layer's attention as transformers builds it (`FULL_ATTENTION` everywhere when no
    window or chunk applies).

    Raises:
        InvalidArgumentError: a field missing or of the wrong type, or a layer type other than
            full, sliding or chunked attention (`refuse_unplanned_layers`).

    Complexity: O(layers).
    """
    fields, model_type = text_config(config)
    refuse_unplanned_layers(fields, model_type)
    return _layer_types(fields, model_type, _int(fields, "num_hidden_layers"))[0]


def read_hf_config(
    config: Mapping[str, Any], *, dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> HFModelConfig:
    """The KV cache shape of a Hugging Face `config.json`, read as transformers reads it.

    A config with kv_lora_rank is MLA: 1 head of kv_lora_rank + qk_rope_head_dim. The dtypes are
    vLLM 0.8.5's choice (`resolve_dtypes`).

    Args:
        config: the parsed config.json.
        dtype: the model dtype, "auto" for the config's (see `resolve_dtypes`).
        kv_cache_dtype: the KV cache dtype, "auto" for the model dtype.

    Raises:
        InvalidArgumentError: a field missing or of the wrong type, a layer type pagedkv does
            not plan as attention (`refuse_unplanned_layers`), or an unknown dtype.

    Complexity: O(layers).
    """
    fields, model_type = text_config(config)
    refuse_unplanned_layers(fields, model_type)
    num_layers = _int(fields, "num_hidden_layers")
    if fields.get("kv_lora_rank") is not None:
        num_kv_heads = 1
        head_size = _int(fields, "kv_lora_rank") + _int(fields, "qk_rope_head_dim")
        use_mla = True
    else:
        num_kv_heads = (
            _int(fields, "num_key_value_heads")
            if fields.get("num_key_value_heads") is not None
            else _int(fields, "num_attention_heads")
        )
        head_size = (
            _int(fields, "head_dim")
            if fields.get("head_dim") is not None
            else _int(fields, "hidden_size") // _int(fields, "num_attention_heads")
        )
        use_mla = False
    num_heads = fields.get("num_attention_heads")
    config_dtype = fields.get("torch_dtype") or fields.get("dtype")
    if config_dtype is not None and not isinstance(config_dtype, str):
        raise InvalidArgumentError(f"config.json: dtype must be a name, got {config_dtype!r}")
    dtypes = resolve_dtypes(config_dtype, dtype, kv_cache_dtype)
    kinds, layers_note = _layer_types(fields, model_type, num_layers)
    num_window_layers = kinds.count(SLIDING_ATTENTION)
    num_chunked_layers = kinds.count(CHUNKED_ATTENTION)
    shape = ModelShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtypes.kv_cache_dtype,
        use_mla=use_mla,
        sliding_window=_window(fields, model_type) if num_window_layers else None,
        num_sliding_window_layers=num_window_layers,
        num_attention_heads=_int(fields, "num_attention_heads") if num_heads is not None else None,
        attention_chunk_size=_chunk(fields) if num_chunked_layers else None,
        num_chunked_local_layers=num_chunked_layers,
        layer_types=kinds,
    )
    positions = fields.get("max_position_embeddings")
    return HFModelConfig(
        model_type=model_type,
        shape=shape,
        layer_types=kinds,
        max_position_embeddings=positions if isinstance(positions, int) else None,
        layer_types_note=layers_note,
        dtype_note=dtypes.note,
        model_dtype=dtypes.model_dtype,
    )
