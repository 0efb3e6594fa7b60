"""KV cache event batches on the wire and through publishers: the JSON form and vLLM's msgpack
form round-trip exactly, their layouts are pinned, malformed input is refused with a typed
error, and the in-process and ZeroMQ publishers deliver every batch in order."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import InvalidArgumentError, Request
from pagedkv.events.publisher import CallbackPublisher, ZmqPublisher, publish_step_events
from pagedkv.events.wire import (
    JSON_SCHEMA,
    MSGPACK_LAYOUTS,
    batch_from_json,
    batch_from_msgpack,
    batch_to_json,
    batch_to_msgpack,
)
from pagedkv.extras import MissingExtraError
from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.vocab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

hash_values = st.one_of(
    st.integers(-(1 << 63), (1 << 63) - 1),  # the builtin hash
    st.integers(0, (1 << 256) - 1),  # sha256
)


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    num_blocks = draw(st.integers(1, 3))
    block_size = draw(st.integers(1, 3))
    extra = st.one_of(
        st.none(), st.lists(st.one_of(st.integers(0, 9), st.text(max_size=4)), min_size=1)
    )
    return BlockStored(
        tuple(draw(st.lists(hash_values, min_size=num_blocks, max_size=num_blocks))),
        draw(st.one_of(st.none(), hash_values)),
        tuple(
            draw(
                st.lists(
                    st.integers(0, 50),
                    min_size=num_blocks * block_size,
                    max_size=num_blocks * block_size,
                )
            )
        ),
        block_size,
        draw(st.one_of(st.none(), st.integers(0, 5))),
        tuple(
            None if keys is None else tuple(keys)
            for keys in draw(st.lists(extra, min_size=num_blocks, max_size=num_blocks))
        ),
        draw(st.integers(0, 3)),
    )


batches = st.builds(
    KVEventBatch,
    st.floats(0, 2e9, allow_nan=False),
    st.lists(
        st.one_of(
            block_stored(),
            st.builds(
                BlockRemoved,
                st.lists(hash_values, min_size=1, max_size=2).map(tuple),
                st.integers(0, 3),
            ),
            st.just(AllBlocksCleared()),
        ),
        max_size=4,
    ).map(tuple),
    st.one_of(st.none(), st.integers(0, 7)),
)


@given(batches)
def test_the_json_form_round_trips(batch: KVEventBatch) -> None:
    assert batch_from_json(batch_to_json(batch)) == batch


@given(batches, st.sampled_from(MSGPACK_LAYOUTS))
def test_the_msgpack_form_round_trips_in_both_layouts(batch: KVEventBatch, layout: str) -> None:
    pytest.importorskip("msgspec")
    assert batch_from_msgpack(batch_to_msgpack(batch, layout)) == batch  # type: ignore[arg-type]


EXAMPLE = KVEventBatch(
    1.5,
    (
        BlockStored((11, 1 << 200), None, (1, 2, 3, 4), 2, 7, ((7,), (7, "image"))),
        BlockRemoved((11,)),
        BlockRemoved((12,), 2),
        AllBlocksCleared(),
    ),
)


def test_the_json_layout() -> None:
    assert json.loads(batch_to_json(EXAMPLE)) == {
        "schema": JSON_SCHEMA,
        "ts": 1.5,
        "data_parallel_rank": None,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [11, 1 << 200],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": 7,
                "extra_keys": [[7], [7, "image"]],
            },
            {"type": "BlockRemoved", "block_hashes": [11]},
            {"type": "BlockRemoved", "block_hashes": [12], "group_idx": 2},
            {"type": "AllBlocksCleared"},
        ],
    }


def test_the_msgpack_layout_is_vllms_batch() -> None:
    """An array [ts, events, rank] of tagged maps with vLLM's field names; sha256-sized hashes as
    32 big-endian bytes; vLLM's required `medium` and `lora_name`; `group_idx` always, 0
    included, as vLLM 0.33 writes it; the rank null when unset, as vLLM writes it."""
    msgspec = pytest.importorskip("msgspec")
    decoded = msgspec.msgpack.decode(batch_to_msgpack(EXAMPLE))
    assert decoded == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, (1 << 200).to_bytes(32, "big")],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": 7,
                "extra_keys": [[7], [7, "image"]],
                "group_idx": 0,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [11], "group_idx": 0, "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [12], "group_idx": 2, "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    ranked = KVEventBatch(2.0, (), data_parallel_rank=3)
    assert msgspec.msgpack.decode(batch_to_msgpack(ranked)) == [2.0, [], 3]


def test_the_array_layout_is_vllm_0_9_to_0_23s() -> None:
    """Each event an array, its tag first, then vLLM 0.23's fields in their declaration order,
    the two pagedkv leaves unset null."""
    msgspec = pytest.importorskip("msgspec")
    decoded = msgspec.msgpack.decode(batch_to_msgpack(EXAMPLE, "array"))
    assert decoded == [
        1.5,
        [
            [
                "BlockStored",
                [11, (1 << 200).to_bytes(32, "big")],
                None,
                [1, 2, 3, 4],
                2,
                7,
                "GPU",
                None,
                [[7], [7, "image"]],
                0,
                None,
                None,
            ],
            ["BlockRemoved", [11], "GPU", 0],
            ["BlockRemoved", [12], "GPU", 2],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_msgpack_reads_vllms_unspecified_group_as_group_0() -> None:
    msgspec = pytest.importorskip("msgspec")
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": None}]]
    )
    assert batch_from_msgpack(payload) == KVEventBatch(1.0, (BlockRemoved((5,)),))


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([["Nope", [1]]], "unknown KV cache event type 'Nope'"),
        ([["BlockRemoved", [1], "GPU", 0, "extra"]], "BlockRemoved event has at most 3 fields"),
    ],
)
def test_a_malformed_array_event_is_refused(events: list[object], message: str) -> None:
    msgspec = pytest.importorskip("msgspec")
    with pytest.raises(InvalidArgumentError, match=message):
        batch_from_msgpack(msgspec.msgpack.encode([1.0, events]))


def test_an_unknown_layout_is_refused() -> None:
    pytest.importorskip("msgspec")
    with pytest.raises(InvalidArgumentError, match="layout must be 'map' or 'array'"):
        batch_to_msgpack(EXAMPLE, "tuple")  # type: ignore[arg-type]


@pytest.mark.parametrize("module", ["msgspec", "zmq"])
def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled module looks like
    with pytest.raises(MissingExtraError) as raised:
        if module == "msgspec":
            batch_to_msgpack(EXAMPLE)
        else:
            ZmqPublisher("inproc://never")
    assert str(raised.value) == (
        f"{'batch_to_msgpack' if module == 'msgspec' else 'ZmqPublisher'} needs {module}, which "
        f"is not installed: pip install 'pagedkv[events]'"
    )
    assert isinstance(raised.value, ImportError)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "must be JSON"),
        ('{"schema": "other/1"}', "schema 'other/1'"),
        (f'{{"schema": "{JSON_SCHEMA}", "ts": "x", "events": []}}', "ts must be a finite"),
        (f'{{"schema": "{JSON_SCHEMA}", "ts": 1, "events": [{{"type": "Nope"}}]}}', "'Nope'"),
        (
            f'{{"schema": "{JSON_SCHEMA}", "ts": 1, "events": [{{"type": "BlockRemoved", '
            '"block_hashes": ["7"]}]}',
            "BlockRemoved.block_hashes must be an integer",
        ),
        (
            f'{{"schema": "{JSON_SCHEMA}", "ts": 1, "events": [{{"type": "BlockStored", '
            '"block_hashes": [1], "token_ids": [], "block_size": 1, "extra_keys": []}]}',
            "extra_keys has 0 entries for 1 block hashes",
        ),
        (
            f'{{"schema": "{JSON_SCHEMA}", "ts": 1, "events": [{{"type": "BlockRemoved", '
            '"block_hashes": [7], "group_idx": -1}]}',
            "BlockRemoved.group_idx must be >= 0, got -1",
        ),
        (
            f'{{"schema": "{JSON_SCHEMA}", "ts": 1, "events": [{{"type": "BlockRemoved", '
            '"block_hashes": [7], "group_idx": true}]}',
            "BlockRemoved.group_idx must be an integer",
        ),
    ],
)
def test_a_malformed_batch_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        batch_from_json(text)


def test_a_hash_beyond_256_bits_is_refused() -> None:
    pytest.importorskip("msgspec")
    with pytest.raises(InvalidArgumentError, match="does not fit 256 bits"):
        batch_to_msgpack(KVEventBatch(0.0, (BlockRemoved((1 << 256,)),)))


# -- publishers ----------------------------------------------------------------------------------


def _manager_with_events() -> Any:
    from dataclasses import replace

    from manager_fixtures import manager_config

    config = replace(manager_config(block_size=2, num_blocks=6), enable_kv_cache_events=True)
    return pagedkv_manager(config).manager  # type: ignore[attr-defined]


def test_a_step_publishes_one_batch_and_an_idle_step_none() -> None:
    manager = _manager_with_events()
    received: list[KVEventBatch] = []
    publisher = CallbackPublisher(received.append)
    manager.allocate_slots(Request("a", [1, 2, 3]), 3)
    batch = publish_step_events(manager, publisher, clock=lambda: 42.0, data_parallel_rank=1)
    assert batch is not None and received == [batch]
    assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (42.0, 1, 1)
    assert publish_step_events(manager, publisher) is None  # nothing new: nothing sent
    publisher.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        publisher.publish(batch)


@pytest.mark.parametrize(
    ("encoding", "layout"), [("msgpack", "map"), ("msgpack", "array"), ("json", "map")]
)
def test_the_zmq_publisher_sends_topic_sequence_and_payload(encoding: str, layout: str) -> None:
    zmq = pytest.importorskip("zmq")
    if encoding == "msgpack":
        pytest.importorskip("msgspec")
    context = zmq.Context()
    endpoint = f"inproc://kv-events-{encoding}-{layout}"
    publisher = ZmqPublisher(
        endpoint,
        topic="kv",
        encoding=encoding,  # type: ignore[arg-type]
        layout=layout,  # type: ignore[arg-type]
        context=context,
    )
    subscriber = context.socket(zmq.SUB)
    subscriber.connect(endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.setsockopt(zmq.RCVTIMEO, 5_000)
    decode = batch_from_msgpack if encoding == "msgpack" else batch_from_json
    try:
        # A PUB socket drops what it sends before a subscription arrives: send until one lands.
        for _ in range(100):
            publisher.publish(EXAMPLE)
            if subscriber.poll(50):
                break
        topic, sequence, payload = subscriber.recv_multipart()
        assert topic == b"kv" and decode(payload) == EXAMPLE
        first = int.from_bytes(sequence, "big")
        publisher.publish(KVEventBatch(3.0, ()))
        while True:  # batches sent while subscribing may still be queued
            topic, sequence, payload = subscriber.recv_multipart()
            if decode(payload).ts == 3.0:
                break
        assert int.from_bytes(sequence, "big") == publisher.sequence - 1 > first
    finally:
        publisher.close()
        subscriber.close(linger=0)
        context.term()
    with pytest.raises(InvalidArgumentError, match="closed"):
        publisher.publish(EXAMPLE)


def test_the_zmq_publisher_refuses_an_unknown_encoding() -> None:
    pytest.importorskip("zmq")
    with pytest.raises(InvalidArgumentError, match="encoding"):
        ZmqPublisher("inproc://never", encoding="xml")  # type: ignore[arg-type]
