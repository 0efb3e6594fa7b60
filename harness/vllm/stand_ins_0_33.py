"""Stand-ins for the parts of vllm 0.33.0 that its KV cache modules import but never need here.

Each is written for this purpose (not taken from vLLM): loggers, the environment flags, the
event types (events stay off), the hash functions (sha256 over pickle, as vLLM's), the stats
record, the request status, and the dtype size. `MODULES` are the wheel members that run as
they are.
"""

from __future__ import annotations

MODULES = (
    "vllm/utils/math_utils.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/kv_cache_layout.py",
    "vllm/v1/kv_cache_spec_registry.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_metrics.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/hisparse/block_pool.py",
)

_EMPTY_PACKAGES = (
    "vllm/__init__.py",
    "vllm/config/__init__.py",
    "vllm/distributed/__init__.py",
    "vllm/multimodal/__init__.py",
    "vllm/utils/__init__.py",
    "vllm/v1/__init__.py",
    "vllm/v1/attention/__init__.py",
    "vllm/v1/attention/backends/__init__.py",
    "vllm/v1/core/__init__.py",
    "vllm/v1/hisparse/__init__.py",
    "vllm/v1/metrics/__init__.py",
)

STAND_INS: dict[str, str] = {name: "" for name in _EMPTY_PACKAGES}
STAND_INS["vllm/config/__init__.py"] = """
class VllmConfig:
    pass


def get_current_vllm_config_or_none():
    return None
"""
STAND_INS["vllm/envs.py"] = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False\n"
STAND_INS["vllm/logger.py"] = """
import logging


class _Logger(logging.LoggerAdapter):
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    def info_once(self, *args, **kwargs):
        self.info(*args, **kwargs)

    def debug_once(self, *args, **kwargs):
        self.debug(*args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
"""
STAND_INS["vllm/multimodal/utils.py"] = """
import bisect


def get_mm_features_in_window(mm_features, start, end):
    # First feature ending after `start`, first feature starting at or after `end`.
    lo = bisect.bisect_right(
        [f.mm_position.offset + f.mm_position.length for f in mm_features], start
    )
    hi = bisect.bisect_left([f.mm_position.offset for f in mm_features], end)
    return lo, hi
"""
STAND_INS["vllm/utils/hashing.py"] = """
import hashlib
import pickle


def sha256(data):
    return hashlib.sha256(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _unavailable(data):
    raise NotImplementedError("only sha256 is available in pagedkv's stand-in")


sha256_cbor = xxhash = xxhash_cbor = _unavailable


def get_hash_fn_by_name(name):
    if name != "sha256":
        raise NotImplementedError(f"{name}: only sha256 is available in pagedkv's stand-in")
    return sha256
"""
STAND_INS["vllm/utils/torch_utils.py"] = """
def get_dtype_size(dtype):
    return dtype.itemsize
"""
STAND_INS["vllm/distributed/kv_events.py"] = """
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class BlockStored(KVCacheEvent):
    pass


class BlockRemoved(KVCacheEvent):
    pass


class AllBlocksCleared(KVCacheEvent):
    pass
"""
STAND_INS["vllm/platforms/__init__.py"] = """
class _Platform:
    def register_custom_kv_cache_specs(self, vllm_config):
        pass


current_platform = _Platform()
"""
STAND_INS["vllm/v1/utils.py"] = """
def tensor_data(tensor):
    raise NotImplementedError("prompt embeddings are not used by pagedkv's harness")
"""
STAND_INS["vllm/v1/request.py"] = """
import enum


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()


class Request:
    pass
"""
STAND_INS["vllm/v1/metrics/stats.py"] = """
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens, num_hits, preempted, hits_by_source=None):
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(frozen=True)
class KVCacheEvictionEvent:
    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple
"""
STAND_INS["vllm/v1/attention/backends/registry.py"] = """
import enum


class MambaAttentionBackendEnum(enum.Enum):
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    SHORT_CONV = "short_conv"
    LINEAR = "linear"
    GDN_ATTN = "gdn_attn"
"""


# vLLM's planning (`kv_cache_planning.py`, its config builder) as the engine runs it, with
# what it imports beyond the modules above, written for this purpose; and the config classes
# whose defaults `engine_0_33` reads (never imported).
PLANNING_MODULES = (
    *MODULES,
    "vllm/config/cache.py",
    "vllm/config/scheduler.py",
    "vllm/v1/core/kv_cache_planning.py",
    "vllm/v1/core/kv_cache_config_builder.py",
)

PLANNING_STAND_INS = dict(STAND_INS)
PLANNING_STAND_INS["vllm/config/__init__.py"] = """
class VllmConfig:
    pass


class SpeculativeConfig:
    pass


def get_current_vllm_config_or_none():
    return None
"""
PLANNING_STAND_INS["vllm/utils/mem_utils.py"] = """
def format_gib(num_bytes):
    return round(num_bytes / (1 << 30), 2)
"""
PLANNING_STAND_INS["vllm/utils/import_utils.py"] = """
import importlib


def resolve_obj_by_qualname(qualname):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)
"""
PLANNING_STAND_INS["vllm/v1/hisparse/layout.py"] = """
def get_hisparse_host_pool_bytes(vllm_config):
    raise NotImplementedError("HiSparse is off in pagedkv's stand-in")


def get_hisparse_kv_cache_config(*args):
    raise NotImplementedError("HiSparse is off in pagedkv's stand-in")


def get_hisparse_kv_cache_groups(vllm_config, kv_cache_spec):
    return []
"""
PLANNING_STAND_INS["vllm/v1/attention/backend.py"] = """
class MultipleOf:
    def __init__(self, base):
        self.base = base
"""
PLANNING_STAND_INS["vllm/platforms/__init__.py"] = """
class _Platform:
    def register_custom_kv_cache_specs(self, vllm_config):
        pass

    def get_kv_cache_config_builder_cls(self, vllm_config):
        return "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"


current_platform = _Platform()
"""
