"""Build (or reuse) the cubin of a kernel source for a device and hand out its kernels.

One NVRTC compile per (source, arch), cached on disk under `$PAGEDKV_KERNEL_CACHE` (default
`~/.cache/pagedkv/kernels`, a temporary directory when that is not writable), keyed by a hash of
the sources, options, NVRTC version and cache format. Modules are loaded through
`cupy.RawModule(path=...)` from the cubin, never from PTX. Every cubin is checked to be exactly
the image its ELF headers describe when written and again when read back (a truncated or
foreign file in the cache is rebuilt, not loaded).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pagedkv.gpu.cubin_image import check_cubin
from pagedkv.gpu.errors import DeviceUnavailableError, KernelCompileError
from pagedkv.gpu.kernel_variants import KernelSource
from pagedkv.gpu.nvrtc_build import cache_key, compile_source


def import_cupy() -> Any:
    """`cupy`, or DeviceUnavailableError when it is missing or sees no device.

    Raises:
        DeviceUnavailableError: cupy is not installed or no CUDA device is usable.
    """
    try:
        import cupy
    except ImportError as error:
        raise DeviceUnavailableError(f"the GPU executor needs cupy: {error}") from error
    if not cupy.is_available():
        raise DeviceUnavailableError("cupy sees no usable CUDA device")
    return cupy


def cache_dir() -> Path:
    """Where cubins are kept; created on first use."""
    configured = os.environ.get("PAGEDKV_KERNEL_CACHE")
    path = Path(configured) if configured else Path.home() / ".cache" / "pagedkv" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError:
        path = Path(tempfile.gettempdir()) / f"pagedkv-kernels-{os.getuid()}"
        path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cubin_path(source: KernelSource, arch: int) -> tuple[Path, dict[str, str]]:
    """The cached cubin of `source` for sm_`arch` and its lowered names, compiling if needed.

    Raises:
        KernelCompileError: NVRTC rejected the source.
    """
    key = cache_key(source, arch)
    stem = f"{Path(source.file_name).stem}-sm{arch}-{key}"
    directory = cache_dir()
    cubin, names = directory / f"{stem}.cubin", directory / f"{stem}.json"
    if cubin.exists() and names.exists():
        try:
            check_cubin(cubin.read_bytes(), str(cubin))
            lowered = dict(json.loads(names.read_text()))
        except (KernelCompileError, ValueError):
            pass  # a damaged or foreign entry: compile it again below
        else:
            if set(lowered) == set(source.name_expressions):
                return cubin, lowered
    module = compile_source(source, arch)
    _atomic_write(cubin, module.cubin)
    _atomic_write(names, json.dumps(module.lowered_names).encode())
    return cubin, module.lowered_names


@functools.cache
def _module(source: KernelSource, device: int) -> tuple[Any, dict[str, str]]:
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        arch = int(cupy.cuda.Device(device).compute_capability)  # a string such as "90"
        path, names = cubin_path(source, arch)
        return cupy.RawModule(path=str(path)), names


def get_kernel(source: KernelSource, name_expression: str, device: int) -> Any:
    """The `cupy.RawKernel` of one instantiation on `device`.

    Args:
        source: the translation unit.
        name_expression: one of `source.name_expressions`.
        device: CUDA device index.

    Raises:
        DeviceUnavailableError: no cupy or no device.
        KernelCompileError: NVRTC rejected the source.
    """
    module, names = _module(source, device)
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        return module.get_function(names[name_expression])
