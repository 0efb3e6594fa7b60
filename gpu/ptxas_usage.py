"""Per-kernel resource usage as ptxas reports it (`--ptxas-options=-v` in the NVRTC log).

CI reads it to keep every kernel variant free of register spills (a spill turns the hot loop's
register traffic into local-memory traffic, which the bandwidth estimates do not count), and
feeds the registers and static shared memory to `occupancy.ctas_per_sm`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")


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
