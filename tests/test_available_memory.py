"""Available KV memory: the arithmetic by hand on CPU, the measurement with a faked torch.cuda,
and the real CUDA path where a device exists."""

from __future__ import annotations

import pytest
import torch

from pagedkv.planning.available_memory import (
    GPUMemoryBudget,
    MemoryProfile,
    NoKVCacheMemoryError,
    available_kv_cache_memory,
    determine_available_memory,
    kv_cache_budget_bytes,
    measure_memory_profile,
)
from pagedkv.planning.kv_cache_config import get_kv_cache_config
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import FullAttentionSpec

GiB = 1 << 30
MiB = 1 << 20

# Illustrative numbers in the shape of a real profile (not recorded on a device): an 80 GiB
# device; 16 GiB of fp16 weights; the forward pass peaks 2 GiB above them; after it, the driver
# sees 768 MiB more than torch holds (CUDA context and NCCL buffers).
PROFILE_80G = MemoryProfile(
    total_bytes=80 * GiB,  # 85,899,345,920
    torch_peak_bytes=18 * GiB,  # 19,327,352,832
    torch_current_bytes=16 * GiB,  # 17,179,869,184
    device_used_bytes=16 * GiB + 768 * MiB,  # 17,985,175,552
)


def test_profile_peak_adds_memory_held_outside_torch() -> None:
    assert PROFILE_80G.non_torch_bytes == 805_306_368  # 768 MiB
    assert PROFILE_80G.peak_bytes == 19_327_352_832 + 805_306_368 == 20_132_659_200


def test_available_memory_by_hand() -> None:
    # 0.9 * 80 GiB - (18 GiB + 0.75 GiB) = 72 - 18.75 = 53.25 GiB
    assert available_kv_cache_memory(PROFILE_80G, 0.9) == 57_176_752_128 == int(53.25 * GiB)
    # the whole device: 80 - 18.75 = 61.25 GiB
    assert available_kv_cache_memory(PROFILE_80G, 1.0) == int(61.25 * GiB)


def test_torch_holding_more_than_the_driver_reports_adds_nothing() -> None:
    profile = MemoryProfile(
        total_bytes=24 * GiB,
        torch_peak_bytes=10 * GiB,
        torch_current_bytes=9 * GiB,
        device_used_bytes=8 * GiB,
    )
    assert profile.non_torch_bytes == 0
    # 0.5 * 24 - 10 = 2 GiB
    assert available_kv_cache_memory(profile, 0.5) == 2 * GiB


def test_a_profile_that_leaves_nothing_gives_a_negative_budget_which_config_refuses() -> None:
    # 0.2 * 80 GiB - 18.75 GiB = -2.75 GiB
    available = available_kv_cache_memory(PROFILE_80G, 0.2)
    assert available == -2_952_790_016
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    with pytest.raises(KVCacheConfigError, match="no memory is available"):
        get_kv_cache_config({"layer.0": spec}, available, max_model_len=4096)


def test_budget_arithmetic_truncates_like_int() -> None:
    assert kv_cache_budget_bytes(1000, 0.9, 100) == 800
    assert kv_cache_budget_bytes(1001, 0.5, 0) == 500  # 500.5 -> 500
    assert kv_cache_budget_bytes(10, 0.5, 6) == -1


