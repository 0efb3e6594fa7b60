"""Reading `cuobjdump -sass` listings (`pagedkv.gpu.sass_count`) on hand-written listings.

The real kernels' counts and budgets are in tests/test_gpu_compile.py; these pin the rules:
which backward branch is the hot loop, what is not a loop, and what the count refuses.
"""

from __future__ import annotations

import pytest

from pagedkv.gpu.errors import KernelCompileError
from pagedkv.gpu.sass_count import hot_loop, instructions_per_key, loops, parse_sass


def _listing(*functions: tuple[str, list[str]]) -> str:
    lines = ["\tcode for sm_90"]
    for name, code in functions:
        lines.append(f"\t\tFunction : {name}")
        lines += [f"        /*{16 * i:04x}*/   {text} ;   /* 0x0 */" for i, text in enumerate(code)]
    return "\n".join(lines) + "\n"


KERNEL = [
    "MOV R1, c[0x0][0x28]",  # 0x00
    "LDSM.16.M88.4 R4, [R2]",  # 0x10: the loop starts here
    "HMMA.16816.F32.BF16 R8, R4, R6, R8",
    "@!UPT UIADD3 URZ, URZ, URZ, URZ",
    "BAR.SYNC.DEFER_BLOCKING 0x0",
    "BRA.DIV UR4, 0x80",  # 0x50: to the divergence handler after EXIT
    "@P0 BRA 0x10",  # 0x60: the loop's back edge
    "EXIT",  # 0x70
    "WARPSYNC.ALL",  # 0x80: the handler
    "BRA 0x50",  # 0x90: back into the loop: not a loop of its own
]


def test_the_hot_loop_is_the_back_edge_around_the_mmas_and_a_handler_is_not_a_loop() -> None:
    code = parse_sass(_listing(("k", KERNEL), ("other", ["EXIT"])))["k"]
    assert [i.opcode for i in code[:3]] == ["MOV", "LDSM", "HMMA"]
    assert code[6].branch_target == 0x10 and code[4].branch_target is None
    assert len(loops(code)) == 1
    loop = hot_loop(code)
    assert (loop.instructions[0].address, loop.instructions[-1].address) == (0x10, 0x60)
    assert (len(loop), loop.count("HMMA"), loop.count("BAR")) == (6, 1, 1)
    assert instructions_per_key(loop, warps=4, keys_per_iteration=32) == 6 * 4 / 32


def test_a_hot_loop_with_a_loop_inside_is_refused() -> None:
    nested = [*KERNEL[:3], "@P1 BRA 0x20", *KERNEL[4:]]  # an inner back edge to the HMMA
    with pytest.raises(KernelCompileError, match="trip count"):
        hot_loop(parse_sass(_listing(("k", nested)))["k"])
    with pytest.raises(KernelCompileError, match="no loop holds"):
        hot_loop(parse_sass(_listing(("k", KERNEL)))["k"], opcode="IMMA")
