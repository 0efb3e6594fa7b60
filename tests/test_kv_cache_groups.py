"""Hybrid models' KV cache groups and configs, as vLLM 0.33 builds them (issue 20, item 1).

The grouping rules on small specs, then the models people deploy (tests/configs: Gemma-3,
gpt-oss-20b/120b, Llama-4-Scout, Mistral), their numbers pinned here as vLLM 0.33.0 computes
them and, where the package index is reachable (or the release is cached), compared with vLLM's
own `get_kv_cache_configs` run on vLLM's own specs (`tests/vllm_033_kv_cache_groups.py`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_campaign import UNREACHABLE

from pagedkv.planning.hf_config import read_hf_config
from pagedkv.planning.kv_cache_config import get_kv_cache_config
from pagedkv.planning.kv_cache_groups import (
    blocks_per_request,
    check_enough_memory_for_groups,
    get_grouped_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    kv_cache_bytes_per_block,
    max_concurrency,
    unify_kv_cache_spec_page_size,
)
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

TESTS = Path(__file__).parent
CONFIGS = TESTS / "configs"
GiB = 1 << 30

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float16")  # 32 B
WINDOW = SlidingWindowSpec(
    block_size=4, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=8
)
CHUNKED = ChunkedLocalAttentionSpec(
    block_size=4, num_kv_heads=1, head_size=2, dtype="float16", attention_chunk_size=8
)


def layers(*kinds: KVCacheSpec) -> dict[str, KVCacheSpec]:
    return {f"layers.{index}": spec for index, spec in enumerate(kinds)}


def names(config_groups: Any) -> list[list[int]]:
    return [[int(n.removeprefix("layers.")) for n in g.layer_names] for g in config_groups]


# -- grouping rules ---------------------------------------------------------------------------


def test_one_spec_is_one_group_in_model_order() -> None:
    (group,) = get_kv_cache_groups(layers(WINDOW, WINDOW, WINDOW))
    assert (group.layer_names, group.kv_cache_spec) == (
        ("layers.0", "layers.1", "layers.2"),
        WINDOW,
    )


def test_groups_take_the_fewest_layers_of_a_spec_and_every_nth_layer() -> None:
    # Gemma-3's 5:1 in small: 10 window layers, 2 full; group size 2; window split 5 ways,
    # group i = window layers [i::5].
    kinds = [FULL if (i + 1) % 6 == 0 else WINDOW for i in range(12)]
    groups = get_kv_cache_groups(layers(*kinds))
    assert names(groups) == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert [g.kv_cache_spec for g in groups] == [WINDOW] * 5 + [FULL]


def test_a_count_below_one_and_a_half_times_the_fewest_sets_the_group_size() -> None:
    # gpt-oss + an EAGLE layer: 12 window + 13 full -> groups of 13, the window group padded.
    groups = get_kv_cache_groups(layers(*[WINDOW, FULL] * 12, FULL))
    assert [len(g.layer_names) for g in groups] == [12, 13]
    # 2 window + 3 full: 3 < 1.5 * 2 is false, so groups of 2: window 1 group, full 2 groups
    groups = get_kv_cache_groups(layers(WINDOW, FULL, WINDOW, FULL, FULL))
    assert names(groups) == [[0, 2], [1, 4], [3]]


def test_buckets_come_in_the_order_of_their_first_layer() -> None:
    groups = get_kv_cache_groups(layers(FULL, CHUNKED, CHUNKED, CHUNKED, FULL, WINDOW))
    assert [g.kv_cache_spec for g in groups] == [FULL, FULL, CHUNKED, CHUNKED, CHUNKED, WINDOW]


def test_smaller_pages_grow_their_block_size() -> None:
    # a window layer of 1 KV head next to full layers of 2: its 32-byte page grows to 64 bytes
    # by 8-token blocks; not by padding.
    wide = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=2, dtype="float16")
    unified = unify_kv_cache_spec_page_size(layers(wide, WINDOW))
    assert unified["layers.1"] == SlidingWindowSpec(
        block_size=8, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=8
    )
    config = get_grouped_kv_cache_config(layers(wide, WINDOW), 64 * 10, max_model_len=16)
    assert config.block_sizes == (4, 8)
    assert (config.scheduler_block_size, config.hash_block_size) == (8, 4)
    with pytest.raises(KVCacheConfigError, match="different block sizes"):
        _ = config.block_size


def test_pages_that_do_not_divide_the_largest_are_refused() -> None:
    three = FullAttentionSpec(block_size=4, num_kv_heads=3, head_size=2, dtype="float16")  # 96
    # 32 divides 96: the window layers get blocks of 12 tokens
    groups = get_kv_cache_groups(layers(three, WINDOW, three))
    assert [g.kv_cache_spec.block_size for g in groups] == [4, 4, 12]
    assert names(groups) == [[0], [2], [1]]
    two = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=2, dtype="float16")  # 64
    with pytest.raises(KVCacheConfigError, match=r"64-byte page does not divide .* \(96 bytes"):
        get_kv_cache_groups(layers(two, WINDOW, three))
    wide_window = SlidingWindowSpec(
        block_size=4, num_kv_heads=3, head_size=2, dtype="float16", sliding_window=8
    )
    with pytest.raises(KVCacheConfigError, match=r"vLLM 0\.33 pads such pages"):
        get_kv_cache_groups(layers(two, wide_window))


def test_one_kind_with_different_specs_is_refused_not_split() -> None:
    wide = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=2, dtype="float16")
    with pytest.raises(KVCacheConfigError, match="one group with a spec per layer"):
        get_kv_cache_groups(layers(FULL, wide))


def test_no_layers_or_no_specs_are_refused() -> None:
    with pytest.raises(KVCacheConfigError, match="no KV cache layers"):
        get_kv_cache_groups({})
    with pytest.raises(InvalidArgumentError, match="not a KVCacheSpec"):
        get_kv_cache_groups({"layers.0": "full"})  # type: ignore[dict-item]


# -- the config over the groups ---------------------------------------------------------------


def test_tensors_are_shared_position_by_position() -> None:
    groups = get_kv_cache_groups(layers(WINDOW, FULL, WINDOW, FULL, WINDOW, WINDOW))
    assert names(groups) == [[0, 4], [2, 5], [1, 3]]
    config = get_kv_cache_config_from_groups(groups, 10)
    assert kv_cache_bytes_per_block(groups) == 2 * 32
    assert config.kv_cache_tensors == (
        KVCacheTensor(320, ("layers.0", "layers.2", "layers.1")),
        KVCacheTensor(320, ("layers.4", "layers.5", "layers.3")),
    )
    assert config.tensors["layers.5"] is config.tensors["layers.4"]


def test_a_smaller_mamba_page_is_padded_not_grown() -> None:
    # a state of 24 bytes does not grow with its block size: padded to the 32-byte page; a
    # state already of the largest page is left as it is
    state = MambaSpec(block_size=4, shapes=[(3,), (3, 3)], dtypes=["float16", "float16"])
    assert state.page_size_bytes == 24
    unified = unify_kv_cache_spec_page_size(layers(FULL, state, FULL))
    assert unified["layers.1"] == dataclasses.replace(state, page_size_padded=32)
    assert unified["layers.0"] == FULL
    groups = get_kv_cache_groups(layers(FULL, state, FULL, state))
    assert names(groups) == [[0, 2], [1, 3]]
    config = get_kv_cache_config_from_groups(groups, 5)
    assert config.block_sizes == (4, 4)
    padded = dataclasses.replace(state, page_size_padded=32)
    assert unify_kv_cache_spec_page_size(layers(FULL, padded))["layers.1"] is padded
    # a Mamba group holds its states whatever the length: 2 blocks with prefix caching
    aligned = dataclasses.replace(padded, mamba_cache_mode="align")
    (group,) = get_kv_cache_groups(layers(aligned))
    assert blocks_per_request(group, max_model_len=10**6, max_in_flight_tokens=1) == 2


def test_a_group_shorter_than_the_group_size_leaves_its_last_position_to_the_others() -> None:
    groups = get_kv_cache_groups(layers(*[WINDOW, FULL] * 2, FULL))  # 2 window, 3 full: size 2
    config = get_kv_cache_config_from_groups(groups, 4)
    assert names(groups) == [[0, 2], [1, 4], [3]]
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ("layers.0", "layers.1", "layers.3"),
        ("layers.2", "layers.4"),
    ]


def test_a_uniform_model_gets_what_the_one_group_path_builds() -> None:
    specs = layers(*[FULL] * 5)
    assert get_grouped_kv_cache_config(specs, 10_000, max_model_len=64) == get_kv_cache_config(
        specs, 10_000, max_model_len=64
    )


def test_the_memory_check_holds_back_the_null_block() -> None:
    # gpt-oss in small: blocks of 2 pages = 64 bytes; a request of 16 tokens: 4 full blocks +
    # cdiv(min(7 + 16, 16), 4) + 1 = 5 window blocks = 9 blocks = 576 bytes, + the null block.
    groups = get_kv_cache_groups(layers(WINDOW, FULL, WINDOW, FULL))
    assert [blocks_per_request(g, max_model_len=16, max_in_flight_tokens=16) for g in groups] == [
        5,
        4,
    ]
    check_enough_memory_for_groups(groups, 640, max_model_len=16, max_in_flight_tokens=16)
    # 12 tokens: 3 full blocks + cdiv(12, 4) + 1 = 4 window blocks = 7 fit; 13 need 9
    with pytest.raises(KVCacheConfigError, match="largest max_model_len that fits is 12"):
        check_enough_memory_for_groups(groups, 639, max_model_len=16, max_in_flight_tokens=16)
    with pytest.raises(KVCacheConfigError, match="after the null block"):
        check_enough_memory_for_groups(groups, 64, max_model_len=16, max_in_flight_tokens=16)
    config = get_grouped_kv_cache_config(
        layers(WINDOW, FULL, WINDOW, FULL), 640, max_model_len=16, max_in_flight_tokens=16
    )
    assert config.num_blocks == 10
    assert max_concurrency(config, max_model_len=16, max_in_flight_tokens=16) == 10 / 9


def test_an_override_replaces_the_budget_before_the_check() -> None:
    specs = layers(WINDOW, FULL, WINDOW, FULL)
    config = get_grouped_kv_cache_config(
        specs, 1, max_model_len=16, max_in_flight_tokens=16, num_blocks_override=10
    )
    assert config.num_blocks == 10
    with pytest.raises(KVCacheConfigError, match="largest max_model_len"):
        get_grouped_kv_cache_config(specs, 10**9, max_model_len=16, num_blocks_override=9)
    with pytest.raises(InvalidArgumentError, match="num_blocks_override"):
        get_grouped_kv_cache_config(specs, 10**9, max_model_len=16, num_blocks_override=0)


# -- the models: pagedkv's numbers, vLLM 0.33.0's numbers -------------------------------------

# (config, max_model_len, max_num_batched_tokens, KV budget per GPU, tensor parallel size)
MODELS: dict[str, tuple[int, int, int, int]] = {
    "gemma-3-4b-it": (32_768, 8192, 20 * GiB, 1),
    "gemma-3-27b-it": (131_072, 8192, 40 * GiB, 1),
    "gpt-oss-20b": (131_072, 8192, 20 * GiB, 1),
    "gpt-oss-120b": (131_072, 8192, 20 * GiB, 1),
    "llama-4-scout-17b-16e": (131_072, 8192, 40 * GiB, 4),
    "mistral-7b-v0.1": (32_768, 2048, 20 * GiB, 1),
    "ministral-8b-instruct-2410": (32_768, 8192, 20 * GiB, 1),
}

# vLLM 0.33.0's `get_kv_cache_configs` and `get_max_concurrency_for_kv_cache_config` on these
# (block size 16, async scheduling: 2 x max_num_batched_tokens in flight): the groups (layers,
# kind), num_blocks, max concurrency; then with --disable-hybrid-kv-cache-manager.
VLLM_0_33: dict[str, tuple[list[tuple[int, str]], int, float, int | None, float | None]] = {
    "gemma-3-4b-it": (
        [(5, "sliding")] * 5 + [(4, "sliding"), (5, "full")],
        65536,
        7.6364,
        9637,
        4.7056,
    ),
    "gemma-3-27b-it": (
        [(9, "sliding")] * 4 + [(8, "sliding")] * 2 + [(10, "full")],
        32768,
        2.2252,
        None,
        None,
    ),  # without the hybrid manager: does not fit
    "gpt-oss-20b": ([(12, "sliding"), (12, "full")], 54613, 5.9201, 27306, 3.3333),
    "gpt-oss-120b": ([(18, "sliding"), (18, "full")], 36408, 3.9467, 18204, 2.2222),
    "llama-4-scout-17b-16e": (
        [(12, "chunked")] * 3 + [(12, "full")],
        218453,
        17.0666,
        54613,
        6.6666,
    ),
    "mistral-7b-v0.1": ([(32, "sliding")], 10240, 19.9610, 10240, 19.9610),
    "ministral-8b-instruct-2410": ([(36, "sliding")], 9102, 4.4422, 9102, 4.4422),
}


def model_specs(name: str) -> dict[str, KVCacheSpec]:
    tensor_parallel_size = MODELS[name][3]
    shape = read_hf_config(json.loads((CONFIGS / f"{name}.json").read_text())).shape
    return shape.kv_cache_specs(16, tensor_parallel_size)


def kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    return "chunked" if isinstance(spec, ChunkedLocalAttentionSpec) else "full"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_models_group_as_in_vllm_0_33(name: str) -> None:
    max_model_len, batched, budget, _ = MODELS[name]
    config = get_grouped_kv_cache_config(
        model_specs(name), budget, max_model_len=max_model_len, max_in_flight_tokens=2 * batched
    )
    groups, num_blocks, concurrency, _, _ = VLLM_0_33[name]
    assert [(len(g.layer_names), kind(g.kv_cache_spec)) for g in config.kv_cache_groups] == groups
    assert config.num_blocks == num_blocks
    limits = {"max_model_len": max_model_len, "max_in_flight_tokens": 2 * batched}
    assert max_concurrency(config, **limits) == pytest.approx(concurrency, abs=1e-4)
    # one block id addresses a page of every group: group size x page bytes per block
    assert sum(t.size for t in config.kv_cache_tensors) == num_blocks * kv_cache_bytes_per_block(
        config.kv_cache_groups
    )


def vllm_case(name: str, disable_hybrid: bool) -> dict[str, Any]:
    """The case `tests/vllm_033_kv_cache_groups.py` runs for model `name`."""
    max_model_len, batched, budget, _ = MODELS[name]
    specs = model_specs(name)
    first = next(iter(specs.values()))
    assert isinstance(first, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec)
    return {
        "kinds": [kind(spec) for spec in specs.values()],
        "sliding_window": next(
            (s.sliding_window for s in specs.values() if isinstance(s, SlidingWindowSpec)), None
        ),
        "attention_chunk_size": next(
            (
                s.attention_chunk_size
                for s in specs.values()
                if isinstance(s, ChunkedLocalAttentionSpec)
            ),
            None,
        ),
        "block_size": 16,
        "num_kv_heads": first.num_kv_heads,
        "head_size": first.head_size,
        "dtype": first.dtype,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": batched,
        "available_memory": budget,
        "disable_hybrid": disable_hybrid,
    }


def test_vllm_0_33_itself_builds_the_pinned_numbers() -> None:
    """vLLM 0.33.0's own planning code on the same layers: groups, layers, blocks, tensors."""
    cases = [vllm_case(name, disable) for disable in (False, True) for name in sorted(MODELS)]
    completed = subprocess.run(
        [sys.executable, str(TESTS / "vllm_033_kv_cache_groups.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode == UNREACHABLE:
        pytest.skip("vllm==0.33.0: the package index is unreachable and nothing is cached")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results = json.loads(completed.stdout.splitlines()[-1])
    hybrid, uniform = results[: len(MODELS)], results[len(MODELS) :]
    for name, theirs, theirs_uniform in zip(sorted(MODELS), hybrid, uniform, strict=True):
        groups, num_blocks, concurrency, uniform_blocks, uniform_concurrency = VLLM_0_33[name]
        assert [(len(g["layers"]), g["kind"]) for g in theirs["groups"]] == groups, name
        assert theirs["num_blocks"] == num_blocks, name
        assert theirs["max_concurrency"] == pytest.approx(concurrency, abs=1e-4), name
        if uniform_blocks is None:
            assert "To serve at least one request" in theirs_uniform["error"], name
        else:
            assert theirs_uniform["num_blocks"] == uniform_blocks, name
            assert theirs_uniform["max_concurrency"] == pytest.approx(uniform_concurrency, 1e-4)
        # the same layers in the same groups, and the same tensors over them
        max_model_len, batched, budget, _ = MODELS[name]
        ours = get_grouped_kv_cache_config(
            model_specs(name), budget, max_model_len=max_model_len, max_in_flight_tokens=2 * batched
        )
        assert [list(g.layer_names) for g in ours.kv_cache_groups] == [
            g["layers"] for g in theirs["groups"]
        ], name
        assert [g.kv_cache_spec.block_size for g in ours.kv_cache_groups] == [
            g["block_size"] for g in theirs["groups"]
        ], name
        # vLLM 0.33: one backing of num_blocks blocks; each group's layers at their offsets,
        # aliased position by position. pagedkv: one tensor per position, shared by the groups.
        page = next(iter(ours.kv_cache_groups)).kv_cache_spec.page_size_bytes
        assert {t["size"] for t in theirs["tensors"]} == {
            sum(t.size for t in ours.kv_cache_tensors)
        }, name
        for tensor in theirs["tensors"]:
            for position, layer in enumerate(tensor["layers"]):
                offset = tensor["offset"] + position * page * ours.num_blocks
                assert (
                    ours.tensors[layer] == ours.kv_cache_tensors[offset // ours.tensors[layer].size]
                )
