"""The engine's KV cache layout: each layer's spec, grouped as vLLM 0.33 groups them.

A model whose layers all share one spec (a Llama: full attention everywhere) has one KV cache
group, laid out by `uniform_kv_cache_config` and served by `KVCacheManager`, as before hybrid
models. A model whose layers differ (Gemma-3: sliding-window and full-attention layers) has the
groups `pagedkv.planning.kv_cache_groups` builds as vLLM 0.33 does (layers bucketed by spec,
buckets split into groups of one size, the j-th layer of every group sharing one tensor), served
by `HybridKVCacheManager`: one block table per group over one pool of `num_blocks` blocks.

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
    DTypeLike,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)


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
        """Each group's sliding window, or None (full attention)."""
        return tuple(
            getattr(group.kv_cache_spec, "sliding_window", None)
            for group in self.kv_cache_config.kv_cache_groups
        )

    def max_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """`max_blocks_per_request` of this layout's config."""
        return max_blocks_per_request(self.kv_cache_config, num_tokens, max_num_batched_tokens)

    def describe(self) -> str:
        """One line: the groups, their attention and their layers."""
        parts = []
        groups = self.kv_cache_config.kv_cache_groups
        for group, window in zip(groups, self.group_windows, strict=True):
            layers = ", ".join(name.removeprefix("layers.") for name in group.layer_names)
            kind = "full attention" if window is None else f"sliding window {window}"
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
    capped). A request must fit in the pool with that many, or it could never be scheduled.

    Complexity: O(groups).
    """
    total = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = cdiv(num_tokens, spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window - 1 + max_num_batched_tokens
            blocks = min(blocks, cdiv(window, spec.block_size) + 1)
        total += blocks
    return total


def layer_specs(
    windows: Sequence[int | None],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: DTypeLike,
) -> list[KVCacheSpec]:
    """One spec per decoder layer: sliding window W where `windows[i]` is W, else full.

    Raises:
        InvalidArgumentError, KVCacheConfigError: as the specs on construction.
    """
    specs: list[KVCacheSpec] = []
    for window in windows:
        if window is None:
            specs.append(
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    dtype=dtype,
                )
            )
        else:
            specs.append(
                SlidingWindowSpec(
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    dtype=dtype,
                    sliding_window=window,
                )
            )
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
