"""Run kernels in an emulator build on NumPy arrays: the launch file and the process.

    memory = EmulatedMemory()
    out = memory.add("out", numpy.zeros(...), writable=True)   # -> a Pointer to element 0
    run_launches(build, memory, [Launch(name, grid, block, smem, (out, numpy.int32(4), ...))])
    memory.arrays["out"]  # what the kernels wrote

Kernel arguments are the typed scalars the CuPy launcher passes (`numpy.int32`, `numpy.int64`,
`numpy.float32`) and `Pointer`s into the emulated arrays; the executable checks each against
the kernel's real parameter types. Each array lives in its own guarded region there.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.gpu.emulator.build import EmulatorBuild
from pagedkv.vocab.errors import PagedKVError


class EmulatorError(PagedKVError, RuntimeError):
    """The emulated kernel broke a rule or faulted (the message is the emulator's report)."""


@dataclass(frozen=True)
class Pointer:
    """A kernel pointer argument: an emulated array and a byte offset into it."""

    array: int
    offset: int = 0


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the name expression, grid, block, dynamic shared memory, arguments.

    Attributes:
        seed: seeds the CTA order and the thread order between synchronization points.
    """

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[Any, ...]
    seed: int = 0


@dataclass
class EmulatedMemory:
    """The arrays a run uses, in order; `add` returns the pointer to an array's first byte."""

    arrays: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    writable: set[str] = field(default_factory=set)

    def add(self, name: str, array: np.ndarray[Any, Any], *, writable: bool = False) -> Pointer:
        """Register a copy of `array` (C-contiguous) under `name`."""
        if name in self.arrays:
            raise ValueError(f"array {name!r} added twice")
        self.arrays[name] = np.ascontiguousarray(array).copy()
        if writable:
            self.writable.add(name)
        return Pointer(len(self.arrays) - 1)


def _encode(index: int, value: Any) -> str:
    if isinstance(value, Pointer):
        return f"p {value.array} {value.offset}"
    if isinstance(value, np.generic) and value.dtype.kind in "iuf" and value.dtype.itemsize <= 8:
        kind = "f" if value.dtype.kind == "f" else "i"
        raw = np.array(value).view(f"u{value.dtype.itemsize}")
        return f"{kind}{value.dtype.itemsize} {int(raw)}"
    raise TypeError(f"argument {index}: expected a Pointer or a NumPy scalar, got {value!r}")


def launch_text(memory: EmulatedMemory, launches: Sequence[Launch], directory: Path) -> str:
    """Write every array under `directory` and return the launch file's text."""
    lines = [str(len(memory.arrays))]
    for index, (name, array) in enumerate(memory.arrays.items()):
        path = directory / f"array{index}.bin"
        array.tofile(path)
        lines += [f"{array.nbytes} {int(name in memory.writable)} {path}", name]
    lines.append(str(len(launches)))
    for launch in launches:
        lines.append(launch.kernel)
        lines.append(
            " ".join(map(str, (*launch.grid, *launch.block, launch.shared_bytes, launch.seed)))
            + f" {len(launch.args)}"
        )
        lines += [_encode(i, arg) for i, arg in enumerate(launch.args)]
    return "\n".join(lines) + "\n"


def run_launches(
    build: EmulatorBuild, memory: EmulatedMemory, launches: Sequence[Launch], timeout: float = 600
) -> None:
    """Run `launches` in order in one emulator process; writable arrays are updated in place.

    Raises:
        EmulatorError: a fault, a deadlock, a divergent barrier or shuffle, a bad argument.
        KeyError: a launch names a kernel the build does not hold.
    """
    for launch in launches:
        if launch.kernel not in build.signatures:
            raise KeyError(f"{launch.kernel} is not in {build.executable}")
    with tempfile.TemporaryDirectory(prefix="pagedkv-emu-") as work:
        directory = Path(work)
        spec = directory / "launch.txt"
        spec.write_text(launch_text(memory, launches, directory))
        result = subprocess.run(
            [str(build.executable), str(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise EmulatorError(
                f"emulator exit status {result.returncode}:\n{result.stderr[-4000:]}".rstrip()
            )
        for index, (name, array) in enumerate(memory.arrays.items()):
            if name in memory.writable:
                data = np.fromfile(directory / f"array{index}.bin", dtype=array.dtype)
                memory.arrays[name] = data.reshape(array.shape)
