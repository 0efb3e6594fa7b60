"""Random paged batches with a dense twin: the inputs of every attention check.

Each sequence's K/V is drawn densely, then laid out page by page into a cache whose pages are a
random permutation of the pool, the way a long-running block pool scatters them. Everything the
kernels must never read holds NaN: unwritten slots past seq_len, spare pages, block 0 (the null
block), and, under a sliding window, pages wholly before the window (they are set to block 0 in
the table, as the manager does). `dense_attention` computes the expected output from the dense
copies with `torch.nn.functional.scaled_dot_product_attention` and an explicit mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.gpu.step_metadata import NULL_BLOCK_ID
from pagedkv.vocab.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from pagedkv.gpu.attention_plan import AttentionPlan
    from pagedkv.gpu.reference import ReferenceTerms


@dataclass(frozen=True)
class BatchShape:
    """The shape of one synthetic step.

    Attributes:
        query_lens: new tokens per sequence.
        seq_lens: tokens per sequence, new ones included (>= query_lens).
        num_heads: query heads.
        num_kv_heads: KV heads.
        head_size: elements per head.
        block_size: tokens per page.
        sliding_window: window in tokens, or None.
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.seq_lens) or any(
            q > s or q < 0 for q, s in zip(self.query_lens, self.seq_lens, strict=True)
        ):
            raise InvalidArgumentError(f"bad query_lens/seq_lens: {self}")

    @property
    def pages_per_seq(self) -> tuple[int, ...]:
        return tuple(-(-s // self.block_size) for s in self.seq_lens)


@dataclass(frozen=True, eq=False)
class SyntheticBatch:
    """One step's tensors, all on one device.

    Attributes:
        shape: what was drawn.
        query: [sum(query_lens), num_heads, head_size].
        keys, values: per sequence, dense [seq_len, num_kv_heads, head_size].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], NaN where
            no token was written.
        query_start_loc, seq_lens, block_table: int32 metadata.
        slot_mapping: int64, the slot of every token of every sequence, in order.
    """

    shape: BatchShape
    query: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def make_batch(
    shape: BatchShape,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    table_padding: int = 2,
) -> SyntheticBatch:
    """Draw a batch (standard normal K, V and queries) and lay it out into a NaN-poisoned paged
    cache (`lay_out_batch`).

    Args:
        shape: the step.
        dtype: the K/V/query dtype.
        device: where the tensors live.
        seed: the random seed (CPU generator: the same data on every device).
        spare_blocks: pool pages no sequence uses (left NaN).
        table_padding: extra block_table columns, filled with out-of-range ids that must be
            ignored because they are never read.

    Complexity: O(total tokens * num_kv_heads * head_size).
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    heads = (shape.num_kv_heads, shape.head_size)
    num_blocks = 1 + sum(shape.pages_per_seq) + spare_blocks
    permutation = torch.randperm(num_blocks - 1, generator=generator) + 1
    keys, values = [], []
    for seq_len in shape.seq_lens:
        keys.append(torch.randn((seq_len, *heads), generator=generator))
        values.append(torch.randn((seq_len, *heads), generator=generator))
    query = torch.randn(
        (sum(shape.query_lens), shape.num_heads, shape.head_size), generator=generator
    )
    return lay_out_batch(
        shape,
        keys,
        values,
        query,
        dtype=dtype,
        device=device,
        pages=permutation.tolist(),
        table_padding=table_padding,
    )


def lay_out_batch(
    shape: BatchShape,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query: torch.Tensor,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    pages: Sequence[int],
    table_padding: int = 2,
) -> SyntheticBatch:
    """Lay given K, V and queries out into a NaN-poisoned paged cache, as a block pool would.

    Args:
        shape: the step.
        keys, values: per sequence, [seq_len, num_kv_heads, head_size] (any float dtype; rounded
            to `dtype`).
        query: [sum(query_lens), num_heads, head_size] (likewise).
        dtype: the K/V/query dtype.
        device: where the tensors live.
        pages: the pool's pages other than block 0, in the order sequences take them from the
            end (a permutation of 1 .. num_blocks - 1; pages left over stay NaN).
        table_padding: extra block_table columns of out-of-range ids (never read).

    Raises:
        InvalidArgumentError: a tensor's shape does not match `shape`, or too few pages.

    Complexity: O(total tokens * num_kv_heads * head_size).
    """
    import torch

    heads = (shape.num_kv_heads, shape.head_size)
    per_seq = shape.pages_per_seq
    if len(pages) < sum(per_seq) or len(keys) != len(per_seq) or len(values) != len(per_seq):
        raise InvalidArgumentError(f"{len(pages)} pages or the K/V count do not fit {shape}")
    if tuple(query.shape) != (sum(shape.query_lens), shape.num_heads, shape.head_size):
        raise InvalidArgumentError(f"query shape {tuple(query.shape)} does not fit {shape}")
    num_blocks = 1 + len(pages)
    free = list(pages)
    key_cache = torch.full((num_blocks, shape.block_size, *heads), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    width = max(per_seq, default=0) + table_padding
    block_table = torch.full((len(per_seq), max(width, 1)), num_blocks + 7, dtype=torch.int32)
    laid_keys, laid_values, slots = [], [], []
    for seq, (seq_len, q_len) in enumerate(zip(shape.seq_lens, shape.query_lens, strict=True)):
        if tuple(keys[seq].shape) != (seq_len, *heads) or values[seq].shape != keys[seq].shape:
            raise InvalidArgumentError(f"sequence {seq}: K/V must be {(seq_len, *heads)}")
        key, value = keys[seq].to(dtype), values[seq].to(dtype)
        blocks = torch.tensor([free.pop() for _ in range(per_seq[seq])], dtype=torch.int64)
        positions = torch.arange(seq_len)
        key_cache[blocks[positions // shape.block_size], positions % shape.block_size] = key
        value_cache[blocks[positions // shape.block_size], positions % shape.block_size] = value
        slots.append(
            blocks[positions // shape.block_size] * shape.block_size + positions % shape.block_size
        )
        if shape.sliding_window is not None:
            read_start = max(0, seq_len - q_len - shape.sliding_window + 1)
            blocks[: read_start // shape.block_size] = NULL_BLOCK_ID
        block_table[seq, : per_seq[seq]] = blocks.to(torch.int32)
        laid_keys.append(key.to(device))
        laid_values.append(value.to(device))
    query_start_loc = torch.zeros(len(per_seq) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(shape.query_lens, dtype=torch.int32), 0)
    return SyntheticBatch(
        shape=shape,
        query=query.to(dtype).to(device),
        keys=tuple(laid_keys),
        values=tuple(laid_values),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(shape.seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device) if slots else torch.zeros(0, dtype=torch.int64),
    )


def visibility_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[query_len, seq_len] bool: query j (at seq_len - query_len + j) may see key p.

    Bottom-right causal: p <= position; with a window W also p > position - W.
    """
    import torch

    positions = torch.arange(seq_len, device=device)[None, :]
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    mask = positions <= query_positions
    if sliding_window is not None:
        mask &= positions > query_positions - sliding_window
    return mask


def dense_attention(batch: SyntheticBatch, scale: float | None = None) -> torch.Tensor:
    """The expected output, from the dense K/V through SDPA (GQA, fp32), [tokens, heads, dim].

    Complexity: O(sum of query_len * seq_len * num_heads * head_size).
    """
    import torch
    import torch.nn.functional as F  # noqa: N812 - the usual name

    shape = batch.shape
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(shape.query_lens, shape.seq_lens, strict=True)):
        if q_len:
            q = batch.query[start : start + q_len].float().transpose(0, 1)[None]
            k = batch.keys[seq].float().transpose(0, 1)[None]
            v = batch.values[seq].float().transpose(0, 1)[None]
            mask = visibility_mask(q_len, seq_len, shape.sliding_window, batch.query.device)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def paged_reference(batch: SyntheticBatch, scale: float | None = None) -> torch.Tensor:
    """The torch reference run over the batch's own paged cache and metadata (its window too),
    in the batch's dtype, as `reference_paged_attention` returns it.

    Complexity: that of `reference_paged_attention`.
    """
    return batch_terms(batch, scale).out.to(batch.query.dtype)


def plan_batch(batch: SyntheticBatch, **options: Any) -> AttentionPlan:
    """`plan_step` over the batch's own tensors and window; `options` go to `plan_step`
    (num_splits, kernel, limits)."""
    from pagedkv.gpu.attention import plan_step

    return plan_step(
        batch.query,
        batch.key_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        sliding_window=batch.shape.sliding_window,
        **options,
    )


def batch_terms(batch: SyntheticBatch, scale: float | None = None) -> ReferenceTerms:
    """The float64 reference terms of the batch (its window too).

    Complexity: that of `reference_attention_terms`.
    """
    from pagedkv.gpu.reference import reference_attention_terms

    return reference_attention_terms(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        scale=scale,
        sliding_window=batch.shape.sliding_window,
    )
