"""Per-layer K/V caches from a KVCacheConfig: layouts on CPU, allocation with torch on CPU."""

from __future__ import annotations

import pytest
import torch

from pagedkv.gpu.kv_cache_tensors import allocate_kv_caches, kv_cache_layouts
from pagedkv.vocab.errors import KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
WINDOW = SlidingWindowSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=128
)


def _config(num_blocks: int = 5, extra_pages: int = 0) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        {
            "layers.0": KVCacheTensor(FULL.page_size_bytes * (num_blocks + extra_pages)),
            "layers.1": KVCacheTensor(WINDOW.page_size_bytes * num_blocks),
        },
        [KVCacheGroupSpec(["layers.0"], FULL), KVCacheGroupSpec(["layers.1"], WINDOW)],
    )


def test_layouts_follow_the_specs_and_tensor_sizes() -> None:
    layouts = kv_cache_layouts(_config(extra_pages=2))
    assert list(layouts) == ["layers.0", "layers.1"]
    full, window = layouts["layers.0"], layouts["layers.1"]
    assert full.shape == (7, 16, 2, 64)  # a unified tensor may hold more pages than num_blocks
    assert (full.dtype, full.sliding_window) == ("bfloat16", None)
    assert window.shape == (5, 16, 2, 64)
    assert (window.dtype, window.sliding_window) == ("float16", 128)


def test_allocation_views_one_zeroed_buffer_per_layer_as_k_and_v() -> None:
    config = _config()
    caches = allocate_kv_caches(config, backend="torch", device="cpu")
    for name, cache in caches.items():
        key, value = cache.key, cache.value
        assert tuple(key.shape) == tuple(value.shape) == cache.layout.shape
        assert key.dtype == getattr(torch, cache.layout.dtype)
        assert key.is_contiguous() and value.is_contiguous()
        assert key.eq(0).all() and value.eq(0).all()
        nbytes = key.numel() * key.element_size()
        assert 2 * nbytes == config.tensors[name].size
        assert value.data_ptr() - key.data_ptr() == nbytes, "K then V in one buffer"


def test_mla_layers_are_rejected() -> None:
    mla = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bf16", use_mla=True
    )
    config = KVCacheConfig(
        2, {"mla": KVCacheTensor(2 * mla.page_size_bytes)}, [KVCacheGroupSpec(["mla"], mla)]
    )
    with pytest.raises(KVCacheConfigError, match="K/V attention layers only"):
        kv_cache_layouts(config)


def test_cupy_caches_need_a_cuda_device_name() -> None:
    with pytest.raises(KVCacheConfigError, match="CUDA device"):
        allocate_kv_caches(_config(), backend="cupy", device="cpu")
