"""Edges of the manager's public behaviour that no other test stated.

`KVCacheManager` (one group or several): the lookup of a request
that grew since its hashes were stored (vLLM 0.33's `lookup_hashes_every_full_block`: a preempted
request is looked up over the blocks it generated, and every full block's hash is stored); the
hit of two full-attention groups with different cached prefixes; the call name a refused
overlapping call reports; exact refusal messages with their arguments (hits for a request that
holds blocks, more hits than stored hashes, a negative `debug_invariants`, a non-bool
`enable_kv_cache_events`, an attention spec no manager handles); speculative tokens equal to
the scheduled ones accepted; a request id free again once freed without caching; a `Request`
subclass tracked beside plain requests; the size of the sha256 memo; and the report of a
fast-path record with another request's id.

Hybrid scenarios reuse `tests/test_hybrid_manager.py`'s helpers (block size 2, block ids per
group, the free queue 1..N-1), so each result is compared with the spec manager's where the
spec has the same call.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from manager_fixtures import invariant_report
from test_hybrid_manager import (
    SIDES,
    Side,
    admit,
    cached_and_waiting,
    config,
    full,
    make,
    refusal,
    window,
)
from test_mutation_kills import OtherAttentionSpec

from pagedkv import (
    ArgumentTypeError,
    BlockPool,
    ConcurrentUseError,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfigError,
    KVCacheManager,
    PlaceholderRange,
    Request,
    RequestError,
    hash_request_tokens,
    sha256,
    uniform_kv_cache_config,
)
from pagedkv.block_hash import Sha256Memo
from pagedkv.manager import SHA256_MEMO_TOKENS
from pagedkv.single_type import single_type_manager
from pagedkv.vocab.semantics import VLLM_0_8_5, VLLM_0_33, Semantics

B = 2
FULL = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")
GROUPS = [1, 2]
"""One full-attention group, or two."""


def _ids(hits: object) -> list[int]:
    """Block ids of a hit's first group."""
    assert isinstance(hits, tuple)
    return [block.block_id for block in hits[0]]


def _prefilled(num_groups: int, prompt: list[int]) -> tuple[KVCacheManager, Request]:
    """A vLLM 0.33 manager (10 blocks of 2 tokens a group, `num_groups` full-attention groups)
    and a request whose prompt is computed."""
    kv_config = config(10 * num_groups, *[full()] * num_groups)
    manager = KVCacheManager(kv_config, 16, semantics=VLLM_0_33)
    request = Request("a", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - num_hit_tokens, hits) is not None
    request.num_computed_tokens = len(prompt)
    return manager, request


def _schedule_one_draft(manager: KVCacheManager, request: Request) -> None:
    """A decode step: one sampled token and one draft (drafts are not cached)."""
    request.append_output_token_ids(3)
    request.spec_token_ids = [4]
    assert manager.allocate_slots(request, 2) is not None
    request.spec_token_ids = []


# -- the lookup of a request that grew since its hashes were stored ------------------------------


@pytest.mark.parametrize("num_groups", GROUPS, ids=["one group", "two groups"])
def test_a_preempted_request_is_looked_up_over_the_blocks_it_generated(num_groups: int) -> None:
    """Its draft accepted, block 1 ([3, 4]) is computed but not cached (nor its hash stored)
    when the request is preempted; once b caches that block, a's lookup covers it."""
    manager, request = _prefilled(num_groups, [1, 2])
    _schedule_one_draft(manager, request)
    request.num_computed_tokens = 4  # the draft accepted
    request.append_output_token_ids([4, 5])  # tokens 1 2 | 3 4 | 5
    manager.free(request)  # preempted
    request.num_computed_tokens = 0
    assert len(manager.req_to_block_hashes["a"]) == 1
    other = Request("b", [1, 2, 3, 4, 9])
    hits, num_hit_tokens = manager.get_computed_blocks(other)
    assert manager.allocate_slots(other, 5 - num_hit_tokens, hits) is not None  # caches [3, 4]

    hits, num_hit_tokens = manager.get_computed_blocks(request)

    # The block b cached [3, 4] in: its id depends on how many groups took blocks before.
    assert (num_hit_tokens, _ids(hits)) == (4, [1, 2] if num_groups == 1 else [1, 4])
    assert manager.req_to_block_hashes["a"] == hash_request_tokens(sha256, B, request)
    manager.check_invariants()


