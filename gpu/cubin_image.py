"""What makes a byte string a whole cubin: the extent its own ELF headers declare.

A cubin is an ELF64 image whose section and program header tables (and every section with file
contents) lie inside the file. `image_extent` reads those headers and returns the byte count they
need; `check_cubin` rejects an image that is shorter or longer, or not an ELF64 CUDA image. It
caught the loader's old defect (CuPy's `getCUBIN` drops the last byte, which cuts the program
header table) without the CUDA tools, so the loader runs it on every cubin it writes or reads.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path

from pagedkv.gpu.errors import KernelCompileError

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
EM_CUDA = 190
SHT_NOBITS = 8
_HEADER_BYTES = 64


def image_extent(image: bytes) -> int:
    """Bytes the ELF headers of `image` say it spans (headers, tables, sections with data).

    Raises:
        KernelCompileError: not a little-endian ELF64 CUDA image, or a table runs past the end.

    Complexity: O(number of sections).
    """
    if len(image) < _HEADER_BYTES or not image.startswith(ELF_MAGIC):
        raise KernelCompileError(f"not an ELF image ({len(image)} bytes)")
    if image[4] != ELFCLASS64 or image[5] != ELFDATA2LSB:
        raise KernelCompileError("a cubin is a little-endian ELF64 image")
    (machine,) = struct.unpack_from("<H", image, 0x12)
    if machine != EM_CUDA:
        raise KernelCompileError(f"ELF machine {machine} is not EM_CUDA ({EM_CUDA})")
    ph_offset, sh_offset = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", image, 0x36)
    extent = max(_HEADER_BYTES, ph_offset + ph_count * ph_size, sh_offset + sh_count * sh_size)
    if sh_offset + sh_count * sh_size > len(image):
        raise KernelCompileError(
            f"the section header table ends at byte {sh_offset + sh_count * sh_size}, "
            f"the image has {len(image)}"
        )
    for index in range(sh_count):
        entry = sh_offset + index * sh_size
        (kind,) = struct.unpack_from("<I", image, entry + 4)
        offset, size = struct.unpack_from("<QQ", image, entry + 0x18)
        if kind != SHT_NOBITS:
            extent = max(extent, offset + size)
    return int(extent)


def check_cubin(image: bytes, what: str) -> None:
    """Reject `image` unless it is exactly the ELF64 CUDA image its headers describe.

    Args:
        image: the bytes.
        what: names the image in the error (a path or a source and arch).

    Raises:
        KernelCompileError: truncated, padded, or not a cubin.

    Complexity: O(number of sections).
    """
    try:
        extent = image_extent(image)
    except KernelCompileError as error:
        raise KernelCompileError(f"{what}: {error}") from error
    if extent != len(image):
        raise KernelCompileError(
            f"{what}: {len(image)} bytes, but its ELF headers span {extent}: "
            f"{'truncated' if extent > len(image) else 'trailing bytes'}"
        )


def cuda_tool(name: str) -> Path | None:
    """Where a CUDA binary tool (`cuobjdump`, `nvdisasm`, `ptxas`) is: PATH, then the
    `nvidia-cuda-*` wheels' `bin` folder, then `/usr/local/cuda/bin`; None if nowhere.

    Complexity: O(number of places searched).
    """
    found = shutil.which(name)
    if found:
        return Path(found)
    spec = importlib.util.find_spec("nvidia")  # the namespace package of the CUDA wheels
    locations = (spec.submodule_search_locations or []) if spec else []
    candidates = [Path(p) / "cu13" / "bin" / name for p in locations]
    candidates.append(Path("/usr/local/cuda/bin") / name)
    return next((path for path in candidates if path.is_file()), None)
