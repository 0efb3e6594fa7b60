"""The one GPU check: copy bandwidth, every kernel variant against the reference, decode table.

    python -m pagedkv.gpu.check --out DIR            # on a machine with a CUDA device
    python -m pagedkv.gpu.check --out DIR --dry-run  # anywhere: plans, shapes, reference checks

In one run, on the device, cheapest first: (1) the device-to-device copy rate; (2) the write
kernel's bandwidth; (3) every kernel variant (dtype x head size x block size x batch kind)
against the float64 reference within the per-element bound of `pagedkv.gpu.error_bound`, and
the write kernel bit for bit against the reference write, all on NaN-poisoned caches; (4) the
decode bandwidth table (batch 1/8/64 x context 512/4096/32768, bf16, head size 128, 32 query /
8 KV heads, block size 16, block tables a random permutation of the pool): every cell's output
is first checked against the reference the same way, then timed with L2 flushed by a read (no
dirty lines left to write back inside the timed kernel): achieved GB/s, % of the copy rate,
speed-up over torch gather + SDPA. Times are CUDA-event medians. Results go to DIR/check.json
and DIR/check.txt at the end and, with `--jsonl FILE`, to FILE one line per result as it is
measured; `--time-limit S` stops before a decode cell that would end past S seconds (the run
then counts as aborted, with every finished cell kept).

Exit status: 0 all checks passed and every target met; 1 a correctness check failed or the run
aborted; 2 correct, but a target missed (batch 64 x 4096 decode below `TARGET_FRACTION` of the
copy rate).

`--dry-run` needs no device: it checks dense SDPA (fp32, rounded to the dtype) against the
float64 reference within the same bound for every correctness case (CPU, smaller: the bound
admits an independent correct fp32 implementation), plans every table cell (work items,
splits, bytes) for an H200, and writes the same report with the timings left empty.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.gpu.attention_metadata import validate_metadata
from pagedkv.gpu.attention_plan import H200, AttentionPlan, DeviceLimits, plan_attention
from pagedkv.gpu.error_bound import compare_to_reference
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    ATTENTION_KERNELS,
    CHECKED_BLOCK_SIZES,
    HEAD_SIZES,
    MMA_DTYPES,
    AttentionKernel,
    attention_traits,
)
from pagedkv.gpu.reference import ReferenceTerms, reference_attention_terms
from pagedkv.gpu.result_log import Record, ResultLog, discard
from pagedkv.gpu.synthetic_batch import (
    BatchShape,
    batch_terms,
    dense_attention,
    make_batch,
    plan_batch,
)

if TYPE_CHECKING:
    import torch

DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (512, 4096, 32768)
DECODE_HEADS = (32, 8)
DECODE_HEAD_SIZE = 128
DECODE_BLOCK_SIZE = 16
SPIN_CYCLES = 2_000_000
"""GPU clock cycles (about 1 ms) of spin before each timed call: longer than launch overhead."""
TARGET_FRACTION = 0.80
"""Decode at batch 64 x context 4096 should reach this fraction of the copy rate (issue 15)."""
FLUSH_BYTES = 512 << 20
"""Read before each timed call: about 8x the H200's L2, so no line of the last call stays."""


@dataclass(frozen=True)
class Case:
    """One correctness case: a batch kind for one kernel variant."""

    name: str
    kernel: AttentionKernel
    dtype: str
    head_size: int
    block_size: int
    shape: BatchShape
    num_splits: int | None = None

    @property
    def default_kernel(self) -> bool:
        """Whether `plan_step` picks this kernel for this dtype by itself."""
        return attention_traits(self.dtype, self.head_size).kernel == self.kernel


def batch_kinds(
    head_size: int, block_size: int, small: bool
) -> list[tuple[str, BatchShape, int | None]]:
    """The batch kinds every variant is checked on: (name, shape, forced splits)."""
    scale = 1 if small else 4
    common = {"head_size": head_size, "block_size": block_size}
    return [
        (
            "decode",
            BatchShape((1, 1, 1, 1), (1, 17 * scale, 64 * scale + 3, 5), 8, 2, **common),
            None,
        ),
        (
            "decode-split",
            BatchShape((1, 1), (300 * scale, 33), 8, 2, **common),
            4,
        ),
        (
            "chunked-prefill",
            BatchShape((7, 1, 16 * scale, 3), (40 * scale, 9, 16 * scale, 50), 8, 2, **common),
            None,
        ),
        (
            "prefill",
            BatchShape((37 * scale, 5), (37 * scale, 5), 4, 4, **common),
            None,
        ),
        (
            "sliding-window",
            BatchShape((1, 9, 1), (70 * scale, 30 * scale, 5), 8, 2, **common, sliding_window=19),
            None,
        ),
        (
            "gqa-16-split",
            BatchShape((2, 1), (90 * scale, 40), 16, 1, **common),
            3,
        ),
    ]


