"""The torch reference executor: `pagedkv.gpu`'s reference write and attention, any device."""

from __future__ import annotations

import torch

from pagedkv.engine.layer_caches import LayerCaches
from pagedkv.gpu.reference import reference_paged_attention, reference_write_kv


class TorchReferenceExecutor(LayerCaches):
    """Plain indexing and a masked softmax (`pagedkv.gpu.reference`): slow, obviously right.

    Each layer writes through its group's slot mapping and reads through its group's block
    table, within its window or its chunk."""

    name = "torch reference"

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cache = self.layer(layer)
        reference_write_kv(key, value, cache.key, cache.value, self.step_of(layer).slot_mapping)

    def attention(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        cache = self.layer(layer)
        step = self.step_of(layer)
        return reference_paged_attention(
            query,
            cache.key,
            cache.value,
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            scale=scale,
            sliding_window=self.window_of(layer),
            attention_chunk_size=self.chunk_of(layer),
        )
