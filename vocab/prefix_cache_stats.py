"""Prefix-cache hit statistics: the counts a manager gathers between two collections.

Two hit rates, side by side: in blocks (vLLM 0.8.5's: full blocks looked up, full blocks hit) and
in tokens (the newest vLLM's: every token of the requests looked up, tokens the hits hold). The
token rate is the one that says how much prefill the cache saved: it counts the partial last block
and the last full block a lookup never asks for (its last token must be recomputed for logits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counts gathered by `KVCacheManager.get_computed_blocks` since the last collection.

    Attributes:
        reset: `reset_prefix_cache` succeeded since the last collection.
        requests: prefix lookups made (one per `get_computed_blocks` call with caching on, a
            request wanting prompt logprobs included, as vLLM 0.8.5 counts them).
        queries: block hashes looked up.
        hits: blocks found.
        queried_tokens: tokens of the requests whose lookup ran (`request.num_tokens` each; a
            request wanting prompt logprobs skips the lookup and adds nothing).
        hit_tokens: tokens the hits hold (`hits * block_size`).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
