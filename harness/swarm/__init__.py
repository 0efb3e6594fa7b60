"""pagedkv.harness.swarm: the swarm campaign engine (seeded runs of the simulated clients).

`runs` draws a run's configuration, features and operation weights from its seed, `sampling`
draws its operations, `engine` runs campaigns of runs, `parallel` runs them in worker processes
or in shards and merges them, `shrink` shrinks a failing run to a short sequence that fails the
same way, `report` prints what `pagedkv verify` shows.
"""

from pagedkv.harness.swarm.engine import (
    CampaignRun,
    Layer,
    RunFailure,
    execute_run,
    manager_layer,
    offers_cache_blocks,
    offers_deferred_frees,
    offers_evict_blocks,
    offers_external_tokens,
    offers_full_sequence_gate,
    offers_kv_events,
    offers_mamba_align,
    offers_mamba_groups,
    offers_mixed_block_sizes,
    pool_layer,
    replay,
    run_campaign,
)

__all__ = [
    "CampaignRun",
    "Layer",
    "RunFailure",
    "execute_run",
    "manager_layer",
    "offers_cache_blocks",
    "offers_deferred_frees",
    "offers_evict_blocks",
    "offers_external_tokens",
    "offers_full_sequence_gate",
    "offers_kv_events",
    "offers_mamba_align",
    "offers_mamba_groups",
    "offers_mixed_block_sizes",
    "pool_layer",
    "replay",
    "run_campaign",
]
