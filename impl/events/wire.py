"""KV cache event batches on the wire: a documented JSON form, and vLLM's msgpack form.

Both carry the fields of `pagedkv.vocab.kv_events` under vLLM's names, and both round-trip exactly
(`batch_from_json(batch_to_json(b)) == b`, the same for msgpack).

**JSON** (`batch_to_json`, standard library only): one object per batch,

    {"schema": "pagedkv-kv-events/1", "ts": 1718000000.25, "data_parallel_rank": null,
     "events": [
       {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": null,
        "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null,
        "extra_keys": [null, [7, "mm-hash"]]},
       {"type": "BlockRemoved", "block_hashes": [11]},
       {"type": "BlockRemoved", "block_hashes": [11], "group_idx": 1},
       {"type": "AllBlocksCleared"}]}

Hash values are JSON integers of any size: sha256 values (the default) have up to 256 bits, so a
consumer outside Python parses them as big integers (Go's `json.Number`, a BigInt-aware parser in
JavaScript). `extra_keys` has one entry per block: null, or its LoRA id (an int) and multimodal
content hashes (strings); the tenant's cache salt is never included. `group_idx`, the KV cache
group of a hybrid model the keys belong to, is written only when it is not 0 (a single-group
model's events are unchanged) and read as 0 when absent. The schema name changes when a field
changes meaning; fields may be added.

**msgpack** (`batch_to_msgpack`, needs msgspec: the `events` extra): vLLM's `KVEventBatch` as
its `ZmqEventPublisher` sends it, byte for byte: an array `[ts, events, data_parallel_rank]`
(the rank null when unset: vLLM's array-like batch writes it either way), each event in one of
two layouts (`MSGPACK_LAYOUTS`):

- `"map"` (the default), vLLM 0.24 and later (0.33.0 included): each event a map with its `type`
  tag and vLLM's field names, in vLLM's order;
- `"array"`, vLLM 0.9 to 0.23, the layout that consumers written against those releases (routers'
  msgpack decoders) read by position, exactly as vLLM 0.23 writes it: `["BlockStored",
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx, null, null]` (the last two are 0.23's `kv_cache_spec_kind` and
  `kv_cache_spec_sliding_window`), `["BlockRemoved", block_hashes, medium, group_idx]`,
  `["AllBlocksCleared"]`. A decoder of an older release, with fewer fields, reads the ones it
  knows and skips the rest (msgspec ignores trailing array items).

Both carry the fields vLLM requires that pagedkv does not track: `medium` ("GPU": the blocks a KV
cache manager pools) and `lora_name` (null). `group_idx` is always written, 0 included, as vLLM
0.33 writes it (its decoder reads an absent `group_idx` as None, not 0). vLLM 0.33's manager also
labels each `BlockStored` with its group's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`;
pagedkv does not send them (optional fields, which vLLM's decoder reads as None). A hash value that
fits msgpack's 64-bit integers is an integer; a larger one (sha256) is its 32 big-endian bytes, as
vLLM publishes sha256 block hashes (vLLM 0.9's decoder takes integers only: use
`caching_hash_algo="builtin"` for it). `tests/test_kv_events_vllm.py` decodes both layouts with
vLLM's own structs (0.33.0, 0.23.0 and 0.9.0) and compares the bytes with what msgspec makes of
vLLM's structs holding the same events.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal

from pagedkv.extras import import_extra
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventExtraKey,
    KVCacheEvent,
    KVEventBatch,
)

JSON_SCHEMA = "pagedkv-kv-events/1"
MsgpackLayout = Literal["map", "array"]
MSGPACK_LAYOUTS: tuple[MsgpackLayout, ...] = ("map", "array")
"""How msgpack carries each event: vLLM >= 0.24's tagged maps, or vLLM 0.9-0.23's arrays."""
MEDIUM_GPU = "GPU"
EVENT_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
"""vLLM's fields of each event that pagedkv sends, in vLLM's declaration order: the map layout's
order and the array layout's (after the tag), so that pagedkv's payload is byte for byte what
msgspec makes of vLLM's own structs holding the same values."""
_ARRAY_UNSET = {"BlockStored": ("kv_cache_spec_kind", "kv_cache_spec_sliding_window")}
"""vLLM 0.23's trailing fields that pagedkv leaves unset: null in the array layout (an array-like
struct writes every field), absent from maps (vLLM omits a field holding its default)."""
_HASH_BYTES = 32  # a sha256 hash value as bytes
_INT64_MIN, _UINT64_LIMIT = -(1 << 63), 1 << 64


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """One event as a JSON object (vLLM's field names and `type` tag)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "extra_keys": [None if keys is None else list(keys) for keys in event.extra_keys],
            **_group(event.group_idx),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            **_group(event.group_idx),
        }
    return {"type": "AllBlocksCleared"}


def _group(group_idx: int) -> dict[str, int]:
    """The `group_idx` field, left out for group 0."""
    return {"group_idx": group_idx} if group_idx else {}


def event_from_dict(obj: object) -> KVCacheEvent:
    """The event a JSON object (`event_to_dict`'s form) describes.

    Raises:
        InvalidArgumentError: not an event object, an unknown type, or a field missing or of
            the wrong type (the message names it).
    """
    fields = _mapping(obj, "event")
    kind = fields.get("type")
    if kind == "BlockStored":
        block_hashes = _hash_list(fields, "block_hashes")
        extra_keys = _field(fields, "extra_keys")
        if len(extra_keys) != len(block_hashes):
            raise InvalidArgumentError(
                f"BlockStored.extra_keys has {len(extra_keys)} entries for "
                f"{len(block_hashes)} block hashes"
            )
        parent = fields.get("parent_block_hash")
        lora_id = fields.get("lora_id")
        return BlockStored(
            block_hashes,
            None if parent is None else _int(parent, "BlockStored.parent_block_hash"),
            tuple(_int(token, "BlockStored.token_ids") for token in _field(fields, "token_ids")),
            _int(fields.get("block_size"), "BlockStored.block_size"),
            None if lora_id is None else _int(lora_id, "BlockStored.lora_id"),
            tuple(_extra_keys(keys) for keys in extra_keys),
            _group_idx(fields),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hash_list(fields, "block_hashes"), _group_idx(fields))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise InvalidArgumentError(f"unknown KV cache event type {kind!r}")


def batch_to_json(batch: KVEventBatch) -> str:
    """The batch as one JSON object (the module docstring shows the form)."""
    return json.dumps(
        {
            "schema": JSON_SCHEMA,
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": [event_to_dict(event) for event in batch.events],
        },
        separators=(",", ":"),
    )


def batch_from_json(text: str | bytes) -> KVEventBatch:
    """The batch `batch_to_json` wrote.

    Raises:
        InvalidArgumentError: not JSON, another schema, or a malformed batch or event.
    """
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"a KV event batch must be JSON: {error}") from None
    fields = _mapping(obj, "batch")
    if fields.get("schema") != JSON_SCHEMA:
        raise InvalidArgumentError(
            f"KV event batch schema {fields.get('schema')!r}, expected {JSON_SCHEMA!r}"
        )
    return _batch(fields.get("ts"), fields.get("events"), fields.get("data_parallel_rank"))


def batch_to_msgpack(batch: KVEventBatch, layout: MsgpackLayout = "map") -> bytes:
    """The batch in vLLM's msgpack form, events in `layout` (the module docstring shows both).

    Raises:
        MissingExtraError: msgspec is not installed (`pip install 'pagedkv[events]'`).
        InvalidArgumentError: an unknown layout, or a hash value beyond 256 bits (none that
            pagedkv computes).
    """
    msgspec = _msgspec("batch_to_msgpack")
    if layout not in MSGPACK_LAYOUTS:
        raise InvalidArgumentError(f"layout must be 'map' or 'array', got {layout!r}")
    events: list[Any] = []
    for event in batch.events:
        obj = event_to_dict(event)
        if not isinstance(event, AllBlocksCleared):
            obj["block_hashes"] = [_wire_hash(value) for value in obj["block_hashes"]]
            obj["medium"] = MEDIUM_GPU
            obj["group_idx"] = event.group_idx
        if isinstance(event, BlockStored):
            parent = obj["parent_block_hash"]
            obj["parent_block_hash"] = None if parent is None else _wire_hash(parent)
            obj["lora_name"] = None
        kind = obj["type"]
        values = [obj[name] for name in EVENT_FIELDS[kind]]  # vLLM's order, in both layouts
        if layout == "array":
            events.append([kind, *values, *(None for _ in _ARRAY_UNSET.get(kind, ()))])
        else:
            events.append({"type": kind, **dict(zip(EVENT_FIELDS[kind], values, strict=True))})
    encoded: bytes = msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])
    return encoded


def batch_from_msgpack(payload: bytes) -> KVEventBatch:
    """The batch `batch_to_msgpack` wrote, in either layout, or vLLM's own encoding of it (the
    rank may be left out; vLLM's extra fields, such as `medium`, are read over; a `group_idx` of
    None or absent is 0).

    Raises:
        MissingExtraError: msgspec is not installed.
        InvalidArgumentError: not msgpack, or a malformed batch or event.
    """
    msgspec = _msgspec("batch_from_msgpack")
    try:
        array = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidArgumentError(f"a KV event batch must be msgpack: {error}") from None
    if not isinstance(array, list) or len(array) not in (2, 3):
        raise InvalidArgumentError("a msgpack KV event batch is an array [ts, events, rank?]")
    events = array[1]
    if isinstance(events, list):
        events = [_event_from_wire(event) for event in events]
    return _batch(array[0], events, array[2] if len(array) == 3 else None)


# -- helpers ---------------------------------------------------------------------------------------


def _batch(ts: object, events: object, rank: object) -> KVEventBatch:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise InvalidArgumentError(f"KV event batch ts must be a finite number, got {ts!r}")
    if not isinstance(events, list):
        raise InvalidArgumentError(f"KV event batch events must be a list, got {events!r}")
    return KVEventBatch(
        float(ts),
        tuple(event_from_dict(event) for event in events),
        None if rank is None else _int(rank, "KVEventBatch.data_parallel_rank"),
    )


def _mapping(obj: object, what: str) -> Mapping[str, object]:
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"a KV {what} must be an object, got {obj!r}")
    return obj


def _field(fields: Mapping[str, object], name: str) -> list[Any]:
    value = fields.get(name)
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{fields.get('type')}.{name} must be a list, got {value!r}")
    return value


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    return value


def _group_idx(fields: Mapping[str, object]) -> int:
    """An event's KV cache group: 0 when absent, else an integer >= 0."""
    group_idx = _int(fields.get("group_idx", 0), f"{fields.get('type')}.group_idx")
    if group_idx < 0:
        raise InvalidArgumentError(f"{fields.get('type')}.group_idx must be >= 0, got {group_idx}")
    return group_idx


