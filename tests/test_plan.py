"""`pagedkv plan`: the chapter's Llama-2-13B example, window and MLA models, errors, sizes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.planning.byte_sizes import parse_size
from pagedkv.planning.hf_config import read_hf_config
from pagedkv.planning.plan import ModelShape, RequestDoesNotFitError, make_plan, resolve_dtypes
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, dtype_name

GiB = 1 << 30
CONFIGS = Path(__file__).parent / "configs"

# Llama-2-13b-hf's config.json, the fields that matter (head_dim = 5120 / 40 = 128).
LLAMA2_13B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 40,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}

# The plan of the chapter's worked example, 40 GiB for the KV cache:
# 2 * 16 * 40 * 128 * 2 = 327,680-byte pages; * 40 layers = 13,107,200 bytes (12.5 MiB) a block;
# / 16 tokens = 819,200 bytes a token; 40 GiB // 327,680 // 40 = 3,276 blocks = 52,416 tokens;
# 4,096 tokens = 256 blocks a request; 52,416 / 4,096 = 12.80x; (3,276 - 1) // 256 = 12.
LLAMA2_13B_PLAN = """\
model            40 layers, full attention, 40 KV heads x 128, float16
block size       16 tokens
page size        327,680 bytes (320.00 KiB) per layer
block            13,107,200 bytes (12.50 MiB) over 40 layers
bytes per token  819,200 bytes (800.00 KiB)
KV budget        42,949,672,960 bytes (40.00 GiB)
blocks           3,276 (block 0 is the null block)
KV capacity      52,416 tokens
max_model_len    4,096 tokens (256 blocks per request)
max concurrency  12.80x (12 whole requests at once)
"""


def shape_of(config: Mapping[str, object], **dtypes: str) -> ModelShape:
    return read_hf_config(config, **dtypes).shape


def write_config(tmp_path: Path, config: dict[str, object]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# -- the chapter's example -------------------------------------------------------------------


def test_llama2_13b_from_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    assert plan(capsys, "--config", config, "--memory-budget", "40GiB") == (
        0,
        LLAMA2_13B_PLAN,
        "",
    )


def test_llama2_13b_from_flags(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = plan(
        capsys,
        *("--num-layers", "40", "--num-kv-heads", "40", "--head-size", "128"),
        *("--dtype", "fp16", "--max-model-len", "4096", "--memory-budget", "42949672960"),
    )
    assert (status, out) == (0, LLAMA2_13B_PLAN)


def test_llama2_13b_plan_numbers() -> None:
    shape = shape_of(LLAMA2_13B_CONFIG)
    assert shape == ModelShape(
        num_layers=40,
        num_kv_heads=40,
        head_size=128,
        dtype=dtype_name("float16"),
        num_attention_heads=40,
    )
    result = make_plan(shape, 40 * GiB, block_size=16, max_model_len=4096)
    assert result.page_size_bytes == 327_680
    assert result.block_bytes == 13_107_200
    assert result.bytes_per_token == 819_200
    assert result.num_blocks == 3276
    assert result.capacity_tokens == 52_416
    assert result.blocks_per_request == 256
    assert result.max_concurrency == 52_416 / 4096 == 12.796875
    assert result.max_whole_requests == 12
    assert result.config.kv_cache_groups[0].kv_cache_spec == FullAttentionSpec(
        block_size=16, num_kv_heads=40, head_size=128, dtype="float16"
    )


def test_llama2_13b_on_a_gpu_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.9 * 80 GiB - 26 GiB of weights and activations = 46 GiB = 49,392,123,904 bytes
    # // 327,680 // 40 = 3,768 blocks (3,768.4)
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    status, out, _ = plan(
        capsys, "--config", config, "--gpu-memory", "80GiB", "--non-kv-memory", "26GiB"
    )
    assert status == 0
    assert "KV budget        49,392,123,904 bytes (46.00 GiB)\n" in out
    assert "blocks           3,768 (block 0 is the null block)\n" in out


def test_llama2_13b_that_does_not_fit_names_the_largest_max_model_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    status, out, err = plan(capsys, "--config", config, "--memory-budget", "2GiB")
    assert (status, out) == (1, "")
    assert err == (
        "pagedkv plan: does not fit: one request of max_model_len=4,096 needs 3.12 GiB "
        "(3,355,443,200 bytes) of KV cache, more than the 2.00 GiB (2,147,483,648 bytes) "
        "available; the largest max_model_len that fits is 2,608. Raise "
        "gpu_memory_utilization or lower max_model_len.\n"
    )
    # and that length does fit
    status, out, _ = plan(
        capsys, "--config", config, "--memory-budget", "2GiB", "--max-model-len", "2608"
    )
    assert status == 0
    assert "blocks           163 (block 0 is the null block)\n" in out


def test_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    status, out, _ = plan(
        capsys,
        *("--config", config, "--memory-budget", "40GiB", "--num-gpu-blocks-override", "300"),
    )
    assert status == 0
    assert "blocks           300 (block 0 is the null block)\n" in out
    assert "KV capacity      4,800 tokens\n" in out
    # 4,800 / 4,096 = 1.17x; (300 - 1) // 256 = 1
    assert "max concurrency  1.17x (1 whole requests at once)\n" in out


# -- other shapes ---------------------------------------------------------------------------


def test_sliding_window_model(capsys: pytest.CaptureFixture[str]) -> None:
    # Mistral-7B-like: 32 layers, 8 KV heads x 128, bf16, window 4,096; 2,048 tokens a step.
    # 0.9 * 80 GiB - 15 GiB = 57 GiB = 61,203,283,968 bytes; // 65,536 // 32 = 29,184 blocks.
    # A request: min(4,095 + 2,048, 32,768) = 6,143 tokens -> cdiv(6,143, 16) + 1 = 385 blocks;
    # (29,184 - 1) // 385 = 75 at once; 466,944 tokens / 32,768 = 14.25x.
    status, out, _ = plan(
        capsys,
        *("--num-layers", "32", "--num-kv-heads", "8", "--head-size", "128", "--dtype", "bf16"),
        *("--sliding-window", "4096", "--max-model-len", "32768"),
        *("--max-num-batched-tokens", "2048", "--gpu-memory", "80GiB", "--non-kv-memory", "15GiB"),
    )
    assert status == 0
    assert out == (
        "model            32 layers, sliding window 4,096, 8 KV heads x 128, bfloat16\n"
        "block size       16 tokens\n"
        "page size        65,536 bytes (64.00 KiB) per layer\n"
        "block            2,097,152 bytes (2.00 MiB) over 32 layers\n"
        "bytes per token  131,072 bytes (128.00 KiB)\n"
        "KV budget        61,203,283,968 bytes (57.00 GiB)\n"
        "blocks           29,184 (block 0 is the null block)\n"
        "KV capacity      466,944 tokens\n"
        "max_model_len    32,768 tokens (385 blocks per request)\n"
        "max batched      2,048 tokens per step\n"
        "max concurrency  14.25x (75 whole requests at once)\n"
    )


def test_mla_model_from_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSeek-V2-Lite-like: 27 layers, latent 512 + rope 64 = 576, bf16.
    # page 1 * 16 * 1 * 576 * 2 = 18,432; block 18,432 * 27 = 497,664; token 31,104.
    # 10 GiB // 18,432 = 582,542 // 27 = 21,575 blocks = 345,200 tokens;
    # 8,192 tokens = 512 blocks; 345,200 / 8,192 = 42.14x; 21,574 // 512 = 42.
    config = write_config(
        tmp_path,
        {
            "model_type": "deepseek_v2",
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "hidden_size": 2048,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 163840,
            "torch_dtype": "bfloat16",
        },
    )
    status, out, _ = plan(
        capsys, "--config", config, "--memory-budget", "10GiB", "--max-model-len", "8192"
    )
    assert status == 0
    assert out == (
        "model            27 layers, full attention, MLA latent of 576, bfloat16\n"
        "block size       16 tokens\n"
        "page size        18,432 bytes (18.00 KiB) per layer\n"
        "block            497,664 bytes (486.00 KiB) over 27 layers\n"
        "bytes per token  31,104 bytes (30.38 KiB)\n"
        "KV budget        10,737,418,240 bytes (10.00 GiB)\n"
        "blocks           21,575 (block 0 is the null block)\n"
        "KV capacity      345,200 tokens\n"
        "max_model_len    8,192 tokens (512 blocks per request)\n"
        "max concurrency  42.14x (42 whole requests at once)\n"
    )


HYBRID_CONFIG = {
    "num_hidden_layers": 4,
    "num_attention_heads": 1,
    "hidden_size": 2,
    "torch_dtype": "float16",
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 64,
}


def test_hybrid_layer_types_are_planned_as_full_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4 layers, 2 with a window of 4, block 4, fp16, 1 head of 2: 32-byte pages. vLLM's check
    # on the layers as given: 2 * cdiv(64, 4) + 2 * (cdiv(3 + 4, 4) + 1) = 38 pages = 1,216
    # bytes. Planned as full: 4 * 16 = 64 pages = 2,048 bytes; 4,096 bytes hold
    # 4,096 // 32 // 4 = 32 blocks, (32 - 1) // 16 = 1 whole request.
    config = write_config(tmp_path, HYBRID_CONFIG)
    shape = shape_of(HYBRID_CONFIG)
    assert (shape.sliding_window, shape.num_sliding_window_layers) == (4, 2)
    status, out, _ = plan(
        capsys,
        *("--config", config, "--memory-budget", "4096", "--block-size", "4"),
        *("--max-num-batched-tokens", "4"),
    )
    assert status == 0
    assert out.splitlines()[:2] == [
        "model            4 layers, 2 sliding window 4 + 2 full attention, 1 KV heads x 2, float16",
        "note             sliding and full layers mixed: all planned as full",
    ]
    assert "blocks           32 (block 0 is the null block)" in out
    assert "(16 blocks per request)" in out
    assert "(1 whole requests at once)" in out


def test_a_budget_that_fits_only_the_window_layers_as_given_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1,216 bytes pass vLLM 0.8.5's check (38 pages as given) but not the 64 pages the layers
    # need as planned; 1,216 // 32 // 4 = 9 blocks of 4 tokens: the largest length is 36.
    config = write_config(tmp_path, HYBRID_CONFIG)
    argv = ("--config", config, "--memory-budget", "1216", "--block-size", "4")
    status, out, err = plan(capsys, *argv, "--max-num-batched-tokens", "4")
    assert (status, out) == (1, "")
    assert err == (
        "pagedkv plan: does not fit: with its sliding-window layers planned as full attention "
        "(one block table for every layer, as vLLM 0.8.5 does; its start-up check counts them "
        "by their window and would pass), one request of max_model_len=64 needs 0.00 GiB "
        "(2,048 bytes) of KV cache, more than the 0.00 GiB (1,216 bytes) available; the "
        "largest max_model_len that fits is 36. Raise gpu_memory_utilization or lower "
        "max_model_len.\n"
    )
    with pytest.raises(RequestDoesNotFitError) as refused:
        make_plan(
            shape_of(HYBRID_CONFIG), 1216, block_size=4, max_model_len=64, max_num_batched_tokens=4
        )
    assert (refused.value.needed_bytes, refused.value.available_bytes) == (2048, 1216)
    assert (refused.value.largest_max_model_len, refused.value.planned_as_full_attention) == (
        36,
        True,
    )
    status, out, _ = plan(capsys, *argv, "--max-model-len", "36")
    assert status == 0
    assert "blocks           9 (block 0 is the null block)" in out


def test_hf_config_variants() -> None:
    # no num_key_value_heads: one KV head per attention head; head_dim given explicitly
    shape = shape_of(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "hidden_size": 512,
            "head_dim": 128,
            "torch_dtype": "bfloat16",
        }
    )
    assert (shape.num_kv_heads, shape.head_size, shape.dtype) == (8, 128, "bfloat16")
    # Qwen2 style: a window that is switched off
    qwen = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "bfloat16",
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    assert shape_of(qwen).sliding_window is None
    # Mistral style: a window on every layer
    mistral = dict(qwen, use_sliding_window=True)
    assert shape_of(mistral).num_sliding_window_layers == 2
    # a multimodal model's text_config; the KV dtype may be chosen over the model's
    wrapped = {"model_type": "llava", "text_config": qwen, "torch_dtype": "float16"}
    assert shape_of(wrapped, kv_cache_dtype="fp8").dtype == "float8_e4m3fn"
    assert shape_of(wrapped).dtype == "bfloat16"
    with pytest.raises(InvalidArgumentError, match="'num_hidden_layers' must be an int"):
        shape_of({"num_attention_heads": 4})
    # no dtype: vLLM reads float32, and runs a float32 model in float16
    untyped = read_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8})
    assert untyped.shape.dtype == "float16"
    assert untyped.dtype_note == (
        "config.json names no dtype: vLLM reads float32 and runs float16 (dtype=auto)"
    )


def test_flags_override_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    # fp8 KV cache: half the page; block 32: twice the page
    status, out, _ = plan(
        capsys,
        *("--config", config, "--memory-budget", "40GiB", "--kv-cache-dtype", "fp8"),
        *("--block-size", "32", "--max-model-len", "2048"),
    )
    assert status == 0
    assert "40 KV heads x 128, float8_e4m3fn" in out
    assert "page size        327,680 bytes (320.00 KiB) per layer" in out
    assert "max_model_len    2,048 tokens (64 blocks per request)" in out


SMALL = ("--num-layers", "2", "--num-kv-heads", "1", "--head-size", "8", "--dtype", "fp16")
GQA8 = ("--num-layers", "2", "--num-kv-heads", "8", "--head-size", "8", "--dtype", "fp16")

# -- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory-budget", "1GiB"], "give --config or --num-layers"),
        (
            [*SMALL, "--max-model-len", "8"],
            "give exactly one of --memory-budget and --gpu-memory",
        ),
        (
            [*SMALL, "--memory-budget", "1GiB", "--gpu-memory", "80GiB", "--max-model-len", "8"],
            "give exactly one of --memory-budget and --gpu-memory",
        ),
        (
            [*SMALL, "--memory-budget", "1GiB"],
            "give --max-model-len",
        ),
        (
            [*SMALL[:-1], "fp12", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "unknown KV cache dtype 'fp12'",
        ),
        (
            [
                *SMALL,
                "--mla",
                "--sliding-window",
                "8",
                "--memory-budget",
                "1GiB",
                "--max-model-len",
                "8",
            ],
            "MLA is not supported with a sliding window",
        ),
        (
            [
                *SMALL,
                "--gpu-memory",
                "80GiB",
                "--gpu-memory-utilization",
                "1.5",
                "--max-model-len",
                "8",
            ],
            "gpu_memory_utilization must be in (0, 1]",
        ),
        (
            [*SMALL, "--memory-budget", "1GiB", "--max-model-len", "8", "--block-size", "0"],
            "block_size must be an int >= 1",
        ),
        (["--config", "/nonexistent/config.json", "--memory-budget", "1GiB"], "cannot read"),
        (
            [*SMALL[:-2], "--memory-budget", "1GiB", "--max-model-len", "8"],
            "give --config or --dtype (without a config.json, --dtype cannot be auto)",
        ),
        (
            [*SMALL[:-1], "fp8", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "dtype must be auto, float16, bfloat16 or float32 (the model's dtype), got 'fp8'; "
            "for an fp8 KV cache give kv_cache_dtype fp8",
        ),
        (
            [*SMALL, "--kv-cache-dtype", "fp16", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "kv_cache_dtype must be auto or one of fp8, fp8_e4m3, fp8_e5m2",
        ),
        (
            [*SMALL, "--memory-budget", "1GiB", "--weights", "1GiB", "--max-model-len", "8"],
            "--weights and --non-kv-memory go with --gpu-memory",
        ),
        (
            [*GQA8, "--tp", "3", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "tensor_parallel_size=3 must divide num_kv_heads=8",
        ),
        (
            [*GQA8, "--tp", "12", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "tensor_parallel_size=12 must be a multiple of num_kv_heads=8",
        ),
        (
            [*GQA8, "--tp", "0", "--memory-budget", "1GiB", "--max-model-len", "8"],
            "tensor_parallel_size must be an int >= 1, got 0",
        ),
        (
            [
                "--config",
                str(CONFIGS / "llama-3.1-70b.json"),
                "--tp",
                "24",
                "--memory-budget",
                "1GiB",
            ],
            "tensor_parallel_size=24 must divide num_attention_heads=64",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = plan(capsys, *argv)
    assert (status, out) == (2, "")
    assert err.startswith("pagedkv plan: error: ")
    assert message in err


def test_no_memory_left_on_the_gpu_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = plan(
        capsys,
        *("--num-layers", "2", "--num-kv-heads", "1", "--head-size", "8", "--dtype", "fp16"),
        *("--gpu-memory", "16GiB", "--non-kv-memory", "15GiB", "--max-model-len", "8"),
    )
    assert (status, out) == (1, "")
    # 0.9 * 16 GiB = 14.4 GiB usable; 15 GiB is 93.75% of the GPU
    assert err == (
        "pagedkv plan: does not fit: the model needs 16,106,127,360 bytes (15.00 GiB) on each "
        "GPU besides its KV cache, more than the 15,461,882,265 bytes (14.40 GiB) that "
        "gpu_memory_utilization=0.9 allows of the GPU's 17,179,869,184 bytes (16.00 GiB): "
        "nothing is left for the KV cache. To fit, raise gpu_memory_utilization above 0.938, "
        "use a GPU with more memory or split the model over more GPUs (tensor_parallel_size).\n"
    )


def test_make_plan_raises_what_the_cli_reports() -> None:
    shape = shape_of(LLAMA2_13B_CONFIG)
    with pytest.raises(KVCacheConfigError, match="largest max_model_len that fits is 2,608"):
        make_plan(shape, 2 * GiB, block_size=16, max_model_len=4096)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("42949672960", 40 * GiB),
        ("40GiB", 40 * GiB),
        ("40 gib", 40 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 << 20),
        ("2KiB", 2048),
        ("3kb", 3000),
        ("1TiB", 1 << 40),
        ("7B", 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "40G", "-1GiB", "1.5", "0.3KiB", "forty"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_size(text)


def test_a_bad_size_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--memory-budget", "40G"])
    assert exited.value.code == 2
    assert "not a memory size: '40G'" in capsys.readouterr().err


def test_changing_the_layer_count_keeps_the_configs_window_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {
        "num_hidden_layers": 4,
        "num_attention_heads": 1,
        "hidden_size": 2,
        "torch_dtype": "float16",
        "sliding_window": 4,
        "max_position_embeddings": 64,
    }
    mixed = write_config(
        tmp_path, dict(base, layer_types=["sliding_attention", "full_attention"] * 2)
    )
    budget = ("--memory-budget", "1MiB", "--block-size", "4")
    # 2 of 4 layers use the window; with 6 layers still 2; with 1 layer, that 1
    for num_layers, kind in [
        ("6", "6 layers, 2 sliding window 4 + 4 full attention"),
        ("1", "1 layers, sliding window 4"),
    ]:
        status, out, _ = plan(capsys, "--config", mixed, "--num-layers", num_layers, *budget)
        assert status == 0
        assert out.startswith(f"model            {kind}, ")
    # a window on every layer stays on every layer; --no-sliding-window removes it
    everywhere = str(tmp_path / "everywhere.json")
    Path(everywhere).write_text(json.dumps(base))
    status, out, _ = plan(capsys, "--config", everywhere, "--num-layers", "6", *budget)
    assert out.startswith("model            6 layers, sliding window 4, ")
    status, out, _ = plan(capsys, "--config", everywhere, "--no-sliding-window", *budget)
    assert out.startswith("model            4 layers, full attention, ")


# -- transformers' layer layouts, vLLM's dtypes (tests/configs) ------------------------------


def config_path(name: str) -> str:
    return str(CONFIGS / f"{name}.json")


# google/gemma-2-9b: float32, no layer_types; transformers alternates window and full layers.
# float16 (vLLM's dtype=auto for float32): 2 * 16 * 8 * 256 * 2 = 131,072-byte pages; * 42 =
# 5,505,024 a block; / 16 = 344,064 a token; 20 GiB // 131,072 // 42 = 3,900 blocks = 62,400
# tokens; all layers planned as full: 8,192 / 16 = 512 blocks a request; 62,400 / 8,192 = 7.62x;
# 3,899 // 512 = 7.
GEMMA2_9B_PLAN = """\
model            42 layers, 21 sliding window 4,096 + 21 full attention, 8 KV heads x 256, float16
note             no layer_types in config.json: transformers' gemma2 layout
note             float32 model: vLLM runs it and its KV cache in float16 (dtype=auto)
note             sliding and full layers mixed: all planned as full
block size       16 tokens
page size        131,072 bytes (128.00 KiB) per layer
block            5,505,024 bytes (5.25 MiB) over 42 layers
bytes per token  344,064 bytes (336.00 KiB)
KV budget        21,474,836,480 bytes (20.00 GiB)
blocks           3,900 (block 0 is the null block)
KV capacity      62,400 tokens
max_model_len    8,192 tokens (512 blocks per request)
max batched      8,192 tokens per step
max concurrency  7.62x (7 whole requests at once)
"""


def test_gemma2_without_layer_types_is_planned_as_transformers_lays_it_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = plan(
        capsys, "--config", config_path("gemma-2-9b"), "--memory-budget", "20GiB"
    )
    assert (status, out, err) == (0, GEMMA2_9B_PLAN, "")


def test_gemma2_with_layer_types_plans_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads(Path(config_path("gemma-2-9b")).read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"] * 21
    status, out, _ = plan(
        capsys, "--config", write_config(tmp_path, config), "--memory-budget", "20GiB"
    )
    assert status == 0
    assert out == GEMMA2_9B_PLAN.replace(
        "note             no layer_types in config.json: transformers' gemma2 layout\n", ""
    )


def test_gemma2_that_fits_only_read_as_all_window_layers_does_not_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 2,400 MiB = 19,200 pages of 131,072 bytes; 2,048 tokens a step. Every layer a window
    # layer (the old reading) needs 42 * (cdiv(4,095 + 2,048, 16) + 1) = 16,170 pages: fits.
    # transformers' 21 + 21: vLLM's check needs 21 * 385 + 21 * 512 = 18,837 pages (passes),
    # but planned as full attention 42 * 512 = 21,504: does not fit. 19,200 // 42 = 457
    # blocks a layer = 7,312 tokens.
    argv: tuple[str, ...] = ("--config", config_path("gemma-2-9b"), "--memory-budget", "2400MiB")
    argv += ("--max-num-batched-tokens", "2048")
    status, out, _ = plan(capsys, *argv, "--sliding-window-layers", "42")
    assert status == 0
    assert "(385 blocks per request)" in out
    status, out, err = plan(capsys, *argv)
    assert (status, out) == (1, "")
    assert err.startswith(
        "pagedkv plan: does not fit: with its sliding-window layers planned as full attention"
    )
    assert (
        "one request of max_model_len=8,192 needs 2.62 GiB (2,818,572,288 bytes) of KV cache, "
        "more than the 2.34 GiB (2,516,582,400 bytes) available; the largest max_model_len "
        "that fits is 7,312." in err
    )


@pytest.mark.parametrize(
    ("name", "model", "notes"),
    [
        (
            "gemma-3-4b-it",
            "34 layers, 29 sliding window 1,024 + 5 full attention, 4 KV heads x 256, bfloat16",
            [
                "no layer_types in config.json: transformers' gemma3_text layout",
                "sliding and full layers mixed: all planned as full",
            ],
        ),
        ("mistral-7b-v0.1", "32 layers, sliding window 4,096, 8 KV heads x 128, bfloat16", []),
        ("qwen2-7b-instruct", "28 layers, full attention, 4 KV heads x 128, bfloat16", []),
    ],
)
def test_model_line_and_notes_of_the_committed_configs(
    capsys: pytest.CaptureFixture[str], name: str, model: str, notes: list[str]
) -> None:
    status, out, _ = plan(
        capsys,
        *("--config", config_path(name), "--memory-budget", "40GiB", "--max-model-len", "8192"),
    )
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == f"model            {model}"
    assert [line[17:] for line in lines if line.startswith("note")] == notes


def test_qwen2_with_its_window_switched_on_uses_transformers_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads(Path(config_path("qwen2-7b-instruct")).read_text())
    config.update(use_sliding_window=True, max_window_layers=21, sliding_window=4096)
    status, out, _ = plan(
        capsys,
        *("--config", write_config(tmp_path, config), "--memory-budget", "40GiB"),
        *("--max-model-len", "8192"),
    )
    assert status == 0
    assert out.splitlines()[:2] == [
        "model            28 layers, 7 sliding window 4,096 + 21 full attention, 4 KV heads x "
        "128, bfloat16",
        "note             no layer_types in config.json: transformers' qwen2 layout",
    ]


@pytest.mark.parametrize(
    ("argv", "dtype", "page"),
    [
        ((), "float16", "131,072"),
        (("--dtype", "float32"), "float32", "262,144"),
        (("--dtype", "bf16"), "bfloat16", "131,072"),
        (("--kv-cache-dtype", "fp8"), "float8_e4m3fn", "65,536"),
        (("--dtype", "float32", "--kv-cache-dtype", "fp8_e5m2"), "float8_e5m2", "65,536"),
    ],
)
def test_a_float32_model_gets_vllms_cache_dtype(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], dtype: str, page: str
) -> None:
    status, out, _ = plan(
        capsys, "--config", config_path("gemma-2-9b"), "--memory-budget", "20GiB", *argv
    )
    assert status == 0
    assert f"8 KV heads x 256, {dtype}\n" in out
    assert f"page size        {page} bytes" in out
    downcast = "float32 model: vLLM runs it and its KV cache in float16 (dtype=auto)"
    assert (downcast in out) == ("--dtype" not in argv)


@pytest.mark.parametrize(
    ("config_dtype", "dtype", "kv_cache_dtype", "expected"),
    [
        ("bfloat16", "auto", "auto", ("bfloat16", "bfloat16")),
        ("float16", "auto", "auto", ("float16", "float16")),
        ("float32", "auto", "auto", ("float16", "float16")),
        (None, "auto", "auto", ("float16", "float16")),
        ("float32", "float32", "auto", ("float32", "float32")),
        ("bfloat16", "half", "auto", ("float16", "float16")),
        ("float16", "bfloat16", "fp8", ("bfloat16", "float8_e4m3fn")),
        ("bfloat16", "AUTO", "fp8_e4m3", ("bfloat16", "float8_e4m3fn")),
        ("bfloat16", "auto", "fp8_e5m2", ("bfloat16", "float8_e5m2")),
    ],
)
def test_resolve_dtypes_is_vllm_0_8_5s_choice(
    config_dtype: str | None, dtype: str, kv_cache_dtype: str, expected: tuple[str, str]
) -> None:
    choice = resolve_dtypes(config_dtype, dtype, kv_cache_dtype)
    assert (choice.model_dtype, choice.kv_cache_dtype) == expected
    assert (choice.note is not None) == (dtype == "auto" and config_dtype in (None, "float32"))


# -- tensor parallelism ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "heads", "row"),
    [
        (1, 8, None),
        (4, 2, "4 GPUs, 2 of 8 KV heads on each"),
        (8, 1, "8 GPUs, 1 of 8 KV heads on each"),
        (16, 1, "16 GPUs, 1 of 8 KV heads on each (each head on 2)"),
        (64, 1, "64 GPUs, 1 of 8 KV heads on each (each head on 8)"),
    ],
)
def test_kv_heads_per_gpu_are_split_as_vllm_splits_them(
    capsys: pytest.CaptureFixture[str], tp: int, heads: int, row: str | None
) -> None:
    # Llama-3.1-70B: 80 layers, 64 query heads, 8 KV heads x 128, bf16
    status, out, _ = plan(
        capsys,
        *("--config", config_path("llama-3.1-70b"), "--tp", str(tp)),
        *("--memory-budget", "20GiB", "--max-model-len", "8192"),
    )
    assert status == 0
    page = 2 * 16 * heads * 128 * 2
    assert f"page size        {page:,} bytes" in out
    assert f"blocks           {20 * GiB // page // 80:,} (block 0" in out
    rows = [line[17:] for line in out.splitlines() if line.startswith("tensor parallel")]
    assert rows == ([] if row is None else [f"{row}; sizes, budget and blocks below per GPU"])


def test_an_mla_latent_is_kept_whole_on_every_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--config", config_path("deepseek-v2-lite"), "--memory-budget", "10GiB")
    status, single, _ = plan(capsys, *argv, "--max-model-len", "8192")
    status_tp, split, _ = plan(capsys, *argv, "--max-model-len", "8192", "--tp", "8")
    assert (status, status_tp) == (0, 0)
    single_lines, split_lines = single.splitlines(), split.splitlines()
    assert split_lines[1] == (
        "tensor parallel  8 GPUs, each keeps the whole MLA latent; sizes, budget and blocks "
        "below per GPU"
    )
    assert split_lines[:1] + split_lines[2:] == single_lines


def test_num_kv_heads_per_gpu() -> None:
    shape = ModelShape(
        num_layers=1, num_kv_heads=8, head_size=8, dtype=dtype_name("bf16"), num_attention_heads=32
    )
    assert [shape.num_kv_heads_per_gpu(tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    for tp, rule in [(3, "divide num_attention_heads"), (0, "an int >= 1")]:
        with pytest.raises(InvalidArgumentError, match=rule):
            shape.num_kv_heads_per_gpu(tp)
    mla = ModelShape(
        num_layers=1, num_kv_heads=1, head_size=576, dtype=dtype_name("bf16"), use_mla=True
    )
    assert mla.num_kv_heads_per_gpu(6) == 1


# -- weights and the GPU ---------------------------------------------------------------------


def test_weights_larger_than_the_gpu_name_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    # the case: 145 GB of weights on an 80 GiB GPU left "-67,690,588,672 bytes"
    argv: tuple[str, ...] = ("--config", config_path("llama-3.1-70b"), "--max-model-len", "8192")
    argv += ("--gpu-memory", "80GiB", "--weights", "145GB")
    status, out, err = plan(capsys, *argv)
    assert (status, out) == (1, "")
    assert err == (
        "pagedkv plan: does not fit: the model needs 145,000,000,000 bytes (135.04 GiB) on each "
        "GPU besides its KV cache, more than the 77,309,411,328 bytes (72.00 GiB) that "
        "gpu_memory_utilization=0.9 allows of the GPU's 85,899,345,920 bytes (80.00 GiB): "
        "nothing is left for the KV cache. To fit, use a GPU with more memory or split the "
        "model over more GPUs (tensor_parallel_size).\n"
    )
    # over 2 GPUs: 72.5 GB each, 77,309,411,328 - 72,500,000,000 = 4,809,411,328 bytes left;
    # 2 * 16 * 4 * 128 * 2 = 32,768-byte pages: 4,809,411,328 // 32,768 // 80 = 1,834 blocks
    status, out, _ = plan(capsys, *argv, "--tp", "2")
    assert status == 0
    assert "KV budget        4,809,411,328 bytes (4.48 GiB)\n" in out
    assert "blocks           1,834 (block 0 is the null block)\n" in out
    # weights, activations and the rest on each GPU
    status, _, err = plan(capsys, *argv, "--tp", "2", "--non-kv-memory", "5GiB")
    assert status == 1
    assert "(weights 67.52 GiB, 1/2 of 135.04 GiB; other 5.00 GiB)" in err


# -- --json ----------------------------------------------------------------------------------

LLAMA2_13B_JSON = {
    "schema": "pagedkv-plan/1",
    "fits": True,
    "model": {
        "description": "40 layers, full attention, 40 KV heads x 128, float16",
        "num_layers": 40,
        "num_full_attention_layers": 40,
        "num_sliding_window_layers": 0,
        "sliding_window": None,
        "num_attention_heads": 40,
        "num_kv_heads": 40,
        "head_size": 128,
        "use_mla": False,
        "kv_cache_dtype": "float16",
    },
    "tensor_parallel_size": 1,
    "num_kv_heads_per_gpu": 40,
    "planned_as_full_attention": False,
    "notes": [],
    "block_size": 16,
    "page_size_bytes": 327_680,
    "block_bytes": 13_107_200,
    "bytes_per_token": 819_200,
    "kv_budget_bytes": 42_949_672_960,
    "num_blocks": 3276,
    "kv_capacity_tokens": 52_416,
    "max_model_len": 4096,
    "blocks_per_request": 256,
    "max_num_batched_tokens": 4096,
    "max_concurrency": 12.796875,
    "max_whole_requests": 12,
    "memory": None,
}


def test_json_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    status, out, err = plan(capsys, "--config", config, "--memory-budget", "40GiB", "--json")
    assert (status, err) == (0, "")
    assert json.loads(out) == LLAMA2_13B_JSON


def test_json_has_every_number_the_text_prints(capsys: pytest.CaptureFixture[str]) -> None:
    argv: tuple[str, ...] = (
        "--config",
        config_path("gemma-2-9b"),
        "--tp",
        "2",
        "--gpu-memory",
        "24GiB",
    )
    argv += ("--weights", "18GB", "--max-num-batched-tokens", "2048", "--max-model-len", "4096")
    status, text, _ = plan(capsys, *argv)
    status_json, out, _ = plan(capsys, *argv, "--json")
    assert (status, status_json) == (0, 0)
    document = json.loads(out)
    assert document["memory"] == {
        "gpu_memory_bytes": 24 * GiB,
        "gpu_memory_utilization": 0.9,
        "usable_bytes": 23_192_823_398,
        "weights_bytes": 18 * 10**9,
        "tensor_parallel_size": 2,
        "weights_bytes_per_gpu": 9 * 10**9,
        "other_bytes": 0,
        "non_kv_bytes": 9 * 10**9,
        "kv_cache_bytes": 14_192_823_398,
    }
    values: set[str] = set()
    for value in [*document.values(), *document["model"].values()]:
        if isinstance(value, float):
            values.add(f"{value:.2f}")
        elif isinstance(value, int):
            values.add(str(value))
    for line in text.splitlines():
        name, value = line[:17].strip(), line[17:]
        if name in ("model", "note"):
            assert value in (document["model"]["description"], *document["notes"])
            continue
        value = re.sub(r"\(\d+\.\d\d [KMGT]iB\)|block 0 is the null block", "", value)
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", value):
            assert number.replace(",", "") in values, (line, number)


def test_json_when_it_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, LLAMA2_13B_CONFIG)
    status, out, err = plan(capsys, "--config", config, "--memory-budget", "2GiB", "--json")
    assert status == 1
    assert err.startswith("pagedkv plan: does not fit: one request of max_model_len=4,096")
    assert json.loads(out) == {
        "schema": "pagedkv-plan/1",
        "fits": False,
        "memory": None,
        "error": {
            "kind": "request_does_not_fit",
            "message": err.removeprefix("pagedkv plan: does not fit: ").rstrip("\n"),
            "max_model_len": 4096,
            "needed_bytes": 3_355_443_200,
            "available_bytes": 2 * GiB,
            "largest_max_model_len": 2608,
            "planned_as_full_attention": False,
        },
    }
    status, out, err = plan(
        capsys, "--config", config, "--gpu-memory", "24GiB", "--weights", "26GB", "--json"
    )
    assert status == 1
    document = json.loads(out)
    assert document["error"]["kind"] == "no_kv_cache_memory"
    assert document["error"]["kv_cache_bytes"] == 23_192_823_398 - 26 * 10**9 < 0
    assert document["memory"]["non_kv_bytes"] == 26 * 10**9
    # bad arguments: status 2, nothing on stdout
    status, out, err = plan(
        capsys, "--config", config, "--memory-budget", "1GiB", "--tp", "3", "--json"
    )
    assert (status, out) == (2, "")


def test_the_planner_and_its_cli_import_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, pagedkv.planning.plan, pagedkv.planning.cli, pagedkv.planning.hf_config, "
        "pagedkv.cli; "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


README = Path(__file__).resolve().parent.parent / "README.md"
README_RUNS = re.findall(r"```\n\$ \./dev plan (.*?)\n(.*?)```", README.read_text(), re.S)


def test_readme_has_plan_examples() -> None:
    assert len(README_RUNS) >= 4


@pytest.mark.parametrize(
    ("argv", "shown"), README_RUNS, ids=[f"readme-{i}" for i in range(len(README_RUNS))]
)
def test_readme_plan_examples_print_what_they_show(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: str, shown: str
) -> None:
    monkeypatch.chdir(README.parent)  # the examples name files relative to the repository
    status, out, err = plan(capsys, *argv.split())
    assert out + err == shown
    assert status == (1 if err else 0)


def test_a_bad_override_is_bad_input_even_when_nothing_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = plan(
        capsys,
        *SMALL,
        *("--memory-budget", "1KiB", "--max-model-len", "4096", "--num-gpu-blocks-override", "0"),
    )
    assert (status, out) == (2, "")
    assert err == "pagedkv plan: error: num_blocks_override must be an int >= 1, got 0\n"
