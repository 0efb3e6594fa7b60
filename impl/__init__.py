"""pagedkv: a verified paged KV-cache block manager.

`import pagedkv` gives the optimized implementation; `import pagedkv.spec` the executable
specification it is checked against. Nothing outside the standard library is imported here.
"""

from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import (
    NONE_HASH,
    BlockHashType,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    need_extra_keys,
    sha256,
)
from pagedkv.block_pool import BlockPool
from pagedkv.errors import (
    BlockStateError,
    FreeQueueError,
    InvalidArgumentError,
    InvariantViolation,
    KVCacheConfigError,
    MaxModelLenExceededError,
    NoFreeBlocksError,
    PagedKVError,
    RequestError,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.request import PlaceholderRange, Request
from pagedkv.semantics import PAGEDKV, VLLM_0_8_5, Semantics

__version__ = "0.1.0"

__all__ = [
    "NONE_HASH",
    "PAGEDKV",
    "VLLM_0_8_5",
    "BlockHashType",
    "BlockPool",
    "BlockStateError",
    "FreeKVCacheBlockQueue",
    "FreeQueueError",
    "InvalidArgumentError",
    "InvariantViolation",
    "KVCacheBlock",
    "KVCacheConfigError",
    "MaxModelLenExceededError",
    "NoFreeBlocksError",
    "PagedKVError",
    "PlaceholderRange",
    "Request",
    "RequestError",
    "Semantics",
    "generate_block_hash_extra_keys",
    "get_hash_fn",
    "hash_block_tokens",
    "hash_request_tokens",
    "need_extra_keys",
    "sha256",
]
