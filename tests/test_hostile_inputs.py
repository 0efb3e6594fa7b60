"""Hostile input: every public call refuses what a careless or malicious caller passes (wrong
types, NaN, infinities, huge or negative ints, forged tenant keys, requests changed between
calls, blocks of another pool) with a typed pagedkv error, and leaves the state byte for byte as
it was.

"Byte for byte" is a pickle of the whole object graph before and after the call: the pool or
manager with every block, link, index entry, stored hash and tracked request (the requests'
tokens and scheduler fields included). Calls run on the spec and on the implementation alike.
The last sections pin the other promises of issue 12: tenant keys no field can forge, the free
queue's ownership, the builtin hash's token range, linear multimodal hashing and the
concurrent-use guard.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hostile_scenes import (
    SIDES,
    ManagerScene,
    PoolScene,
    manager_scene,
    pool_scene,
    refused,
    state,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import (
    BlockHashType,
    BlockPool,
    BlockStateError,
    FreeKVCacheBlockQueue,
    FreeQueueError,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheTensor,
    PlaceholderRange,
    Request,
    estimate_max_model_len,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    sha256,
    uniform_kv_cache_config,
    unify_kv_cache_configs,
)
from pagedkv import block_hash as block_hash_module
from pagedkv.harness.client.catalog import IDENTITY_CHANGES, not_a_hash, request_field
from pagedkv.planning.kv_cache_config import check_enough_kv_cache_memory, memory_needed_bytes
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.vocab.arguments import MAX_TOKEN_ID
from pagedkv.vocab.errors import ArgumentTypeError, FrozenRequestFieldError

# -- hostile values --------------------------------------------------------------------------------

not_ints = st.one_of(
    st.booleans(),
    st.floats(),  # NaN and the infinities included
    st.none(),
    st.text(max_size=2),
    st.binary(max_size=2),
    st.lists(st.integers(0, 3), max_size=2),
    st.decimals(places=1),
    st.fractions(max_denominator=3),
)
"""Values that are no int: a bool is none either."""

negative_ints = st.integers(max_value=-1)
huge_ints = st.integers(min_value=2**63, max_value=2**200)
bad_counts = st.one_of(not_ints, negative_ints)
not_block_lists = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.lists(st.one_of(st.none(), st.floats(), st.text(max_size=1), st.booleans()), min_size=1),
)
"""No iterable of blocks: not iterable at all, or holding something that is no block."""
not_hit_lists = not_block_lists.filter(lambda value: value is not None)  # None: no hits


# -- every public call of the block pool ---------------------------------------------------------

POOL_CALLS: dict[str, tuple[st.SearchStrategy[object], Callable[[PoolScene, Any], object]]] = {
    "get_new_blocks(num_blocks)": (
        st.one_of(bad_counts, huge_ints),
        lambda s, v: s.pool.get_new_blocks(v),
    ),
    "touch(blocks)": (not_block_lists, lambda s, v: s.pool.touch(v)),
    "free_blocks(ordered_blocks)": (not_block_lists, lambda s, v: s.pool.free_blocks(v)),
    "get_cached_block(block_hash)": (
        st.one_of(
            st.none(),
            st.integers(),
            st.text(max_size=2),
            st.tuples(st.integers(), st.tuples(st.integers(0, 9)), st.none()),  # a plain tuple
            st.builds(BlockHashType, st.integers(), st.lists(st.integers(0, 9))),  # unhashable
        ),
        lambda s, v: s.pool.get_cached_block(v),
    ),
    "cache_full_blocks(request)": (
        st.one_of(st.none(), st.text(max_size=2), st.integers()),
        lambda s, v: s.pool.cache_full_blocks(v, s.blocks, s.stored, 2, 2, 2, sha256),
    ),
    "cache_full_blocks(blocks)": (
        not_block_lists,
        lambda s, v: s.pool.cache_full_blocks(s.request, v, s.stored, 0, 1, 2, sha256),
    ),
    "cache_full_blocks(block_hashes)": (
        st.one_of(st.none(), st.tuples(), st.text(max_size=2), st.frozensets(st.integers())),
        lambda s, v: s.pool.cache_full_blocks(s.request, s.blocks, v, 2, 2, 2, sha256),
    ),
    "cache_full_blocks(num_cached_blocks)": (
        bad_counts,
        lambda s, v: s.pool.cache_full_blocks(s.request, s.blocks, s.stored, v, 2, 2, sha256),
    ),
    "cache_full_blocks(num_full_blocks)": (
        st.one_of(bad_counts, huge_ints),
        lambda s, v: s.pool.cache_full_blocks(s.request, s.blocks, s.stored, 2, v, 2, sha256),
    ),
    "cache_full_blocks(block_size)": (
        st.one_of(bad_counts, st.just(0)),
        lambda s, v: s.pool.cache_full_blocks(s.request, s.blocks, s.stored, 2, 2, v, sha256),
    ),
    "cache_full_blocks(hash_fn)": (
        st.one_of(st.none(), st.integers(), st.text(max_size=2)),
        lambda s, v: s.pool.cache_full_blocks(s.request, s.blocks, s.stored, 2, 2, 2, v),
    ),
}


@pytest.mark.parametrize("side", SIDES)
@given(num_gpu_blocks=st.one_of(not_ints, st.integers(max_value=0)))
def test_a_pool_refuses_a_size_that_is_no_positive_int(side: str, num_gpu_blocks: object) -> None:
    pool_class: Any = SpecBlockPool if side == "spec" else BlockPool
    with pytest.raises(InvalidArgumentError, match="num_gpu_blocks"):
        pool_class(num_gpu_blocks, True)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("enable_caching", [1, 0, None, "yes"])
def test_a_pool_refuses_a_caching_flag_that_is_no_bool(side: str, enable_caching: object) -> None:
    pool_class: Any = SpecBlockPool if side == "spec" else BlockPool
    with pytest.raises(ArgumentTypeError, match="enable_caching must be a bool"):
        pool_class(4, enable_caching)


@pytest.mark.parametrize("side", SIDES)
def test_a_tuple_of_stored_hashes_indexes_nothing(side: str) -> None:
    """Issue 12: a tuple for block_hashes indexed the blocks, then failed to extend it."""
    scene = pool_scene(side)
    (new_block,) = scene.pool.get_new_blocks(1)
    blocks = [*scene.blocks[:2], new_block]
    request = Request("r2", [1, 2, 3, 4, 5, 6], cache_salt="tenant-a")
    error = refused(
        lambda: scene.pool.cache_full_blocks(request, blocks, tuple(scene.stored), 2, 3, 2, sha256),
        scene.pool,
    )
    assert isinstance(error, ArgumentTypeError)
    assert str(error).startswith(
        "BlockPool.cache_full_blocks: block_hashes must be a list, got (BlockHashType("
    )


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("returned", ["h", 1.5, None, (1,)])
def test_a_hash_function_returning_no_int_caches_nothing(side: str, returned: object) -> None:
    scene = pool_scene(side)
    (new_block,) = scene.pool.get_new_blocks(1)
    blocks = [*scene.blocks, new_block]
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8])  # no salt: another chain, same pool
    stored: list[BlockHashType] = []
    first = scene.pool.get_new_blocks(1)
    error = refused(
        lambda: scene.pool.cache_full_blocks(
            request, [*first, *blocks[1:]], stored, 0, 1, 2, not_a_hash(returned)
        ),
        scene.pool,
        stored,
    )
    assert isinstance(error, ArgumentTypeError)
    assert "the value hash_fn returned must be an int" in str(error)


@pytest.mark.parametrize("side", SIDES)
def test_a_foreign_parent_block_is_refused(side: str) -> None:
    scene = pool_scene(side)
    (new_block,) = scene.pool.get_new_blocks(1)
    foreign: Any = 99 if side == "spec" else KVCacheBlock(99)
    request = Request("r", [1, 2, 3, 4, 5, 6], cache_salt="tenant-a")
    error = refused(
        lambda: scene.pool.cache_full_blocks(
            request, [scene.blocks[0], foreign, new_block], list(scene.stored), 2, 3, 2, sha256
        ),
        scene.pool,
    )
    assert isinstance(error, BlockStateError)
    assert str(error) == "block 99: block does not belong to this pool"


@pytest.mark.parametrize("side", SIDES)
def test_touch_reads_an_iterator_once_and_touches_every_block(side: str) -> None:
    """Issue 12: touch(iter(...)) used to exhaust the iterator checking it, then do nothing."""
    scene = pool_scene(side)
    scene.pool.touch(iter(scene.blocks[:2]))
    ref_cnt = (
        scene.pool.ref_cnt[1:3]
        if side == "spec"
        else [block.ref_cnt for block in scene.pool.blocks[1:3]]
    )
    assert ref_cnt == [2, 2]
    scene.pool.free_blocks(iter(scene.blocks[:2]))
    scene.pool.check_invariants()


# -- the free queue and blocks of another pool ---------------------------------------------------


def test_a_block_of_another_pool_is_refused_everywhere() -> None:
    """Issue 12: queue.remove(block of another pool) corrupted both pools."""
    pool, other = BlockPool(6, True), BlockPool(6, True)
    mine = pool.get_new_blocks(2)
    theirs = other.get_new_blocks(2)
    other.free_blocks(theirs)  # both of other's blocks are in other's free queue
    stranger = other.blocks[4]  # free in other, same id as a free block of pool
    request = Request("r", [1, 2, 3, 4])
    calls: list[Callable[[], object]] = [
        lambda: pool.free_block_queue.remove(stranger),
        lambda: pool.free_block_queue.append(theirs[0]),
        lambda: pool.touch([stranger]),
        lambda: pool.free_blocks([theirs[0]]),
        lambda: pool.cache_full_blocks(request, [mine[0], theirs[0]], [], 0, 2, 2, sha256),
    ]
    for call in calls:
        error = refused(call, pool, other)
        assert isinstance(error, BlockStateError)
    pool.check_invariants()
    other.check_invariants()


def test_a_manager_refuses_a_hit_of_another_pool() -> None:
    scene = manager_scene("impl")
    other = manager_scene("impl")
    error = refused(
        lambda: scene.manager.allocate_slots(scene.waiting, 1, other.hits),
        scene.manager,
        other.manager,
    )
    assert isinstance(error, BlockStateError)


def test_the_free_queue_refuses_duplicate_in_use_and_owned_blocks() -> None:
    """Issue 12: the constructor accepted duplicate or in-use blocks."""
    fresh = [KVCacheBlock(i) for i in range(3)]
    in_use = KVCacheBlock(7)
    in_use.ref_cnt = 1
    owned = BlockPool(3, True).blocks[2]
    for blocks, rule in [
        ([fresh[0], fresh[1], fresh[0]], "a block listed twice"),
        ([fresh[2], in_use], "a block in use"),
        ([owned], "a block of another free queue"),
    ]:
        before = state(blocks)
        with pytest.raises(FreeQueueError, match=rule):
            FreeKVCacheBlockQueue(blocks)
        assert state(blocks) == before  # no block linked or claimed
    with pytest.raises(ArgumentTypeError, match=r"blocks\[1\] must be a KVCacheBlock"):
        FreeKVCacheBlockQueue([KVCacheBlock(0), 1])  # type: ignore[list-item]
    queue = FreeKVCacheBlockQueue(iter(fresh))  # an iterator is read once
    assert [block.block_id for block in queue.get_all_free_blocks()] == [0, 1, 2]
    with pytest.raises(ArgumentTypeError, match="block must be a KVCacheBlock"):
        queue.remove(None)  # type: ignore[arg-type]


# -- every public call of the manager ------------------------------------------------------------

ManagerCall = Callable[[ManagerScene, Any], object]
MANAGER_CALLS: dict[str, tuple[st.SearchStrategy[object], ManagerCall]] = {
    "get_computed_blocks(request)": (
        st.one_of(st.none(), st.text(max_size=3), st.integers()),
        lambda s, v: s.manager.get_computed_blocks(v),
    ),
    "allocate_slots(request)": (
        st.one_of(st.none(), st.text(max_size=3), st.integers()),
        lambda s, v: s.manager.allocate_slots(v, 1),
    ),
    "allocate_slots(num_tokens)": (
        st.one_of(bad_counts, huge_ints),
        lambda s, v: s.manager.allocate_slots(s.waiting, v, s.hits),
    ),
    "allocate_slots(num_tokens) adopting nothing": (  # 0 only adopts hits or external tokens
        st.one_of(bad_counts, st.just(0)),
        lambda s, v: s.manager.allocate_slots(s.running, v),
    ),
    "allocate_slots(num_external_computed_tokens)": (  # more than the request has: refused
        st.one_of(bad_counts, huge_ints),
        lambda s, v: s.manager.allocate_slots(
            s.waiting, 1, s.hits, 0, num_external_computed_tokens=v
        ),
    ),
    "allocate_slots(num_external_computed_tokens) running": (  # a first allocation's only
        st.integers(min_value=1, max_value=3),
        lambda s, v: s.manager.allocate_slots(
            s.running, 1, None, 0, num_external_computed_tokens=v
        ),
    ),
    "allocate_slots(delay_cache_blocks)": (
        not_ints.filter(lambda value: not isinstance(value, bool)),
        lambda s, v: s.manager.allocate_slots(s.waiting, 1, s.hits, 0, delay_cache_blocks=v),
    ),
    "allocate_slots(new_computed_blocks)": (  # the value as the one group's hits
        not_hit_lists,
        lambda s, v: s.manager.allocate_slots(s.waiting, 1, (v,)),
    ),
    "allocate_slots(num_lookahead_tokens)": (
        st.one_of(bad_counts, huge_ints),
        lambda s, v: s.manager.allocate_slots(s.running, 1, None, v),
    ),
    "free(request)": (st.one_of(st.none(), st.text(max_size=3)), lambda s, v: s.manager.free(v)),
    "free_block_hashes(request)": (
        st.one_of(st.none(), st.text(max_size=3)),
        lambda s, v: s.manager.free_block_hashes(v),
    ),
    "get_num_common_prefix_blocks(num_running_requests)": (
        bad_counts,
        lambda s, v: s.manager.get_num_common_prefix_blocks(s.running, v),
    ),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("call", [*sorted(POOL_CALLS), *sorted(MANAGER_CALLS)])
@settings(max_examples=25)
@given(data=st.data())
def test_every_public_call_refuses_hostile_arguments(
    side: str, call: str, data: st.DataObject
) -> None:
    """One argument of a pool or manager call replaced by a hostile value: a typed error, and
    the pool or manager and its requests unchanged to the byte."""
    if call in POOL_CALLS:
        values, make_pool_call = POOL_CALLS[call]
        pool = pool_scene(side)
        value = data.draw(values, label="hostile value")
        refused(lambda: make_pool_call(pool, value), pool.pool, pool.request, pool.stored)
    else:
        values, make_manager_call = MANAGER_CALLS[call]
        scene = manager_scene(side)
        value = data.draw(values, label="hostile value")
        refused(
            lambda: make_manager_call(scene, value), scene.manager, scene.running, scene.waiting
        )


SCHEDULER_FIELDS: dict[str, tuple[st.SearchStrategy[object], str]] = {
    "num_computed_tokens": (not_ints, "allocate"),
    "spec_token_ids": (
        st.one_of(st.none(), st.text(max_size=2), st.integers(), st.tuples(st.integers())),
        "allocate",
    ),
    "prompt_logprobs": (st.one_of(st.none(), st.integers(), st.text(max_size=2)), "lookup"),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("field", sorted(SCHEDULER_FIELDS))
@settings(max_examples=25)
@given(data=st.data())
def test_a_request_mutated_between_calls_is_refused(
    side: str, field: str, data: st.DataObject
) -> None:
    """A scheduler-owned field set to a wrong type is refused by the next call that reads it."""
    values, call = SCHEDULER_FIELDS[field]
    scene = manager_scene(side)
    value = data.draw(values, label=field)
    request = scene.running
    with request_field(request, field, value):
        if call == "lookup":
            refused(lambda: scene.manager.get_computed_blocks(request), scene.manager)
        else:
            refused(lambda: scene.manager.allocate_slots(request, 1), scene.manager)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(
    ("num_tokens", "field", "value", "lookahead"),
    [
        (2.0, None, None, 0),
        (1, "num_computed_tokens", 0.0, 0),
        (1, None, None, 1.5),
        (math.nan, None, None, 0),
        (math.inf, None, None, 0),
        (True, None, None, 0),
        (1, "num_computed_tokens", math.nan, 0),
        (1, "num_computed_tokens", False, 0),
    ],
)
def test_float_nan_and_bool_counts_touch_no_hit(
    side: str, num_tokens: object, field: str | None, value: object, lookahead: object
) -> None:
    """Issue 12: allocate_slots(req, 2.0, hits) touched the hits and kept them, then raised;
    allocate_slots(r, nan) returned None (which a scheduler reads as "preempt someone")."""
    scene = manager_scene(side)
    request = scene.waiting

    def call() -> object:
        if field is None:
            return scene.manager.allocate_slots(request, num_tokens, scene.hits, lookahead)
        with request_field(request, field, value):
            return scene.manager.allocate_slots(request, 1, scene.hits)

    error = refused(call, scene.manager, request)
    assert isinstance(error, ArgumentTypeError)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(("field", "value"), IDENTITY_CHANGES)
def test_a_request_identity_cannot_change(side: str, field: str, value: object) -> None:
    """Issue 12: changing the salt or the id of a tracked request after its lookup reached
    another tenant's blocks or stranded its own."""
    scene = manager_scene(side)
    for request in (scene.running, scene.waiting):
        error = refused(partial(setattr, request, field, value), scene.manager, request)
        assert isinstance(error, FrozenRequestFieldError)
        assert isinstance(error, AttributeError)
        assert error.rule == f"{field} is fixed at construction"
    scene.manager.free(scene.running)
    scene.manager.free_block_hashes(scene.running)
    scene.manager.free_block_hashes(scene.waiting)
    scene.manager.check_invariants()
    # Every block is free again: nothing was stranded.
    pool = scene.manager.pool if side == "spec" else scene.manager.block_pool
    assert pool.get_num_free_blocks() == 11


