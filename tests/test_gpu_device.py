"""The kernels on a real device against the torch reference (skipped without one).

On CPU only the argument checks that come before any launch run (the last tests).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.gpu.attention import paged_attention, paged_attention_varlen, plan_step
from pagedkv.gpu.error_bound import compare_to_reference
from pagedkv.gpu.kv_write import write_kv
from pagedkv.gpu.reference import reference_write_kv
from pagedkv.gpu.synthetic_batch import BatchShape, batch_terms, make_batch, plan_batch
from pagedkv.vocab.errors import InvalidArgumentError


def _has_device() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available()) and torch.cuda.is_available()


needs_device = pytest.mark.skipif(
    not _has_device(), reason="needs a CUDA device visible to both cupy and torch"
)


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_attention_kernel_matches_the_reference(
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    window: int | None,
    num_splits: int | None,
) -> None:
    shape = BatchShape((1, 7, 1, 40), (200, 60, 1, 40), 8, 2, head_size, block_size, window)
    batch = make_batch(shape, dtype=dtype, device="cuda", seed=head_size)
    plan = plan_batch(batch, num_splits=num_splits)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, plan)
    result = compare_to_reference(out, batch_terms(batch), str(dtype).removeprefix("torch."))
    assert result["passed"], result


@pytest.mark.gpu
@needs_device
def test_varlen_entry_point_and_cupy_arrays_give_the_same_output() -> None:
    import cupy

    shape = BatchShape((1, 1), (100, 33), 8, 8, 128, 16)
    batch = make_batch(shape, dtype=torch.float16, device="cuda")
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table)
    out = paged_attention_varlen(batch.query, batch.key_cache, batch.value_cache, *args)
    as_cupy = [cupy.from_dlpack(t) for t in (batch.query, batch.key_cache, batch.value_cache)]
    out_cupy = paged_attention_varlen(*as_cupy, *[cupy.from_dlpack(t) for t in args])
    torch.testing.assert_close(out, torch.from_dlpack(out_cupy))


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kernel_matches_the_reference_bit_for_bit(
    dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    caches = [
        torch.full((9, 16, 4, 128), float("nan"), dtype=dtype, device="cuda") for _ in range(4)
    ]
    key = torch.randn(40, 4, 128, device="cuda").to(dtype)
    value = torch.randn(40, 4, 128, device="cuda").to(dtype)
    slots = torch.randperm(9 * 16, device="cuda")[:38].to(slot_dtype)
    slots[::5] = -1
    write_kv(key, value, caches[0], caches[1], slots)
    reference_write_kv(key, value, caches[2], caches[3], slots)
    for mine, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.gpu
@needs_device
def test_write_kernel_handles_strided_keys_with_a_narrower_copy() -> None:
    qkv = torch.randn(10, 3, 4, 60, device="cuda", dtype=torch.float16)
    key, value = qkv[:, 1], qkv[:, 2]  # views into a fused QKV projection; 120-byte rows
    caches = [torch.zeros(4, 16, 4, 60, dtype=torch.float16, device="cuda") for _ in range(4)]
    slots = torch.arange(10, device="cuda") * 3
    write_kv(key, value, caches[0], caches[1], slots)
    reference_write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@needs_device
def test_a_bad_slot_or_block_id_raises_before_any_launch() -> None:
    key_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    key = torch.ones(2, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(InvalidArgumentError, match="outside the cache"):
        write_kv(key, key, key_cache, value_cache, torch.tensor([0, 64], device="cuda"))
    assert key_cache.eq(0).all(), "nothing written"
    batch = make_batch(BatchShape((1,), (20,), 2, 2, 64, 16), dtype=torch.float16, device="cuda")
    table = batch.block_table.clone()
    table[0, 1] = batch.key_cache.shape[0]
    with pytest.raises(InvalidArgumentError, match="not a block id"):
        paged_attention_varlen(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.query_start_loc,
            batch.seq_lens,
            table,
        )


# --- on any machine: the checks that run before a launch -------------------------------------


def test_host_tensors_are_rejected_before_any_device_work() -> None:
    batch = make_batch(BatchShape((1,), (5,), 2, 2, 64, 16), dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="must be on a CUDA device"):
        write_kv(
            batch.query[:, :2],
            batch.query[:, :2],
            batch.key_cache,
            batch.value_cache,
            batch.slot_mapping,
        )
    plan = plan_step(
        batch.query, batch.key_cache, batch.query_start_loc, batch.seq_lens, batch.block_table
    )
    with pytest.raises(InvalidArgumentError, match="must be on a CUDA device"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, plan)


def test_non_arrays_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match=r"expected a torch\.Tensor"):
        write_kv([1], [1], [1], [1], [1])
