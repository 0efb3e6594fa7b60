"""Paged attention on the GPU: validate every array, then launch the kernel (and the merge).

    plan = plan_step(query, key_cache, query_start_loc, seq_lens, block_table)  # host checks
    out = paged_attention(query, key_cache, value_cache, plan)                   # launches only

`plan_step` copies the metadata to the host once (a synchronization) and validates it; a plan
is reused across layers and repeats. `paged_attention_varlen` does both in one call. Layout,
launch configuration and the split policy: gpu/README.md and `pagedkv.gpu.attention_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv.gpu.array_view import ArrayLike, ArrayView, describe
from pagedkv.gpu.attention_metadata import validate_metadata
from pagedkv.gpu.attention_plan import AttentionPlan, DeviceLimits, plan_attention
from pagedkv.gpu.kernel_loader import get_kernel, import_cupy
from pagedkv.gpu.kernel_variants import (
    ATTENTION_SOURCE,
    MERGE_PAIRS_PER_CTA,
    MERGE_THREADS,
    AttentionKernel,
    attention_kernel_name,
    attention_source,
    merge_kernel_name,
)
from pagedkv.gpu.launch import KernelCall, common_device, i32, i64, launch_context, pointer
from pagedkv.vocab.errors import InvalidArgumentError


def device_limits(device: int) -> DeviceLimits:
    """The split policy's view of CUDA device `device`.

    Raises:
        DeviceUnavailableError: no cupy or no device.
    """
    cupy = import_cupy()
    attributes = cupy.cuda.Device(device).attributes
    return DeviceLimits(
        num_sms=int(attributes["MultiProcessorCount"]),
        shared_memory_per_sm=int(attributes["MaxSharedMemoryPerMultiprocessor"]),
    )


def check_cache(view: ArrayView, dtype: str, num_kv_heads: int | None, head_size: int) -> None:
    """Check one K or V cache: [num_blocks, block_size, num_kv_heads, head_size], aligned.

    Raises:
        InvalidArgumentError: wrong rank, dtype, head shape, a non-contiguous last dimension,
            or a pointer or stride that is not a multiple of 16 bytes (the kernel copies 16-byte
            chunks).
    """
    view.expect(4, (dtype,))
    if view.shape[3] != head_size or (num_kv_heads is not None and view.shape[2] != num_kv_heads):
        raise InvalidArgumentError(
            f"{view.name} must be [num_blocks, block_size, {num_kv_heads or 'num_kv_heads'}, "
            f"{head_size}], got {view.shape}"
        )
    view.expect_last_dim_contiguous()
    if view.ptr % 16 or any(s * view.itemsize % 16 for s in view.strides[:3]):
        raise InvalidArgumentError(
            f"{view.name} must be 16-byte aligned with 16-byte multiple strides, got pointer "
            f"{view.ptr:#x} and strides {view.strides}"
        )


def _check_arrays(
    plan: AttentionPlan, query: ArrayView, key: ArrayView, value: ArrayView, out: ArrayView
) -> None:
    metadata = plan.metadata
    for view in (query, out):
        view.expect(3, (plan.dtype,))
        view.expect_last_dim_contiguous()
        if view.shape[1:] != (plan.num_heads, plan.head_size):
            raise InvalidArgumentError(
                f"{view.name} must be [num_tokens, {plan.num_heads}, {plan.head_size}], "
                f"got {view.shape}"
            )
        if view.shape[0] < metadata.num_query_tokens:
            raise InvalidArgumentError(
                f"{view.name} has {view.shape[0]} rows, the plan covers "
                f"{metadata.num_query_tokens} tokens"
            )
    for view in (key, value):
        check_cache(view, plan.dtype, plan.num_kv_heads, plan.head_size)
        if view.shape[:2] != (metadata.num_blocks, metadata.block_size):
            raise InvalidArgumentError(
                f"{view.name} has {view.shape[0]} blocks of {view.shape[1]} tokens, the plan "
                f"was made for {metadata.num_blocks} blocks of {metadata.block_size}"
            )
    if key.strides != value.strides:
        raise InvalidArgumentError(
            f"key_cache and value_cache must share strides, got {key.strides} and {value.strides}"
        )


def plan_step(
    query: ArrayLike,
    key_cache: ArrayLike,
    query_start_loc: ArrayLike,
    seq_lens: ArrayLike,
    block_table: ArrayLike,
    *,
    sliding_window: int | None = None,
    limits: DeviceLimits | None = None,
    num_splits: int | None = None,
    kernel: AttentionKernel | None = None,
) -> AttentionPlan:
    """Validate a step's metadata against the query and cache shapes and plan the launch.

    Args:
        query: [num_tokens, num_heads, head_size] (shape and dtype only are read).
        key_cache: [num_blocks, block_size, num_kv_heads, head_size] (likewise).
        query_start_loc: the step's metadata (host or device, int32).
        seq_lens: likewise.
        block_table: likewise.
        sliding_window: window in tokens, or None.
        limits: the device for the split policy; None: read from the query's device, or an
            H200 when the query is on the host.
        num_splits: force a split count; None: the policy.
        kernel: "mma" (tensor cores, fp16/bf16) or "simt"; None: "mma" where it applies.

    Raises:
        InvalidArgumentError: any metadata rule (see `validate_metadata`) or shape mismatch.

    Complexity: O(S * max_blocks) on the host, plus one device-to-host copy.
    """
    q = describe(query, "query")
    k = describe(key_cache, "key_cache")
    q.expect(3, ("float16", "bfloat16", "float32"))
    check_cache(k, q.dtype, None, q.shape[2])
    metadata = validate_metadata(
        query_start_loc,
        seq_lens,
        block_table,
        block_size=k.shape[1],
        num_blocks=k.shape[0],
        num_query_rows=q.shape[0],
        sliding_window=sliding_window,
    )
    if limits is None and q.device is not None:
        limits = device_limits(q.device)
    return plan_attention(
        metadata,
        num_heads=q.shape[1],
        num_kv_heads=k.shape[2],
        head_size=q.shape[2],
        dtype=q.dtype,
        limits=limits or DeviceLimits(),
        num_splits=num_splits,
        kernel=kernel,
    )


def _device_arrays(plan: AttentionPlan, device: int, cupy: Any) -> dict[str, Any]:
    arrays = plan.device_cache.get(device)
    if arrays is None:
        metadata = plan.metadata
        arrays = {
            name: cupy.asarray(host)
            for name, host in (
                ("query_start_loc", metadata.query_start_loc),
                ("seq_lens", metadata.seq_lens),
                ("block_table", metadata.block_table),
                ("work_seq", plan.work_seq),
                ("work_row", plan.work_row),
            )
        }
        # Uploaded once per plan and device, then read from any stream: let the copies land.
        cupy.cuda.get_current_stream().synchronize()
        plan.device_cache[device] = arrays
    return arrays


def _empty_like(query: ArrayLike, view: ArrayView) -> ArrayLike:
    if view.backend == "torch":
        import torch

        return torch.empty(tuple(query.shape), dtype=query.dtype, device=query.device)
    cupy = import_cupy()
    with cupy.cuda.Device(view.device):
        return cupy.empty(view.shape, dtype=query.dtype)


def paged_attention(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    plan: AttentionPlan,
    *,
    out: ArrayLike | None = None,
    scale: float | None = None,
) -> ArrayLike:
    """Attention of each query token over its sequence's cached keys, through the block table.

    Args:
        query: [num_tokens, num_heads, head_size], float16 / bfloat16 / float32, on a CUDA
            device (torch or CuPy), last dimension contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_size], same dtype, same
            strides, 16-byte aligned.
        value_cache: likewise, as `key_cache`.
        plan: from `plan_step` (or `plan_attention`) for these shapes.
        out: where to write, like `query`; None: a new array. Rows past
            `query_start_loc[-1]` are left as they are.
        scale: softmax scale; None: 1 / sqrt(head_size).

    Returns:
        `out` (or the new array).

    Raises:
        InvalidArgumentError: an array does not match the plan or the rules above.
        DeviceUnavailableError: no cupy or no device.

    Complexity: O(1) host work plus the launches (asynchronous on the current stream).
    """
    q = describe(query, "query")
    k = describe(key_cache, "key_cache")
    v = describe(value_cache, "value_cache")
    backend, device = common_device([q, k, v])
    if out is None:
        out = _empty_like(query, q)
    o = describe(out, "out")
    common_device([q, o])
    _check_arrays(plan, q, k, v, o)
    if plan.num_work == 0:
        return out
    with launch_context(backend, device) as cupy:
        arrays = _device_arrays(plan, device, cupy)
        shape = (plan.num_splits, plan.metadata.num_query_tokens, plan.num_heads)
        split = plan.num_splits > 1
        pointers = dict(arrays) | {
            "query": pointer(q),
            "key_cache": pointer(k),
            "value_cache": pointer(v),
            "out": pointer(o),
            "partial_out": (
                cupy.empty((*shape, plan.head_size), np.float32) if split else np.uint64(0)
            ),
            "partial_lse": cupy.empty(shape, np.float32) if split else np.uint64(0),
        }
        for call in attention_calls(plan, q, k, o, pointers, scale):
            call.launch(get_kernel(call.source, call.kernel, device))
    return out


def attention_calls(
    plan: AttentionPlan,
    query: ArrayView,
    key_cache: ArrayView,
    out: ArrayView,
    pointers: Mapping[str, Any],
    scale: float | None = None,
) -> list[KernelCall]:
    """The launches of one `paged_attention`: the attention kernel, then the merge if split.

    Args:
        plan: the step's plan.
        query, key_cache, out: the validated arrays (their strides; V shares K's).
        pointers: the kernel pointer of each array by name: query, key_cache, value_cache,
            out, query_start_loc, seq_lens, block_table, work_seq, work_row, partial_out
            (fp32 [splits, tokens, heads, head_size]) and partial_lse (fp32 [splits, tokens,
            heads]); the last two are null pointers when the plan does not split.
        scale: softmax scale; None: 1 / sqrt(head_size).

    Raises:
        InvalidArgumentError: a non-finite scale, or a count that does not fit an int32.

    Complexity: O(1).
    """
    scale = 1.0 / math.sqrt(plan.head_size) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"scale must be finite, got {scale}")
    metadata = plan.metadata
    num_tokens = metadata.num_query_tokens
    split = plan.num_splits > 1
    kernel = plan.traits.kernel
    calls = [
        KernelCall(
            attention_source(kernel),
            attention_kernel_name(plan.dtype, plan.head_size, kernel),
            plan.grid,
            (plan.traits.threads, 1, 1),
            plan.traits.smem_bytes,
            (
                pointers["query"],
                i64(query.strides[0]),
                i64(query.strides[1]),
                pointers["key_cache"],
                pointers["value_cache"],
                i64(key_cache.strides[0]),
                i64(key_cache.strides[1]),
                i64(key_cache.strides[2]),
                pointers["query_start_loc"],
                pointers["seq_lens"],
                pointers["block_table"],
                i64(metadata.block_table.shape[1]),
                pointers["work_seq"],
                pointers["work_row"],
                i32(metadata.num_blocks),
                i32(metadata.block_size.bit_length() - 1),
                i32(plan.group_size),
                i32(metadata.sliding_window or 0),
                np.float32(scale * math.log2(math.e)),
                pointers["out"],
                i64(out.strides[0]),
                i64(out.strides[1]),
                pointers["partial_out"],
                pointers["partial_lse"],
                i32(num_tokens),
                i32(plan.num_heads),
            ),
        )
    ]
    if split:
        pairs = num_tokens * plan.num_heads
        calls.append(
            KernelCall(
                ATTENTION_SOURCE,
                merge_kernel_name(plan.dtype),
                (-(-pairs // MERGE_PAIRS_PER_CTA), 1, 1),
                (MERGE_THREADS, 1, 1),
                0,
                (
                    pointers["partial_out"],
                    pointers["partial_lse"],
                    i32(plan.num_splits),
                    i32(num_tokens),
                    i32(plan.num_heads),
                    i32(plan.head_size),
                    pointers["out"],
                    i64(out.strides[0]),
                    i64(out.strides[1]),
                ),
            )
        )
    return calls


def paged_attention_varlen(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    query_start_loc: ArrayLike,
    seq_lens: ArrayLike,
    block_table: ArrayLike,
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    out: ArrayLike | None = None,
) -> ArrayLike:
    """`plan_step` then `paged_attention`: validate everything, launch, return the output.

    Raises:
        InvalidArgumentError, DeviceUnavailableError: as those two.
    """
    plan = plan_step(
        query, key_cache, query_start_loc, seq_lens, block_table, sliding_window=sliding_window
    )
    return paged_attention(query, key_cache, value_cache, plan, out=out, scale=scale)
