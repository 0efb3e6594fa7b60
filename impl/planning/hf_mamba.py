"""Read the config.json of a Mamba hybrid as transformers (5.24) reads it, dtypes as vLLM 0.33.

Five families are known (`MAMBA_MODEL_TYPES`). Each says in its own way which layers attend
and which keep a recurrent state; a field the config.json lacks takes the default of
transformers' config class (`MAMBA_DEFAULTS`; `tests/test_hf_mamba.py` checks both against
transformers itself):

    jamba             layer i attends when i % attn_layer_period == attn_layer_offset, the
                      others are Mamba-1
    falcon_h1         every layer attends and keeps a Mamba-2 state, side by side
    nemotron_h        layers_block_type (or the older hybrid_override_pattern: M Mamba-2,
                      * attention, - MLP, E MoE); num_hidden_layers is its length
    granitemoehybrid  layer_types, Mamba-2 where none is given
    qwen3_next        layer_types, else every full_attention_interval-th layer attends; the
                      others are gated delta nets (linear attention)

Layer types take transformers' names ("mamba" and "attention" read as "linear_attention" and
"full_attention", as transformers remaps them); a type the family does not have is refused by
name, never planned as something else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.planning.hf_config import text_config
from pagedkv.planning.mamba_model import (
    HYBRID,
    LINEAR_ATTENTION,
    MAMBA_DTYPES,
    MAMBA_MODEL_TYPES,
    MLP,
    MOE,
    GatedDeltaNetState,
    Mamba1State,
    Mamba2State,
    MambaHybridModel,
    RecurrentState,
)
from pagedkv.planning.plan import FULL_ATTENTION, KV_CACHE_DTYPES, DTypeChoice, ModelShape
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName, dtype_name

LEGACY_LAYER_TYPES: Mapping[str, str] = {
    "mamba": LINEAR_ATTENTION,
    "attention": FULL_ATTENTION,
}
"""Older layer type names and the names transformers reads them as."""

NEMOTRON_H_PATTERN: Mapping[str, str] = {
    "M": LINEAR_ATTENTION,
    "*": FULL_ATTENTION,
    "-": MLP,
    "E": MOE,
}
"""Nemotron-H's `hybrid_override_pattern` letters and the layer types they stand for."""

