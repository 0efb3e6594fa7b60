"""The CPU offload tier behind the KV connector, spec and impl side by side: a manager holds the
tier its connector stores to and loads from (`attach_offload_tier`), and `reset_prefix_cache`
clears both tiers or neither (vLLM 0.33's default reset keeps the tier: #57727). The spec's
ghost KV gives a tier chunk what its store copied and a load writes it into the request's
blocks, so a load of the wrong chunk, or of one stored before a reset (older weights), is
caught by the attention-truth check.

One group of full attention, block size 4, 10 blocks; the tier holds 4 chunks of one block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from manager_fixtures import manager_config

from pagedkv import ArgumentTypeError, KVCacheManager, Request
from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.swarm import manager_layer
from pagedkv.harness.swarm.engine import execute_run
from pagedkv.offload import OffloadTier
from pagedkv.spec.attention_truth import ATTENTION_TRUTH, STALE_KV
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.offload import SpecOffloadTier
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.offload import (
    LookupResult,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    make_offload_key,
)

SIDES = ("spec", "impl")
TIER = OffloadTierConfig(num_chunks=4)
KEYS = (make_offload_key(b"chunk-0", 0), make_offload_key(b"chunk-1", 0))


def build(side: str) -> Any:
    """A manager of `side` holding a fresh tier of its own side."""
    config = manager_config()
    if side == "spec":
        spec = config.build(SpecKVCacheManager)
        spec.attach_offload_tier(SpecOffloadTier(TIER))
        return spec
    impl = config.build(KVCacheManager)
    impl.attach_offload_tier(OffloadTier(TIER))
    return impl


def computed(manager: Any, request: Request) -> None:
    """The request looked up and computed whole in one step."""
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens


def store(manager: Any, request: Request, keys: tuple[OffloadKey, ...]) -> None:
    """The connector stores the request's first blocks as `keys` (one chunk a block) and the
    store completes; the spec's ghost state copies what the blocks hold."""
    tier_request = OffloadRequest(request.request_id)
    output = manager.offload_tier.prepare_store(list(keys), tier_request)
    assert output is not None and output.keys_to_store == keys
    if isinstance(manager, SpecKVCacheManager):
        (table,) = manager.held(request.request_id) or ([],)
        manager.offload_stored(list(zip(keys, table, strict=False)))
    manager.offload_tier.complete_store(list(keys), tier_request)


def answers(manager: Any) -> list[LookupResult]:
    tier_request = OffloadRequest("lookup")
    return [manager.offload_tier.lookup(key, tier_request) for key in KEYS]


@pytest.mark.parametrize("side", SIDES)
def test_a_reset_clears_the_gpu_pool_and_the_cpu_tier(side: str) -> None:
    manager = build(side)
    request = Request("a", range(9))
    computed(manager, request)
    store(manager, request, KEYS)
    manager.free(request)
    assert answers(manager) == [LookupResult.HIT, LookupResult.HIT]
    assert manager.reset_prefix_cache()
    assert answers(manager) == [LookupResult.MISS, LookupResult.MISS]
    assert manager.offload_tier.snapshot().refs == ()
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_a_refused_reset_leaves_both_tiers(side: str) -> None:
    manager = build(side)
    request = Request("a", range(9))
    computed(manager, request)
    store(manager, request, KEYS)
    assert not manager.reset_prefix_cache()  # the request still holds its blocks
    assert answers(manager) == [LookupResult.HIT, LookupResult.HIT]


@pytest.mark.parametrize("side", SIDES)
def test_attach_offload_tier_takes_a_tier_of_its_side_or_none(side: str) -> None:
    manager = build(side)
    other = OffloadTier(TIER) if side == "spec" else SpecOffloadTier(TIER)
    with pytest.raises(ArgumentTypeError, match="OffloadTier or None"):
        manager.attach_offload_tier(other)
    manager.attach_offload_tier(None)
    assert manager.reset_prefix_cache()


def loaded(manager: SpecKVCacheManager, request: Request, keys: tuple[OffloadKey, ...]) -> None:
    """The connector loads `keys` (found in the tier) as the request's first blocks: external
    tokens past no local hit, then the rest of the prompt in the same step."""
    manager.get_computed_blocks(request)
    manager.offload_load_next(request, {(0, position): key for position, key in enumerate(keys)})
    num_external = len(keys) * manager.block_size
    manager.allocate_slots(
        request, request.num_tokens - num_external, num_external_computed_tokens=num_external
    )


def test_a_load_writes_what_the_store_copied() -> None:
    manager = build("spec")
    first = Request("a", range(9))
    computed(manager, first)
    store(manager, first, KEYS)
    manager.free(first)
    second = Request("b", range(9))  # the same prefix: the chunks hold its KV
    loaded(manager, second, KEYS)
    second.num_computed_tokens = second.num_tokens
    manager.check_invariants()
    assert manager.truth.take_checks()["attention truth: blocks loaded from a CPU tier"] == 2


def test_a_load_of_another_prefixs_chunk_is_caught() -> None:
    manager = build("spec")
    first = Request("a", range(9))
    computed(manager, first)
    store(manager, first, KEYS)
    manager.free(first)
    other = Request("b", [7, *range(1, 9)])  # its first block differs
    with pytest.raises(InvariantViolation) as caught:
        loaded(manager, other, KEYS)
    assert caught.value.invariant == ATTENTION_TRUTH


def test_kv_stored_before_a_reset_is_never_read_after_it() -> None:
    """vLLM #57727: a reset that leaves the tier serving (vLLM 0.33's default,
    `reset_connector=False`, played here by resetting with the tier detached) lets a request
    load KV computed with the old weights; its hash matches, the epoch does not."""
    manager = build("spec")
    first = Request("a", range(9))
    computed(manager, first)
    store(manager, first, KEYS)
    manager.free(first)
    tier, manager.offload_tier = manager.offload_tier, None
    assert manager.reset_prefix_cache()
    manager.attach_offload_tier(tier)
    assert answers(manager) == [LookupResult.HIT, LookupResult.HIT]
    again = Request("b", range(9))
    with pytest.raises(InvariantViolation) as caught:
        loaded(manager, again, KEYS)
    assert caught.value.invariant == STALE_KV
    assert "computed in weights epoch 0 (now 1)" in str(caught.value)


def keeping_the_tier(reset: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """`reset` made vLLM 0.33's default: the manager's tier is left out of it."""

    def reset_gpu_pool_only(manager: Any) -> bool:
        tier, manager.offload_tier = manager.offload_tier, None
        try:
            return reset(manager)
        finally:
            manager.offload_tier = tier

    return reset_gpu_pool_only


def test_the_campaign_catches_a_reset_that_keeps_the_tier_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM #57727 in the spec and the implementation alike: the two agree, so no comparison
    can see it; the spec's weights epochs do, as soon as a request loads a pre-reset chunk
    (manager run 15 of the CI campaign, seed 2025)."""
    spec_reset = keeping_the_tier(SpecKVCacheManager.reset_prefix_cache)
    impl_reset = keeping_the_tier(KVCacheManager._reset_prefix_cache)
    monkeypatch.setattr(SpecKVCacheManager, "reset_prefix_cache", spec_reset)
    monkeypatch.setattr(KVCacheManager, "_reset_prefix_cache", impl_reset)
    layer = manager_layer(pagedkv_manager)
    run = layer.draw(8280324179490601438)
    assert run.offload_tier is not None
    ops, error = execute_run(layer, run, Coverage())
    assert isinstance(error, InvariantViolation), error
    assert error.invariant == STALE_KV
    assert len(ops) == 586