@pytest.mark.parametrize("side", SIDES)
def test_max_model_len_nan_is_refused(side: str) -> None:
    """Issue 12: max_model_len=nan switched the limit off."""
    manager_class: Any = SpecKVCacheManager if side == "spec" else KVCacheManager
    layer = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    for max_model_len in (math.nan, math.inf, 64.0, True, "64", None):
        with pytest.raises(ArgumentTypeError, match="max_model_len must be an int >= 1"):
            manager_class(uniform_kv_cache_config(layer, 4), max_model_len)
    for flag in ("enable_caching", "use_eagle", "log_stats"):
        with pytest.raises(ArgumentTypeError, match=f"{flag} must be a bool"):
            manager_class(uniform_kv_cache_config(layer, 4), 8, **{flag: 1})
    with pytest.raises(ArgumentTypeError, match="kv_cache_config must be a KVCacheConfig"):
        manager_class(layer, 8)


def test_memory_estimates_refuse_a_nan_budget() -> None:
    """Issue 12: estimate_max_model_len(specs, nan) returned 0."""
    specs = {"layer": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")}
    for budget in (math.nan, math.inf, 1e9, True, None):
        with pytest.raises(ArgumentTypeError, match="available_memory must be an int"):
            estimate_max_model_len(specs, budget, max_model_len=64)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match="available_memory must be an int"):
            check_enough_kv_cache_memory(specs, budget, max_model_len=64)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="max_model_len must be an int >= 1"):
        memory_needed_bytes(specs, max_model_len=math.nan)  # type: ignore[arg-type]