def _hash_list(fields: Mapping[str, object], name: str) -> tuple[int, ...]:
    where = f"{fields.get('type')}.{name}"
    return tuple(_int(value, where) for value in _field(fields, name))


def _extra_keys(keys: object) -> tuple[EventExtraKey, ...] | None:
    if keys is None:
        return None
    if not isinstance(keys, list) or not keys:
        raise InvalidArgumentError(
            f"BlockStored.extra_keys entries are null or non-empty lists, got {keys!r}"
        )
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidArgumentError(
                f"BlockStored.extra_keys holds LoRA ids and multimodal hashes, got {key!r}"
            )
    return tuple(keys)


def _wire_hash(value: int) -> int | bytes:
    """A hash value as msgpack carries it: an integer if it fits 64 bits, else 32 bytes."""
    if _INT64_MIN <= value < _UINT64_LIMIT:
        return value
    if 0 <= value < 1 << (8 * _HASH_BYTES):
        return value.to_bytes(_HASH_BYTES, "big")
    raise InvalidArgumentError(f"hash value {value} does not fit 256 bits")


def _event_from_wire(event: object) -> object:
    """An event of either msgpack layout as `event_to_dict`'s map, hash bytes back to ints."""
    if isinstance(event, list) and event and isinstance(event[0], str):
        if event[0] not in EVENT_FIELDS:
            raise InvalidArgumentError(f"unknown KV cache event type {event[0]!r}")
        fields = EVENT_FIELDS[event[0]] + _ARRAY_UNSET.get(event[0], ())
        if len(event) - 1 > len(fields):
            raise InvalidArgumentError(
                f"an array-layout {event[0]} event has at most {len(fields)} fields, got "
                f"{len(event) - 1}"
            )
        event = {"type": event[0], **dict(zip(fields, event[1:], strict=False))}
    if not isinstance(event, dict):
        return event
    decoded = dict(event)
    if isinstance(decoded.get("block_hashes"), list):
        decoded["block_hashes"] = [_int_hash(item) for item in decoded["block_hashes"]]
    if "parent_block_hash" in decoded:
        decoded["parent_block_hash"] = _int_hash(decoded["parent_block_hash"])
    if decoded.get("group_idx", 0) is None:
        del decoded["group_idx"]  # vLLM's "unspecified": the only group
    return decoded


def _int_hash(value: object) -> object:
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value


def _msgspec(purpose: str) -> Any:
    return import_extra("msgspec", extra="events", purpose=purpose)
