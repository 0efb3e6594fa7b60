"""The paged KV write on the GPU: validate, pick the widest copy, launch `write_kv_kernel`.

Token i of `key`/`value` goes to slot `slot_mapping[i]` = `block_id * block_size + offset` of the
caches; a negative slot skips the token. The token count is `len(slot_mapping)` (key and value
may have more rows, e.g. padding). Slots are checked on the host before the launch (one
device-to-host copy of `slot_mapping`); the kernel also skips any slot outside the cache, so
even with `check_slots=False` no write lands outside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv.gpu.array_view import ArrayLike, ArrayView, describe, to_host
from pagedkv.gpu.kernel_loader import get_kernel
from pagedkv.gpu.kernel_variants import (
    SLOT_INDEX_TYPES,
    WRITE_MAX_THREADS,
    WRITE_SOURCE,
    WRITE_VECTOR_TYPES,
    write_kernel_name,
)
from pagedkv.gpu.launch import KernelCall, common_device, i32, i64, launch_context, pointer
from pagedkv.vocab.errors import InvalidArgumentError


def check_slots(slots: np.ndarray[Any, Any], num_slots: int) -> None:
    """Every slot is negative (skip) or below `num_slots`, and no slot appears twice.

    Raises:
        InvalidArgumentError: names the first offending token.

    Complexity: O(n log n).
    """
    too_big = slots >= num_slots
    if too_big.any():
        token = int(np.argmax(too_big))
        raise InvalidArgumentError(
            f"slot_mapping[{token}] = {slots[token]} is outside the cache's {num_slots} slots"
        )
    used = slots[slots >= 0]
    unique, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        slot = int(unique[np.argmax(counts > 1)])
        raise InvalidArgumentError(f"slot {slot} is written by more than one token")


def check_write_arrays(
    key: ArrayView, value: ArrayView, key_cache: ArrayView, value_cache: ArrayView, slots: ArrayView
) -> None:
    """Shapes, dtypes and strides of a KV write.

    Raises:
        InvalidArgumentError: key/value not [T, H, D] with T >= len(slot_mapping), caches not
            [N, B, H, D] of the same dtype and strides, a non-contiguous last dimension, or
            slot_mapping not a contiguous int32/int64 vector.
    """
    key_cache.expect(4, (key_cache.dtype,))
    slots.expect(1, tuple(SLOT_INDEX_TYPES))
    slots.expect_contiguous()
    head_shape = key_cache.shape[2:]
    for view in (key, value):
        view.expect(3, (key_cache.dtype,))
        view.expect_last_dim_contiguous()
        if view.shape[1:] != head_shape or view.shape[0] < slots.shape[0]:
            raise InvalidArgumentError(
                f"{view.name} must be [>= {slots.shape[0]} tokens, {head_shape[0]}, "
                f"{head_shape[1]}] like the cache, got {view.shape}"
            )
    value_cache.expect(4, (key_cache.dtype,))
    if value_cache.shape != key_cache.shape or value_cache.strides != key_cache.strides:
        raise InvalidArgumentError(
            f"key_cache and value_cache must share shape and strides, got {key_cache.shape} "
            f"{key_cache.strides} and {value_cache.shape} {value_cache.strides}"
        )
    key_cache.expect_last_dim_contiguous()


def copy_width(views: list[ArrayView], row_bytes: int) -> int:
    """The widest copy (16, 8, 4 or 2 bytes, or the element size) every pointer and stride allows.

    Complexity: O(number of strides).
    """
    itemsize = views[0].itemsize
    for width in sorted(WRITE_VECTOR_TYPES, reverse=True):
        if width < itemsize or row_bytes % width:
            continue
        aligned = all(
            view.ptr % width == 0 and all(s * view.itemsize % width == 0 for s in view.strides[:-1])
            for view in views
        )
        if aligned:
            return width
    if itemsize not in WRITE_VECTOR_TYPES:
        raise InvalidArgumentError(f"the KV write moves 2-16 byte elements, got {itemsize} bytes")
    return itemsize


def write_kv(
    key: ArrayLike,
    value: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    slot_mapping: ArrayLike,
    *,
    check_slots_on_host: bool = True,
) -> None:
    """Write each token's K and V rows into its cache slot (negative slot: skip).

    Args:
        key: [num_tokens, num_kv_heads, head_size], the caches' dtype.
        value: likewise, as `key`.
        key_cache: [num_blocks, block_size, num_kv_heads, head_size].
        value_cache: likewise, as `key_cache`.
        slot_mapping: int32 or int64 [n], n <= num_tokens, contiguous.
        check_slots_on_host: copy slot_mapping to the host and reject bad slots before
            launching (a synchronization). Off: out-of-range slots are silently skipped.

    Raises:
        InvalidArgumentError: a shape, dtype, stride, device or slot rule is broken; nothing
            was written.
        DeviceUnavailableError: no cupy or no device.

    Complexity: O(n) host work when checking, plus one launch.
    """
    views = write_views(key, value, key_cache, value_cache, slot_mapping)
    backend, device = common_device(views)
    k, v, kc, vc, slots = views
    check_write_arrays(k, v, kc, vc, slots)
    num_slots = kc.shape[0] * kc.shape[1]
    if check_slots_on_host:
        check_slots(np.asarray(to_host(slot_mapping)), num_slots)
    call = write_kv_call(
        views,
        {
            "key": pointer(k),
            "value": pointer(v),
            "key_cache": pointer(kc),
            "value_cache": pointer(vc),
            "slot_mapping": pointer(slots),
        },
    )
    if call is not None:
        with launch_context(backend, device):
            call.launch(get_kernel(call.source, call.kernel, device))


def write_views(
    key: ArrayLike,
    value: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    slot_mapping: ArrayLike,
) -> list[ArrayView]:
    """The five arrays of a KV write, described under their argument names. Complexity: O(1)."""
    return [
        describe(key, "key"),
        describe(value, "value"),
        describe(key_cache, "key_cache"),
        describe(value_cache, "value_cache"),
        describe(slot_mapping, "slot_mapping"),
    ]


def write_kv_call(views: list[ArrayView], pointers: Mapping[str, Any]) -> KernelCall | None:
    """The launch of one `write_kv` (None: no tokens), from validated arrays.

    Args:
        views: key, value, key_cache, value_cache, slot_mapping (checked by
            `check_write_arrays`).
        pointers: the kernel pointer of each of them by that name.

    Complexity: O(number of strides).
    """
    k, v, kc, vc, slots = views
    num_blocks, block_size, num_kv_heads, head_size = kc.shape
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return None
    row_bytes = head_size * kc.itemsize
    width = copy_width([k, v, kc, vc], row_bytes)
    units = width // kc.itemsize
    row_vecs = row_bytes // width
    threads = min(WRITE_MAX_THREADS, -(-num_kv_heads * row_vecs // 32) * 32)
    return KernelCall(
        WRITE_SOURCE,
        write_kernel_name(width, slots.dtype),
        (num_tokens, 1, 1),
        (threads, 1, 1),
        0,
        (
            pointers["key"],
            pointers["value"],
            i64(k.strides[0] // units),
            i64(k.strides[1] // units),
            i64(v.strides[0] // units),
            i64(v.strides[1] // units),
            pointers["key_cache"],
            pointers["value_cache"],
            i64(kc.strides[0] // units),
            i64(kc.strides[1] // units),
            i64(kc.strides[2] // units),
            pointers["slot_mapping"],
            i32(num_kv_heads),
            i32(row_vecs),
            i32(block_size),
            i64(num_blocks * block_size),
        ),
    )
