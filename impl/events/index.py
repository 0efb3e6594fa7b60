"""The implementation's side of KV cache events: a `BlockStored` built from index keys, a
`BlockRemoved` of one key, and the replay of a stream into what a consumer's index holds (a
count of keys per KV cache group and hash value).

The records themselves are `pagedkv.vocab.kv_events` (shared with the spec, which builds and replays
them with its own code, so a mistake here cannot hide in both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey, MultimodalKey
from pagedkv.vocab.kv_events import (
    BlockRemoved,
    BlockStored,
    EventExtraKey,
    KVCacheEvent,
    KVEventReplayError,
)


def published_extra_keys(block_hash: BlockHashType) -> tuple[EventExtraKey, ...] | None:
    """A key's extra keys as `BlockStored.extra_keys` publishes them: a multimodal input as its
    content hash, without the cache salt."""
    if block_hash.extra_keys is None:
        return None
    kept = tuple(
        key.mm_hash if isinstance(key, MultimodalKey) else key
        for key in block_hash.extra_keys
        if isinstance(key, (int, str, MultimodalKey))
    )
    return kept or None


def block_stored(
    run: Sequence[BlockHashType],
    parent_hash_value: int | None,
    block_size: int,
    lora_id: int | None,
    group_idx: int = 0,
) -> BlockStored:
    """The `BlockStored` event of consecutive hashes `run` whose keys of KV cache group
    `group_idx` entered the index.

    Complexity: O(tokens of the run).
    """
    token_ids: list[int] = []
    for block_hash in run:
        token_ids.extend(block_hash.token_ids)
    return BlockStored(
        tuple(block_hash.hash_value for block_hash in run),
        parent_hash_value,
        tuple(token_ids),
        block_size,
        lora_id,
        tuple(published_extra_keys(block_hash) for block_hash in run),
        group_idx,
    )


def block_removed(key: CacheKey) -> BlockRemoved:
    """The `BlockRemoved` event of index key `key`, which left the index. Complexity: O(1)."""
    if isinstance(key, GroupKey):
        return BlockRemoved((key.block_hash.hash_value,), key.group_id)
    return BlockRemoved((key.hash_value,))


HashCount = tuple[int, int]
"""What a replay counts keys by: (KV cache group, hash value)."""


def replay_hash_counts(
    events: Iterable[KVCacheEvent], counts: Counter[HashCount] | None = None
) -> Counter[HashCount]:
    """Apply `events` in order to `counts` (a fresh Counter when None) and return it.

    `BlockStored` adds one per (group, hash value), `BlockRemoved` takes one away,
    `AllBlocksCleared` empties it. Replaying a pool's whole stream gives, per group and hash
    value, how many index keys have them (`index_hash_counts`).

    Raises:
        KVEventReplayError: a removal of a hash value the replay does not hold; `counts` then
            holds the events before it.

    Complexity: O(hashes in the events).
    """
    replayed: Counter[HashCount] = Counter() if counts is None else counts
    for event in events:
        if isinstance(event, BlockStored):
            for hash_value in event.block_hashes:
                replayed[event.group_idx, hash_value] += 1
        elif isinstance(event, BlockRemoved):
            for hash_value in event.block_hashes:
                counted = (event.group_idx, hash_value)
                if replayed[counted] <= 0:
                    del replayed[counted]
                    raise KVEventReplayError(
                        f"BlockRemoved of hash {hash_value} (group {event.group_idx}), which no "
                        "BlockStored announced"
                    )
                replayed[counted] -= 1
                if not replayed[counted]:
                    del replayed[counted]
        else:
            replayed.clear()
    return replayed


def index_hash_counts(keys: Iterable[CacheKey]) -> Counter[HashCount]:
    """Per (group, hash value), how many of the index keys `keys` have them: what a replay must
    give."""
    return Counter(
        (key.group_id, key.block_hash.hash_value)
        if isinstance(key, GroupKey)
        else (0, key.hash_value)
        for key in keys
    )
