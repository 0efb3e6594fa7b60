"""A Prometheus exporter for the KV cache: usage, prefix-cache hit rates, evictions, preemptions.

Needs `prometheus_client` (the `metrics` extra). The scheduler feeds it once a step:

    metrics = KVCacheMetrics(registry=prometheus_client.REGISTRY)
    ...
    events = manager.take_events()                      # publish them too, if anyone listens
    metrics.observe(
        usage=manager.usage,
        stats=manager.make_prefix_cache_stats(),        # None without log_stats
        events=events,
        num_preempted=len(preempted_this_step),
    )

Metrics (`namespace` prefix, "pagedkv" by default):

    pagedkv_kv_cache_usage                   gauge    fraction of blocks in use (`usage`)
    pagedkv_prefix_cache_requests_total      counter  prefix lookups
    pagedkv_prefix_cache_queries_total{unit} counter  blocks or tokens looked up
    pagedkv_prefix_cache_hits_total{unit}    counter  blocks or tokens found
    pagedkv_prefix_cache_hit_rate{unit}      gauge    hits / queries, last max_recent_requests
    pagedkv_prefix_cache_resets_total        counter  successful prefix-cache resets
    pagedkv_kv_cache_evictions_total         counter  BlockRemoved events (needs events on)
    pagedkv_preemptions_total                counter  preemptions the scheduler reports

`unit` is "blocks" (vLLM 0.8.5's counts) or "tokens" (the newest vLLM's).

Preemptions come from the scheduler: the manager cannot tell them apart, since a preempted
request and a finished one are both released with `free()` (and both still have their last
sampled token to compute). Evictions come from the event stream, so they count index keys that
left the cache (a block evicted while another block still caches its content is no loss), and
only with `enable_kv_cache_events=True`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedkv.events.prefix_caching_metrics import PrefixCachingMetrics
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_events import BlockRemoved, KVCacheEvent
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats

UNITS = ("blocks", "tokens")


class KVCacheMetrics:
    """The KV cache's Prometheus metrics, updated by `observe` (see the module docstring).

    Args:
        registry: where the metrics are registered (default: a registry of their own, so two
            exporters never clash; pass `prometheus_client.REGISTRY` to expose them with the
            process's default metrics).
        namespace: the prefix of every metric name.
        max_recent_requests: the window of the hit-rate gauges, in requests.
    """

    def __init__(
        self, registry: Any = None, namespace: str = "pagedkv", max_recent_requests: int = 1000
    ) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry() if registry is None else registry
        self.window = PrefixCachingMetrics(max_recent_requests)
        common: dict[str, Any] = {"namespace": namespace, "registry": self.registry}
        self.usage = prom.Gauge("kv_cache_usage", "Fraction of KV cache blocks in use.", **common)
        self.requests = prom.Counter(
            "prefix_cache_requests", "Prefix-cache lookups made.", **common
        )
        self.queries = prom.Counter(
            "prefix_cache_queries",
            "Blocks or tokens looked up in the prefix cache.",
            ["unit"],
            **common,
        )
        self.hits = prom.Counter(
            "prefix_cache_hits", "Blocks or tokens found in the prefix cache.", ["unit"], **common
        )
        self.hit_rate = prom.Gauge(
            "prefix_cache_hit_rate",
            f"Prefix-cache hits / queries over the last {max_recent_requests} requests.",
            ["unit"],
            **common,
        )
        self.resets = prom.Counter(
            "prefix_cache_resets", "Successful prefix-cache resets.", **common
        )
        self.evictions = prom.Counter(
            "kv_cache_evictions",
            "Cached block hashes evicted from the prefix cache (BlockRemoved events).",
            **common,
        )
        self.preemptions = prom.Counter(
            "preemptions", "Requests preempted, as the scheduler reports them.", **common
        )
        for unit in UNITS:  # export zeros before the first lookup
            self.queries.labels(unit)
            self.hits.labels(unit)
            self.hit_rate.labels(unit)

    def observe(
        self,
        *,
        usage: float,
        stats: PrefixCacheStats | None = None,
        events: Iterable[KVCacheEvent] = (),
        num_preempted: int = 0,
    ) -> None:
        """Record one scheduler step.

        Args:
            usage: the manager's `usage` now.
            stats: what `make_prefix_cache_stats()` returned this step (None: not collected).
            events: the KV cache events taken this step.
            num_preempted: requests the scheduler preempted this step.

        Raises:
            InvalidArgumentError: usage outside [0, 1], or a negative `num_preempted`.
        """
        if not 0.0 <= usage <= 1.0:
            raise InvalidArgumentError(f"usage must be in [0, 1], got {usage}")
        if num_preempted < 0:
            raise InvalidArgumentError(f"num_preempted must be >= 0, got {num_preempted}")
        self.usage.set(usage)
        if stats is not None:
            self._observe_stats(stats)
        self.evictions.inc(
            sum(len(event.block_hashes) for event in events if isinstance(event, BlockRemoved))
        )
        self.preemptions.inc(num_preempted)

    def _observe_stats(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.resets.inc()
        self.requests.inc(stats.requests)
        self.queries.labels("blocks").inc(stats.queries)
        self.hits.labels("blocks").inc(stats.hits)
        self.queries.labels("tokens").inc(stats.queried_tokens)
        self.hits.labels("tokens").inc(stats.hit_tokens)
        self.window.observe(stats)
        self.hit_rate.labels("blocks").set(self.window.hit_rate)
        self.hit_rate.labels("tokens").set(self.window.token_hit_rate)
