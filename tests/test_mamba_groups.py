"""Mamba groups (vLLM 0.33's `MambaManager`, mode "none") and groups of several block sizes,
spec and impl side by side: each group holds the blocks its own block size needs for the
request's slots (plus a Mamba group's speculative blocks), all groups' missing blocks fit
together or nothing changes, refusals name the group, and the invariants check that every
group covers the same slots.

The model: full attention of block size 4 (group 0) and a Mamba group of block size
max_model_len = 40 with one speculative block (group 1), caching off, in a pool of 10 blocks
(1..9 free). vLLM 0.33 lays a Mamba hybrid out this way with caching off: its Mamba layers'
block size is max_model_len.
"""

from __future__ import annotations

import pytest

from pagedkv import (
    FullAttentionSpec,
    InvariantViolation,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MaxModelLenExceededError,
    Request,
    RequestError,
    SlidingWindowSpec,
)
from pagedkv.spec.manager import SpecKVCacheManager

MAX_MODEL_LEN = 40
Manager = SpecKVCacheManager | KVCacheManager


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")


def mamba(block_size: int = MAX_MODEL_LEN, speculative: int = 1) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=[(1,)],
        dtypes=["float16"],
        page_size_padded=16,
        num_speculative_blocks=speculative,
    )


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    names = [f"layers.{group}" for group in range(len(specs))]
    return KVCacheConfig(
        num_blocks,
        {
            name: KVCacheTensor(spec.page_size_bytes * num_blocks)
            for name, spec in zip(names, specs, strict=True)
        },
        [KVCacheGroupSpec([name], spec) for name, spec in zip(names, specs, strict=True)],
    )


def both(kv_config: KVCacheConfig) -> list[Manager]:
    return [
        manager_class(kv_config, MAX_MODEL_LEN, enable_caching=False)
        for manager_class in (SpecKVCacheManager, KVCacheManager)
    ]


def ids(result: object) -> list[list[int]] | None:
    """A result's block ids per group (the spec answers in ids, the impl in blocks)."""
    if result is None:
        return None
    assert isinstance(result, tuple)
    return [[getattr(block, "block_id", block) for block in blocks] for blocks in result]


def held(manager: Manager, request_id: str) -> list[list[int]]:
    if isinstance(manager, SpecKVCacheManager):
        found = manager.held(request_id)
        return [] if found is None else [list(blocks) for blocks in found]
    found = [list(blocks) for blocks in manager.get_block_ids(request_id)]
    return found if any(found) else []


def step(manager: Manager, request: Request, num_tokens: int, lookahead: int = 0) -> object:
    """allocate_slots, then the tokens count as computed (as a scheduler does)."""
    result = manager.allocate_slots(request, num_tokens, None, lookahead)
    if result is not None:
        request.num_computed_tokens += num_tokens
    manager.check_invariants()
    return result


@pytest.mark.parametrize("side", [0, 1], ids=["spec", "impl"])
def test_each_group_takes_what_its_own_block_size_needs(side: int) -> None:
    manager = both(config(10, full(), mamba()))[side]
    empty = manager.usage  # the null block
    request = Request("r", range(10))
    assert ids(step(manager, request, 10)) == [[1, 2, 3], [4, 5]]  # state + speculative block
    for token in range(10, 12):
        request.append_output_token_ids(token)
        assert ids(step(manager, request, 1)) == [[], []]  # inside the last attention block
    request.append_output_token_ids(12)
    assert ids(step(manager, request, 1)) == [[6], []]  # a new attention block only
    assert held(manager, "r") == [[1, 2, 3, 6], [4, 5]]
    manager.free(request)
    manager.check_invariants()
    assert manager.usage == empty


@pytest.mark.parametrize("side", [0, 1], ids=["spec", "impl"])
def test_all_groups_fit_together_or_nothing_changes(side: int) -> None:
    """8 free blocks: a 3-block request takes 5 (3 + 2); a second one needs 5 again. Each
    group's share (3, or 2) alone would fit in the 3 left: together they do not."""
    manager = both(config(9, full(), mamba()))[side]
    first, second = Request("a", range(10)), Request("b", range(10))
    assert ids(step(manager, first, 10)) == [[1, 2, 3], [4, 5]]
    usage = manager.usage
    assert step(manager, second, 10) is None
    assert manager.usage == usage and held(manager, "b") == []


@pytest.mark.parametrize("side", [0, 1], ids=["spec", "impl"])
def test_a_mamba_group_bounds_slots_at_max_model_len(side: int) -> None:
    """Full attention alone would allow 40 slots here too, but a group of block size 36 would
    allow 72; with the Mamba group's one block of 40 tokens, 41 slots are refused naming it."""
    manager = both(config(10, full(36), mamba()))[side]
    request = Request("r", range(40))
    with pytest.raises(MaxModelLenExceededError) as info:
        manager.allocate_slots(request, 40, None, 1)
    assert str(info.value) == (
        "request 'r': allocation past max_model_len (3 blocks needed, at most 2 "
        "(max_model_len 40, block size 40, KV cache group 1))"
    )
    manager.check_invariants()
    assert ids(step(manager, request, 40)) == [[1, 2], [3, 4]]


