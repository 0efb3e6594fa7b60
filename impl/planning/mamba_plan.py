"""Plan a Mamba hybrid's KV cache and states on each GPU, as vLLM 0.33 lays them out.

vLLM 0.8.5, which `pagedkv plan` follows for attention-only models, has no Mamba cache in its
V1 engine, so a model with recurrent layers is planned as vLLM 0.33.0 plans it, on a Hopper GPU
with FlashAttention (the backend vLLM 0.33 picks there), in these steps:

1. `hybrid_block_size` (vLLM's `Platform._align_hybrid_block_size`): the attention block size
   rises to the smallest multiple of the kernel alignment whose page holds one layer's state,
   and each state's page is padded to that attention page, so that every layer's page is the
   same and one block id addresses a page of every group:

       alignment  = max(16, block_size), and with prefix caching a multiple of the state's
                    checkpoint alignment (Qwen3-Next's FlashInfer prefill: 64)
       block_size = max(block_size, alignment * cdiv(state, alignment * attention bytes/token))
                    (that rounded up to a multiple of 16)
       page       = block_size * attention bytes per token >= state

   A model without attention layers keeps its block size and its states' own page.

2. each attention layer gets a `FullAttentionSpec` of that block size, each recurrent layer a
   `MambaSpec` padded to the page; with prefix caching (vLLM 0.33's default) a request holds
   2 states per recurrent layer (the running one and the last at a block boundary), 3 for
   Mamba-2 and for Qwen3-Next on FlashInfer (a prefill checkpoint); without it, 1.
3. the layers are grouped (`pagedkv.planning.kv_cache_groups`): groups of one size, one pool
   of blocks, a block being a page of each layer of a group.

Its command line is `pagedkv plan` (`pagedkv.planning.cli`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedkv.block_counts import cdiv
from pagedkv.planning.byte_sizes import format_bytes
from pagedkv.planning.hybrid_layout import VLLM_VERSION, kind_of, layer_indices
from pagedkv.planning.kv_cache_groups import (
    blocks_per_request,
    check_enough_memory_for_groups,
    estimate_max_model_len_from_groups,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    kv_cache_bytes_per_block,
    max_concurrency,
    max_memory_usage_bytes_from_groups,
)
from pagedkv.planning.mamba_model import (
    ATTENTION_KINDS,
    STATE_KINDS,
    GatedDeltaNetState,
    Mamba1State,
    MambaHybridModel,
)
from pagedkv.planning.plan import PLAN_JSON_SCHEMA, RequestDoesNotFitError
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    attention_page_size_bytes,
    dtype_size,
)

KERNEL_BLOCK_ALIGNMENT = 16
"""The smallest kernel block of FlashAttention (`MultipleOf(16)`): vLLM 0.33 keeps a hybrid's
attention block size a multiple of it."""

GDN_PREFILL_BACKENDS = ("flashinfer", "triton")
"""Qwen3-Next's gated-delta-net prefill kernels: FlashInfer on Hopper (vLLM 0.33's choice
there), Triton elsewhere."""

GDN_CHECKPOINT_ALIGNMENT = 64
"""FlashInfer's gated-delta-net prefill exports states every 64 tokens
(`FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`); with prefix caching vLLM 0.33 makes the block size a
multiple of it and keeps one more state per request for it."""


def hybrid_block_size(
    block_size: int,
    attention_bytes_per_token: int,
    state_bytes: int,
    *,
    checkpoint_alignment: int | None = None,
) -> int:
    """The attention block size vLLM 0.33 gives a Mamba hybrid (`_align_hybrid_block_size`):
    the smallest multiple of the alignment whose page holds `state_bytes`, never below
    `block_size` (see the module docstring).

    Args:
        block_size: the configured block size (16 by default).
        attention_bytes_per_token: one token of one attention layer on one GPU.
        state_bytes: one recurrent layer's state for one request on one GPU.
        checkpoint_alignment: with prefix caching, the tokens between the states a prefill
            checkpoints (None: any).

    Raises:
        InvalidArgumentError: a size < 1.

    Complexity: O(1).
    """
    for name, value in (
        ("block_size", block_size),
        ("attention_bytes_per_token", attention_bytes_per_token),
        ("state_bytes", state_bytes),
        ("checkpoint_alignment", 1 if checkpoint_alignment is None else checkpoint_alignment),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    alignment = max(KERNEL_BLOCK_ALIGNMENT, block_size)
    if checkpoint_alignment is not None:
        alignment = math.lcm(alignment, checkpoint_alignment)
    needed = alignment * cdiv(state_bytes, alignment * attention_bytes_per_token)
    needed = KERNEL_BLOCK_ALIGNMENT * cdiv(needed, KERNEL_BLOCK_ALIGNMENT)
    return max(block_size, needed)


def _count(number: int, noun: str) -> str:
    """ "1 layer", "4 layers"."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def _layer_number(name: str) -> str:
    """`layers.4.attn` -> `layers.4` (what `layer_indices` shortens)."""
    return name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class MambaPlan:
    """One GPU's KV cache and recurrent states for a Mamba hybrid, as vLLM 0.33 lays them out.

    Attributes:
        model: the model.
        budget_bytes: memory for the KV cache and states on each GPU.
        max_model_len: the longest request.
        config: the grouped config (every layer's page of one size, one pool of blocks).
        block_size: the attention block size after `hybrid_block_size`.
        configured_block_size: the block size asked for.
        tensor_parallel_size: GPUs sharing every layer.
        prefix_caching: vLLM's prefix caching (its Mamba "align" mode) is on.
        gdn_prefill_backend: Qwen3-Next's prefill kernel (only it reads this).
        max_num_batched_tokens: the most tokens one step computes (None: max_model_len); no
            attention or state layer's memory depends on it.
        notes: what the plan assumed, one sentence each.
    """

    model: MambaHybridModel
    budget_bytes: int
    max_model_len: int
    config: KVCacheConfig
    block_size: int
    configured_block_size: int
    tensor_parallel_size: int = 1
    prefix_caching: bool = True
    gdn_prefill_backend: str = "flashinfer"
    max_num_batched_tokens: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.config.kv_cache_groups

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer, attention or state."""
        return self.groups[0].kv_cache_spec.page_size_bytes

    @property
    def state_spec(self) -> MambaSpec:
        """The spec every recurrent layer has."""
        spec = next(
            group.kv_cache_spec
            for group in self.groups
            if isinstance(group.kv_cache_spec, MambaSpec)
        )
        assert isinstance(spec, MambaSpec)  # a Mamba hybrid has at least one recurrent layer
        return spec

    @property
    def state_bytes(self) -> int:
        """One recurrent layer's state for one request, before padding."""
        return self.model.state_bytes(self.tensor_parallel_size)

    @property
    def state_padding_bytes(self) -> int:
        """What padding adds to each state's page."""
        return self.page_size_bytes - self.state_bytes

    @property
    def num_kv_heads_per_gpu(self) -> int | None:
        attention = self.model.attention
        return (
            None if attention is None else attention.num_kv_heads_per_gpu(self.tensor_parallel_size)
        )

    @property
    def bytes_per_token(self) -> int:
        """One token of every attention layer (the states cost nothing per token)."""
        return self.page_size_bytes // self.block_size * len(self.model.attention_layers)

    @property
    def bytes_per_block(self) -> int:
        """One block id: a page of each layer of the largest group."""
        return kv_cache_bytes_per_block(self.groups)

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def group_blocks_per_request(self) -> tuple[int, ...]:
        """Blocks one request of max_model_len holds in each group."""
        return tuple(
            blocks_per_request(
                group, max_model_len=self.max_model_len, max_in_flight_tokens=self.max_model_len
            )
            for group in self.groups
        )

    @property
    def request_blocks(self) -> int:
        return sum(self.group_blocks_per_request)

    @property
    def request_bytes(self) -> int:
        return self.request_blocks * self.bytes_per_block

    @property
    def state_request_bytes(self) -> int:
        """What one request's states take in the pool (their groups' blocks)."""
        return self.bytes_per_block * sum(
            blocks
            for group, blocks in zip(self.groups, self.group_blocks_per_request, strict=True)
            if isinstance(group.kv_cache_spec, MambaSpec)
        )

    @property
    def max_concurrency(self) -> float:
        """vLLM 0.33's figure: num_blocks / the blocks one request holds in all groups."""
        return max_concurrency(
            self.config, max_model_len=self.max_model_len, max_in_flight_tokens=self.max_model_len
        )

    @property
    def capacity_tokens(self) -> int:
        """vLLM 0.33's "KV cache size": max concurrency times max_model_len, rounded down."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def max_whole_requests(self) -> int:
        """Requests of max_model_len that fit at once; block 0 is the null block."""
        return (self.num_blocks - 1) // self.request_blocks

    @property
    def all_notes(self) -> tuple[str, ...]:
        """The model's notes, the caller's, then how vLLM 0.33 was assumed to run it."""
        caching = (
            f"prefix caching on (mamba_cache_mode align): a request keeps "
            f"{self._states_per_request()}"
            if self.prefix_caching
            else "prefix caching off (mamba_cache_mode none): a request keeps one state per layer"
        )
        setting = f"FlashAttention on a Hopper GPU, {caching}"
        if isinstance(self.model.state, GatedDeltaNetState):
            setting += f"; {self.gdn_prefill_backend} gated-delta-net prefill"
        return (
            *self.model.notes,
            *self.notes,
            f"planned as vLLM {VLLM_VERSION} plans Mamba hybrids (vLLM 0.8.5's V1 engine has "
            f"none): {setting}",
        )

    def _states_per_request(self) -> str:
        count = self.state_spec.blocks_per_request
        parts = ["the running one", "the last at a block boundary", "a prefill checkpoint"]
        return f"{count} states per layer ({', '.join(parts[:count])})"

    def _group_rows(self) -> list[tuple[str, str]]:
        """One row per group of attention, one per run of equal state groups."""
        rows: list[tuple[str, str]] = []
        entries = list(zip(self.groups, self.group_blocks_per_request, strict=True))
        index = 0
        while index < len(entries):
            group, blocks = entries[index]
            spec = group.kv_cache_spec
            end = index + 1
            if isinstance(spec, MambaSpec):
                while end < len(entries) and entries[end][0].kv_cache_spec == spec:
                    end += 1
            runs = entries[index:end]
            if len(runs) == 1:
                names = tuple(_layer_number(name) for name in group.layer_names)
                kind = self.model.state.name if isinstance(spec, MambaSpec) else kind_of(spec)
                rows.append(
                    (
                        f"group {index}",
                        f"{kind}, {_count(len(names), 'layer')} ({layer_indices(names)}), "
                        f"block size {spec.block_size:,}: {blocks:,} blocks per request",
                    )
                )
            else:
                layers = sum(len(run[0].layer_names) for run in runs)
                sizes = sorted({len(run[0].layer_names) for run in runs}, reverse=True)
                rows.append(
                    (
                        f"groups {index}-{end - 1}",
                        f"{self.model.state.name}, {layers} layers in {len(runs)} groups of "
                        f"{' or '.join(map(str, sizes))}, block size {spec.block_size:,}: "
                        f"{blocks:,} blocks per request in each",
                    )
                )
            index = end
        return rows

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (name, value) pairs, in the order `format` prints them."""
        rows = [("model", self.model.describe())]
        if self.tensor_parallel_size > 1:
            heads = self.num_kv_heads_per_gpu
            attention = "" if heads is None else f"{heads} KV heads and "
            rows.append(
                (
                    "tensor parallel",
                    f"{self.tensor_parallel_size} GPUs, {attention}1/{self.tensor_parallel_size} "
                    f"of each state on each; sizes, budget and blocks below per GPU",
                )
            )
        rows += [("note", note) for note in self.all_notes]
        rows.append(("state", self.model.describe_state(self.tensor_parallel_size)))
        raised = (
            f" (raised from {self.configured_block_size}: an attention page holds a state)"
            if self.block_size != self.configured_block_size
            else ""
        )
        rows.append(("block size", f"{self.block_size:,} tokens{raised}"))
        padding = self.state_padding_bytes
        padded = (
            f"; each state padded by {padding:,} bytes ({padding / self.state_bytes:.2%})"
            if padding
            else ""
        )
        rows.append(("page size", f"{format_bytes(self.page_size_bytes)} per layer{padded}"))
        if self.model.attention_layers:
            rows.append(
                (
                    "bytes per token",
                    f"{format_bytes(self.bytes_per_token)} over "
                    f"{_count(len(self.model.attention_layers), 'attention layer')}",
                )
            )
        largest = max(len(group.layer_names) for group in self.groups)
        rows += [
            ("KV budget", format_bytes(self.budget_bytes)),
            (
                f"vLLM {VLLM_VERSION}",
                f"one KV cache group of {_count(largest, 'layer')}"
                if len(self.groups) == 1
                else f"hybrid KV cache manager: {len(self.groups)} groups of up to "
                f"{_count(largest, 'layer')}, one pool",
            ),
            *self._group_rows(),
            (
                "blocks",
                f"{self.num_blocks:,} of {format_bytes(self.bytes_per_block)}, a page of each "
                f"layer of a group (block 0 is the null block)",
            ),
            (
                "max_model_len",
                f"{self.max_model_len:,} tokens ({self.request_blocks:,} blocks per request: "
                f"{format_bytes(self.request_bytes)}, states "
                f"{format_bytes(self.state_request_bytes)})",
            ),
            ("KV capacity", f"{self.capacity_tokens:,} tokens (max concurrency x max_model_len)"),
            (
                "max concurrency",
                f"{self.max_concurrency:.2f}x ({self.max_whole_requests:,} whole requests at once)",
            ),
        ]
        return rows

    def format(self) -> str:
        """The plan as aligned `name  value` lines."""
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def as_json(self) -> dict[str, Any]:
        """Every figure `format` prints, by name (`pagedkv plan --json`, less `memory`): the
        keys of an attention plan where they mean the same, vLLM 0.33's layout in `mamba`."""
        spec = self.state_spec
        return {
            "schema": PLAN_JSON_SCHEMA,
            "fits": True,
            "model": self.model.as_json(self.tensor_parallel_size),
            "tensor_parallel_size": self.tensor_parallel_size,
            "num_kv_heads_per_gpu": self.num_kv_heads_per_gpu,
            "planned_as_full_attention": False,
            "notes": list(self.all_notes),
            "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes,
            "block_bytes": self.bytes_per_block,
            "bytes_per_token": self.bytes_per_token,
            "kv_budget_bytes": self.budget_bytes,
            "num_blocks": self.num_blocks,
            "kv_capacity_tokens": self.capacity_tokens,
            "max_model_len": self.max_model_len,
            "blocks_per_request": self.request_blocks,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_concurrency": self.max_concurrency,
            "max_whole_requests": self.max_whole_requests,
            "hybrid": None,
            "hybrid_refusal": None,
            "mamba": {
                "vllm_version": VLLM_VERSION,
                "prefix_caching": self.prefix_caching,
                "mamba_cache_mode": spec.mamba_cache_mode,
                "gdn_prefill_backend": (
                    self.gdn_prefill_backend
                    if isinstance(self.model.state, GatedDeltaNetState)
                    else None
                ),
                "configured_block_size": self.configured_block_size,
                "state_bytes": self.state_bytes,
                "state_padding_bytes": self.state_padding_bytes,
                "states_per_request": spec.blocks_per_request,
                "num_groups": len(self.groups),
                "group_size": max(len(group.layer_names) for group in self.groups),
                "groups": [
                    {
                        "kind": (
                            spec_of.mamba_type
                            if isinstance(spec_of := group.kv_cache_spec, MambaSpec)
                            else kind_of(spec_of)
                        ),
                        "block_size": group.kv_cache_spec.block_size,
                        "num_layers": len(group.layer_names),
                        "layer_names": list(group.layer_names),
                        "blocks_per_request": blocks,
                    }
                    for group, blocks in zip(
                        self.groups, self.group_blocks_per_request, strict=True
                    )
                ],
                "bytes_per_block": self.bytes_per_block,
                "request_blocks": self.request_blocks,
                "request_bytes": self.request_bytes,
                "state_request_bytes": self.state_request_bytes,
            },
        }


