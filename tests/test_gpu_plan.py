"""Host-side metadata rules, the work list, the split policy, and the kernel's algorithm.

`emulate_kernel` transliterates paged_attention.cu's CTA logic (key range, split chunks, tiles,
online softmax in the log2 domain, partials and the merge) into NumPy, driven by a real plan;
matching the reference proves the plan and the index arithmetic the kernel uses, on CPU.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.gpu.attention import plan_step
from pagedkv.gpu.attention_metadata import validate_metadata
from pagedkv.gpu.attention_plan import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    AttentionPlan,
    DeviceLimits,
    choose_num_splits,
    plan_attention,
    split_tiles,
)
from pagedkv.gpu.kernel_variants import AttentionKernel
from pagedkv.gpu.synthetic_batch import BatchShape, make_batch, paged_reference, plan_batch
from pagedkv.vocab.errors import InvalidArgumentError


def _metadata(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 4,
    sliding_window: int | None = None,
    width: int | None = None,
) -> Any:
    pages = [-(-s // block_size) for s in seq_lens]
    width = max([*pages, 1]) if width is None else width
    table = np.zeros((len(seq_lens), width), dtype=np.int32)
    for seq, count in enumerate(pages):
        table[seq, :count] = np.arange(count) + 1 + sum(pages[:seq])
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return starts, np.array(seq_lens, dtype=np.int32), table, 1 + sum(pages)


# --- validate_metadata -----------------------------------------------------------------------


def test_valid_metadata_is_copied_to_the_host() -> None:
    starts, lens, table, num_blocks = _metadata([2, 1], [5, 9])
    metadata = validate_metadata(
        torch.from_numpy(starts), lens, table, block_size=4, num_blocks=num_blocks, num_query_rows=3
    )
    table[0, 0] = 99  # the metadata holds its own copy
    assert metadata.block_table[0, 0] == 1
    assert metadata.query_lens.tolist() == [2, 1]
    assert metadata.num_query_tokens == 3
    assert metadata.read_starts.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(starts=m["starts"][:-1]), "len\\(seq_lens\\) \\+ 1"),
        (lambda m: m.update(table=m["table"][:1]), "one row per sequence"),
        (lambda m: m["starts"].__setitem__(0, 1), "query_start_loc\\[0\\] must be 0"),
        (lambda m: m["starts"].__setitem__(1, 4), "decreases at sequence 1"),
        (lambda m: m.update(rows=2), "exceeds the query's 2 rows"),
        (lambda m: m["lens"].__setitem__(0, 1), "shorter than its 2 new tokens"),
        (lambda m: m["lens"].__setitem__(1, 13), "needs 4 pages but block_table has 3"),
        (lambda m: m["table"].__setitem__((1, 2), 99), "block_table\\[1, 2\\] = 99"),
        (lambda m: m["table"].__setitem__((0, 1), -1), "block_table\\[0, 1\\] = -1"),
        (lambda m: m.update(starts=m["starts"].astype(np.int64)), "must be one of \\('int32',\\)"),
        (lambda m: m.update(table=m["table"][0]), "must have 2 dimensions"),
        (lambda m: m.update(block_size=3), "power of two"),
        (lambda m: m.update(window=0), "sliding_window"),
    ],
)
def test_each_metadata_rule_raises(mutate: Any, message: str) -> None:
    starts, lens, table, num_blocks = _metadata([2, 1], [5, 9])
    args = {"starts": starts, "lens": lens, "table": table, "rows": 3, "block_size": 4}
    args["window"] = None
    mutate(args)
    with pytest.raises(InvalidArgumentError, match=message):
        validate_metadata(
            args["starts"],
            args["lens"],
            args["table"],
            block_size=args["block_size"],
            num_blocks=num_blocks,
            num_query_rows=args["rows"],
            sliding_window=args["window"],
        )


def test_pages_that_are_never_read_may_hold_anything() -> None:
    # Sequence 0 computes positions 8..9 with a window of 2: it reads [7, 10), pages 1 and 2.
    starts, lens, table, num_blocks = _metadata([2, 1], [10, 3], width=4)
    table[0, 0] = -5  # before the window
    table[0, 3] = 10**6  # past seq_len
    table[1, 1:] = 10**6
    metadata = validate_metadata(
        starts,
        lens,
        table,
        block_size=4,
        num_blocks=num_blocks,
        num_query_rows=3,
        sliding_window=2,
    )
    assert metadata.read_starts.tolist() == [7, 1]
    table[0, 1] = 10**6  # page 1 holds position 7: read
    with pytest.raises(InvalidArgumentError, match="block_table\\[0, 1\\]"):
        validate_metadata(
            starts,
            lens,
            table,
            block_size=4,
            num_blocks=num_blocks,
            num_query_rows=3,
            sliding_window=2,
        )


def test_a_sequence_without_new_tokens_is_not_read() -> None:
    starts, lens, table, num_blocks = _metadata([0, 1], [8, 1])
    table[0, :] = -1
    metadata = validate_metadata(
        starts, lens, table, block_size=4, num_blocks=num_blocks, num_query_rows=1
    )
    assert metadata.query_lens.tolist() == [0, 1]


# --- plan_attention --------------------------------------------------------------------------


@given(
    query_lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    context=st.lists(st.integers(0, 300), min_size=6, max_size=6),
    group=st.sampled_from([1, 2, 3, 4, 8, 16]),
    window=st.none() | st.integers(1, 64),
)
def test_the_work_list_covers_every_query_row_exactly_once(
    query_lens: list[int], context: list[int], group: int, window: int | None
) -> None:
    seq_lens = [q + c for q, c in zip(query_lens, context, strict=False)]
    starts, lens, table, num_blocks = _metadata(query_lens, seq_lens, sliding_window=window)
    metadata = validate_metadata(
        starts,
        lens,
        table,
        block_size=4,
        num_blocks=num_blocks,
        num_query_rows=sum(query_lens),
        sliding_window=window,
    )
    plan = plan_attention(
        metadata, num_heads=2 * group, num_kv_heads=2, head_size=64, dtype="float16"
    )
    covered = []
    for seq, row0 in zip(plan.work_seq.tolist(), plan.work_row.tolist(), strict=True):
        rows = min(plan.traits.rows, query_lens[seq] * group - row0)
        assert rows >= 1
        covered += [(seq, row) for row in range(row0, row0 + rows)]
    expected = [(s, r) for s, q in enumerate(query_lens) for r in range(q * group)]
    assert sorted(covered) == expected
    assert list(plan.work_keys) == sorted(plan.work_keys, reverse=True), "longest first"
    assert 1 <= plan.num_splits <= MAX_SPLITS


def test_work_keys_count_only_the_window_and_causal_range() -> None:
    starts, lens, table, num_blocks = _metadata([1, 3], [100, 3])
    metadata = validate_metadata(
        starts,
        lens,
        table,
        block_size=4,
        num_blocks=num_blocks,
        num_query_rows=4,
        sliding_window=10,
    )
    plan = plan_attention(metadata, num_heads=1, num_kv_heads=1, head_size=64, dtype="float32")
    # decode at position 99 reads [90, 100); the prefill's 3 rows read [0, 3)
    assert plan.work_keys.tolist() == [10, 3]
    assert plan.kv_tokens_read == 13


def test_split_policy() -> None:
    assert choose_num_splits(num_ctas=512, max_keys=4096, resident_ctas=528) == 1
    assert choose_num_splits(num_ctas=300, max_keys=4096, resident_ctas=528) == 1
    assert choose_num_splits(num_ctas=64, max_keys=4096, resident_ctas=528) == 8, "not 9: 576"
    assert choose_num_splits(num_ctas=8, max_keys=32768, resident_ctas=528) == MAX_SPLITS
    assert (
        choose_num_splits(num_ctas=8, max_keys=512, resident_ctas=528) == 512 // MIN_KEYS_PER_SPLIT
    )
    assert choose_num_splits(num_ctas=8, max_keys=100, resident_ctas=528) == 1
    assert choose_num_splits(num_ctas=0, max_keys=0, resident_ctas=528) == 1
    assert choose_num_splits(num_ctas=600, max_keys=10**6, resident_ctas=528) == 1


@given(
    num_ctas=st.integers(1, 2000),
    max_keys=st.integers(0, 10**6),
    resident=st.integers(1, 2000),
)
def test_splits_never_start_a_second_wave(num_ctas: int, max_keys: int, resident: int) -> None:
    splits = choose_num_splits(num_ctas, max_keys, resident)
    assert 1 <= splits <= MAX_SPLITS
    assert splits == 1 or num_ctas * splits <= resident
    assert splits == 1 or max_keys // splits >= MIN_KEYS_PER_SPLIT
    if splits < MAX_SPLITS and splits < max_keys // MIN_KEYS_PER_SPLIT:
        assert num_ctas * (splits + 1) > resident, "one more split would not fit: the most"


@given(range_tiles=st.integers(0, 5000), num_splits=st.integers(1, MAX_SPLITS))
def test_split_tiles_deal_the_range_out_evenly(range_tiles: int, num_splits: int) -> None:
    chunks = [split_tiles(range_tiles, num_splits, s) for s in range(num_splits)]
    assert chunks[0][0] == 0 and chunks[-1][1] == range_tiles
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks)), "contiguous"
    sizes = [stop - first for first, stop in chunks]
    assert max(sizes) - min(sizes) <= 1


def test_the_decode_table_cells_fill_one_wave_with_equal_splits() -> None:
    from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS, plan_decode_cell

    resident = 132 * 4
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            plan = plan_decode_cell(batch, context, DeviceLimits())
            ctas = plan.num_work * plan.num_kv_heads * plan.num_splits
            assert ctas <= resident, (batch, context, ctas)
            if plan.num_splits > 1:
                assert ctas * 2 > resident or plan.num_splits == context // MIN_KEYS_PER_SPLIT
            tiles = -(-context // plan.traits.tile_tokens)
            chunks = [split_tiles(tiles, plan.num_splits, s) for s in range(plan.num_splits)]
            sizes = {stop - first for first, stop in chunks}
            assert max(sizes) - min(sizes) <= 1, (batch, context, sizes)
    assert plan_decode_cell(8, 4096, DeviceLimits()).num_splits == 8  # 512 CTAs of 16 tiles


def test_resident_ctas_follow_shared_memory_and_launch_bounds() -> None:
    h200 = DeviceLimits(num_sms=132, shared_memory_per_sm=228 * 1024)
    assert h200.resident_ctas(46_000, 4) == 4
    assert h200.resident_ctas(46_000, 3) == 3
    assert DeviceLimits(num_sms=108, shared_memory_per_sm=164 * 1024).resident_ctas(46_000, 4) == 3
    with pytest.raises(InvalidArgumentError):
        DeviceLimits(num_sms=0)


def test_plan_rejects_bad_heads_variants_and_splits() -> None:
    starts, lens, table, num_blocks = _metadata([1], [5])
    metadata = validate_metadata(
        starts, lens, table, block_size=4, num_blocks=num_blocks, num_query_rows=1
    )
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        plan_attention(metadata, num_heads=6, num_kv_heads=4, head_size=64, dtype="float16")
    with pytest.raises(InvalidArgumentError, match="head sizes"):
        plan_attention(metadata, num_heads=4, num_kv_heads=4, head_size=96, dtype="float16")
    with pytest.raises(InvalidArgumentError, match="dtypes"):
        plan_attention(metadata, num_heads=4, num_kv_heads=4, head_size=64, dtype="float64")
    with pytest.raises(InvalidArgumentError, match="num_splits"):
        plan_attention(
            metadata, num_heads=4, num_kv_heads=4, head_size=64, dtype="float16", num_splits=0
        )


def test_plan_step_checks_query_and_cache_shapes_without_a_device() -> None:
    batch = make_batch(BatchShape((2,), (9,), 4, 2, 64, 4), dtype=torch.float16)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table)
    plan = plan_step(batch.query, batch.key_cache, *args)
    assert plan.grid == (1, 2, 1)
    with pytest.raises(InvalidArgumentError, match="key_cache must be one of"):
        plan_step(batch.query, batch.key_cache.float(), *args)
    unaligned = torch.zeros((*batch.key_cache.shape[:3], 68), dtype=torch.float16)[..., :64]
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        plan_step(batch.query, unaligned, *args)
    with pytest.raises(InvalidArgumentError, match="exceeds the query's 1 rows"):
        plan_step(batch.query[:1], batch.key_cache, *args)


# --- the kernel's algorithm, emulated --------------------------------------------------------


def emulate_kernel(
    plan: AttentionPlan,
    query: np.ndarray[Any, Any],
    k_cache: np.ndarray[Any, Any],
    v_cache: np.ndarray[Any, Any],
    scale: float,
) -> np.ndarray[Any, Any]:
    """paged_attention_kernel + merge_splits_kernel, CTA by CTA, in float64."""
    md = plan.metadata
    rows, tile, group = plan.traits.rows, plan.traits.tile_tokens, plan.group_size
    splits, heads, dim = plan.num_splits, plan.num_heads, plan.head_size
    tokens = md.num_query_tokens
    out = np.zeros((tokens, heads, dim))
    part_o = np.zeros((splits, tokens, heads, dim))
    part_lse = np.full((splits, tokens, heads), -np.inf)
    window = md.sliding_window or 0
    scale_log2 = scale * math.log2(math.e)
    for seq, row0 in zip(plan.work_seq.tolist(), plan.work_row.tolist(), strict=True):
        q_start = int(md.query_start_loc[seq])
        q_len = int(md.query_start_loc[seq + 1]) - q_start
        context = int(md.seq_lens[seq]) - q_len
        n_rows = min(rows, q_len * group - row0)
        first_pos = context + row0 // group
        last_pos = context + (row0 + n_rows - 1) // group
        kv_begin = max(0, first_pos - window + 1) if window > 0 else 0
        kv_end = last_pos + 1
        range_tiles = -(-(kv_end - kv_begin) // tile)
        row_tok = [(row0 + r) // group for r in range(n_rows)]
        qpos = np.array([context + t for t in row_tok])
        for kv_head in range(plan.num_kv_heads):
            row_heads = [kv_head * group + (row0 + r) % group for r in range(n_rows)]
            q = np.stack([query[q_start + t, h] for t, h in zip(row_tok, row_heads, strict=True)])
            q = q * scale_log2
            for split in range(splits):
                tile_lo, tile_hi = split_tiles(range_tiles, splits, split)
                kv_start = kv_begin + tile_lo * tile
                kv_stop = min(kv_end, kv_begin + tile_hi * tile)
                m = np.full(n_rows, -np.inf)
                l_sum = np.zeros(n_rows)
                acc = np.zeros((n_rows, dim))
                for tile_start in range(kv_start, kv_stop, tile):
                    pos = np.arange(tile_start, min(tile_start + tile, kv_stop))
                    blocks = md.block_table[seq, pos // md.block_size]
                    keys = k_cache[blocks, pos % md.block_size, kv_head]
                    values = v_cache[blocks, pos % md.block_size, kv_head]
                    visible = pos[None, :] <= qpos[:, None]
                    if window > 0:
                        visible &= pos[None, :] > qpos[:, None] - window
                    scores = np.where(visible, q @ keys.T, -np.inf)
                    m_new = np.maximum(m, scores.max(axis=1))
                    live = m_new != -np.inf
                    alpha = np.where(live, np.exp2(np.where(live, m - m_new, 0)), 1.0)
                    p = np.where(
                        live[:, None], np.exp2(scores - np.where(live, m_new, 0)[:, None]), 0
                    )
                    l_sum = l_sum * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None] + p @ values
                    m = m_new
                o = np.where(l_sum[:, None] > 0, acc / np.maximum(l_sum, 1e-300)[:, None], 0)
                lse = np.where(l_sum > 0, m + np.log2(np.maximum(l_sum, 1e-300)), -np.inf)
                for r in range(n_rows):
                    token, head = q_start + row_tok[r], row_heads[r]
                    if splits == 1:
                        out[token, head] = o[r]
                    else:
                        part_o[split, token, head] = o[r]
                        part_lse[split, token, head] = lse[r]
    if splits > 1:
        lse_max = part_lse.max(axis=0)
        weights = np.where(part_lse == -np.inf, 0.0, np.exp2(part_lse - lse_max))
        out = (weights[..., None] * part_o).sum(axis=0) / weights.sum(axis=0)[..., None]
    return out


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_kernel_algorithm_matches_the_reference(
    num_splits: int, window: int | None, block_size: int
) -> None:
    shape = BatchShape(
        query_lens=(1, 5, 1, 3, 12),
        seq_lens=(70, 45, 1, 3, 100),
        num_heads=12,
        num_kv_heads=2,  # a group of 6: rows of one CTA span tokens and heads
        head_size=64,
        block_size=block_size,
        sliding_window=window,
    )
    batch = make_batch(shape, dtype=torch.float32, seed=num_splits)
    plan = plan_batch(batch, num_splits=num_splits)
    assert plan.traits.tile_tokens == 32  # several tiles per range
    expected = paged_reference(batch)
    emulated = emulate_kernel(
        plan,
        batch.query.double().numpy(),
        batch.key_cache.double().numpy(),
        batch.value_cache.double().numpy(),
        1 / math.sqrt(64),
    )
    assert np.isfinite(emulated).all()
    np.testing.assert_allclose(emulated, expected.double().numpy(), rtol=1e-5, atol=1e-5)


def test_the_tensor_core_kernel_is_the_default_for_16_bit_types_only() -> None:
    batch = make_batch(BatchShape((1,), (40,), 8, 2, 128, 16), dtype=torch.bfloat16)
    plan = plan_batch(batch)
    assert (plan.traits.kernel, plan.traits.rows, plan.traits.tile_tokens) == ("mma", 16, 32)
    assert plan_batch(batch, kernel="simt").traits.rows == 8
    fp32 = make_batch(BatchShape((1,), (40,), 8, 2, 128, 16), dtype=torch.float32)
    assert plan_batch(fp32).traits.kernel == "simt"
    with pytest.raises(InvalidArgumentError, match="tensor-core kernel takes"):
        plan_batch(fp32, kernel="mma")


class CudaLaunchRules:
    """A CuPy `RawKernel` as the driver treats it: a launch with more dynamic shared memory than
    the function's opted-in maximum (48 KiB until raised) fails, as cuLaunchKernel does."""

    def __init__(self) -> None:
        from pagedkv.gpu.launch import OPT_IN_SHARED_BYTES

        self.max_dynamic_shared_size_bytes = OPT_IN_SHARED_BYTES
        self.preferred_shared_memory_carveout = -1  # no preference
        self.launched: list[tuple[int, int]] = []  # (shared bytes, carveout)

    def __call__(self, grid: object, block: object, args: object, shared_mem: int) -> None:
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes not opted into")
        self.launched.append((shared_mem, self.preferred_shared_memory_carveout))


