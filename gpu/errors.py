"""The GPU executor's own failures, beside the argument errors of `pagedkv.vocab.errors`.

    PagedKVError
    ├── KernelCompileError      NVRTC rejected a kernel source (the log is in the message)
    └── DeviceUnavailableError  no CUDA device, or cupy / torch-CUDA is not installed

Misuse (a bad shape, dtype, stride, block id or slot) raises
`pagedkv.vocab.errors.InvalidArgumentError` before anything is launched.
"""

from __future__ import annotations

from pagedkv.vocab.errors import PagedKVError


class KernelCompileError(PagedKVError, RuntimeError):
    """NVRTC failed to compile a kernel source for an architecture."""


class DeviceUnavailableError(PagedKVError, RuntimeError):
    """The operation needs a CUDA device (and cupy) that this process does not have."""