@pytest.mark.parametrize("utilization", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_utilization_must_be_in_zero_one(utilization: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        kv_cache_budget_bytes(1000, utilization, 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="gpu_memory_utilization"):
        # checked before any device is touched
        determine_available_memory(lambda: None, utilization)  # type: ignore[arg-type]


def test_profile_fields_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="total_bytes must be an int >= 1"):
        MemoryProfile(0, 0, 0, 0)
    with pytest.raises(InvalidArgumentError, match="torch_peak_bytes must be an int >= 0"):
        MemoryProfile(1, -1, 0, 0)
    with pytest.raises(InvalidArgumentError, match="device_used_bytes must be an int >= 0"):
        MemoryProfile(1, 0, 0, 1.5)  # type: ignore[arg-type]


# -- a GPU planned before any run ------------------------------------------------------------


def test_gpu_budget_splits_the_weights_over_the_tensor_parallel_gpus() -> None:
    # 0.9 * 80 GiB = 77,309,411,328 usable; 141 GB over 4 GPUs = 35,250,000,000 each, plus
    # 3 GiB of activations and context: 77,309,411,328 - 38,471,225,472 = 38,838,185,856
    budget = GPUMemoryBudget(
        gpu_memory_bytes=80 * GiB,
        gpu_memory_utilization=0.9,
        weights_bytes=141 * 10**9,
        other_bytes=3 * GiB,
        tensor_parallel_size=4,
    )
    assert budget.usable_bytes == 77_309_411_328
    assert budget.weights_bytes_per_gpu == 35_250_000_000
    assert budget.non_kv_bytes == 38_471_225_472
    assert budget.kv_cache_bytes == budget.require_kv_cache_bytes() == 38_838_185_856
    # where it is positive it is the profile arithmetic's budget
    assert budget.kv_cache_bytes == kv_cache_budget_bytes(80 * GiB, 0.9, 38_471_225_472)
    # an odd share rounds up: 7 bytes over 2 GPUs is 4 each
    assert GPUMemoryBudget(100, 1.0, weights_bytes=7, tensor_parallel_size=2).kv_cache_bytes == 96
    assert budget.as_json() == {
        "gpu_memory_bytes": 85_899_345_920,
        "gpu_memory_utilization": 0.9,
        "usable_bytes": 77_309_411_328,
        "weights_bytes": 141_000_000_000,
        "weights_estimated": False,
        "tensor_parallel_size": 4,
        "weights_bytes_per_gpu": 35_250_000_000,
        "other_bytes": 3_221_225_472,
        "non_kv_bytes": 38_471_225_472,
        "kv_cache_bytes": 38_838_185_856,
    }
    # an estimate of each GPU's share (replicated norms, KV heads) replaces the even split
    estimated = GPUMemoryBudget(
        80 * GiB, 0.9, 141 * 10**9, 3 * GiB, 4, estimated_bytes_per_gpu=35_300_000_000
    )
    assert (estimated.weights_estimated, estimated.weights_bytes_per_gpu) == (True, 35_300_000_000)
    assert estimated.non_kv_bytes == 35_300_000_000 + 3 * GiB
    with pytest.raises(InvalidArgumentError, match="estimated_bytes_per_gpu"):
        GPUMemoryBudget(80 * GiB, 0.9, estimated_bytes_per_gpu=-1)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        # the weights alone exceed the whole GPU: no utilization helps
        (
            GPUMemoryBudget(80 * GiB, 0.9, weights_bytes=145 * 10**9),
            "the model needs 145,000,000,000 bytes (135.04 GiB) on each GPU besides its KV "
            "cache, more than the 77,309,411,328 bytes (72.00 GiB) that "
            "gpu_memory_utilization=0.9 allows of the GPU's 85,899,345,920 bytes (80.00 GiB): "
            "nothing is left for the KV cache. To fit, use a GPU with more memory or split the "
            "model over more GPUs (tensor_parallel_size).",
        ),
        # split, with activations: 0.95 * 40 GiB = 38 GiB usable, 36 + 2 GiB needed exactly
        (
            GPUMemoryBudget(
                40 * GiB,
                0.95,
                weights_bytes=72 * GiB,
                other_bytes=2 * GiB,
                tensor_parallel_size=2,
            ),
            "the model needs 40,802,189,312 bytes (38.00 GiB) on each GPU besides its KV cache "
            "(weights 36.00 GiB, 1/2 of 72.00 GiB; other 2.00 GiB), all of the "
            "40,802,189,312 bytes (38.00 GiB) that gpu_memory_utilization=0.95 allows of the "
            "GPU's 42,949,672,960 bytes (40.00 GiB): nothing is left for the KV cache. To fit, "
            "raise gpu_memory_utilization above 0.950, use a GPU with more memory or split the "
            "model over more GPUs (tensor_parallel_size).",
        ),
    ],
)
def test_a_gpu_with_nothing_left_names_the_numbers_and_the_fixes(
    budget: GPUMemoryBudget, message: str
) -> None:
    assert budget.kv_cache_bytes <= 0
    with pytest.raises(NoKVCacheMemoryError) as refused:
        budget.require_kv_cache_bytes()
    assert str(refused.value) == message
    assert refused.value.budget is budget
    assert "-" not in str(refused.value).split("GPU besides")[0]  # never a negative count


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpu_memory_bytes": 0}, "gpu_memory_bytes must be an int >= 1"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"weights_bytes": -1}, "weights_bytes must be an int >= 0"),
        ({"other_bytes": 1.5}, "other_bytes must be an int >= 0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1"),
    ],
)
def test_gpu_budget_fields_are_validated(fields: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"gpu_memory_bytes": GiB, "gpu_memory_utilization": 0.9}
    with pytest.raises(InvalidArgumentError, match=message):
        GPUMemoryBudget(**{**arguments, **fields})  # type: ignore[arg-type]


