"""How much device memory the KV cache may take: measure a profiling run, then subtract.

    budget = total * gpu_memory_utilization - peak
    peak   = torch's peak allocated bytes during the profile
           + memory held outside torch (device used - torch allocated, after the profile; if > 0)

The measurement (`measure_memory_profile`) needs a CUDA device; the arithmetic
(`available_kv_cache_memory`, `kv_cache_budget_bytes`) is pure and runs anywhere, and so is
`GPUMemoryBudget`, the same sum planned from a GPU's size and the model's weights, which refuses
with the numbers when nothing is left. torch is imported only when measuring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.planning.byte_sizes import GiB, format_bytes
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError

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


@dataclass(frozen=True)
class GPUMemoryBudget:
    """One GPU's memory and what takes it besides the KV cache, planned before any run, in bytes.

        kv_cache_bytes = usable_bytes - non_kv_bytes
        usable_bytes   = int(gpu_memory_bytes * gpu_memory_utilization)
        non_kv_bytes   = weights_bytes_per_gpu + other_bytes
        weights_bytes_per_gpu = cdiv(weights_bytes, tensor_parallel_size), or the estimate's

    Attributes:
        gpu_memory_bytes: the GPU's memory in all (>= 1).
        gpu_memory_utilization: the share of it the model and its KV cache may use, in (0, 1].
        weights_bytes: the model's weights over all GPUs (>= 0); each GPU holds an even share
            (tensor parallelism splits every large matrix; what it replicates is small) unless
            `estimated_bytes_per_gpu` says better.
        other_bytes: each GPU's peak besides its weights and the KV cache: activations, the CUDA
            context, communication buffers (>= 0).
        tensor_parallel_size: GPUs the weights are split over (>= 1).
        estimated_bytes_per_gpu: each GPU's share of the weights as estimated from the model's
            config (replicated KV heads and norms included), or None when `weights_bytes` was
            given (then it is split evenly).
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int = 0
    other_bytes: int = 0
    tensor_parallel_size: int = 1
    estimated_bytes_per_gpu: int | None = None

    def __post_init__(self) -> None:
        _check_bytes("gpu_memory_bytes", self.gpu_memory_bytes, 1)
        _check_utilization(self.gpu_memory_utilization)
        _check_bytes("weights_bytes", self.weights_bytes, 0)
        _check_bytes("other_bytes", self.other_bytes, 0)
        _check_bytes("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.estimated_bytes_per_gpu is not None:
            _check_bytes("estimated_bytes_per_gpu", self.estimated_bytes_per_gpu, 0)

    @property
    def weights_estimated(self) -> bool:
        """The weights were estimated from the model's config, not given."""
        return self.estimated_bytes_per_gpu is not None

    @property
    def usable_bytes(self) -> int:
        """`int(gpu_memory_bytes * gpu_memory_utilization)`: what the model may use in all."""
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def weights_bytes_per_gpu(self) -> int:
        """This GPU's share of the weights: the estimate's, or an even share rounded up."""
        if self.estimated_bytes_per_gpu is not None:
            return self.estimated_bytes_per_gpu
        return -(-self.weights_bytes // self.tensor_parallel_size)

    @property
    def non_kv_bytes(self) -> int:
        """Everything on this GPU but the KV cache: its weights and the other bytes."""
        return self.weights_bytes_per_gpu + self.other_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """What is left for the KV cache, <= 0 when nothing is (where it is positive, the same
        as `kv_cache_budget_bytes` of the GPU's memory, utilization and non-KV bytes)."""
        return self.usable_bytes - self.non_kv_bytes

    def require_kv_cache_bytes(self) -> int:
        """`kv_cache_bytes`, refused when it is not positive.

        Raises:
            NoKVCacheMemoryError: the weights and other bytes take all the usable memory; the
                message names the numbers and what to change.

        Complexity: O(1).
        """
        available = self.kv_cache_bytes
        if available <= 0:
            raise NoKVCacheMemoryError(self)
        return available

    def as_json(self) -> dict[str, int | float | bool]:
        """Every figure above, under its attribute's name (the `memory` object of `pagedkv plan
        --json`)."""
        return {
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "usable_bytes": self.usable_bytes,
            "weights_bytes": self.weights_bytes,
            "weights_estimated": self.weights_estimated,
            "tensor_parallel_size": self.tensor_parallel_size,
            "weights_bytes_per_gpu": self.weights_bytes_per_gpu,
            "other_bytes": self.other_bytes,
            "non_kv_bytes": self.non_kv_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
        }


class NoKVCacheMemoryError(KVCacheConfigError):
    """The weights and other memory take all that a GPU may use: no KV cache is possible.

    Attributes:
        budget: the GPU's numbers.
    """

    def __init__(self, budget: GPUMemoryBudget) -> None:
        self.budget = budget
        super().__init__(_no_kv_cache_memory_message(budget))


def _no_kv_cache_memory_message(budget: GPUMemoryBudget) -> str:
    parts = []
    if budget.weights_bytes:
        estimated = " estimated from its config" if budget.weights_estimated else ""
        parts.append(f"weights{estimated} {budget.weights_bytes_per_gpu / GiB:.2f} GiB")
        if budget.tensor_parallel_size > 1:
            share = "its share" if budget.weights_estimated else f"1/{budget.tensor_parallel_size}"
            parts[-1] += f", {share} of {budget.weights_bytes / GiB:.2f} GiB"
    if budget.other_bytes:
        parts.append(f"other {budget.other_bytes / GiB:.2f} GiB")
    breakdown = (
        f" ({'; '.join(parts)})"
        if len(parts) > 1 or budget.tensor_parallel_size > 1 or budget.weights_estimated
        else ""
    )
    comparison = "more than" if budget.non_kv_bytes > budget.usable_bytes else "all of"
    fixes = ["use a GPU with more memory", "split the model over more GPUs (tensor_parallel_size)"]
    if budget.non_kv_bytes < budget.gpu_memory_bytes:
        least = math.ceil(budget.non_kv_bytes / budget.gpu_memory_bytes * 1000) / 1000
        fixes.insert(0, f"raise gpu_memory_utilization above {least:.3f}")
    return (
        f"the model needs {format_bytes(budget.non_kv_bytes)} on each GPU besides its KV cache"
        f"{breakdown}, {comparison} the {format_bytes(budget.usable_bytes)} that "
        f"gpu_memory_utilization={budget.gpu_memory_utilization} allows of the GPU's "
        f"{format_bytes(budget.gpu_memory_bytes)}: nothing is left for the KV cache. "
        f"To fit, {', '.join(fixes[:-1])} or {fixes[-1]}."
    )


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
