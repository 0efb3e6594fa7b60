"""The Prometheus exporter: vLLM's metric names and labels, prometheus_client's default registry,
several engines per process, evictions from the event stream, preemptions as the scheduler
reports them, and a missing extra named."""

from __future__ import annotations

import gc
import sys
import urllib.request
from dataclasses import replace

import pytest
from manager_fixtures import manager_config

from pagedkv import InvalidArgumentError, PrefixCacheStats, Request
from pagedkv.extras import MissingExtraError
from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.vocab.kv_events import BlockRemoved

prometheus_client = pytest.importorskip("prometheus_client")

from pagedkv.events.metrics import KVCacheMetrics, serve_metrics  # noqa: E402

LABELS = {"model_name": "m", "engine": "0"}


def value(metrics: KVCacheMetrics, name: str, **labels: str) -> float | None:
    sample: float | None = metrics.registry.get_sample_value(name, labels or LABELS)
    return sample


def exporter(**kwargs: object) -> KVCacheMetrics:
    """An exporter with the labels `LABELS` in a registry of its own."""
    return KVCacheMetrics(prometheus_client.CollectorRegistry(), model_name="m", **kwargs)  # type: ignore[arg-type]


STATS = PrefixCacheStats(requests=2, queries=6, hits=3, queried_tokens=30, hit_tokens=12)


def test_a_step_updates_every_metric_under_vllms_names_in_tokens() -> None:
    metrics = exporter()
    events = [BlockRemoved((1,)), BlockRemoved((2,))]
    metrics.observe(usage=0.25, stats=STATS, events=events, num_preempted=1)
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert value(metrics, "vllm:prefix_cache_queries_total") == 30
    assert value(metrics, "vllm:prefix_cache_hits_total") == 12
    assert value(metrics, "vllm:num_preemptions_total") == 1
    assert value(metrics, "pagedkv_prefix_cache_requests_total") == 2
    assert value(metrics, "pagedkv_prefix_cache_hit_rate") == 0.4
    assert value(metrics, "pagedkv_kv_cache_evictions_total") == 2
    assert value(metrics, "pagedkv_prefix_cache_resets_total") == 0


def test_vllm_0_8_5_names_count_blocks() -> None:
    metrics = exporter(names="vllm-0.8.5")
    metrics.observe(usage=0.5, stats=STATS, num_preempted=2)
    assert value(metrics, "vllm:gpu_cache_usage_perc") == 0.5
    assert value(metrics, "vllm:gpu_prefix_cache_queries_total") == 6
    assert value(metrics, "vllm:gpu_prefix_cache_hits_total") == 3
    assert value(metrics, "vllm:num_preemptions_total") == 2
    assert value(metrics, "vllm:kv_cache_usage_perc") is None  # not the newer names


def test_counters_accumulate_and_a_reset_restarts_the_hit_rate_window() -> None:
    metrics = exporter(max_recent_requests=10)
    metrics.observe(usage=0.5, stats=PrefixCacheStats(requests=1, queried_tokens=8, hit_tokens=8))
    metrics.observe(usage=0.5, stats=None, num_preempted=2)  # stats not collected this step
    reset = PrefixCacheStats(reset=True, requests=1, queried_tokens=8, hit_tokens=2)
    metrics.observe(usage=0.0, stats=reset)
    assert value(metrics, "vllm:prefix_cache_queries_total") == 16
    assert value(metrics, "pagedkv_prefix_cache_hit_rate") == 0.25
    assert value(metrics, "pagedkv_prefix_cache_resets_total") == 1
    assert value(metrics, "vllm:num_preemptions_total") == 2
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0.0


def test_every_series_is_exported_before_the_first_step() -> None:
    text = prometheus_client.generate_latest(exporter().registry).decode()
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "pagedkv_kv_cache_evictions_total",
    ):
        assert f'{name}{{engine="0",model_name="m"}} 0.0' in text


