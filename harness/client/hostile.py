"""Calls only a careless or malicious caller makes to a KV cache manager: the client's catalog.

Each entry is a function of a `Scene` (the pair of managers, the request it is about, the
client's view of it, and a small int `arg` that picks among its variants). It makes its call
through `scene.refuse`, which compares both sides and demands that a refused call leave both
unchanged; whatever it changes on the request (speculative tokens, computed tokens) it restores.
A catalog is a mapping from kind to function: the client makes a `Hostile` operation's call
from `HOSTILE_CALLS` unless given another (`ManagerClient(hostile_calls=...)`), so new hostile
calls plug in without touching any driver. `HOSTILE_CALLS` holds this module's calls (which
need the client's view: is the request running, how many hashes it stores) and every manager
entry of the value catalog (`harness/client/catalog.py`: wrong types, NaN, mutated scheduler
fields, identity changes, bad tokens), named "catalog: <its name>", its values drawn from `arg`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.harness.client.catalog import MANAGER_HOSTILE_CALLS, ManagerScene, side_name
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.protocol import ManagerUnderTest
from pagedkv.vocab.request import Request


@dataclass
class Scene:
    """What a hostile call may use.

    Attributes:
        pair: both managers.
        request: the live request the call is about.
        running: whether the scheduler runs it (it holds blocks).
        tracked: whether the spec ties the request's id to this object (blocks or hashes).
        num_stored_hashes: how many block hashes the spec stores for it.
        num_blocks: pool size.
        max_model_len: the managers' max_model_len.
        block_size: tokens a block.
        sliding_window: the window of a single-group manager, or None.
        num_groups: KV cache groups (hits and results are one list per group).
        enable_caching: prefix caching on or off.
        arg: picks among the call's variants (any int).
        on_refusal: called with the call's name and the spec's error, if any.
    """

    pair: ComparedPair[ManagerUnderTest]
    request: Request
    running: bool
    tracked: bool
    num_stored_hashes: int
    num_blocks: int
    max_model_len: int
    block_size: int
    sliding_window: int | None
    num_groups: int
    enable_caching: bool
    arg: int
    on_refusal: Callable[[str, Exception], None]

    def refuse(
        self, operation: str, label: str, call: Callable[[ManagerUnderTest], object]
    ) -> None:
        """Make `call` on both sides: same outcome, and a refusal changes nothing."""
        _, error = self.pair.refused_call(operation, call, lambda: label)
        if error is not None:
            self.on_refusal(operation, error)

    def group_hits(self, hits: list[int]) -> Any:
        """`hits` as the manager takes them: the same list for every group (so that the first
        group meets the broken rule)."""
        return tuple(list(hits) for _ in range(self.num_groups))

    def look_up(self) -> Any:
        """The request's hits from a valid lookup on both sides (as a scheduler would make
        it; it stores the request's hashes), or None if either side refused."""
        request = self.request
        lookup, error = self.pair.call(
            "get_computed_blocks",
            lambda manager: manager.get_computed_blocks(request),
            lambda: f"get_computed_blocks({request.request_id})",
        )
        return None if error is not None or lookup is None else lookup[0]


HostileCall = Callable[[Scene], None]


def bad_counts(scene: Scene) -> None:
    """num_tokens 0 or negative, or negative lookahead."""
    request = scene.request
    num_tokens, lookahead = ((0, 0), (-1, 0), (1, -1))[scene.arg % 3]
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, {num_tokens}, None, {lookahead})",
        lambda manager: manager.allocate_slots(request, num_tokens, None, lookahead),
    )


def more_tokens_than_the_request_has(scene: Scene) -> None:
    request = scene.request
    extra = request.num_tokens - request.num_computed_tokens + 1 + scene.arg % 3
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, {extra})",
        lambda manager: manager.allocate_slots(request, extra),
    )


def past_max_model_len(scene: Scene) -> None:
    request = scene.request
    lookahead = scene.max_model_len + 1 + scene.arg % scene.block_size
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, 1, None, {lookahead})",
        lambda manager: manager.allocate_slots(request, 1, None, lookahead),
    )


def impostor(scene: Scene) -> None:
    """Another Request object with a tracked request's id: lookup, allocate or free."""
    if not scene.tracked:
        return
    fake = copy.copy(scene.request)  # same id, same tokens, another object
    name = ("get_computed_blocks", "allocate_slots", "free")[scene.arg % 3]
    calls: dict[str, Callable[[ManagerUnderTest], object]] = {
        "get_computed_blocks": lambda manager: manager.get_computed_blocks(fake),
        "allocate_slots": lambda manager: manager.allocate_slots(fake, 1),
        "free": lambda manager: manager.free(fake),
    }
    scene.refuse(name, f"{name}(impostor of {fake.request_id})", calls[name])


def foreign_hits(scene: Scene) -> None:
    """Hits for a waiting request that cannot be its cached blocks: outside the pool, the
    null block under full attention, a window hit of the wrong shape, or more hits than it has
    stored hashes."""
    if scene.running:
        return  # hits_while_holding_blocks
    request = scene.request
    num_stored = scene.num_stored_hashes
    if not num_stored and scene.enable_caching:
        scene.look_up()
        num_stored = request.num_tokens // scene.block_size
    n = scene.num_blocks
    choices = [[-1], [n], [n + 3], [0], [1] * (num_stored + 1)]
    if scene.sliding_window is not None:
        choices.append([0, 0])  # null blocks with no cached block after them
    hits = scene.group_hits(choices[scene.arg % len(choices)])
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, 1, {hits})",
        lambda manager: manager.allocate_slots(request, 1, hits),
    )


