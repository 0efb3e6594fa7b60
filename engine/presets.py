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


@dataclass(frozen=True)
class Gemma3Shape:
    """The sizes and layer pattern of a synthetic Gemma-3 text model.

    Attributes:
        layer_types: one "sliding_attention" or "full_attention" per layer (Gemma-3's own
            pattern is five sliding layers to each full one; these are shorter).
        sliding_window: tokens a sliding layer's query sees, itself included.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...]


SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA3_PRESETS: dict[str, Gemma3Shape] = {
    # 4 layers, one sliding to one full (gpt-oss's ratio): vLLM 0.33 makes two KV cache
    # groups of two layers each, a sliding-window group and a full-attention group.
    "gemma3-2group": Gemma3Shape(512, 256, 512, 4, 2, 64, 1024, 16, (SLIDING, FULL) * 2),
    # 6 layers, two sliding to one full: 4 sliding layers against 2 full ones is more than
    # vLLM 0.33's 1.5x slack, so the sliding layers split into two groups of two (layers 0, 3
    # and 1, 4) beside the full group (2, 5): three groups, one block id a page of each.
    "gemma3-3group": Gemma3Shape(512, 256, 512, 4, 2, 64, 1024, 16, (SLIDING, SLIDING, FULL) * 2),
}


@dataclass(frozen=True)
class Llama4Shape:
    """The sizes and layer pattern of a synthetic Llama-4 text model.

    Attributes:
        layer_types: one "chunked_attention" or "full_attention" per layer; chunked layers use
            RoPE, full ones none (Llama-4's NoPE layers, with attention temperature tuning).
        attention_chunk_size: tokens per chunk of a chunked layer.
        floor_scale: the temperature tuning's step in positions (Llama-4 uses 8192; a small
            one makes the query scale change within these short sequences).
        moe_layers: the layers whose feed-forward is a mixture of experts (with a shared one).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    attention_chunk_size: int
    floor_scale: int
    num_experts: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[int, ...]


CHUNKED = "chunked_attention"

LLAMA4_PRESETS: dict[str, Llama4Shape] = {
    # 4 layers, chunked local attention (chunks of 16 tokens) then full, twice, as Llama-4
    # interleaves them (3:1 there); layers 1 and 3 are mixtures of 2 experts. Two KV cache
    # groups: chunked local attention and full attention.
    "llama4-2group": Llama4Shape(
        512, 256, 512, 4, 2, 64, 1024, 16, 8, 2, (CHUNKED, FULL) * 2, (1, 3)
    ),
}

PRESETS: tuple[str, ...] = (*SYNTHETIC_PRESETS, *GEMMA3_PRESETS, *LLAMA4_PRESETS)
"""Every synthetic model's name: the Llamas', the Gemma-3s' and the Llama-4s'."""


def max_positions(preset: str) -> int:
    """The longest sequence the preset's model takes (its `max_position_embeddings`)."""
    shapes: dict[str, LlamaShape | Gemma3Shape | Llama4Shape] = {
        **SYNTHETIC_PRESETS,
        **GEMMA3_PRESETS,
        **LLAMA4_PRESETS,
    }
    return shapes[preset].max_position_embeddings
