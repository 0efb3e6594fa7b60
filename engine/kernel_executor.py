"""The CUDA executor: `pagedkv.gpu`'s CuPy kernels, driven thinly, or a dry run of them.

Per step and KV cache group: the slots are checked on the host once (the group's first layer's
write; every layer of a group writes the same slots), and one `plan_step` is made from the
group's host metadata and window (no device-to-host copy) and reused by every layer of the
group's `paged_attention`. A model of one group (a Llama) makes one check and one plan a step.
The kernels have no chunked local attention: an executor over such a layer is refused.
`KernelExecutor` holds that glue; a `KernelLaunches` object does the launching:

    CupyLaunches    `write_kv`, `plan_step`, `paged_attention` on CUDA tensors
    DryRunLaunches  the same `plan_step`; instead of each launch, the checks the kernels' host
                    side makes (shapes, dtypes and device against the plan, slots), a record
                    of the launch, and the torch reference's result, on any device
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from pagedkv.engine.layer_caches import GroupedStepMetadata, LayerCaches
from pagedkv.gpu.attention import paged_attention, plan_step
from pagedkv.gpu.attention_plan import AttentionPlan
from pagedkv.gpu.kv_cache_tensors import LayerKVCache
from pagedkv.gpu.kv_write import write_kv
from pagedkv.gpu.reference import reference_paged_attention, reference_write_kv
from pagedkv.gpu.step_metadata import StepMetadata
from pagedkv.vocab.errors import InvalidArgumentError


class KernelLaunches(Protocol):
    """The three calls the executor makes into `pagedkv.gpu` (or stands in for them)."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        check_slots_on_host: bool,
    ) -> None: ...

    def plan(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        metadata: StepMetadata,
        *,
        sliding_window: int | None = None,
    ) -> AttentionPlan: ...

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
    ) -> torch.Tensor: ...


def _plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    metadata: StepMetadata,
    sliding_window: int | None,
) -> AttentionPlan:
    return plan_step(
        query,
        key_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_table,
        sliding_window=sliding_window,
    )


class CupyLaunches:
    """The kernels themselves: CUDA tensors only."""

    name = "cupy kernels"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        check_slots_on_host: bool,
    ) -> None:
        write_kv(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            check_slots_on_host=check_slots_on_host,
        )

    def plan(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        metadata: StepMetadata,
        *,
        sliding_window: int | None = None,
    ) -> AttentionPlan:
        return _plan(query, key_cache, metadata, sliding_window)

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
    ) -> torch.Tensor:
        out: torch.Tensor = paged_attention(query, key_cache, value_cache, plan, scale=scale)
        return out


@dataclass(frozen=True)
class LaunchRecord:
    """One launch a dry run stood in for.

    Attributes:
        kind: which kernel.
        num_tokens: tokens written, or query tokens attended.
        slots_checked_on_host: (write) whether the slots were checked before it.
        plan: (attention) the plan it would have launched with.
    """

    kind: Literal["write_kv", "paged_attention"]
    num_tokens: int
    slots_checked_on_host: bool = False
    plan: AttentionPlan | None = None


