"""The vLLM bugs the spec reproduces under a release's semantics, and the states they lead to.

A semantics switch that takes vLLM's side of a rule the attention-truth invariant holds wrong
(`pagedkv.spec.attention_truth`) is a known bug: under that semantics the spec must still do
what vLLM does, so a conformance campaign compares vLLM's code with it, and the invariant then
names each state the bug leads to instead of failing on it. Each `KnownBug` says how to recognise
its states from the untruth found (what a position held, and what it should have held); the
request that read it is tainted until it is freed, so what follows from the bug is the bug's
too. docs/semantics.md lists them with a replay each (`pagedkv verify --known-bugs fail`).
"""

from __future__ import annotations

import os

from pagedkv.spec.attention_truth import KnownBug, Untruth
from pagedkv.spec.ghost_kv import NULL_BLOCK_ID, GhostKV, MultimodalPlace
from pagedkv.vocab.semantics import Semantics

FATAL_ENV = "PAGEDKV_KNOWN_BUGS"
"""Set to "fail" to make a known bug's states fail like any untruth (to replay one)."""


def _eagle_window_hit_one_short(untruth: Untruth, ghost: GhostKV) -> bool:
    """A hit whose window reaches a position EAGLE left holding the null block."""
    return untruth.where == "hit" and untruth.block_id == NULL_BLOCK_ID


def _block_places(
    untruth: Untruth, ghost: GhostKV
) -> tuple[list[MultimodalPlace | None], list[MultimodalPlace | None]] | None:
    """The multimodal places of the slots of the block read wrong, as found and as the reader's
    own KV would have them, when the two hold the same tokens for the same adapter and tenant
    (the block's key then differed only in its multimodal part); else None."""
    if untruth.found is None or untruth.block_id is None or untruth.found[0] != untruth.expected[0]:
        return None
    slots = ghost.slots[untruth.block_id]
    start = untruth.position - untruth.position % len(slots)
    own = ghost.expected[untruth.request_id][1][start : start + len(slots)]
    found: list[MultimodalPlace | None] = []
    expected: list[MultimodalPlace | None] = []
    for held, number in zip(slots, own, strict=False):
        if held is None:
            return None
        found_root, found_steps = ghost.histories.unfold(held)
        root, steps = ghost.histories.unfold(number)
        if found_root != root or found_steps[-1][0] != steps[-1][0]:
            return None
        found.append(found_steps[-1][1])
        expected.append(steps[-1][1])
    return found, expected


def _hashes(places: list[MultimodalPlace | None]) -> list[str]:
    """The inputs that fill a block, in order, each once."""
    return list(dict.fromkeys(place[0] for place in places if place is not None))


def _mm_keys_without_position(untruth: Untruth, ghost: GhostKV) -> bool:
    """The block holds the same tokens and the same inputs at other places: a key that names
    an input but not where it sits."""
    places = _block_places(untruth, ghost)
    return places is not None and _hashes(places[0]) == _hashes(places[1])


def _vllm_new_block_mm_keys(untruth: Untruth, ghost: GhostKV) -> bool:
    """The block holds the same tokens with other inputs: a key that leaves an overlapping
    input out."""
    places = _block_places(untruth, ghost)
    return places is not None and _hashes(places[0]) != _hashes(places[1])


KNOWN_BUGS: dict[str, KnownBug] = {
    "eagle_window_hit_one_short": KnownBug(
        "vLLM 0.8.5",
        "an EAGLE hit leaves a sliding window one block short (the null block in its window)",
        _eagle_window_hit_one_short,
    ),
    "mm_keys_without_position": KnownBug(
        "vLLM 0.8.5",
        "a multimodal input keyed without its place: a block of the same tokens with the same "
        "input elsewhere is hit",
        _mm_keys_without_position,
    ),
    "vllm_new_block_mm_keys": KnownBug(
        "vLLM 0.8.5",
        "a block completed by generated tokens keyed by the last multimodal input only (one "
        "ending where the block starts included): a block of the same tokens with other inputs "
        "is hit",
        _vllm_new_block_mm_keys,
    ),
}
"""The semantics switch that reproduces each bug -> the bug."""


def known_bugs(semantics: Semantics) -> tuple[KnownBug, ...]:
    """The bugs a manager under `semantics` reproduces."""
    return tuple(bug for switch, bug in KNOWN_BUGS.items() if getattr(semantics, switch))


def known_bugs_fatal() -> bool:
    """Whether a known bug's states fail like any untruth (`FATAL_ENV` set to "fail")."""
    return os.environ.get(FATAL_ENV, "") == "fail"
