"""pagedkv's msgpack KV events read by a vllm release's own `KVEventBatch`, in a process of its own.

    python tests/vllm_kv_events.py VERSION

Fetches `vllm/distributed/kv_events.py` of vllm VERSION (one wheel member, by range requests,
cached in ~/.cache/pagedkv beside the harness's trees) with stand-ins for the vllm modules it
imports but does not need to define its structs (the logger, the config, the network helpers, the
block-hash type alias), imports it as `vllm`, and checks, for event batches that pagedkv's
managers emitted (a full-attention manager with sha256 and with the builtin hash, a hybrid
manager of two KV cache groups, LoRA and multimodal extra keys, a reset, a data-parallel rank):

- decoded: msgspec decodes `batch_to_msgpack(batch, layout)` as the release's `KVEventBatch`,
  and every field of every event struct holds pagedkv's value (hash bytes read as integers; the
  fields pagedkv does not track hold vLLM's defaults);
- same_items: pagedkv's payload decodes to the same msgpack items, maps in the same key order,
  as msgspec's encoding of the release's structs built with pagedkv's values; same_bytes: it is
  that encoding byte for byte (maps aside: msgspec heads a struct's map with a 16-bit length
  where pagedkv's dict gets the one-byte form, both valid msgpack). Neither is checked for a
  release whose structs lack fields pagedkv writes (its decoder skips the extra trailing items);
- read_back: `batch_from_msgpack` of that vLLM-made payload gives pagedkv's batch back.

Batches whose hashes do not fit 64 bits (sha256) are skipped for a release that declares its
hashes as `list[int]` (0.9), and reported as `int_only`, with whether its decoder refuses them.
Both layouts are tried (the release's decoder must refuse the other one). Prints one JSON line:
per layout, what held and every mismatch. Exit status: 0 the checks ran, 2 a setup error, 3 the
package index is unreachable and nothing is cached (the test skips, saying so).
"""

from __future__ import annotations

import json
import sys
import urllib.error
from typing import Any

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheTensor,
    PlaceholderRange,
    Request,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.events.wire import (
    EVENT_FIELDS,
    MSGPACK_LAYOUTS,
    batch_from_msgpack,
    batch_to_msgpack,
    event_to_dict,
)
from pagedkv.harness.vllm.wheel import FetchError, source_tree
from pagedkv.vocab.kv_events import KVCacheEvent, KVEventBatch

UNREACHABLE = 3
MEMBER = "vllm/distributed/kv_events.py"
_PACKAGES = (
    "vllm/__init__.py",
    "vllm/distributed/__init__.py",
    "vllm/utils/__init__.py",
    "vllm/v1/__init__.py",
    "vllm/v1/core/__init__.py",
)
# Written for this check, not taken from vLLM: only the names kv_events.py imports.
STAND_INS: dict[str, str] = {name: "" for name in _PACKAGES}
STAND_INS["vllm/config/__init__.py"] = "class KVEventsConfig:\n    pass\n"
STAND_INS["vllm/config/kv_events.py"] = "class KVEventsConfig:\n    pass\n"
STAND_INS["vllm/logger.py"] = (
    "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n"
)
STAND_INS["vllm/utils/network_utils.py"] = (
    "def _unused(*args, **kwargs):\n"
    "    raise NotImplementedError('not needed to decode events')\n\n\n"
    "get_ip = get_tcp_uri = is_valid_ipv6_address = split_zmq_path = make_zmq_path = _unused\n"
)
STAND_INS["vllm/v1/core/kv_cache_utils.py"] = "ExternalBlockHash = bytes | int\n"


def _unreachable(error: BaseException) -> bool:
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, urllib.error.URLError | ConnectionError | TimeoutError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


# -- pagedkv's batches ---------------------------------------------------------------------------


def _full_attention_batches(algo: str) -> list[KVEventBatch]:
    """Stores (a LoRA request, a multimodal one), evictions at reuse, then a reset."""
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16")
    manager = KVCacheManager(
        uniform_kv_cache_config(spec, num_blocks=6),
        max_model_len=32,
        caching_hash_algo=algo,
        enable_kv_cache_events=True,
    )
    batches = []
    requests = [
        Request("lora", [1, 2, 3, 4, 5], lora_id=7),
        Request(
            "image",
            [9, 9, 9, 9, 8],
            mm_positions=[PlaceholderRange(offset=1, length=2)],
            mm_hashes=["img-0"],
        ),
        Request("plain", [4, 4, 4, 4, 4, 4, 4, 4, 4]),  # evicts what the others cached
    ]
    for step, request in enumerate(requests):
        hits, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens, hits) is not None
        manager.free(request)
        manager.free_block_hashes(request)
        batches.append(KVEventBatch(1000.0 + step, tuple(manager.take_events())))
    assert manager.reset_prefix_cache()
    batches.append(KVEventBatch(1010.5, tuple(manager.take_events()), data_parallel_rank=2))
    return batches