def hits_while_holding_blocks(scene: Scene) -> None:
    """Hits passed for a request that already runs (or hits with caching off)."""
    if not scene.running and scene.enable_caching:
        return
    request = scene.request
    hits = scene.group_hits([1 + scene.arg % max(scene.num_blocks - 1, 1)])
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, 1, {hits})",
        lambda manager: manager.allocate_slots(request, 1, hits),
    )


def computed_outside_slots(scene: Scene) -> None:
    """num_computed_tokens negative or past the request's slots."""
    computed = scene.request.num_computed_tokens
    _allocate_with_computed(scene, (-1, computed + 4 * scene.block_size + 1)[scene.arg % 2])


def computed_went_back(scene: Scene) -> None:
    """A running request whose num_computed_tokens went back below its cached blocks."""
    if scene.running and scene.request.num_computed_tokens >= scene.block_size:
        _allocate_with_computed(scene, 0)


def _allocate_with_computed(scene: Scene, computed: int) -> None:
    """allocate_slots(request, 1) with num_computed_tokens set to `computed` for the call."""
    request = scene.request
    saved = request.num_computed_tokens
    request.num_computed_tokens = computed
    label = f"allocate_slots({request.request_id}, 1) with {computed} computed of {saved}"
    try:
        scene.refuse("allocate_slots", label, lambda manager: manager.allocate_slots(request, 1))
    finally:
        request.num_computed_tokens = saved


def more_drafts_than_scheduled(scene: Scene) -> None:
    request = scene.request
    request.spec_token_ids = [0] * (2 + scene.arg % 2)
    label = f"allocate_slots({request.request_id}, 1) with {len(request.spec_token_ids)} drafts"
    try:
        scene.refuse("allocate_slots", label, lambda manager: manager.allocate_slots(request, 1))
    finally:
        request.spec_token_ids = []


def hashes_dropped_while_running(scene: Scene) -> None:
    request = scene.request
    scene.refuse(
        "free_block_hashes",
        f"free_block_hashes({request.request_id})",
        lambda manager: manager.free_block_hashes(request),
    )


def hybrid_hits_misshapen(scene: Scene) -> None:
    """A manager of several groups given a waiting request's own hits, misshapen: one group's
    list a block short, two groups' lists swapped (each group's blocks are cached under its own
    key), or one list too few or too many."""
    if scene.num_groups == 1 or scene.running or not scene.enable_caching:
        return
    hits = scene.look_up()
    if hits is None:
        return
    lists = [list(group_hits) for group_hits in hits]
    variant = scene.arg % 3
    if variant == 0 and lists[0]:
        lists[-1] = lists[-1][:-1]
    elif variant == 1 and lists[0] != lists[1]:
        lists[0], lists[1] = lists[1], lists[0]
    else:
        lists = lists[:-1] if scene.arg % 2 else [*lists, []]
    request = scene.request
    misshapen: Any = tuple(lists)
    scene.refuse(
        "allocate_slots",
        f"allocate_slots({request.request_id}, 1, {lists})",
        lambda manager: manager.allocate_slots(request, 1, misshapen),
    )


_STRANGER = Request("never-seen", [0])


def unknown_request(scene: Scene) -> None:
    """Freeing a request the manager never saw: a no-op, on both sides."""
    scene.refuse("free", "free(never-seen)", lambda manager: manager.free(_STRANGER))


@dataclass(frozen=True)
class CatalogCall:
    """Entry `name` of `MANAGER_HOSTILE_CALLS` as a hostile call: its values drawn from the
    scene's `arg`, refused by both sides, changing neither (counted as "hostile catalog")."""

    name: str

    def __call__(self, scene: Scene) -> None:
        entry = MANAGER_HOSTILE_CALLS[self.name]
        shown, side_call = entry(random.Random(scene.arg), ManagerScene(scene.request))
        spec = scene.pair.spec
        scene.refuse(
            "hostile catalog", shown, lambda manager: side_call(manager, side_name(manager, spec))
        )


SWARM_HOSTILE_CALLS: Mapping[str, HostileCall] = {
    "bad counts": bad_counts,
    "more tokens than the request has": more_tokens_than_the_request_has,
    "past max_model_len": past_max_model_len,
    "impostor": impostor,
    "foreign hits": foreign_hits,
    "hits while holding blocks": hits_while_holding_blocks,
    "computed outside slots": computed_outside_slots,
    "computed went back": computed_went_back,
    "more drafts than scheduled": more_drafts_than_scheduled,
    "hashes dropped while running": hashes_dropped_while_running,
    "unknown request": unknown_request,
    "hybrid hits misshapen": hybrid_hits_misshapen,
}
"""The calls of this module: kind -> call."""

HYBRID_ONLY_CALLS = frozenset({"hybrid hits misshapen"})
"""Calls that do nothing to a single-group manager (not drawn in its runs)."""

HOSTILE_CALLS: Mapping[str, HostileCall] = {
    **SWARM_HOSTILE_CALLS,
    **{f"catalog: {name}": CatalogCall(name) for name in MANAGER_HOSTILE_CALLS},
}
"""The default catalog: this module's calls and the state machines' catalog."""