@pytest.mark.parametrize(
    "semantics",
    [VLLM_0_33, Semantics(lookup_hashes_every_full_block=True, mm_keys_without_position=True)],
    ids=["input keyed with its place", "input keyed alone"],
)
def test_the_hashes_a_preempted_lookup_adds_chain_on_from_the_prompts_input_keys(
    semantics: Semantics,
) -> None:
    """A multimodal input in the prompt's two blocks: the hash of the block generated before
    the preemption chains on from theirs, keyed as the semantics keys an input."""
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64, semantics=semantics)
    request = Request("a", [1, 2, 3, 4], mm_positions=[PlaceholderRange(1, 2)], mm_hashes=["i"])
    assert manager.allocate_slots(request, 4) is not None
    request.num_computed_tokens = 4
    request.append_output_token_ids([5, 6])
    manager.free(request)  # preempted
    request.num_computed_tokens = 0

    manager.get_computed_blocks(request)

    mm_position = not semantics.mm_keys_without_position
    chain = hash_request_tokens(sha256, B, request, mm_position=mm_position)
    assert len(chain) == 3
    assert manager.req_to_block_hashes["a"] == chain
    assert chain[2] != hash_request_tokens(sha256, B, request, mm_position=not mm_position)[2]


@pytest.mark.parametrize("num_groups", GROUPS, ids=["one group", "two groups"])
def test_the_lookup_stores_the_hash_of_the_last_full_block_it_leaves_out(num_groups: int) -> None:
    """Its draft rejected, the request holds 2 full blocks (1 2 | 3 6) but stored 1 hash when
    preempted: the lookup leaves the last block out (it is recomputed) yet stores its hash,
    exactly one block past the stored ones."""
    manager, request = _prefilled(num_groups, [1, 2])
    _schedule_one_draft(manager, request)
    request.num_computed_tokens = 3  # the draft rejected
    request.append_output_token_ids(6)  # tokens 1 2 | 3 6
    manager.free(request)
    request.num_computed_tokens = 0

    hits, num_hit_tokens = manager.get_computed_blocks(request)

    assert (num_hit_tokens, _ids(hits)) == (2, [1])
    assert manager.req_to_block_hashes["a"] == hash_request_tokens(sha256, B, request)
    assert len(manager.req_to_block_hashes["a"]) == 2


# -- the hybrid manager: hits, allocation, refusals ----------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_two_full_attention_groups_hit_the_shorter_cached_prefix(side: str) -> None:
    """a's 4 full blocks are cached in both groups, then c's allocation evicts group 0's
    block at position 3 (block 4, freed tail first): b's hit is 3 blocks in both groups."""
    manager = make(side, config(11, full(), full()))
    first = Request("a", list(range(9)))
    assert admit(manager, first) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    manager.free(first)
    assert manager.allocate_slots(Request("c", [99]), 1) == ([5], [4])

    hits, num_hit_tokens = manager.get_computed_blocks(Request("b", [*range(8), 70]))

    assert (hits, num_hit_tokens) == (([1, 2, 3], [6, 7, 8]), 6)


@pytest.mark.parametrize("side", SIDES)
def test_as_many_drafts_as_scheduled_tokens_are_accepted(side: str) -> None:
    manager = make(side, config(10, full(), window(3)))
    request = Request("a", [1, 2, 3])
    admit(manager, request)  # 2 blocks per group, 3 tokens computed
    request.spec_token_ids = [4, 5]

    assert manager.allocate_slots(request, 2) == ([5], [6])
    manager.check_invariants()


@pytest.mark.parametrize("side", SIDES)
def test_without_caching_a_freed_request_id_is_free_for_another_request(side: str) -> None:
    """No hashes are stored without caching, so `free` alone forgets the request."""
    manager = make(side, config(8, full(), window(3)), 16, enable_caching=False)
    first = Request("a", [1, 2, 3])
    manager.allocate_slots(first, 3)
    manager.free(first)

    assert manager.allocate_slots(Request("a", [4, 5]), 2) == ([5], [6])
    manager.check_invariants()


def _hits_for_a_holding_request(manager: Side) -> Callable[[], object]:
    """b took its hits (its computed tokens still 0), then gets them again."""
    request, hits = cached_and_waiting(manager)
    assert manager.allocate_slots(request, 1, hits) is not None
    return lambda: manager.allocate_slots(request, 1, hits)