ATTENTION_VARIANTS = [
    (kernel, dtype, head)
    for kernel in ("mma", "simt")
    for dtype in ("float16", "bfloat16", "float32")
    if kernel == "simt" or dtype != "float32"
    for head in (64, 128, 256)
]


@pytest.mark.parametrize(("kernel", "dtype", "head_size"), ATTENTION_VARIANTS, ids=str)
def test_every_attention_launch_opts_into_its_shared_memory_first(
    kernel: AttentionKernel, dtype: str, head_size: int
) -> None:
    """The launches `paged_attention` makes (attention kernel, then the merge), through the
    real `KernelCall.launch`, on a function that refuses what the driver refuses."""
    from pagedkv.gpu.array_view import describe
    from pagedkv.gpu.attention import attention_calls
    from pagedkv.gpu.launch import MAX_SHARED_CARVEOUT, OPT_IN_SHARED_BYTES

    batch = make_batch(BatchShape((1,), (300,), 4, 2, head_size, 16), dtype=getattr(torch, dtype))
    plan = plan_batch(batch, kernel=kernel, num_splits=2)
    views = (describe(batch.query, "query"), describe(batch.key_cache, "key_cache"))
    names = (
        "query key_cache value_cache out query_start_loc seq_lens block_table work_seq "
        "work_row partial_out partial_lse"
    )
    pointers = {name: np.uint64(0) for name in names.split()}
    calls = attention_calls(plan, *views, describe(batch.query, "out"), pointers)
    assert [call.shared_bytes for call in calls] == [plan.traits.smem_bytes, 0]
    for call in calls:
        function = CudaLaunchRules()
        call.launch(function)
        carveout = MAX_SHARED_CARVEOUT if call.shared_bytes else -1
        assert function.launched == [(call.shared_bytes, carveout)]
    if plan.traits.smem_bytes > OPT_IN_SHARED_BYTES:
        with pytest.raises(RuntimeError, match="not opted into"):  # what launch() prevents
            CudaLaunchRules()(plan.grid, (128, 1, 1), (), shared_mem=plan.traits.smem_bytes)