# -- KV cache configs --------------------------------------------------------------------------

LAYER = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")  # 8 bytes


def _config_calls() -> list[tuple[str, Callable[[], object]]]:
    """Issue 22, item 7: configs built from wrong types, each with the argument it names."""
    tensor, group = KVCacheTensor(16), KVCacheGroupSpec(["a"], LAYER)
    return [
        ("tensors['a']", lambda: KVCacheConfig(2, {"a": 16}, [group])),  # type: ignore[dict-item]
        ("tensors", lambda: KVCacheConfig(2, None, [group])),  # type: ignore[arg-type]
        ("tensors", lambda: KVCacheConfig(2, [("a", tensor)], [group])),  # type: ignore[arg-type]
        ("tensors['a']", lambda: KVCacheConfig(2, {"a": None}, [group])),  # type: ignore[dict-item]
        ("kv_cache_groups", lambda: KVCacheConfig(2, {"a": tensor}, "a")),  # type: ignore[arg-type]
        ("kv_cache_groups[0]", lambda: KVCacheConfig(2, {"a": tensor}, ["a"])),  # type: ignore[list-item]
        ("kv_cache_groups", lambda: KVCacheConfig(2, {"a": tensor}, None)),  # type: ignore[arg-type]
        ("kv_cache_groups", lambda: KVCacheConfig(2, {"a": tensor}, group)),  # type: ignore[arg-type]
        ("a layer name in tensors", lambda: KVCacheConfig(2, {1: tensor}, [group])),  # type: ignore[dict-item]
        ("num_blocks", lambda: KVCacheConfig(2.0, {"a": tensor}, [group])),  # type: ignore[arg-type]
        ("layer_names[1]", lambda: KVCacheGroupSpec(["a", 1], LAYER)),  # type: ignore[list-item]
        ("layer_names[0]", lambda: KVCacheGroupSpec([None], LAYER)),  # type: ignore[list-item]
        ("layer_names", lambda: KVCacheGroupSpec(None, LAYER)),  # type: ignore[arg-type]
        ("layer_names", lambda: KVCacheGroupSpec(3, LAYER)),  # type: ignore[arg-type]
        ("layer_names", lambda: KVCacheGroupSpec(b"ab", LAYER)),  # type: ignore[arg-type]
        ("kv_cache_spec", lambda: KVCacheGroupSpec(["a"], None)),  # type: ignore[arg-type]
        ("KVCacheTensor.size", lambda: KVCacheTensor(None)),  # type: ignore[arg-type]
        ("KVCacheTensor.size", lambda: KVCacheTensor("16")),  # type: ignore[arg-type]
        ("shared_by[0]", lambda: KVCacheTensor(16, [1])),  # type: ignore[list-item]
        ("shared_by", lambda: KVCacheTensor(16, "ab")),
    ]


