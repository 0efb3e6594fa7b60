"""The synthetic models' shapes, by preset name: plain data, importable without torch.

`pagedkv run` checks `--preset` (and `--max-model-len` against the preset's positions) before it
imports torch, so that a mistyped argument is reported at once; `pagedkv.engine.model` builds
the models from these shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a synthetic Llama (head size = hidden_size / num_heads)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int


SYNTHETIC_PRESETS: dict[str, LlamaShape] = {
    # 2 layers, GQA 4:2, head size 64: the CI model.
    "tiny": LlamaShape(512, 256, 512, 2, 4, 2, 1024),
    # 4 layers, GQA 8:4, head size 64: `pagedkv run`'s default.
    "small": LlamaShape(2048, 512, 1024, 4, 8, 4, 4096),
}

PRESETS: tuple[str, ...] = tuple(SYNTHETIC_PRESETS)
"""Every synthetic model's name."""


def max_positions(preset: str) -> int:
    """The longest sequence the preset's model takes (its `max_position_embeddings`)."""
    return SYNTHETIC_PRESETS[preset].max_position_embeddings
