"""What vLLM 0.33 plans for a model with window or chunked layers, beside a uniform layout.

vLLM 0.8.5, which `pagedkv plan` follows, gives every layer of a hybrid model one block table,
so its window layers keep every token like full-attention ones. vLLM 0.33's hybrid KV cache
manager gives each kind of layer its own groups (`pagedkv.planning.kv_cache_groups`), so a
window layer keeps only its window's blocks. A `HybridLayout` holds both on one GPU's budget:

    uniform    every layer full attention: a block = a page of every layer,
               a request = cdiv(max_model_len, B) blocks
    hybrid     a block = a page of each layer of the largest group,
               a request = the sum over groups of the blocks it holds there
    saved      (uniform request bytes - hybrid request bytes) per request of max_model_len

Windowed and chunked layers keep what is still scheduled besides their window: vLLM 0.33 counts
`max_in_flight_tokens`, max_num_batched_tokens times the batches in flight (2 with async
scheduling, its default). vLLM 0.33 turns its hybrid manager off by default for models with
chunked local attention (Llama-4: a latency regression; `VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_
HYBRID_KV_CACHE=1` turns it on), so such a model runs the uniform layout unless that is set.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from pagedkv.block_counts import cdiv
from pagedkv.planning.byte_sizes import format_bytes
from pagedkv.planning.kv_cache_groups import (
    blocks_per_request,
    get_grouped_kv_cache_config,
    kv_cache_bytes_per_block,
    max_concurrency,
)
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

VLLM_VERSION = "0.33.0"
"""The vLLM release whose hybrid planning this follows (read from its source)."""

ASYNC_SCHEDULING_BATCHES = 2
"""Batches in flight with vLLM 0.33's async scheduling (its default, one pipeline stage)."""