def correctness_cases(small: bool) -> list[Case]:
    """Every (kernel, dtype, head size, block size, batch kind): both kernels for fp16/bf16."""
    return [
        Case(
            f"{kernel}/{dtype}/D{head}/B{block}/{kind}",
            kernel,
            dtype,
            head,
            block,
            shape,
            splits,
        )
        for kernel in ATTENTION_KERNELS
        for dtype in ATTENTION_DTYPES
        if kernel == "simt" or dtype in MMA_DTYPES
        for head in HEAD_SIZES
        for block in CHECKED_BLOCK_SIZES
        for kind, shape, splits in batch_kinds(head, block, small)
    ]


@dataclass
class Report:
    """Everything the run measured or checked; written as JSON and as text."""

    mode: str
    environment: dict[str, Any] = field(default_factory=dict)
    copy_gbps: float | None = None
    correctness: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    write: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    @property
    def failures(self) -> list[str]:
        """Correctness failures (and an aborted run): exit status 1."""
        failed = [case["name"] for case in self.correctness if not case["passed"]]
        failed += [
            f"decode {row['batch']}x{row['context']}"
            for row in self.decode
            if row.get("correct") is False
        ]
        return [*failed, "run aborted"] if self.error else failed

    @property
    def missed_targets(self) -> list[str]:
        """Performance targets measured and missed: exit status 2 when nothing failed."""
        target = next((r for r in self.decode if (r["batch"], r["context"]) == (64, 4096)), None)
        if target is None or target["pct_of_copy"] is None:
            return []
        if target["pct_of_copy"] >= 100 * TARGET_FRACTION:
            return []
        return [
            f"decode 64x4096 at {target['pct_of_copy']:.1f}% of the copy rate, "
            f"target {100 * TARGET_FRACTION:.0f}%"
        ]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def decode_shape(batch: int, context: int) -> BatchShape:
    """One decode table cell's step."""
    return BatchShape(
        query_lens=(1,) * batch,
        seq_lens=(context,) * batch,
        num_heads=DECODE_HEADS[0],
        num_kv_heads=DECODE_HEADS[1],
        head_size=DECODE_HEAD_SIZE,
        block_size=DECODE_BLOCK_SIZE,
    )


