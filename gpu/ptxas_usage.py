"""Per-kernel resource usage as ptxas reports it (`--ptxas-options=-v` in the NVRTC log), and
as a cubin lists it (`cuobjdump -res-usage`, for a cubin whose compile log is gone).

CI reads it to keep every kernel variant free of register spills (a spill turns the hot loop's
register traffic into local-memory traffic, which the bandwidth estimates do not count), and
feeds the registers and static shared memory to `occupancy.ctas_per_sm`.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pagedkv.gpu.cubin_image import cuda_tool
from pagedkv.gpu.errors import KernelCompileError

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")
_RES_FUNCTION = re.compile(r"^\s*Function (\S+):")
_RES_FIELDS = re.compile(r"REG:(\d+) .*SHARED:(\d+)")
RESERVED_SHARED_IN_CUBIN = {90: 1024}
"""Bytes of the per-CTA system reservation a cubin of that arch lists as SHARED (sm_90 cubins
do; sm_80 ones list static shared memory only): `cubin_resources` subtracts them."""


@dataclass(frozen=True)
class KernelUsage:
    """One entry function's resources on one arch.

    Attributes:
        symbol: the mangled name.
        arch: compute capability (90 for sm_90).
        registers: registers per thread.
        stack_bytes: stack frame per thread.
        spill_store_bytes: bytes of registers spilled to local memory.
        spill_load_bytes: bytes reloaded from the spills.
        static_shared_bytes: `__shared__` memory per CTA (dynamic shared memory comes on top).
    """

    symbol: str
    arch: int
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_shared_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def parse_ptxas_log(log: str) -> dict[str, KernelUsage]:
    """Every entry function's usage found in an NVRTC/ptxas verbose log, by mangled name.

    Complexity: O(len(log)).
    """
    usage: dict[str, KernelUsage] = {}
    symbol: str | None = None
    arch = 0
    frame: tuple[int, int, int] | None = None
    for line in log.splitlines():
        if entry := _ENTRY.search(line):
            symbol, arch, frame = entry.group(1), int(entry.group(2)), None
        elif symbol is not None and (match := _FRAME.search(line)):
            frame = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        elif symbol is not None and frame is not None and (match := _REGISTERS.search(line)):
            shared = _SHARED.search(line)
            static = int(shared.group(1)) if shared else 0
            usage[symbol] = KernelUsage(symbol, arch, int(match.group(1)), *frame, static)
            symbol = None
    return usage


def cubin_resources(cubin: Path, arch: int) -> dict[str, tuple[int, int]]:
    """Registers and static shared memory of every function of a cubin, by mangled name, from
    `cuobjdump -res-usage` (the SHARED it lists for sm_90 includes the 1 KiB reservation,
    subtracted here: see RESERVED_SHARED_IN_CUBIN).

    Raises:
        KernelCompileError: cuobjdump is not installed or refuses the file.
    """
    tool = cuda_tool("cuobjdump")
    if tool is None:
        raise KernelCompileError("reading resource usage needs cuobjdump")
    result = subprocess.run(
        [str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise KernelCompileError(f"cuobjdump -res-usage {cubin} failed: {result.stderr[-2000:]}")
    reserved = RESERVED_SHARED_IN_CUBIN.get(arch, 0)
    resources: dict[str, tuple[int, int]] = {}
    symbol = None
    for line in result.stdout.splitlines():
        if function := _RES_FUNCTION.match(line):
            symbol = function.group(1)
        elif symbol is not None and (fields := _RES_FIELDS.search(line)):
            resources[symbol] = (int(fields.group(1)), max(0, int(fields.group(2)) - reserved))
            symbol = None
    return resources
