"""A catalog of hostile calls: named ways a careless or malicious caller misuses the pool and
the manager, each of which must be refused with a typed error and change nothing.

Each entry takes a random generator (seeded by the operation that makes the call, so a recorded
operation replays the same call) and a scene (a live request of the client, the pool's size, a
request's blocks), and returns the call as a report shows it and as a function of one side
("spec" or "impl"). The client makes these calls for its `Hostile` (manager) and `Misuse` (pool)
operations, whichever driver drew them: the swarm, the hypothesis machines or the exhaustive
search.

The hostile values are wrong types (bools, floats, NaN, infinities, None, strings, containers),
ints out of range (negative, huge), forged or unhashable keys, and mutations of a request between
calls (a scheduler-owned field set to a wrong type; an attempt to change a request's identity).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pagedkv.harness.protocol import ManagerUnderTest, PoolUnderTest
from pagedkv.vocab.hashes import BlockHashType, HashFn
from pagedkv.vocab.request import Request

SideCall = Callable[[Any, str], object]
"""A call on one side; the second argument is "spec" or "impl"."""

HostileCall = tuple[str, SideCall]
"""The call as shown in a report, and the call itself."""

NOT_INTS: tuple[object, ...] = (
    True,
    False,
    1.0,
    2.5,
    math.nan,
    math.inf,
    -math.inf,
    None,
    "1",
    b"\x01",
    [1],
    (1,),
    Decimal(1),
)
"""Values that are no int (a bool is no int either), each once."""

BAD_COUNTS: tuple[object, ...] = (*NOT_INTS, -1, -(2**70))
"""Values no count accepts: no int, or a negative one."""

NOT_BLOCK_LISTS: tuple[object, ...] = (
    3,
    1.5,
    "ab",
    [None],
    [1.5],
    [True],
    ["0"],
    (math.nan,),
)
"""Values that are no iterable of block ids, or hold something that is no block id."""

NOT_REQUESTS: tuple[object, ...] = (None, "req-1", 1, ("req-1", [0]))

NOT_BOOLS: tuple[object, ...] = (None, 0, 1, "yes", 1.0)

IDENTITY_CHANGES: tuple[tuple[str, object], ...] = (
    ("request_id", "another-id"),
    ("prompt_token_ids", (0,)),
    ("mm_positions", ()),
    ("mm_hashes", ("img-x",)),
    ("lora_id", 2),
    ("cache_salt", "tenant-2"),
    ("cache_salt", None),
)
"""A request's identity fields with a value to (fail to) set them to."""

BAD_TOKENS: tuple[object, ...] = (-1, -2, 2**31, 2**64, True, 1.5, None, "a", [0, -1], [0, "a"])
"""What `append_output_token_ids` refuses (a bad token, alone or in a list)."""


# -- scenes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManagerScene:
    """What a hostile manager call may use: a live request of the driver."""

    request: Request


@dataclass(frozen=True)
class PoolScene:
    """What a hostile pool call may use: a request, the ids of its blocks, its stored hashes
    (copied for each side: a call must not share one list between spec and impl)."""

    request: Request
    block_ids: tuple[int, ...]
    stored_hashes: tuple[BlockHashType, ...]
    block_size: int
    hash_fn: HashFn


@contextmanager
def request_field(request: Request, field: str, value: object) -> Iterator[None]:
    """Set a scheduler-owned field of `request` to `value` for the duration of one call."""
    saved = getattr(request, field)
    setattr(request, field, value)
    try:
        yield
    finally:
        setattr(request, field, saved)


# -- the manager ---------------------------------------------------------------------------------