def test_hits_for_a_request_that_holds_blocks_are_refused_in_every_group() -> None:
    expected = (
        RequestError,
        "request 'b': new_computed_blocks for a request that already holds blocks or computed "
        "tokens",
    )
    assert refusal("impl", _hits_for_a_holding_request) == expected
    assert refusal("spec", _hits_for_a_holding_request) == expected


@pytest.mark.parametrize("looked_up", [False, True], ids=["never looked up", "looked up"])
def test_more_hits_than_stored_hashes_are_refused_with_both_counts(looked_up: bool) -> None:
    """One group; b's lookup (if any) stores 1 hash, a's 2 cached blocks are passed as hits."""
    manager = make("impl", config(10, full()))
    admit(manager, Request("a", list(range(7))))
    other = Request("b", [0, 1, 2])
    if looked_up:
        manager.get_computed_blocks(other)
    before = manager.state()

    with pytest.raises(RequestError) as info:
        manager.allocate_slots(other, 1, ([1, 2],))

    assert str(info.value) == (
        "request 'b': new_computed_blocks must be the request's cached blocks "
        f"(2 hits but {int(looked_up)} stored block hashes)"
    )
    assert manager.state() == before


def test_a_call_overlapping_a_pool_call_is_refused_under_its_own_name() -> None:
    """A hash function that calls the manager while the pool hashes a block with it: each call
    is refused, named, and changes nothing."""
    manager = KVCacheManager(config(8, full(), window(3)), 16)
    request = Request("a", [1, 2, 3])
    manager.allocate_slots(request, 3)
    calls: dict[str, Callable[[], object]] = {
        "KVCacheManager.get_computed_blocks": lambda: manager.get_computed_blocks(request),
        "KVCacheManager.allocate_slots": lambda: manager.allocate_slots(request, 1),
        "KVCacheManager.free": lambda: manager.free(request),
        "KVCacheManager.get_blocks": lambda: manager.get_blocks("a"),
    }
    refused: dict[str, str] = {}

    def reentering_hash(value: object) -> int:
        for name, call in calls.items():
            try:
                call()
            except ConcurrentUseError as error:
                assert error.call == name
                refused[name] = str(error)
        return sha256(value)

    pool = manager.block_pool
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(Request("r", [7, 7]), [block], [], 0, 1, B, reentering_hash)
    pool.free_blocks([block])

    assert refused == {
        name: f"{name}: refused, another call on the same object is running (pagedkv managers "
        "and pools are not thread-safe: serialize calls with a lock of your own)"
        for name in calls
    }
    assert manager.get_block_ids("a") == ([1, 2], [3, 4])
    manager.check_invariants()


def test_a_negative_checking_interval_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        KVCacheManager(config(8, full(), window(3)), 16, debug_invariants=-1)
    assert str(info.value) == "KVCacheManager: debug_invariants must be an int >= 0, got -1"


def test_the_registry_refuses_a_spec_without_a_manager_by_name() -> None:
    other = OtherAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")
    with pytest.raises(KVCacheConfigError) as info:
        single_type_manager(other, BlockPool(4, True), 0, False)
    assert str(info.value) == "no attention manager for OtherAttentionSpec"


# -- KVCacheManager --------------------------------------------------------------------------------


def test_the_manager_refuses_a_non_bool_events_switch_under_its_own_name() -> None:
    with pytest.raises(ArgumentTypeError) as info:
        KVCacheManager(uniform_kv_cache_config(FULL, 10), 16, enable_kv_cache_events=1)
    assert str(info.value) == "KVCacheManager: enable_kv_cache_events must be a bool, got 1"


