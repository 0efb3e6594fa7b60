"""`pagedkv plan`: the chapter's Llama-2-13B example, window and MLA models, errors, sizes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from test_kv_cache_groups import MODELS, VLLM_0_33

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
        *("--dtype", "fp16", "--max-model-len", "4096", "--memory-budget", "42949672960B"),
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
        capsys,
        *("--config", config, "--gpu-memory", "80GiB", "--non-kv-memory", "26GiB"),
        *("--weights", "0B"),  # counted in --non-kv-memory here
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
        *("--weights", "0B"),
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
        # vLLM 0.33, one group: 2 x 2,048 tokens in flight, cdiv(4,095 + 4,096, 16) + 1 = 513
        # blocks a request; 29,184 / 513 = 56.89x, 29,183 // 513 = 56 at once; all full
        # attention: 2,048 blocks a request, 14.25x, 14 at once.
        "vLLM 0.33.0      one KV cache group of 32 layers; windows keep 4,096 tokens in flight "
        "(2 x max_num_batched_tokens 2,048)\n"
        "group 0          sliding window 4,096, 32 layers (0, 1, ..., 31), block size 16: 513 "
        "blocks per request\n"
        "hybrid blocks    29,184 of 2,097,152 bytes (2.00 MiB); 29,184 of 2,097,152 bytes "
        "(2.00 MiB) uniform\n"
        "per request      1,075,838,976 bytes (1.00 GiB) vs 4,294,967,296 bytes (4.00 GiB) all "
        "full attention: saves 3,219,128,320 bytes (3.00 GiB) (75.0%)\n"
        "hybrid requests  56.89x (56 whole requests) vs 14.25x (14) all full attention: "
        "+42 requests\n"
        "retention        vLLM 0.33.0's engine caches a window group's blocks only at each "
        "prompt's replay boundary (prefix_cache_retention_interval=0); pagedkv's "
        "KVCacheConfig caches every full block unless given an interval\n"
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
    # 4 layers, 2 with a window of 4, block 8, fp16, 1 head of 2: 64-byte pages. vLLM's check
    # on the layers as given: 2 * cdiv(64, 8) + 2 * (cdiv(3 + 4, 8) + 1) = 20 pages = 1,280
    # bytes. Planned as full: 4 * 8 = 32 pages = 2,048 bytes; 4,096 bytes hold
    # 4,096 // 64 // 4 = 16 blocks, (16 - 1) // 8 = 1 whole request.
    config = write_config(tmp_path, HYBRID_CONFIG)
    shape = shape_of(HYBRID_CONFIG)
    assert (shape.sliding_window, shape.num_sliding_window_layers) == (4, 2)
    status, out, _ = plan(
        capsys,
        *("--config", config, "--memory-budget", "4096B", "--block-size", "8"),
        *("--max-num-batched-tokens", "4"),
    )
    assert status == 0
    assert out.splitlines()[:2] == [
        "model            4 layers, 2 sliding window 4 + 2 full attention, 1 KV heads x 2, float16",
        "note             sliding and full layers mixed: all planned as full",
    ]
    assert "blocks           16 (block 0 is the null block)" in out
    assert "(8 blocks per request)" in out
    assert "(1 whole requests at once)" in out
    # vLLM 0.33: two groups of 2 layers, a block 2 pages = 128 bytes, 4,096 // 128 = 32 blocks;
    # a request: cdiv(min(3 + 2 * 4, 64), 8) + 1 = 3 window blocks + 8 full = 11 blocks;
    # (32 - 1) // 11 = 2 whole requests, 32 / 11 = 2.91x; uniform (16 - 1) // 8 = 1, 2.00x.
    assert "hybrid blocks    32 of 128 bytes; 16 of 256 bytes uniform" in out
    assert "hybrid requests  2.91x (2 whole requests) vs 2.00x (1) all full attention: +1" in out


def test_a_budget_that_fits_only_the_window_layers_as_given_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1,280 bytes pass vLLM 0.8.5's check (20 pages as given) but not the 32 pages the layers
    # need as planned; 1,280 // 64 // 4 = 5 blocks of 8 tokens: the largest length is 40.
    # vLLM 0.33's grouped layout would refuse too: 11 blocks of 128 bytes > 1,280 - 128.
    config = write_config(tmp_path, HYBRID_CONFIG)
    argv = ("--config", config, "--memory-budget", "1280B", "--block-size", "8")
    status, out, err = plan(capsys, *argv, "--max-num-batched-tokens", "4")
    assert (status, out) == (1, "")
    assert err == (
        "pagedkv plan: does not fit: with its sliding-window layers planned as full attention "
        "(one block table for every layer, as vLLM 0.8.5 does; its start-up check counts them "
        "by their window and would pass), one request of max_model_len=64 needs 0.00 GiB "
        "(2,048 bytes) of KV cache, more than the 0.00 GiB (1,280 bytes) available; the "
        "largest max_model_len that fits is 40. Raise gpu_memory_utilization or lower "
        "max_model_len.\n"
    )
    with pytest.raises(RequestDoesNotFitError) as refused:
        make_plan(
            shape_of(HYBRID_CONFIG), 1280, block_size=8, max_model_len=64, max_num_batched_tokens=4
        )
    assert (refused.value.needed_bytes, refused.value.available_bytes) == (2048, 1280)
    assert (refused.value.largest_max_model_len, refused.value.planned_as_full_attention) == (
        40,
        True,
    )
    assert refused.value.hybrid is None
    status, out, _ = plan(capsys, *argv, "--max-num-batched-tokens", "4", "--max-model-len", "40")
    assert status == 0
    assert "blocks           5 (block 0 is the null block)" in out


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpu-memory-utilization", "1.5"],
            "argument --gpu-memory-utilization: must be in (0, 1]",
        ),
        (
            ["--gpu-memory-utilization", "nan"],
            "argument --gpu-memory-utilization: must be in (0, 1]",
        ),
        (["--block-size", "0"], "argument --block-size: invalid choice: 0 (choose from 1, 8, 16,"),
        (["--block-size", "12"], "argument --block-size: invalid choice: 12"),
        (["--tp", "0"], "argument --tensor-parallel-size/--tp: must be an int >= 1, got 0"),
        (["--num-layers", "-1"], "argument --num-layers: must be an int >= 1, got -1"),
        (["--max-model-len", "0"], "argument --max-model-len: must be an int >= 1, got 0"),
        (["--max-model-len", "4k"], "argument --max-model-len: not an int: '4k'"),
        (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be an int"),
        (["--num-gpu-blocks-override", "0"], "argument --num-gpu-blocks-override: must be an int"),
        (["--sliding-window", "0"], "argument --sliding-window: must be an int >= 1, got 0"),
        (["--memory-budget", "80"], "argument --memory-budget: a memory size needs a unit: 80GiB"),
        (["--gpu-memory", "80"], "argument --gpu-memory: a memory size needs a unit: 80GiB"),
        (
            ["--weights", "140000000000"],
            "argument --weights: a memory size needs a unit: "
            "140000000000B if you mean bytes (130.39 GiB)",
        ),
        (["--non-kv-memory", "2X"], "argument --non-kv-memory: not a memory size: '2X'"),
    ],
)
def test_option_errors_name_the_option_before_anything_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Issue 22: errors name the user's option, never an internal function."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"pagedkv plan: error: {message}" in err
    assert not re.search(
        r"\b(memory_needed_bytes|estimate_max_model_len|check_enough|make_plan|"
        r"get_kv_cache_config|ModelShape)\b",
        err,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*SMALL[:-1], "fp12"], "--dtype: unknown KV cache dtype 'fp12'"),
        ([*SMALL, "--kv-cache-dtype", "fp16"], "--kv-cache-dtype: kv_cache_dtype must be auto"),
        ([*GQA8, "--tp", "3"], "--tensor-parallel-size: tensor_parallel_size=3 must divide"),
        (
            [*SMALL, "--sliding-window", "8", "--sliding-window-layers", "9"],
            "--sliding-window-layers 9: more than the model's 2 layers",
        ),
        ([*SMALL, "--mla", "--sliding-window", "8"], "--mla: MLA is not supported with a sliding"),
    ],
)
def test_model_errors_name_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = plan(capsys, *argv, "--memory-budget", "1GiB", "--max-model-len", "8")
    assert (status, out) == (2, "")
    assert err.startswith(f"pagedkv plan: error: {message}")


def test_argument_errors_come_before_torch_is_imported() -> None:
    """Issue 22: `pagedkv plan` with a bad option fails fast, without importing torch."""
    code = (
        "import sys\n"
        "from pagedkv.cli import main\n"
        "for argv in (['--block-size', '12'], ['--memory-budget', '80'], ['--tp', '0']):\n"
        "    try:\n"
        "        main(['plan', *argv])\n"
        "    except SystemExit as exited:\n"
        "        assert exited.code == 2, exited.code\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
        "rc = main(['plan', '--config', 'tests/configs/gpt-oss-20b.json',\n"
        "           '--gpu-memory', '80GiB'])\n"
        "assert rc == 0, rc\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported'\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert completed.returncode == 0, completed.stderr


def test_no_memory_left_on_the_gpu_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = plan(
        capsys,
        *("--num-layers", "2", "--num-kv-heads", "1", "--head-size", "8", "--dtype", "fp16"),
        *("--gpu-memory", "16GiB", "--non-kv-memory", "15GiB", "--max-model-len", "8"),
        *("--weights", "0B"),
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
        ("1B", 1),
        ("42949672960B", 40 * GiB),
        ("40GiB", 40 * GiB),
        ("40Gi", 40 * GiB),
        ("40G", 40 * GiB),  # vLLM's human_readable_int: one upper-case letter is binary
        ("40g", 40 * 10**9),  # and a lower-case one decimal
        ("40GB", 40 * 10**9),
        ("40gb", 40 * 10**9),
        ("2K", 2048),
        ("2k", 2000),
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


@pytest.mark.parametrize(
    "text", ["", "GiB", "40", "40X", "40Gb2", "-1GiB", "1.5", "0.3KiB", "0.3K", "forty"]
)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_size(text)


def test_a_bare_number_is_refused_with_the_units_it_could_mean() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        parse_size("80")
    assert str(refused.value) == (
        "a memory size needs a unit: 80GiB (85,899,345,920 bytes), 80GB (80,000,000,000 bytes) "
        "or 80B"
    )


@pytest.mark.parametrize("size", ["80G", "80Gi", "80GB", "80GiB"])
def test_the_gpu_sizes_people_write_are_accepted(
    capsys: pytest.CaptureFixture[str], size: str
) -> None:
    """Issue 22: `--gpu-memory 80G` and its spellings; the budget follows the unit."""
    argv = ("--config", config_path("llama-3.1-70b"), "--max-model-len", "8192", "--tp", "4")
    status, out, _ = plan(capsys, *argv, "--gpu-memory", size)
    assert status == 0
    # Llama-3.1-70B in bf16, 141,107,412,992 bytes: a quarter each, norms on every GPU
    expected = int((80 * 10**9 if size == "80GB" else 80 * GiB) * 0.9) - 35_278_831_616
    assert f"KV budget        {expected:,} bytes" in out


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
    budget = ("--memory-budget", "1MiB", "--block-size", "8")
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
# 3,899 // 512 = 7. vLLM 0.33: groups of 21 layers (window layers 0, 2, ..., full 1, 3, ...),
# a block 21 pages = 2,752,512 bytes, 20 GiB // that = 7,801 blocks; with 2 x 8,192 tokens in
# flight a window layer keeps min(4,095 + 16,384, 8,192) tokens: cdiv(8,192, 16) + 1 = 513
# blocks, + 512 full = 1,025 a request: 7,801 / 1,025 = 7.61x, 7,800 // 1,025 = 7 at once, one
# block more per request than all full attention (at 8,192 tokens the windows save nothing).
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
vLLM 0.33.0      hybrid KV cache manager: 2 groups of up to 21 layers, one pool; windows keep 16,384 tokens in flight (2 x max_num_batched_tokens 8,192)
group 0          sliding window 4,096, 21 layers (0, 2, ..., 40), block size 16: 513 blocks per request
group 1          full attention, 21 layers (1, 3, ..., 41), block size 16: 512 blocks per request
hybrid blocks    7,801 of 2,752,512 bytes (2.62 MiB); 3,900 of 5,505,024 bytes (5.25 MiB) uniform
per request      2,821,324,800 bytes (2.63 GiB) vs 2,818,572,288 bytes (2.62 GiB) all full attention: costs 2,752,512 bytes (2.62 MiB) (0.1%)
hybrid requests  7.61x (7 whole requests) vs 7.62x (7) all full attention: +0 requests
retention        vLLM 0.33.0's engine caches a window group's blocks only at each prompt's replay boundary (prefix_cache_retention_interval=0); pagedkv's KVCacheConfig caches every full block unless given an interval
"""  # noqa: E501


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
        "num_chunked_local_layers": 0,
        "attention_chunk_size": None,
        "layer_types": ["full_attention"] * 40,
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
    "hybrid": None,
    "hybrid_refusal": None,
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
        "weights_estimated": False,
        "weights_estimate": None,
        "tensor_parallel_size": 2,
        "weights_bytes_per_gpu": 9 * 10**9,
        "other_bytes": 0,
        "non_kv_bytes": 9 * 10**9,
        "kv_cache_bytes": 14_192_823_398,
    }
    hybrid = document["hybrid"]
    values: set[str] = set()
    groups = hybrid["groups"]
    for value in [
        *document.values(),
        *document["model"].values(),
        *hybrid.values(),
        *(value for group in groups for value in group.values()),
        *(name.removeprefix("layers.") for group in groups for name in group["layer_names"]),
        hybrid["vllm_version"],
    ]:
        if isinstance(value, float):
            values.update((f"{abs(value):.2f}", f"{abs(value):.1%}".rstrip("%")))
        elif isinstance(value, int):
            values.add(str(abs(value)))
        elif isinstance(value, str):
            values.add(value)
    for line in text.splitlines():
        name, value = line[:17].strip(), line[17:]
        if name in ("model", "note"):
            assert value in (document["model"]["description"], *document["notes"])
            continue
        value = re.sub(r"\(\d+\.\d\d [KMGT]iB\)|block 0 is the null block|^\+", "", value)
        value = re.sub(r"group \d+", "", name + " " + value).replace("0.33.0", "")
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", value):
            assert number.replace(",", "") in values, (line, number)
    assert "vLLM 0.33.0" in text and hybrid["vllm_version"] == "0.33.0"
    assert [line[:8] for line in text.splitlines() if line.startswith("group")] == [
        f"group {index} " for index in range(hybrid["num_groups"])
    ]


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
            "hybrid": None,
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