@pytest.mark.parametrize(
    ("argument", "index"), [(a, i) for i, (a, _) in enumerate(_config_calls())]
)
def test_configs_of_wrong_types_are_refused_with_a_typed_error(argument: str, index: int) -> None:
    """Issue 22: an int as a tensor, None tensors, a str as a group or non-str layer names
    raised AttributeError or TypeError, or passed."""
    with pytest.raises(ArgumentTypeError) as refused:
        _config_calls()[index][1]()
    assert argument in str(refused.value)


def _workers() -> list[KVCacheConfig]:
    return [uniform_kv_cache_config(LAYER, blocks, 2) for blocks in (4, 3)]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (lambda workers: workers[0], ArgumentTypeError, "kv_cache_configs must be a collection"),
        (lambda workers: "a", ArgumentTypeError, "kv_cache_configs must be a collection"),
        (lambda workers: [*workers, "a"], ArgumentTypeError, r"kv_cache_configs\[2\] must be a"),
        (lambda workers: [workers[0], None], ArgumentTypeError, r"kv_cache_configs\[1\]"),
        (lambda workers: 3, ArgumentTypeError, "kv_cache_configs must be an iterable"),
        (lambda workers: iter([]), InvalidArgumentError, "at least one KV cache config"),
        (lambda workers: [], InvalidArgumentError, "at least one KV cache config"),
    ],
)
def test_unify_refuses_what_is_not_a_collection_of_configs(
    arguments: Callable[[list[KVCacheConfig]], object], error: type[Exception], message: str
) -> None:
    """Issue 22: a single config, a str item or an empty iterator raised TypeError,
    AttributeError or ValueError (min() of nothing); nothing given changes."""
    workers = _workers()
    given = arguments(workers)
    before = pickle.dumps(workers)
    with pytest.raises(error, match=message):
        unify_kv_cache_configs(given)  # type: ignore[arg-type]
    assert pickle.dumps(workers) == before


