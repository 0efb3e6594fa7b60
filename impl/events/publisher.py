"""Publishing each step's KV cache events: in process, or over ZeroMQ as vLLM does.

A scheduler drains the manager once a step and hands the batch to a publisher:

    publisher = CallbackPublisher(router.apply)        # or ZmqPublisher("tcp://*:5557")
    ...
    publish_step_events(manager, publisher)            # after the step's allocate/free calls

`KVEventPublisher` is the whole interface (`publish`, `close`); anything with those two methods
will do. `ZmqPublisher` needs pyzmq (and msgspec for vLLM's msgpack payload): the `events`
extra, which a `MissingExtraError` names when they are missing. It sends from the calling thread
(a PUB socket never blocks: past its high-water mark it drops messages, and a subscriber sees
the gap in the sequence numbers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pagedkv.events.wire import MSGPACK_LAYOUTS, MsgpackLayout, batch_to_json, batch_to_msgpack
from pagedkv.extras import import_extra
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_events import KVCacheEvent, KVEventBatch

Encoding = Literal["msgpack", "json"]


class KVEventPublisher(Protocol):
    """Where batches of KV cache events go."""

    def publish(self, batch: KVEventBatch) -> None:
        """Deliver one batch; batches arrive in the order they were published."""
        ...

    def close(self) -> None:
        """Release what the publisher holds; no batch may be published after."""
        ...


class EventSource(Protocol):
    """What emits KV cache events: a `KVCacheManager` or a `BlockPool`."""

    def take_events(self) -> list[KVCacheEvent]: ...


def publish_step_events(
    source: EventSource,
    publisher: KVEventPublisher,
    *,
    data_parallel_rank: int | None = None,
    clock: Callable[[], float] = time.time,
) -> KVEventBatch | None:
    """Take the events `source` queued since the last call and publish them as one batch.

    Returns:
        The batch published, or None when there was no event (nothing is published).
    """
    events = source.take_events()
    if not events:
        return None
    batch = KVEventBatch(clock(), tuple(events), data_parallel_rank)
    publisher.publish(batch)
    return batch


class CallbackPublisher:
    """Calls each subscriber with every batch, in process, in subscription order."""

    def __init__(self, *subscribers: Callable[[KVEventBatch], object]) -> None:
        self.subscribers = list(subscribers)
        self.closed = False

    def subscribe(self, subscriber: Callable[[KVEventBatch], object]) -> None:
        self.subscribers.append(subscriber)

    def publish(self, batch: KVEventBatch) -> None:
        """Hand `batch` to every subscriber.

        Raises:
            InvalidArgumentError: the publisher is closed.
        """
        if self.closed:
            raise InvalidArgumentError("publish on a closed CallbackPublisher")
        for subscriber in self.subscribers:
            subscriber(batch)

    def close(self) -> None:
        self.closed = True


class ZmqPublisher:
    """Sends each batch on a ZeroMQ PUB socket as vLLM's `ZmqEventPublisher` does.

    One multipart message per batch: the topic, the batch's sequence number (8 bytes, big-endian,
    from 0), and the payload: vLLM's msgpack form (`encoding="msgpack"`, the default; events as
    maps, vLLM >= 0.24's layout, or as arrays with `layout="array"`, vLLM 0.9-0.23's) or
    pagedkv's JSON form (`"json"`, UTF-8) (`pagedkv.events.wire`).

    Args:
        endpoint: where to bind (`tcp://*:5557`, `ipc://...`, `inproc://...`), or to connect to
            (`tcp://host:port`, as vLLM: an endpoint without `*` and not ipc/inproc).
        topic: the first frame of every message (subscribers filter on its prefix).
        encoding: the payload's form.
        layout: how msgpack lays out each event ("map" or "array"; unused for JSON).
        context: the ZeroMQ context (default: the process's shared one; inproc endpoints need
            the subscriber's).
        hwm: the socket's send high-water mark, in messages.

    Raises:
        InvalidArgumentError: an unknown encoding or layout.
        MissingExtraError: pyzmq, or msgspec for msgpack, is not installed (the `events` extra).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        topic: str = "",
        encoding: Encoding = "msgpack",
        layout: MsgpackLayout = "map",
        context: Any = None,
        hwm: int = 100_000,
    ) -> None:
        if encoding not in ("msgpack", "json"):
            raise InvalidArgumentError(f"encoding must be 'msgpack' or 'json', got {encoding!r}")
        if layout not in MSGPACK_LAYOUTS:
            raise InvalidArgumentError(f"layout must be 'map' or 'array', got {layout!r}")
        zmq = import_extra("zmq", extra="events", purpose="ZmqPublisher")
        if encoding == "msgpack":
            import_extra("msgspec", extra="events", purpose="ZmqPublisher")
        self.encode: Callable[[KVEventBatch], bytes] = (
            (lambda batch: batch_to_msgpack(batch, layout))
            if encoding == "msgpack"
            else _json_bytes
        )
        self.topic = topic.encode()
        self.sequence = 0
        self.socket: Any = (context or zmq.Context.instance()).socket(zmq.PUB)
        self.socket.set_hwm(hwm)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.endpoint = endpoint

    def publish(self, batch: KVEventBatch) -> None:
        """Send `batch` as the next sequence number.

        Raises:
            InvalidArgumentError: the publisher is closed.
        """
        if self.socket is None:
            raise InvalidArgumentError(f"publish on a closed ZmqPublisher ({self.endpoint})")
        payload = self.encode(batch)
        self.socket.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), payload))
        self.sequence += 1

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None


def _json_bytes(batch: KVEventBatch) -> bytes:
    return batch_to_json(batch).encode()
