"""The engine's KV cache layout: each layer's spec, grouped as vLLM 0.33 groups them.

A model whose layers all share one spec (a Llama: full attention everywhere) has one KV cache
group, laid out by `uniform_kv_cache_config`. A model whose layers differ (Gemma-3:
sliding-window and full-attention layers; Llama-4: chunked local and full attention) has the
groups `pagedkv.planning.kv_cache_groups` builds as vLLM 0.33 does (layers bucketed by spec,
buckets split into groups of one size, the j-th layer of every group sharing one tensor).
`KVCacheManager` serves both: one block table per group over one pool of `num_blocks` blocks.

    Gemma-3 style, layers (sliding, sliding, full) x 2, window 16:
        group 0  sliding window 16   layers 0, 3
        group 1  sliding window 16   layers 1, 4
        group 2  full attention      layers 2, 5
        tensors  position 0 shared by layers 0, 1, 2; position 1 by layers 3, 4, 5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.block_counts import cdiv
from pagedkv.planning.kv_cache_groups import get_kv_cache_config_from_groups, get_kv_cache_groups
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    DTypeLike,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's query sees, itself included: every earlier token, the last
    `sliding_window` tokens, or the tokens of its own chunk of `attention_chunk_size`."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None


def layer_name(index: int) -> str:
    """The name of decoder layer `index` in the engine's `KVCacheConfig`."""
    return f"layers.{index}"


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache config and where each decoder layer sits in it.

    Attributes:
        kv_cache_config: the groups, tensors and `num_blocks`.
        layer_groups: decoder layer i -> the index of its KV cache group.
    """

    kv_cache_config: KVCacheConfig
    layer_groups: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Decoder layer i's name in the config, in layer order."""
        return tuple(layer_name(index) for index in range(len(self.layer_groups)))

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window, or None (full or chunked local attention)."""
        return tuple(
            getattr(group.kv_cache_spec, "sliding_window", None)
            for group in self.kv_cache_config.kv_cache_groups
        )

    @property
    def group_chunks(self) -> tuple[int | None, ...]:
        """Each group's attention chunk size, or None (full or sliding-window attention)."""
        return tuple(
            getattr(group.kv_cache_spec, "attention_chunk_size", None)
            for group in self.kv_cache_config.kv_cache_groups
        )

    def max_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """`max_blocks_per_request` of this layout's config."""
        return max_blocks_per_request(self.kv_cache_config, num_tokens, max_num_batched_tokens)

    def describe(self) -> str:
        """One line: the groups, their attention and their layers."""
        parts = []
        groups = self.kv_cache_config.kv_cache_groups
        for group, window, chunk in zip(groups, self.group_windows, self.group_chunks, strict=True):
            layers = ", ".join(name.removeprefix("layers.") for name in group.layer_names)
            kind = "full attention"
            if window is not None:
                kind = f"sliding window {window}"
            elif chunk is not None:
                kind = f"chunked local attention {chunk}"
            parts.append(f"{kind} (layers {layers})")
        count = self.num_groups
        return f"{count} {'group' if count == 1 else 'groups'}: " + "; ".join(parts)


def max_blocks_per_request(
    config: KVCacheConfig, num_tokens: int, max_num_batched_tokens: int
) -> int:
    """The most blocks, all groups together, a request of `num_tokens` tokens holds after any
    `allocate_slots` of a scheduler whose steps compute at most `max_num_batched_tokens` tokens:
    cdiv(num_tokens, B) in a full-attention group; in a sliding-window group at most that, and
    at most the window's W - 1 earlier tokens and the step's tokens, whose first block may start
    mid-block, `cdiv(W - 1 + max_num_batched_tokens, B) + 1` (`sliding_window_max_blocks`,
    capped); in a chunked local group likewise with the C - 1 earlier tokens of the first
    token's chunk. A request must fit in the pool with that many, or it could never be
    scheduled.

    Complexity: O(groups).
    """
    total = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = cdiv(num_tokens, spec.block_size)
        reach = None
        if isinstance(spec, SlidingWindowSpec):
            reach = spec.sliding_window - 1 + max_num_batched_tokens
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            reach = spec.attention_chunk_size - 1 + max_num_batched_tokens
        if reach is not None:
            blocks = min(blocks, cdiv(reach, spec.block_size) + 1)
        total += blocks
    return total


def layer_specs(
    attention: Sequence[LayerAttention],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: DTypeLike,
) -> list[KVCacheSpec]:
    """One spec per decoder layer: `SlidingWindowSpec`, `ChunkedLocalAttentionSpec` or
    `FullAttentionSpec`, as `attention[i]` says.

    Raises:
        InvalidArgumentError, KVCacheConfigError: as the specs on construction.
    """
    heads, size = num_kv_heads, head_size
    specs: list[KVCacheSpec] = []
    for layer in attention:
        spec: KVCacheSpec
        if layer.sliding_window is not None:
            spec = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=size,
                dtype=dtype,
                sliding_window=layer.sliding_window,
            )
        elif layer.attention_chunk_size is not None:
            spec = ChunkedLocalAttentionSpec(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=size,
                dtype=dtype,
                attention_chunk_size=layer.attention_chunk_size,
            )
        else:
            spec = FullAttentionSpec(
                block_size=block_size, num_kv_heads=heads, head_size=size, dtype=dtype
            )
        specs.append(spec)
    return specs


def kv_layout(specs: Sequence[KVCacheSpec], num_blocks: int) -> KVLayout:
    """The layout of a model whose decoder layer i has spec `specs[i]` (module docstring).

    Raises:
        InvalidArgumentError: no layers.
        KVCacheConfigError: layers vLLM 0.33 groups in a way pagedkv does not hold
            (`get_kv_cache_groups`), or groups of different block sizes (no pool serves them).
    """
    if not specs:
        raise InvalidArgumentError("a model needs at least one layer")
    if len(set(specs)) == 1:
        config = uniform_kv_cache_config(specs[0], num_blocks, len(specs))
        return KVLayout(config, (0,) * len(specs))
    names = [layer_name(index) for index in range(len(specs))]
    groups = get_kv_cache_groups(dict(zip(names, specs, strict=True)))
    config = get_kv_cache_config_from_groups(groups, num_blocks)
    group_of = {name: index for index, group in enumerate(groups) for name in group.layer_names}
    return KVLayout(config, tuple(group_of[name] for name in names))
