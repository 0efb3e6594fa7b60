"""pagedkv: a verified paged KV-cache block manager.

`import pagedkv` gives the optimized implementation; `import pagedkv.spec` the executable
specification it is checked against; both speak the vocabulary of `pagedkv.vocab` (errors,
`Request`, KV cache specs, block keys, semantics, event records) and share nothing else.

The names below load on first use (PEP 562), so importing a subpackage (`pagedkv.spec`,
`pagedkv.vocab`, `pagedkv.gpu`) loads no module it does not need: in particular the spec never
loads the optimized pool or manager. Nothing outside the standard library is imported here.
`pagedkv.COMPILED` says whether this install runs the hot modules compiled with mypyc
(`COMPILED_MODULES` lists them) or as pure Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.block import KVCacheBlock
    from pagedkv.block_hash import (
        generate_block_hash_extra_keys,
        hash_block_tokens,
        hash_request_tokens,
        need_extra_keys,
    )
    from pagedkv.block_pool import BlockPool
    from pagedkv.events.prefix_caching_metrics import PrefixCachingMetrics
    from pagedkv.free_queue import FreeKVCacheBlockQueue
    from pagedkv.manager import KVCacheBlocks, KVCacheManager
    from pagedkv.planning.kv_cache_config import (
        check_enough_kv_cache_memory,
        estimate_max_model_len,
        get_kv_cache_config,
        unify_kv_cache_configs,
    )
    from pagedkv.vocab.errors import (
        ArgumentTypeError,
        BlockStateError,
        ConcurrentUseError,
        FreeQueueError,
        FrozenRequestFieldError,
        InvalidArgumentError,
        InvariantViolation,
        KVCacheConfigError,
        MaxModelLenExceededError,
        NoFreeBlocksError,
        PagedKVError,
        RequestError,
    )
    from pagedkv.vocab.hashes import (
        NONE_HASH,
        BlockHashType,
        CacheSalt,
        GroupKey,
        get_hash_fn,
        sha256,
    )
    from pagedkv.vocab.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
        uniform_kv_cache_config,
    )
    from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
    from pagedkv.vocab.request import PlaceholderRange, Request
    from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, Semantics

    COMPILED_MODULES: tuple[str, ...]
    COMPILED: bool

__version__ = "0.1.0"

_HOMES: dict[str, tuple[str, ...]] = {
    "pagedkv.block": ("KVCacheBlock",),
    "pagedkv.block_hash": (
        "generate_block_hash_extra_keys",
        "hash_block_tokens",
        "hash_request_tokens",
        "need_extra_keys",
    ),
    "pagedkv.block_pool": ("BlockPool",),
    "pagedkv.events.prefix_caching_metrics": ("PrefixCachingMetrics",),
    "pagedkv.free_queue": ("FreeKVCacheBlockQueue",),
    "pagedkv.hybrid_manager": ("HybridKVCacheManager",),  # deprecated: not in __all__
    "pagedkv.manager": ("KVCacheBlocks", "KVCacheManager"),
    "pagedkv.planning.kv_cache_config": (
        "check_enough_kv_cache_memory",
        "estimate_max_model_len",
        "get_kv_cache_config",
        "unify_kv_cache_configs",
    ),
    "pagedkv.vocab.errors": (
        "ArgumentTypeError",
        "BlockStateError",
        "ConcurrentUseError",
        "FreeQueueError",
        "FrozenRequestFieldError",
        "InvalidArgumentError",
        "InvariantViolation",
        "KVCacheConfigError",
        "MaxModelLenExceededError",
        "NoFreeBlocksError",
        "PagedKVError",
        "RequestError",
    ),
    "pagedkv.vocab.hashes": (
        "NONE_HASH",
        "BlockHashType",
        "CacheSalt",
        "GroupKey",
        "get_hash_fn",
        "sha256",
    ),
    "pagedkv.vocab.kv_cache_interface": (
        "AttentionSpec",
        "ChunkedLocalAttentionSpec",
        "FullAttentionSpec",
        "KVCacheConfig",
        "KVCacheGroupSpec",
        "KVCacheSpec",
        "KVCacheTensor",
        "MambaSpec",
        "SlidingWindowSpec",
        "uniform_kv_cache_config",
    ),
    "pagedkv.vocab.prefix_cache_stats": ("PrefixCacheStats",),
    "pagedkv.vocab.request": ("PlaceholderRange", "Request"),
    "pagedkv.vocab.semantics": ("PAGEDKV", "VLLM_0_8_5", "Semantics"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (and kept here after, except a
    deprecated one, which warns each time)."""
    if name in ("COMPILED", "COMPILED_MODULES"):
        from pagedkv._build_info import MYPYC_MODULES, compiled_modules

        modules = compiled_modules()
        globals().update(COMPILED_MODULES=modules, COMPILED=modules == MYPYC_MODULES)
        return globals()[name]
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if module != "pagedkv.hybrid_manager":  # a deprecated name warns on every use: not kept
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "COMPILED",
    "COMPILED_MODULES",
    "NONE_HASH",
    "PAGEDKV",
    "VLLM_0_8_5",
    "ArgumentTypeError",
    "AttentionSpec",
    "BlockHashType",
    "BlockPool",
    "BlockStateError",
    "CacheSalt",
    "ChunkedLocalAttentionSpec",
    "ConcurrentUseError",
    "FreeKVCacheBlockQueue",
    "FreeQueueError",
    "FrozenRequestFieldError",
    "FullAttentionSpec",
    "GroupKey",
    "InvalidArgumentError",
    "InvariantViolation",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheConfigError",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaSpec",
    "MaxModelLenExceededError",
    "NoFreeBlocksError",
    "PagedKVError",
    "PlaceholderRange",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "Request",
    "RequestError",
    "Semantics",
    "SlidingWindowSpec",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "generate_block_hash_extra_keys",
    "get_hash_fn",
    "get_kv_cache_config",
    "hash_block_tokens",
    "hash_request_tokens",
    "need_extra_keys",
    "sha256",
    "uniform_kv_cache_config",
    "unify_kv_cache_configs",
]