ROOT = Path(__file__).resolve().parent.parent
PLANNING_PAGE = ROOT / "docs" / "planning.md"  # the documentation's `pagedkv plan` page
PAGE_RUNS = re.findall(r"```\n\$ \./dev plan (.*?)\n(.*?)```", PLANNING_PAGE.read_text(), re.S)


def test_the_planning_page_has_plan_examples() -> None:
    assert len(PAGE_RUNS) >= 4


@pytest.mark.parametrize(
    ("argv", "shown"), PAGE_RUNS, ids=[f"planning-page-{i}" for i in range(len(PAGE_RUNS))]
)
def test_the_planning_page_examples_print_what_they_show(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: str, shown: str
) -> None:
    monkeypatch.chdir(ROOT)  # the examples name files relative to the repository
    status, out, err = plan(capsys, *argv.split())
    assert out + err == shown
    assert status == (1 if err else 0)


def test_a_bad_override_is_bad_input_even_when_nothing_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "plan",
                *SMALL,
                *("--memory-budget", "1KiB", "--max-model-len", "4096"),
                *("--num-gpu-blocks-override", "0"),
            ]
        )
    assert exited.value.code == 2
    assert "argument --num-gpu-blocks-override: must be an int >= 1, got 0" in (
        capsys.readouterr().err
    )
    shape = ModelShape(num_layers=2, num_kv_heads=1, head_size=8, dtype=dtype_name("fp16"))
    with pytest.raises(InvalidArgumentError, match="num_blocks_override must be an int >= 1"):
        make_plan(shape, 1024, block_size=16, max_model_len=4096, num_blocks_override=0)