@dataclass
class DryRunLaunches:
    """Everything but the launch: `plan_step`, the host-side checks, a record, the reference.

    Attributes:
        records: every launch stood in for, in order.
        plans: every plan made, in order.
    """

    name: str = "cupy kernels (dry run: torch reference)"
    records: list[LaunchRecord] = field(default_factory=list)
    plans: list[AttentionPlan] = field(default_factory=list)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        check_slots_on_host: bool,
    ) -> None:
        _check_same_device([key, value, key_cache, value_cache, slot_mapping])
        # The reference checks shapes, dtypes, strides and every slot as `write_kv` does.
        reference_write_kv(key, value, key_cache, value_cache, slot_mapping)
        self.records.append(
            LaunchRecord("write_kv", int(slot_mapping.shape[0]), check_slots_on_host)
        )

    def plan(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        metadata: StepMetadata,
        *,
        sliding_window: int | None = None,
    ) -> AttentionPlan:
        plan = _plan(query, key_cache, metadata, sliding_window)
        self.plans.append(plan)
        return plan

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
    ) -> torch.Tensor:
        _check_same_device([query, key_cache, value_cache])
        _check_against_plan(query, key_cache, value_cache, plan)
        metadata = plan.metadata  # what the kernel would read: the plan's host copies
        out = reference_paged_attention(
            query,
            key_cache,
            value_cache,
            torch.from_numpy(metadata.query_start_loc),
            torch.from_numpy(metadata.seq_lens),
            torch.from_numpy(metadata.block_table),
            scale=scale,
            sliding_window=metadata.sliding_window,
        )
        self.records.append(LaunchRecord("paged_attention", metadata.num_query_tokens, plan=plan))
        return out


def _check_same_device(tensors: Sequence[torch.Tensor]) -> None:
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise InvalidArgumentError(f"a launch's tensors must share one device, got {devices}")


def _check_against_plan(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: AttentionPlan
) -> None:
    """The shape and dtype checks `paged_attention` makes against its plan."""
    metadata = plan.metadata
    dtype = str(query.dtype).removeprefix("torch.")
    expected_query = (plan.num_heads, plan.head_size)
    if dtype != plan.dtype or tuple(query.shape[1:]) != expected_query:
        raise InvalidArgumentError(
            f"query is {dtype} {tuple(query.shape)}, the plan is for {plan.dtype} "
            f"[num_tokens, {plan.num_heads}, {plan.head_size}]"
        )
    if query.shape[0] < metadata.num_query_tokens:
        raise InvalidArgumentError(
            f"query has {query.shape[0]} rows, the plan covers {metadata.num_query_tokens}"
        )
    expected_cache = (metadata.num_blocks, metadata.block_size, plan.num_kv_heads, plan.head_size)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tuple(cache.shape) != expected_cache or cache.dtype != query.dtype:
            raise InvalidArgumentError(
                f"{name} is {cache.dtype} {tuple(cache.shape)}, the plan is for {plan.dtype} "
                f"{expected_cache}"
            )


class KernelExecutor(LayerCaches):
    """The executor glue around a `KernelLaunches` (module docstring)."""

    def __init__(self, caches: Sequence[LayerKVCache], launches: KernelLaunches) -> None:
        """Raises:
        InvalidArgumentError: no caches, caches of different shapes, or a layer of chunked
            local attention (the kernels mask by window only).
        """
        super().__init__(caches)
        chunked = [i for i, cache in enumerate(caches) if cache.layout.attention_chunk_size]
        if chunked:
            raise InvalidArgumentError(
                f"layers {chunked} use chunked local attention, which the CUDA kernels do not "
                f"implement: use the reference executor"
            )
        self.launches = launches
        self.name = launches.name
        self._plans: dict[int, AttentionPlan] = {}  # by KV cache group, for the current step
        self._slots_checked: set[int] = set()  # the groups whose slots were checked this step

    def begin_step(self, metadata: StepMetadata | GroupedStepMetadata) -> None:
        super().begin_step(metadata)
        self._plans = {}
        self._slots_checked = set()

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cache = self.layer(layer)
        group = self.group_of(layer)
        self.launches.write_kv(
            key,
            value,
            cache.key,
            cache.value,
            self.step_of(layer).slot_mapping,
            check_slots_on_host=group not in self._slots_checked,
        )
        self._slots_checked.add(group)

    def attention(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        cache = self.layer(layer)
        group = self.group_of(layer)
        plan = self._plans.get(group)
        if plan is None:
            plan = self.launches.plan(
                query, cache.key, self.step_of(layer).host, sliding_window=self.window_of(layer)
            )
            self._plans[group] = plan
        return self.launches.attention(query, cache.key, cache.value, plan, scale=scale)
