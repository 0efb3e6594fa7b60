"""pagedkv's GPU executor: paged KV writes and paged attention as CuPy RawKernels.

Importing this package imports nothing else (no cupy, torch or numpy) and touches no device;
each name below is loaded from its module on first use. Modules:

    kernel_variants     every instantiation compiled, and the launch constants the host mirrors
    nvrtc_build         NVRTC -> cubin without a driver (CI compiles every variant with it)
    cubin_image         a cubin is exactly the ELF image its headers describe; CUDA tools
    ptxas_usage         registers, spills, shared memory from ptxas' report or a cubin
    sass_count          warp instructions per key of a kernel's main loop, from its SASS
    occupancy           CTAs per SM by CUDA's rules (registers, shared memory, reservation)
    kernel_loader       per-device cubin cache and `cupy.RawModule` loading
    launch              one device and backend per call, the caller's stream, typed arguments
    array_view          torch / CuPy / NumPy arrays described without importing them
    attention_metadata  varlen metadata rules, checked on the host before any launch
    attention_plan      work list and split-KV policy (pure, CPU-testable)
    attention           `plan_step`, `paged_attention`, `paged_attention_varlen`
    kv_write            `write_kv`
    reference           float64 torch reference of both operations
    error_bound         the per-element bound a correct kernel's output meets
    step_metadata       scheduler step + block lists -> slot_mapping, block_table, ...
    kv_cache_tensors    per-layer K/V caches from a `KVCacheConfig`
    synthetic_batch     random paged batches with a dense twin and the SDPA oracle
    adversarial_batches batches built for the kernels' numerical corners
    errors              KernelCompileError, DeviceUnavailableError
    check               the one GPU check script (`python -m pagedkv.gpu.check`)
    first_device        the first run on a lent device (`bash gpu/first_device.sh OUT`)
    result_log          results appended as JSON lines the moment they are measured
    link_tree           the package as links laid out by pyproject.toml (stdlib only)
    emulator/           the CPU SIMT emulator that runs the kernels' exact text

Layout, launch bounds and the split policy: gpu/README.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.gpu.attention import paged_attention, paged_attention_varlen, plan_step
    from pagedkv.gpu.attention_metadata import AttentionMetadata, validate_metadata
    from pagedkv.gpu.attention_plan import AttentionPlan, DeviceLimits, plan_attention
    from pagedkv.gpu.errors import DeviceUnavailableError, KernelCompileError
    from pagedkv.gpu.kv_cache_tensors import (
        KVCacheLayout,
        LayerKVCache,
        allocate_kv_caches,
        kv_cache_layouts,
    )
    from pagedkv.gpu.kv_write import write_kv
    from pagedkv.gpu.reference import reference_paged_attention, reference_write_kv
    from pagedkv.gpu.step_metadata import (
        ScheduledRequest,
        StepMetadata,
        build_step_metadata,
        scheduled_from_manager,
    )

_EXPORTS = {
    "paged_attention": "attention",
    "paged_attention_varlen": "attention",
    "plan_step": "attention",
    "AttentionMetadata": "attention_metadata",
    "validate_metadata": "attention_metadata",
    "AttentionPlan": "attention_plan",
    "DeviceLimits": "attention_plan",
    "plan_attention": "attention_plan",
    "DeviceUnavailableError": "errors",
    "KernelCompileError": "errors",
    "KVCacheLayout": "kv_cache_tensors",
    "LayerKVCache": "kv_cache_tensors",
    "allocate_kv_caches": "kv_cache_tensors",
    "kv_cache_layouts": "kv_cache_tensors",
    "write_kv": "kv_write",
    "reference_paged_attention": "reference",
    "reference_write_kv": "reference",
    "ScheduledRequest": "step_metadata",
    "StepMetadata": "step_metadata",
    "build_step_metadata": "step_metadata",
    "scheduled_from_manager": "step_metadata",
}

__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "DeviceLimits",
    "DeviceUnavailableError",
    "KVCacheLayout",
    "KernelCompileError",
    "LayerKVCache",
    "ScheduledRequest",
    "StepMetadata",
    "allocate_kv_caches",
    "build_step_metadata",
    "kv_cache_layouts",
    "paged_attention",
    "paged_attention_varlen",
    "plan_attention",
    "plan_step",
    "reference_paged_attention",
    "reference_write_kv",
    "scheduled_from_manager",
    "validate_metadata",
    "write_kv",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedkv.gpu.{module}"), name)