MAMBA_DEFAULTS: Mapping[str, Mapping[str, object]] = {
    "jamba": {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "max_position_embeddings": 262_144,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    "falcon_h1": {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "max_position_embeddings": 8192,
        "mamba_d_ssm": 1024,
        "mamba_n_heads": 128,
        "mamba_d_head": "auto",
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    "nemotron_h": {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
        "max_position_embeddings": 4096,
        "ssm_state_size": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "conv_kernel": 4,
        "mamba_ssm_cache_dtype": "float32",
    },
    "granitemoehybrid": {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_size": 4096,
        "max_position_embeddings": 2048,
        "mamba_n_heads": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_head": "auto",
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    "qwen3_next": {
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_size": 2048,
        "max_position_embeddings": 32_768,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
    },
}
"""Model type -> transformers' class defaults of the fields read here (None-valued ones left
out); Nemotron-H's default layers are `NEMOTRON_H_DEFAULT_LAYERS`."""

NEMOTRON_H_DEFAULT_LAYERS = (LINEAR_ATTENTION, MOE, FULL_ATTENTION, MLP)
"""NemotronHConfig's `layers_block_type` when a config.json gives neither it nor a pattern."""

QWEN3_NEXT_FULL_ATTENTION_INTERVAL = 4
"""Qwen3NextConfig's default `full_attention_interval`."""

NEMOTRON_H_LEGACY_FIELDS: Mapping[str, str] = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
}
"""Older Nemotron-H field names; transformers lets them override the new ones."""


def _int(fields: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(
            f"config.json: {key!r} must be an int >= {minimum}, got {value!r}"
        )
    return value


def _optional_int(fields: Mapping[str, Any], key: str) -> int | None:
    return None if fields.get(key) is None else _int(fields, key)


def mamba_model_type(config: Mapping[str, Any]) -> str | None:
    """The model type of the config's language model (its `text_config`'s, when it nests
    one) if it is one of `MAMBA_MODEL_TYPES`, else None."""
    _, model_type = text_config(config)
    return model_type if model_type in MAMBA_MODEL_TYPES else None


def _with_defaults(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    fields = {**MAMBA_DEFAULTS[model_type], **config}  # a key given as null stays null
    if model_type == "nemotron_h":
        for old, new in NEMOTRON_H_LEGACY_FIELDS.items():
            if old in config:
                fields[new] = config[old]
    return fields


def _layer_list(
    fields: Mapping[str, Any], key: str, known: Sequence[str], model_type: str
) -> tuple[str, ...]:
    """`fields[key]`, legacy names read as transformers reads them; an unknown type refused."""
    given = fields[key]
    if not isinstance(given, list) or not given:
        raise InvalidArgumentError(
            f"config.json: {key!r} must list each layer's type, got {given!r}"
        )
    kinds = tuple(LEGACY_LAYER_TYPES.get(kind, kind) for kind in given)
    for index, kind in enumerate(kinds):
        if kind not in known:
            raise InvalidArgumentError(
                f"config.json: layer {index} is {given[index]!r}; pagedkv plans {model_type} "
                f"layers of type {', '.join(map(repr, known))} only"
            )
    return kinds


def _given_layer_types(fields: Mapping[str, Any], aliases: Sequence[str]) -> str | None:
    """Which of `aliases` (the same field, as transformers' attribute_map has it) the config
    gives a value for, or None."""
    given = [key for key in aliases if fields.get(key) is not None]
    return given[0] if given else None


def _layers(fields: Mapping[str, Any], model_type: str) -> tuple[str, ...]:
    """Each layer's type, as transformers' config class builds it."""
    if model_type == "jamba":
        for key in ("layer_types", "layers_block_type"):
            if key in fields:
                raise InvalidArgumentError(
                    f"config.json: jamba's layers come from attn_layer_period and "
                    f"attn_layer_offset; transformers refuses a {key!r}"
                )
        period = _int(fields, "attn_layer_period")
        offset = _int(fields, "attn_layer_offset", 0)
        if offset >= period:
            raise InvalidArgumentError(
                f"config.json: attn_layer_offset={offset} must be below attn_layer_period={period}"
            )
        num_layers = _int(fields, "num_hidden_layers")
        return tuple(
            FULL_ATTENTION if i % period == offset else LINEAR_ATTENTION for i in range(num_layers)
        )
    if model_type == "falcon_h1":
        return (HYBRID,) * _int(fields, "num_hidden_layers")
    if model_type == "nemotron_h":
        return _nemotron_h_layers(fields)
    known = (FULL_ATTENTION, LINEAR_ATTENTION)
    given = _given_layer_types(fields, ("layer_types", "layers_block_type"))
    num_layers = _int(fields, "num_hidden_layers")
    if given is not None:
        kinds = _layer_list(fields, given, known, model_type)
        if len(kinds) != num_layers:
            raise InvalidArgumentError(
                f"config.json: {given!r} lists {len(kinds)} layers, num_hidden_layers is "
                f"{num_layers}"
            )
        return kinds
    if model_type == "granitemoehybrid":
        return (LINEAR_ATTENTION,) * num_layers
    interval = fields.get("full_attention_interval", QWEN3_NEXT_FULL_ATTENTION_INTERVAL)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise InvalidArgumentError(
            f"config.json: 'full_attention_interval' must be an int >= 1, got {interval!r}"
        )
    return tuple(
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
    )


def _nemotron_h_layers(fields: Mapping[str, Any]) -> tuple[str, ...]:
    """layers_block_type (or layer_types), else hybrid_override_pattern, else the default."""
    known = (FULL_ATTENTION, LINEAR_ATTENTION, MLP, MOE)
    key = _given_layer_types(fields, ("layers_block_type", "layer_types"))
    if key is not None:
        return _layer_list(fields, key, known, "nemotron_h")
    pattern = fields.get("hybrid_override_pattern")
    if pattern is None:
        return NEMOTRON_H_DEFAULT_LAYERS
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgumentError(
            f"config.json: 'hybrid_override_pattern' must be a string of layer letters, got "
            f"{pattern!r}"
        )
    for index, letter in enumerate(pattern):
        if letter not in NEMOTRON_H_PATTERN:
            letters = ", ".join(f"{key} ({kind})" for key, kind in NEMOTRON_H_PATTERN.items())
            raise InvalidArgumentError(
                f"config.json: hybrid_override_pattern: layer {index} is {letter!r}; "
                f"pagedkv plans nemotron_h layers {letters} only"
            )
    return tuple(NEMOTRON_H_PATTERN[letter] for letter in pattern)


def _auto_head(fields: Mapping[str, Any], key: str, intermediate: int, heads: int) -> int:
    """`fields[key]`, or intermediate // heads where it is "auto" (transformers' default)."""
    return intermediate // heads if fields.get(key) == "auto" else _int(fields, key)


def _state(fields: Mapping[str, Any], model_type: str) -> RecurrentState:
    """The recurrent state of `model_type`'s layers, from the fields vLLM 0.33 reads."""
    if model_type == "jamba":
        return Mamba1State(
            intermediate_size=_int(fields, "mamba_expand") * _int(fields, "hidden_size"),
            state_size=_int(fields, "mamba_d_state"),
            conv_kernel=_int(fields, "mamba_d_conv"),
        )
    if model_type == "qwen3_next":
        return GatedDeltaNetState(
            num_k_heads=_int(fields, "linear_num_key_heads"),
            num_v_heads=_int(fields, "linear_num_value_heads"),
            head_k_dim=_int(fields, "linear_key_head_dim"),
            head_v_dim=_int(fields, "linear_value_head_dim"),
            conv_kernel=_int(fields, "linear_conv_kernel_dim"),
        )
    if model_type == "nemotron_h":
        heads, head_dim = _int(fields, "mamba_num_heads"), _int(fields, "mamba_head_dim")
        return Mamba2State(
            intermediate_size=heads * head_dim,
            n_groups=_int(fields, "n_groups"),
            num_heads=heads,
            head_dim=head_dim,
            state_size=_int(fields, "ssm_state_size"),
            conv_kernel=_int(fields, "conv_kernel"),
        )
    expand = fields.get("mamba_expand")
    if not isinstance(expand, (int, float)) or isinstance(expand, bool) or expand <= 0:
        raise InvalidArgumentError(f"config.json: 'mamba_expand' must be > 0, got {expand!r}")
    if model_type == "falcon_h1" and fields.get("mamba_d_ssm") is not None:
        intermediate = _int(fields, "mamba_d_ssm")
    else:
        intermediate = int(expand * _int(fields, "hidden_size"))
    heads = _int(fields, "mamba_n_heads")
    return Mamba2State(
        intermediate_size=intermediate,
        n_groups=_int(fields, "mamba_n_groups"),
        num_heads=heads,
        head_dim=_auto_head(fields, "mamba_d_head", intermediate, heads),
        state_size=_int(fields, "mamba_d_state"),
        conv_kernel=_int(fields, "mamba_d_conv"),
    )


def _head_size(fields: Mapping[str, Any], model_type: str) -> int:
    """The attention layers' head size, as vLLM 0.33's layers take it, which must be the one
    its block-size alignment takes (config head_dim, else hidden_size // heads)."""
    by_hidden = _int(fields, "hidden_size") // _int(fields, "num_attention_heads")
    head_dim = _optional_int(fields, "head_dim")
    if model_type in ("jamba", "granitemoehybrid"):  # their layers ignore head_dim
        if head_dim is not None and head_dim != by_hidden:
            raise InvalidArgumentError(
                f"config.json: head_dim={head_dim}, but {model_type}'s attention layers use "
                f"hidden_size // num_attention_heads = {by_hidden}; vLLM 0.33 would size "
                f"their pages and its block-size alignment differently, which pagedkv does "
                f"not plan"
            )
        return by_hidden
    return by_hidden if head_dim is None else head_dim


def resolve_dtypes_0_33(
    config_dtype: str | None, dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> DTypeChoice:
    """vLLM 0.33's dtype choice on a Hopper GPU, for a model planned on FlashAttention.

    dtype "auto" takes `config_dtype`, except float32, or no dtype at all (read as float32),
    which become bfloat16 (vLLM 0.33's first dtype on a GPU that has it; 0.8.5 took float16).
    FlashAttention runs float16 and bfloat16 and an fp8 (e4m3) KV cache only.

    Raises:
        InvalidArgumentError: an unknown dtype, float32, or an fp8_e5m2 KV cache.

    Complexity: O(1).
    """
    note = None
    if dtype.strip().lower() == "auto":
        model_dtype = DTypeName("float32") if config_dtype is None else dtype_name(config_dtype)
        if model_dtype == "float32":
            note = (
                "config.json names no dtype: vLLM 0.33 reads float32 and runs bfloat16"
                if config_dtype is None
                else "float32 model: vLLM 0.33 runs it and its caches in bfloat16"
            ) + " (dtype=auto)"
            model_dtype = DTypeName("bfloat16")
    else:
        model_dtype = dtype_name(dtype)
    if model_dtype not in ("float16", "bfloat16"):
        raise InvalidArgumentError(
            f"dtype must be auto, float16 or bfloat16 for a Mamba hybrid, got {dtype!r}: "
            f"pagedkv plans its attention on FlashAttention, which runs those only"
        )
    choice = kv_cache_dtype.strip().lower()
    if choice == "auto":
        return DTypeChoice(model_dtype, model_dtype, note)
    if choice not in ("fp8", "fp8_e4m3"):
        known = ", ".join(KV_CACHE_DTYPES)
        raise InvalidArgumentError(
            f"kv_cache_dtype must be auto, fp8 or fp8_e4m3 for a Mamba hybrid (FlashAttention "
            f"on Hopper), got {kv_cache_dtype!r}; pagedkv knows {known}"
        )
    return DTypeChoice(model_dtype, KV_CACHE_DTYPES[choice], note)


def state_dtypes(
    model_dtype: DTypeName,
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    config_ssm_dtype: str | None = None,
) -> tuple[DTypeName, DTypeName]:
    """The conv and the ssm state's dtypes, as vLLM 0.33 picks them (`MambaStateDtypeCalculator`).

    The conv state takes `mamba_cache_dtype`, "auto" being the model's; the ssm state takes
    `mamba_ssm_cache_dtype`, "auto" being `config_ssm_dtype` where the model has one
    (Nemotron-H's `mamba_ssm_cache_dtype`), else the conv state's.

    Raises:
        InvalidArgumentError: a dtype not in `MAMBA_DTYPES`.

    Complexity: O(1).
    """
    for option, value in (
        ("mamba_cache_dtype", mamba_cache_dtype),
        ("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype),
        ("config.json's mamba_ssm_cache_dtype", config_ssm_dtype or "auto"),
    ):
        if value not in MAMBA_DTYPES:
            raise InvalidArgumentError(
                f"{option} must be one of {', '.join(MAMBA_DTYPES)}, got {value!r}"
            )
    conv = model_dtype if mamba_cache_dtype == "auto" else DTypeName(mamba_cache_dtype)
    ssm = mamba_ssm_cache_dtype
    if ssm == "auto" and config_ssm_dtype is not None:
        ssm = config_ssm_dtype
    return conv, conv if ssm == "auto" else DTypeName(ssm)


def read_mamba_hybrid_config(
    config: Mapping[str, Any],
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
) -> MambaHybridModel:
    """A Mamba hybrid's config.json as transformers reads it, dtypes as vLLM 0.33 picks them.

    Args:
        config: the parsed config.json, of one of `MAMBA_MODEL_TYPES` (or nesting one as its
            `text_config`).
        dtype: the model dtype, "auto" for the config's (`resolve_dtypes_0_33`).
        kv_cache_dtype: the attention layers' cache dtype, "auto" for the model's.
        mamba_cache_dtype: the conv state's dtype, "auto" for the model's (`state_dtypes`).
        mamba_ssm_cache_dtype: the ssm state's dtype, "auto" for the config's or the conv
            state's (`state_dtypes`).

    Raises:
        InvalidArgumentError: another model type; a field missing or of the wrong type; a
            layer type the family does not have (named with its index); Nemotron-H's
            sliding window; a dtype vLLM 0.33 would not run it in.

    Complexity: O(layers).
    """
    text, model_type = text_config(config)
    if model_type not in MAMBA_MODEL_TYPES:
        raise InvalidArgumentError(
            f"config.json: model_type {model_type!r} is not a Mamba hybrid pagedkv knows "
            f"({', '.join(MAMBA_MODEL_TYPES)})"
        )
    fields = _with_defaults(text, model_type)
    if model_type == "nemotron_h" and fields.get("sliding_window") is not None:
        raise InvalidArgumentError(
            f"config.json: nemotron_h with sliding_window={fields['sliding_window']!r}: "
            f"pagedkv plans Nemotron-H's attention layers as full attention only"
        )
    kinds = _layers(fields, model_type)
    config_dtype = fields.get("torch_dtype") or fields.get("dtype")
    if config_dtype is not None and not isinstance(config_dtype, str):
        raise InvalidArgumentError(f"config.json: dtype must be a name, got {config_dtype!r}")
    dtypes = resolve_dtypes_0_33(config_dtype, dtype, kv_cache_dtype)
    config_ssm = fields.get("mamba_ssm_cache_dtype") if model_type == "nemotron_h" else None
    if config_ssm is not None and not isinstance(config_ssm, str):
        raise InvalidArgumentError(
            f"config.json: 'mamba_ssm_cache_dtype' must be a name, got {config_ssm!r}"
        )
    num_attention = sum(1 for kind in kinds if kind in (FULL_ATTENTION, HYBRID))
    attention = None
    if num_attention:
        heads = _int(fields, "num_attention_heads")
        attention = ModelShape(
            num_layers=num_attention,
            num_kv_heads=_optional_int(fields, "num_key_value_heads") or heads,
            head_size=_head_size(fields, model_type),
            dtype=dtypes.kv_cache_dtype,
            num_attention_heads=heads,
        )
    positions = fields.get("max_position_embeddings")
    return MambaHybridModel(
        model_type=model_type,
        layer_types=kinds,
        attention=attention,
        state=_state(fields, model_type),
        state_dtypes=state_dtypes(
            dtypes.model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype, config_ssm
        ),
        model_dtype=dtypes.model_dtype,
        max_position_embeddings=positions if isinstance(positions, int) else None,
        notes=(dtypes.note,) if dtypes.note else (),
    )
