"""Small contracts the mutation run (`python -m proofs.mutation`) found stated by no test.

Each test states one behaviour of a public class or function: the defaults and attributes of
`KVCacheManager`, the reprs that logs and failure reports print, `TokenView` equality, the chain
seed `NONE_HASH`, `PrefixCachingMetrics`' window, and the helpers on `KVCacheBlock`.
"""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv import (
    VLLM_0_8_5,
    AttentionSpec,
    BlockPool,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfigError,
    KVCacheManager,
    PlaceholderRange,
    PrefixCacheStats,
    PrefixCachingMetrics,
    Request,
    SlidingWindowSpec,
    generate_block_hash_extra_keys,
    hash_request_tokens,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.manager import CHECK_INVARIANTS_ENV
from pagedkv.vocab import hashes as block_hash_module
from pagedkv.vocab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from pagedkv.vocab.request import TokenView
from pagedkv.vocab.semantics import VLLM_0_32

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")


# -- KVCacheManager: construction ------------------------------------------------------------


def test_manager_defaults_gather_no_stats_and_keep_their_arguments() -> None:
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), max_model_len=64)
    assert (manager.max_model_len, manager.log_stats, manager.enable_caching) == (64, False, True)
    assert manager.prefix_cache_stats is None
    assert manager.make_prefix_cache_stats() is None
    (group,) = manager.coordinator.single_type_managers
    assert (group.kv_cache_spec, group.group_id) == (FULL, 0)


def test_the_pool_gets_the_managers_caching_switch_and_semantics() -> None:
    manager = KVCacheManager(
        uniform_kv_cache_config(FULL, 10), 64, enable_caching=False, semantics=VLLM_0_8_5
    )
    assert manager.block_pool.enable_caching is False
    assert manager.block_pool.semantics is VLLM_0_8_5


def test_vllm_0_8_5s_switches_need_exactly_one_kv_cache_group() -> None:
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=8
    )
    tensor = KVCacheTensor(size=FULL.page_size_bytes * 10)
    config = KVCacheConfig(
        10,
        {"full": tensor, "window": tensor},
        [KVCacheGroupSpec(("full",), FULL), KVCacheGroupSpec(("window",), window)],
    )
    assert KVCacheManager(config, 64).num_groups == 2
    with pytest.raises(KVCacheConfigError) as info:
        KVCacheManager(config, 64, semantics=VLLM_0_8_5)
    assert str(info.value) == (
        "vLLM 0.8.5's switches need one KV cache group (0.8.5 had no hybrid manager), got 2 "
        "groups and capacity_counts_null_blocks, vllm_new_block_mm_keys, "
        "cap_at_max_model_len, eagle_window_hit_one_short, mm_keys_without_position"
    )
    # vLLM 0.32.0's hybrid coordinator counts the null block too: that switch takes groups.
    assert KVCacheManager(config, 64, semantics=VLLM_0_32).num_groups == 2


@dataclasses.dataclass(frozen=True, init=False)
class OtherAttentionSpec(AttentionSpec):
    """An attention type the manager has no policy for."""

    @property
    def type_id(self) -> str:
        return "other"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 0


def test_an_attention_type_without_a_policy_is_refused_by_name() -> None:
    other = OtherAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    with pytest.raises(KVCacheConfigError) as info:
        KVCacheManager(uniform_kv_cache_config(other, 10), 64)
    assert str(info.value) == "no attention manager for OtherAttentionSpec"


def test_max_model_len_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        KVCacheManager(uniform_kv_cache_config(FULL, 10), max_model_len=0)
    assert str(info.value) == "KVCacheManager: max_model_len must be an int >= 1, got 0"


def test_negative_checking_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        KVCacheManager(uniform_kv_cache_config(FULL, 10), 64, debug_invariants=-1)
    assert str(info.value) == "KVCacheManager: debug_invariants must be an int >= 0, got -1"


def test_a_blank_checking_variable_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_INVARIANTS_ENV, "  ")
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    assert manager.debug_invariants == 0


def test_allocate_slots_reserves_no_lookahead_unless_asked() -> None:
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    request = Request("a", range(4))
    new = manager.allocate_slots(request, 4)
    assert new is not None
    assert [block.block_id for block in new[0]] == [1]


# -- blocks and the free queue ----------------------------------------------------------------


