"""Compile a kernel source to a cubin with NVRTC, without a GPU or a driver.

CuPy's own compile entry points ask for the current device first, so they fail on a machine
without one. NVRTC called directly through `cupy_backends.cuda.libs.nvrtc` does not: this module
does that, with CuPy's include options (libcudacxx, the fp16/bf16 headers) plus `pagedkv/gpu`
for `pagedkv_common.cuh`. CI uses it to compile every variant for sm_80 and sm_90; the loader
uses it to build the cubin for the device at hand. Always a cubin, never PTX: NVRTC 13.5 emits PTX
that an older driver may refuse.

The image is read with the size `nvrtcGetCUBINSize` reports (through ctypes, on the library
CuPy already loaded): CuPy's `getCUBIN` treats the image as a C string and drops its last byte,
which cuts the ELF program header table (`cuobjdump` and `nvdisasm` reject such a file).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.gpu.cubin_image import check_cubin
from pagedkv.gpu.errors import DeviceUnavailableError, KernelCompileError
from pagedkv.gpu.kernel_variants import KernelSource
from pagedkv.gpu.ptxas_usage import KernelUsage, parse_ptxas_log

KERNEL_DIR = Path(__file__).resolve().parent
"""Where the `.cu` and `.cuh` files live (installed as package data next to this module)."""

BASE_OPTIONS: tuple[str, ...] = ("--std=c++17", "-default-device", "--ptxas-options=-v")
"""`-v`: ptxas writes each kernel's registers and spills into the log (`ptxas_usage`)."""


@dataclass(frozen=True)
class CompiledModule:
    """A cubin and the mangled name of each instantiation in it.

    Attributes:
        source: what was compiled.
        arch: the compute capability, e.g. 90 for sm_90.
        cubin: the ELF image.
        lowered_names: name expression -> mangled symbol.
        log: NVRTC's log (warnings and ptxas' resource report).
        usage: mangled symbol -> registers and spills, from the log.
    """

    source: KernelSource
    arch: int
    cubin: bytes
    lowered_names: dict[str, str]
    log: str
    usage: dict[str, KernelUsage]


def source_text(source: KernelSource) -> str:
    """The full text NVRTC compiles: the file and the generated tail. Complexity: O(size)."""
    return (KERNEL_DIR / source.file_name).read_text() + source.extra_source


def compile_options(arch: int) -> tuple[str, ...]:
    """NVRTC options for `arch`: CuPy's include paths, ours, and a real-arch (cubin) target.

    Raises:
        DeviceUnavailableError: cupy is not installed.
    """
    try:
        from cupy._core.core import assemble_cupy_compiler_options
    except ImportError as error:  # pragma: no cover - cupy is in the dev install
        raise DeviceUnavailableError(f"compiling kernels needs cupy: {error}") from error
    options = tuple(assemble_cupy_compiler_options(BASE_OPTIONS))
    return (*options, f"-I{KERNEL_DIR}", f"-arch=sm_{arch}")


CACHE_FORMAT = 2
"""Bumped when the cached bytes change meaning: 2 = cubins read with their exact size."""


def cache_key(source: KernelSource, arch: int) -> str:
    """A hash of everything that decides the cubin: texts, options, NVRTC version, format.

    Complexity: O(total source size).
    """
    from cupy_backends.cuda.libs import nvrtc

    digest = hashlib.sha256()
    digest.update(f"pagedkv cubin cache format {CACHE_FORMAT}".encode())
    digest.update(source_text(source).encode())
    for header in sorted(KERNEL_DIR.glob("*.cuh")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    digest.update(repr((source.name_expressions, compile_options(arch))).encode())
    digest.update(repr(nvrtc.getVersion()).encode())
    return digest.hexdigest()[:32]


def _nvrtc_library(nvrtc: Any) -> ctypes.CDLL:
    """The libnvrtc CuPy's binding already loaded (same soname, so the same program handles)."""
    major = nvrtc.getVersion()[0]
    try:
        return ctypes.CDLL(f"libnvrtc.so.{major}", mode=os.RTLD_NOLOAD)
    except OSError as error:  # pragma: no cover - the binding loaded it moments ago
        raise DeviceUnavailableError(f"libnvrtc.so.{major} is not loaded: {error}") from error


def read_cubin(nvrtc: Any, program: int) -> bytes:
    """The program's cubin, `nvrtcGetCUBINSize` bytes long (CuPy's `getCUBIN` drops one).

    Raises:
        KernelCompileError: NVRTC reports an error, or the image is not a whole cubin.
    """
    library = _nvrtc_library(nvrtc)
    size = ctypes.c_size_t()
    status = library.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size))
    if status != 0:
        raise KernelCompileError(f"nvrtcGetCUBINSize failed with status {status}")
    buffer = ctypes.create_string_buffer(size.value)
    status = library.nvrtcGetCUBIN(ctypes.c_void_p(program), buffer)
    if status != 0:
        raise KernelCompileError(f"nvrtcGetCUBIN failed with status {status}")
    return buffer.raw


def compile_source(source: KernelSource, arch: int) -> CompiledModule:
    """Compile `source` for sm_`arch` to a cubin, with every name expression instantiated.

    Args:
        source: the translation unit.
        arch: compute capability as an int (80, 90, ...).

    Returns:
        The cubin and the lowered name of each expression.

    Raises:
        KernelCompileError: NVRTC rejected the source or the arch; the message holds its log.
        DeviceUnavailableError: cupy (and so NVRTC's binding) is not installed.
    """
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as error:  # pragma: no cover - cupy is in the dev install
        raise DeviceUnavailableError(f"compiling kernels needs cupy: {error}") from error
    if arch not in nvrtc.getSupportedArchs():
        raise KernelCompileError(
            f"NVRTC {nvrtc.getVersion()} cannot target sm_{arch}; "
            f"supported: {nvrtc.getSupportedArchs()}"
        )
    program = nvrtc.createProgram(source_text(source), source.file_name, [], [])
    try:
        for name in source.name_expressions:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, list(compile_options(arch)))
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(
                f"{source.file_name} for sm_{arch} failed to compile: {error}\n{log}"
            ) from error
        lowered = {name: nvrtc.getLoweredName(program, name) for name in source.name_expressions}
        cubin = read_cubin(nvrtc, program)
        check_cubin(cubin, f"{source.file_name} for sm_{arch}")
        log = nvrtc.getProgramLog(program)
        return CompiledModule(
            source=source,
            arch=arch,
            cubin=cubin,
            lowered_names=lowered,
            log=log,
            usage=parse_ptxas_log(log),
        )
    finally:
        nvrtc.destroyProgram(program)
