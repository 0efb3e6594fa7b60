"""How one step's attention is cut into CTAs: the work list and the split-KV decision.

Host-only and pure (NumPy), so it is tested on CPU. Each work item is (sequence, first row):
rows of a sequence are (token, head-in-group) pairs, `row = token * group_size + head`, and one
CTA takes `traits.rows` consecutive rows of one KV head (16 for the tensor-core kernel, 8 for the
SIMT one), so a decode step of a GQA group of up to that many query heads reads that KV head's
pages once. The grid is (work items, KV heads, splits).

Split-KV: when items x KV heads leave the device's resident slots idle, every CTA's key range
is cut into `num_splits` chunks, each CTA writes an fp32 partial output and log-sum-exp, and a
merge kernel combines them. The rule (`choose_num_splits`): the largest split count whose grid
still fits in one wave of resident CTAs, at most `MAX_SPLITS`, and no more than the longest range
has `MIN_KEYS_PER_SPLIT`-key chunks. The kernel deals each range's tiles out evenly, so two splits
of one CTA differ by at most one tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.gpu.attention_metadata import AttentionMetadata
from pagedkv.gpu.kernel_variants import AttentionKernel, AttentionTraits, attention_traits
from pagedkv.vocab.errors import InvalidArgumentError

MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


@dataclass(frozen=True)
class DeviceLimits:
    """What the split policy needs to know about the device.

    Attributes:
        num_sms: streaming multiprocessors.
        shared_memory_per_sm: bytes of shared memory one SM gives its resident CTAs.
    """

    num_sms: int = 132
    shared_memory_per_sm: int = 228 * 1024

    def __post_init__(self) -> None:
        if self.num_sms < 1 or self.shared_memory_per_sm < 1:
            raise InvalidArgumentError(f"device limits must be positive, got {self}")

    def resident_ctas(self, smem_bytes: int, max_ctas_per_sm: int) -> int:
        """CTAs one SM holds at once: shared memory (1 KiB reserved per CTA, in 128-byte
        units, as `occupancy.ctas_per_sm` counts it) or the launch bounds' CTAs per SM,
        whichever is fewer (at least 1)."""
        per_cta = -(-(smem_bytes + 1024) // 128) * 128
        return max(1, min(max_ctas_per_sm, self.shared_memory_per_sm // per_cta))


H200 = DeviceLimits(num_sms=132, shared_memory_per_sm=228 * 1024)


def choose_num_splits(num_ctas: int, max_keys: int, resident_ctas: int) -> int:
    """Splits per CTA so that a small batch still fills the device.

    Args:
        num_ctas: CTAs without splitting (work items x KV heads).
        max_keys: the longest key range of any CTA.
        resident_ctas: CTAs the whole device holds at once.

    Returns:
        `floor(resident_ctas / num_ctas)` (the most splits whose grid is still one wave: never
        a near-empty second wave), at most `MAX_SPLITS` and at most
        `max_keys // MIN_KEYS_PER_SPLIT`; at least 1.

    Complexity: O(1).
    """
    if num_ctas <= 0:
        return 1
    return max(1, min(MAX_SPLITS, resident_ctas // num_ctas, max_keys // MIN_KEYS_PER_SPLIT))


def split_tiles(range_tiles: int, num_splits: int, split: int) -> tuple[int, int]:
    """Tiles `[first, stop)` of a `range_tiles`-tile key range that split `split` reads: the
    kernel's even deal (splits differ by at most one tile). Complexity: O(1)."""
    return split * range_tiles // num_splits, (split + 1) * range_tiles // num_splits


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Everything a launch needs besides the tensors. Build with `plan_attention`.

    Attributes:
        metadata: the validated step metadata.
        num_heads: query heads.
        num_kv_heads: KV heads (divides num_heads).
        head_size: elements per head.
        dtype: query/cache dtype name.
        traits: the kernel variant's launch constants.
        work_seq: int32 [num_work], the sequence of each work item, longest key range first.
        work_row: int32 [num_work], its first row.
        work_keys: int64 [num_work], keys each item reads (before splitting).
        num_splits: key-range chunks per item (1: no split, no merge kernel).
        device_cache: per-device uploads of the arrays above, filled by the launcher.
    """

    metadata: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    traits: AttentionTraits
    work_seq: np.ndarray[Any, np.dtype[np.int32]]
    work_row: np.ndarray[Any, np.dtype[np.int32]]
    work_keys: np.ndarray[Any, np.dtype[np.int64]]
    num_splits: int
    device_cache: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_work(self) -> int:
        return int(self.work_seq.shape[0])

    @property
    def grid(self) -> tuple[int, int, int]:
        """(work items, KV heads, splits)."""
        return (self.num_work, self.num_kv_heads, self.num_splits)

    @property
    def kv_tokens_read(self) -> int:
        """Key positions read per KV head, summed over work items (for bandwidth reports)."""
        return int(self.work_keys.sum())


def plan_attention(
    metadata: AttentionMetadata,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: str,
    limits: DeviceLimits = H200,
    num_splits: int | None = None,
    kernel: AttentionKernel | None = None,
) -> AttentionPlan:
    """Cut a step into work items and decide the split.

    Args:
        metadata: from `validate_metadata`.
        num_heads: query heads (a multiple of num_kv_heads).
        num_kv_heads: KV heads.
        head_size: 64, 128 or 256.
        dtype: "float16", "bfloat16" or "float32".
        limits: the device, for the split policy.
        num_splits: force a split count (1..MAX_SPLITS), e.g. in tests; None: the policy.
        kernel: "mma" or "simt"; None: "mma" for fp16/bf16, "simt" for fp32.

    Returns:
        The plan; its work list covers every query row exactly once.

    Raises:
        InvalidArgumentError: bad head counts, an unsupported variant, a bad num_splits.

    Complexity: O(num_work log num_work).
    """
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise InvalidArgumentError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    traits = attention_traits(dtype, head_size, kernel)
    group = num_heads // num_kv_heads
    query_lens = metadata.query_lens.astype(np.int64)
    context = metadata.seq_lens.astype(np.int64) - query_lens
    items_per_seq = -(-query_lens * group // traits.rows)
    work_seq = np.repeat(np.arange(metadata.num_seqs, dtype=np.int64), items_per_seq)
    first_item = np.cumsum(items_per_seq) - items_per_seq
    work_row = (np.arange(work_seq.shape[0], dtype=np.int64) - first_item[work_seq]) * traits.rows
    last_row = np.minimum(work_row + traits.rows, query_lens[work_seq] * group) - 1
    first_pos = context[work_seq] + work_row // group
    last_pos = context[work_seq] + last_row // group
    if metadata.sliding_window is None:
        work_keys = last_pos + 1
    else:
        work_keys = last_pos + 1 - np.maximum(first_pos - metadata.sliding_window + 1, 0)
    order = np.argsort(-work_keys, kind="stable")
    if num_splits is None:
        per_sm = limits.resident_ctas(traits.smem_bytes, traits.min_ctas_per_sm)
        resident = limits.num_sms * per_sm
        max_keys = int(work_keys.max()) if work_keys.size else 0
        num_splits = choose_num_splits(work_seq.shape[0] * num_kv_heads, max_keys, resident)
    return AttentionPlan(
        metadata=metadata,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        traits=traits,
        work_seq=work_seq[order].astype(np.int32),
        work_row=work_row[order].astype(np.int32),
        work_keys=work_keys[order].astype(np.int64),
        num_splits=num_splits,
    )
