"""The CPU offload tier's specification: the tier (`tier`), what it remembers of a request
(`access`), and its eviction policies (`policy`: what one is told; `lru`, `arc`)."""

from pagedkv.spec.offload.access import SpecRequestAccess
from pagedkv.spec.offload.arc import SpecARC
from pagedkv.spec.offload.lru import SpecLRU
from pagedkv.spec.offload.policy import SpecPolicy
from pagedkv.spec.offload.tier import SpecOffloadTier

__all__ = ["SpecARC", "SpecLRU", "SpecOffloadTier", "SpecPolicy", "SpecRequestAccess"]
