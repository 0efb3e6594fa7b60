"""Instructions a compiled kernel issues per key, counted in its SASS (`cuobjdump -sass`).

No device is needed: the decode kernel's cost is set by its main loop, and the loop is in the
cubin. `hot_loop` finds the loop that holds the kernel's MMA instructions (the backward branch
around them; the warp-divergence handlers after EXIT, which branch back into it, are not
loops); every instruction in it runs at most once per iteration and warp, so its length is an
upper bound on what one warp issues per iteration (the `@!UPT` no-ops ptxas inserts between
dependent MMAs count: they take issue slots too). With `keys` keys per iteration and `warps`
warps per CTA,

    warp instructions per key = loop length * warps / keys

which is what a CTA's schedulers must issue per key read (the README's bandwidth estimate turns
it into a fraction of the issue rate). A loop with another loop inside is refused: its inner
trip count is not in the listing.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pagedkv.gpu.cubin_image import cuda_tool
from pagedkv.gpu.errors import KernelCompileError

_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_BRANCH = re.compile(r"^BRA(?:\.\S+)?\s+(?:\S+,\s*)?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction.

    Attributes:
        address: its offset in the function.
        text: as cuobjdump prints it, predicate included, without the trailing `;`.
    """

    address: int
    text: str

    @property
    def opcode(self) -> str:
        """The mnemonic without predicate or modifiers (`HMMA`, `LDSM`, `BRA`, ...)."""
        return _PREDICATE.sub("", self.text).split(maxsplit=1)[0].split(".")[0]

    @property
    def branch_target(self) -> int | None:
        """Where a `BRA` goes, or None for any other instruction."""
        match = _BRANCH.match(_PREDICATE.sub("", self.text))
        return int(match.group(1), 16) if match else None


@dataclass(frozen=True)
class Loop:
    """The instructions from a backward branch's target to the branch, inclusive."""

    instructions: tuple[Instruction, ...]

    def count(self, opcode: str) -> int:
        """Instructions of one mnemonic in the loop. Complexity: O(len(loop))."""
        return sum(instruction.opcode == opcode for instruction in self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)


def parse_sass(listing: str) -> dict[str, tuple[Instruction, ...]]:
    """Every function of a `cuobjdump -sass` listing, by mangled name.

    Complexity: O(len(listing)).
    """
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in listing.splitlines():
        if function := _FUNCTION.search(line):
            current = functions.setdefault(function.group(1), [])
        elif current is not None and (match := _INSTRUCTION.search(line)):
            current.append(Instruction(int(match.group(1), 16), match.group(2)))
    return {name: tuple(code) for name, code in functions.items()}


def disassemble(cubin: Path) -> dict[str, tuple[Instruction, ...]]:
    """`cuobjdump -sass` of a cubin, parsed.

    Raises:
        KernelCompileError: cuobjdump is not installed or refuses the file.
    """
    tool = cuda_tool("cuobjdump")
    if tool is None:
        raise KernelCompileError("counting SASS needs cuobjdump (cuda-toolkit[cuobjdump])")
    result = subprocess.run(
        [str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=False, timeout=120
    )
    if result.returncode != 0:
        raise KernelCompileError(f"cuobjdump -sass {cubin} failed: {result.stderr[-2000:]}")
    return parse_sass(result.stdout)


def loops(code: tuple[Instruction, ...]) -> list[Loop]:
    """Every backward branch's body that holds no EXIT (an EXIT inside means a branch back from
    a handler placed after the kernel's end, not a loop), in address order.

    Complexity: O(len(code) * branches).
    """
    found = []
    for index, instruction in enumerate(code):
        target = instruction.branch_target
        if target is None or target > instruction.address:
            continue
        first = next(i for i, candidate in enumerate(code) if candidate.address >= target)
        body = code[first : index + 1]
        if not any(candidate.opcode == "EXIT" for candidate in body):
            found.append(Loop(body))
    return sorted(found, key=lambda loop: loop.instructions[0].address)


def hot_loop(code: tuple[Instruction, ...], opcode: str = "HMMA") -> Loop:
    """The loop holding the most `opcode` instructions (the MMAs of a decode kernel's main loop).

    Raises:
        KernelCompileError: no loop holds one, or the hot loop holds another loop.

    Complexity: O(len(code) * branches).
    """
    candidates = [loop for loop in loops(code) if loop.count(opcode)]
    if not candidates:
        raise KernelCompileError(f"no loop holds a {opcode} instruction")
    hot = max(candidates, key=lambda loop: loop.count(opcode))
    first, last = hot.instructions[0].address, hot.instructions[-1].address
    for loop in loops(code):
        inner = (loop.instructions[0].address, loop.instructions[-1].address)
        if inner != (first, last) and first <= inner[0] and inner[1] <= last:
            raise KernelCompileError(
                f"the hot loop [{first:#x}, {last:#x}] holds the loop [{inner[0]:#x}, "
                f"{inner[1]:#x}], whose trip count the listing does not give"
            )
    return hot


def instructions_per_key(loop: Loop, warps: int, keys_per_iteration: int) -> float:
    """Warp instructions a CTA issues per key: `len(loop) * warps / keys_per_iteration`.

    Complexity: O(1).
    """
    return len(loop) * warps / keys_per_iteration
