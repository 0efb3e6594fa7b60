"""A Prometheus exporter for the KV cache, under vLLM's metric names and labels.

Needs `prometheus_client` (`pip install 'pagedkv[metrics]'`; without it `KVCacheMetrics` raises
`MissingExtraError` naming that extra). The scheduler feeds it once a step:

    metrics = KVCacheMetrics(model_name="my-model", engine=0)   # prometheus_client's REGISTRY
    ...
    metrics.observe(
        usage=manager.usage,
        stats=manager.make_prefix_cache_stats(),        # None without log_stats
        events=manager.take_events(),                   # publish them too, if anyone listens
        num_preempted=len(preempted_this_step),
    )

Metrics, every one labelled `model_name` and `engine` as vLLM labels its own (so dashboards built
for vLLM show pagedkv's engines):

    names="vllm" (the default: vLLM 0.33's names)
    vllm:kv_cache_usage_perc               gauge    fraction of KV cache blocks in use (`usage`)
    vllm:prefix_cache_queries_total        counter  tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total           counter  of those, tokens found cached
    vllm:num_preemptions_total             counter  preemptions the scheduler reports

    names="vllm-0.8.5" (vLLM 0.8.5's names and units)
    vllm:gpu_cache_usage_perc              gauge    the same usage
    vllm:gpu_prefix_cache_queries_total    counter  full blocks looked up
    vllm:gpu_prefix_cache_hits_total       counter  of those, blocks found cached
    vllm:num_preemptions_total             counter  the same preemptions

    pagedkv's own, beside either
    pagedkv_prefix_cache_requests_total    counter  prefix-cache lookups (requests looked up)
    pagedkv_prefix_cache_resets_total      counter  successful prefix-cache resets
    pagedkv_prefix_cache_hit_rate          gauge    hit tokens / queried tokens, last
                                                    `max_recent_requests` requests
    pagedkv_kv_cache_evictions_total       counter  cached block hashes evicted (BlockRemoved
                                                    events: needs enable_kv_cache_events)

The token counts are `PrefixCacheStats.queried_tokens` and `hit_tokens`: every lookup counts,
a recompute's after a preemption included (vLLM 0.33 counts a preempted request's lookups apart,
outside these counters); the block counts are `queries` and `hits`, vLLM 0.8.5's.

Several exporters per process: each `KVCacheMetrics` owns the series of one (`model_name`,
`engine`) pair in its registry; exporters of one registry share the metric families, so two
engines of one process are two label sets of the same metrics, as vLLM's data-parallel engines
are. A second exporter with the *same* labels in the same registry is refused
(`InvalidArgumentError`): two sources would overwrite each other's gauge and add into each
other's counters. `close()` removes an exporter's series and frees its labels; an exporter that
is garbage-collected without `close()` frees its labels but leaves its last values exported, and a
new exporter with those labels continues the counters from there (a counter never goes down).
A metric name already registered by another collector of the registry (vLLM's own exporter, in a
process running vLLM) is refused too: pass a registry of your own.

Preemptions come from the scheduler: the manager cannot tell them apart, since a preempted
request and a finished one are both released with `free()`. Evictions come from the event stream,
so they count index keys that left the cache (a block evicted while another block still caches
its content is no loss). `serve_metrics` starts prometheus_client's HTTP endpoint.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedkv.events.prefix_caching_metrics import PrefixCachingMetrics
from pagedkv.extras import import_extra
from pagedkv.vocab.arguments import is_int, require_int, require_iterable, require_str
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.vocab.kv_events import BlockRemoved
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats

MetricNames = Literal["vllm", "vllm-0.8.5"]
LABEL_NAMES = ("model_name", "engine")


@dataclass(frozen=True)
class Spelling:
    """One release's names for the four metrics vLLM and pagedkv share, and its count unit."""

    usage: str
    queries: str
    hits: str
    preemptions: str
    unit: Literal["tokens", "blocks"]


SPELLINGS: dict[str, Spelling] = {
    "vllm": Spelling(
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "tokens",
    ),
    "vllm-0.8.5": Spelling(
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
        "vllm:num_preemptions",
        "blocks",
    ),
}
"""`names=` -> the metric names (counters without prometheus_client's `_total` suffix)."""