def test_a_block_repr_shows_its_neighbours_in_the_free_queue() -> None:
    pool = BlockPool(4, True)  # free queue: 1, 2, 3
    assert repr(pool.blocks[2]) == (
        "KVCacheBlock(block_id=2, ref_cnt=0, block_hash=None, prev_free_block=1, next_free_block=3)"
    )


# -- hashes ------------------------------------------------------------------------------------


def test_the_chain_seed_comes_from_pythonhashseed_or_is_random(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert block_hash_module._none_hash() == sha256("7")
    monkeypatch.delenv("PYTHONHASHSEED")
    seeds = {block_hash_module._none_hash() for _ in range(3)}
    assert len(seeds) == 3  # 256 random bits each: a repeat would be a broken generator
    assert all(0 <= seed < 2**256 for seed in seeds)
    assert sha256("7") not in seeds


def test_extra_keys_without_multimodal_inputs_keep_the_scan_position() -> None:
    request = Request("a", [1, 2], lora_id=3)
    assert generate_block_hash_extra_keys(request, 0, 2, 5) == ((3,), 5)


def test_hashing_with_an_empty_block_size_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        hash_request_tokens(sha256, 0, Request("a", [1]))
    assert str(info.value) == "hash_request_tokens: block_size must be an int >= 1, got 0"


# -- requests ----------------------------------------------------------------------------------


def test_a_bad_placeholder_range_is_refused_with_its_numbers() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        PlaceholderRange(-1, 2)
    assert str(info.value) == "PlaceholderRange: offset must be an int >= 0, got -1"
    with pytest.raises(InvalidArgumentError) as info:
        PlaceholderRange(0, 0)
    assert str(info.value) == "PlaceholderRange: length must be an int >= 1, got 0"


def test_a_token_view_equals_the_same_tokens_in_any_sequence_type() -> None:
    view = TokenView([1, 2])
    assert view == [1, 2]
    assert view == (1, 2)
    assert view == TokenView([1, 2])
    assert view != [2, 1]
    assert view != TokenView([1])
    assert view != "12"
    assert repr(view) == "[1, 2]"


def test_a_request_repr_shows_its_extras_and_redacts_the_salt() -> None:
    plain = Request("a", [1, 2])
    assert repr(plain) == "Request('a', tokens=[1, 2], num_computed_tokens=0)"
    full = Request(
        "b",
        [1, 2],
        mm_positions=[PlaceholderRange(0, 1)],
        mm_hashes=["img"],
        lora_id=3,
        cache_salt="secret",
    )
    assert repr(full) == (
        "Request('b', tokens=[1, 2], num_computed_tokens=0, "
        "mm_positions=(PlaceholderRange(offset=0, length=1),), lora_id=3, "
        "cache_salt=<redacted>)"
    )


# -- prefix-cache metrics ----------------------------------------------------------------------


def test_the_window_is_a_thousand_requests_unless_given() -> None:
    assert PrefixCachingMetrics().max_recent_requests == 1000


def test_a_window_of_one_request_is_valid_and_zero_is_refused() -> None:
    assert PrefixCachingMetrics(1).max_recent_requests == 1
    with pytest.raises(InvalidArgumentError) as info:
        PrefixCachingMetrics(0)
    assert str(info.value) == (
        "PrefixCachingMetrics: max_recent_requests must be an int >= 1, got 0"
    )


def test_the_window_holds_exactly_max_recent_requests_then_drops_the_oldest_batches() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=3)
    metrics.observe(PrefixCacheStats(requests=1, queries=5, hits=1))
    metrics.observe(PrefixCacheStats(requests=2, queries=3, hits=3))  # 3 requests: all kept
    assert (
        metrics.aggregated_requests,
        metrics.aggregated_query_total,
        metrics.aggregated_query_hit,
    ) == (3, 8, 4)
    metrics.observe(PrefixCacheStats(requests=2, queries=7, hits=2))  # 5 > 3, then 4 > 3
    assert (
        metrics.aggregated_requests,
        metrics.aggregated_query_total,
        metrics.aggregated_query_hit,
    ) == (2, 7, 2)


def test_a_reset_zeroes_every_aggregate() -> None:
    metrics = PrefixCachingMetrics()
    metrics.observe(PrefixCacheStats(requests=2, queries=5, hits=1))
    metrics.reset()
    assert (
        metrics.aggregated_requests,
        metrics.aggregated_query_total,
        metrics.aggregated_query_hit,
        len(metrics.query_queue),
    ) == (0, 0, 0, 0)
