"""Budget -> config: the not-enough-memory check, the block count, hybrid unification, workers."""

from __future__ import annotations

import copy
import itertools
import logging
import re

import pytest

from pagedkv.planning.kv_cache_config import (
    GiB,
    check_enough_kv_cache_memory,
    check_kv_cache_groups_match,
    estimate_max_model_len,
    get_kv_cache_config,
    memory_needed_bytes,
    sorted_kv_cache_groups,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_configs,
)
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

LLAMA2_13B = FullAttentionSpec(block_size=16, num_kv_heads=40, head_size=128, dtype="float16")
LLAMA2_13B_LAYERS: dict[str, KVCacheSpec] = {f"layers.{i}": LLAMA2_13B for i in range(40)}

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float16")  # 32 B pages
WINDOW = SlidingWindowSpec(
    block_size=4, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=4
)


def layers(*specs: KVCacheSpec) -> dict[str, KVCacheSpec]:
    return {f"layer.{i}": spec for i, spec in enumerate(specs)}


# -- memory needed, and the largest max_model_len that fits ---------------------------------


def test_memory_needed_sums_layers() -> None:
    # 40 layers * 256 pages * 327,680 bytes = 3,355,443,200 bytes = 3.125 GiB
    assert memory_needed_bytes(LLAMA2_13B_LAYERS, max_model_len=4096) == 3_355_443_200
    # 2 full layers: cdiv(64, 4) = 16 pages each; 2 window layers, 4 new tokens per step:
    # min(3 + 4, 64) = 7 -> cdiv(7, 4) + 1 = 3 pages each; (2 * 16 + 2 * 3) * 32 = 1216
    hybrid = layers(FULL, WINDOW, FULL, WINDOW)
    assert memory_needed_bytes(hybrid, max_model_len=64, max_num_batched_tokens=4) == 1216
    # max_num_batched_tokens defaults to max_model_len: window needs min(3 + 64, 64) = 64 tokens
    # -> 16 + 1 pages
    assert memory_needed_bytes(layers(WINDOW), max_model_len=64) == 17 * 32


def test_estimate_of_the_chapter_example() -> None:
    # 2 GiB / 13,107,200 bytes per 16-token block over 40 layers = 163.84 -> 163 blocks
    # -> 163 * 16 = 2608 tokens (2609 would need a 164th block: 2,149,580,800 > 2 GiB)
    assert estimate_max_model_len(LLAMA2_13B_LAYERS, 2 * GiB, max_model_len=4096) == 2608
    # everything fits: the search never goes above max_model_len
    assert estimate_max_model_len(LLAMA2_13B_LAYERS, 40 * GiB, max_model_len=4096) == 4096
    # one block of every layer does not fit
    assert estimate_max_model_len(LLAMA2_13B_LAYERS, 13_107_199, max_model_len=4096) == 0
    assert estimate_max_model_len(LLAMA2_13B_LAYERS, 13_107_200, max_model_len=4096) == 16


def test_estimate_matches_a_linear_scan() -> None:
    models = [layers(FULL), layers(WINDOW, WINDOW), layers(FULL, WINDOW, FULL)]
    for specs, batched, available in itertools.product(models, [1, 3, 9], range(0, 700, 29)):
        expected = max(
            (
                n
                for n in range(1, 41)
                if memory_needed_bytes(specs, max_model_len=n, max_num_batched_tokens=batched)
                <= available
            ),
            default=0,
        )
        got = estimate_max_model_len(
            specs, available, max_model_len=40, max_num_batched_tokens=batched
        )
        assert got == expected, (specs, batched, available)


def test_estimate_changes_nothing_it_is_given() -> None:
    specs = layers(FULL, WINDOW)
    before = copy.deepcopy(specs)
    estimate_max_model_len(specs, 100, max_model_len=64, max_num_batched_tokens=4)
    assert specs == before