SERVE_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM 0.33's `vllm serve` default max_num_batched_tokens on a GPU of 70 to 160 GiB other than
an A100 (2,048 on smaller GPUs and A100s, 16,384 from 160 GiB)."""

CHUNKED_HYBRID_SWITCH = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1"
"""The environment setting vLLM 0.33 needs to use its hybrid manager for chunked attention."""


def kind_of(spec: KVCacheSpec) -> str:
    """A group's kind in words: "full attention", "sliding window 1,024", "chunked local 8,192".

    Complexity: O(1).
    """
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding window {spec.sliding_window:,}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked local {spec.attention_chunk_size:,}"
    return "full attention"


def layer_indices(names: tuple[str, ...]) -> str:
    """`layers.0, layers.6, layers.12, layers.18, layers.24` as "0, 6, ..., 24" (an even step,
    five or more); other names as they are. Complexity: O(len(names))."""
    indices = [name.removeprefix("layers.") for name in names]
    if not all(index.isdigit() for index in indices):
        return ", ".join(names)
    numbers = [int(index) for index in indices]
    steps = {b - a for a, b in itertools.pairwise(numbers)}
    if len(numbers) > 4 and len(steps) == 1:
        return f"{numbers[0]}, {numbers[1]}, ..., {numbers[-1]}"
    return ", ".join(indices)


@dataclass(frozen=True)
class HybridLayout:
    """vLLM 0.33's grouped KV cache on one GPU, and the uniform layout on the same budget.

    Attributes:
        config: the grouped config (`get_grouped_kv_cache_config`).
        uniform_spec: the full-attention spec every layer has in the uniform layout.
        num_layers: the model's layers on the GPU.
        budget_bytes: the GPU's KV cache budget.
        max_model_len: the longest request.
        max_num_batched_tokens: the most tokens one step schedules.
        max_in_flight_tokens: what windowed and chunked layers keep beyond their window.
        enabled_by_default: vLLM 0.33 uses this layout without being asked (not for chunked
            local attention, see the module docstring).
    """

    config: KVCacheConfig
    uniform_spec: FullAttentionSpec
    num_layers: int
    budget_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    max_in_flight_tokens: int
    enabled_by_default: bool = True

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.config.kv_cache_groups

    @property
    def bytes_per_block(self) -> int:
        """One block id: a page of each layer of the largest group."""
        return kv_cache_bytes_per_block(self.groups)

    @property
    def group_blocks_per_request(self) -> tuple[int, ...]:
        """Blocks one request of max_model_len holds in each group."""
        return tuple(
            blocks_per_request(
                group,
                max_model_len=self.max_model_len,
                max_in_flight_tokens=self.max_in_flight_tokens,
            )
            for group in self.groups
        )

    @property
    def request_blocks(self) -> int:
        """Blocks one request holds in all groups together."""
        return sum(self.group_blocks_per_request)

    @property
    def request_bytes(self) -> int:
        return self.request_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """vLLM 0.33's figure: num_blocks / request_blocks."""
        return max_concurrency(
            self.config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.max_in_flight_tokens,
        )

    @property
    def max_whole_requests(self) -> int:
        """Requests of max_model_len that fit at once (block 0 is the null block)."""
        return (self.config.num_blocks - 1) // self.request_blocks

    @property
    def uniform_bytes_per_block(self) -> int:
        return self.uniform_spec.page_size_bytes * self.num_layers

    @property
    def uniform_num_blocks(self) -> int:
        return self.budget_bytes // self.uniform_bytes_per_block

    @property
    def uniform_request_blocks(self) -> int:
        return cdiv(self.max_model_len, self.uniform_spec.block_size)

    @property
    def uniform_request_bytes(self) -> int:
        return self.uniform_request_blocks * self.uniform_bytes_per_block

    @property
    def uniform_max_concurrency(self) -> float:
        return self.uniform_num_blocks / self.uniform_request_blocks

    @property
    def uniform_max_whole_requests(self) -> int:
        return max(self.uniform_num_blocks - 1, 0) // self.uniform_request_blocks

    @property
    def saved_bytes_per_request(self) -> int:
        """What the hybrid layout saves on each request of max_model_len (< 0: it costs more,
        when windows are no shorter than a request plus the tokens in flight)."""
        return self.uniform_request_bytes - self.request_bytes

    @property
    def more_requests(self) -> int:
        """Whole requests the hybrid layout holds beyond the uniform one."""
        return self.max_whole_requests - self.uniform_max_whole_requests

    def rows(self) -> list[tuple[str, str]]:
        """The layout as (name, value) pairs, after the plan's own rows."""
        largest = max(len(group.layer_names) for group in self.groups)
        in_flight = (
            f"windows keep {self.max_in_flight_tokens:,} tokens in flight "
            f"({self.max_in_flight_tokens // self.max_num_batched_tokens} x "
            f"max_num_batched_tokens {self.max_num_batched_tokens:,})"
        )
        if len(self.groups) == 1:
            layout = f"one KV cache group of {largest} layers; {in_flight}"
        else:
            layout = (
                f"hybrid KV cache manager: {len(self.groups)} groups of up to {largest} "
                f"layers, one pool; {in_flight}"
            )
        if not self.enabled_by_default:
            layout += f"; off by default for chunked local attention ({CHUNKED_HYBRID_SWITCH})"
        rows = [(f"vLLM {VLLM_VERSION}", layout)]
        for index, (group, blocks) in enumerate(
            zip(self.groups, self.group_blocks_per_request, strict=True)
        ):
            rows.append(
                (
                    f"group {index}",
                    f"{kind_of(group.kv_cache_spec)}, {len(group.layer_names)} layers "
                    f"({layer_indices(group.layer_names)}), block size "
                    f"{group.kv_cache_spec.block_size}: {blocks:,} blocks per request",
                )
            )
        saved = self.saved_bytes_per_request
        share = saved / self.uniform_request_bytes
        rows += [
            (
                "hybrid blocks",
                f"{self.config.num_blocks:,} of {format_bytes(self.bytes_per_block)}; "
                f"{self.uniform_num_blocks:,} of {format_bytes(self.uniform_bytes_per_block)} "
                f"uniform",
            ),
            (
                "per request",
                f"{format_bytes(self.request_bytes)} vs {format_bytes(self.uniform_request_bytes)} "
                f"all full attention: {'saves' if saved >= 0 else 'costs'} "
                f"{format_bytes(abs(saved))} ({abs(share):.1%})",
            ),
            (
                "hybrid requests",
                f"{self.max_concurrency:.2f}x ({self.max_whole_requests:,} whole requests) vs "
                f"{self.uniform_max_concurrency:.2f}x ({self.uniform_max_whole_requests:,}) all "
                f"full attention: {self.more_requests:+,} requests",
            ),
        ]
        if any(isinstance(group.kv_cache_spec, SlidingWindowSpec) for group in self.groups):
            rows.append(
                (
                    "retention",
                    f"vLLM {VLLM_VERSION}'s engine caches a window group's blocks only at each "
                    "prompt's replay boundary (prefix_cache_retention_interval=0); pagedkv's "
                    "KVCacheConfig caches every full block unless given an interval",
                )
            )
        return rows

    def as_json(self) -> dict[str, Any]:
        """Every figure `rows` prints, by name (the `hybrid` object of `pagedkv plan --json`)."""
        return {
            "vllm_version": VLLM_VERSION,
            "enabled_by_default": self.enabled_by_default,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "batches_in_flight": self.max_in_flight_tokens // self.max_num_batched_tokens,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            "num_groups": len(self.groups),
            "group_size": max(len(group.layer_names) for group in self.groups),
            "groups": [
                {
                    "kind": kind_of(group.kv_cache_spec),
                    "block_size": group.kv_cache_spec.block_size,
                    "num_layers": len(group.layer_names),
                    "layer_names": list(group.layer_names),
                    "blocks_per_request": blocks,
                }
                for group, blocks in zip(self.groups, self.group_blocks_per_request, strict=True)
            ],
            "num_blocks": self.config.num_blocks,
            "bytes_per_block": self.bytes_per_block,
            "request_blocks": self.request_blocks,
            "request_bytes": self.request_bytes,
            "max_concurrency": self.max_concurrency,
            "max_whole_requests": self.max_whole_requests,
            "uniform_num_blocks": self.uniform_num_blocks,
            "uniform_bytes_per_block": self.uniform_bytes_per_block,
            "uniform_request_blocks": self.uniform_request_blocks,
            "uniform_request_bytes": self.uniform_request_bytes,
            "uniform_max_concurrency": self.uniform_max_concurrency,
            "uniform_max_whole_requests": self.uniform_max_whole_requests,
            "saved_bytes_per_request": self.saved_bytes_per_request,
            "saved_fraction": self.saved_bytes_per_request / self.uniform_request_bytes,
            "more_requests": self.more_requests,
        }