@pytest.mark.parametrize(
    ("block_size", "maxsize"), [(16, SHA256_MEMO_TOKENS // 16), (2 * SHA256_MEMO_TOKENS, 1)]
)
def test_the_sha256_memo_remembers_its_tokens_worth_of_blocks_and_at_least_one(
    block_size: int, maxsize: int
) -> None:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(uniform_kv_cache_config(spec, 3), 64)
    memo = manager.caching_hash_fn
    assert isinstance(memo, Sha256Memo)
    assert memo.maxsize == maxsize


class _TaggedRequest(Request):
    """A scheduler's own request type: any subclass of Request is served."""


def test_a_request_subclass_is_served_beside_plain_requests_with_the_invariants_held() -> None:
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    tagged, plain = _TaggedRequest("t", range(6)), Request("p", range(6))
    for request in (tagged, plain):  # the subclass tracked first
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 6 - num_hit_tokens, hits) is not None
        request.num_computed_tokens = 6
    manager.check_invariants()
    tagged.append_output_token_ids(1)
    assert manager.allocate_slots(tagged, 1) is not None
    manager.check_invariants()
    for request in (tagged, plain):
        manager.free(request)
        manager.free_block_hashes(request)
    manager.check_invariants()
    assert manager.usage == pytest.approx(0.1)  # the null block alone


def test_a_fast_path_record_with_another_id_and_its_own_token_list_is_reported() -> None:
    """The record can only be wrong by a bug: it is corrupted here by hand, as the other
    reports of `tests/test_invariant_reports.py` are."""
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    request = Request("a", range(6))
    manager.allocate_slots(request, 6)
    record = manager._records[request]
    manager._records[request] = type(record)("b", request.live_token_ids())
    assert invariant_report(manager.check_invariants) == (
        "the fast path's record of a tracked request is its own",
        "request 'a': a record of 'b' with its token list",
    )


def test_a_request_missing_from_a_later_group_is_reported_as_unequal_block_lists() -> None:
    """Group 1's list of request 'a' moved under another id (every block still held once): the
    report names 'a' with no list in group 1, not a crash on the missing list."""
    manager = KVCacheManager(config(10, full(), window(3)), 16)
    manager.allocate_slots(Request("a", range(5)), 5)
    lists = manager.coordinator.single_type_managers[1].req_to_blocks
    lists["b"] = lists.pop("a")
    assert invariant_report(manager.check_invariants) == (
        "a request's block lists cover the same token slots in every group",
        "request 'a': [3, None] blocks of [2, 2] tokens",
    )


def test_hashes_keyed_without_the_inputs_place_pass_the_stored_chain_check() -> None:
    """`mm_keys_without_position` alone (vLLM 0.8.5's keys, without its other switches): the
    stored hashes differ from the chain keyed with the input's place, and the invariant check
    rehashes the tokens as they were stored, so it passes."""
    semantics = Semantics(mm_keys_without_position=True)
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64, semantics=semantics)
    request = Request("a", [0] * 6, mm_positions=[PlaceholderRange(1, 2)], mm_hashes=["img"])
    assert manager.allocate_slots(request, 6) is not None
    hash_fn = manager.caching_hash_fn
    stored = manager.req_to_block_hashes["a"]
    assert stored == hash_request_tokens(hash_fn, B, request, mm_position=False)
    assert stored[:2] != hash_request_tokens(hash_fn, B, request)[:2]
    manager.check_invariants()


def test_a_capped_allocation_after_hits_stops_at_max_model_len() -> None:
    """vLLM 0.8.5's cap: max_model_len 8 (4 blocks of 2); b hits a's 3 cached blocks and
    schedules 6 more tokens (6 blocks needed): it gets the 1 block left, not 3."""
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 8, semantics=VLLM_0_8_5)
    first = Request("a", list(range(7)))
    assert manager.allocate_slots(first, 7) is not None
    first.num_computed_tokens = 7
    manager.free(first)
    second = Request("b", list(range(12)))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 6
    new = manager.allocate_slots(second, 6, hits)
    assert new is not None and len(new[0]) == 1
    assert len(manager.get_blocks("b")[0]) == 4


def test_full_attention_reads_every_earlier_token_so_skips_no_block() -> None:
    """Full attention's per-type manager skips no leading block at any step (its attention reads
    every earlier token); the coordinator never asks it, but the per-type surface states it."""
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    (full,) = manager.coordinator.single_type_managers
    assert not full.allows_null_blocks
    assert [full.num_skipped_blocks(n) for n in (0, 1, 16, 63)] == [0, 0, 0, 0]


def test_get_blocks_during_another_call_is_refused_under_its_own_name() -> None:
    """`get_blocks` called from inside a pool call (a re-entering hash function) is refused
    with its own name, and the call it interrupted completes."""
    manager = KVCacheManager(uniform_kv_cache_config(FULL, 10), 64)
    manager.allocate_slots(Request("a", [1, 2, 3]), 3)
    names: list[str] = []

    def reentering_hash(value: object) -> int:
        try:
            manager.get_blocks("a")
        except ConcurrentUseError as error:
            names.append(error.call)
        return sha256(value)

    pool = manager.block_pool
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(Request("r", [7] * B), [block], [], 0, 1, B, reentering_hash)
    pool.free_blocks([block])
    assert names == ["KVCacheManager.get_blocks"]
    assert [len(group) for group in manager.get_blocks("a")] == [2]  # 3 tokens, blocks of 2
