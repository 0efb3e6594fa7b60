"""Block hashes, defined the plain way: what `pagedkv.block_hash` must compute.

The vocabulary (`BlockHashType`, `NONE_HASH`, the hash functions) is shared with the
implementation; the definitions here avoid every shortcut: the extra keys of a block are found by
testing each multimodal input for overlap, and each chain is recomputed from its first block.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.vocab.hashes import (
    NONE_HASH,
    BlockHashType,
    CacheSalt,
    ExtraKey,
    HashFn,
    MultimodalKey,
)
from pagedkv.vocab.request import Request


def overlaps(offset: int, length: int, start: int, end: int) -> bool:
    """Whether the input at tokens `[offset, offset + length)` shares one with `[start, end)`."""
    return offset < end and start < offset + length


def mm_inputs_in_block(ranges: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the multimodal inputs `(offset, length)` that overlap the block `[start, end)`."""
    return [
        index
        for index, (offset, length) in enumerate(ranges)
        if overlaps(offset, length, start, end)
    ]


def vllm_mm_inputs_in_block(ranges: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """vLLM 0.8.5's choice for a block `cache_full_blocks` hashes itself (difference 6): only the
    last input, when it overlaps the block or ends exactly where the block starts."""
    if not ranges:
        return []
    offset, length = ranges[-1]
    if overlaps(offset, length, start, end) or offset + length == start:
        return [len(ranges) - 1]
    return []


def _ranges(request: Request) -> list[tuple[int, int]]:
    return [(position.offset, position.length) for position in request.mm_positions]


def block_extra_keys(
    request: Request, start: int, end: int, *, mm_position: bool = True
) -> tuple[ExtraKey, ...] | None:
    """LoRA id, then every multimodal input overlapping the block, then the salt.

    A multimodal input is keyed with its place: `MultimodalKey(hash, offset - start, length)`
    (without `mm_position`, vLLM 0.8.5's key: the hash alone), so the key says which token of
    which input fills each slot of the block.

    Each field has a type of its own (an int, strs, a `CacheSalt`; `Request` validates them),
    so no value of one field can stand for another's: a multimodal hash shaped like a salt is
    still a str, never equal to the `CacheSalt` of another tenant.

    The salt joins every block, not only the first (docs/semantics.md, difference 4):
    an index key is (hash value, tokens, extra keys), and the parent chain enters it only
    through the hash value. With the salt in block 0 only, two tenants' identical later blocks
    would have equal keys up to the hash value, and a sliding-window lookup (which probes blocks
    one by one) would then cross tenants on a hash-value collision. With the salt in every key,
    different salts never share a block whatever the hash function.
    """
    keys: list[ExtraKey] = []
    if request.lora_id is not None:
        keys.append(request.lora_id)
    if request.mm_positions:
        for index in mm_inputs_in_block(_ranges(request), start, end):
            placeholder, mm_hash = request.mm_positions[index], request.mm_hashes[index]
            if mm_position:
                keys.append(MultimodalKey(mm_hash, placeholder.offset - start, placeholder.length))
            else:
                keys.append(mm_hash)
    if request.cache_salt is not None:
        keys.append(CacheSalt(request.cache_salt))
    return tuple(keys) if keys else None


def vllm_new_block_extra_keys(
    request: Request, start: int, end: int
) -> tuple[ExtraKey, ...] | None:
    """vLLM 0.8.5's keys for a block `cache_full_blocks` hashes itself (difference 6).

    Only the last multimodal input is considered, and it joins when it overlaps the block or
    ends exactly where the block starts.
    """
    keys: list[ExtraKey] = []
    if request.lora_id is not None:
        keys.append(request.lora_id)
    for index in vllm_mm_inputs_in_block(_ranges(request), start, end):
        keys.append(request.mm_hashes[index])
    if request.cache_salt is not None:
        keys.append(CacheSalt(request.cache_salt))
    return tuple(keys) if keys else None


def block_hash(
    hash_fn: HashFn,
    parent_hash_value: int | None,
    token_ids: tuple[int, ...],
    extra_keys: tuple[ExtraKey, ...] | None,
) -> BlockHashType:
    """One block's key: its hash value chains the parent's value (None or 0 starts a chain)."""
    parent = parent_hash_value if parent_hash_value else NONE_HASH
    return BlockHashType(hash_fn((parent, token_ids, extra_keys)), token_ids, extra_keys)


def request_block_hash(
    hash_fn: HashFn, block_size: int, request: Request, block_index: int
) -> BlockHashType:
    """The hash of full block `block_index` of the request, its chain computed from block 0."""
    assert (block_index + 1) * block_size <= request.num_tokens, "only full blocks are hashed"
    return request_block_hashes(hash_fn, block_size, request)[block_index]


def request_block_hashes(
    hash_fn: HashFn, block_size: int, request: Request, *, mm_position: bool = True
) -> list[BlockHashType]:
    """The hash of every full block of the request, in order, each chained to the one before it
    (block 0 to none); a partial tail is never hashed. `mm_position`: `block_extra_keys`'."""
    assert block_size > 0, "blocks hold at least one token"
    hashes: list[BlockHashType] = []
    parent: int | None = None
    for index in range(request.num_tokens // block_size):
        start, end = index * block_size, (index + 1) * block_size
        tokens = tuple(request.all_token_ids[start:end])
        keys = block_extra_keys(request, start, end, mm_position=mm_position)
        result = block_hash(hash_fn, parent, tokens, keys)
        hashes.append(result)
        parent = result.hash_value
    return hashes