def test_the_default_registry_is_what_a_users_http_server_serves() -> None:
    """A user's own `start_http_server` (here `serve_metrics`) serves pagedkv's lines."""
    metrics = KVCacheMetrics(model_name="default-registry-test", engine=3)
    assert metrics.registry is prometheus_client.REGISTRY
    metrics.observe(usage=0.75, num_preempted=1)
    server = serve_metrics(0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.close()
        metrics.close()
    labels = 'engine="3",model_name="default-registry-test"'
    assert f"vllm:kv_cache_usage_perc{{{labels}}} 0.75" in text
    assert f"vllm:num_preemptions_total{{{labels}}} 1.0" in text
    # close() removed the series.
    assert "default-registry-test" not in prometheus_client.generate_latest().decode()


def test_several_engines_share_a_registry_and_equal_labels_are_refused() -> None:
    registry = prometheus_client.CollectorRegistry()
    first = KVCacheMetrics(registry, model_name="m", engine=0)
    second = KVCacheMetrics(registry, model_name="m", engine=1)
    other_model = KVCacheMetrics(registry, model_name="other", engine=0, names="vllm-0.8.5")
    first.observe(usage=0.5, num_preempted=1)
    second.observe(usage=0.25, num_preempted=2)
    other_model.observe(usage=1.0, num_preempted=4)
    preemptions = "vllm:num_preemptions_total"
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "0"}) == 1
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "1"}) == 2
    assert registry.get_sample_value(preemptions, {"model_name": "other", "engine": "0"}) == 4
    with pytest.raises(InvalidArgumentError, match="already exported to this registry"):
        KVCacheMetrics(registry, model_name="m", engine="0")  # "0" is engine 0's label
    second.close()
    second.close()  # idempotent
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "1"}) is None
    with pytest.raises(InvalidArgumentError, match="closed"):
        second.observe(usage=0.0)
    again = KVCacheMetrics(registry, model_name="m", engine=1)  # labels free after close()
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "1"}) == 0
    del again, first
    gc.collect()
    # Collected without close(): its labels are free, its last values still exported, and a
    # new exporter with those labels continues its counters.
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "0"}) == 1
    successor = KVCacheMetrics(registry, model_name="m", engine=0)
    successor.observe(usage=0.5, num_preempted=1)
    assert registry.get_sample_value(preemptions, {"model_name": "m", "engine": "0"}) == 2


def test_a_name_another_collector_registered_is_refused_naming_it() -> None:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("vllm:kv_cache_usage_perc", "vLLM's own", registry=registry)
    with pytest.raises(InvalidArgumentError, match=r"vllm:kv_cache_usage_perc is already regis"):
        KVCacheMetrics(registry)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"usage": 1.5}, "usage must be in"),
        ({"usage": float("nan")}, "usage must be in"),
        ({"usage": 0.5, "num_preempted": -1}, "num_preempted must be an int >= 0"),
        ({"usage": 0.5, "stats": {"hits": 1}}, "stats must be a PrefixCacheStats"),
        ({"usage": 0.5, "events": None}, "events must be an iterable"),
    ],
)
def test_impossible_observations_are_refused_recording_nothing(
    kwargs: dict[str, object], message: str
) -> None:
    metrics = exporter()
    with pytest.raises(InvalidArgumentError, match=message):
        metrics.observe(**kwargs)  # type: ignore[arg-type]
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"names": "vllm-1.0"}, "names must be one of 'vllm', 'vllm-0.8.5'"),
        ({"engine": -1}, "engine must be an int >= 0"),
        ({"engine": 1.0}, "engine must be an int >= 0 or a non-empty str"),
        ({"model_name": ""}, "model_name must not be empty"),
        ({"max_recent_requests": 0}, "max_recent_requests must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        KVCacheMetrics(prometheus_client.CollectorRegistry(), **kwargs)  # type: ignore[arg-type]


def test_a_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingExtraError) as raised:
        KVCacheMetrics()
    assert str(raised.value) == (
        "KVCacheMetrics needs prometheus_client, which is not installed: "
        "pip install 'pagedkv[metrics]'"
    )
    with pytest.raises(MissingExtraError, match=r"pagedkv\[metrics\]"):
        serve_metrics(0)


def test_fed_from_a_manager_the_exporter_counts_what_the_manager_did() -> None:
    config = replace(
        manager_config(block_size=2, num_blocks=4, log_stats=True), enable_kv_cache_events=True
    )
    manager = pagedkv_manager(config).manager  # type: ignore[union-attr]
    tokens, blocks = exporter(), exporter(names="vllm-0.8.5")
    for index, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 7, 7, 7, 7])):
        request = Request(f"r{index}", prompt)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
        manager.free(request)
        stats, events = manager.make_prefix_cache_stats(), manager.take_events()
        for metrics in (tokens, blocks):
            metrics.observe(usage=manager.usage, stats=stats, events=events)
    # r1 hits both of r0's full blocks (4 of its 5 tokens); r2 evicts them.
    assert value(tokens, "vllm:prefix_cache_hits_total") == 4
    assert value(tokens, "vllm:prefix_cache_queries_total") == 15
    assert value(blocks, "vllm:gpu_prefix_cache_hits_total") == 2
    assert value(tokens, "pagedkv_kv_cache_evictions_total") == 2