def _num_tokens(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice((*BAD_COUNTS, 0))
    request = scene.request
    return (
        f"allocate_slots({request!r}, {value!r})",
        lambda manager, _: manager.allocate_slots(request, value),
    )


def _lookahead(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice(BAD_COUNTS)
    request = scene.request
    return (
        f"allocate_slots({request!r}, 1, None, {value!r})",
        lambda manager, _: manager.allocate_slots(request, 1, None, value),
    )


def _hits(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice(NOT_BLOCK_LISTS)
    request = scene.request
    return (
        f"allocate_slots({request!r}, 1, {value!r})",
        lambda manager, _: manager.allocate_slots(request, 1, value),
    )


def _mutated_field(
    field: str, values: tuple[object, ...], call: str
) -> Callable[[random.Random, ManagerScene], HostileCall]:
    def make(rng: random.Random, scene: ManagerScene) -> HostileCall:
        value = rng.choice(values)
        request = scene.request

        def run(manager: ManagerUnderTest, _: str) -> object:
            with request_field(request, field, value):
                if call == "lookup":
                    return manager.get_computed_blocks(request)
                return manager.allocate_slots(request, 1)

        return f"{call} of {request!r} with {field}={value!r}", run

    return make


def _not_a_request(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice(NOT_REQUESTS)
    method = rng.choice(
        (
            "get_computed_blocks",
            "allocate_slots",
            "free",
            "free_block_hashes",
            "get_num_common_prefix_blocks",
        )
    )

    def run(manager: ManagerUnderTest, _: str) -> object:
        if method == "allocate_slots":
            return manager.allocate_slots(value, 1)  # type: ignore[arg-type]
        if method == "get_num_common_prefix_blocks":
            return manager.get_num_common_prefix_blocks(value, 1)  # type: ignore[arg-type]
        return getattr(manager, method)(value)

    return f"{method}({value!r})", run


def _running_count(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice(BAD_COUNTS)
    request = scene.request
    return (
        f"get_num_common_prefix_blocks({request!r}, {value!r})",
        lambda manager, _: manager.get_num_common_prefix_blocks(request, value),
    )


def _identity_change(rng: random.Random, scene: ManagerScene) -> HostileCall:
    field, value = rng.choice(IDENTITY_CHANGES)
    request = scene.request
    return (
        f"{request!r}.{field} = {value!r}",
        lambda manager, _: setattr(request, field, value),
    )


def _bad_token(rng: random.Random, scene: ManagerScene) -> HostileCall:
    value = rng.choice(BAD_TOKENS)
    request = scene.request
    return (
        f"{request!r}.append_output_token_ids({value!r})",
        lambda manager, _: request.append_output_token_ids(value),  # type: ignore[arg-type]
    )


MANAGER_HOSTILE_CALLS: dict[str, Callable[[random.Random, ManagerScene], HostileCall]] = {
    "num_tokens of a wrong type or range": _num_tokens,
    "num_lookahead_tokens of a wrong type or range": _lookahead,
    "hits that are no block ids": _hits,
    "num_computed_tokens set to a wrong type": _mutated_field(
        "num_computed_tokens", NOT_INTS, "allocate_slots"
    ),
    "spec_token_ids set to no list": _mutated_field(
        "spec_token_ids", (None, "ab", 3, (0,), frozenset({0})), "allocate_slots"
    ),
    "prompt_logprobs set to no bool": _mutated_field("prompt_logprobs", NOT_BOOLS, "lookup"),
    "no Request at all": _not_a_request,
    "num_running_requests of a wrong type or range": _running_count,
    "a change to a request's identity": _identity_change,
    "a token that is no token id": _bad_token,
}
"""Hostile manager calls by name; each is refused and changes nothing."""


# -- the block pool ------------------------------------------------------------------------------


def _num_blocks(rng: random.Random, scene: PoolScene) -> HostileCall:
    value = rng.choice(BAD_COUNTS)
    return f"get_new_blocks({value!r})", lambda pool, _: pool.get_new_blocks(value)


def _block_list(method: str) -> Callable[[random.Random, PoolScene], HostileCall]:
    def make(rng: random.Random, scene: PoolScene) -> HostileCall:
        value = rng.choice(NOT_BLOCK_LISTS)
        return f"{method}({value!r})", lambda pool, _: getattr(pool, method)(value)

    return make


CACHE_ARGUMENTS = (
    "request",
    "block_ids",
    "block_hashes",
    "num_cached_blocks",
    "num_full_blocks",
    "block_size",
    "hash_fn",
)
"""cache_full_blocks' arguments, in order (the harness names the blocks by id)."""

_BAD_CACHE_VALUES: dict[str, tuple[object, ...]] = {
    "request": NOT_REQUESTS,
    "block_ids": (None, 3, 1.5),
    "block_hashes": (None, (), "hashes", frozenset()),
    "num_cached_blocks": BAD_COUNTS,
    "num_full_blocks": BAD_COUNTS,
    "block_size": (*BAD_COUNTS, 0),
    "hash_fn": (None, 3, "sha256"),
}


def _cache_argument(rng: random.Random, scene: PoolScene) -> HostileCall:
    argument = rng.choice(CACHE_ARGUMENTS)
    value = rng.choice(_BAD_CACHE_VALUES[argument])

    def run(pool: PoolUnderTest, _: str) -> object:
        arguments: dict[str, Any] = {
            "request": scene.request,
            "block_ids": list(scene.block_ids),
            "block_hashes": list(scene.stored_hashes),  # each side its own copy
            "num_cached_blocks": 0,
            "num_full_blocks": 0,
            "block_size": scene.block_size,
            "hash_fn": scene.hash_fn,
        }
        arguments[argument] = value
        pool.cache_full_blocks(*(arguments[name] for name in CACHE_ARGUMENTS))
        return None

    return f"cache_full_blocks(... {argument}={value!r} ...)", run


def _lookup_key(rng: random.Random, scene: PoolScene) -> HostileCall:
    value = rng.choice(
        (
            None,
            3,
            "hash",
            (0, (0,), None),  # a plain tuple shaped like a key: no BlockHashType
            BlockHashType(0, [0], None),  # type: ignore[arg-type]  # unhashable
            BlockHashType(0, (0,), ([0],)),  # type: ignore[arg-type]  # unhashable
        )
    )
    return f"get_cached_block({value!r})", lambda pool, _: pool.get_cached_block(value)


POOL_HOSTILE_CALLS: dict[str, Callable[[random.Random, PoolScene], HostileCall]] = {
    "num_blocks of a wrong type or range": _num_blocks,
    "touch of no block ids": _block_list("touch"),
    "free_blocks of no block ids": _block_list("free_blocks"),
    "cache_full_blocks with an argument of a wrong type": _cache_argument,
    "get_cached_block of no hashable BlockHashType": _lookup_key,
}
"""Hostile block-pool calls by name; each is refused and changes nothing."""


def side_name(side: object, spec: object) -> str:
    """ "spec" when `side` is the spec side of a pair, else "impl" (what a catalog entry's call
    is told)."""
    return "spec" if side is spec else "impl"


def not_a_hash(value: object) -> HashFn:
    """A hash function that returns `value` (something else than an int) for any key."""

    def hash_fn(_: object) -> int:
        return value  # type: ignore[return-value]

    return hash_fn
