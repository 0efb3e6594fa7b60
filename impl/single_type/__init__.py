"""The per-type managers: one module per attention type, picked by the spec type of a group.

A new attention type is one module here (a `SingleTypeKVCacheManager` subclass), one entry in
`SINGLE_TYPE_MANAGERS`, its twin in `pagedkv.spec.single_type` and its draw in the harness
(`ATTENTION_DRAWS` of `pagedkv.harness.swarm.runs`); CONTRIBUTING.md gives the recipe.
"""

from __future__ import annotations

from pagedkv.block_pool import BlockPool
from pagedkv.single_type.base import SingleTypeKVCacheManager
from pagedkv.single_type.chunked_local import ChunkedLocalAttentionManager
from pagedkv.single_type.full_attention import FullAttentionManager
from pagedkv.single_type.mamba import MambaAlignManager, MambaManager
from pagedkv.single_type.sliding_window import SlidingWindowManager
from pagedkv.vocab import refusals
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "SINGLE_TYPE_MANAGERS",
    "ChunkedLocalAttentionManager",
    "FullAttentionManager",
    "MambaAlignManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "single_type_manager",
]

SINGLE_TYPE_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}
"""The manager of each spec type, keyed by the exact type (as vLLM's `spec_manager_map`; a
Mamba group in mamba_cache_mode "align" takes `MambaAlignManager`)."""


def single_type_manager(
    spec: KVCacheSpec,
    block_pool: BlockPool,
    group_id: int,
    use_eagle: bool,
    retention_interval: int | None = None,
) -> SingleTypeKVCacheManager:
    """The manager of KV cache group `group_id`, whose layers have spec `spec`, with EAGLE and
    the config's `prefix_cache_retention_interval`.

    Raises:
        KVCacheConfigError: a spec type no manager serves, or EAGLE with one whose type does
            not support it.

    Complexity: O(1).
    """
    manager_class = SINGLE_TYPE_MANAGERS.get(type(spec))
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
        manager_class = MambaAlignManager
    if manager_class is None:
        raise refusals.no_manager_for(type(spec).__name__)
    if use_eagle and not manager_class.supports_eagle:
        raise refusals.eagle_unsupported(manager_class.kind)
    manager = manager_class(spec, block_pool, group_id)
    manager.use_eagle = use_eagle
    manager.retention_interval = retention_interval
    manager.sparse = manager_class.acts_on_retention and retention_interval is not None
    return manager
