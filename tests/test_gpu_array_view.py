"""Arrays described without importing their library; the copy width and cache alignment rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.gpu.array_view import ArrayView, backend_of, describe, to_host
from pagedkv.gpu.attention import check_cache
from pagedkv.gpu.kv_write import copy_width
from pagedkv.vocab.errors import InvalidArgumentError


def test_torch_and_numpy_arrays_are_described_in_elements() -> None:
    tensor = torch.zeros(4, 6, dtype=torch.bfloat16)[:, 1:5]
    view = describe(tensor, "t")
    assert (view.backend, view.dtype, view.itemsize, view.device) == ("torch", "bfloat16", 2, None)
    assert (view.shape, view.strides) == ((4, 4), (6, 1))
    assert view.ptr == tensor.data_ptr()
    array = np.zeros((3, 5), dtype=np.int32)[:, ::2]
    view = describe(array, "a")
    assert (view.backend, view.dtype, view.shape, view.strides) == (
        "numpy",
        "int32",
        (3, 3),
        (5, 2),
    )
    assert to_host(array) is array
    assert to_host(torch.arange(3)).tolist() == [0, 1, 2]


def test_contiguity_checks() -> None:
    describe(torch.zeros(2, 1, 3)[:, :, :], "x").expect_contiguous()
    with pytest.raises(InvalidArgumentError, match="x must be contiguous"):
        describe(torch.zeros(4, 4)[:, ::2], "x").expect_contiguous()
    with pytest.raises(InvalidArgumentError, match="last dimension must be contiguous"):
        describe(torch.zeros(4, 4).t(), "x").expect_last_dim_contiguous()


def test_unknown_objects_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="got list"):
        backend_of([1, 2])


def _view(ptr: int, strides: tuple[int, ...], itemsize: int = 2) -> ArrayView:
    shape = (4,) * len(strides)
    return ArrayView("v", "torch", ptr, shape, strides, "float16", itemsize, 0)


def test_copy_width_is_the_widest_every_pointer_and_stride_allows() -> None:
    aligned = _view(4096, (1024, 256, 1))
    assert copy_width([aligned], row_bytes=256) == 16
    assert copy_width([aligned, _view(4096 + 8, (1024, 256, 1))], row_bytes=256) == 8
    assert copy_width([_view(4096, (1024, 258, 1))], row_bytes=256) == 4  # 516-byte stride
    assert copy_width([aligned], row_bytes=120) == 8  # head_size 60
    assert copy_width([_view(4098, (1024, 256, 1))], row_bytes=256) == 2
    assert copy_width([_view(4096, (1024, 256, 1), itemsize=4)], row_bytes=512) == 16


def test_caches_must_be_16_byte_aligned_for_the_attention_kernel() -> None:
    check_cache(_view(4096, (8192, 512, 64, 1)), "float16", 4, 4)
    with pytest.raises(InvalidArgumentError, match="16-byte aligned"):
        check_cache(_view(4104, (8192, 512, 64, 1)), "float16", 4, 4)
    with pytest.raises(InvalidArgumentError, match="16-byte aligned"):
        check_cache(_view(4096, (8192, 516, 64, 1)), "float16", 4, 4)
    with pytest.raises(InvalidArgumentError, match=r"\[num_blocks, block_size, 2, 4\]"):
        check_cache(_view(4096, (8192, 512, 64, 1)), "float16", 2, 4)