def _hybrid_batches() -> list[KVEventBatch]:
    """Two KV cache groups: every event names its group."""
    full = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16")
    window = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=4
    )
    tensor = KVCacheTensor(size=full.page_size_bytes * 10)
    config = KVCacheConfig(
        10,
        {"layers.0": tensor, "layers.1": tensor},
        [KVCacheGroupSpec(["layers.0"], full), KVCacheGroupSpec(["layers.1"], window)],
    )
    manager = KVCacheManager(config, max_model_len=16, enable_kv_cache_events=True)
    batches = []
    for step, tokens in enumerate(([1, 2, 3, 4, 5], [6, 6, 6, 6, 6, 6, 6])):
        request = Request(f"r{step}", tokens)
        hits, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens, hits) is not None
        manager.free(request)
        manager.free_block_hashes(request)
        batches.append(KVEventBatch(2000.0 + step, tuple(manager.take_events())))
    return batches


def batches() -> dict[str, list[KVEventBatch]]:
    found = {
        "sha256": _full_attention_batches("sha256"),
        "builtin": _full_attention_batches("builtin"),
        "hybrid": _hybrid_batches(),
    }
    kinds = {type(e).__name__ for group in found.values() for b in group for e in b.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    assert any(getattr(e, "group_idx", 0) for b in found["hybrid"] for e in b.events), (
        "the hybrid manager emitted no event of group 1"
    )
    return found


# -- the check ---------------------------------------------------------------------------------


def _wire_hash(value: int) -> int | bytes:
    return value if -(1 << 63) <= value < 1 << 64 else value.to_bytes(32, "big")


def _plain(value: Any) -> Any:
    """Tuples as lists, hash bytes as ints: values as pagedkv's records hold them."""
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return value


def _ordered(value: Any) -> Any:
    """msgpack items with every map as its list of pairs: equal iff equal in the same order."""
    if isinstance(value, dict):
        return [(key, _ordered(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_ordered(item) for item in value]
    return value


def _ours(event: KVCacheEvent) -> dict[str, Any]:
    """The event's fields as vLLM names them, with the values vLLM requires pagedkv to send."""
    fields = event_to_dict(event)
    if "block_hashes" in fields:
        fields.update(medium="GPU", group_idx=getattr(event, "group_idx", 0))
    if "token_ids" in fields:
        fields["lora_name"] = None
    return fields


def _vllm_event(kv: Any, event: KVCacheEvent) -> Any:
    """The release's own struct holding pagedkv's values (the fields it declares)."""
    cls = getattr(kv, type(event).__name__)
    fields = _ours(event)
    values = {}
    for name in cls.__struct_fields__:
        if name in fields:
            value = fields[name]
            if name == "block_hashes":
                value = [_wire_hash(v) for v in value]
            elif name == "parent_block_hash" and value is not None:
                value = _wire_hash(value)
            elif name == "extra_keys":
                value = [None if keys is None else tuple(keys) for keys in value]
            values[name] = value
    return cls(**values)


def _field_mismatches(decoded: Any, event: KVCacheEvent) -> list[str]:
    if type(decoded).__name__ != type(event).__name__:
        return [f"{type(event).__name__} decoded as {type(decoded).__name__}"]
    ours = _ours(event)
    wrong = []
    defaults = dict(
        zip(
            decoded.__struct_fields__[-len(decoded.__struct_defaults__) :]
            if decoded.__struct_defaults__
            else (),
            decoded.__struct_defaults__,
            strict=True,
        )
    )
    for name in decoded.__struct_fields__:
        got = _plain(getattr(decoded, name))
        want = _plain(ours[name]) if name in ours else defaults.get(name)
        if got != want:
            wrong.append(f"{type(event).__name__}.{name}: vLLM read {got!r}, pagedkv sent {want!r}")
    return wrong


def load(version: str) -> tuple[int, Any]:
    """The release's kv_events module, or an exit status and why it could not be had."""
    try:
        root = source_tree(version, [MEMBER], STAND_INS)
    except FetchError as error:
        status = UNREACHABLE if _unreachable(error) else 2
        return status, f"cannot fetch vllm=={version}: {error}"
    sys.path.insert(0, str(root))
    import vllm.distributed.kv_events as kv

    return 0, kv


def check(kv: Any, layout: str) -> dict[str, Any]:
    import msgspec

    stored_fields = list(kv.BlockStored.__struct_fields__)
    int_only = "bytes" not in repr(kv.BlockStored.__annotations__.get("block_hashes"))
    complete = all(
        set(fields) <= set(getattr(kv, kind).__struct_fields__)
        for kind, fields in EVENT_FIELDS.items()
    )
    report: dict[str, Any] = {
        "array_like": bool(kv.BlockStored.__struct_config__.array_like),
        "block_stored_fields": stored_fields,
        "block_removed_fields": list(kv.BlockRemoved.__struct_fields__),
        "int_only": int_only,
        "complete": complete,
        "batches": 0,
        "events": 0,
        "group_idx_seen": [],
        "same_items": 0,
        "same_bytes": 0,
        "mismatches": [],
    }
    groups = set()
    for name, group in batches().items():
        for batch in group:
            payload = batch_to_msgpack(batch, layout)  # type: ignore[arg-type]
            too_wide = any(
                isinstance(_wire_hash(v), bytes)
                for e in batch.events
                for v in getattr(e, "block_hashes", ())
            )
            if int_only and too_wide:
                try:
                    msgspec.msgpack.decode(payload, type=kv.KVEventBatch)
                    report["mismatches"].append(f"{name}: an int-only release took hash bytes")
                except msgspec.ValidationError:
                    report["refuses_hash_bytes"] = True
                continue
            try:
                decoded = msgspec.msgpack.decode(payload, type=kv.KVEventBatch)
            except msgspec.ValidationError as error:
                report["mismatches"].append(f"{name}: vLLM's decoder refused it: {error}")
                continue
            report["batches"] += 1
            has_rank = "data_parallel_rank" in kv.KVEventBatch.__struct_fields__
            if decoded.ts != batch.ts or (
                has_rank and decoded.data_parallel_rank != batch.data_parallel_rank
            ):
                report["mismatches"].append(f"{name}: ts or rank {decoded!r}")
            if len(decoded.events) != len(batch.events):
                report["mismatches"].append(f"{name}: {len(decoded.events)} events decoded")
            for got, event in zip(decoded.events, batch.events, strict=False):
                report["events"] += 1
                report["mismatches"] += [f"{name}: {m}" for m in _field_mismatches(got, event)]
                if hasattr(got, "group_idx"):
                    groups.add(got.group_idx)
            rank = {"data_parallel_rank": batch.data_parallel_rank}
            theirs = kv.KVEventBatch(
                ts=batch.ts,
                events=[_vllm_event(kv, event) for event in batch.events],
                **(rank if "data_parallel_rank" in kv.KVEventBatch.__struct_fields__ else {}),
            )
            vllm_payload = msgspec.msgpack.encode(theirs)
            if not complete:
                continue  # its structs lack fields pagedkv writes: no equal bytes, nothing to read
            if vllm_payload == payload:
                report["same_bytes"] += 1
            if _ordered(msgspec.msgpack.decode(vllm_payload)) == _ordered(
                msgspec.msgpack.decode(payload)
            ):
                report["same_items"] += 1
            else:
                report["mismatches"].append(f"{name}: vLLM's {vllm_payload!r}, ours {payload!r}")
            try:
                read_back: object = batch_from_msgpack(vllm_payload)
            except Exception as error:
                read_back = error
            if read_back != batch:
                report["mismatches"].append(f"{name}: vLLM's payload read back as {read_back!r}")
    report["group_idx_seen"] = sorted(groups, key=repr)
    if not report["batches"]:
        report["mismatches"].append("no batch was checked")
    return report


def main() -> int:
    version = sys.argv[1]
    status, kv = load(version)
    if status:
        print(json.dumps({"version": version, "setup_error": kv}))
        return int(status)
    reports = {layout: check(kv, layout) for layout in MSGPACK_LAYOUTS}
    print(json.dumps({"version": version, **reports}, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