@pytest.mark.parametrize("function", [memory_needed_bytes, estimate_max_model_len])
def test_limits_and_specs_are_validated(function: object) -> None:
    def call(specs: object, **limits: object) -> object:
        if function is memory_needed_bytes:
            return memory_needed_bytes(specs, **limits)  # type: ignore[arg-type]
        return estimate_max_model_len(specs, 100, **limits)  # type: ignore[arg-type]

    with pytest.raises(InvalidArgumentError, match="max_model_len must be an int >= 1"):
        call(layers(FULL), max_model_len=0)
    with pytest.raises(InvalidArgumentError, match="max_num_batched_tokens must be an int >= 1"):
        call(layers(FULL), max_model_len=8, max_num_batched_tokens=0)
    with pytest.raises(KVCacheConfigError, match="no KV cache layers"):
        call({}, max_model_len=8)
    with pytest.raises(InvalidArgumentError, match="'x': not a KVCacheSpec"):
        call({"x": 3}, max_model_len=8)


# -- not enough memory ---------------------------------------------------------------------


def test_not_enough_memory_names_needed_available_and_the_largest_length_that_fits() -> None:
    with pytest.raises(KVCacheConfigError) as raised:
        check_enough_kv_cache_memory(LLAMA2_13B_LAYERS, 2 * GiB, max_model_len=4096)
    assert str(raised.value) == (
        "one request of max_model_len=4,096 needs 3.12 GiB (3,355,443,200 bytes) of KV cache, "
        "more than the 2.00 GiB (2,147,483,648 bytes) available; the largest max_model_len "
        "that fits is 2,608. Raise gpu_memory_utilization or lower max_model_len."
    )


def test_not_enough_memory_even_for_one_token() -> None:
    with pytest.raises(KVCacheConfigError, match=r"not even max_model_len=1 fits\."):
        check_enough_kv_cache_memory(layers(FULL), 31, max_model_len=8)


@pytest.mark.parametrize("available", [0, -1, -(10**9)])
def test_no_memory_at_all(available: int) -> None:
    with pytest.raises(KVCacheConfigError, match="no memory is available for the KV cache"):
        check_enough_kv_cache_memory(layers(FULL), available, max_model_len=8)


def test_exactly_enough_memory_passes() -> None:
    check_enough_kv_cache_memory(LLAMA2_13B_LAYERS, 3_355_443_200, max_model_len=4096)
    with pytest.raises(KVCacheConfigError, match="largest max_model_len that fits is 4,080"):
        check_enough_kv_cache_memory(LLAMA2_13B_LAYERS, 3_355_443_199, max_model_len=4096)


def test_not_enough_memory_for_sliding_window_uses_the_window_formula() -> None:
    # 1 window layer, 2 new tokens per step, max_model_len 64: min(3 + 2, 64) = 5 -> 2 + 1 pages
    # = 96 bytes needed. With 64 bytes: L = 1 needs min(5, 1) = 1 -> 1 + 1 = 2 pages = 64 bytes,
    # and L = 4 needs min(5, 4) = 4 -> 2 pages, L = 5 needs 3 pages: the largest is 4.
    with pytest.raises(KVCacheConfigError, match=r"0\.00 GiB \(96 bytes\).*fits is 4\."):
        check_enough_kv_cache_memory(layers(WINDOW), 64, max_model_len=64, max_num_batched_tokens=2)


# -- get_kv_cache_config ----------------------------------------------------------------------


def test_config_of_the_chapter_example() -> None:
    config = get_kv_cache_config(LLAMA2_13B_LAYERS, 40 * GiB, max_model_len=4096)
    # 42,949,672,960 // 327,680 = 131,072 pages; // 40 layers = 3276 blocks (3276.8)
    assert config.num_blocks == 3276
    assert config.num_blocks * 16 == 52_416  # tokens
    assert list(config.tensors) == list(LLAMA2_13B_LAYERS)
    assert set(config.tensors.values()) == {KVCacheTensor(size=327_680 * 3276)}
    assert config.tensors["layers.0"].size == 1_073_479_680
    assert len(config.kv_cache_groups) == 1
    group = config.kv_cache_groups[0]
    assert group.layer_names == tuple(LLAMA2_13B_LAYERS)
    assert group.kv_cache_spec == LLAMA2_13B


