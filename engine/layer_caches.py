"""The caches an executor owns, one per layer, and the current step's metadata as tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.gpu.kv_cache_tensors import LayerKVCache
from pagedkv.gpu.step_metadata import StepMetadata
from pagedkv.vocab.errors import InvalidArgumentError


class StepTensors:
    """One step's metadata: the host arrays, and torch copies on the caches' device in the
    kernels' dtypes (int32 offsets, lengths and table; int64 slots)."""

    def __init__(self, metadata: StepMetadata, device: torch.device) -> None:
        def put(array: object, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(array).to(device=device, dtype=dtype)

        self.host = metadata
        self.query_start_loc = put(metadata.query_start_loc, torch.int32)
        self.seq_lens = put(metadata.seq_lens, torch.int32)
        self.block_table = put(metadata.block_table, torch.int32)
        self.slot_mapping = put(metadata.slot_mapping, torch.int64)


class LayerCaches:
    """Per-layer K/V caches (all of one shape) and the step they are being used for."""

    def __init__(self, caches: Sequence[LayerKVCache]) -> None:
        if not caches:
            raise InvalidArgumentError("an executor needs at least one layer's cache")
        shapes = {tuple(cache.key.shape) for cache in caches}
        if len(shapes) != 1:
            raise InvalidArgumentError(f"every layer's cache must have one shape, got {shapes}")
        self.caches = list(caches)
        self.device: torch.device = self.caches[0].key.device
        self._step: StepTensors | None = None

    def begin_step(self, metadata: StepMetadata) -> None:
        """Take the step's metadata; every layer's write and attention of the step use it."""
        self._step = StepTensors(metadata, self.device)

    @property
    def step(self) -> StepTensors:
        """The current step.

        Raises:
            InvalidArgumentError: no step has begun.
        """
        if self._step is None:
            raise InvalidArgumentError("begin_step must come before a layer's write or attention")
        return self._step

    def layer(self, layer: int) -> LayerKVCache:
        """Layer `layer`'s caches.

        Raises:
            InvalidArgumentError: no such layer.
        """
        if not 0 <= layer < len(self.caches):
            raise InvalidArgumentError(f"layer {layer} is not in [0, {len(self.caches)})")
        return self.caches[layer]