def make_hybrid_layout(
    specs: dict[str, KVCacheSpec],
    budget_bytes: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    batches_in_flight: int = ASYNC_SCHEDULING_BATCHES,
    num_blocks_override: int | None = None,
) -> HybridLayout:
    """vLLM 0.33's layout of `specs` (one GPU's layers) within `budget_bytes`, with the uniform
    layout of the same layers beside it.

    Args:
        specs: layer name -> spec, in model order; every spec an attention spec of one page size.
        budget_bytes: the GPU's KV cache budget.
        max_model_len: the longest request.
        max_num_batched_tokens: the most tokens one step schedules (>= 1).
        batches_in_flight: 2 with vLLM 0.33's async scheduling, 1 without.
        num_blocks_override: use this many blocks, as vLLM's `num_gpu_blocks_override`.

    Raises:
        KVCacheConfigError: vLLM 0.33 would refuse (one request of max_model_len does not fit
            less the null block, or the layers cannot be grouped).
        InvalidArgumentError: a limit < 1.

    Complexity: O(num_layers + groups * log max_model_len).
    """
    if batches_in_flight not in (1, 2):
        raise InvalidArgumentError(f"batches_in_flight must be 1 or 2, got {batches_in_flight!r}")
    if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
        raise InvalidArgumentError(
            f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}"
        )
    in_flight = batches_in_flight * max_num_batched_tokens
    config = get_grouped_kv_cache_config(
        specs,
        budget_bytes,
        max_model_len=max_model_len,
        max_in_flight_tokens=in_flight,
        num_blocks_override=num_blocks_override,
    )
    first = next(iter(specs.values()))
    assert isinstance(first, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))
    uniform = FullAttentionSpec(
        block_size=first.block_size,
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_size,
        dtype=first.dtype,
        use_mla=first.use_mla,
    )
    budget = (
        budget_bytes
        if num_blocks_override is None
        else num_blocks_override * (uniform.page_size_bytes * len(specs))
    )
    chunked = any(isinstance(spec, ChunkedLocalAttentionSpec) for spec in specs.values())
    return HybridLayout(
        config=config,
        uniform_spec=uniform,
        num_layers=len(specs),
        budget_bytes=budget,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_in_flight_tokens=in_flight,
        enabled_by_default=not chunked,
    )
