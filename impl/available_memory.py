"""How much device memory the KV cache may take: measure a profiling run, then subtract.

    budget = total * gpu_memory_utilization - peak
    peak   = torch's peak allocated bytes during the profile
           + memory held outside torch (device used - torch allocated, after the profile; if > 0)

The measurement (`measure_memory_profile`) needs a CUDA device; the arithmetic
(`available_kv_cache_memory`, `kv_cache_budget_bytes`) is pure and runs anywhere. torch is
imported only when measuring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.errors import InvalidArgumentError, KVCacheConfigError

if TYPE_CHECKING:
    import torch


def _check_bytes(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_utilization(gpu_memory_utilization: float) -> None:
    if (
        not isinstance(gpu_memory_utilization, (int, float))
        or isinstance(gpu_memory_utilization, bool)
        or math.isnan(gpu_memory_utilization)
        or not 0 < gpu_memory_utilization <= 1
    ):
        raise InvalidArgumentError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )


@dataclass(frozen=True)
class MemoryProfile:
    """What one profiling run measured on one device, in bytes.

    Attributes:
        total_bytes: the device's memory in all (>= 1).
        torch_peak_bytes: torch's peak allocated bytes during the profile (>= 0).
        torch_current_bytes: torch's allocated bytes after the profile, cache emptied (>= 0).
        device_used_bytes: total minus free after the profile, as the driver sees it (>= 0):
            torch's memory plus the CUDA context, NCCL buffers and other libraries'.
    """

    total_bytes: int
    torch_peak_bytes: int
    torch_current_bytes: int
    device_used_bytes: int

    def __post_init__(self) -> None:
        _check_bytes("total_bytes", self.total_bytes, 1)
        _check_bytes("torch_peak_bytes", self.torch_peak_bytes, 0)
        _check_bytes("torch_current_bytes", self.torch_current_bytes, 0)
        _check_bytes("device_used_bytes", self.device_used_bytes, 0)

    @property
    def non_torch_bytes(self) -> int:
        """Memory held outside torch: device used minus torch allocated, or 0 if negative."""
        return max(self.device_used_bytes - self.torch_current_bytes, 0)

    @property
    def peak_bytes(self) -> int:
        """Everything but the KV cache at its peak: torch's peak plus memory outside torch."""
        return self.torch_peak_bytes + self.non_torch_bytes


def kv_cache_budget_bytes(total_bytes: int, gpu_memory_utilization: float, peak_bytes: int) -> int:
    """`int(total_bytes * gpu_memory_utilization - peak_bytes)`; negative when nothing is left.

    Raises:
        InvalidArgumentError: total < 1, peak < 0, or utilization outside (0, 1].

    Complexity: O(1).
    """
    _check_bytes("total_bytes", total_bytes, 1)
    _check_bytes("peak_bytes", peak_bytes, 0)
    _check_utilization(gpu_memory_utilization)
    return int(total_bytes * gpu_memory_utilization - peak_bytes)


def available_kv_cache_memory(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take after `profile`: see the module docstring. Complexity: O(1).

    Raises:
        InvalidArgumentError: utilization outside (0, 1].
    """
    return kv_cache_budget_bytes(profile.total_bytes, gpu_memory_utilization, profile.peak_bytes)


def measure_memory_profile(
    profile_fn: Callable[[], object], device: torch.device | int | str | None = None
) -> MemoryProfile:
    """Run `profile_fn` (e.g. a forward pass at the largest batch) and measure its memory.

    Empties torch's cache and resets its peak statistics first, so the peak is the profile's;
    empties the cache again afterwards, so memory torch merely caches is not counted as held
    outside torch. Assumes no other process changes its memory use on the device meanwhile.

    Args:
        profile_fn: the work to measure; its return value is ignored.
        device: the CUDA device; None means the current one.

    Raises:
        KVCacheConfigError: no CUDA device.

    Complexity: one run of `profile_fn`.
    """
    import torch

    if not torch.cuda.is_available():
        raise KVCacheConfigError(
            "no CUDA device: available KV cache memory can only be measured on a GPU; "
            "give a memory budget instead"
        )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _, total_bytes = torch.cuda.mem_get_info(device)
    profile_fn()
    torch.cuda.synchronize(device)
    torch_peak_bytes = int(torch.cuda.memory_stats(device)["allocated_bytes.all.peak"])
    torch.cuda.empty_cache()
    torch_current_bytes = int(torch.cuda.memory_stats(device)["allocated_bytes.all.current"])
    free_bytes, total_after = torch.cuda.mem_get_info(device)
    return MemoryProfile(
        total_bytes=int(total_bytes),
        torch_peak_bytes=torch_peak_bytes,
        torch_current_bytes=torch_current_bytes,
        device_used_bytes=int(total_after - free_bytes),
    )


def determine_available_memory(
    profile_fn: Callable[[], object],
    gpu_memory_utilization: float,
    device: torch.device | int | str | None = None,
) -> int:
    """Bytes of device memory the KV cache may take, from a profiling run of `profile_fn`.

    Args:
        profile_fn: see `measure_memory_profile`.
        gpu_memory_utilization: the share of the device's total memory pagedkv may use, in
            (0, 1]; checked before anything runs.
        device: the CUDA device; None means the current one.

    Returns:
        `available_kv_cache_memory(measure_memory_profile(...), gpu_memory_utilization)`;
        zero or negative when the profile left nothing (`get_kv_cache_config` refuses that).

    Raises:
        InvalidArgumentError: utilization outside (0, 1].
        KVCacheConfigError: no CUDA device.

    Complexity: one run of `profile_fn`.
    """
    _check_utilization(gpu_memory_utilization)
    profile = measure_memory_profile(profile_fn, device)
    return available_kv_cache_memory(profile, gpu_memory_utilization)
