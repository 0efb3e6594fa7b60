"""From the manager's block lists and a scheduler step to the kernels' metadata.

A scheduled request computes tokens `[num_computed_tokens, num_computed_tokens +
num_scheduled_tokens)` this step; its block list covers every position up to the end::

    positions  | computed (in cache)   | scheduled this step |
    blocks     [b0     ][b1     ][b2   ..][b3          ]      page p = positions [p*B, (p+1)*B)
    slot(pos)  = block_ids[pos // B] * B + pos % B

Sliding-window lists hold the null block at positions that fell out of the window (chunked
local attention's, at the positions of earlier chunks): the list keeps its length, so positions
stay stable, and the kernels never read pages before the window (`build_step_metadata` checks
that no page the step reads is the null block).

`build_step_metadata` is pure (plain data in, NumPy arrays out); `scheduled_from_manager` reads
a `KVCacheManager`'s `req_to_blocks` (vLLM's names) into that plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pagedkv.gpu.attention_metadata import is_power_of_two
from pagedkv.vocab.errors import InvalidArgumentError

NULL_BLOCK_ID = 0
"""The block id the pool reserves as the placeholder for skipped positions."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a scheduler step.

    Attributes:
        block_ids: the request's blocks in position order (null blocks included).
        num_computed_tokens: tokens already in the cache (>= 0).
        num_scheduled_tokens: tokens computed this step (>= 0).
    """

    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0 or self.num_scheduled_tokens < 0:
            raise InvalidArgumentError(
                f"token counts must be >= 0, got computed={self.num_computed_tokens}, "
                f"scheduled={self.num_scheduled_tokens}"
            )
        if any(block_id < 0 for block_id in self.block_ids):
            raise InvalidArgumentError(f"block ids must be >= 0, got {self.block_ids}")

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once the step has run."""
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass(frozen=True, eq=False)
class StepMetadata:
    """What one step's kernels read, for S requests and T scheduled tokens.

    Attributes:
        query_start_loc: int32 [S+1], cumulative scheduled tokens.
        seq_lens: int32 [S], computed + scheduled tokens.
        block_table: int32 [S, max_blocks], padded with the null block id.
        slot_mapping: int64 [T], where each scheduled token's K/V is written.
        positions: int64 [T], each scheduled token's position in its request.
    """

    query_start_loc: np.ndarray[Any, np.dtype[np.int32]]
    seq_lens: np.ndarray[Any, np.dtype[np.int32]]
    block_table: np.ndarray[Any, np.dtype[np.int32]]
    slot_mapping: np.ndarray[Any, np.dtype[np.int64]]
    positions: np.ndarray[Any, np.dtype[np.int64]]


