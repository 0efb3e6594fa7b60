"""pagedkv.offload: the CPU offload tier (vLLM 0.33's `CPUOffloadingManager` with its LRU and
ARC policies), checked against `pagedkv.spec.offload`. docs/semantics.md, "The CPU offload
tier", states the contract and every difference from vLLM."""

from pagedkv.offload.arc import ARCPolicy
from pagedkv.offload.lru import LRUPolicy
from pagedkv.offload.policy import CachePolicy
from pagedkv.offload.tier import OffloadTier
from pagedkv.vocab.errors import OffloadChunkError
from pagedkv.vocab.offload import (
    LookupResult,
    OffloadEvent,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    StoreOutput,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
)

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "LookupResult",
    "OffloadChunkError",
    "OffloadEvent",
    "OffloadKey",
    "OffloadRequest",
    "OffloadTier",
    "OffloadTierConfig",
    "StoreOutput",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]