def test_config_checks_memory_before_anything_else() -> None:
    with pytest.raises(KVCacheConfigError, match="largest max_model_len that fits is 2,608"):
        get_kv_cache_config(LLAMA2_13B_LAYERS, 2 * GiB, max_model_len=4096)
    # the override does not skip the check
    with pytest.raises(KVCacheConfigError, match="largest max_model_len that fits is 2,608"):
        get_kv_cache_config(LLAMA2_13B_LAYERS, 2 * GiB, max_model_len=4096, num_blocks_override=10)


def test_override_replaces_the_budgets_block_count() -> None:
    # budget: 1000 // 32 // 2 = 15 blocks; override 5 (smaller) and 1000 (larger than the budget)
    specs = layers(FULL, FULL)
    assert get_kv_cache_config(specs, 1000, max_model_len=8).num_blocks == 15
    for override in (5, 1000):
        config = get_kv_cache_config(specs, 1000, max_model_len=8, num_blocks_override=override)
        assert config.num_blocks == override
        assert config.tensors == {
            "layer.0": KVCacheTensor(32 * override),
            "layer.1": KVCacheTensor(32 * override),
        }


@pytest.mark.parametrize("override", [0, -3, True])
def test_override_must_be_a_positive_int(override: int) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks_override must be an int >= 1"):
        get_kv_cache_config(layers(FULL), 1000, max_model_len=8, num_blocks_override=override)


def test_override_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedkv.planning.kv_cache_config"):
        get_kv_cache_config(layers(FULL), 1000, max_model_len=8, num_blocks_override=5)
    assert "num_blocks 31 overridden by num_blocks_override=5" in caplog.text


def test_mla_config() -> None:
    # 2 MLA layers, 1 x 576 bf16, block 16: 18,432-byte pages; max_model_len 1024 needs
    # 64 pages per layer = 2,359,296 bytes for both. 10 MiB // 18,432 // 2 = 284 blocks.
    mla = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", use_mla=True
    )
    specs = layers(mla, mla)
    assert memory_needed_bytes(specs, max_model_len=1024) == 2_359_296
    config = get_kv_cache_config(specs, 10 * (1 << 20), max_model_len=1024)
    assert config.num_blocks == 284
    assert config.tensors["layer.1"].size == 284 * 18_432


def test_sliding_window_only_model_keeps_its_window() -> None:
    # 2 window layers; need min(3 + 4, 64) = 7 -> 3 pages each = 192 bytes; 200 // 32 // 2 = 3
    config = get_kv_cache_config(
        layers(WINDOW, WINDOW), 200, max_model_len=64, max_num_batched_tokens=4
    )
    assert config.num_blocks == 3
    assert config.kv_cache_groups[0].kv_cache_spec == WINDOW


def test_hybrid_model_is_unified_to_full_attention() -> None:
    specs = layers(FULL, WINDOW, FULL, WINDOW)
    given = dict(specs)
    # The check runs on the specs as given (1216 bytes, see test_memory_needed_sums_layers) and
    # passes; then the window layers become full attention: 1216 // 32 // 4 = 9 blocks.
    config = get_kv_cache_config(specs, 1216, max_model_len=64, max_num_batched_tokens=4)
    assert config.num_blocks == 9
    (group,) = config.kv_cache_groups
    assert group.layer_names == ("layer.0", "layer.1", "layer.2", "layer.3")
    assert group.kv_cache_spec == FULL
    assert set(config.tensors.values()) == {KVCacheTensor(9 * 32)}
    # nothing it was given changed
    assert specs == given
    assert isinstance(specs["layer.1"], SlidingWindowSpec)


def test_unify_hybrid_specs_returns_a_copy() -> None:
    specs = layers(WINDOW, FULL)
    unified = unify_hybrid_kv_cache_specs(specs)
    assert unified == layers(FULL, FULL)
    assert specs == layers(WINDOW, FULL)
    # only window layers, or only full layers: unchanged
    assert unify_hybrid_kv_cache_specs(layers(WINDOW, WINDOW)) == layers(WINDOW, WINDOW)
    assert unify_hybrid_kv_cache_specs(layers(FULL)) == layers(FULL)


