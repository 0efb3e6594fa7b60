"""PrefixCachingMetrics: a hit rate over recent requests, reset by a prefix-cache reset."""

from __future__ import annotations

import pytest

from pagedkv import InvalidArgumentError, PrefixCacheStats, PrefixCachingMetrics


def test_hit_rate_is_hits_over_queries_and_zero_without_queries() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=10)
    assert metrics.hit_rate == 0.0
    metrics.observe(PrefixCacheStats(requests=2, queries=8, hits=2))
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=2))
    assert metrics.hit_rate == pytest.approx(4 / 10)


def test_the_oldest_batch_drops_out_past_the_window() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=3)
    metrics.observe(PrefixCacheStats(requests=2, queries=4, hits=4))
    metrics.observe(PrefixCacheStats(requests=2, queries=4, hits=0))  # 4 requests > 3
    assert (metrics.aggregated_requests, metrics.hit_rate) == (2, 0.0)


def test_a_reset_clears_what_came_before() -> None:
    metrics = PrefixCachingMetrics()
    metrics.observe(PrefixCacheStats(requests=1, queries=4, hits=4))
    metrics.observe(PrefixCacheStats(reset=True, requests=1, queries=4, hits=1))
    assert metrics.hit_rate == pytest.approx(1 / 4)


def test_window_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError):
        PrefixCachingMetrics(0)


def test_the_token_hit_rate_counts_tokens_over_the_same_window() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=2)
    assert metrics.token_hit_rate == 0.0
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=2, queried_tokens=9, hit_tokens=8))
    metrics.observe(PrefixCacheStats(requests=1, queries=2, hits=0, queried_tokens=9))
    assert metrics.token_hit_rate == pytest.approx(8 / 18)
    metrics.observe(PrefixCacheStats(requests=1, queries=1, hits=1, queried_tokens=6, hit_tokens=4))
    assert metrics.token_hit_rate == pytest.approx(4 / 15)  # the first batch dropped out


def test_empty_batches_never_keep_old_ones_in_the_window() -> None:
    """A scheduler collects stats every step, mostly empty: they must not count as batches."""
    metrics = PrefixCachingMetrics(max_recent_requests=2)
    metrics.observe(PrefixCacheStats(requests=2, queries=2, hits=2))
    for _ in range(5):
        metrics.observe(PrefixCacheStats())
    metrics.observe(PrefixCacheStats(requests=1, queries=1, hits=0))
    metrics.observe(PrefixCacheStats(requests=1, queries=1, hits=0))
    assert (metrics.aggregated_requests, metrics.hit_rate) == (2, 0.0)
    metrics.observe(PrefixCacheStats(reset=True))  # an empty batch still carries a reset
    assert (metrics.aggregated_requests, len(metrics.query_queue)) == (0, 0)


def test_a_batch_larger_than_the_window_is_kept_whole() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=2)
    metrics.observe(PrefixCacheStats(requests=5, queries=5, hits=1))
    assert (metrics.aggregated_requests, metrics.hit_rate) == (5, 0.2)


@pytest.mark.parametrize("side", ["spec", "impl"])
def test_managers_count_queried_and_hit_tokens(side: str) -> None:
    from manager_fixtures import MANAGER_FACTORIES, manager_config

    from pagedkv import Request

    manager = MANAGER_FACTORIES[side](manager_config(block_size=2, log_stats=True))
    first = Request("first", [1, 2, 3, 4, 5])
    hits, num_hit_tokens = manager.get_computed_blocks(first)
    manager.allocate_slots(first, first.num_tokens - num_hit_tokens, hits)
    second = Request("second", [1, 2, 3, 4])  # all in full blocks: the last one is not looked up
    assert manager.get_computed_blocks(second) == ([1], 2)
    wants_logprobs = Request("third", [1, 2, 3], prompt_logprobs=True)  # skips the lookup
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(
        requests=3, queries=3, hits=1, queried_tokens=9, hit_tokens=2
    )
