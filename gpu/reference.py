"""The torch reference of both GPU operations: plain indexing and a masked softmax, CPU or GPU.

Written for clarity, not speed, and built on no kernel idea (no tiles, no online softmax): it is
what the kernels are checked against, and it is itself checked against
`torch.nn.functional.scaled_dot_product_attention` on densely laid-out K/V. It validates its
arguments with the same host-side rules as the kernels (`validate_metadata`, `check_slots`).
Attention is computed in float64 from the inputs' exact values, so its own rounding is far
below any kernel's; `reference_attention_terms` also returns the quantities the per-element
error bound of `pagedkv.gpu.error_bound` is made of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.gpu.array_view import describe
from pagedkv.gpu.attention_metadata import validate_metadata
from pagedkv.gpu.kv_write import check_slots, check_write_arrays
from pagedkv.vocab.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch


def reference_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's K/V rows to slot `slot_mapping[i]` of the caches; negative: skip.

    Args:
        key: [num_tokens, num_kv_heads, head_size].
        value: likewise, as `key`.
        key_cache: [num_blocks, block_size, num_kv_heads, head_size], written in place.
        value_cache: likewise, as `key_cache`.
        slot_mapping: int32/int64 [n], n <= num_tokens.

    Raises:
        InvalidArgumentError: as `pagedkv.gpu.kv_write.write_kv`; nothing is written.

    Complexity: O(n * num_kv_heads * head_size).
    """
    check_write_arrays(
        describe(key, "key"),
        describe(value, "value"),
        describe(key_cache, "key_cache"),
        describe(value_cache, "value_cache"),
        describe(slot_mapping, "slot_mapping"),
    )
    import torch

    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.detach().to("cpu", dtype=torch.int64).numpy()
    check_slots(slots, num_blocks * block_size)
    tokens = torch.as_tensor(np.flatnonzero(slots >= 0), device=key.device)
    slot_index = slot_mapping.to(key.device, dtype=torch.int64)[tokens]
    blocks, offsets = slot_index // block_size, slot_index % block_size
    key_cache[blocks, offsets] = key[tokens]
    value_cache[blocks, offsets] = value[tokens]


@dataclass(frozen=True, eq=False)
class ReferenceTerms:
    """The float64 reference output and what bounds a correct kernel's distance from it.

    Attributes:
        out: [num_tokens, num_heads, head_size], softmax(Q K^T * scale) V; rows past
            `query_start_loc[-1]` are zero.
        weighted_abs: same shape, sum over keys of p_k * |v_k| (the scale of every rounding
            error in P.V and of a relative error in the probabilities).
        score_norm: [num_tokens, num_heads], scale * |q| * max_k |k| over the keys the row sees:
            bounds sum_i |q_i k_i| * scale (Cauchy-Schwarz), the scale of Q.K's rounding.
        num_keys: [num_tokens, num_heads], keys the row sees.
    """

    out: torch.Tensor
    weighted_abs: torch.Tensor
    score_norm: torch.Tensor
    num_keys: torch.Tensor


