"""Chained block hashes, computed fast: the keys of a request's full blocks.

What a key is (`BlockHashType`, the hash functions, `NONE_HASH`) is `pagedkv.vocab.hashes`;
`pagedkv.spec.block_hash` defines each key the plain way. Here: one loop makes every hash input
(`chain_block_hashes`), multimodal inputs are found by a linear scan, and a manager's SHA-256
remembers recent inputs (`Sha256Memo`). Only full blocks are hashed.
"""

from __future__ import annotations

import functools
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any, Protocol

from pagedkv.vocab.arguments import (
    require_callable,
    require_instance,
    require_int,
    require_token_ids,
)
from pagedkv.vocab.hashes import (
    NONE_HASH,
    BlockHashType,
    CacheSalt,
    ExtraKey,
    HashFn,
    MultimodalKey,
    sha256,
)
from pagedkv.vocab.request import PlaceholderRange, Request


class Sha256Memo:
    """`sha256` that remembers the values of its `maxsize` most recently used inputs.

    A manager hashes the blocks of a shared prefix again for every request that shares it;
    remembering them makes those lookups about ten times cheaper, while a new input costs about
    0.3 us more than hashing it. An input (parent hash value, token ids, extra keys) is compared
    whole, so a remembered value is exactly the one SHA-256 computes. Inputs must be hashable.
    What it remembers is a cache, not state: a pickle or copy of it starts empty.
    """

    __slots__ = ("_cached", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._cached = functools.lru_cache(maxsize=maxsize)(sha256)

    def __call__(self, obj: object) -> int:
        return self._cached(obj)

    def __reduce__(self) -> tuple[type[Sha256Memo], tuple[int]]:
        return Sha256Memo, (self.maxsize,)


def need_extra_keys(request: Request) -> bool:
    """Whether any block of `request` carries extra keys (multimodal, LoRA or salt)."""
    require_instance("need_extra_keys", "request", request, Request)
    return _need_extra_keys(request)


def _need_extra_keys(request: Request) -> bool:
    return (
        bool(request.mm_positions) or request.lora_id is not None or request.cache_salt is not None
    )


class PlaceholderTuples(Protocol):
    """Multimodal placeholder ranges as `(offset, length)` tuples, sorted and disjoint."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> tuple[int, int]: ...


class _RangesAsTuples:
    """`PlaceholderRange`s seen as `(offset, length)` tuples, without copying them."""

    __slots__ = ("_positions",)

    def __init__(self, positions: Sequence[PlaceholderRange]) -> None:
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, index: int, /) -> tuple[int, int]:
        position = self._positions[index]
        return position.offset, position.length


def mm_inputs_in_block(
    ranges: PlaceholderTuples,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    include_touching: bool = False,
) -> tuple[list[int], int]:
    """Which multimodal inputs from `start_mm_idx` on overlap the block `[start, end)`.

    An input `(offset, length)` covers tokens `[offset, offset + length)`; `include_touching`
    also takes one that ends exactly where the block starts (vLLM 0.8.5's quirk, difference 6).
    The scan passes over inputs that end before the block and stops at the first input the
    block has not reached, or at one that continues into the next block.

    Returns:
        The indices of the overlapping inputs, in order, and the index the next block's scan
        starts from (without `include_touching`, every input before it ends at or before
        `end_token_idx`, so a left-to-right scan over blocks is linear overall).

    Complexity: O(1) plus the inputs passed over.
    """
    indices: list[int] = []
    num_ranges = len(ranges)
    mm_idx = start_mm_idx
    if num_ranges:
        offset, length = ranges[num_ranges - 1]
        if offset + length < start_token_idx or (
            offset + length == start_token_idx and not include_touching
        ):
            return indices, num_ranges  # every input ends before this block
    while mm_idx < num_ranges:
        offset, length = ranges[mm_idx]
        if offset >= end_token_idx:
            break  # the block has not reached this input
        input_end = offset + length
        if input_end < start_token_idx or (input_end == start_token_idx and not include_touching):
            mm_idx += 1  # the block is past this input
            continue
        indices.append(mm_idx)
        if input_end > end_token_idx:
            break  # the input continues into the next block
        mm_idx += 1  # the input ends here; the next one may start in this block too
    return indices, mm_idx


def first_mm_input(
    positions: Sequence[PlaceholderRange], token_idx: int, include_touching: bool = False
) -> int:
    """The index of the first multimodal input ending after `token_idx` (or at it, with
    `include_touching`): where the scan for the block starting at `token_idx` begins.

    Inputs are sorted and disjoint, so their ends are sorted and a binary search finds it. This
    keeps hashing a request's blocks linear whatever the call that starts it: a block hashed by
    `cache_full_blocks` in the middle of a prompt does not rescan the inputs before it.

    Complexity: O(log inputs).
    """
    search = bisect_left if include_touching else bisect_right
    return search(positions, token_idx, key=_input_end)


def _input_end(position: PlaceholderRange) -> int:
    return position.end


def generate_block_hash_extra_keys(
    request: Request,
    start_token_idx: object,
    end_token_idx: object,
    start_mm_idx: object,
    *,
    include_touching: bool = False,
    mm_position: bool = True,
) -> tuple[tuple[ExtraKey, ...] | None, int]:
    """Extra keys of the block covering tokens `[start_token_idx, end_token_idx)`.

    Order: the LoRA id, then each multimodal input from `start_mm_idx` on that overlaps the
    block (`mm_inputs_in_block`) as a `MultimodalKey` (its hash, its offset relative to the
    block's start, its length; without `mm_position`, vLLM 0.8.5's key: its hash alone), then
    the `CacheSalt` (every block: tenant isolation must not rest on hash values alone, see
    `pagedkv.spec.block_hash`). `include_touching` also takes an input ending exactly where the
    block starts (vLLM 0.8.5's quirk, difference 6).

    Returns:
        The keys (None when there are none) and the index of the first multimodal input the next
        block must consider, so a left-to-right scan over blocks is linear overall.

    Raises:
        ArgumentTypeError, InvalidArgumentError: an argument of the wrong type, a negative index,
            or a block that ends before it starts.

    Complexity: O(1) plus the multimodal inputs passed over.
    """
    call = "generate_block_hash_extra_keys"
    require_instance(call, "request", request, Request)
    start = require_int(call, "start_token_idx", start_token_idx, 0)
    end = require_int(call, "end_token_idx", end_token_idx, start)
    mm_idx = require_int(call, "start_mm_idx", start_mm_idx, 0)
    keys: list[ExtraKey] = []
    if request.lora_id is not None:
        keys.append(request.lora_id)
    if request.mm_positions:
        indices, mm_idx = mm_inputs_in_block(
            _RangesAsTuples(request.mm_positions), start, end, mm_idx, include_touching
        )
        mm_hashes = request.mm_hashes
        if mm_position:
            positions = request.mm_positions
            keys.extend(
                MultimodalKey(mm_hashes[i], positions[i].offset - start, positions[i].length)
                for i in indices
            )
        else:
            keys.extend(mm_hashes[i] for i in indices)
    if request.cache_salt is not None:
        keys.append(CacheSalt(request.cache_salt))
    return (tuple(keys) if keys else None), mm_idx


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: object,
    curr_block_token_ids: Sequence[int],
    extra_keys: object = None,
) -> BlockHashType:
    """Hash one full block, chained to its parent's hash value (None or 0: the chain's start).

    Raises:
        ArgumentTypeError, InvalidArgumentError: `hash_fn` not callable, a parent that is not an
            int or None, a token that is not a token id, extra keys that are not a tuple or
            None, or a hash function that returns something else than an int.

    Complexity: O(len(curr_block_token_ids)) plus the hash function.
    """
    call = "hash_block_tokens"
    require_callable(call, "hash_fn", hash_fn)
    parent = (
        None
        if parent_block_hash is None
        else require_int(call, "parent_block_hash", parent_block_hash)
    )
    token_ids = require_token_ids(call, "curr_block_token_ids", curr_block_token_ids)
    keys: tuple[ExtraKey, ...] | None = (
        None if extra_keys is None else require_instance(call, "extra_keys", extra_keys, tuple)
    )
    block_hash = chain_block_hash(hash_fn, parent, token_ids, keys)
    require_int(call, "the value hash_fn returned", hash_value_of(block_hash))
    return block_hash


_new_tuple = tuple.__new__


def chain_block_hashes(
    hash_fn: HashFn,
    parent_hash_value: int | None,
    token_ids: list[int],
    first_token: int,
    num_blocks: int,
    block_size: int,
    extra_keys: Sequence[tuple[ExtraKey, ...] | None] | None = None,
) -> list[BlockHashType]:
    """The chained hashes of `num_blocks` consecutive blocks of `token_ids` from `first_token`:
    the first chained to `parent_hash_value` (None or 0: the chain's start), each next one to
    the one before. `extra_keys[i]` are the i-th block's keys (None: no block has any).

    The one place a block's hash input is made: `(parent value or NONE_HASH, token ids, extra
    keys)`. For arguments already checked; the values `hash_fn` returns are its callers' to
    check (`hash_value_of`).

    Complexity: O(num_blocks * block_size) plus the hash function.
    """
    # Called untyped: a compiled build would check the declared return type here and raise a
    # bare TypeError.
    untyped_hash_fn: Any = hash_fn
    hashes: list[BlockHashType] = []
    parent: Any = parent_hash_value
    keys: tuple[ExtraKey, ...] | None = None
    start = first_token
    for index in range(num_blocks):
        block_tokens = tuple(token_ids[start : start + block_size])
        if extra_keys is not None:
            keys = extra_keys[index]
        parent = untyped_hash_fn((parent or NONE_HASH, block_tokens, keys))
        # BlockHashType(parent, block_tokens, keys), one Python frame less
        hashes.append(_new_tuple(BlockHashType, (parent, block_tokens, keys)))
        start += block_size
    return hashes


def chain_block_hash(
    hash_fn: HashFn,
    parent_hash_value: int | None,
    token_ids: tuple[int, ...],
    extra_keys: tuple[ExtraKey, ...] | None,
) -> BlockHashType:
    """`hash_block_tokens` for arguments already checked: one block (`chain_block_hashes`).

    Complexity: O(len(token_ids)) plus the hash function.
    """
    keys = None if extra_keys is None else (extra_keys,)
    return chain_block_hashes(
        hash_fn, parent_hash_value, list(token_ids), 0, 1, len(token_ids), keys
    )[0]


def hash_value_of(block_hash: BlockHashType) -> object:
    """The hash value a hash function returned, untyped, for its caller to check (a compiled
    build would check it on reading and raise a bare TypeError)."""
    untyped: Any = block_hash
    return untyped.hash_value


def hash_request_tokens(
    hash_fn: HashFn, block_size: object, request: Request, *, mm_position: bool = True
) -> list[BlockHashType]:
    """The chained hashes of every full block of `request.all_token_ids`, in order.

    A trailing partial block is never hashed. `mm_position`: as `generate_block_hash_extra_keys`.

    Raises:
        ArgumentTypeError, InvalidArgumentError: `hash_fn` not callable, `block_size` not an
            int >= 1, `request` not a Request.

    Complexity: O(num_tokens + multimodal inputs).
    """
    call = "hash_request_tokens"
    require_callable(call, "hash_fn", hash_fn)
    size = require_int(call, "block_size", block_size, 1)
    require_instance(call, "request", request, Request)
    token_ids = request._all_token_ids  # read directly: a view's slicing costs a Python call
    num_blocks = len(token_ids) // size
    extra_keys: list[tuple[ExtraKey, ...] | None] | None = None
    if _need_extra_keys(request):
        extra_keys = []
        mm_idx = 0
        for start in range(0, num_blocks * size, size):
            keys, mm_idx = generate_block_hash_extra_keys(
                request, start, start + size, mm_idx, mm_position=mm_position
            )
            extra_keys.append(keys)
    return chain_block_hashes(hash_fn, None, token_ids, 0, num_blocks, size, extra_keys)
