"""The Prometheus exporter: usage, prefix-cache counts and hit rates in blocks and tokens,
evictions from the event stream, preemptions as the scheduler reports them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from manager_fixtures import manager_config

from pagedkv import InvalidArgumentError, PrefixCacheStats, Request
from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.vocab.kv_events import BlockRemoved

prometheus_client = pytest.importorskip("prometheus_client")

from pagedkv.events.metrics import KVCacheMetrics  # noqa: E402


def value(metrics: KVCacheMetrics, name: str, **labels: str) -> float | None:
    sample: float | None = metrics.registry.get_sample_value(f"pagedkv_{name}", labels)
    return sample


def test_a_step_updates_every_metric() -> None:
    metrics = KVCacheMetrics()
    stats = PrefixCacheStats(requests=2, queries=6, hits=3, queried_tokens=30, hit_tokens=12)
    metrics.observe(
        usage=0.25,
        stats=stats,
        events=[BlockRemoved((1,)), BlockRemoved((2,))],
        num_preempted=1,
    )
    assert value(metrics, "kv_cache_usage") == 0.25
    assert value(metrics, "prefix_cache_requests_total") == 2
    assert value(metrics, "prefix_cache_queries_total", unit="blocks") == 6
    assert value(metrics, "prefix_cache_hits_total", unit="blocks") == 3
    assert value(metrics, "prefix_cache_queries_total", unit="tokens") == 30
    assert value(metrics, "prefix_cache_hits_total", unit="tokens") == 12
    assert value(metrics, "prefix_cache_hit_rate", unit="blocks") == 0.5
    assert value(metrics, "prefix_cache_hit_rate", unit="tokens") == 0.4
    assert value(metrics, "kv_cache_evictions_total") == 2
    assert value(metrics, "preemptions_total") == 1
    assert value(metrics, "prefix_cache_resets_total") == 0


def test_counters_accumulate_and_a_reset_restarts_the_hit_rate_window() -> None:
    metrics = KVCacheMetrics(max_recent_requests=10)
    metrics.observe(usage=0.5, stats=PrefixCacheStats(requests=1, queries=4, hits=4))
    metrics.observe(usage=0.5, stats=None, num_preempted=2)  # stats not collected this step
    metrics.observe(usage=0.0, stats=PrefixCacheStats(reset=True, requests=1, queries=4, hits=1))
    assert value(metrics, "prefix_cache_queries_total", unit="blocks") == 8
    assert value(metrics, "prefix_cache_hit_rate", unit="blocks") == 0.25
    assert value(metrics, "prefix_cache_resets_total") == 1
    assert value(metrics, "preemptions_total") == 2
    assert value(metrics, "kv_cache_usage") == 0.0


def test_every_series_is_exported_before_the_first_lookup() -> None:
    text = prometheus_client.generate_latest(KVCacheMetrics().registry).decode()
    assert 'pagedkv_prefix_cache_hit_rate{unit="tokens"} 0.0' in text
    assert 'pagedkv_prefix_cache_queries_total{unit="blocks"} 0.0' in text


def test_two_exporters_do_not_clash_and_a_namespace_renames_them() -> None:
    first, second = KVCacheMetrics(), KVCacheMetrics(namespace="engine1")
    first.observe(usage=0.5)
    assert second.registry.get_sample_value("engine1_kv_cache_usage") == 0.0
    registry = prometheus_client.CollectorRegistry()
    KVCacheMetrics(registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        KVCacheMetrics(registry=registry)  # one registry, one exporter per namespace


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"usage": 1.5}, "usage must be in"), ({"usage": 0.5, "num_preempted": -1}, "num_preempted")],
)
def test_impossible_observations_are_refused(kwargs: dict[str, float], message: str) -> None:
    metrics = KVCacheMetrics()
    with pytest.raises(InvalidArgumentError, match=message):
        metrics.observe(**kwargs)  # type: ignore[arg-type]
    assert value(metrics, "kv_cache_usage") == 0.0


def test_fed_from_a_manager_the_exporter_counts_what_the_manager_did() -> None:
    config = replace(
        manager_config(block_size=2, num_blocks=4, log_stats=True), enable_kv_cache_events=True
    )
    manager = pagedkv_manager(config).manager  # type: ignore[attr-defined]
    metrics = KVCacheMetrics()
    for index, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 7, 7, 7, 7])):
        request = Request(f"r{index}", prompt)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
        manager.free(request)
        metrics.observe(
            usage=manager.usage,
            stats=manager.make_prefix_cache_stats(),
            events=manager.take_events(),
        )
    # r1 hits both of r0's full blocks (4 of its 5 tokens); r2 evicts them.
    assert value(metrics, "prefix_cache_hits_total", unit="tokens") == 4
    assert value(metrics, "prefix_cache_queries_total", unit="tokens") == 15
    assert value(metrics, "prefix_cache_hits_total", unit="blocks") == 2
    assert value(metrics, "kv_cache_evictions_total") == 2