def test_unify_reads_an_iterator_of_configs_once() -> None:
    """An iterator worked halfway: its configs were read, then `min` saw none left."""
    unified = unify_kv_cache_configs(iter(_workers()))
    assert [config.num_blocks for config in unified] == [3, 3]
    assert unify_kv_cache_configs(config for config in _workers()) == unified


# -- requests --------------------------------------------------------------------------------------

REQUEST_FIELDS: dict[str, st.SearchStrategy[object]] = {
    "request_id": st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=1), max_size=1)),
    "prompt_token_ids": st.one_of(
        st.none(),
        st.integers(),
        st.lists(
            st.one_of(
                not_ints.filter(lambda v: not isinstance(v, list)),
                negative_ints,
                st.integers(min_value=MAX_TOKEN_ID + 1),
            ),
            min_size=1,
            max_size=3,
        ).map(lambda bad: [0, *bad]),
    ),
    "mm_hashes": st.one_of(
        st.lists(st.one_of(st.none(), st.integers(), st.tuples(st.text(max_size=2))), min_size=1),
    ),
    "lora_id": st.one_of(
        st.booleans(), st.floats(), st.text(max_size=1), st.integers(max_value=0), huge_ints
    ),
    "cache_salt": st.one_of(
        st.integers(), st.lists(st.text(max_size=2), max_size=1), st.tuples(st.text(max_size=2))
    ),
    "prompt_logprobs": st.one_of(st.none(), st.integers(), st.text(max_size=1)),
}


