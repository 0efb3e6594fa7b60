"""The varlen attention metadata of one step, validated on the host before any launch.

vLLM V1's names and types: `query_start_loc` int32 [S+1], `seq_lens` int32 [S], `block_table`
int32 [S, max_blocks]. Sequence s has `q_len = query_start_loc[s+1] - query_start_loc[s]` new
tokens at the end of its `seq_len` tokens; its query j sits at position `seq_len - q_len + j`::

    positions   0 ........................... seq_len - q_len ....... seq_len - 1
                | context (already in cache)  | new tokens (queries)       |
    block_table [b0][b1][b2] ...   page p holds positions [p * B, (p + 1) * B)

Keys read for sequence s are `[read_start, seq_len)` with `read_start = max(0, seq_len - q_len
- W + 1)` under a sliding window W, else 0: only those pages' block ids must be valid (a
sliding-window table may hold anything, typically the null block 0, before them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.gpu.array_view import ArrayLike, describe, to_host
from pagedkv.vocab.errors import InvalidArgumentError


def is_power_of_two(value: int) -> bool:
    """Whether `value` is 1, 2, 4, ... Complexity: O(1)."""
    return value >= 1 and value & (value - 1) == 0


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Validated host copies of one step's metadata. Construct with `validate_metadata`.

    Attributes:
        query_start_loc: int32 [S+1], starts at 0, non-decreasing.
        seq_lens: int32 [S], each >= that sequence's q_len.
        block_table: int32 [S, max_blocks], C-contiguous; pages read hold ids in [0, num_blocks).
        block_size: tokens per page, a power of two.
        num_blocks: pages in the cache.
        sliding_window: tokens each query sees, itself included, or None for full attention.
    """

    query_start_loc: np.ndarray[Any, np.dtype[np.int32]]
    seq_lens: np.ndarray[Any, np.dtype[np.int32]]
    block_table: np.ndarray[Any, np.dtype[np.int32]]
    block_size: int
    num_blocks: int
    sliding_window: int | None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_query_tokens(self) -> int:
        """Tokens the metadata covers: `query_start_loc[-1]`."""
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        return np.diff(self.query_start_loc).astype(np.int32)

    @property
    def read_starts(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """First key position each sequence reads (0 without a window)."""
        context = self.seq_lens.astype(np.int64) - self.query_lens
        if self.sliding_window is None:
            return np.zeros_like(context)
        starts: np.ndarray[Any, np.dtype[np.int64]] = np.maximum(
            context - self.sliding_window + 1, 0
        )
        return starts


def _host_int32(array: ArrayLike, name: str, ndim: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    view = describe(array, name)
    view.expect(ndim, ("int32",))
    host = np.ascontiguousarray(to_host(array), dtype=np.int32)
    return host.copy() if host is array else host


def validate_metadata(
    query_start_loc: ArrayLike,
    seq_lens: ArrayLike,
    block_table: ArrayLike,
    *,
    block_size: int,
    num_blocks: int,
    num_query_rows: int,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Check one step's metadata against the cache and the query; return host copies.

    Device arrays are copied to the host (a synchronization). Every rule of the module docstring
    is checked, so a launch with the result can neither read outside the cache nor write outside
    the output.

    Args:
        query_start_loc: int32 [S+1].
        seq_lens: int32 [S].
        block_table: int32 [S, max_blocks].
        block_size: tokens per page (a power of two).
        num_blocks: pages in the cache (block ids must be below it).
        num_query_rows: rows of the query/output array (`query_start_loc[-1]` may not exceed it).
        sliding_window: window in tokens (>= 1), or None.

    Returns:
        The validated metadata (host copies, independent of the arguments).

    Raises:
        InvalidArgumentError: any rule broken; the message names the sequence and the rule.

    Complexity: O(S * max_blocks).
    """
    if not isinstance(block_size, int) or not is_power_of_two(block_size):
        raise InvalidArgumentError(f"block_size must be a power of two, got {block_size!r}")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise InvalidArgumentError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise InvalidArgumentError(f"sliding_window must be None or >= 1, got {sliding_window!r}")
    starts = _host_int32(query_start_loc, "query_start_loc", 1)
    lens = _host_int32(seq_lens, "seq_lens", 1)
    table = _host_int32(block_table, "block_table", 2)
    num_seqs = lens.shape[0]
    if starts.shape[0] != num_seqs + 1:
        raise InvalidArgumentError(
            f"query_start_loc must have len(seq_lens) + 1 = {num_seqs + 1} entries, "
            f"got {starts.shape[0]}"
        )
    if table.shape[0] != num_seqs:
        raise InvalidArgumentError(
            f"block_table must have one row per sequence ({num_seqs}), got {table.shape[0]}"
        )
    if starts[0] != 0:
        raise InvalidArgumentError(f"query_start_loc[0] must be 0, got {starts[0]}")
    query_lens = np.diff(starts.astype(np.int64))
    if (query_lens < 0).any():
        seq = int(np.argmax(query_lens < 0))
        raise InvalidArgumentError(f"query_start_loc decreases at sequence {seq}")
    if starts[-1] > num_query_rows:
        raise InvalidArgumentError(
            f"query_start_loc[-1] = {starts[-1]} exceeds the query's {num_query_rows} rows"
        )
    short = lens < query_lens
    if short.any():
        seq = int(np.argmax(short))
        raise InvalidArgumentError(
            f"sequence {seq}: seq_len {lens[seq]} is shorter than its {query_lens[seq]} new tokens"
        )
    pages_needed = -(-lens.astype(np.int64) // block_size)
    too_long = pages_needed > table.shape[1]
    if too_long.any():
        seq = int(np.argmax(too_long))
        raise InvalidArgumentError(
            f"sequence {seq}: seq_len {lens[seq]} needs {pages_needed[seq]} pages but block_table "
            f"has {table.shape[1]} columns"
        )
    metadata = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=lens,
        block_table=table,
        block_size=block_size,
        num_blocks=num_blocks,
        sliding_window=sliding_window,
    )
    columns = np.arange(table.shape[1], dtype=np.int64)[None, :]
    first_page = (metadata.read_starts // block_size)[:, None]
    read = (columns >= first_page) & (columns < pages_needed[:, None]) & (query_lens > 0)[:, None]
    bad = read & ((table < 0) | (table >= num_blocks))
    if bad.any():
        seq, page = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgumentError(
            f"sequence {seq}: block_table[{seq}, {page}] = {table[seq, page]} is not a block id "
            f"in [0, {num_blocks})"
        )
    return metadata
