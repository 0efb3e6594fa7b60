"""config.json read as transformers reads it: pagedkv's layer layouts and defaults against
transformers' own config classes (transformers is a dev dependency; `pagedkv` never imports it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import CONFIG_MAPPING, Gemma3Config, PreTrainedConfig

from pagedkv.planning.hf_config import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LAYER_KINDS,
    SLIDING_ATTENTION,
    TRANSFORMERS_DEFAULTS,
    layer_types,
    read_hf_config,
)
from pagedkv.vocab.errors import InvalidArgumentError

CONFIGS = Path(__file__).parent / "configs"

READ_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_chunk_size",
    "no_rope_layer_interval",
)


def transformers_config(config: dict[str, Any]) -> PreTrainedConfig:
    """What transformers builds from `config`: its model type's class, the text part."""
    built = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    text = built.get_text_config()
    assert isinstance(text, PreTrainedConfig)
    return text


def transformers_view(config: dict[str, Any]) -> tuple[object, ...]:
    """Layers, KV heads, head size, window, chunk, each layer's attention, max positions, as
    the model code reads them from transformers' config (a class without `layer_types` applies
    `sliding_window` to every layer)."""
    text = transformers_config(config)
    num_layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None) or None  # Qwen2-MoE writes 0 for none
    chunk = getattr(text, "attention_chunk_size", None) or None
    kinds = getattr(text, "layer_types", None) or [SLIDING_ATTENTION] * num_layers
    kinds = [
        FULL_ATTENTION
        if (kind == SLIDING_ATTENTION and not window) or (kind == CHUNKED_ATTENTION and not chunk)
        else kind
        for kind in kinds
    ]
    heads = text.num_attention_heads
    return (
        num_layers,
        text.num_key_value_heads or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
        window if SLIDING_ATTENTION in kinds else None,
        chunk if CHUNKED_ATTENTION in kinds else None,
        tuple(kinds),
        text.max_position_embeddings,
    )


def pagedkv_view(config: dict[str, Any]) -> tuple[object, ...]:
    read = read_hf_config(config)
    shape = read.shape
    return (
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_size,
        shape.sliding_window,
        shape.attention_chunk_size,
        read.layer_types,
        read.max_position_embeddings,
    )


def without_layer_types(config: PreTrainedConfig) -> dict[str, Any]:
    """`config.to_dict()` as a config.json saved before its class had `layer_types`."""
    saved = config.to_dict()
    for part in (saved, saved.get("text_config") or {}):
        part.pop("layer_types", None)
    return saved


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_DEFAULTS))
def test_defaults_are_transformers_class_defaults(model_type: str) -> None:
    cls = CONFIG_MAPPING[model_type]
    class_defaults = {
        field.name: field.default
        for field in dataclasses.fields(cls)
        if field.name in READ_FIELDS and field.default is not None
    }
    assert dict(TRANSFORMERS_DEFAULTS[model_type].fields) == class_defaults


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_DEFAULTS))
def test_a_config_with_only_its_model_type_reads_as_in_transformers(model_type: str) -> None:
    bare = {"model_type": model_type, "torch_dtype": "bfloat16"}
    assert pagedkv_view(bare) == transformers_view(bare)


CASES: list[tuple[str, dict[str, Any]]] = [
    ("gemma2", {"num_hidden_layers": 42}),
    ("gemma2", {"num_hidden_layers": 7}),
    ("gemma2", {"num_hidden_layers": 1}),
    ("gemma3_text", {"num_hidden_layers": 34, "sliding_window": 1024}),
    ("gemma3_text", {"num_hidden_layers": 12, "sliding_window_pattern": 3}),
    ("gemma3_text", {"num_hidden_layers": 5}),
    ("cohere2", {"num_hidden_layers": 40}),
    ("cohere2", {"num_hidden_layers": 9, "sliding_window_pattern": 3}),
    ("gpt_oss", {"num_hidden_layers": 24}),
    ("mistral", {}),
    ("mistral", {"sliding_window": None}),
    ("ministral", {"num_hidden_layers": 6}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True}),
    ("qwen2", {"use_sliding_window": True, "num_hidden_layers": 28, "max_window_layers": 21}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}),
    ("qwen2_moe", {"use_sliding_window": True, "max_window_layers": 10}),
    ("qwen2_moe", {"use_sliding_window": False}),
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 20}),
    ("qwen3_moe", {"use_sliding_window": True}),
    ("qwen3_moe", {}),
]


@pytest.mark.parametrize(("model_type", "kwargs"), CASES)
def test_layer_split_without_layer_types_is_transformers(
    model_type: str, kwargs: dict[str, Any]
) -> None:
    saved = without_layer_types(CONFIG_MAPPING[model_type](**kwargs))
    assert pagedkv_view(saved) == transformers_view(saved)


@pytest.mark.parametrize(("model_type", "kwargs"), CASES)
def test_layer_split_with_layer_types_is_transformers(
    model_type: str, kwargs: dict[str, Any]
) -> None:
    saved = CONFIG_MAPPING[model_type](**kwargs).to_dict()
    assert pagedkv_view(saved) == transformers_view(saved)
    assert read_hf_config(saved).layer_types_note is None


def test_gemma3_multimodal_config_without_layer_types() -> None:
    wrapper = Gemma3Config(
        text_config={"num_hidden_layers": 34, "sliding_window": 1024, "sliding_window_pattern": 3}
    )
    saved = without_layer_types(wrapper)
    assert pagedkv_view(saved) == transformers_view(saved)
    assert layer_types(saved)[:3] == (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda path: path.stem)