@pytest.mark.parametrize("field", sorted(REQUEST_FIELDS))
@settings(max_examples=30)
@given(data=st.data())
def test_a_request_refuses_fields_of_the_wrong_type(field: str, data: st.DataObject) -> None:
    """Issue 12: a salt ["t"] or unhashable multimodal hashes passed, then broke allocation
    halfway; str, float or None tokens passed too."""
    value = data.draw(REQUEST_FIELDS[field], label=field)
    fields: dict[str, Any] = {"request_id": "r", "prompt_token_ids": [0, 1, 2, 3]}
    if field == "mm_hashes":  # one placeholder per hash, so only the hashes' types are wrong
        assert isinstance(value, list)
        fields["mm_positions"] = [PlaceholderRange(i, 1) for i in range(len(value))]
        fields["prompt_token_ids"] = [0] * len(value)
    fields[field] = value
    with pytest.raises(InvalidArgumentError, match=field):
        Request(**fields)


def test_an_unhashable_salt_never_reaches_a_manager() -> None:
    """Issue 12: cache_salt=["t"] allocated, then failed hashing; check_invariants then failed
    ("every hashed block is indexed")."""
    with pytest.raises(ArgumentTypeError) as info:
        Request("r", [1, 2, 3, 4], cache_salt=["secret"])  # type: ignore[arg-type]
    # The salt is a secret: the message shows its type only.
    assert str(info.value) == "Request 'r': cache_salt must be a str or None, got a list"


