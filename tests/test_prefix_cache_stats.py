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