_HELP = {
    "vllm:kv_cache_usage_perc": "KV cache usage (1 is every block in use).",
    "vllm:gpu_cache_usage_perc": "KV cache usage (1 is every block in use).",
    "vllm:prefix_cache_queries": "Prefix-cache lookups, in tokens looked up.",
    "vllm:prefix_cache_hits": "Prefix-cache hits, in tokens found cached.",
    "vllm:gpu_prefix_cache_queries": "Prefix-cache lookups, in full blocks looked up.",
    "vllm:gpu_prefix_cache_hits": "Prefix-cache hits, in blocks found cached.",
    "vllm:num_preemptions": "Preemptions, as the scheduler reports them.",
    "pagedkv_prefix_cache_requests": "Prefix-cache lookups made (requests looked up).",
    "pagedkv_prefix_cache_resets": "Successful prefix-cache resets.",
    "pagedkv_prefix_cache_hit_rate": "Prefix-cache hit tokens / queried tokens, recent requests.",
    "pagedkv_kv_cache_evictions": "Cached block hashes evicted (BlockRemoved events).",
}


@dataclass
class _RegistryState:
    """What the exporters of one registry share: the metric families, and the labels in use."""

    families: dict[str, Any] = field(default_factory=dict)
    labels_in_use: set[tuple[str, str]] = field(default_factory=set)


_STATES: weakref.WeakKeyDictionary[Any, _RegistryState] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _release(state: _RegistryState, labels: tuple[str, str]) -> None:
    with _LOCK:
        state.labels_in_use.discard(labels)


