"""The glue from block lists and a scheduler step to slot_mapping / block_table / ... .

The end-to-end test runs whole scheduler steps on CPU: it writes each step's new K/V through
`slot_mapping` with the reference write, attends through `block_table` with the reference, and
compares with dense SDPA over each request's full history. Blocks come from a shuffled pool and
are recycled; under a sliding window, blocks that fall out of every future window are replaced
by the NaN-filled null block, as the manager does, so a read of one would show.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

from pagedkv.block import KVCacheBlock
from pagedkv.gpu.reference import reference_paged_attention, reference_write_kv
from pagedkv.gpu.step_metadata import (
    NULL_BLOCK_ID,
    ScheduledRequest,
    build_step_metadata,
    scheduled_from_manager,
)
from pagedkv.gpu.synthetic_batch import visibility_mask
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.request import Request


def test_metadata_of_a_small_step() -> None:
    step = [
        ScheduledRequest(block_ids=(7, 3, 5), num_computed_tokens=5, num_scheduled_tokens=4),
        ScheduledRequest(block_ids=(2,), num_computed_tokens=0, num_scheduled_tokens=3),
        ScheduledRequest(block_ids=(4, 6), num_computed_tokens=6, num_scheduled_tokens=0),
    ]
    md = build_step_metadata(step, block_size=4)
    assert md.query_start_loc.tolist() == [0, 4, 7, 7]
    assert md.seq_lens.tolist() == [9, 3, 6]
    assert md.block_table.tolist() == [[7, 3, 5], [2, 0, 0], [4, 6, 0]]
    assert md.positions.tolist() == [5, 6, 7, 8, 0, 1, 2]
    # position p of request 0 -> block (7, 3, 5)[p // 4] * 4 + p % 4
    assert md.slot_mapping.tolist() == [13, 14, 15, 20, 8, 9, 10]
    assert md.query_start_loc.dtype == np.int32 and md.block_table.dtype == np.int32
    assert md.slot_mapping.dtype == np.int64


def test_an_empty_step_and_a_fixed_table_width() -> None:
    md = build_step_metadata([], block_size=16)
    assert md.query_start_loc.tolist() == [0]
    assert md.block_table.shape == (0, 1)
    md = build_step_metadata([ScheduledRequest((1,), 0, 1)], block_size=2, max_blocks_per_request=5)
    assert md.block_table.tolist() == [[1, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("step", "kwargs", "message"),
    [
        ([ScheduledRequest((1,), 3, 2)], {}, "5 tokens need 2 blocks of 4, it has 1"),
        ([ScheduledRequest((1, 0), 3, 2)], {}, "page 1 is the null block"),
        ([ScheduledRequest((0, 2), 4, 1)], {}, "page 0 is the null block"),
        ([ScheduledRequest((1, 2), 0, 5)], {"max_blocks_per_request": 1}, "narrower"),
        ([ScheduledRequest((1,), 0, 1)], {"block_size": 3}, "power of two"),
    ],
)
def test_build_rules(step: list[ScheduledRequest], kwargs: dict[str, int], message: str) -> None:
    args = {"block_size": 4, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        build_step_metadata(step, **args)


def test_null_blocks_before_the_window_are_allowed() -> None:
    # Window 3: computing position 9 reads [7, 10), pages 1 and 2; page 0 may be null.
    step = [ScheduledRequest((NULL_BLOCK_ID, 5, 6), 9, 1)]
    md = build_step_metadata(step, block_size=4, sliding_window=3)
    assert md.slot_mapping.tolist() == [25]
    with pytest.raises(InvalidArgumentError, match="page 0 is the null block"):
        build_step_metadata(step, block_size=4)  # full attention reads page 0


def test_null_blocks_before_the_chunk_are_allowed() -> None:
    # Chunk 8: computing positions 9 and 10 reads [8, 11), page 2 only; pages 0 and 1 may be
    # null. Computing from position 7 reads the chunk [0, 8) as well.
    step = [ScheduledRequest((NULL_BLOCK_ID, NULL_BLOCK_ID, 6), 9, 2)]
    md = build_step_metadata(step, block_size=4, attention_chunk_size=8)
    assert md.slot_mapping.tolist() == [25, 26]
    with pytest.raises(InvalidArgumentError, match="page 1 is the null block"):
        build_step_metadata(
            [ScheduledRequest((5, NULL_BLOCK_ID, 6), 7, 3)], block_size=4, attention_chunk_size=8
        )


def test_scheduled_request_rules() -> None:
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        ScheduledRequest((1,), -1, 1)
    with pytest.raises(InvalidArgumentError, match="block ids"):
        ScheduledRequest((-2,), 0, 1)
    assert ScheduledRequest((1, 2), 3, 4).seq_len == 7


class _Manager:
    """The part of a KVCacheManager the adapter reads."""

    def __init__(self, req_to_blocks: dict[str, list[KVCacheBlock]]) -> None:
        self._req_to_blocks = req_to_blocks

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self._req_to_blocks


def test_scheduled_from_manager_reads_block_ids_and_token_counts() -> None:
    first, second = Request("a", [1, 2, 3, 4, 5]), Request("b", [6, 7])
    first.num_computed_tokens = 4
    manager = _Manager(
        {"a": [KVCacheBlock(3), KVCacheBlock(9)], "b": [KVCacheBlock(1)], "idle": []}
    )
    scheduled = scheduled_from_manager(manager, [first, second], {"a": 1, "b": 2})
    assert scheduled == [ScheduledRequest((3, 9), 4, 1), ScheduledRequest((1,), 0, 2)]
    with pytest.raises(InvalidArgumentError, match="no blocks"):
        scheduled_from_manager(manager, [Request("zz", [1])], {"zz": 1})
    with pytest.raises(InvalidArgumentError, match="no scheduled-token count"):
        scheduled_from_manager(manager, [first], {})


# --- whole steps on the reference path -------------------------------------------------------

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 8
LENGTHS = {"a": 19, "b": 10, "c": 6}
STEPS = [
    {"a": 7, "b": 6},  # chunked prefill of a, full prefill of b
    {"a": 9, "b": 1, "c": 6},  # the rest of a's prompt, a decode, c's prefill
    {"a": 1, "b": 1},
    {"a": 1, "b": 1, "c": 0},  # c scheduled with no tokens
    {"a": 1, "b": 1},
]


@pytest.mark.parametrize("window", [None, 3, 6])
def test_scheduler_steps_run_through_the_glue_and_match_dense_attention(
    window: int | None,
) -> None:
    generator = torch.Generator().manual_seed(0)
    shuffle = random.Random(0)
    num_blocks = 24
    free = list(range(1, num_blocks))
    shuffle.shuffle(free)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    keys = {r: torch.randn(n, KV_HEADS, HEAD_SIZE, generator=generator) for r, n in LENGTHS.items()}
    values = {
        r: torch.randn(n, KV_HEADS, HEAD_SIZE, generator=generator) for r, n in LENGTHS.items()
    }
    queries = {r: torch.randn(n, HEADS, HEAD_SIZE, generator=generator) for r, n in LENGTHS.items()}
    computed = dict.fromkeys(LENGTHS, 0)
    blocks: dict[str, list[int]] = {r: [] for r in LENGTHS}
    num_nulled = 0
    for step in STEPS:
        for request, count in step.items():
            while len(blocks[request]) * BLOCK_SIZE < computed[request] + count:
                blocks[request].append(free.pop())
        scheduled = [ScheduledRequest(tuple(blocks[r]), computed[r], n) for r, n in step.items()]
        md = build_step_metadata(scheduled, BLOCK_SIZE, sliding_window=window)
        new = [(r, computed[r], computed[r] + n) for r, n in step.items()]
        reference_write_kv(
            torch.cat([keys[r][a:b] for r, a, b in new]),
            torch.cat([values[r][a:b] for r, a, b in new]),
            key_cache,
            value_cache,
            torch.from_numpy(md.slot_mapping),
        )
        assert md.positions.tolist() == [p for _, a, b in new for p in range(a, b)]
        out = reference_paged_attention(
            torch.cat([queries[r][a:b] for r, a, b in new]),
            key_cache,
            value_cache,
            torch.from_numpy(md.query_start_loc),
            torch.from_numpy(md.seq_lens),
            torch.from_numpy(md.block_table),
            sliding_window=window,
        )
        start = 0
        for request, a, b in new:
            q = queries[request][a:b].transpose(0, 1)[None]
            k = keys[request][:b].transpose(0, 1)[None]
            v = values[request][:b].transpose(0, 1)[None]
            mask = visibility_mask(b - a, b, window)
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            torch.testing.assert_close(out[start : start + b - a], expected[0].transpose(0, 1))
            start += b - a
            computed[request] = b
        if window is not None:
            # The manager's remove_skipped_blocks: pages wholly before the next window start
            # become the null block (NaN here) and go back to the pool.
            for request, done in computed.items():
                for page in range(max(0, done - window + 1) // BLOCK_SIZE):
                    if blocks[request][page] != NULL_BLOCK_ID:
                        free.append(blocks[request][page])  # reused next
                        blocks[request][page] = NULL_BLOCK_ID
                        num_nulled += 1
    assert computed == {"a": 19, "b": 10, "c": 6}
    assert window is None or num_nulled > 0, "the window really skipped blocks"
