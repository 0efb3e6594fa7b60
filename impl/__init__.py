"""pagedkv: a verified paged KV-cache block manager.

`import pagedkv` gives the optimized implementation; `import pagedkv.spec` the executable
specification it is checked against. Nothing outside the standard library is imported here.
`pagedkv.COMPILED` says whether this install runs the hot modules compiled with mypyc
(`COMPILED_MODULES` lists them) or as pure Python.
"""

from pagedkv._build_info import MYPYC_MODULES, compiled_modules
from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import (
    NONE_HASH,
    BlockHashType,
    CacheSalt,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    need_extra_keys,
    sha256,
)
from pagedkv.block_pool import BlockPool
from pagedkv.errors import (
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
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.kv_cache_config import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    unify_kv_cache_configs,
)
from pagedkv.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.manager import KVCacheManager
from pagedkv.prefix_cache_stats import PrefixCacheStats, PrefixCachingMetrics
from pagedkv.request import PlaceholderRange, Request
from pagedkv.semantics import PAGEDKV, VLLM_0_8_5, Semantics

__version__ = "0.1.0"

COMPILED_MODULES: tuple[str, ...] = compiled_modules()
"""The hot modules this process runs compiled (mypyc); empty for a pure-Python install."""
COMPILED: bool = COMPILED_MODULES == MYPYC_MODULES
"""True when every module the compiled build compiles runs compiled here."""

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
    "ConcurrentUseError",
    "FreeKVCacheBlockQueue",
    "FreeQueueError",
    "FrozenRequestFieldError",
    "FullAttentionSpec",
    "InvalidArgumentError",
    "InvariantViolation",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheConfigError",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
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