class KVCacheMetrics:
    """The KV cache's Prometheus metrics for one engine, updated by `observe` (module docstring).

    Args:
        registry: where the metrics are registered (default: prometheus_client's `REGISTRY`,
            which `start_http_server` and `generate_latest()` serve).
        model_name: the `model_name` label (vLLM's served model name).
        engine: the `engine` label (vLLM's engine index), an int >= 0 or a str.
        names: "vllm" (vLLM 0.33's names, prefix-cache counts in tokens) or "vllm-0.8.5" (its
            `gpu_` names, counts in blocks).
        max_recent_requests: the window of the hit-rate gauge, in requests.

    Raises:
        MissingExtraError: prometheus_client is not installed.
        InvalidArgumentError: a bad argument; `model_name` and `engine` already exported by
            another live exporter of this registry; or a metric name registered there by
            another collector.
    """

    def __init__(
        self,
        registry: Any = None,
        *,
        model_name: str = "pagedkv",
        engine: int | str = 0,
        names: MetricNames = "vllm",
        max_recent_requests: int = 1000,
    ) -> None:
        call = "KVCacheMetrics"
        require_str(call, "model_name", model_name)
        if not model_name:
            raise InvalidArgumentError(f"{call}: model_name must not be empty")
        if is_int(engine):
            require_int(call, "engine", engine, 0)
        elif not isinstance(engine, str) or not engine:
            raise ArgumentTypeError(
                f"{call}: engine must be an int >= 0 or a non-empty str, got {engine!r}"
            )
        if names not in SPELLINGS:
            raise InvalidArgumentError(
                f"{call}: names must be one of {', '.join(map(repr, SPELLINGS))}, got {names!r}"
            )
        self.window = PrefixCachingMetrics(max_recent_requests)
        prom = import_extra("prometheus_client", extra="metrics", purpose=call)
        self.registry = prom.REGISTRY if registry is None else registry
        self.names = names
        self.spelling = SPELLINGS[names]
        self.labels: tuple[str, str] = (model_name, str(engine))
        spelling = self.spelling
        with _LOCK:
            state = _STATES.get(self.registry)
            if state is None:
                state = _STATES[self.registry] = _RegistryState()
            if self.labels in state.labels_in_use:
                raise InvalidArgumentError(
                    f"{call}: model_name={model_name!r}, engine={str(engine)!r} are already "
                    f"exported to this registry by another KVCacheMetrics; give each engine "
                    f"its own engine label, or close() the other one first"
                )
            family = _Families(prom, self.registry, state)
            self.usage = family.child(prom.Gauge, spelling.usage, self.labels)
            self.queries = family.child(prom.Counter, spelling.queries, self.labels)
            self.hits = family.child(prom.Counter, spelling.hits, self.labels)
            self.preemptions = family.child(prom.Counter, spelling.preemptions, self.labels)
            self.requests = family.child(prom.Counter, "pagedkv_prefix_cache_requests", self.labels)
            self.resets = family.child(prom.Counter, "pagedkv_prefix_cache_resets", self.labels)
            self.hit_rate = family.child(prom.Gauge, "pagedkv_prefix_cache_hit_rate", self.labels)
            self.evictions = family.child(prom.Counter, "pagedkv_kv_cache_evictions", self.labels)
            state.labels_in_use.add(self.labels)
        self._families = family.used
        self._release = weakref.finalize(self, _release, state, self.labels)

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def observe(
        self,
        *,
        usage: float,
        stats: PrefixCacheStats | None = None,
        events: Iterable[object] = (),
        num_preempted: int = 0,
    ) -> None:
        """Record one scheduler step.

        Args:
            usage: the manager's `usage` now.
            stats: what `make_prefix_cache_stats()` returned this step (None: not collected).
            events: the KV cache events taken this step.
            num_preempted: requests the scheduler preempted this step.

        Raises:
            InvalidArgumentError: usage outside [0, 1], a negative `num_preempted`, stats that
                are not `PrefixCacheStats`, or the exporter is closed (nothing is recorded).
        """
        call = "KVCacheMetrics.observe"
        if self.closed:
            raise InvalidArgumentError(f"{call}: this exporter is closed")
        if (
            isinstance(usage, bool)
            or not isinstance(usage, (int, float))
            or not 0.0 <= usage <= 1.0
        ):
            raise InvalidArgumentError(f"{call}: usage must be in [0, 1], got {usage!r}")
        require_int(call, "num_preempted", num_preempted, 0)
        if stats is not None and not isinstance(stats, PrefixCacheStats):
            raise ArgumentTypeError(
                f"{call}: stats must be a PrefixCacheStats or None, got {type(stats).__name__}"
            )
        taken: list[object] = require_iterable(call, "events", events)
        removed = sum(len(e.block_hashes) for e in taken if isinstance(e, BlockRemoved))
        self.usage.set(usage)
        if stats is not None:
            self._observe_stats(stats)
        self.evictions.inc(removed)
        self.preemptions.inc(num_preempted)

    def close(self) -> None:
        """Remove this exporter's series from its registry and free its labels (idempotent)."""
        if self._release.detach() is None:
            return
        for family in self._families:
            family.remove(*self.labels)
        _release(_STATES[self.registry], self.labels)

    def _observe_stats(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.resets.inc()
        self.requests.inc(stats.requests)
        if self.spelling.unit == "tokens":
            self.queries.inc(stats.queried_tokens)
            self.hits.inc(stats.hit_tokens)
        else:
            self.queries.inc(stats.queries)
            self.hits.inc(stats.hits)
        self.window.observe(stats)
        self.hit_rate.set(self.window.token_hit_rate)


class _Families:
    """Gets (or registers once) a registry's metric families and a labelled child of each."""

    def __init__(self, prom: Any, registry: Any, state: _RegistryState) -> None:
        self.prom = prom
        self.registry = registry
        self.state = state
        self.used: list[Any] = []

    def child(self, kind: Any, name: str, labels: tuple[str, str]) -> Any:
        family = self.state.families.get(name)
        if family is None:
            try:
                family = kind(name, _HELP[name], LABEL_NAMES, registry=self.registry)
            except ValueError as error:  # prometheus_client: "Duplicated timeseries ..."
                raise InvalidArgumentError(
                    f"KVCacheMetrics: {name} is already registered in this registry by another "
                    f"collector ({error}); pass KVCacheMetrics(registry=...) a registry of its "
                    f"own"
                ) from None
            self.state.families[name] = family
        if family not in self.used:
            self.used.append(family)
        return family.labels(*labels)  # exported (as 0) from now on


class MetricsServer:
    """prometheus_client's HTTP endpoint on a daemon thread (`serve_metrics`)."""

    def __init__(self, server: Any, thread: Any, host: str) -> None:
        self.server = server
        self.thread = thread
        self.host = host
        self.port: int = server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(port: int, host: str = "127.0.0.1", registry: Any = None) -> MetricsServer:
    """Serve `registry` (default: prometheus_client's REGISTRY) at http://HOST:PORT/metrics.

    Args:
        port: the TCP port (0: any free one; `MetricsServer.port` says which).
        host: the address to listen on (127.0.0.1 by default: this machine only; 0.0.0.0 lets
            a Prometheus server elsewhere scrape it).

    Raises:
        MissingExtraError: prometheus_client is not installed.
        InvalidArgumentError: a port outside [0, 65535], or the address cannot be bound.
    """
    require_int("serve_metrics", "port", port, 0, 65535)
    prom = import_extra("prometheus_client", extra="metrics", purpose="serve_metrics")
    try:
        server, thread = prom.start_http_server(
            port, addr=host, registry=prom.REGISTRY if registry is None else registry
        )
    except OSError as error:
        raise InvalidArgumentError(f"cannot serve metrics on {host}:{port}: {error}") from None
    return MetricsServer(server, thread, host)
