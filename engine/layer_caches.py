"""The caches an executor owns, one per layer, and the current step's metadata as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.gpu.kv_cache_tensors import LayerKVCache
from pagedkv.gpu.step_metadata import StepMetadata
from pagedkv.vocab.errors import InvalidArgumentError


@dataclass(frozen=True, eq=False)
class GroupedStepMetadata:
    """One step's metadata for a model of several KV cache groups (a hybrid model).

    Every group has its own block table and slot mapping (block ids come from one pool, group by
    group); the tokens, positions, query offsets and sequence lengths are the same in each.

    Attributes:
        groups: one `StepMetadata` per KV cache group, in the config's group order.
        layer_groups: decoder layer i -> the index of its group.
    """

    groups: tuple[StepMetadata, ...]
    layer_groups: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise InvalidArgumentError("a grouped step needs at least one group's metadata")
        bad = [g for g in self.layer_groups if not 0 <= g < len(self.groups)]
        if bad:
            raise InvalidArgumentError(
                f"layer groups {bad} are not in [0, {len(self.groups)}) (one metadata per group)"
            )


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
    """Per-layer K/V caches (all of one shape) and the step they are being used for.

    A step is a `StepMetadata` (one KV cache group: every layer reads it) or a
    `GroupedStepMetadata` (each layer reads its group's). Each layer's sliding window and
    attention chunk are its cache's (`KVCacheLayout.sliding_window`, `.attention_chunk_size`).
    """

    def __init__(self, caches: Sequence[LayerKVCache]) -> None:
        if not caches:
            raise InvalidArgumentError("an executor needs at least one layer's cache")
        shapes = {tuple(cache.key.shape) for cache in caches}
        if len(shapes) != 1:
            raise InvalidArgumentError(f"every layer's cache must have one shape, got {shapes}")
        self.caches = list(caches)
        self.device: torch.device = self.caches[0].key.device
        self._steps: tuple[StepTensors, ...] = ()
        self._layer_groups: tuple[int, ...] | None = None

    def begin_step(self, metadata: StepMetadata | GroupedStepMetadata) -> None:
        """Take the step's metadata; every layer's write and attention of the step use it (or
        its group's part of it).

        Raises:
            InvalidArgumentError: grouped metadata that does not name a group for every layer.
        """
        if isinstance(metadata, GroupedStepMetadata):
            if len(metadata.layer_groups) != len(self.caches):
                raise InvalidArgumentError(
                    f"the step names groups for {len(metadata.layer_groups)} layers, the "
                    f"executor has {len(self.caches)}"
                )
            self._steps = tuple(StepTensors(group, self.device) for group in metadata.groups)
            self._layer_groups = metadata.layer_groups
        else:
            self._steps = (StepTensors(metadata, self.device),)
            self._layer_groups = None

    @property
    def step(self) -> StepTensors:
        """The current step (the first group's, for a grouped step).

        Raises:
            InvalidArgumentError: no step has begun.
        """
        if not self._steps:
            raise InvalidArgumentError("begin_step must come before a layer's write or attention")
        return self._steps[0]

    def group_of(self, layer: int) -> int:
        """The KV cache group of layer `layer` in the current step (0 for a plain step).

        Raises:
            InvalidArgumentError: no step has begun, or no such layer.
        """
        self.layer(layer)
        if not self._steps:
            raise InvalidArgumentError("begin_step must come before a layer's write or attention")
        return 0 if self._layer_groups is None else self._layer_groups[layer]

    def step_of(self, layer: int) -> StepTensors:
        """The current step's metadata as layer `layer` reads it: its group's.

        Raises:
            InvalidArgumentError: no step has begun, or no such layer.
        """
        return self._steps[self.group_of(layer)]

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None (full or chunked local attention)."""
        return self.layer(layer).layout.sliding_window

    def chunk_of(self, layer: int) -> int | None:
        """Layer `layer`'s attention chunk size, or None (full or sliding-window attention)."""
        return self.layer(layer).layout.attention_chunk_size

    def layer(self, layer: int) -> LayerKVCache:
        """Layer `layer`'s caches.

        Raises:
            InvalidArgumentError: no such layer.
        """
        if not 0 <= layer < len(self.caches):
            raise InvalidArgumentError(f"layer {layer} is not in [0, {len(self.caches)})")
        return self.caches[layer]
