"""`cache_blocks(request, num_computed_tokens)`, vLLM 0.33's call after an output when its
scheduler decodes speculatively (and a KV connector's when an async load lands), spec and impl
side by side: the blocks accepted draft tokens filled are cached at once, as the next
`allocate_slots` would cache them; nothing beyond the tokens the caller counts as computed.

The numbers: a pool of 10 blocks (1..9 free), block size 4, max_model_len 64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from manager_fixtures import GROUP_FACTORIES, manager_config

from pagedkv import (
    ArgumentTypeError,
    InvalidArgumentError,
    KVCacheManager,
    Request,
    RequestError,
)
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.spec.manager import SpecKVCacheManager

SIDES = sorted(GROUP_FACTORIES)


def both(config: ManagerConfig | None = None) -> list[ManagerUnderTest]:
    return [GROUP_FACTORIES[side](config or manager_config()) for side in SIDES]


def decode_with_accepted_drafts(manager: ManagerUnderTest) -> Request:
    """A 5-token prompt, then a step of its next token and two drafts, both accepted: tokens
    4-7 (block 2) are real only once the drafts are accepted, after the allocation."""
    request = Request("r", range(5))
    assert manager.allocate_slots(request, 5) == ([1, 2],)  # block 1 full and cached
    request.num_computed_tokens = 5
    request.append_output_token_ids(50)
    request.spec_token_ids = [60, 61]
    assert manager.allocate_slots(request, 3) == ([],)  # slots 0-7: blocks 1 and 2
    request.spec_token_ids = []
    request.num_computed_tokens = 8
    request.append_output_token_ids([60, 61, 62])  # both drafts accepted, one token sampled
    return request


def test_blocks_accepted_drafts_filled_are_cached_at_once() -> None:
    snapshots = []
    for manager in both():
        request = decode_with_accepted_drafts(manager)
        assert manager.snapshot().num_cached == {"r": 1}
        manager.cache_blocks(request, 8)
        manager.check_invariants()
        snapshot = manager.snapshot()
        assert snapshot.num_cached == {"r": 2}
        snapshots.append(snapshot)
        sibling = Request("s", [0, 1, 2, 3, 4, 50, 60, 61, 7])
        hits, num_hit_tokens = manager.get_computed_blocks(sibling)
        assert hits == ([1, 2],) and num_hit_tokens == 8
        assert manager.allocate_slots(request, 1) == ([3],)  # caches nothing more
        assert manager.snapshot().num_cached == {"r": 2}
    assert snapshots[0] == snapshots[1]


@pytest.mark.parametrize("num_tokens", [0, 3, 4, 7])
def test_no_more_full_blocks_than_cached_changes_nothing(num_tokens: int) -> None:
    for manager in both():
        request = decode_with_accepted_drafts(manager)
        before = manager.snapshot()
        manager.cache_blocks(request, num_tokens)
        assert manager.snapshot() == before


def test_with_caching_off_nothing_is_cached_or_checked() -> None:
    for manager in both(manager_config(enable_caching=False)):
        request = Request("r", range(5))
        manager.cache_blocks(request, 0)  # holds nothing: no refusal with caching off
        assert manager.allocate_slots(request, 5) == ([1, 2],)
        request.num_computed_tokens = 5
        before = manager.snapshot()
        manager.cache_blocks(request, 4)
        assert manager.snapshot() == before


def _refusal(manager: ManagerUnderTest, call: Any) -> tuple[type, str]:
    before = manager.snapshot()
    with pytest.raises(Exception) as info:
        call(manager)
    assert manager.snapshot() == before
    return type(info.value), str(info.value)


def _running(manager: ManagerUnderTest) -> Request:
    """A request of 6 tokens, 4 of them computed in its one block."""
    request = Request("r", range(6))
    assert manager.allocate_slots(request, 4) is not None
    request.num_computed_tokens = 4
    return request


REFUSALS: dict[str, tuple[type, Any]] = {
    "holds no blocks": (RequestError, lambda m, r: m.cache_blocks(Request("idle", range(8)), 4)),
    "past the computed tokens": (RequestError, lambda m, r: m.cache_blocks(r, 5)),
    "negative": (InvalidArgumentError, lambda m, r: m.cache_blocks(r, -1)),
    "not an int": (ArgumentTypeError, lambda m, r: m.cache_blocks(r, 4.0)),
    "not a request": (ArgumentTypeError, lambda m, r: m.cache_blocks("r", 4)),
    "another object with the id": (
        RequestError,
        lambda m, r: m.cache_blocks(Request("r", range(6)), 4),
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_is_typed_alike_and_changes_nothing(case: str) -> None:
    error, call = REFUSALS[case]
    outcomes = []
    for manager in both():
        request = _running(manager)
        outcomes.append(_refusal(manager, lambda m, r=request: call(m, r)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] is error, outcomes[0]


def test_computed_tokens_outside_the_slots_are_refused() -> None:
    messages = []
    for manager_class in (SpecKVCacheManager, KVCacheManager):
        manager = manager_class(manager_config().kv_cache_config, 64)
        request = Request("r", range(12))
        assert manager.allocate_slots(request, 4) is not None  # one block: 4 slots
        request.num_computed_tokens = 8
        with pytest.raises(RequestError) as info:
            manager.cache_blocks(request, 8)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "slots" in messages[0]


def test_the_tokens_cached_never_pass_the_requests_own() -> None:
    """Computed tokens past the request's (its scheduled drafts, counted before they were
    accepted or rejected) cannot be cached: they are not the request's tokens yet."""
    config = dataclasses.replace(manager_config())
    for manager in both(config):
        request = Request("r", range(6))
        request.spec_token_ids = [9, 9]
        assert manager.allocate_slots(request, 8) is not None
        request.spec_token_ids = []
        request.num_computed_tokens = 8
        error, message = _refusal(manager, lambda m, r=request: m.cache_blocks(r, 8))
        assert error is RequestError and "6 computed" in message
