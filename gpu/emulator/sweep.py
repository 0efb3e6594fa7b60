"""The fuller emulator sweep, on demand: decode-table cells x kernels x thread orders.

    python -m pagedkv.gpu.emulator.sweep                  # the 8 cells below 2M keys, 2 seeds
    python -m pagedkv.gpu.emulator.sweep --cells 64x32768  # the largest (about 30 GB of RAM)

Each cell is the check's decode step (bf16, D=128, 32 q / 8 KV heads, block 16, the H200
plan's splits), drawn by `make_batch` and run through the exact kernel text on the emulator,
compared with the float64 reference within the dtype's bound. CI runs the six smallest cells
once (tests/test_gpu_emulator.py). Exit status 1 when any run fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from pagedkv.gpu.kernel_variants import ATTENTION_KERNELS

LARGEST_CELL = (64, 32768)


def run_cell(batch_size: int, context: int, kernel: str, seed: int) -> dict[str, object]:
    """One cell on the emulator with one kernel and thread order."""
    import torch

    from pagedkv.gpu.attention_plan import DeviceLimits
    from pagedkv.gpu.check import decode_shape
    from pagedkv.gpu.emulator.attention import emulate_paged_attention
    from pagedkv.gpu.error_bound import compare_to_reference
    from pagedkv.gpu.synthetic_batch import batch_terms, make_batch, plan_batch

    batch = make_batch(decode_shape(batch_size, context), dtype=torch.bfloat16, seed=context)
    plan = plan_batch(batch, limits=DeviceLimits(), kernel="mma" if kernel == "mma" else "simt")
    before = os.times()
    out = emulate_paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, seed=seed)
    after = os.times()
    result = compare_to_reference(out, batch_terms(batch), "bfloat16")
    return result | {
        "splits": plan.num_splits,
        "ctas": plan.num_work * plan.num_kv_heads * plan.num_splits,
        "emulator_cpu_s": (after.children_user + after.children_system)
        - (before.children_user + before.children_system),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; return 1 if any run failed."""
    from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS

    parser = argparse.ArgumentParser(prog="python -m pagedkv.gpu.emulator.sweep")
    parser.add_argument(
        "--cells", nargs="*", help="BATCHxCONTEXT, e.g. 8x4096 (default: all but the largest)"
    )
    parser.add_argument("--seeds", type=int, default=2, help="thread orders per cell and kernel")
    args = parser.parse_args(argv)
    if args.cells:
        cells = [tuple(int(part) for part in cell.split("x")) for cell in args.cells]
    else:
        cells = [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS if (b, c) != LARGEST_CELL]
    failed = 0
    for batch_size, context in cells:
        for kernel in ATTENTION_KERNELS:
            for seed in range(args.seeds):
                started = time.perf_counter()
                result = run_cell(batch_size, context, kernel, seed)
                failed += not result["passed"]
                sys.stdout.write(
                    f"{batch_size:>3} x {context:>6} {kernel:>4} seed {seed}: "
                    f"{'ok' if result['passed'] else 'FAILED'}  splits {result['splits']:>2}  "
                    f"CTAs {result['ctas']:>4}  error/bound {result['max_error_over_bound']:.3f}  "
                    f"emulator {result['emulator_cpu_s']:.1f} s CPU, "
                    f"{time.perf_counter() - started:.1f} s wall\n"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
