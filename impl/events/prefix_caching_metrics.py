"""Prefix-cache hit rates over the most recent requests: the aggregate a metrics exporter shows."""

from __future__ import annotations

from collections import deque

from pagedkv.vocab.arguments import require_instance, require_int
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats


class PrefixCachingMetrics:
    """Hit rates over the most recent `max_recent_requests` requests (whole batches).

    Each `observe` adds one batch of stats; then the oldest batches drop out while the aggregate
    holds more than `max_recent_requests` requests, the newest batch always kept. A batch without
    requests is left out (a scheduler collects stats every step, mostly empty ones; queued, they
    would keep old batches in past the window). A stats object with `reset` set clears
    everything first. vLLM 0.8.5 dropped one batch per observe and queued empty ones, so its
    window could grow past the limit; the newest vLLM does as here.

    Complexity: O(1) amortized per `observe`.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        require_int("PrefixCachingMetrics", "max_recent_requests", max_recent_requests, 1)
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.aggregated_queried_tokens = 0
        self.aggregated_hit_tokens = 0
        # (requests, queries, hits, queried tokens, hit tokens) per observed batch, oldest first
        self.query_queue: deque[tuple[int, int, int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one batch of stats (see the class docstring for what the window keeps)."""
        require_instance("PrefixCachingMetrics.observe", "stats", stats, PrefixCacheStats)
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        batch = (stats.requests, stats.queries, stats.hits, stats.queried_tokens, stats.hit_tokens)
        self.query_queue.append(batch)
        self._add(batch, 1)
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            self._add(self.query_queue.popleft(), -1)

    def _add(self, batch: tuple[int, int, int, int, int], sign: int) -> None:
        requests, queries, hits, queried_tokens, hit_tokens = batch
        self.aggregated_requests += sign * requests
        self.aggregated_query_total += sign * queries
        self.aggregated_query_hit += sign * hits
        self.aggregated_queried_tokens += sign * queried_tokens
        self.aggregated_hit_tokens += sign * hit_tokens

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.aggregated_queried_tokens = 0
        self.aggregated_hit_tokens = 0
        self.query_queue.clear()

    @property
    def hit_rate(self) -> float:
        """Blocks hit / blocks looked up over the window; 0.0 when nothing was looked up."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total

    @property
    def token_hit_rate(self) -> float:
        """Tokens hit / tokens of the requests looked up over the window; 0.0 without any."""
        if self.aggregated_queried_tokens == 0:
            return 0.0
        return self.aggregated_hit_tokens / self.aggregated_queried_tokens
