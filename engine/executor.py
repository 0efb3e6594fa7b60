"""The attention executor: what the model runner asks of the paged KV cache, layer by layer.

Per step the runner calls `begin_step` once with the step's metadata (slot mapping, block
table, sequence lengths, query offsets: `pagedkv.gpu.build_step_metadata`; for a model of
several KV cache groups, one such metadata per group and each layer's group:
`GroupedStepMetadata`), then for each layer `write_kv` (the step's new K/V rows into their
slots) and `attention` (each new token's query over its sequence's cached keys, through the
block table, within the layer's sliding window if it has one). Two implementations:

    TorchReferenceExecutor   `pagedkv.gpu.reference_*` on torch tensors, CPU or GPU
    KernelExecutor           the CuPy kernels (`write_kv`, `plan_step`, `paged_attention`) on
                             CUDA; with `DryRunLaunches` it builds and checks every launch's
                             arguments on any device and computes through the reference
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias

from pagedkv.vocab.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from pagedkv.engine.layer_caches import GroupedStepMetadata
    from pagedkv.gpu.kv_cache_tensors import LayerKVCache
    from pagedkv.gpu.step_metadata import StepMetadata

ExecutorName: TypeAlias = Literal["reference", "cupy", "cupy-dry-run"]
EXECUTOR_NAMES: tuple[ExecutorName, ...] = ("reference", "cupy", "cupy-dry-run")


class AttentionExecutor(Protocol):
    """Paged K/V writes and paged attention for the layers of one model."""

    @property
    def name(self) -> str: ...

    def begin_step(self, metadata: StepMetadata | GroupedStepMetadata) -> None:
        """Take this step's metadata (host arrays); every layer of the step uses it (or, for
        grouped metadata, its group's)."""
        ...

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's keys and values, [num_tokens, num_kv_heads, head_size], to their
        slots of layer `layer`'s cache."""
        ...

    def attention(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the step's queries, [num_tokens, num_heads, head_size], over layer
        `layer`'s cache; returns the same shape."""
        ...


ExecutorFactory: TypeAlias = "Callable[[Sequence[LayerKVCache]], AttentionExecutor]"
"""Makes an executor over the per-layer caches (one per layer, in layer order)."""


def make_executor(name: ExecutorName, caches: Sequence[LayerKVCache]) -> AttentionExecutor:
    """The executor called `name` over `caches` (one per layer, in layer order).

    Raises:
        InvalidArgumentError: an unknown name or no caches.
    """
    if not caches:
        raise InvalidArgumentError("an executor needs at least one layer's cache")
    if name == "reference":
        from pagedkv.engine.torch_executor import TorchReferenceExecutor

        return TorchReferenceExecutor(caches)
    if name in ("cupy", "cupy-dry-run"):
        from pagedkv.engine.kernel_executor import CupyLaunches, DryRunLaunches, KernelExecutor

        return KernelExecutor(
            caches, DryRunLaunches() if name == "cupy-dry-run" else CupyLaunches()
        )
    raise InvalidArgumentError(f"executor must be one of {EXECUTOR_NAMES}, got {name!r}")