# -- vLLM 0.33's hybrid layout beside the plan (issue 20) -------------------------------------


@pytest.mark.parametrize("name", sorted(VLLM_0_33))
def test_the_plan_shows_vllm_0_33s_groups_and_numbers(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    max_model_len, batched, budget, tp = MODELS[name]
    argv = ("--config", config_path(name), "--memory-budget", f"{budget}B", "--tp", str(tp))
    argv += ("--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(batched))
    status, out, err = plan(capsys, *argv, "--json")
    groups, num_blocks, concurrency, uniform_blocks, uniform_concurrency = VLLM_0_33[name]
    if uniform_blocks is None:  # only the hybrid layout fits: the plan (vLLM 0.8.5) refuses
        assert status == 1
        assert "vLLM 0.33.0's hybrid KV cache manager would fit it" in err
        hybrid = json.loads(out)["error"]["hybrid"]
    else:
        assert status == 0
        hybrid = json.loads(out)["hybrid"]
        if len(groups) > 1:  # vLLM 0.33 without its hybrid manager: every layer full attention
            assert hybrid["uniform_num_blocks"] == uniform_blocks
            assert hybrid["uniform_max_concurrency"] == pytest.approx(uniform_concurrency, 1e-4)
        else:  # one kind of layer: vLLM keeps its windows either way; "uniform" is all full
            assert hybrid["uniform_num_blocks"] == num_blocks
            assert hybrid["uniform_max_concurrency"] == num_blocks / (max_model_len // 16)
    assert [(g["num_layers"], g["kind"].split()[0]) for g in hybrid["groups"]] == groups
    assert hybrid["num_blocks"] == num_blocks
    assert hybrid["max_concurrency"] == pytest.approx(concurrency, abs=1e-4)
    assert hybrid["enabled_by_default"] == (name != "llama-4-scout-17b-16e")
    assert hybrid["max_in_flight_tokens"] == 2 * batched


def test_gpt_oss_120b_on_one_80g_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    # weights: 65,248,815,744 bytes estimated (MXFP4 experts); 0.9 * 80 GiB - that = 12.06 GB.
    # vLLM 0.33: 18 window + 18 full layers, two groups of 18: a block is 18 pages of 32 KiB;
    # 12,060,595,584 // 589,824 = 20,447 blocks; a 131,072-token request holds 8,192 full
    # blocks + cdiv(127 + 16,384, 16) + 1 = 1,033 window blocks (2 x 8,192 tokens in flight).
    status, out, err = plan(capsys, "--config", config_path("gpt-oss-120b"), "--gpu-memory", "80G")
    assert (status, err) == (0, "")
    assert (
        "note             weights estimated from config.json (116,829,156,672 parameters, MXFP4 "
        "experts, bfloat16 elsewhere): 60.77 GiB; --weights overrides\n" in out
    )
    assert "KV budget        12,060,595,584 bytes (11.23 GiB)\n" in out
    assert "blocks           10,223 (block 0 is the null block)\n" in out
    assert "group 0          sliding window 128, 18 layers (0, 2, ..., 34), block size 16: " in out
    assert "1,033 blocks per request\n" in out
    assert "group 1          full attention, 18 layers (1, 3, ..., 35), block size 16: 8,192" in out
    assert "hybrid blocks    20,447 of 589,824 bytes (576.00 KiB); 10,223 of 1,179,648" in out
    assert (
        "per request      5,441,126,400 bytes (5.07 GiB) vs 9,663,676,416 bytes (9.00 GiB) all "
        "full attention: saves 4,222,550,016 bytes (3.93 GiB) (43.7%)\n" in out
    )
    assert (
        "hybrid requests  2.22x (2 whole requests) vs 1.25x (1) all full attention: +1 requests"
        in out
    )
    status, out, _ = plan(
        capsys, "--config", config_path("gpt-oss-120b"), "--gpu-memory", "80G", "--json"
    )
    memory = json.loads(out)["memory"]
    assert (memory["weights_estimated"], memory["weights_bytes"]) == (True, 65_248_815_744)
    assert memory["weights_estimate"]["parameters"] == 116_829_156_672
    assert memory["weights_estimate"]["quantization"] == "MXFP4 experts"


def test_weights_that_do_not_fit_are_refused_with_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 22: Llama-3.1-70B on one 80 GiB GPU got 14,745 blocks, its weights taken as 0."""
    argv = ("--config", config_path("llama-3.1-70b"), "--max-model-len", "8192")
    status, out, err = plan(capsys, *argv, "--gpu-memory", "80GiB")
    assert (status, out) == (1, "")
    assert err.startswith(
        "pagedkv plan: does not fit: the model needs 141,107,412,992 bytes (131.42 GiB) on each "
        "GPU besides its KV cache (weights estimated from its config 131.42 GiB), more than the "
        "77,309,411,328 bytes (72.00 GiB)"
    )
    status, out, _ = plan(capsys, *argv, "--gpu-memory", "80GiB", "--json")
    document = json.loads(out)
    assert (status, document["error"]["kind"]) == (1, "no_kv_cache_memory")
    assert document["memory"]["weights_estimated"] is True
    assert document["memory"]["weights_estimate"]["parameters"] == 70_553_706_496
    # on two GPUs it fits: each holds half the weights
    status, out, _ = plan(capsys, *argv, "--gpu-memory", "80GiB", "--tp", "2")
    assert status == 0
    assert "65.71 GiB on each GPU" in out
    # --weights overrides the estimate
    status, out, _ = plan(capsys, *argv, "--gpu-memory", "80GiB", "--weights", "0B")
    assert status == 0
    assert "weights estimated" not in out


def test_a_model_directory_is_read_as_its_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "mistral-7b-v0.1.json").read_text())
    by_file = plan(capsys, "--config", config_path("mistral-7b-v0.1"), "--memory-budget", "8GiB")
    by_dir = plan(capsys, "--config", str(tmp_path), "--memory-budget", "8GiB")
    assert by_dir == by_file
    assert by_dir[0] == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _, err = plan(capsys, "--config", str(empty), "--memory-budget", "8GiB")
    assert status == 2
    assert err == f"pagedkv plan: error: --config {empty}: a directory without a config.json\n"


def test_llama_4_says_vllm_0_33_runs_it_uniform_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--config", config_path("llama-4-scout-17b-16e"), "--gpu-memory", "80GiB")
    status, out, _ = plan(capsys, *argv, "--tp", "4", "--max-model-len", "131072")
    assert status == 0
    assert "chunked local layers planned as full (vLLM 0.8.5 has no chunked cache)" in out
    assert (
        "off by default for chunked local attention "
        "(VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1)" in out
    )
    assert "group 3          full attention, 12 layers (3, 7, ..., 47)" in out
    # its 217 GB of bf16 weights do not fit one 80 GiB GPU
    status, out, err = plan(capsys, *argv, "--max-model-len", "131072")
    assert (status, out) == (1, "")
    assert "(weights estimated from its config 202.36 GiB)" in err


def test_without_async_scheduling_windows_keep_one_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--config", config_path("gpt-oss-20b"), "--memory-budget", "20GiB")
    argv += ("--max-model-len", "131072")
    _, two, _ = plan(capsys, *argv, "--json")
    _, one, _ = plan(capsys, *argv, "--json", "--no-async-scheduling")
    assert json.loads(two)["hybrid"]["groups"][0]["blocks_per_request"] == 1033
    assert json.loads(one)["hybrid"]["groups"][0]["blocks_per_request"] == 521  # (127+8192)/16
