"""The reference per-type managers, one module per attention type, picked by a group's spec type.

The registry below is the spec's twin of `pagedkv.single_type`'s; a new attention type is one
module on each side, one entry in each registry and one draw in the harness
(`ATTENTION_DRAWS` of `pagedkv.harness.swarm.runs`).
"""

from __future__ import annotations

from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.spec.single_type.chunked_local import ChunkedLocalAttention
from pagedkv.spec.single_type.full_attention import FullAttention
from pagedkv.spec.single_type.mamba import MambaAlignState, MambaState
from pagedkv.spec.single_type.sliding_window import SlidingWindow
from pagedkv.vocab import refusals
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "SPEC_SINGLE_TYPE_MANAGERS",
    "ChunkedLocalAttention",
    "FullAttention",
    "Lookup",
    "MambaAlignState",
    "MambaState",
    "SlidingWindow",
    "SpecSingleTypeManager",
    "spec_single_type_manager",
]

SPEC_SINGLE_TYPE_MANAGERS: dict[type[KVCacheSpec], type[SpecSingleTypeManager]] = {
    FullAttentionSpec: FullAttention,
    SlidingWindowSpec: SlidingWindow,
    ChunkedLocalAttentionSpec: ChunkedLocalAttention,
    MambaSpec: MambaState,
}
"""The reference manager of each spec type, keyed by the exact type (a Mamba group in
mamba_cache_mode "align" takes `MambaAlignState`)."""


def spec_single_type_manager(
    spec: KVCacheSpec,
    pool: SpecBlockPool,
    group_id: int,
    use_eagle: bool,
    retention_interval: int | None = None,
) -> SpecSingleTypeManager:
    """The reference manager of KV cache group `group_id`, with EAGLE and the config's
    `prefix_cache_retention_interval`.

    Preconditions: a spec type the registry serves; EAGLE only with an attention type that
    supports it (KVCacheConfigError).
    """
    manager_class = SPEC_SINGLE_TYPE_MANAGERS.get(type(spec))
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
        manager_class = MambaAlignState
    if manager_class is None:
        raise refusals.no_manager_for(type(spec).__name__)
    if use_eagle and not manager_class.supports_eagle:
        raise refusals.eagle_unsupported(manager_class.kind)
    manager = manager_class(spec, pool, group_id)
    manager.use_eagle = use_eagle
    manager.retention_interval = retention_interval
    return manager