def test_committed_configs_read_as_in_transformers(path: Path) -> None:
    config = json.loads(path.read_text())
    ours, theirs = pagedkv_view(config), transformers_view(config)
    if read_hf_config(config).shape.use_mla:  # one latent of kv_lora_rank + rope dims
        text = transformers_config(config)
        assert ours[2] == text.kv_lora_rank + text.qk_rope_head_dim
        ours, theirs = ours[:1] + ours[3:], theirs[:1] + theirs[3:]
    assert ours == theirs


def test_gemma2_9b_without_layer_types_is_21_sliding_and_21_full() -> None:
    read = read_hf_config(json.loads((CONFIGS / "gemma-2-9b.json").read_text()))
    assert read.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 21
    assert read.shape.num_sliding_window_layers == 21
    assert read.layer_types_note == "no layer_types in config.json: transformers' gemma2 layout"


def test_an_unknown_model_type_takes_the_window_on_every_layer_and_says_so() -> None:
    config = {
        "model_type": "not_a_model",
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "hidden_size": 16,
        "sliding_window": 8,
        "torch_dtype": "bfloat16",
    }
    read = read_hf_config(config)
    assert read.layer_types == (SLIDING_ATTENTION,) * 3
    assert read.layer_types_note == (
        "no layer_types, and model_type 'not_a_model' has no layout pagedkv knows: "
        "window on every layer"
    )
    no_type = {key: value for key, value in config.items() if key != "model_type"}
    assert read_hf_config(no_type).layer_types_note == (
        "no layer_types, and a config without model_type has no layout pagedkv knows: "
        "window on every layer"
    )
    # the switch vLLM and transformers read for every model type
    assert read_hf_config(dict(config, use_sliding_window=False)).shape.sliding_window is None


def other_layer_configs() -> list[tuple[str, dict[str, Any]]]:
    """Every model type whose transformers class gives a layer type other than full, sliding
    or chunked attention, its config as saved and as saved before the class had
    `layer_types` (the class derives them again when it reads it)."""
    found = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            built = CONFIG_MAPPING[model_type]()
            kinds = getattr(built.get_text_config(), "layer_types", None)
            saved = built.to_dict()
        except Exception:  # a class that cannot build its own defaults
            continue
        if isinstance(kinds, (list, tuple)) and set(kinds) - set(LAYER_KINDS):
            found += [(model_type, saved), (model_type, without_layer_types(built))]
    return found


def test_every_model_with_other_layers_is_refused_by_name_never_planned() -> None:
    found = other_layer_configs()
    assert {"jamba", "qwen3_next", "bamba", "kimi_linear", "deepseek_v32"} <= {
        model_type for model_type, _ in found
    }
    for model_type, config in found:
        with pytest.raises(InvalidArgumentError) as refused:
            read_hf_config(config)
        message = str(refused.value)
        if message != "config.json: 'num_hidden_layers' must be an int, got None":  # no LLM
            assert "pagedkv plans" in message or "read it with" in message, (model_type, message)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model_type": "jamba"},
            "config.json: model_type 'jamba' has Mamba or linear-attention layers: read it "
            "with pagedkv.planning.hf_mamba.read_mamba_hybrid_config (pagedkv plan does)",
        ),
        (
            {"model_type": "qwen3_5", "layer_types": ["full_attention", "linear_attention"]},
            "config.json: layer 1 is 'linear_attention'; pagedkv plans 'full_attention', "
            "'sliding_attention', 'chunked_attention' layers, and the Mamba and "
            "linear-attention layers of jamba, falcon_h1, nemotron_h, granitemoehybrid, "
            "qwen3_next only",
        ),
        (
            {"model_type": "minimax", "num_hidden_layers": 2},
            "config.json: model_type 'minimax' has 'linear_attention' layers; pagedkv plans "
            "'full_attention', 'sliding_attention', 'chunked_attention' layers, and the Mamba "
            "and linear-attention layers of jamba, falcon_h1, nemotron_h, granitemoehybrid, "
            "qwen3_next only",
        ),
        (
            {
                "model_type": "bamba",
                "num_hidden_layers": 32,
                "attn_layer_indices": [9, 18],
                "mamba_n_heads": 128,
                "mamba_d_head": 64,
                "mamba_n_groups": 1,
                "mamba_d_state": 128,
                "mamba_d_conv": 4,
            },
            "config.json: model_type 'bamba' has layers other than attention "
            "(attn_layer_indices, mamba_n_heads, mamba_d_head, mamba_n_groups, ...); pagedkv "
            "plans 'full_attention', 'sliding_attention', 'chunked_attention' layers, and the "
            "Mamba and linear-attention layers of jamba, falcon_h1, nemotron_h, "
            "granitemoehybrid, qwen3_next only",
        ),
    ],
)
def test_layers_pagedkv_does_not_plan_as_attention_are_refused_word_for_word(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        read_hf_config(config)
    assert str(refused.value) == message
    with pytest.raises(InvalidArgumentError):
        layer_types(config)


def test_older_layer_type_names_read_as_transformers_reads_them() -> None:
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "attention"],
    }
    assert read_hf_config(config).layer_types == (SLIDING_ATTENTION, FULL_ATTENTION)
    assert transformers_view(config)[5] == (SLIDING_ATTENTION, FULL_ATTENTION)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["sliding_attention"]}, "one type for each of the 2 layers"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "layer 1 is 'linear_attention'"),
        ({"sliding_window": "4k"}, "'sliding_window' must be an int"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' must be an int"),
        ({"torch_dtype": 16}, "dtype must be a name"),
        ({"torch_dtype": "float12"}, "unknown KV cache dtype 'float12'"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
        **change,
    }
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(")):
        read_hf_config(config)
