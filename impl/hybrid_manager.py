"""Deprecated: `KVCacheManager` serves one or more KV cache groups; `HybridKVCacheManager` is the
same class under its old name, and warns when it is looked up."""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    """`HybridKVCacheManager`: `pagedkv.KVCacheManager`, with a DeprecationWarning."""
    if name != "HybridKVCacheManager":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "HybridKVCacheManager is deprecated: KVCacheManager serves any number of KV cache groups",
        DeprecationWarning,
        stacklevel=2,
    )
    from pagedkv.manager import KVCacheManager

    return KVCacheManager