def build_step_metadata(
    requests: Sequence[ScheduledRequest],
    block_size: int,
    *,
    max_blocks_per_request: int | None = None,
    null_block_id: int | None = NULL_BLOCK_ID,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> StepMetadata:
    """Build slot_mapping, block_table, seq_lens and query_start_loc for one step.

    Args:
        requests: the step's requests, in batch order.
        block_size: tokens per block (a power of two, as the kernels need).
        max_blocks_per_request: block_table width; None: the longest block list (at least 1).
        null_block_id: the placeholder id no page the kernels read may hold; None: no such
            check.
        sliding_window: the layer group's window, or None: the kernels then read pages from
            the first scheduled token's window start (else from position 0) to the end.
        attention_chunk_size: the layer group's chunk (chunked local attention), or None:
            pages are then read from the first scheduled token's chunk start.

    Returns:
        The metadata, as NumPy arrays.

    Raises:
        InvalidArgumentError: a block list too short for its tokens, a null block in a page the
            kernels read, a table narrower than a block list, a bad block size.

    Complexity: O(total blocks + total scheduled tokens).
    """
    if not isinstance(block_size, int) or not is_power_of_two(block_size):
        raise InvalidArgumentError(f"block_size must be a power of two, got {block_size!r}")
    longest = max((len(r.block_ids) for r in requests), default=0)
    width = max(longest, 1) if max_blocks_per_request is None else max_blocks_per_request
    if width < longest:
        raise InvalidArgumentError(
            f"max_blocks_per_request={width} is narrower than a block list of {longest} blocks"
        )
    num_requests = len(requests)
    block_table = np.full((num_requests, width), null_block_id or 0, dtype=np.int32)
    scheduled = np.array([r.num_scheduled_tokens for r in requests], dtype=np.int64)
    query_start_loc = np.zeros(num_requests + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(scheduled)
    seq_lens = np.array([r.seq_len for r in requests], dtype=np.int32)
    positions = np.empty(int(scheduled.sum()), dtype=np.int64)
    slot_mapping = np.empty_like(positions)
    for index, request in enumerate(requests):
        blocks = np.asarray(request.block_ids, dtype=np.int64)
        if -(-request.seq_len // block_size) > blocks.shape[0]:
            raise InvalidArgumentError(
                f"request {index}: {request.seq_len} tokens need "
                f"{-(-request.seq_len // block_size)} blocks of {block_size}, it has "
                f"{blocks.shape[0]}"
            )
        block_table[index, : blocks.shape[0]] = blocks
        start, stop = int(query_start_loc[index]), int(query_start_loc[index + 1])
        pos = np.arange(request.num_computed_tokens, request.seq_len, dtype=np.int64)
        token_blocks = blocks[pos // block_size]
        if null_block_id is not None and request.num_scheduled_tokens:
            read_start = 0
            if sliding_window is not None:
                read_start = max(0, request.num_computed_tokens - sliding_window + 1)
            if attention_chunk_size is not None:
                computed = request.num_computed_tokens
                read_start = computed // attention_chunk_size * attention_chunk_size
            read_pages = blocks[read_start // block_size : -(-request.seq_len // block_size)]
            if (read_pages == null_block_id).any():
                page = read_start // block_size + int(np.argmax(read_pages == null_block_id))
                raise InvalidArgumentError(
                    f"request {index}: page {page} is the null block but the step reads it"
                )
        positions[start:stop] = pos
        slot_mapping[start:stop] = token_blocks * block_size + pos % block_size
    return StepMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        positions=positions,
    )


class HasBlockId(Protocol):
    """A block as the manager holds it (`KVCacheBlock`)."""

    @property
    def block_id(self) -> int: ...


class BlockLists(Protocol):
    """What the glue reads from a `KVCacheManager`: each live request's blocks."""

    @property
    def req_to_blocks(self) -> Mapping[str, Sequence[HasBlockId]]: ...


class ScheduledRequestLike(Protocol):
    """What the glue reads from a `Request`."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...


def scheduled_from_manager(
    manager: BlockLists,
    requests: Sequence[ScheduledRequestLike],
    num_scheduled_tokens: Mapping[str, int],
) -> list[ScheduledRequest]:
    """The plain-data view of a step: each request's block ids and token counts.

    Args:
        manager: the KV cache manager after `allocate_slots` for this step.
        requests: the scheduled requests, in batch order.
        num_scheduled_tokens: request id -> tokens scheduled this step (vLLM's
            `SchedulerOutput.num_scheduled_tokens`).

    Raises:
        InvalidArgumentError: a request with no block list or no scheduled-token count.

    Complexity: O(total blocks).
    """
    result = []
    for request in requests:
        request_id = request.request_id
        if request_id not in manager.req_to_blocks:
            raise InvalidArgumentError(f"request {request_id!r} has no blocks in the manager")
        if request_id not in num_scheduled_tokens:
            raise InvalidArgumentError(f"request {request_id!r} has no scheduled-token count")
        result.append(
            ScheduledRequest(
                block_ids=tuple(block.block_id for block in manager.req_to_blocks[request_id]),
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_scheduled_tokens[request_id],
            )
        )
    return result
