"""`pagedkv plan` for Mamba hybrids (issue 36): Jamba, Falcon-H1, Nemotron-H, Granite-4.0-H and
Qwen3-Next planned as vLLM 0.33.0 plans them.

Each case's numbers are pinned here as vLLM 0.33.0's own code computes them, and, where the
package index is reachable (or the release is cached), compared with that code run on the same
config (`tests/vllm_033_mamba_plan.py`: the model's state calculators, the platform's block-size
alignment, the Mamba layers' specs, the grouping and the concurrency, from vLLM's wheel).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_campaign import UNREACHABLE

from pagedkv.cli import main
from pagedkv.planning.hf_mamba import read_mamba_hybrid_config
from pagedkv.planning.mamba_model import Mamba1State
from pagedkv.planning.mamba_plan import (
    MambaPlan,
    hybrid_block_size,
    make_mamba_plan,
    mamba_kv_cache_specs,
)
from pagedkv.planning.plan import RequestDoesNotFitError
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, MambaSpec

TESTS = Path(__file__).parent
CONFIGS = TESTS / "configs" / "mamba"
GiB = 1 << 30

# Nemotron-H-8B-Base-8K's layout and sizes, saved the older way (a pattern and
# num_hidden_layers): 24 Mamba-2 (M), 4 attention (*), 24 MLP (-) layers.
NEMOTRON_H_8B = {
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_hidden_layers": 52,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
# A Granite-4.0-H-style layout in the older names: 40 layers, attention at 5, 15, 25 and 35.
GRANITE_H = {
    "model_type": "granitemoehybrid",
    "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)],
    "num_hidden_layers": 40,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "max_position_embeddings": 131_072,
    "torch_dtype": "bfloat16",
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "max_position_embeddings": 262_144,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class Case:
    """A config.json and how it is served (vLLM's defaults unless given)."""

    config: dict[str, Any]
    budget: int
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    prefix_caching: bool = True
    gdn_prefill_backend: str = "flashinfer"
    num_gpu_blocks_override: int | None = None


JAMBA_DEFAULTS = json.loads((CONFIGS / "jamba-defaults.json").read_text())

CASES: dict[str, Case] = {
    # the issue's: transformers' default JambaConfig on 62 GiB
    "jamba": Case(JAMBA_DEFAULTS, 62 * GiB),
    "jamba-tp2-fp8": Case(
        {"model_type": "jamba", "torch_dtype": "bfloat16"},
        24 * GiB,
        max_model_len=65_536,
        tensor_parallel_size=2,
        kv_cache_dtype="fp8",
    ),
    "falcon_h1": Case({"model_type": "falcon_h1", "torch_dtype": "bfloat16"}, 20 * GiB),
    "falcon_h1-head-dim-block-128": Case(
        {
            "model_type": "falcon_h1",
            "torch_dtype": "bfloat16",
            "head_dim": 64,
            "num_key_value_heads": 4,
            "mamba_d_ssm": None,
            "max_position_embeddings": 131_072,
        },
        40 * GiB,
        block_size=128,
    ),
    "nemotron_h": Case(NEMOTRON_H_8B, 40 * GiB),
    "nemotron_h-tp4-ssm-bf16": Case(
        NEMOTRON_H_8B, 16 * GiB, tensor_parallel_size=4, mamba_ssm_cache_dtype="bfloat16"
    ),
    "granitemoehybrid": Case(GRANITE_H, 30 * GiB),
    "granitemoehybrid-no-attention": Case(
        {"model_type": "granitemoehybrid", "torch_dtype": "bfloat16"}, 10 * GiB
    ),
    "qwen3_next": Case(QWEN3_NEXT, 40 * GiB),
    "qwen3_next-tp2-override": Case(
        QWEN3_NEXT, 40 * GiB, tensor_parallel_size=2, num_gpu_blocks_override=3000
    ),
    "qwen3_next-triton": Case(QWEN3_NEXT, 40 * GiB, gdn_prefill_backend="triton"),
    "qwen3_next-no-prefix-caching": Case(QWEN3_NEXT, 40 * GiB, prefix_caching=False),
}

# vLLM 0.33.0's numbers for each case (`tests/vllm_033_mamba_plan.py` prints them): attention
# block size, page, num_blocks, the groups (kind, layers, blocks a request holds), max
# concurrency, KV cache size in tokens.
#
# Jamba by hand: an attention token 2 x 8 heads x 128 x 2 bytes = 4,096 bytes; a Mamba-1 state
# conv (3, 8,192) + ssm (8,192, 16) in bfloat16 = 311,296 bytes; block 16 x cdiv(311,296,
# 16 x 4,096) = 80 tokens, page 80 x 4,096 = 327,680 (the state padded by 16,384); 4 attention
# and 28 Mamba layers: groups of 4, 7 Mamba groups; a block 4 pages = 1,310,720 bytes; 62 GiB
# // 1,310,720 = 50,790 blocks; a request cdiv(262,144, 80) = 3,277 attention blocks + 7 x 2
# states (prefix caching: the running one, the last at a block boundary) = 3,291 blocks;
# 50,790 / 3,291 = 15.43x, x 262,144 = 4,045,668 tokens.
# Qwen3-Next: 2 x 2 x 256 x 2 = 2,048 bytes a token; a gated-delta-net state conv (3, 2 x 16 x
# 128 + 32 x 128 = 8,192) + ssm (32, 128, 128) = 1,097,728 bytes; FlashInfer's prefill
# checkpoints every 64 tokens, so 64 x cdiv(1,097,728, 64 x 2,048) = 576 (544, a multiple of
# 16, with Triton or without prefix caching); 3 states a request (+ a prefill checkpoint).
Groups = list[tuple[str, int, int]]
VLLM_0_33: dict[str, tuple[int, int, int, Groups, float, int]] = {
    "falcon_h1": (144, 589_824, 1137, [("full", 32, 57), ("mamba", 32, 3)], 18.95, 155_238),
    "falcon_h1-head-dim-block-128": (
        4224,
        4_325_376,
        310,
        [("full", 32, 32), ("mamba", 32, 3)],
        8.8571,
        1_160_923,
    ),
    "granitemoehybrid": (
        528,
        2_162_688,
        3723,
        [("mamba", 4, 3)] * 9 + [("full", 4, 249)],
        13.4891,
        1_768_047,
    ),
    "granitemoehybrid-no-attention": (16, 4_246_528, 79, [("mamba", 32, 3)], 26.3333, 53_930),
    "jamba": (80, 327_680, 50_790, [("mamba", 4, 2)] * 7 + [("full", 4, 3277)], 15.433, 4_045_668),
    "jamba-tp2-fp8": (
        160,
        163_840,
        39_321,
        [("mamba", 4, 2)] * 7 + [("full", 4, 410)],
        92.7382,
        6_077_691,
    ),
    "nemotron_h": (
        1040,
        4_259_840,
        2520,
        [("mamba", 4, 3)] * 6 + [("full", 4, 8)],
        96.9231,
        793_993,
    ),
    "nemotron_h-tp4-ssm-bf16": (
        528,
        540_672,
        7943,
        [("mamba", 4, 3)] * 6 + [("full", 4, 16)],
        233.6176,
        1_913_795,
    ),
    "qwen3_next": (
        576,
        1_179_648,
        3034,
        [("mamba", 12, 3)] * 3 + [("full", 12, 456)],
        6.5247,
        1_710_419,
    ),
    "qwen3_next-no-prefix-caching": (
        544,
        1_114_112,
        3212,
        [("mamba", 12, 1)] * 3 + [("full", 12, 482)],
        6.6227,
        1_736_095,
    ),
    "qwen3_next-tp2-override": (
        576,
        589_824,
        3000,
        [("mamba", 12, 3)] * 3 + [("full", 12, 456)],
        6.4516,
        1_691_251,
    ),
    "qwen3_next-triton": (
        544,
        1_114_112,
        3212,
        [("mamba", 12, 2)] * 3 + [("full", 12, 482)],
        6.582,
        1_725_423,
    ),
}


def plan_of(case: Case) -> MambaPlan:
    model = read_mamba_hybrid_config(
        case.config,
        kv_cache_dtype=case.kv_cache_dtype,
        mamba_ssm_cache_dtype=case.mamba_ssm_cache_dtype,
    )
    max_model_len = case.max_model_len or model.max_position_embeddings
    assert max_model_len is not None
    return make_mamba_plan(
        model,
        case.budget,
        block_size=case.block_size,
        max_model_len=max_model_len,
        tensor_parallel_size=case.tensor_parallel_size,
        prefix_caching=case.prefix_caching,
        gdn_prefill_backend=case.gdn_prefill_backend,
        num_blocks_override=case.num_gpu_blocks_override,
    )


def summary(plan: MambaPlan) -> tuple[int, int, int, Groups, float, int]:
    groups = [
        (
            "mamba" if isinstance(group.kv_cache_spec, MambaSpec) else "full",
            len(group.layer_names),
            blocks,
        )
        for group, blocks in zip(plan.groups, plan.group_blocks_per_request, strict=True)
    ]
    return (
        plan.block_size,
        plan.page_size_bytes,
        plan.num_blocks,
        groups,
        round(plan.max_concurrency, 4),
        plan.capacity_tokens,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_family_plans_vllm_0_33s_numbers(name: str) -> None:
    assert summary(plan_of(CASES[name])) == VLLM_0_33[name]


def vllm_case(case: Case) -> dict[str, Any]:
    """The case `tests/vllm_033_mamba_plan.py` runs (the model dtype as pagedkv resolves it,
    vLLM 0.33's rule: float32 or none read as bfloat16 on Hopper)."""
    plan = plan_of(case)
    return {
        "config": case.config,
        "dtype": plan.model.model_dtype,
        "cache_dtype": case.kv_cache_dtype,
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": case.mamba_ssm_cache_dtype,
        "block_size": case.block_size,
        "prefix_caching": case.prefix_caching,
        "gdn_prefill_backend": case.gdn_prefill_backend,
        "tensor_parallel_size": case.tensor_parallel_size,
        "max_model_len": plan.max_model_len,
        "available_memory": case.budget,
        "num_gpu_blocks_override": case.num_gpu_blocks_override,
    }


def run_vllm(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    completed = subprocess.run(
        [sys.executable, str(TESTS / "vllm_033_mamba_plan.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode == UNREACHABLE:
        pytest.skip("vllm==0.33.0: the package index is unreachable and nothing is cached")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results: list[dict[str, Any]] = json.loads(completed.stdout.splitlines()[-1])
    return results


def test_vllm_0_33_itself_plans_the_pinned_numbers() -> None:
    """vLLM 0.33.0's own code on the same configs: block size, state, page, groups, blocks."""
    names = sorted(CASES)
    for name, theirs in zip(names, run_vllm([vllm_case(CASES[n]) for n in names]), strict=True):
        assert "error" not in theirs, (name, theirs)
        groups = [
            (group["kind"], len(group["layers"]), group["blocks_per_request"])
            for group in theirs["groups"]
        ]
        pinned = (
            theirs["block_size"],
            theirs["page_size_bytes"],
            theirs["num_blocks"],
            groups,
            round(theirs["max_concurrency"], 4),
            theirs["kv_cache_size_tokens"],
        )
        assert pinned == VLLM_0_33[name], name
        ours = plan_of(CASES[name])
        # the same layers in the same groups, of the same block sizes
        assert [list(g.layer_names) for g in ours.groups] == [g["layers"] for g in theirs["groups"]]
        assert [g.kv_cache_spec.block_size for g in ours.groups] == [
            g["block_size"] for g in theirs["groups"]
        ], name
        # the same state, padded the same way
        spec = ours.state_spec
        assert [list(shape) for shape in spec.shapes] == theirs["state_shapes"], name
        assert list(spec.dtypes) == theirs["state_dtypes"], name
        assert spec.state_size_bytes == theirs["state_bytes"], name
        assert spec.page_size_padded == theirs["mamba_page_size_padded"], name
        assert spec.mamba_cache_mode == theirs["mamba_cache_mode"], name
        assert spec.block_size == theirs["mamba_block_size"], name


# -- the issue's regression: transformers' default JambaConfig ----------------------------------

# vLLM 0.33's plan of the issue's command (the numbers above, by hand): 4 attention layers, 28
# Mamba-1 layers, 16 KiB a token (not 128 KiB), 2 states of 311,296 bytes per Mamba layer and
# request, padded to 320 KiB pages.
JAMBA_PLAN = """\
model            32 layers, 28 Mamba-1 + 4 full attention, 8 KV heads x 128, bfloat16
note             config.json names no dtype: vLLM 0.33 reads float32 and runs bfloat16 (dtype=auto)
note             planned as vLLM 0.33.0 plans Mamba hybrids (vLLM 0.8.5's V1 engine has none): \
FlashAttention on a Hopper GPU, prefix caching on (mamba_cache_mode align): a request keeps 2 \
states per layer (the running one, the last at a block boundary)
state            Mamba-1: conv (3, 8,192) bfloat16 + ssm (8,192, 16) bfloat16 = 311,296 bytes \
(304.00 KiB) per layer and request
block size       80 tokens (raised from 16: an attention page holds a state)
page size        327,680 bytes (320.00 KiB) per layer; each state padded by 16,384 bytes (5.26%)
bytes per token  16,384 bytes (16.00 KiB) over 4 attention layers
KV budget        66,571,993,088 bytes (62.00 GiB)
vLLM 0.33.0      hybrid KV cache manager: 8 groups of up to 4 layers, one pool
groups 0-6       Mamba-1, 28 layers in 7 groups of 4, block size 80: 2 blocks per request in each
group 7          full attention, 4 layers (4, 12, 20, 28), block size 80: 3,277 blocks per request
blocks           50,790 of 1,310,720 bytes (1.25 MiB), a page of each layer of a group (block 0 \
is the null block)
max_model_len    262,144 tokens (3,291 blocks per request: 4,313,579,520 bytes (4.02 GiB), \
states 18,350,080 bytes (17.50 MiB))
KV capacity      4,045,668 tokens (max concurrency x max_model_len)
max concurrency  15.43x (15 whole requests at once)
"""

JAMBA_ARGV = ("--config", str(CONFIGS / "jamba-defaults.json"), "--memory-budget", "62GiB")


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_jamba_is_no_longer_planned_as_32_full_attention_layers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = plan(capsys, *JAMBA_ARGV)
    assert (status, out, err) == (0, JAMBA_PLAN, "")
    # what it printed before: every layer full attention, 128 KiB a token, no state, 1.94x
    assert "32 layers, full attention" not in out
    assert "131,072 bytes (128.00 KiB)" not in out
    assert "1.94x" not in out


def test_the_json_plan_has_every_number_the_text_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = plan(capsys, *JAMBA_ARGV, "--json")
    assert status == 0
    document = json.loads(out)
    mamba = document["mamba"]
    assert document["model"]["layer_types"] == [
        "full_attention" if i % 8 == 4 else "linear_attention" for i in range(32)
    ]
    assert (document["block_size"], document["page_size_bytes"], document["num_blocks"]) == (
        80,
        327_680,
        50_790,
    )
    assert (document["block_bytes"], document["bytes_per_token"]) == (1_310_720, 16_384)
    assert (document["blocks_per_request"], document["kv_capacity_tokens"]) == (3291, 4_045_668)
    assert document["max_concurrency"] == 50_790 / 3291
    assert (document["hybrid"], document["planned_as_full_attention"]) == (None, False)
    assert mamba["state_bytes"] == 311_296 == document["model"]["state_bytes"]
    assert (mamba["state_padding_bytes"], mamba["states_per_request"]) == (16_384, 2)
    assert [group["blocks_per_request"] for group in mamba["groups"]] == [2] * 7 + [3277]
    assert mamba["groups"][7]["layer_names"] == [f"layers.{i}.attn" for i in (4, 12, 20, 28)]
    numbers: set[str] = set()
    for value in [
        *document.values(),
        *document["model"].values(),
        *mamba.values(),
        *(value for group in mamba["groups"] for value in group.values()),
        *(value for shape in document["model"]["state_shapes"] for value in shape),
    ]:
        if isinstance(value, float):
            numbers.add(f"{value:.2f}")
        elif isinstance(value, int):
            numbers.add(str(value))
    kinds = [group["kind"] for group in mamba["groups"]]
    numbers |= {str(kinds.count(kind)) for kind in kinds}  # "in 7 groups of 4"
    numbers |= {"0.33.0", "5.26"}  # the version, and the padding's share
    _, text, _ = plan(capsys, *JAMBA_ARGV)
    for line in text.splitlines():
        name, shown = line[:17].strip(), line[17:]
        if name in ("model", "note"):
            assert shown in (document["model"]["description"], *document["notes"])
            continue
        value = re.sub(r"\(\d+\.\d\d [KMGT]iB\)|block 0 is the null block|\([\d, ]+\)", "", line)
        value = re.sub(r"groups? [\d-]+|layers? \([\d, ]+\)", "", value)
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", value[17:]):
            assert number.replace(",", "") in numbers, (line, number)


def test_a_request_that_does_not_fit_names_the_largest_that_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--config", str(CONFIGS / "jamba-defaults.json"), "--memory-budget", "4GiB")
    assert plan(capsys, *argv) == (
        1,
        "",
        "pagedkv plan: does not fit: one request of max_model_len=262,144 needs 4.02 GiB "
        "(4,313,579,520 bytes) of KV cache, more than the 4.00 GiB (4,293,656,576 bytes) left "
        "after the null block; the largest max_model_len that fits is 260,880. Raise "
        "gpu_memory_utilization or lower max_model_len.\n",
    )
    status, out, _ = plan(capsys, *argv, "--json")
    error = json.loads(out)["error"]
    assert status == 1
    assert (error["kind"], error["needed_bytes"], error["largest_max_model_len"]) == (
        "request_does_not_fit",
        4_313_579_520,
        260_880,
    )
    # 260,880 = 3,261 blocks of 80 tokens: 3,261 + 14 states = 3,275 blocks of 1,310,720 bytes
    # fit in 4 GiB less the null block; 260,881 needs one more
    with pytest.raises(RequestDoesNotFitError) as refused:
        plan_of(Case(JAMBA_DEFAULTS, 4 * GiB))
    assert refused.value.available_bytes == 4 * GiB


def test_vllm_0_33_refuses_it_with_the_same_largest_max_model_len() -> None:
    fits = vllm_case(Case(JAMBA_DEFAULTS, 4 * GiB, max_model_len=260_880))
    (theirs, refused) = run_vllm([fits, {**fits, "max_model_len": 260_881}])
    assert theirs["num_blocks"] == 4 * GiB // 1_310_720 == 3276
    assert refused["error"].startswith("ValueError: To serve at least one request")
    assert "the estimated maximum model length is 260880." in refused["error"]


# -- the CLI's options and refusals, word for word -------------------------------------------


def write_config(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("qwen3_next-triton", ("--gdn-prefill-backend", "triton")),
        ("qwen3_next-no-prefix-caching", ("--no-enable-prefix-caching",)),
        ("qwen3_next-tp2-override", ("--tp", "2", "--num-gpu-blocks-override", "3000")),
        ("nemotron_h-tp4-ssm-bf16", ("--tp", "4", "--mamba-ssm-cache-dtype", "bfloat16")),
        ("jamba-tp2-fp8", ("--tp", "2", "--kv-cache-dtype", "fp8", "--max-model-len", "65536")),
        ("falcon_h1-head-dim-block-128", ("--block-size", "128")),
    ],
)
def test_the_options_plan_what_vllm_would_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, flags: tuple[str, ...]
) -> None:
    case = CASES[name]
    budget = f"{case.budget}B"
    argv = ("--config", write_config(tmp_path, case.config), "--memory-budget", budget, *flags)
    status, out, _ = plan(capsys, *argv, "--json")
    assert status == 0
    document = json.loads(out)
    assert (document["num_blocks"], document["block_size"], document["page_size_bytes"]) == (
        VLLM_0_33[name][2],
        VLLM_0_33[name][0],
        VLLM_0_33[name][1],
    )
    assert round(document["max_concurrency"], 4) == VLLM_0_33[name][4]


NOT_FOR_MAMBA = "not for a Mamba hybrid (model_type 'jamba'): its layers come from config.json"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--num-layers", "8"), f"--num-layers: {NOT_FOR_MAMBA}"),
        (("--num-kv-heads", "4"), f"--num-kv-heads: {NOT_FOR_MAMBA}"),
        (("--sliding-window", "4096"), f"--sliding-window: {NOT_FOR_MAMBA}"),
        (("--mla",), f"--mla: {NOT_FOR_MAMBA}"),
        (
            ("--dtype", "float32"),
            "--dtype: dtype must be auto, float16 or bfloat16 for a Mamba hybrid, got "
            "'float32': pagedkv plans its attention on FlashAttention, which runs those only",
        ),
        (
            ("--kv-cache-dtype", "fp8_e5m2"),
            "--kv-cache-dtype: kv_cache_dtype must be auto, fp8 or fp8_e4m3 for a Mamba hybrid "
            "(FlashAttention on Hopper), got 'fp8_e5m2'; pagedkv knows fp8, fp8_e4m3, fp8_e5m2",
        ),
        (
            ("--tp", "3"),
            "--tensor-parallel-size: tensor_parallel_size=3 must divide the Mamba inner "
            "width=8192: each GPU keeps the same share of every recurrent state",
        ),
        (
            ("--tp", "64"),
            "--tensor-parallel-size: tensor_parallel_size=64 must divide num_attention_heads=32"
            ": each GPU gets the same number of query heads",
        ),
    ],
)
def test_options_a_mamba_hybrid_cannot_take_are_refused_naming_them(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    assert plan(capsys, *JAMBA_ARGV, *flags) == (2, "", f"pagedkv plan: error: {message}\n")


def test_mamba_options_are_refused_for_a_model_without_mamba_layers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    llama = ("--num-layers", "2", "--num-kv-heads", "1", "--head-size", "8", "--dtype", "fp16")
    budget = ("--max-model-len", "64", "--memory-budget", "1MiB")
    for option, value in (
        ("--mamba-cache-dtype", "float32"),
        ("--mamba-ssm-cache-dtype", "float32"),
        ("--gdn-prefill-backend", "triton"),
    ):
        assert plan(capsys, *llama, *budget, option, value) == (
            2,
            "",
            f"pagedkv plan: error: {option}: the model has no Mamba layers\n",
        )
    assert plan(capsys, *llama, *budget, "--no-enable-prefix-caching")[0] == 0


PLANS_ONLY = (
    "pagedkv plans 'full_attention', 'sliding_attention', 'chunked_attention' layers, and the "
    "Mamba and linear-attention layers of jamba, falcon_h1, nemotron_h, granitemoehybrid, "
    "qwen3_next only"
)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {
                **QWEN3_NEXT,
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention"] * 3 + ["sliding_attention"],
            },
            "config.json: layer 3 is 'sliding_attention'; pagedkv plans qwen3_next layers of "
            "type 'full_attention', 'linear_attention' only",
        ),
        (
            {**GRANITE_H, "num_hidden_layers": 2, "layer_types": ["mamba", "conv"]},
            "config.json: layer 1 is 'conv'; pagedkv plans granitemoehybrid layers of type "
            "'full_attention', 'linear_attention' only",
        ),
        (
            {**NEMOTRON_H_8B, "hybrid_override_pattern": "M-M*-X"},
            "config.json: hybrid_override_pattern: layer 5 is 'X'; pagedkv plans nemotron_h "
            "layers M (linear_attention), * (full_attention), - (mlp), E (moe) only",
        ),
        (
            {**NEMOTRON_H_8B, "sliding_window": 4096},
            "config.json: nemotron_h with sliding_window=4096: pagedkv plans Nemotron-H's "
            "attention layers as full attention only",
        ),
        (
            {"model_type": "jamba", "layer_types": ["mamba", "attention"]},
            "config.json: jamba's layers come from attn_layer_period and attn_layer_offset; "
            "transformers refuses a 'layer_types'",
        ),
        (  # Kimi-Linear: a linear-attention state pagedkv does not size
            {
                "model_type": "kimi_linear",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "hidden_size": 64,
                "layer_types": ["linear_attention", "full_attention"],
            },
            f"config.json: layer 0 is 'linear_attention'; {PLANS_ONLY}",
        ),
        (  # a pure Mamba model, no layer list in its config
            {
                "model_type": "mamba",
                "num_hidden_layers": 24,
                "hidden_size": 768,
                "state_size": 16,
                "conv_kernel": 4,
                "time_step_rank": 48,
            },
            f"config.json: model_type 'mamba' has layers other than attention (time_step_rank); "
            f"{PLANS_ONLY}",
        ),
        (  # DeepSeek-V3.2's indexer keeps a cache of its own
            {"model_type": "deepseek_v32", "num_hidden_layers": 2, "kv_lora_rank": 512},
            f"config.json: model_type 'deepseek_v32' has 'indexed_attention' layers; {PLANS_ONLY}",
        ),
    ],
)
def test_layers_pagedkv_does_not_know_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], message: str
) -> None:
    argv = ("--config", write_config(tmp_path, config), "--memory-budget", "40GiB")
    assert plan(capsys, *argv, "--max-model-len", "4096") == (
        2,
        "",
        f"pagedkv plan: error: {message}\n",
    )