class FakeCuda:
    """torch.cuda's memory functions over a made-up device, recording the order of calls.

    Torch holds `weights` before the profile; the profile allocates `activations` on top and
    frees them; the driver always sees `outside` bytes more than torch has reserved, and torch
    reserves `cached` bytes more than it has allocated until its cache is emptied.
    """

    def __init__(self, total: int, weights: int, activations: int, outside: int) -> None:
        self.total, self.outside, self.activations = total, outside, activations
        self.allocated = self.peak = weights
        self.cached = 0
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "is_available",
            "empty_cache",
            "reset_peak_memory_stats",
            "mem_get_info",
            "synchronize",
            "memory_stats",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        used = self.allocated + self.cached + self.outside
        return self.total - used, self.total

    def synchronize(self, device: object = None) -> None:
        self.calls.append("synchronize")

    def memory_stats(self, device: object = None) -> dict[str, int]:
        self.calls.append("memory_stats")
        return {
            "allocated_bytes.all.peak": self.peak,
            "allocated_bytes.all.current": self.allocated,
        }

    def profile(self) -> None:
        self.calls.append("profile")
        self.allocated += self.activations
        self.peak = max(self.peak, self.allocated)
        self.allocated -= self.activations
        self.cached += self.activations  # freed, but still reserved by torch's cache


def test_measurement_order_and_numbers_with_a_faked_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCuda(total=80 * GiB, weights=16 * GiB, activations=2 * GiB, outside=768 * MiB)
    fake.install(monkeypatch)
    profile = measure_memory_profile(fake.profile)
    assert fake.calls == [
        "empty_cache",
        "reset_peak_memory_stats",
        "mem_get_info",
        "profile",
        "synchronize",
        "memory_stats",
        "empty_cache",  # before reading current/used: torch's cache is not "outside torch"
        "memory_stats",
        "mem_get_info",
    ]
    assert profile == PROFILE_80G
    fake.calls.clear()
    assert determine_available_memory(fake.profile, 0.9) == 57_176_752_128


def test_measuring_without_a_cuda_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    with pytest.raises(KVCacheConfigError, match="no CUDA device"):
        determine_available_memory(lambda: ran.append(1), 0.9)
    assert ran == []


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)
def test_cuda_measurement_sees_the_profiles_peak() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    size = 256 * MiB

    def profile() -> None:
        scratch = torch.empty(size, dtype=torch.uint8, device=device)
        scratch.fill_(1)
        del scratch

    profile_result = measure_memory_profile(profile, device)
    _, total = torch.cuda.mem_get_info(device)
    assert profile_result.total_bytes == total
    assert profile_result.torch_peak_bytes >= size
    assert profile_result.torch_current_bytes < profile_result.torch_peak_bytes
    # the CUDA context alone is held outside torch
    assert profile_result.non_torch_bytes > 0
    available = determine_available_memory(profile, 0.9, device)
    assert available <= int(total * 0.9) - size
    # a second run of the same profile measures (nearly) the same
    assert abs(available - available_kv_cache_memory(profile_result, 0.9)) < 64 * MiB
