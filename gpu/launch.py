"""Shared launch plumbing: one device and one backend per call, the stream, scalar types.

CuPy passes a Python int as int64 and a float as double, and checks neither array dtypes nor
strides, so every kernel argument is built here with an explicit NumPy type, and pointers are
passed as `numpy.uint64` after the caller validated the arrays they come from. Kernels run on
the caller's current stream: torch's for torch tensors, CuPy's for CuPy arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.gpu.array_view import ArrayView, Backend
from pagedkv.gpu.kernel_loader import import_cupy
from pagedkv.gpu.kernel_variants import KernelSource
from pagedkv.vocab.errors import InvalidArgumentError

OPT_IN_SHARED_BYTES = 48 * 1024
"""Dynamic shared memory a launch gets without `cudaFuncAttributeMaxDynamicSharedMemorySize`."""
MAX_SHARED_CARVEOUT = 100
"""`cudaSharedmemCarveoutMaxShared`: the largest shared-memory part of L1 (228 KiB on an H200),
which the CTAs per SM of `kernel_variants` assume (the driver may pick less without it)."""


@dataclass(frozen=True)
class KernelCall:
    """One launch, independent of who runs it (CuPy on a device, or the CPU emulator).

    Attributes:
        source: the translation unit holding the kernel.
        kernel: the name expression (see `kernel_variants`).
        grid: CTAs in x, y, z.
        block: threads in x, y, z.
        shared_bytes: dynamic shared memory per CTA.
        args: typed scalars (`numpy.int32`, ...) and whatever pointer objects the caller gave.
    """

    source: KernelSource
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[Any, ...]

    def launch(self, function: Any) -> None:
        """Launch on a CuPy `RawKernel` on the current device and stream. A kernel with shared
        memory asks for the largest carveout first, and more than 48 KiB of dynamic shared
        memory is opted into, as CUDA requires."""
        if self.shared_bytes > 0:
            function.preferred_shared_memory_carveout = MAX_SHARED_CARVEOUT
        if self.shared_bytes > OPT_IN_SHARED_BYTES:
            function.max_dynamic_shared_size_bytes = self.shared_bytes
        function(self.grid, self.block, self.args, shared_mem=self.shared_bytes)


def common_device(views: Sequence[ArrayView]) -> tuple[Backend, int]:
    """The single backend and CUDA device of `views`.

    Raises:
        InvalidArgumentError: an array is on the host, or they differ in backend or device.
    """
    backends = {view.backend for view in views}
    devices = {view.device for view in views}
    host = [view.name for view in views if view.device is None]
    if host:
        raise InvalidArgumentError(f"{', '.join(host)} must be on a CUDA device")
    if len(backends) != 1 or len(devices) != 1:
        described = ", ".join(f"{v.name}: {v.backend} cuda:{v.device}" for v in views)
        raise InvalidArgumentError(f"arrays must share one backend and device, got {described}")
    device = devices.pop()
    assert device is not None  # no host arrays (checked above)
    return backends.pop(), device


@contextlib.contextmanager
def launch_context(backend: Backend, device: int) -> Iterator[Any]:
    """Enter `device` and the caller's current stream (torch's or CuPy's); yield cupy."""
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        if backend == "torch":
            import torch

            handle = torch.cuda.current_stream(device).cuda_stream
            with cupy.cuda.ExternalStream(handle, device):
                yield cupy
        else:
            yield cupy


def pointer(view: ArrayView) -> np.uint64:
    """The kernel argument for an array already validated by the caller."""
    value: np.uint64 = np.uint64(view.ptr)
    return value


def i32(value: int) -> np.int32:
    """An int kernel argument, range-checked."""
    if not -(2**31) <= value < 2**31:
        raise InvalidArgumentError(f"{value} does not fit a 32-bit kernel argument")
    result: np.int32 = np.int32(value)
    return result


def i64(value: int) -> np.int64:
    """A long long kernel argument."""
    result: np.int64 = np.int64(value)
    return result