# -- the pieces --------------------------------------------------------------------------------


def test_the_attention_block_size_rises_until_its_page_holds_a_state() -> None:
    # Jamba: 16 x cdiv(311,296, 16 x 4,096) = 80; a bigger configured block is the alignment
    assert hybrid_block_size(16, 4096, 311_296) == 80
    assert hybrid_block_size(64, 4096, 311_296) == 128
    assert hybrid_block_size(128, 4096, 311_296) == 128
    # a state that already fits a 16-token page leaves the block size alone
    assert hybrid_block_size(16, 4096, 65_536) == 16
    assert hybrid_block_size(16, 4096, 65_537) == 32
    # Qwen3-Next with FlashInfer's prefill: a multiple of its 64-token checkpoints
    assert hybrid_block_size(16, 2048, 1_097_728) == 544
    assert hybrid_block_size(16, 2048, 1_097_728, checkpoint_alignment=64) == 576
    # a block size below the kernel's 16 still rises to a multiple of 16
    assert hybrid_block_size(8, 4096, 4096) == 16
    with pytest.raises(InvalidArgumentError, match="state_bytes must be an int >= 1"):
        hybrid_block_size(16, 4096, 0)


def test_falcon_h1_layers_hold_both_an_attention_and_a_state_attention_first() -> None:
    model = read_mamba_hybrid_config({"model_type": "falcon_h1", "num_hidden_layers": 2})
    specs, block_size = mamba_kv_cache_specs(model, block_size=16, max_model_len=8192)
    assert list(specs) == ["layers.0.attn", "layers.0.mamba", "layers.1.attn", "layers.1.mamba"]
    attention, state = specs["layers.0.attn"], specs["layers.0.mamba"]
    assert attention == FullAttentionSpec(
        block_size=144, num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    assert isinstance(state, MambaSpec) and block_size == 144
    assert state.page_size_bytes == attention.page_size_bytes == 144 * 4096
    assert (state.mamba_type, state.num_prefill_checkpoint_blocks) == ("mamba2", 1)


def test_without_prefix_caching_a_state_is_one_block_of_max_model_len_tokens() -> None:
    model = read_mamba_hybrid_config(JAMBA_DEFAULTS)
    specs, _ = mamba_kv_cache_specs(model, block_size=16, max_model_len=4096, prefix_caching=False)
    state = specs["layers.0.mamba"]
    assert isinstance(state, MambaSpec)
    assert (state.block_size, state.mamba_cache_mode, state.blocks_per_request) == (
        4096,
        "none",
        1,
    )
    assert isinstance(model.state, Mamba1State)


def test_make_mamba_plan_refuses_bad_limits() -> None:
    model = read_mamba_hybrid_config(JAMBA_DEFAULTS)
    with pytest.raises(InvalidArgumentError, match="max_model_len must be an int >= 1, got 0"):
        make_mamba_plan(model, GiB, max_model_len=0)
    with pytest.raises(InvalidArgumentError, match="num_blocks_override must be an int >= 1"):
        make_mamba_plan(model, GiB, max_model_len=16, num_blocks_override=0)
    with pytest.raises(InvalidArgumentError, match="gdn_prefill_backend must be one of"):
        make_mamba_plan(model, GiB, max_model_len=16, gdn_prefill_backend="cuda")