def mamba_kv_cache_specs(
    model: MambaHybridModel,
    *,
    block_size: int,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    prefix_caching: bool = True,
    gdn_prefill_backend: str = "flashinfer",
) -> tuple[dict[str, KVCacheSpec], int]:
    """One GPU's layer specs as vLLM 0.33 builds them, and the attention block size.

    Each attention layer is `layers.{i}.attn`, each recurrent layer `layers.{i}.mamba` (a
    Falcon-H1 layer has both, attention first), in model order.

    Raises:
        InvalidArgumentError: a tensor-parallel split vLLM refuses (see
            `ModelShape.num_kv_heads_per_gpu` and `RecurrentState.shapes`), an unknown
            gated-delta-net prefill backend, or a size < 1.

    Complexity: O(layers).
    """
    if gdn_prefill_backend not in GDN_PREFILL_BACKENDS:
        raise InvalidArgumentError(
            f"gdn_prefill_backend must be one of {', '.join(GDN_PREFILL_BACKENDS)}, got "
            f"{gdn_prefill_backend!r}"
        )
    tp = tensor_parallel_size
    state = model.state
    exports_checkpoints = prefix_caching and (
        not isinstance(state, GatedDeltaNetState) or gdn_prefill_backend == "flashinfer"
    )
    state_bytes = model.state_bytes(tp)
    attention = model.attention
    specs: dict[str, KVCacheSpec] = {}
    attention_spec = None
    page = state_bytes
    attention_block = block_size
    if attention is not None:
        heads = attention.num_kv_heads_per_gpu(tp)
        per_token = attention_page_size_bytes(
            1, heads, attention.head_size, dtype_size(attention.dtype), False
        )
        alignment = (
            GDN_CHECKPOINT_ALIGNMENT
            if exports_checkpoints and isinstance(state, GatedDeltaNetState)
            else None
        )
        attention_block = hybrid_block_size(
            block_size, per_token, state_bytes, checkpoint_alignment=alignment
        )
        page = attention_block * per_token
        attention_spec = FullAttentionSpec(
            block_size=attention_block,
            num_kv_heads=heads,
            head_size=attention.head_size,
            dtype=attention.dtype,
        )
    state_spec = MambaSpec(
        block_size=attention_block if prefix_caching else max_model_len,
        shapes=model.state_shapes(tp),
        dtypes=model.state_dtypes,
        page_size_padded=None if page == state_bytes else page,
        mamba_type=state.mamba_type,
        mamba_cache_mode="align" if prefix_caching else "none",
        num_prefill_checkpoint_blocks=(
            0 if isinstance(state, Mamba1State) or not exports_checkpoints else 1
        ),
    )
    for index, kind in enumerate(model.layer_types):
        if kind in ATTENTION_KINDS and attention_spec is not None:
            specs[f"layers.{index}.attn"] = attention_spec
        if kind in STATE_KINDS:
            specs[f"layers.{index}.mamba"] = state_spec
    return specs, attention_block