def reference_attention_terms(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> ReferenceTerms:
    """Varlen paged attention in float64, with the terms of the kernels' error bound.

    For each sequence s, the keys `[read_start, seq_len)` are gathered page by page through
    `block_table[s]` (so nothing past seq_len and nothing before the window, or before the first
    query's chunk, is read), every query row is masked to the keys it may see (bottom-right
    causal, optional window or chunk, GQA), and softmax(Q K^T * scale) V is computed densely.

    Chunked local attention (Llama-4's local layers; the kernels have none): the query at
    position p sees the keys from `p // C * C` to p. Its pages before the first query's chunk
    may hold anything (a paged cache puts the null block there) and are never read.

    Args:
        query: [num_tokens, num_heads, head_size].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size].
        query_start_loc, seq_lens, block_table: int32 metadata (see `validate_metadata`).
        scale: softmax scale; None: 1 / sqrt(head_size).
        sliding_window: window in tokens, or None.
        attention_chunk_size: chunk in tokens (>= 1), or None; not with a window.

    Raises:
        InvalidArgumentError: a metadata rule or shape is broken, or a window and a chunk.

    Complexity: O(sum over sequences of q_len * keys read * num_heads * head_size).
    """
    import torch

    if attention_chunk_size is not None:
        if (
            not isinstance(attention_chunk_size, int)
            or isinstance(attention_chunk_size, bool)
            or attention_chunk_size < 1
        ):
            raise InvalidArgumentError(
                f"attention_chunk_size must be None or >= 1, got {attention_chunk_size!r}"
            )
        if sliding_window is not None:
            raise InvalidArgumentError("a sliding window and a chunk size cannot both be given")

    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    if query.dim() != 3 or query.shape[2] != head_size or query.shape[1] % num_kv_heads:
        raise InvalidArgumentError(
            f"query must be [num_tokens, k * {num_kv_heads}, {head_size}], got {tuple(query.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise InvalidArgumentError("key_cache and value_cache must have the same shape")
    metadata = validate_metadata(
        query_start_loc,
        seq_lens,
        block_table,
        block_size=block_size,
        num_blocks=num_blocks,
        num_query_rows=query.shape[0],
        sliding_window=sliding_window,
    )
    group = query.shape[1] // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    device, f64 = query.device, torch.float64
    out = torch.zeros(query.shape, dtype=f64, device=device)
    weighted_abs = torch.zeros_like(out)
    score_norm = torch.zeros(query.shape[:2], dtype=f64, device=device)
    num_keys = torch.zeros(query.shape[:2], dtype=torch.int64, device=device)
    starts = metadata.query_start_loc.tolist()
    for seq, (seq_len, read_start) in enumerate(
        zip(metadata.seq_lens.tolist(), metadata.read_starts.tolist(), strict=True)
    ):
        rows = slice(starts[seq], starts[seq + 1])
        q_len = rows.stop - rows.start
        if q_len == 0:
            continue
        first_key = read_start
        if attention_chunk_size is not None:  # the first query's chunk start
            first_key = (seq_len - q_len) // attention_chunk_size * attention_chunk_size
        positions = torch.arange(first_key, seq_len, device=device)
        pages = torch.as_tensor(metadata.block_table[seq], device=device).long()
        blocks = pages[positions // block_size]
        offsets = positions % block_size
        keys = key_cache[blocks, offsets].to(f64)  # [k, kv_heads, d]
        values = value_cache[blocks, offsets].to(f64)
        q = query[rows].to(f64).view(q_len, num_kv_heads, group, head_size)
        scores = torch.einsum("qhgd,khd->hgqk", q, keys) * scale
        query_positions = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        visible = positions[None, :] <= query_positions
        if sliding_window is not None:
            visible &= positions[None, :] > query_positions - sliding_window
        if attention_chunk_size is not None:
            chunk_starts = query_positions // attention_chunk_size * attention_chunk_size
            visible &= positions[None, :] >= chunk_starts
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[rows] = torch.einsum("hgqk,khd->qhgd", probs, values).flatten(1, 2)
        weighted_abs[rows] = torch.einsum("hgqk,khd->qhgd", probs, values.abs()).flatten(1, 2)
        key_norms = keys.norm(dim=-1).transpose(0, 1)[:, None, :]  # [kv_heads, 1, k]
        max_key_norm = key_norms.masked_fill(~visible, 0.0).amax(dim=-1).transpose(0, 1)
        norms = q.norm(dim=-1) * max_key_norm[:, :, None]  # [q, kv_heads, group]
        score_norm[rows] = scale * norms.flatten(1, 2)
        num_keys[rows] = visible.sum(dim=-1)[:, None].expand(q_len, query.shape[1])
    return ReferenceTerms(out, weighted_abs, score_norm, num_keys)


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor:
    """Varlen paged attention, bottom-right causal, optional window or chunk, GQA; float64
    math.

    Every argument is as in `reference_attention_terms`.

    Returns:
        [num_tokens, num_heads, head_size] in the query's dtype (the float64 result, rounded
        once); rows past `query_start_loc[-1]` are zero.

    Raises:
        InvalidArgumentError: a metadata rule or shape is broken.

    Complexity: that of `reference_attention_terms`.
    """
    terms = reference_attention_terms(
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale=scale,
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
    )
    return terms.out.to(query.dtype)
