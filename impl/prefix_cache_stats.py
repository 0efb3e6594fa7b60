"""Prefix-cache hit statistics: one step's counts, and a sliding aggregate over recent requests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.arguments import require_instance, require_int


@dataclass
class PrefixCacheStats:
    """Counts gathered by `KVCacheManager.get_computed_blocks` since the last collection.

    Attributes:
        reset: `reset_prefix_cache` succeeded since the last collection.
        requests: prefix lookups made (one per `get_computed_blocks` call with caching on).
        queries: block hashes looked up.
        hits: blocks found.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


class PrefixCachingMetrics:
    """Hit rate over the most recent `max_recent_requests` requests (about; whole batches).

    Each `observe` adds one batch of stats; the oldest batches drop out once the aggregate holds
    more than `max_recent_requests` requests. A stats object with `reset` set clears everything
    first. Complexity: O(1) amortized per `observe`.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        require_int("PrefixCachingMetrics", "max_recent_requests", max_recent_requests, 1)
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one batch of stats (a `PrefixCacheStats`)."""
        require_instance("PrefixCachingMetrics.observe", "stats", stats, PrefixCacheStats)
        if stats.reset:
            self.reset()
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        if self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def hit_rate(self) -> float:
        """hits / queries over the window; 0.0 when nothing was queried."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