@pytest.mark.parametrize("side", [0, 1], ids=["spec", "impl"])
def test_computed_tokens_outside_a_group_s_slots_are_refused_naming_it(side: int) -> None:
    manager = both(config(10, full(), mamba()))[side]
    empty = manager.usage
    request = Request("r", range(10))
    request.num_computed_tokens = 3  # nothing held yet
    with pytest.raises(RequestError) as info:
        manager.allocate_slots(request, 7)
    assert info.value.rule == "num_computed_tokens outside the request's slots"
    assert str(info.value).endswith("(3 computed, 0 blocks of 4 held in KV cache group 0)")
    assert manager.usage == empty


@pytest.mark.parametrize("side", [0, 1], ids=["spec", "impl"])
def test_a_state_block_wholly_before_the_last_token_is_dropped(side: int) -> None:
    """A Mamba group of 4-token blocks (a user's choice; vLLM uses max_model_len): the token at
    p reads the state after p - 1, so block i is dropped once p - 1 lies past it."""
    manager = both(config(12, full(), mamba(4, speculative=0)))[side]
    request = Request("r", range(9))
    assert ids(step(manager, request, 8)) == [[1, 2], [3, 4]]
    request.append_output_token_ids(9)  # tokens 0..9; 8 computed
    assert ids(step(manager, request, 1)) == [[5], [6]]
    request.append_output_token_ids(10)  # token 9 computed next: reads the state after 8
    assert ids(step(manager, request, 1)) == [[], []]
    assert held(manager, "r") == [[1, 2, 5], [0, 0, 6]]  # states before token 8 are dropped


def test_the_spec_and_the_impl_report_a_group_that_lost_its_speculative_block() -> None:
    managers = both(config(10, full(), mamba()))
    for manager in managers:
        step(manager, Request("r", range(10)), 10)
    spec, impl = managers
    assert isinstance(spec, SpecKVCacheManager) and isinstance(impl, KVCacheManager)
    spec.pool.free_blocks_unchecked([spec.managers[1].blocks["r"].pop()])
    impl.block_pool.free_blocks([impl.coordinator.single_type_managers[1].req_to_blocks["r"].pop()])
    reports = []
    for manager in managers:
        with pytest.raises(InvariantViolation) as info:
            manager.check_invariants()
        reports.append((info.value.invariant, info.value.detail))
    assert (
        reports[0]
        == reports[1]
        == (
            "a request's block lists cover the same token slots in every group",
            "request 'r': [3, 1] blocks of [4, 40] tokens",
        )
    )


def test_mixed_attention_block_sizes_without_caching() -> None:
    """Two attention groups of 2- and 6-token blocks (caching off, as vLLM's no-prefix-cache
    coordinator allows): spec and impl take the same blocks step by step."""
    window = SlidingWindowSpec(
        block_size=6, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=4
    )
    results: list[list[object]] = []
    for manager in both(config(16, full(2), window)):
        request = Request("r", range(7))
        trace: list[object] = [ids(step(manager, request, 7))]
        for token in range(7, 20):
            request.append_output_token_ids(token)
            trace.append(ids(step(manager, request, 1)))
        trace.append(held(manager, "r"))
        results.append(trace)
    assert results[0] == results[1]
    # After 19 computed tokens the window starts at token 16: the 6-token group's first two
    # blocks are dropped (freed to the queue's tail), the 2-token group keeps all ten.
    assert results[0][-1] == [[1, 2, 3, 4, 7, 8, 9, 11, 12, 13], [0, 0, 10, 14]]


def test_a_model_of_state_layers_only_holds_one_state_per_request() -> None:
    """One Mamba group alone (a Mamba-2 model, caching off; the manager campaign's
    `mamba_alone` runs): a request holds its state block and its speculative one whatever its
    length, a decode step takes none, and the pool runs out at a number of requests; spec and
    impl take the same blocks."""
    results: list[list[object]] = []
    for manager in both(config(5, mamba(speculative=1))):
        first, long, late = Request("a", range(3)), Request("b", range(30)), Request("c", [7])
        trace = [ids(step(manager, first, 3)), ids(step(manager, long, 30))]
        first.append_output_token_ids(3)
        trace.append(ids(step(manager, first, 1)))
        trace.append(ids(step(manager, late, 1)))
        manager.free(first)
        trace.append(ids(step(manager, late, 1)))
        trace.append(held(manager, "b"))
        results.append(trace)
    assert results[0] == results[1]
    # Blocks 1-4 hold two requests' states; the third waits until the first is freed, and
    # takes its blocks back in the order they were freed (with caching off, pagedkv frees a
    # request's blocks first to last).
    assert results[0] == [[[1, 2]], [[3, 4]], [[]], None, [[1, 2]], [[3, 4]]]
