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


def test_layers_of_a_shared_tensor_get_one_buffer() -> None:
    """vLLM's hybrid layout: the j-th layer of every group uses one tensor (a block id belongs
    to one group at a time), so the allocation holds one buffer per position, not per layer."""
    from pagedkv.planning.kv_cache_groups import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sliding_window=32
    )
    specs = {f"layers.{i}": window if i % 3 != 2 else full for i in range(6)}
    config = get_kv_cache_config_from_groups(get_kv_cache_groups(specs), 5)
    groups = [list(group.layer_names) for group in config.kv_cache_groups]
    assert groups == [["layers.0", "layers.3"], ["layers.1", "layers.4"], ["layers.2", "layers.5"]]
    caches = allocate_kv_caches(config, backend="torch", device="cpu")
    for position in range(2):
        names = [group[position] for group in groups]
        assert len({caches[name].key.data_ptr() for name in names}) == 1, names
        assert len({caches[name].value.data_ptr() for name in names}) == 1, names
    assert caches["layers.0"].key.data_ptr() != caches["layers.3"].key.data_ptr()
    assert caches["layers.0"].layout.sliding_window == 32
    assert caches["layers.2"].layout.sliding_window is None
    caches["layers.0"].key[1, 0, 0, 0] = 7.0
    assert caches["layers.2"].key[1, 0, 0, 0] == 7.0  # one buffer, seen by both


def test_layers_sharing_a_tensor_must_share_a_layout() -> None:
    small = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype="float32")
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sliding_window=32
    )
    assert small.page_size_bytes == window.page_size_bytes
    tensor = KVCacheTensor(window.page_size_bytes * 4, ["a", "b"])
    config = KVCacheConfig(
        4,
        {"a": tensor, "b": tensor},
        [KVCacheGroupSpec(["a"], window), KVCacheGroupSpec(["b"], small)],
    )
    with pytest.raises(KVCacheConfigError, match="share a tensor but are laid out differently"):
        allocate_kv_caches(config, backend="torch", device="cpu")
