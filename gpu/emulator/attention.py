"""`paged_attention` and `write_kv` run through the CPU emulator, launch for launch.

The launches are the ones the CuPy path makes (`attention.attention_calls`,
`kv_write.write_kv_call`): same kernels, grids, shared memory and typed arguments; only the
pointers name emulated arrays. Inputs and outputs are CPU torch tensors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.gpu.array_view import describe
from pagedkv.gpu.attention import attention_calls
from pagedkv.gpu.attention_plan import AttentionPlan
from pagedkv.gpu.emulator.build import EmulatorBuild, build_emulator
from pagedkv.gpu.emulator.launch import EmulatedMemory, Launch, Pointer, run_launches
from pagedkv.gpu.kernel_variants import ATTENTION_SOURCE, MMA_ATTENTION_SOURCE, WRITE_SOURCE
from pagedkv.gpu.kv_write import check_slots, check_write_arrays, write_kv_call, write_views

if TYPE_CHECKING:
    import torch

NULL = Pointer(-1)
"""A null pointer argument."""


@functools.cache
def attention_build() -> EmulatorBuild:
    """The emulator build of both attention sources (compiled once per process and cached)."""
    return build_emulator((ATTENTION_SOURCE, MMA_ATTENTION_SOURCE))


@functools.cache
def write_build() -> EmulatorBuild:
    """The emulator build of kv_write.cu."""
    return build_emulator(WRITE_SOURCE)


def raw(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """The bytes of a contiguous CPU tensor as a NumPy array of the same shape (bf16 too)."""
    import torch

    unsigned = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    array: np.ndarray[Any, Any] = tensor.contiguous().view(unsigned[tensor.element_size()]).numpy()
    return array


def from_raw(array: np.ndarray[Any, Any], like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `like`'s dtype from the bytes `raw` produced."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).view(like.dtype).reshape(like.shape)


def emulate_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    *,
    scale: float | None = None,
    seed: int = 0,
    build: EmulatorBuild | None = None,
) -> torch.Tensor:
    """What `paged_attention(query, key_cache, value_cache, plan)` returns, computed by the
    kernels' exact text on the emulator.

    Args:
        query, key_cache, value_cache: CPU tensors (made contiguous).
        plan: from `plan_step` / `plan_attention`.
        scale: softmax scale; None: 1 / sqrt(head_size).
        seed: CTA and thread order.
        build: an emulator build holding both attention sources (a mutant, say); None: the
            real one.

    Returns:
        The output; rows the kernels do not write hold NaN.

    Raises:
        EmulatorError: the kernels faulted or broke a synchronization rule.

    Complexity: the kernels' work, run serially (about 10^7 to 10^8 thread steps a second).
    """
    import torch

    q, k, v = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    out = torch.full_like(q, float("nan"))
    memory = EmulatedMemory()
    metadata = plan.metadata
    pointers: dict[str, Any] = {
        "query": memory.add("query", raw(q)),
        "key_cache": memory.add("key_cache", raw(k)),
        "value_cache": memory.add("value_cache", raw(v)),
        "out": memory.add("out", raw(out), writable=True),
        "query_start_loc": memory.add("query_start_loc", metadata.query_start_loc),
        "seq_lens": memory.add("seq_lens", metadata.seq_lens),
        "block_table": memory.add("block_table", metadata.block_table),
        "work_seq": memory.add("work_seq", plan.work_seq),
        "work_row": memory.add("work_row", plan.work_row),
        "partial_out": NULL,
        "partial_lse": NULL,
    }
    if plan.num_splits > 1:
        shape = (plan.num_splits, metadata.num_query_tokens, plan.num_heads)
        nan = np.float32(np.nan)
        pointers["partial_out"] = memory.add(
            "partial_out", np.full((*shape, plan.head_size), nan), writable=True
        )
        pointers["partial_lse"] = memory.add("partial_lse", np.full(shape, nan), writable=True)
    if plan.num_work:
        views = (describe(q, "query"), describe(k, "key_cache"), describe(out, "out"))
        calls = attention_calls(plan, *views, pointers, scale)
        launches = [Launch(c.kernel, c.grid, c.block, c.shared_bytes, c.args, seed) for c in calls]
        run_launches(build or attention_build(), memory, launches)
    return from_raw(memory.arrays["out"], out)


def emulate_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches after `write_kv(key, value, key_cache, value_cache, slot_mapping)`, computed
    by the write kernel's exact text on the emulator (the inputs are not modified).

    Raises:
        InvalidArgumentError: as `write_kv`.
        EmulatorError: the kernel faulted.
    """
    key, value = key.contiguous(), value.contiguous()
    key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    views = write_views(key, value, key_cache, value_cache, slot_mapping)
    check_write_arrays(*views)
    check_slots(slot_mapping.numpy(), key_cache.shape[0] * key_cache.shape[1])
    memory = EmulatedMemory()
    pointers = {
        "key": memory.add("key", raw(key)),
        "value": memory.add("value", raw(value)),
        "key_cache": memory.add("key_cache", raw(key_cache), writable=True),
        "value_cache": memory.add("value_cache", raw(value_cache), writable=True),
        "slot_mapping": memory.add("slot_mapping", slot_mapping.contiguous().numpy()),
    }
    call = write_kv_call(views, pointers)
    if call is not None:
        launch = Launch(call.kernel, call.grid, call.block, call.shared_bytes, call.args, seed)
        run_launches(write_build(), memory, [launch])
    return (
        from_raw(memory.arrays["key_cache"], key_cache),
        from_raw(memory.arrays["value_cache"], value_cache),
    )
