"""KV cache events: what entered and left the prefix-cache index, in vLLM's event schema.

A router doing KV-aware routing, or any mirror of the cache, keeps its own copy of the index from
these events. pagedkv emits each of them exactly once:

- `BlockStored` when index keys *enter* the index: the first block is cached under a key. One
  event per maximal run of consecutive positions of one `cache_full_blocks` call whose keys
  entered; `parent_block_hash` is the hash value the run's first block chains to.
- `BlockRemoved` when a key *leaves* the index: the last block cached under it is evicted (lazily,
  when a free block is handed out again). One event per key.
- `AllBlocksCleared` on every successful `reset_prefix_cache` (the index is empty after it).

A second block cached under a key that is already indexed, or the eviction of one of two blocks
cached under a key, emits nothing: the set of keys did not change. vLLM emits one event per block
instead, so its stream announces a hash twice and removes a hash that another block still holds.

What a consumer gets as a block's hash is the key's `hash_value` (an int, as vLLM's
`block_hashes`); the rest of the key travels in `BlockStored` (`token_ids`, `extra_keys`). So the
exact replay is a count per hash value (`pagedkv.events.index.replay_hash_counts`):
replaying every event emitted so far gives, for each hash value, the number of index keys with
that value. With sha256 (the default) that is 1 for every cached hash; a count of 2 only arises
from a collision of hash values between different keys, possible with
`caching_hash_algo="builtin"`. Both pools state this replay as an invariant
(`check_invariants()`), and the differential harness compares the streams of spec and
implementation after every step.

Events are off by default: `KVCacheManager(..., enable_kv_cache_events=True)` turns them on;
the scheduler drains them once a step with `take_events()` and publishes them as one
`KVEventBatch` (`pagedkv.events.publisher`, serialized by `pagedkv.events.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from pagedkv.vocab.errors import PagedKVError

EventExtraKey: TypeAlias = "int | str"
"""An extra key as events publish it: a LoRA id (int) or a multimodal content hash (str)."""


@dataclass(frozen=True)
class BlockStored:
    """Index keys that entered the index, in chain order (vLLM's `BlockStored`).

    Attributes:
        block_hashes: each key's hash value.
        parent_block_hash: the hash value the first block chains to; None for a request's
            first block.
        token_ids: every block's tokens, concatenated (`block_size` a block).
        block_size: tokens per block.
        lora_id: the request's LoRA adapter id, or None.
        extra_keys: per block, its extra keys without the tenant's cache salt (a LoRA id and
            multimodal content hashes), or None when it has none. The salt is never published:
            whoever knew it could send requests that hit the tenant's blocks. The hash values
            cover it.
        group_idx: the KV cache group the blocks belong to (0 for a single-group model): each
            group indexes its own blocks, so one hash value may be stored once per group.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    extra_keys: tuple[tuple[EventExtraKey, ...] | None, ...]
    group_idx: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Index keys that left the index (vLLM's `BlockRemoved`): one key, by its hash value, of
    KV cache group `group_idx`."""

    block_hashes: tuple[int, ...]
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """A successful prefix-cache reset: the index is empty (vLLM's `AllBlocksCleared`)."""


KVCacheEvent: TypeAlias = "BlockStored | BlockRemoved | AllBlocksCleared"


@dataclass(frozen=True)
class KVEventBatch:
    """The events one scheduler step drained, as published (vLLM's `KVEventBatch`).

    Attributes:
        ts: when the batch was made, in seconds since the epoch.
        events: in the order they happened.
        data_parallel_rank: the data-parallel rank of the engine that emitted them, if any.
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


class KVEventReplayError(PagedKVError):
    """An event stream that cannot come from an index: a removal of a hash not stored."""