def decode_bytes(plan: AttentionPlan, elem: int = 2) -> int:
    """Bytes a decode call must move: KV read + q + out + the block-table pages read."""
    kv = plan.kv_tokens_read * plan.num_kv_heads * plan.head_size * 2 * elem
    tokens = plan.metadata.num_query_tokens
    q_and_out = 2 * tokens * plan.num_heads * plan.head_size * elem
    pages = int(sum(-(-s // plan.metadata.block_size) for s in plan.metadata.seq_lens.tolist()))
    metadata = 4 * pages + 4 * (2 * plan.metadata.num_seqs + 1)
    return kv + q_and_out + metadata


def plan_decode_cell(batch: int, context: int, limits: DeviceLimits) -> AttentionPlan:
    """Validate and plan one table cell from its shape alone (no tensors)."""
    import numpy as np

    pages = -(-context // DECODE_BLOCK_SIZE)
    metadata = validate_metadata(
        np.arange(batch + 1, dtype=np.int32),
        np.full(batch, context, dtype=np.int32),
        np.arange(batch * pages, dtype=np.int32).reshape(batch, pages) + 1,
        block_size=DECODE_BLOCK_SIZE,
        num_blocks=batch * pages + 1,
        num_query_rows=batch,
    )
    return plan_attention(
        metadata,
        num_heads=DECODE_HEADS[0],
        num_kv_heads=DECODE_HEADS[1],
        head_size=DECODE_HEAD_SIZE,
        dtype="bfloat16",
        limits=limits,
    )


# ---------------------------------------------------------------------------------------------
# Dry run: no device.


def dry_run(report: Report, record: Record = discard) -> None:
    """Dense SDPA within the bound for every case (CPU, small), plans and bytes for the table;
    each result goes to `record` as it is made."""
    import torch

    report.environment = {"device": "none (dry run)", "torch": torch.__version__}
    record({"kind": "environment", **report.environment})
    tokens, heads = write_shape()
    report.write = {"tokens": tokens, "bytes": write_bytes(tokens, heads), "us": None, "gbps": None}
    record({"kind": "write", **report.write})
    for case in correctness_cases(small=True):
        if not case.default_kernel:
            continue  # the reference and its bound do not depend on the kernel
        batch = make_batch(case.shape, dtype=_torch_dtype(case.dtype), seed=len(report.correctness))
        sdpa = dense_attention(batch).to(batch.query.dtype)
        result = _compare(case, sdpa, batch_terms(batch), "SDPA (fp32) vs float64 reference")
        report.correctness.append(result)
        record({"kind": "correctness", **result})
    for batch_size in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            plan = plan_decode_cell(batch_size, context, H200)
            report.decode.append(_decode_row(batch_size, context, plan, None, None, None))
            record({"kind": "decode", **report.decode[-1]})


def _compare(case: Case, out: torch.Tensor, terms: ReferenceTerms, what: str) -> dict[str, Any]:
    return {"name": case.name, "check": what} | compare_to_reference(out, terms, case.dtype)


def _decode_row(
    batch: int,
    context: int,
    plan: AttentionPlan,
    kernel_us: float | None,
    baseline_us: float | None,
    copy_gbps: float | None,
    checks: dict[str, dict[str, Any]] | None = None,
    simt_us: float | None = None,
) -> dict[str, Any]:
    """One table row; the timed kernel is the plan's (tensor cores for bf16), `simt_us` the
    SIMT kernel's time on the same cell for comparison, `checks` each kernel's output check."""
    moved = decode_bytes(plan)
    gbps = moved / kernel_us / 1e3 if kernel_us else None
    return {
        "batch": batch,
        "context": context,
        "kernel": plan.traits.kernel,
        "correct": None if checks is None else all(c["passed"] for c in checks.values()),
        "checks": checks,
        "bytes": moved,
        "num_splits": plan.num_splits,
        "ctas": plan.num_work * plan.num_kv_heads * plan.num_splits,
        "kernel_us": kernel_us,
        "gbps": gbps,
        "pct_of_copy": 100 * gbps / copy_gbps if gbps and copy_gbps else None,
        "simt_us": simt_us,
        "baseline_us": baseline_us,
        "speedup": baseline_us / kernel_us if kernel_us and baseline_us else None,
    }


def write_shape() -> tuple[int, int]:
    """Tokens and KV heads of the write-bandwidth test (head size 128, bf16)."""
    return 65536, DECODE_HEADS[1]


def write_bytes(tokens: int, heads: int, elem: int = 2) -> int:
    """K and V read once and written once, plus the int64 slot of each token."""
    return 2 * 2 * tokens * heads * DECODE_HEAD_SIZE * elem + 8 * tokens


# ---------------------------------------------------------------------------------------------
# Device run.


def time_cuda(
    fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None
) -> float:
    """Median microseconds of `fn` over `repeats` CUDA-event-timed calls (after one warm-up).

    `before` runs ahead of each timed call, outside the timed span (an L2 flush). A GPU-side
    spin (`torch.cuda._sleep`) keeps the stream busy while the host enqueues the start event,
    `fn`'s launches and the end event, so host launch overhead stays out of the measurement.
    """
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3)
    return statistics.median(times)


def measure_copy(num_bytes: int, repeats: int) -> float:
    """Device-to-device copy rate in GB/s (bytes read + bytes written per second)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / us / 1e3


def device_correctness(report: Report, record: Record = discard) -> None:
    """Every case: write kernel vs reference write (bitwise), attention kernel vs reference;
    each result to `record` as it is measured."""
    import torch

    from pagedkv.gpu.attention import paged_attention
    from pagedkv.gpu.kv_write import write_kv
    from pagedkv.gpu.reference import reference_write_kv

    for index, case in enumerate(correctness_cases(small=False)):
        batch = make_batch(case.shape, dtype=_torch_dtype(case.dtype), device="cuda", seed=index)
        keys, values = torch.cat(batch.keys), torch.cat(batch.values)
        caches = [torch.full_like(batch.key_cache, float("nan")) for _ in range(4)]
        write_kv(keys, values, caches[0], caches[1], batch.slot_mapping)
        reference_write_kv(keys, values, caches[2], caches[3], batch.slot_mapping)
        same = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in ((caches[0], caches[2]), (caches[1], caches[3]))
        )
        written = {"name": case.name, "check": "write kernel vs reference", "passed": same}
        report.correctness.append(written)
        record({"kind": "correctness", **written})
        plan = plan_batch(batch, num_splits=case.num_splits, kernel=case.kernel)
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, plan)
        torch.cuda.synchronize()
        result = _compare(case, out, batch_terms(batch), "attention kernel vs float64 reference")
        result["num_splits"] = plan.num_splits
        report.correctness.append(result)
        record({"kind": "correctness", **result})


def _baseline(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
) -> Callable[[], object]:
    """torch gather + SDPA: copy the pages densely, then attend (what a paged kernel saves)."""
    import torch.nn.functional as F  # noqa: N812 - the usual name

    batch, pages = block_table.shape
    blocks = block_table.long()
    q = query.view(batch, query.shape[1], 1, query.shape[2])
    dense = (batch, pages * k_cache.shape[1], *k_cache.shape[2:])

    def run() -> object:
        k = k_cache[blocks].view(dense).transpose(1, 2)
        v = v_cache[blocks].view(dense).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def l2_flush() -> Callable[[], object]:
    """A callable that evicts L2 by reading `FLUSH_BYTES` (a max reduction writes 4 bytes).

    A memset would leave the L2 full of dirty lines whose write-back lands inside the next
    timed kernel; a read leaves clean lines, and any dirty line of the previous call is
    written back during the flush, outside the timed span.
    """
    import torch

    buffer = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    return lambda: torch.amax(buffer)


def _time_decode_cell(
    caches: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    context: int,
    limits: DeviceLimits,
    repeats: int,
    flush: Callable[[], object],
) -> dict[str, Any]:
    """Plan one cell for both kernels, check each output against the float64 reference, then
    time both kernels and the baseline (baseline None: out of memory)."""
    import torch

    from pagedkv.gpu.attention import paged_attention, plan_step

    k_cache, v_cache = caches
    batch = table.shape[0]
    heads = (DECODE_HEADS[0], DECODE_HEAD_SIZE)
    query = torch.randn((batch, *heads), dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    plans = {
        kernel: plan_step(query, k_cache, starts, lens, table, limits=limits, kernel=kernel)
        for kernel in ATTENTION_KERNELS
    }
    terms = reference_attention_terms(query, k_cache, v_cache, starts, lens, table)
    checks, times = {}, {}
    for kernel, plan in plans.items():
        out = torch.full_like(query, float("nan"))

        def call(plan: AttentionPlan = plan, out: torch.Tensor = out) -> object:
            return paged_attention(query, k_cache, v_cache, plan, out=out)

        call()
        checks[kernel] = compare_to_reference(out, terms, "bfloat16")
        times[kernel] = time_cuda(call, repeats, before=flush)
    del terms
    baseline = _baseline(query, k_cache, v_cache, table)
    try:
        baseline_us: float | None = time_cuda(baseline, max(3, repeats // 2), before=flush)
    except torch.OutOfMemoryError:
        baseline_us = None  # the dense copies of the largest cell did not fit: no speed-up
    return {
        "plan": plans["mma"],
        "kernel_us": times["mma"],
        "simt_us": times["simt"],
        "checks": checks,
        "baseline_us": baseline_us,
    }


def device_decode_table(
    report: Report,
    limits: DeviceLimits,
    repeats: int,
    record: Record = discard,
    deadline: float | None = None,
) -> None:
    """The decode table on one pool sized for the largest cell (random page permutations),
    each row to `record` as it is measured. With a `deadline` (time.monotonic()), a cell that
    would end past it (by the longest cell so far) is not started: report.error says so."""
    import torch

    assert report.copy_gbps is not None
    num_blocks = 1 + max(DECODE_BATCHES) * -(-max(DECODE_CONTEXTS) // DECODE_BLOCK_SIZE)
    shape = (num_blocks, DECODE_BLOCK_SIZE, DECODE_HEADS[1], DECODE_HEAD_SIZE)
    caches = (
        torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
        torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
    )
    flush = l2_flush()
    permutation = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1
    longest = 0.0
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            if deadline is not None and time.monotonic() + longest > deadline:
                report.error = f"time limit: the decode table stopped before {batch}x{context}"
                record({"kind": "decode", "batch": batch, "context": context, "stopped": True})
                return
            started = time.monotonic()
            pages = -(-context // DECODE_BLOCK_SIZE)
            table = permutation[: batch * pages].view(batch, pages).contiguous()
            cell = _time_decode_cell(caches, table, context, limits, repeats, flush)
            report.decode.append(
                _decode_row(
                    batch,
                    context,
                    cell["plan"],
                    cell["kernel_us"],
                    cell["baseline_us"],
                    report.copy_gbps,
                    cell["checks"],
                    cell["simt_us"],
                )
            )
            record({"kind": "decode", **report.decode[-1]})
            torch.cuda.empty_cache()  # the reference's and the baseline's dense copies
            longest = max(longest, time.monotonic() - started)


def device_write_bandwidth(report: Report, repeats: int, record: Record = discard) -> None:
    """The write kernel moving 65,536 tokens into a random permutation of a pool's slots."""
    import torch

    from pagedkv.gpu.kv_write import write_kv

    tokens, heads = write_shape()
    num_blocks = 2 * tokens // DECODE_BLOCK_SIZE
    shape = (num_blocks, DECODE_BLOCK_SIZE, heads, DECODE_HEAD_SIZE)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn((tokens, heads, DECODE_HEAD_SIZE), dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * DECODE_BLOCK_SIZE, device="cuda")[:tokens].contiguous()
    us = time_cuda(
        lambda: write_kv(key, value, k_cache, v_cache, slots, check_slots_on_host=False),
        repeats,
        before=l2_flush(),
    )
    moved = write_bytes(tokens, heads)
    report.write = {"tokens": tokens, "bytes": moved, "us": us, "gbps": moved / us / 1e3}
    if report.copy_gbps:
        report.write["pct_of_copy"] = 100 * report.write["gbps"] / report.copy_gbps
    record({"kind": "write", **report.write})


def device_run(
    report: Report, repeats: int, record: Record = discard, deadline: float | None = None
) -> None:
    """Environment, copy rate, write bandwidth, correctness, decode table (the slowest, last),
    each result to `record` as it is measured; `deadline` as `device_decode_table`'s."""
    import cupy
    import torch

    from pagedkv.gpu.attention import device_limits

    properties = torch.cuda.get_device_properties(0)
    limits = device_limits(0)
    report.environment = {
        "device": properties.name,
        "sms": limits.num_sms,
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "compute_capability": cupy.cuda.Device(0).compute_capability,
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "driver": cupy.cuda.runtime.driverGetVersion(),
    }
    record({"kind": "environment", **report.environment})
    report.copy_gbps = measure_copy(1 << 30, repeats)
    record({"kind": "copy", "gbps": report.copy_gbps})
    device_write_bandwidth(report, repeats, record)
    device_correctness(report, record)
    device_decode_table(report, limits, repeats, record, deadline)


# ---------------------------------------------------------------------------------------------
# Report.


def _fmt(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`, or "n/a" padded to the spec's width."""
    width = spec.split(".", maxsplit=1)[0]
    text = "n/a" if value is None else format(value, spec)
    return text.rjust(int(width)) if width else text


def format_report(report: Report) -> str:
    """The human-readable report."""
    lines = [f"pagedkv GPU check ({report.mode})", ""]
    if report.error:
        lines += ["ABORTED (partial results below):", report.error]
    lines += [f"  {key}: {value}" for key, value in report.environment.items()]
    lines += ["", f"device copy rate: {_fmt(report.copy_gbps, '.0f')} GB/s", ""]
    passed = sum(case["passed"] for case in report.correctness)
    lines.append(f"correctness: {passed}/{len(report.correctness)} passed")
    for case in report.correctness:
        if not case["passed"]:
            lines.append(f"  FAIL {case['name']} ({case['check']}): {case}")
    lines += [
        "",
        f"decode, bf16, D={DECODE_HEAD_SIZE}, {DECODE_HEADS[0]} q / {DECODE_HEADS[1]} kv heads, "
        f"block {DECODE_BLOCK_SIZE}, L2 flushed, CUDA-event medians; us, GB/s and %copy are the "
        f"tensor-core kernel's, simt us the SIMT kernel's on the same cell",
        f"{'batch':>5} {'context':>7} {'MB':>9} {'splits':>6} {'CTAs':>6} {'output':>7} "
        f"{'us':>9} {'GB/s':>7} {'%copy':>6} {'simt us':>9} {'torch us':>9} {'speedup':>7}",
    ]
    verdicts = {None: "n/a", True: "ok", False: "WRONG"}
    for row in report.decode:
        lines.append(
            f"{row['batch']:>5} {row['context']:>7} {row['bytes'] / 1e6:>9.1f} "
            f"{row['num_splits']:>6} {row['ctas']:>6} {verdicts[row['correct']]:>7} "
            f"{_fmt(row['kernel_us'], '9.1f')} {_fmt(row['gbps'], '7.0f')} "
            f"{_fmt(row['pct_of_copy'], '6.1f')} {_fmt(row['simt_us'], '9.1f')} "
            f"{_fmt(row['baseline_us'], '9.1f')} "
            f"{_fmt(row['speedup'], '7.2f')}"
        )
    target = next((r for r in report.decode if (r["batch"], r["context"]) == (64, 4096)), None)
    if target is not None and target["pct_of_copy"] is not None:
        verdict = "meets" if not report.missed_targets else "MISSES"
        lines.append(
            f"target: batch 64 x 4096 at {target['pct_of_copy']:.1f}% of copy rate {verdict} "
            f"the {100 * TARGET_FRACTION:.0f}% target"
        )
    write = report.write
    lines += [
        "",
        f"write kernel: {write.get('tokens')} tokens, {write.get('bytes', 0) / 1e6:.1f} MB, "
        f"{_fmt(write.get('us'), '.1f')} us, {_fmt(write.get('gbps'), '.0f')} GB/s "
        f"({_fmt(write.get('pct_of_copy'), '.1f')}% of copy)",
        "",
        f"total {report.seconds:.1f} s",
    ]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """Write check.json and check.txt under `out_dir` (created); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, text_path = out_dir / "check.json", out_dir / "check.txt"
    payload = asdict(report) | {
        "failures": report.failures,
        "missed_targets": report.missed_targets,
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    text_path.write_text(format_report(report))
    return json_path, text_path


def _jsonl_record(path: Path) -> Record:
    """A `Record` appending to `path` (a `ResultLog`), each result tagged step "check"."""
    log = ResultLog(path)

    def record(result: dict[str, Any]) -> None:
        log({"step": "check", **result})

    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return the exit status: 1 a correctness check failed or the run aborted,
    2 everything correct but a target missed, 0 otherwise.

    An exception (a CUDA fault, say) ends the run but not the report: what was measured so far
    is written with the traceback.
    """
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.gpu.check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for check.json/.txt")
    parser.add_argument("--dry-run", action="store_true", help="no device: plans and reference")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--jsonl", type=Path, help="append each result to this file as measured")
    parser.add_argument("--time-limit", type=float, help="seconds: start no decode cell past it")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    deadline = time.monotonic() + args.time_limit if args.time_limit is not None else None
    record = _jsonl_record(args.jsonl) if args.jsonl is not None else discard
    report = Report(mode="dry run" if args.dry_run else "device")
    try:
        if args.dry_run:
            dry_run(report, record)
        else:
            device_run(report, args.repeats, record, deadline)
    except Exception:  # keep what was measured; the traceback goes in the report
        report.error = traceback.format_exc()
        record({"kind": "error", "error": report.error})
    report.seconds = time.perf_counter() - started
    json_path, text_path = write_report(report, args.out)
    sys.stdout.write(format_report(report))
    sys.stdout.write(f"wrote {json_path} and {text_path}\n")
    if report.failures:
        return 1
    return 2 if report.missed_targets else 0


if __name__ == "__main__":
    sys.exit(main())
