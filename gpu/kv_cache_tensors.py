"""Per-layer K and V cache tensors allocated from a `KVCacheConfig`.

Like vLLM V1, each layer's `KVCacheTensor.size` bytes are one buffer, viewed as
`[2, num_pages, block_size, num_kv_heads, head_size]` of the spec's dtype; K is `[0]`, V is `[1]`,
each `[num_pages, block_size, num_kv_heads, head_size]` and contiguous. `num_pages` is
`size // page_size_bytes`, at least `config.num_blocks` (after multi-worker unification a tensor
may hold more pages than are used). A tensor several groups share (`KVCacheTensor.shared_by`, a
hybrid model's layout) is one buffer: every layer it names gets the same K and V views, as in
vLLM, since a block id belongs to one group at a time. MLA layers (one latent per token) are not
served by these kernels and are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedkv.gpu.array_view import ArrayLike
from pagedkv.gpu.kernel_loader import import_cupy
from pagedkv.vocab.errors import KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import AttentionSpec, KVCacheConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """How one layer's buffer is viewed.

    Attributes:
        layer_name: the layer.
        dtype: canonical dtype name.
        num_pages: pages in the buffer (>= config.num_blocks).
        block_size: tokens per page.
        num_kv_heads: KV heads.
        head_size: elements per head.
        sliding_window: the layer's window, or None.
        attention_chunk_size: the layer's chunk (chunked local attention, which the kernels
            do not serve; the torch reference does), or None.
    """

    layer_name: str
    dtype: str
    num_pages: int
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    attention_chunk_size: int | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of K (and of V)."""
        return (self.num_pages, self.block_size, self.num_kv_heads, self.head_size)


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's caches (torch tensors or CuPy arrays) and their layout."""

    layout: KVCacheLayout
    key: ArrayLike
    value: ArrayLike


def kv_cache_layouts(config: KVCacheConfig) -> dict[str, KVCacheLayout]:
    """Each layer's cache layout, in group order.

    Raises:
        KVCacheConfigError: a layer is not an attention layer, or uses MLA.

    Complexity: O(num_layers).
    """
    layouts: dict[str, KVCacheLayout] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec) or spec.use_mla:
            raise KVCacheConfigError(
                f"layers {group.layer_names}: the GPU executor serves K/V attention layers only, "
                f"got {spec!r}"
            )
        for name in group.layer_names:
            layouts[name] = KVCacheLayout(
                layer_name=name,
                dtype=spec.dtype,
                num_pages=config.tensors[name].size // spec.page_size_bytes,
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                sliding_window=getattr(spec, "sliding_window", None),
                attention_chunk_size=getattr(spec, "attention_chunk_size", None),
            )
    return layouts


def allocate_kv_caches(
    config: KVCacheConfig,
    *,
    backend: Literal["torch", "cupy"] = "torch",
    device: str | int = "cuda",
) -> dict[str, LayerKVCache]:
    """Allocate zeroed K and V caches for every layer of `config`.

    Args:
        config: the KV cache config.
        backend: "torch" (any torch device, CPU included) or "cupy" (a CUDA device index).
        device: a torch device ("cuda", "cuda:1", "cpu"); for cupy a CUDA index or "cuda:N".

    Returns:
        layer name -> its caches, in group order; the layers of one shared tensor get the same
        K and V arrays.

    Raises:
        KVCacheConfigError: as `kv_cache_layouts`; layers sharing a tensor whose layouts differ
            in dtype or shape (unified pages of different block sizes: not served here); or a
            cupy device that is not CUDA.
        DeviceUnavailableError: backend "cupy" without a device.

    Complexity: O(num_layers) allocations at most, O(total bytes) to zero them.
    """
    caches: dict[str, LayerKVCache] = {}
    shared: dict[tuple[str, ...], LayerKVCache] = {}
    for name, layout in kv_cache_layouts(config).items():
        sharers = config.tensors[name].shared_by
        first = shared.get(sharers) if sharers else None
        if first is not None:
            if (first.layout.dtype, first.layout.shape) != (layout.dtype, layout.shape):
                raise KVCacheConfigError(
                    f"layers {first.layout.layer_name!r} and {name!r} share a tensor but are "
                    f"laid out differently ({first.layout.dtype} {first.layout.shape} vs "
                    f"{layout.dtype} {layout.shape}): not supported by this allocator"
                )
            caches[name] = LayerKVCache(layout=layout, key=first.key, value=first.value)
            continue
        shape = (2, *layout.shape)
        if backend == "torch":
            import torch

            buffer = torch.zeros(shape, dtype=getattr(torch, layout.dtype), device=device)
        else:
            index = _cuda_index(device)
            cupy = import_cupy()
            with cupy.cuda.Device(index):
                buffer = cupy.zeros(shape, dtype=_cupy_dtype(layout.dtype))
        caches[name] = LayerKVCache(layout=layout, key=buffer[0], value=buffer[1])
        if sharers:
            shared[sharers] = caches[name]
    return caches


def _cupy_dtype(name: str) -> object:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def _cuda_index(device: str | int) -> int:
    if isinstance(device, int):
        return device
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise KVCacheConfigError(f"cupy caches need a CUDA device, got {device!r}")
