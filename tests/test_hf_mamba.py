"""Mamba hybrids' config.json read as transformers reads it: pagedkv's layouts, fields and
defaults against transformers' own config classes (a dev dependency; `pagedkv` never imports
it), dtypes as vLLM 0.33 picks them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from transformers import CONFIG_MAPPING, PreTrainedConfig

from pagedkv.planning.hf_mamba import (
    MAMBA_DEFAULTS,
    NEMOTRON_H_DEFAULT_LAYERS,
    mamba_model_type,
    read_mamba_hybrid_config,
    resolve_dtypes_0_33,
    state_dtypes,
)
from pagedkv.planning.mamba_model import (
    MAMBA_MODEL_TYPES,
    GatedDeltaNetState,
    Mamba1State,
    Mamba2State,
)
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName

READ_FIELDS = {field for fields in MAMBA_DEFAULTS.values() for field in fields} | {
    "layer_types",
    "layers_block_type",
}


def transformers_config(config: dict[str, Any]) -> PreTrainedConfig:
    built = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    assert isinstance(built, PreTrainedConfig)
    return built


def transformers_layer_types(built: PreTrainedConfig) -> tuple[str, ...]:
    """Each layer's type as transformers' class gives it (`layers_block_type` where the class
    keeps its list there), in its current names."""
    names = {"mamba": "linear_attention", "attention": "full_attention"}
    given = getattr(built, "layers_block_type", None) or built.layer_types
    return tuple(names.get(kind, kind) for kind in given)


@pytest.mark.parametrize("model_type", MAMBA_MODEL_TYPES)
def test_defaults_are_transformers_class_defaults(model_type: str) -> None:
    cls = CONFIG_MAPPING[model_type]
    class_defaults = {
        field.name: field.default
        for field in dataclasses.fields(cls)
        if field.name in READ_FIELDS and field.default is not None
    }
    assert dict(MAMBA_DEFAULTS[model_type]) == class_defaults
    if model_type == "nemotron_h":
        assert transformers_layer_types(cls()) == NEMOTRON_H_DEFAULT_LAYERS


NEMOTRON_H_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

# config.json files as they are saved, older spellings included
CONFIGS: list[dict[str, Any]] = [
    {"model_type": "jamba"},
    {"model_type": "jamba", "num_hidden_layers": 9, "attn_layer_period": 3, "attn_layer_offset": 0},
    {"model_type": "jamba", "num_key_value_heads": 32, "mamba_expand": 3},
    {"model_type": "falcon_h1"},
    {"model_type": "falcon_h1", "head_dim": 64, "mamba_d_ssm": None, "num_hidden_layers": 4},
    {"model_type": "falcon_h1", "mamba_d_head": 16, "mamba_n_heads": 64},
    {"model_type": "nemotron_h"},
    {"model_type": "nemotron_h", "hybrid_override_pattern": NEMOTRON_H_PATTERN},
    {"model_type": "nemotron_h", "hybrid_override_pattern": "M*ME", "num_hidden_layers": 9},
    {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention", "mlp"]},
    {"model_type": "nemotron_h", "layer_types": ["linear_attention", "full_attention"]},
    {"model_type": "nemotron_h", "mamba_n_groups": 2, "mamba_d_conv": 3, "n_groups": 4},
    {"model_type": "nemotron_h", "head_dim": 64, "num_key_value_heads": 2},
    {"model_type": "granitemoehybrid"},
    {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_key_value_heads": 8,
        "mamba_n_heads": 256,
        "mamba_d_head": 32,
    },
    {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 2,
        "layers_block_type": ["full_attention", "linear_attention"],
    },
    {"model_type": "qwen3_next"},
    {"model_type": "qwen3_next", "num_hidden_layers": 12, "full_attention_interval": 3},
    {
        "model_type": "qwen3_next",
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "head_dim": 128,
    },
]


def _ids(config: dict[str, Any]) -> str:
    return ",".join(f"{key}={value}"[:24] for key, value in config.items())


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_layers_and_sizes_read_as_in_transformers(config: dict[str, Any]) -> None:
    built = transformers_config(config)
    for saved in (config, built.to_dict()):
        model = read_mamba_hybrid_config(saved)
        assert model.layer_types == transformers_layer_types(built)
        assert model.max_position_embeddings == built.max_position_embeddings
        assert model.state == state_of(built)
        attention = model.attention
        if not model.attention_layers:  # Granite's default: Mamba layers only
            assert attention is None and built.model_type == "granitemoehybrid"
            continue
        assert attention is not None
        assert attention.num_layers == len(model.attention_layers)
        assert attention.num_kv_heads == built.num_key_value_heads
        assert attention.num_attention_heads == built.num_attention_heads
        # the attention layers' head size, as vLLM's model files take it
        by_hidden = built.hidden_size // built.num_attention_heads
        head_dim = getattr(built, "head_dim", None)
        assert attention.head_size == (by_hidden if head_dim is None else head_dim)


def state_of(built: PreTrainedConfig) -> object:
    """The recurrent state's sizes as vLLM 0.33's model files read them from transformers'
    config (`get_mamba_state_shape_from_config`)."""
    if built.model_type == "jamba":
        return Mamba1State(
            built.mamba_expand * built.hidden_size, built.mamba_d_state, built.mamba_d_conv
        )
    if built.model_type == "qwen3_next":
        return GatedDeltaNetState(
            built.linear_num_key_heads,
            built.linear_num_value_heads,
            built.linear_key_head_dim,
            built.linear_value_head_dim,
            built.linear_conv_kernel_dim,
        )
    if built.model_type == "nemotron_h":
        return Mamba2State(
            built.mamba_num_heads * built.mamba_head_dim,
            built.n_groups,
            built.mamba_num_heads,
            built.mamba_head_dim,
            built.ssm_state_size,
            built.conv_kernel,
        )
    intermediate = built.mamba_expand * built.hidden_size
    if built.model_type == "falcon_h1" and built.mamba_d_ssm is not None:
        intermediate = built.mamba_d_ssm
    return Mamba2State(
        intermediate,
        built.mamba_n_groups,
        built.mamba_n_heads,
        built.mamba_d_head,
        built.mamba_d_state,
        built.mamba_d_conv,
    )


def test_a_nested_text_config_is_read_as_its_model_type() -> None:
    config = {
        "model_type": "NemotronH_Nano_VL_V2",
        "torch_dtype": "float16",
        "text_config": {"model_type": "nemotron_h", "hybrid_override_pattern": "M*"},
    }
    assert mamba_model_type(config) == "nemotron_h"
    model = read_mamba_hybrid_config(config)
    assert model.layer_types == ("linear_attention", "full_attention")
    assert model.model_dtype == "float16"  # the top level's dtype, the text config naming none
    assert mamba_model_type({"model_type": "llama"}) is None


# -- dtypes, as vLLM 0.33 picks them ------------------------------------------------------------


def test_dtypes_are_vllm_0_33s() -> None:
    # no dtype, or float32: bfloat16 (0.33's first dtype on a GPU with it; 0.8.5 took float16)
    none = resolve_dtypes_0_33(None)
    assert (none.model_dtype, none.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert none.note == (
        "config.json names no dtype: vLLM 0.33 reads float32 and runs bfloat16 (dtype=auto)"
    )
    assert resolve_dtypes_0_33("float32").note == (
        "float32 model: vLLM 0.33 runs it and its caches in bfloat16 (dtype=auto)"
    )
    half = resolve_dtypes_0_33("float16", kv_cache_dtype="fp8")
    assert (half.model_dtype, half.kv_cache_dtype, half.note) == (
        "float16",
        "float8_e4m3fn",
        None,
    )
    assert resolve_dtypes_0_33("bfloat16", dtype="half").model_dtype == "float16"
    with pytest.raises(InvalidArgumentError, match="got 'float32': pagedkv plans its attention"):
        resolve_dtypes_0_33("bfloat16", dtype="float32")
    with pytest.raises(InvalidArgumentError, match="got 'fp8_e5m2'"):
        resolve_dtypes_0_33("bfloat16", kv_cache_dtype="fp8_e5m2")


def test_state_dtypes_follow_the_mamba_cache_dtypes() -> None:
    bf16 = DTypeName("bfloat16")
    assert state_dtypes(bf16) == (bf16, bf16)
    assert state_dtypes(bf16, "float32") == ("float32", "float32")
    assert state_dtypes(bf16, "auto", "float32") == (bf16, "float32")
    # Nemotron-H: "auto" is config.json's mamba_ssm_cache_dtype (float32 by default)
    assert state_dtypes(bf16, config_ssm_dtype="float32") == (bf16, "float32")
    assert state_dtypes(bf16, "auto", "float16", "float32") == (bf16, "float16")
    assert read_mamba_hybrid_config({"model_type": "nemotron_h"}).state_dtypes == (bf16, "float32")
    nemotron = read_mamba_hybrid_config(
        {"model_type": "nemotron_h", "mamba_ssm_cache_dtype": "bfloat16"}
    )
    assert nemotron.state_dtypes == (bf16, bf16)
    assert read_mamba_hybrid_config({"model_type": "falcon_h1"}).state_dtypes == (bf16, bf16)
    with pytest.raises(InvalidArgumentError, match="mamba_cache_dtype must be one of auto"):
        state_dtypes(bf16, "fp8")


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model_type": "llama"},
            "config.json: model_type 'llama' is not a Mamba hybrid pagedkv knows (jamba, "
            "falcon_h1, nemotron_h, granitemoehybrid, qwen3_next)",
        ),
        (
            {"model_type": "jamba", "attn_layer_period": 4, "attn_layer_offset": 4},
            "config.json: attn_layer_offset=4 must be below attn_layer_period=4",
        ),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 3, "layer_types": ["full_attention"]},
            "config.json: 'layer_types' lists 1 layers, num_hidden_layers is 3",
        ),
        (
            {"model_type": "granitemoehybrid", "layer_types": []},
            "config.json: 'layer_types' must list each layer's type, got []",
        ),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": ""},
            "config.json: 'hybrid_override_pattern' must be a string of layer letters, got ''",
        ),
        (
            {"model_type": "falcon_h1", "mamba_n_heads": 0},
            "config.json: 'mamba_n_heads' must be an int >= 1, got 0",
        ),
        (
            {"model_type": "jamba", "head_dim": 64},
            "config.json: head_dim=64, but jamba's attention layers use hidden_size // "
            "num_attention_heads = 128; vLLM 0.33 would size their pages and its block-size "
            "alignment differently, which pagedkv does not plan",
        ),
        (
            {"model_type": "nemotron_h", "mamba_ssm_cache_dtype": "fp8"},
            "config.json's mamba_ssm_cache_dtype must be one of auto, float32, float16, "
            "bfloat16, got 'fp8'",
        ),
        ({"model_type": "jamba", "torch_dtype": 16}, "config.json: dtype must be a name, got 16"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        read_mamba_hybrid_config(config)
    assert str(refused.value) == message


def test_a_split_that_does_not_divide_a_state_is_refused_naming_it() -> None:
    falcon = read_mamba_hybrid_config({"model_type": "falcon_h1"})
    # 1,024 + 2 x 1 x 256 = 1,536 conv channels; with 1 group and tp 2 the group is copied
    assert falcon.state_shapes(2) == ((3, (1024 + 2 * 2 * 256) // 2), (64, 8, 256))
    with pytest.raises(InvalidArgumentError) as refused:
        falcon.state_shapes(3)
    assert str(refused.value) == (
        "tensor_parallel_size=3 must divide the Mamba convolution width=2560: each GPU keeps "
        "the same share of every recurrent state"
    )
    qwen = read_mamba_hybrid_config({"model_type": "qwen3_next"})
    with pytest.raises(InvalidArgumentError, match="must divide the value heads=32"):
        qwen.state_shapes(64)
