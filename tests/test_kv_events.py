"""KV cache events: exactly one BlockStored when a key enters the index, one BlockRemoved when it
leaves, AllBlocksCleared at a reset; replaying them reproduces the index. Spec and impl side by
side, with exact streams; events off queue nothing and change no decision.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import pytest
from manager_fixtures import MANAGER_FACTORIES, manager_config

from pagedkv import (
    ArgumentTypeError,
    BlockHashType,
    BlockPool,
    InvariantViolation,
    KVCacheManager,
    Request,
    hash_request_tokens,
    sha256,
)
from pagedkv.events.index import index_hash_counts, replay_hash_counts
from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.protocol import ManagerUnderTest, PoolUnderTest
from pagedkv.spec import SpecBlockPool
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.vocab.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventExtraKey,
    KVCacheEvent,
    KVEventReplayError,
)
from pagedkv.vocab.request import PlaceholderRange
from pagedkv.vocab.semantics import PAGEDKV

SIDES = ("spec", "impl")
POOLS = {"spec": spec_pool, "impl": pagedkv_pool}


def make(side: str, events: bool = True, **kwargs: Any) -> ManagerUnderTest:
    config = dataclasses.replace(manager_config(**kwargs), enable_kv_cache_events=events)
    manager = MANAGER_FACTORIES[side](config)
    manager.check_invariants()
    return manager


def take(manager: Any) -> list[KVCacheEvent]:
    events: list[KVCacheEvent] = manager.take_events()
    manager.check_invariants()
    return events


def admit(manager: ManagerUnderTest, request: Request) -> list[int] | None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return new


def stored(
    hashes: list[BlockHashType], parent: int | None, lora_id: int | None = None, block_size: int = 2
) -> BlockStored:
    """The BlockStored a run of `hashes` should produce."""
    return BlockStored(
        tuple(h.hash_value for h in hashes),
        parent,
        tuple(token for h in hashes for token in h.token_ids),
        block_size,
        lora_id,
        # As they are: these helpers' requests have no salt, the one key events leave out.
        tuple(cast("tuple[EventExtraKey, ...] | None", h.extra_keys) for h in hashes),
    )


# -- what is emitted, exactly --------------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_a_prefill_announces_its_full_blocks_then_a_decode_the_block_it_fills(side: str) -> None:
    manager = make(side, block_size=2, num_blocks=8)
    request = Request("a", [1, 2, 3, 4, 5], lora_id=7)
    admit(manager, request)
    chain = hash_request_tokens(sha256, 2, request)
    stored_prefill = BlockStored(
        (chain[0].hash_value, chain[1].hash_value), None, (1, 2, 3, 4), 2, 7, ((7,), (7,))
    )
    assert take(manager) == [stored_prefill]
    request.append_output_token_ids(6)
    manager.allocate_slots(request, 1)  # completes block 2: [5, 6]
    block_2 = hash_request_tokens(sha256, 2, request)[2]
    assert take(manager) == [stored([block_2], chain[1].hash_value, lora_id=7)]
    assert take(manager) == []  # drained


@pytest.mark.parametrize("side", SIDES)
def test_a_hash_cached_in_two_blocks_is_stored_once_and_removed_once(side: str) -> None:
    """The last full block of a prompt is never looked up, so the same prompt caches it again
    in a block of its own: one key, two blocks. vLLM would announce it twice and remove it
    when the first of the two blocks is evicted."""
    manager = make(side, block_size=2, num_blocks=5)
    first, second = Request("first", [1, 2, 3, 4]), Request("second", [1, 2, 3, 4])
    admit(manager, first)
    chain = hash_request_tokens(sha256, 2, first)
    assert take(manager) == [stored(chain, None)]
    admit(manager, second)  # hits block 0's key, caches [3, 4] again: no event
    assert take(manager) == []
    manager.free(first)  # frees [3, 4] (its copy) then [1, 2], which second still holds
    manager.free(second)  # then second's copy of [3, 4]
    manager.free_block_hashes(first)
    manager.free_block_hashes(second)
    # Free queue now: the unused block, first's copy of [3, 4], second's copy, then [1, 2].
    assert admit(manager, Request("x", [9])) is not None  # takes the unused block
    assert take(manager) == []
    y = Request("y", [9, 8, 7])  # takes both copies of [3, 4]: only the second removes the key
    assert admit(manager, y) is not None
    y_chain = hash_request_tokens(sha256, 2, y)
    assert take(manager) == [BlockRemoved((chain[1].hash_value,)), stored(y_chain, None)]
    assert admit(manager, Request("z", [5])) is not None
    assert take(manager) == [BlockRemoved((chain[0].hash_value,))]


@pytest.mark.parametrize("side", SIDES)
def test_a_reset_is_announced_and_a_refused_reset_is_not(side: str) -> None:
    manager = make(side, block_size=2, num_blocks=6)
    request = Request("a", [1, 2, 3])
    admit(manager, request)
    take(manager)
    assert manager.reset_prefix_cache() is False  # a block is in use
    assert take(manager) == []
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert take(manager) == [AllBlocksCleared()]


@pytest.mark.parametrize("side", SIDES)
def test_a_refused_call_queues_no_event(side: str) -> None:
    manager = make(side, block_size=2, num_blocks=6)
    request = Request("a", [1, 2, 3, 4, 5])
    with pytest.raises(Exception, match="tokens computed after this step"):
        manager.allocate_slots(request, request.num_tokens + 1)
    assert take(manager) == []


@pytest.mark.parametrize("side", SIDES)
def test_null_blocks_split_a_cache_call_into_runs_with_their_parents(side: str) -> None:
    """A pool-level call over [b1, null, b2, b3]: two runs, each chained to the hash before it."""
    pool: Any = POOLS[side](8, True, PAGEDKV, True)
    request = Request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    chain = hash_request_tokens(sha256, 2, request)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, [blocks[0], 0, blocks[1], blocks[2]], [], 0, 4, 2, sha256)
    assert take(pool) == [
        stored(chain[:1], None),
        stored(chain[2:], chain[1].hash_value),
    ]


@pytest.mark.parametrize("side", SIDES)
def test_events_publish_lora_ids_and_multimodal_hashes_but_never_the_salt(side: str) -> None:
    manager = make(side, block_size=2, num_blocks=6)
    request = Request(
        "a",
        [1, 2, 3, 4, 5],
        mm_positions=[PlaceholderRange(2, 2)],
        mm_hashes=["image-1"],
        lora_id=3,
        cache_salt="tenant-secret",
    )
    admit(manager, request)
    (event,) = take(manager)
    assert isinstance(event, BlockStored)
    assert event.extra_keys == ((3,), (3, "image-1"))
    assert "tenant-secret" not in repr(event)


@pytest.mark.parametrize("side", SIDES)
def test_a_hash_value_shared_by_two_keys_is_counted_twice(side: str) -> None:
    """Two keys, one hash value (a forced collision): two BlockStored with the same value, and a
    replay that counts per value still holds the index exactly."""

    def collide(_: object) -> int:
        return 7

    pool: Any = POOLS[side](6, True, PAGEDKV, True)
    first, second = Request("a", [1, 2]), Request("b", [3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, blocks[:1], [], 0, 1, 2, collide)
    pool.cache_full_blocks(second, blocks[1:], [], 0, 1, 2, collide)
    events = take(pool)
    assert [event.block_hashes for event in events] == [(7,), (7,)]  # type: ignore[union-attr]
    assert replay_hash_counts(events) == Counter({(0, 7): 2})


# -- off by default, and off changes nothing -----------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_events_off_queue_nothing_and_take_no_other_decision(side: str) -> None:
    on, off = make(side, events=True, block_size=2, num_blocks=4), make(side, events=False)
    off = make(side, events=False, block_size=2, num_blocks=4)
    for manager in (on, off):
        for index, prompt in enumerate(([1, 2, 3], [1, 2, 5], [6, 6, 6, 6, 6])):
            request = Request(f"r{index}", prompt)
            admit(manager, request)
            manager.free(request)
        manager.reset_prefix_cache()
    assert take(on) != []
    assert take(off) == []
    assert on.snapshot().pool.kv_events == ()
    assert off.snapshot().pool.kv_events is None
    assert dataclasses.replace(on.snapshot().pool, kv_events=None) == off.snapshot().pool


def test_the_manager_takes_events_off_by_default() -> None:
    from pagedkv import FullAttentionSpec, KVCacheManager, uniform_kv_cache_config

    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(spec, 4), max_model_len=16)
    request = Request("a", [1, 2, 3])
    manager.allocate_slots(request, 3)
    assert manager.take_events() == []
    assert manager.block_pool.kv_event_queue == []


# -- the replay invariant catches a lost or a repeated event -------------------------------------


def _queue(pool: Any) -> list[KVCacheEvent]:
    queue: list[KVCacheEvent] = (
        pool.pool.events if hasattr(pool.pool, "events") else (pool.pool.kv_event_queue)
    )
    return queue


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(
    ("corrupt", "detail"),
    [
        (lambda queue: queue.pop(), "index only"),  # a lost BlockStored
        (lambda queue: queue.append(queue[-1]), "replay only"),  # a repeated BlockStored
        (lambda queue: queue.append(BlockRemoved((99,))), "no BlockStored announced"),
    ],
    ids=["missing", "duplicate", "unannounced removal"],
)
def test_the_replay_invariant_catches_a_corrupted_stream(
    side: str, corrupt: Callable[[list[KVCacheEvent]], object], detail: str
) -> None:
    pool: PoolUnderTest = POOLS[side](6, True, PAGEDKV, True)
    request = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, [], 0, 2, 2, sha256)
    pool.check_invariants()
    corrupt(_queue(pool))
    with pytest.raises(InvariantViolation, match="replaying the events") as info:
        pool.check_invariants()
    assert detail in str(info.value)


@pytest.mark.parametrize("side", SIDES)
def test_the_replay_invariant_covers_batches_already_taken(side: str) -> None:
    """The base is what a consumer holds after every taken batch: a batch taken before the loss
    still counts."""
    pool: Any = POOLS[side](3, True, PAGEDKV, True)
    request = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, [], 0, 2, 2, sha256)
    take(pool)
    pool.free_blocks(list(reversed(blocks)))
    pool.get_new_blocks(1)  # evicts the tail block: one BlockRemoved
    assert len(_queue(pool)) == 1
    _queue(pool).clear()  # ... lost
    with pytest.raises(InvariantViolation, match="replaying the events"):
        pool.check_invariants()


def test_a_consumer_refuses_a_removal_it_never_saw_stored() -> None:
    with pytest.raises(KVEventReplayError, match="which no BlockStored announced"):
        replay_hash_counts([BlockRemoved((5,))])
    keys = [BlockHashType(1, (0,)), BlockHashType(1, (2,)), BlockHashType(3, (4,))]
    assert index_hash_counts(keys) == Counter({(0, 1): 2, (0, 3): 1})
    assert replay_hash_counts([stored(keys[:1], None), AllBlocksCleared()]) == Counter()


# -- the optional dependencies stay optional -----------------------------------------------------


def test_importing_the_event_modules_loads_no_optional_dependency() -> None:
    code = (
        "import sys, pagedkv, pagedkv.vocab.kv_events, pagedkv.events.wire,"
        " pagedkv.events.publisher, pagedkv.events.metrics;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'msgspec', 'zmq', 'prometheus_client'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_implementations_replay_report_names_both_sides_exactly() -> None:
    pool: Any = pagedkv_pool(4, True, PAGEDKV, True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(Request("a", [1, 2]), blocks, [], 0, 1, 2, lambda _: 5)
    pool.pool.kv_event_queue.append(BlockStored((6,), None, (3, 4), 2, None, (None,)))
    with pytest.raises(InvariantViolation) as info:
        pool.check_invariants()
    assert (info.value.invariant, info.value.detail) == (
        "replaying the events reproduces the hash index",
        "replay only: {(0, 6): 1}, index only: {}",
    )


@pytest.mark.parametrize("side", SIDES)
def test_an_event_queued_while_events_are_off_is_reported(side: str) -> None:
    pool: Any = POOLS[side](4, True, PAGEDKV, False)
    queue = pool.pool.events if side == "spec" else pool.pool.kv_event_queue
    queue.append(AllBlocksCleared())
    with pytest.raises(InvariantViolation, match="no event is queued while events are off"):
        pool.check_invariants()


@pytest.mark.parametrize("flag", [1, "yes", None, 1.0])
def test_a_flag_that_is_not_a_bool_is_refused_naming_the_constructor(flag: object) -> None:
    """The events flag is checked with the other constructor arguments, on both sides."""
    config = manager_config()
    for cls, name in ((BlockPool, "BlockPool"), (SpecBlockPool, "BlockPool")):
        with pytest.raises(ArgumentTypeError, match=f"{name}.*enable_kv_cache_events must be"):
            cls(4, True, PAGEDKV, flag)  # type: ignore[arg-type]
    for manager_class in (KVCacheManager, SpecKVCacheManager):
        with pytest.raises(ArgumentTypeError, match="enable_kv_cache_events must be a bool"):
            manager_class(
                config.kv_cache_config,
                8,
                enable_kv_cache_events=flag,  # type: ignore[arg-type]
            )