def test_layers_with_different_page_layouts_are_refused_by_name() -> None:
    other = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=2, dtype="float16")
    with pytest.raises(KVCacheConfigError) as raised:
        get_kv_cache_config(layers(FULL, FULL, other), 10_000, max_model_len=8)
    message = str(raised.value)
    assert "layer 'layer.0' has FullAttentionSpec(block_size=4, num_kv_heads=1" in message
    assert "layer 'layer.2' has FullAttentionSpec(block_size=4, num_kv_heads=2" in message
    # two windows of different sizes are different specs too
    wider = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=8
    )
    with pytest.raises(KVCacheConfigError, match="sliding_window=8"):
        get_kv_cache_config(layers(WINDOW, wider), 10_000, max_model_len=8)


# -- several workers ------------------------------------------------------------------------


def worker_config(num_blocks: int, *groups: tuple[str, KVCacheSpec]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        {name: KVCacheTensor(spec.page_size_bytes * num_blocks) for name, spec in groups},
        [KVCacheGroupSpec([name], spec) for name, spec in groups],
    )


def test_unify_takes_the_minimum_and_sorts_groups_by_type_id() -> None:
    a = worker_config(7, ("w", WINDOW), ("f", FULL))
    b = worker_config(5, ("f", FULL), ("w", WINDOW))
    c = worker_config(9, ("w", WINDOW), ("f", FULL))
    unified = unify_kv_cache_configs([a, b, c])
    assert [config.num_blocks for config in unified] == [5, 5, 5]
    for config, original in zip(unified, [a, b, c], strict=True):
        # "full_attention_4_32" < "sliding_window_4_4_32"
        assert [g.layer_names for g in config.kv_cache_groups] == [("f",), ("w",)]
        # tensors are kept, not shrunk
        assert config.tensors == original.tensors
    # the configs given are not changed
    assert (a.num_blocks, b.num_blocks, c.num_blocks) == (7, 5, 9)
    assert [g.layer_names for g in a.kv_cache_groups] == [("w",), ("f",)]


def test_unify_of_one_worker_changes_only_the_group_order() -> None:
    a = worker_config(7, ("w", WINDOW), ("f", FULL))
    (unified,) = unify_kv_cache_configs([a])
    assert unified.num_blocks == 7
    assert unified.kv_cache_groups == sorted_kv_cache_groups(a)


def test_unify_compares_specs_not_layer_names() -> None:
    # pipeline-parallel workers hold different layers with the same spec
    a = worker_config(4, ("layers.0", FULL))
    b = worker_config(6, ("layers.20", FULL))
    assert [c.num_blocks for c in unify_kv_cache_configs([a, b])] == [4, 4]


def test_unify_refuses_a_mismatched_spec_naming_the_layer_and_both_specs() -> None:
    fp32 = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float32")
    a = worker_config(4, ("attn.0", FULL))
    b = worker_config(4, ("attn.0", FULL))
    c = worker_config(4, ("attn.0", fp32))
    with pytest.raises(KVCacheConfigError) as raised:
        unify_kv_cache_configs([a, b, c])
    assert str(raised.value) == (
        "KV cache specs differ between workers in group 0: worker 0 layer 'attn.0' has "
        f"{FULL}, worker 2 layer 'attn.0' has {fp32}"
    )
    assert "dtype='float32'" in str(raised.value)
    assert "dtype='float16'" in str(raised.value)


def test_unify_refuses_a_different_number_of_groups() -> None:
    a = worker_config(4, ("f", FULL))
    b = worker_config(4, ("f", FULL), ("w", WINDOW))
    with pytest.raises(
        KVCacheConfigError,
        match=re.escape(
            "worker 1 has 2 KV cache groups, worker 0 has 1: "
            "['full_attention_4_32', 'sliding_window_4_4_32'] vs ['full_attention_4_32']"
        ),
    ):
        unify_kv_cache_configs([a, b])


def test_unify_needs_a_config() -> None:
    with pytest.raises(InvalidArgumentError):
        unify_kv_cache_configs([])
    with pytest.raises(InvalidArgumentError):
        check_kv_cache_groups_match([])
