"""The torch reference equals dense SDPA, and the reference write puts rows where slots say.

Every batch is laid out through a random permutation of the pool, with NaN in every slot the
reference must not read (past seq_len, spare pages, the null block, pages before a window) and
out-of-range ids in unused block-table columns: a finite, matching output proves none is read.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.gpu.reference import reference_paged_attention, reference_write_kv
from pagedkv.gpu.synthetic_batch import (
    BatchShape,
    dense_attention,
    make_batch,
    paged_reference,
    visibility_mask,
)
from pagedkv.vocab.errors import InvalidArgumentError

KINDS = {
    "decode": ((1, 1, 1, 1), (1, 7, 16, 33)),
    "chunked-prefill": ((5, 1, 9, 3), (12, 20, 9, 31)),
    "prefill": ((13, 4, 1), (13, 4, 1)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 1, 4, 11])
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_paged_reference_equals_dense_sdpa(
    kind: str, num_heads: int, num_kv_heads: int, window: int | None, block_size: int
) -> None:
    query_lens, seq_lens = KINDS[kind]
    shape = BatchShape(query_lens, seq_lens, num_heads, num_kv_heads, 8, block_size, window)
    batch = make_batch(shape, dtype=torch.float32, seed=block_size)
    out = paged_reference(batch)
    assert out.isfinite().all()
    torch.testing.assert_close(out, dense_attention(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_precision_reference_rounds_the_fp32_result(
    dtype: torch.dtype, tolerance: float
) -> None:
    shape = BatchShape((3, 1, 8), (20, 9, 8), 4, 2, 64, 16, None)
    batch = make_batch(shape, dtype=dtype, seed=3)
    out = paged_reference(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_attention(batch), rtol=tolerance, atol=tolerance)


def test_the_scale_argument_is_applied() -> None:
    batch = make_batch(BatchShape((2,), (6,), 2, 1, 8, 4), dtype=torch.float32)
    torch.testing.assert_close(paged_reference(batch, scale=0.3), dense_attention(batch, scale=0.3))


def test_rows_past_the_last_sequence_are_zero() -> None:
    batch = make_batch(BatchShape((2,), (6,), 2, 1, 8, 4), dtype=torch.float32)
    padded = torch.cat([batch.query, torch.full_like(batch.query[:3], float("nan"))])
    out = reference_paged_attention(
        padded,
        batch.key_cache,
        batch.value_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
    )
    assert out[2:].eq(0).all()
    torch.testing.assert_close(out[:2], dense_attention(batch))


def test_the_window_mask_is_bottom_right_aligned() -> None:
    # 2 new tokens at positions 3 and 4 of 5; window 2: position 3 sees {2, 3}, 4 sees {3, 4}.
    mask = visibility_mask(2, 5, 2)
    assert mask.tolist() == [
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]


def test_a_bad_block_id_in_a_read_page_raises() -> None:
    batch = make_batch(BatchShape((1, 2), (9, 2), 2, 1, 8, 4), dtype=torch.float32)
    num_blocks = batch.key_cache.shape[0]
    for bad in (num_blocks, -1):
        table = batch.block_table.clone()
        table[0, 2] = bad
        with pytest.raises(InvalidArgumentError, match=rf"block_table\[0, 2\] = {bad}"):
            reference_paged_attention(
                batch.query,
                batch.key_cache,
                batch.value_cache,
                batch.query_start_loc,
                batch.seq_lens,
                table,
            )


def test_a_query_that_does_not_match_the_cache_raises() -> None:
    batch = make_batch(BatchShape((1,), (5,), 4, 2, 8, 4), dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="query must be"):
        reference_paged_attention(
            batch.query[:, :3],
            batch.key_cache,
            batch.value_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_table,
        )


# --- reference_write_kv ----------------------------------------------------------------------


def _caches(num_blocks: int = 4, block_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, 2, 4)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def test_write_puts_each_row_in_its_slot_and_skips_negative_slots() -> None:
    key_cache, value_cache = _caches()
    key, value = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    slots = torch.tensor([3, -1, 6, 0], dtype=torch.int64)  # the 5th row is padding
    reference_write_kv(key, value, key_cache, value_cache, slots)
    for token, slot in ((0, 3), (2, 6), (3, 0)):
        assert torch.equal(key_cache[slot // 2, slot % 2], key[token])
        assert torch.equal(value_cache[slot // 2, slot % 2], value[token])
    written = {0, 3, 6}
    for slot in set(range(8)) - written:
        assert key_cache[slot // 2, slot % 2].isnan().all()
        assert value_cache[slot // 2, slot % 2].isnan().all()


def test_write_accepts_int32_slots() -> None:
    key_cache, value_cache = _caches()
    key = torch.randn(1, 2, 4)
    reference_write_kv(key, key, key_cache, value_cache, torch.tensor([5], dtype=torch.int32))
    assert torch.equal(key_cache[2, 1], key[0])


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([0, 8], "slot_mapping\\[1\\] = 8 is outside the cache's 8 slots"),
        ([2, 2], "slot 2 is written by more than one token"),
    ],
)
def test_a_bad_slot_raises_and_writes_nothing(slots: list[int], message: str) -> None:
    key_cache, value_cache = _caches()
    key = torch.randn(2, 2, 4)
    with pytest.raises(InvalidArgumentError, match=message):
        reference_write_kv(key, key, key_cache, value_cache, torch.tensor(slots))
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.parametrize(
    ("key_shape", "slot_dtype", "message"),
    [
        ((2, 3, 4), torch.int64, "key must be"),
        ((1, 2, 4), torch.int64, "key must be \\[>= 2 tokens"),
        ((2, 2, 4), torch.float32, "slot_mapping must be one of"),
    ],
)
def test_write_shape_and_dtype_rules(
    key_shape: tuple[int, ...], slot_dtype: torch.dtype, message: str
) -> None:
    key_cache, value_cache = _caches()
    key = torch.randn(key_shape)
    slots = torch.tensor([0, 1]).to(slot_dtype)
    with pytest.raises(InvalidArgumentError, match=message):
        reference_write_kv(key, key, key_cache, value_cache, slots)


def test_write_rejects_a_dtype_mismatch_and_unequal_caches() -> None:
    key_cache, value_cache = _caches()
    key = torch.randn(1, 2, 4)
    slots = torch.tensor([0])
    with pytest.raises(InvalidArgumentError, match="key must be one of"):
        reference_write_kv(key.double(), key, key_cache, value_cache, slots)
    with pytest.raises(InvalidArgumentError, match="share shape and strides"):
        reference_write_kv(key, key, key_cache, value_cache[:2], slots)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("chunk", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 4])
def test_the_chunk_mask_equals_dense_sdpa_and_reads_no_earlier_chunk(
    kind: str, chunk: int, block_size: int
) -> None:
    """Chunked local attention (Llama-4's local layers): the query at p sees keys from
    p // C * C to p. Pages before the first query's chunk hold NaN: a finite, matching output
    proves they are not read (a paged cache puts the null block there)."""
    import torch.nn.functional as F  # noqa: N812 - the usual name

    query_lens, seq_lens = KINDS[kind]
    shape = BatchShape(query_lens, seq_lens, 4, 2, 8, block_size)
    batch = make_batch(shape, dtype=torch.float32, seed=chunk)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    expected = torch.zeros_like(batch.query)
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first_key = (seq_len - q_len) // chunk * chunk
        for page in range(first_key // block_size):  # wholly before the first query's chunk
            key_cache[batch.block_table[seq, page]] = float("nan")
            value_cache[batch.block_table[seq, page]] = float("nan")
        positions = torch.arange(seq_len)
        query_positions = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = (positions <= query_positions) & (positions >= query_positions // chunk * chunk)
        q = batch.query[start : start + q_len].transpose(0, 1)[None]
        k = batch.keys[seq].float().transpose(0, 1)[None]
        v = batch.values[seq].float().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        expected[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    out = reference_paged_attention(
        batch.query,
        key_cache,
        value_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        attention_chunk_size=chunk,
    )
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_window_and_a_chunk_are_refused_together() -> None:
    batch = make_batch(BatchShape((2,), (6,), 2, 1, 8, 4), dtype=torch.float32)
    arrays = (batch.query, batch.key_cache, batch.value_cache)
    metadata = (batch.query_start_loc, batch.seq_lens, batch.block_table)
    with pytest.raises(InvalidArgumentError, match="cannot both be given"):
        reference_paged_attention(*arrays, *metadata, sliding_window=2, attention_chunk_size=2)
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size must be None or >= 1"):
        reference_paged_attention(*arrays, *metadata, attention_chunk_size=0)