def make_mamba_plan(
    model: MambaHybridModel,
    budget_bytes: int,
    *,
    block_size: int = 16,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_blocks_override: int | None = None,
    tensor_parallel_size: int = 1,
    notes: Iterable[str] = (),
    prefix_caching: bool = True,
    gdn_prefill_backend: str = "flashinfer",
) -> MambaPlan:
    """The plan for `model` within `budget_bytes` on each of `tensor_parallel_size` GPUs.

    Specs (`mamba_kv_cache_specs`), groups (`get_kv_cache_groups`), vLLM 0.33's start-up check
    (one request of max_model_len in the budget less the null block), then `budget //
    bytes_per_block` blocks (or `num_blocks_override`).

    Raises:
        RequestDoesNotFitError: one request of max_model_len does not fit (the message names
            the largest max_model_len that does).
        InvalidArgumentError: a size, limit, override or split out of its domain.

    Complexity: O(num_layers + groups * log max_model_len).
    """
    for name, value in (("max_model_len", max_model_len), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if num_blocks_override is not None and (
        not isinstance(num_blocks_override, int)
        or isinstance(num_blocks_override, bool)
        or num_blocks_override < 1
    ):
        raise InvalidArgumentError(
            f"num_blocks_override must be an int >= 1, got {num_blocks_override!r}"
        )
    specs, attention_block = mamba_kv_cache_specs(
        model,
        block_size=block_size,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        prefix_caching=prefix_caching,
        gdn_prefill_backend=gdn_prefill_backend,
    )
    groups = get_kv_cache_groups(specs)
    per_block = kv_cache_bytes_per_block(groups)
    available = budget_bytes if num_blocks_override is None else num_blocks_override * per_block
    limits = {"max_model_len": max_model_len, "max_in_flight_tokens": max_model_len}
    try:
        check_enough_memory_for_groups(groups, available, **limits)
    except KVCacheConfigError as error:
        raise RequestDoesNotFitError(
            str(error),
            max_model_len=max_model_len,
            needed_bytes=max_memory_usage_bytes_from_groups(groups, **limits),
            available_bytes=available,
            largest_max_model_len=estimate_max_model_len_from_groups(
                groups, max(available - per_block, 0), **limits
            ),
            planned_as_full_attention=False,
        ) from None
    return MambaPlan(
        model=model,
        budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        config=get_kv_cache_config_from_groups(groups, available // per_block),
        block_size=attention_block,
        configured_block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        prefix_caching=prefix_caching,
        gdn_prefill_backend=gdn_prefill_backend,
        max_num_batched_tokens=(
            max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        ),
        notes=tuple(notes),
    )
