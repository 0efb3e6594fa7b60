"""The implementation's side of KV cache events: a `BlockStored` built from index keys, and the
replay of a stream into what a consumer's index holds (a count of keys per hash value).

The records themselves are `pagedkv.vocab.kv_events` (shared with the spec, which builds and replays
them with its own code, so a mistake here cannot hide in both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_events import (
    BlockRemoved,
    BlockStored,
    EventExtraKey,
    KVCacheEvent,
    KVEventReplayError,
)


def published_extra_keys(block_hash: BlockHashType) -> tuple[EventExtraKey, ...] | None:
    """A key's extra keys as `BlockStored.extra_keys` publishes them: without the cache salt."""
    if block_hash.extra_keys is None:
        return None
    kept = tuple(key for key in block_hash.extra_keys if isinstance(key, (int, str)))
    return kept or None


def block_stored(
    run: Sequence[BlockHashType],
    parent_hash_value: int | None,
    block_size: int,
    lora_id: int | None,
) -> BlockStored:
    """The `BlockStored` event of consecutive keys `run` that entered the index.

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
    )


def replay_hash_counts(
    events: Iterable[KVCacheEvent], counts: Counter[int] | None = None
) -> Counter[int]:
    """Apply `events` in order to `counts` (a fresh Counter when None) and return it.

    `BlockStored` adds one per hash value, `BlockRemoved` takes one away, `AllBlocksCleared`
    empties it. Replaying a pool's whole stream gives, per hash value, how many index keys have
    it (`index_hash_counts`).

    Raises:
        KVEventReplayError: a removal of a hash value the replay does not hold; `counts` then
            holds the events before it.

    Complexity: O(hashes in the events).
    """
    replayed: Counter[int] = Counter() if counts is None else counts
    for event in events:
        if isinstance(event, BlockStored):
            for hash_value in event.block_hashes:
                replayed[hash_value] += 1
        elif isinstance(event, BlockRemoved):
            for hash_value in event.block_hashes:
                if replayed[hash_value] <= 0:
                    del replayed[hash_value]
                    raise KVEventReplayError(
                        f"BlockRemoved of hash {hash_value}, which no BlockStored announced"
                    )
                replayed[hash_value] -= 1
                if not replayed[hash_value]:
                    del replayed[hash_value]
        else:
            replayed.clear()
    return replayed


def index_hash_counts(keys: Iterable[BlockHashType]) -> Counter[int]:
    """Per hash value, how many of the index keys `keys` have it: what a replay must give."""
    return Counter(block_hash.hash_value for block_hash in keys)