@given(bad=st.one_of(not_ints, negative_ints, st.integers(min_value=MAX_TOKEN_ID + 1)))
def test_a_bad_output_token_appends_nothing(bad: object) -> None:
    request = Request("r", [1, 2])
    before = state(request)
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        request.append_output_token_ids([3, bad])  # type: ignore[list-item]
    if not isinstance(bad, list):  # a list of ids in range (or none) is a valid append
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            request.append_output_token_ids(bad)  # type: ignore[arg-type]
    assert state(request) == before


def test_placeholder_ranges_refuse_bools_and_floats() -> None:
    for offset, length in [(True, 1), (0, True), (0.0, 1), (0, 1.5), (math.nan, 1)]:
        with pytest.raises(ArgumentTypeError, match="PlaceholderRange"):
            PlaceholderRange(offset, length)  # type: ignore[arg-type]


def test_hash_functions_refuse_wrong_types() -> None:
    request = Request("r", [1, 2, 3, 4], lora_id=3)
    calls: list[Callable[[], object]] = [
        lambda: hash_request_tokens(sha256, 2.0, request),  # type: ignore[arg-type]
        lambda: hash_request_tokens(sha256, True, request),
        lambda: hash_request_tokens(None, 2, request),  # type: ignore[arg-type]
        lambda: hash_request_tokens(sha256, 2, "r"),  # type: ignore[arg-type]
        lambda: hash_block_tokens(sha256, None, [1, -1]),
        lambda: hash_block_tokens(sha256, 1.5, [1, 2]),  # type: ignore[arg-type]
        lambda: hash_block_tokens(sha256, None, [1, 2], ["lora"]),  # type: ignore[arg-type]
        lambda: hash_block_tokens(not_a_hash("h"), None, [1, 2]),
        lambda: generate_block_hash_extra_keys(request, 0, 2.0, 0),  # type: ignore[arg-type]
        lambda: generate_block_hash_extra_keys(request, 0, 2, -1),
        lambda: get_hash_fn(["sha256"]),  # type: ignore[arg-type]
        lambda: block_hash_module.need_extra_keys(None),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()


# -- tenant keys no field can forge ---------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("sliding", [False, True])
def test_a_multimodal_hash_cannot_stand_for_a_salt(side: str, sliding: bool) -> None:
    """Issue 12: mm_hashes=[("cache_salt", "A")] without a salt hit tenant A's blocks. Such a
    hash is refused (not a str); one spelled like the salt is a str, never a CacheSalt."""
    scene = manager_scene(side, sliding=sliding)
    with pytest.raises(ArgumentTypeError, match=r"mm_hashes\[0\] must be a str"):
        Request(
            "forger",
            [1, 2, 3, 4, 5, 6, 9],
            mm_positions=[PlaceholderRange(0, 7)],
            mm_hashes=[("cache_salt", "tenant-a")],  # type: ignore[list-item]
        )
    for mm_hash in ("tenant-a", "cache_salt", "CacheSalt(<redacted>)"):
        forger = Request(
            f"forger-{mm_hash}",
            [1, 2, 3, 4, 5, 6, 9],
            mm_positions=[PlaceholderRange(0, 7)],
            mm_hashes=[mm_hash],
        )
        (hits,), _ = scene.manager.get_computed_blocks(forger)
        null = 0 if side == "spec" else scene.manager.block_pool.null_block
        assert all(block == null for block in hits), "a forged key reached tenant-a's blocks"
    lora = Request("lora", [1, 2, 3, 4, 5, 6, 9], lora_id=1)
    assert scene.manager.get_computed_blocks(lora)[1] == 0


# -- the builtin hash --------------------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_token_ids_where_the_builtin_hash_collides_are_refused(side: str) -> None:
    """Issue 12: with caching_hash_algo="builtin", prompts starting [-1, ...] and [-2, ...]
    shared a block (hash(-1) == hash(-2)); so would 0 and 2**61 - 1."""
    assert hash(-1) == hash(-2) and hash(0) == hash(2**61 - 1)  # why the range is checked
    for tokens in ([-1, 5, 6], [-2, 5, 6], [2**61 - 1, 5, 6], [MAX_TOKEN_ID + 1]):
        with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[0\] must be an int"):
            Request("r", tokens)
    scene = manager_scene(side, sliding=True, hash_algo="builtin")
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        scene.running.append_output_token_ids(-1)


@given(
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), min_size=2, max_size=2, unique=True),
)
def test_the_builtin_hash_of_a_valid_token_id_is_the_id(tokens: list[int]) -> None:
    """In [0, MAX_TOKEN_ID] CPython's hash() is the identity, so two ids never hash alike."""
    first, second = tokens
    assert (hash(first), hash(second)) == (first, second)


