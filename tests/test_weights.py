"""The weights' memory estimated from a config.json (issue 22, item 2): parameters counted as
transformers builds the model (its own modules, on the meta device: nothing allocated), bytes in
vLLM's dtype, split over tensor-parallel ranks as vLLM splits them."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedConfig,
)

from pagedkv.planning.hf_config import read_hf_config
from pagedkv.planning.weights import (
    KV_HEADS,
    REPLICATED,
    WEIGHT_DEFAULTS,
    estimate_weights,
)
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName

CONFIGS = Path(__file__).parent / "configs"
BF16 = DTypeName("bfloat16")

# Parameters of each committed config as transformers 5.24 builds the model, and what the
# model cards say (rounded as they round it).
PARAMETERS = {
    "deepseek-v2-lite": (15_706_484_224, "15.7B"),
    "gemma-2-9b": (9_241_705_984, "9.24B"),
    "gemma-3-27b-it": (27_432_406_640, "27.4B"),
    "gemma-3-4b-it": (4_300_079_472, "4.3B"),
    "gpt-oss-120b": (116_829_156_672, "117B"),
    "gpt-oss-20b": (20_914_757_184, "21B"),
    "llama-3.1-70b": (70_553_706_496, "70.6B"),
    "llama-4-scout-17b-16e": (108_641_793_536, "109B"),
    "ministral-8b-instruct-2410": (8_019_808_256, "8.0B"),
    "mistral-7b-v0.1": (7_241_732_096, "7.24B"),
    "qwen2-7b-instruct": (7_615_616_512, "7.6B"),
}


def load(name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return config


def transformers_parameters(config: dict[str, Any]) -> int:
    built = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    model_class = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = model_class.from_config(built)
    return sum(parameter.numel() for parameter in model.parameters())


def test_every_committed_config_is_estimated() -> None:
    assert sorted(PARAMETERS) == sorted(path.stem for path in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_parameters_are_what_transformers_builds(name: str) -> None:
    config = load(name)
    estimate = estimate_weights(config, read_hf_config(config).model_dtype or BF16)
    expected, _ = PARAMETERS[name]
    assert estimate.parameters == expected
    assert transformers_parameters(config) == expected


@pytest.mark.parametrize("model_type", sorted(WEIGHT_DEFAULTS))
def test_defaults_are_transformers_class_defaults(model_type: str) -> None:
    cls = CONFIG_MAPPING[model_type]
    assert issubclass(cls, PreTrainedConfig)
    class_defaults = {
        field.name: field.default
        for field in dataclasses.fields(cls)
        if field.name in WEIGHT_DEFAULTS[model_type] and field.default is not None
    }
    assert dict(WEIGHT_DEFAULTS[model_type]) == class_defaults


def test_gpt_oss_experts_are_mxfp4_the_rest_bf16() -> None:
    # gpt-oss-120b: 114.7B expert weights at 17/32 byte (the checkpoint's 65 GB), 2.2B in bf16
    estimate = estimate_weights(load("gpt-oss-120b"), BF16)
    experts = next(part for part in estimate.parts if part.name == "experts" and part.num_bytes)
    assert estimate.quantization == "MXFP4 experts"
    # 36 * 128 * 3 * 2880 * 2880 = 114,661,785,600 expert weights * 17 / 32 + 2 * the rest
    assert estimate.num_bytes == 60_914_073_600 + 2 * 2_167_371_072 == 65_248_815_744
    assert estimate.describe() == "116,829,156,672 parameters, MXFP4 experts, bfloat16 elsewhere"
    assert experts.num_bytes < experts.parameters  # under a byte a weight
    twenty = estimate_weights(load("gpt-oss-20b"), BF16)
    assert twenty.num_bytes == 10_152_345_600 + 2 * 1_804_459_584 == 13_761_264_768


def test_tied_embeddings_are_counted_once_and_moe_counts_every_expert() -> None:
    gemma = load("gemma-3-4b-it")  # Gemma's classes tie the LM head to the embeddings
    tied = estimate_weights(gemma, BF16)
    untied = estimate_weights(
        {**gemma, "text_config": {**gemma["text_config"], "tie_word_embeddings": False}}, BF16
    )
    vocab_by_hidden = 262_208 * 2560
    assert untied.parameters - tied.parameters == vocab_by_hidden
    scout = estimate_weights(load("llama-4-scout-17b-16e"), BF16)
    experts = sum(part.parameters for part in scout.parts if part.name == "experts")
    assert experts == 48 * 16 * 3 * 5120 * 8192  # every layer MoE, 16 experts each


def test_each_gpu_holds_its_share_and_whole_kv_heads() -> None:
    # Llama-3.1-70B, 8 KV heads: up to tp 8 everything splits evenly (but the norms); at tp 16
    # each GPU holds one KV head's projections, as two GPUs share each head.
    estimate = estimate_weights(load("llama-3.1-70b"), BF16)
    replicated = sum(p.num_bytes for p in estimate.parts if p.split == REPLICATED)
    kv = sum(p.num_bytes for p in estimate.parts if p.split == KV_HEADS)
    assert estimate.bytes_per_gpu(1) == estimate.num_bytes == 141_107_412_992
    even = (estimate.num_bytes - replicated) / 8 + replicated
    assert estimate.bytes_per_gpu(8) == pytest.approx(even, abs=8)
    assert estimate.bytes_per_gpu(16) == pytest.approx(
        (estimate.num_bytes - replicated - kv) / 16 + kv / 8 + replicated, abs=16
    )
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size"):
        estimate.bytes_per_gpu(0)


def test_the_dtype_sets_the_bytes() -> None:
    config = load("mistral-7b-v0.1")
    assert estimate_weights(config, DTypeName("float32")).num_bytes == 4 * 7_241_732_096
    assert estimate_weights(config, BF16).num_bytes == 2 * 7_241_732_096


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "mamba", "torch_dtype": "bfloat16"}, "model_type 'mamba'"),
        ({"num_hidden_layers": 2}, "model_type None"),
        (
            {**load("mistral-7b-v0.1"), "quantization_config": {"quant_method": "awq"}},
            "quant_method 'awq'",
        ),
        ({**load("mistral-7b-v0.1"), "vocab_size": "32k"}, "'vocab_size' must be an int"),
    ],
)
def test_what_cannot_be_estimated_is_refused_asking_for_weights(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as refused:
        estimate_weights(config, BF16)
    assert "give --weights" in str(refused.value)
