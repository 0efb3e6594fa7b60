"""KV cache specs and configs: page-size and per-request formulas by hand, dtypes, validation."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch

from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    DTYPE_ALIASES,
    DTYPE_SIZES,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    dtype_name,
    dtype_size,
    mamba_state_bytes,
)

# The chapter's worked example: Llama-2-13B, fp16, block 16, 40 KV heads of 128.
LLAMA2_13B = FullAttentionSpec(block_size=16, num_kv_heads=40, head_size=128, dtype="float16")


def full(**overrides: object) -> FullAttentionSpec:
    fields: dict[str, object] = {
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 2,
        "dtype": "float16",
    }
    fields.update(overrides)
    return FullAttentionSpec(**fields)  # type: ignore[arg-type]


def window(**overrides: object) -> SlidingWindowSpec:
    fields: dict[str, object] = {
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 2,
        "dtype": "float16",
        "sliding_window": 4,
    }
    fields.update(overrides)
    return SlidingWindowSpec(**fields)  # type: ignore[arg-type]


# -- page size -------------------------------------------------------------------------------


def test_page_size_of_the_chapter_example() -> None:
    # 2 (K and V) * 16 tokens * 40 heads * 128 * 2 bytes
    assert LLAMA2_13B.page_size_bytes == 327_680
    # one logical block across 40 layers: 13,107,200 bytes = 12.5 MiB
    assert LLAMA2_13B.page_size_bytes * 40 == 13_107_200 == int(12.5 * (1 << 20))


def test_page_size_of_mla_stores_one_latent_vector() -> None:
    # DeepSeek-V2-style MLA: 1 "head" of kv_lora_rank 512 + rope 64 = 576, bf16, block 16:
    # 1 * 16 * 1 * 576 * 2
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", use_mla=True
    )
    assert spec.page_size_bytes == 18_432
    assert dataclasses.replace(spec, use_mla=False).page_size_bytes == 36_864


def test_page_size_of_sliding_window_and_other_dtypes() -> None:
    # Mistral-7B: block 16, 8 KV heads of 128, bf16: 2 * 16 * 8 * 128 * 2
    mistral = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
    )
    assert mistral.page_size_bytes == 65_536
    assert full(dtype="float32").page_size_bytes == 2 * 4 * 1 * 2 * 4 == 64
    assert full(dtype="fp8").page_size_bytes == 2 * 4 * 1 * 2 * 1 == 16
    assert full(dtype=torch.int8, num_kv_heads=3).page_size_bytes == 2 * 4 * 3 * 2 * 1 == 48


# -- memory for one request -----------------------------------------------------------------


def test_full_attention_needs_a_page_per_block_of_max_model_len() -> None:
    # cdiv(4096, 16) = 256 pages of 327,680 bytes
    assert LLAMA2_13B.max_memory_usage_bytes(4096, 2048) == 256 * 327_680 == 83_886_080
    assert LLAMA2_13B.max_memory_usage_bytes(4097, 2048) == 257 * 327_680
    assert LLAMA2_13B.max_memory_usage_bytes(1, 1) == 327_680
    # the batch size does not matter for full attention
    assert LLAMA2_13B.max_memory_usage_bytes(4096, 1) == LLAMA2_13B.max_memory_usage_bytes(
        4096, 100_000
    )


def test_sliding_window_needs_window_plus_batch_plus_one_block() -> None:
    mistral = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
    )
    # min(4095 + 2048, 32768) = 6143 tokens; cdiv(6143, 16) = 384; + 1 = 385 pages
    assert mistral.max_memory_usage_bytes(32_768, 2048) == 385 * 65_536 == 25_231_360
    # capped by max_model_len: min(6143, 1000) = 1000; cdiv(1000, 16) = 63; + 1 = 64 pages
    assert mistral.max_memory_usage_bytes(1000, 2048) == 64 * 65_536
    # the docstring's picture: B = 4, W = 4, one new token: min(3 + 1, 100) = 4 -> 1 + 1 pages
    assert window().max_memory_usage_bytes(100, 1) == 2 * window().page_size_bytes == 64
    # W = 4, 5 new tokens: 3 + 5 = 8 -> 2 + 1 pages
    assert window().max_memory_usage_bytes(100, 5) == 3 * 32


@pytest.mark.parametrize("spec", [full(), window()])
@pytest.mark.parametrize(("max_model_len", "batched"), [(0, 1), (1, 0), (-4, 3)])
def test_memory_usage_rejects_limits_below_one(
    spec: KVCacheSpec, max_model_len: int, batched: int
) -> None:
    with pytest.raises(InvalidArgumentError, match=">= 1"):
        spec.max_memory_usage_bytes(max_model_len, batched)


# -- type ids ---------------------------------------------------------------------------------


def test_type_ids_name_the_kind_window_block_and_page() -> None:
    assert LLAMA2_13B.type_id == "full_attention_16_327680"
    assert window().type_id == "sliding_window_4_4_32"
    # same page size, different layout: same type id, but not equal specs
    assert full(num_kv_heads=2, head_size=1).type_id == full().type_id
    assert full(num_kv_heads=2, head_size=1) != full()
    # a window spec never equals a full spec with the same fields
    assert window() != full()


# -- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "name", "size"),
    [
        (torch.float16, "float16", 2),
        (torch.half, "float16", 2),
        (torch.bfloat16, "bfloat16", 2),
        (torch.float32, "float32", 4),
        (torch.float8_e4m3fn, "float8_e4m3fn", 1),
        (torch.float8_e5m2, "float8_e5m2", 1),
        (torch.int8, "int8", 1),
        (torch.uint8, "uint8", 1),
        ("float16", "float16", 2),
        ("torch.bfloat16", "bfloat16", 2),
        ("  BF16 ", "bfloat16", 2),
        ("half", "float16", 2),
        ("fp8", "float8_e4m3fn", 1),
        ("fp8_e5m2", "float8_e5m2", 1),
        ("float", "float32", 4),
    ],
)
def test_dtypes_normalize_to_a_canonical_name(given: object, name: str, size: int) -> None:
    assert dtype_name(given) == name  # type: ignore[arg-type]
    assert dtype_size(given) == size  # type: ignore[arg-type]
    spec = full(dtype=given)
    assert spec.dtype == name
    assert isinstance(spec.dtype, str)
    assert spec == full(dtype=name)


def test_every_known_dtype_has_torchs_element_size() -> None:
    for name, size in DTYPE_SIZES.items():
        torch_dtype = getattr(torch, name)
        assert torch_dtype.itemsize == size, name
        assert dtype_name(torch_dtype) == name
    for alias, name in DTYPE_ALIASES.items():
        assert name in DTYPE_SIZES, alias


@pytest.mark.parametrize("bad", ["float128", "auto", "", torch.complex64, 2, None, object()])
def test_unknown_dtypes_are_refused_clearly(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="dtype"):
        full(dtype=bad)


def test_unknown_dtype_message_lists_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown KV cache dtype 'float128'.*bfloat16"):
        dtype_name("float128")


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0, "4"])
def test_sizes_must_be_positive_ints(field: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{field} must be an int >= 1"):
        full(**{field: value})
    with pytest.raises(InvalidArgumentError, match=f"{field} must be an int >= 1"):
        window(**{field: value})


@pytest.mark.parametrize("value", [0, -1, False])
def test_sliding_window_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="sliding_window must be an int >= 1"):
        window(sliding_window=value)


def test_use_mla_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="use_mla must be a bool"):
        full(use_mla=1)


def test_mla_with_a_sliding_window_is_refused() -> None:
    with pytest.raises(KVCacheConfigError, match="MLA is not supported with a sliding window"):
        window(use_mla=True)
    with pytest.raises(KVCacheConfigError, match="MLA"):
        dataclasses.replace(window(), use_mla=True)


def test_specs_are_frozen_hashable_picklable_and_replace_revalidates() -> None:
    spec = window()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 8  # type: ignore[misc]
    assert len({spec, window(), full(), full()}) == 2
    for original in (spec, LLAMA2_13B, full(use_mla=True)):
        copy = pickle.loads(pickle.dumps(original))
        assert copy == original
        assert type(copy) is type(original)
    assert dataclasses.replace(spec, block_size=8).page_size_bytes == 64
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(spec, block_size=0)


def test_the_base_specs_are_abstract() -> None:
    with pytest.raises(TypeError):
        KVCacheSpec(block_size=4)  # type: ignore[abstract]


# -- Mamba states ------------------------------------------------------------------------------


def mamba(**overrides: object) -> MambaSpec:
    # Jamba's Mamba-1 layer: conv (3, 8,192) + ssm (8,192, 16), bfloat16
    fields: dict[str, object] = {
        "block_size": 80,
        "shapes": [(3, 8192), (8192, 16)],
        "dtypes": ["bfloat16", torch.bfloat16],
        "mamba_type": "mamba1",
        "mamba_cache_mode": "align",
    }
    fields.update(overrides)
    return MambaSpec(**fields)  # type: ignore[arg-type]


def test_a_mamba_page_is_its_state_or_the_padded_size() -> None:
    # (3 x 8,192 + 8,192 x 16) x 2 bytes
    assert mamba().state_size_bytes == mamba().page_size_bytes == 311_296
    assert mamba_state_bytes([(3, 8192), (8192, 16)], ["bfloat16", "bfloat16"]) == 311_296
    # padded to an 80-token attention page of 4,096 bytes a token
    padded = mamba(page_size_padded=327_680)
    assert (padded.page_size_bytes, padded.state_size_bytes) == (327_680, 311_296)
    # Nemotron-H's ssm state in float32: (3 x 10,240) x 2 + (128 x 64 x 128) x 4
    nemotron = mamba(shapes=[(3, 10_240), (128, 64, 128)], dtypes=["bfloat16", "float32"])
    assert nemotron.page_size_bytes == 61_440 + 4_194_304
    assert nemotron.dtypes == ("bfloat16", "float32")


def test_a_request_holds_two_or_three_states_with_prefix_caching_else_one() -> None:
    # whatever the length: the running state, the last at a block boundary, a prefill
    # checkpoint (Mamba-2), and one per draft token
    for max_model_len in (1, 80, 10**6):
        assert mamba().max_memory_usage_bytes(max_model_len, 1) == 2 * 311_296
    assert mamba(num_prefill_checkpoint_blocks=1).blocks_per_request == 3
    assert mamba(num_speculative_blocks=2, num_prefill_checkpoint_blocks=1).blocks_per_request == 5
    assert mamba(mamba_cache_mode="none", num_prefill_checkpoint_blocks=1).blocks_per_request == 1
    assert mamba(mamba_cache_mode="none", num_speculative_blocks=2).blocks_per_request == 3
    with pytest.raises(InvalidArgumentError, match="max_model_len must be an int >= 1"):
        mamba().max_memory_usage_bytes(0, 1)


def test_a_mamba_type_id_names_the_recurrence_mode_states_block_and_page() -> None:
    assert mamba(page_size_padded=327_680).type_id == "mamba_mamba1_align_2_80_327680"
    assert mamba().type_id != mamba(mamba_cache_mode="none").type_id
    assert mamba() != full() and mamba() == mamba()


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"shapes": []}, InvalidArgumentError, "MambaSpec: shapes must be a non-empty"),
        ({"shapes": "3x8"}, ArgumentTypeError, "MambaSpec: shapes must be a non-empty"),
        ({"shapes": [(3, 0), (8, 16)]}, InvalidArgumentError, r"shapes\[0\] must be"),
        ({"shapes": [(3, 8), ()]}, InvalidArgumentError, r"shapes\[1\] must be"),
        ({"shapes": [(3, 8.0), (8, 16)]}, ArgumentTypeError, r"shapes\[0\] must be"),
        ({"shapes": [3, (8, 16)]}, ArgumentTypeError, r"shapes\[0\] must be"),
        ({"dtypes": ["bfloat16"]}, KVCacheConfigError, "one dtype per state shape: 2 shapes, 1"),
        ({"dtypes": ["bfloat16", "float12"]}, InvalidArgumentError, "unknown KV cache dtype"),
        ({"block_size": 0}, InvalidArgumentError, "block_size must be an int >= 1"),
        ({"page_size_padded": 0}, InvalidArgumentError, "page_size_padded must be an int >= 1"),
        (
            {"page_size_padded": 311_295},
            KVCacheConfigError,
            "page_size_padded=311,295 is smaller than the 311,296-byte state",
        ),
        ({"mamba_cache_mode": "all"}, InvalidArgumentError, "must be one of align, none"),
        ({"mamba_type": 1}, ArgumentTypeError, "MambaSpec: mamba_type must be a str"),
        (
            {"num_speculative_blocks": -1},
            InvalidArgumentError,
            "MambaSpec: num_speculative_blocks must be an int >= 0, got -1",
        ),
        (
            {"num_prefill_checkpoint_blocks": True},
            ArgumentTypeError,
            "MambaSpec: num_prefill_checkpoint_blocks must be an int >= 0, got True",
        ),
    ],
)
def test_mamba_specs_refuse_what_cannot_be_a_state(
    overrides: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        mamba(**overrides)


def test_mamba_specs_are_frozen_hashable_picklable_and_replace_revalidates() -> None:
    spec = mamba(page_size_padded=327_680)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert len({spec, mamba(page_size_padded=327_680), mamba()}) == 2
    assert dataclasses.replace(spec, block_size=16).page_size_bytes == 327_680
    assert dataclasses.replace(spec, page_size_padded=None).page_size_bytes == 311_296
    with pytest.raises(KVCacheConfigError, match="smaller than"):
        dataclasses.replace(spec, page_size_padded=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 8  # type: ignore[misc]


def test_a_group_of_attention_and_one_of_states_share_tensors_page_by_page() -> None:
    # Jamba in small: one attention layer and one Mamba layer, pages padded to one size
    attention = full(block_size=80, num_kv_heads=8, head_size=128, dtype="bfloat16")
    state = mamba(page_size_padded=attention.page_size_bytes)
    shared = KVCacheTensor(attention.page_size_bytes * 3, ["attn", "mamba"])
    cfg = KVCacheConfig(
        3,
        {"attn": shared, "mamba": shared},
        [KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["mamba"], state)],
    )
    assert cfg.block_sizes == (80, 80) and cfg.kv_cache_tensors == (shared,)


# -- tensors, groups, configs -------------------------------------------------------------


def test_tensor_size_must_be_positive() -> None:
    assert KVCacheTensor(size=1).size == 1
    with pytest.raises(InvalidArgumentError, match=r"KVCacheTensor\.size"):
        KVCacheTensor(size=0)


def test_group_needs_distinct_layers_and_a_spec() -> None:
    group = KVCacheGroupSpec(["a", "b"], full())
    assert group.layer_names == ("a", "b")
    with pytest.raises(KVCacheConfigError, match="at least one layer"):
        KVCacheGroupSpec([], full())
    with pytest.raises(KVCacheConfigError, match="twice"):
        KVCacheGroupSpec(["a", "a"], full())
    with pytest.raises(ArgumentTypeError, match="collection"):
        KVCacheGroupSpec("ab", full())
    with pytest.raises(InvalidArgumentError, match="KVCacheSpec"):
        KVCacheGroupSpec(["a"], "full")  # type: ignore[arg-type]


def config(num_blocks: int = 3, pages: int = 3) -> KVCacheConfig:
    spec = full()  # 32-byte pages
    return KVCacheConfig(
        num_blocks=num_blocks,
        tensors={"a": KVCacheTensor(32 * pages), "b": KVCacheTensor(32 * pages)},
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec)],
    )


def test_config_fields_follow_the_interface_contract() -> None:
    cfg = config()
    assert cfg.num_blocks == 3
    assert cfg.tensors == {"a": KVCacheTensor(96), "b": KVCacheTensor(96)}
    assert isinstance(cfg.tensors, dict)
    assert cfg.kv_cache_groups[0].kv_cache_spec == full()
    assert cfg.layer_names == ("a", "b")
    assert cfg.block_size == 4


def test_config_copies_the_tensor_mapping() -> None:
    tensors = {"a": KVCacheTensor(32)}
    cfg = KVCacheConfig(1, tensors, [KVCacheGroupSpec(["a"], full())])
    tensors["b"] = KVCacheTensor(32)
    assert list(cfg.tensors) == ["a"]


def test_config_allows_tensors_larger_than_num_blocks() -> None:
    # after multi-worker unification a worker keeps its larger tensors
    assert config(num_blocks=2, pages=5).with_num_blocks(1).num_blocks == 1


def test_config_refuses_inconsistent_layouts() -> None:
    spec = full()
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        config(num_blocks=0)
    with pytest.raises(KVCacheConfigError, match="at least num_blocks=4"):
        config(num_blocks=4, pages=3)
    with pytest.raises(KVCacheConfigError, match="at least num_blocks"):
        config(pages=3).with_num_blocks(4)
    with pytest.raises(KVCacheConfigError, match="whole number of 32-byte pages"):
        KVCacheConfig(1, {"a": KVCacheTensor(33)}, [KVCacheGroupSpec(["a"], spec)])
    with pytest.raises(KVCacheConfigError, match=r"without a tensor \['b'\]"):
        KVCacheConfig(1, {"a": KVCacheTensor(32)}, [KVCacheGroupSpec(["a", "b"], spec)])
    with pytest.raises(KVCacheConfigError, match=r"in no group \['b'\]"):
        KVCacheConfig(
            1,
            {"a": KVCacheTensor(32), "b": KVCacheTensor(32)},
            [KVCacheGroupSpec(["a"], spec)],
        )
    with pytest.raises(KVCacheConfigError, match="more than one group"):
        KVCacheConfig(
            1,
            {"a": KVCacheTensor(32)},
            [KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["a"], window())],
        )
    with pytest.raises(KVCacheConfigError, match="at least one group"):
        KVCacheConfig(1, {}, [])


def _one_group(spec: KVCacheSpec, interval: object = None) -> KVCacheConfig:
    return KVCacheConfig(
        1,
        {"a": KVCacheTensor(spec.page_size_bytes)},
        [KVCacheGroupSpec(["a"], spec)],
        prefix_cache_retention_interval=interval,  # type: ignore[arg-type]
    )


def test_retention_defaults_to_dense_and_survives_copies() -> None:
    assert config().prefix_cache_retention_interval is None
    sparse = _one_group(window(), 0)
    assert sparse.prefix_cache_retention_interval == 0
    assert sparse.with_num_blocks(1) == sparse
    assert sparse.with_retention(8).prefix_cache_retention_interval == 8
    assert dataclasses.replace(sparse, num_blocks=1) == sparse
    assert pickle.loads(pickle.dumps(sparse)) == sparse
    assert sparse != sparse.with_retention(None)


@pytest.mark.parametrize("interval", [0, 4, 8, 400])
def test_retention_is_zero_or_a_positive_multiple_of_the_block(interval: int) -> None:
    assert _one_group(window(), interval).prefix_cache_retention_interval == interval


@pytest.mark.parametrize("interval", [-4, 2, 6])
def test_retention_off_the_block_grid_is_refused(interval: int) -> None:
    with pytest.raises(KVCacheConfigError, match="must be >= 0 and a multiple of"):
        _one_group(window(), interval)


@pytest.mark.parametrize("interval", [4, -4, 2])
def test_retention_without_a_window_or_mamba_group_is_refused_unless_zero(interval: int) -> None:
    # vLLM 0.33 checks this first, so a negative interval gets this refusal too.
    assert _one_group(full(), 0).prefix_cache_retention_interval == 0
    with pytest.raises(KVCacheConfigError, match="needs a sliding-window or Mamba group"):
        _one_group(full(), interval)


@pytest.mark.parametrize("interval", [True, 4.0, "4"])
def test_retention_of_another_type_is_refused(interval: object) -> None:
    with pytest.raises(ArgumentTypeError, match="prefix_cache_retention_interval"):
        _one_group(window(), interval)


def test_config_block_size_needs_one_block_size() -> None:
    cfg = KVCacheConfig(
        1,
        {"a": KVCacheTensor(32), "b": KVCacheTensor(64)},
        [KVCacheGroupSpec(["a"], full()), KVCacheGroupSpec(["b"], full(block_size=8))],
    )
    with pytest.raises(KVCacheConfigError, match=r"different block sizes: \[4, 8\]"):
        _ = cfg.block_size


def test_groups_of_different_block_sizes_give_the_sizes_a_hybrid_manager_needs() -> None:
    cfg = KVCacheConfig(
        1,
        {"a": KVCacheTensor(32), "b": KVCacheTensor(64), "c": KVCacheTensor(96)},
        [
            KVCacheGroupSpec(["a"], full()),
            KVCacheGroupSpec(["b"], full(block_size=8)),
            KVCacheGroupSpec(["c"], window(block_size=12)),
        ],
    )
    assert cfg.block_sizes == (4, 8, 12)
    assert (cfg.scheduler_block_size, cfg.hash_block_size) == (24, 4)  # vLLM's LCM and GCD
    assert config().block_sizes == (4,)
    assert (config().scheduler_block_size, config().hash_block_size) == (4, 4)


def test_groups_share_tensors_position_by_position() -> None:
    # vLLM's hybrid layout: layer i of each group uses one tensor; a block id owns one group
    first, second = KVCacheTensor(64, ["a", "c"]), KVCacheTensor(64, ("b", "d"))
    cfg = KVCacheConfig(
        2,
        {"a": first, "b": second, "c": first, "d": second},
        [KVCacheGroupSpec(["a", "b"], full()), KVCacheGroupSpec(["c", "d"], window())],
    )
    assert first.shared_by == ("a", "c")
    assert cfg.kv_cache_tensors == (first, second)
    assert config().kv_cache_tensors == (KVCacheTensor(96), KVCacheTensor(96))
    # existing callers: a tensor of one layer names no sharers, positionally or by keyword
    assert KVCacheTensor(32) == KVCacheTensor(size=32) == KVCacheTensor(32, ())


def test_shared_tensors_must_agree() -> None:
    shared = KVCacheTensor(64, ["a", "c"])
    groups = [KVCacheGroupSpec(["a", "b"], full()), KVCacheGroupSpec(["c", "d"], window())]
    with pytest.raises(KVCacheConfigError, match="which does not name it"):
        KVCacheConfig(2, {"a": shared, "b": shared, "c": shared, "d": KVCacheTensor(64)}, groups)
    with pytest.raises(KVCacheConfigError, match="must map to the one tensor shared by"):
        KVCacheConfig(
            2,
            {"a": shared, "b": KVCacheTensor(64), "c": KVCacheTensor(64), "d": KVCacheTensor(64)},
            groups,
        )
    same_group = KVCacheTensor(64, ["a", "b"])
    with pytest.raises(KVCacheConfigError, match="are both in group 0"):
        KVCacheConfig(
            2,
            {"a": same_group, "b": same_group, "c": KVCacheTensor(64), "d": KVCacheTensor(64)},
            groups,
        )
    with pytest.raises(KVCacheConfigError, match="names a layer twice"):
        KVCacheTensor(64, ["a", "a"])


def test_importing_the_budgeting_modules_does_not_import_torch() -> None:
    code = (
        "import sys, pagedkv.vocab.kv_cache_interface, pagedkv.planning.kv_cache_config, "
        "pagedkv.planning.available_memory, pagedkv.planning.distributed, pagedkv.planning.plan; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