# -- linear multimodal hashing --------------------------------------------------------------------


def _inputs_read(monkeypatch: pytest.MonkeyPatch, num_tokens: int) -> int:
    """Multimodal ranges read while one prefill of `num_tokens` tokens (an input every 8
    tokens, block size 4) is allocated without a prior lookup."""
    reads = 0
    original = block_hash_module._RangesAsTuples.__getitem__

    def counting(self: Any, index: int) -> tuple[int, int]:
        nonlocal reads
        reads += 1
        return original(self, index)

    monkeypatch.setattr(block_hash_module._RangesAsTuples, "__getitem__", counting)
    positions = [PlaceholderRange(offset, 3) for offset in range(2, num_tokens - 3, 8)]
    request = Request(
        "r",
        [0] * num_tokens,
        mm_positions=positions,
        mm_hashes=[f"img-{i}" for i in range(len(positions))],
    )
    layer = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(layer, num_tokens // 4 + 1), num_tokens)
    assert manager.allocate_slots(request, num_tokens) is not None
    return reads


def test_multimodal_hashing_without_a_lookup_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12: each block rescanned every input before it (7.99 s for 200k tokens)."""
    small, large = _inputs_read(monkeypatch, 800), _inputs_read(monkeypatch, 3_200)
    assert large <= 4.5 * small, (small, large)  # quadratic would be 16x
