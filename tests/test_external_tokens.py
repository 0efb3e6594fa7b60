"""A KV connector's external tokens (`allocate_slots(..., num_external_computed_tokens=n,
delay_cache_blocks=...)`, vLLM 0.33's connector path), spec and impl side by side.

External tokens extend a request's first allocation past its hits: their KV is loaded by a
connector into fresh blocks. Every group adopts its hits less those the external tokens push
out of its window or chunk (null blocks there, the hits left untouched in the free queue), every
group's adopted hits are touched, every group takes its external blocks, then every group its
new blocks (vLLM 0.33's two phases, PR #44409). A sync load caches them at once; an async load
(`delay_cache_blocks`) caches nothing until the caller's `cache_blocks` when it lands, so no
other request can hit a block still being loaded.

The numbers: block size 4, max_model_len 64; pools of 10 blocks (1..9 free) unless stated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from manager_fixtures import GROUP_FACTORIES, manager_config

from pagedkv import (
    ArgumentTypeError,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheSpec,
    MambaSpec,
    Request,
    RequestError,
    SlidingWindowSpec,
)
from pagedkv.harness.adapters import SpecManagerAdapter
from pagedkv.harness.client.manager import ManagerClient
from pagedkv.harness.client.manager_ops import Admit, Arrive, Finish, Step
from pagedkv.harness.coverage import Coverage
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config
from pagedkv.vocab.errors import InvariantViolation

SIDES = sorted(GROUP_FACTORIES)
B = 4


def both(config: ManagerConfig | None = None) -> list[ManagerUnderTest]:
    return [GROUP_FACTORIES[side](config or manager_config()) for side in SIDES]


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")


def window(tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=tokens
    )


def groups_config(specs: list[KVCacheSpec], num_blocks: int) -> ManagerConfig:
    return dataclasses.replace(
        manager_config(), kv_cache_config=hybrid_kv_cache_config(specs, num_blocks)
    )


def external(
    manager: ManagerUnderTest,
    request: Request,
    num_tokens: int,
    hits: Any,
    num_external: int,
    delay: bool = False,
    **gate: bool,
) -> Any:
    return manager.allocate_slots(
        request,
        num_tokens,
        hits if hits and any(hits) else None,
        0,
        num_external_computed_tokens=num_external,
        delay_cache_blocks=delay,
        **gate,
    )


def computed_and_freed(manager: ManagerUnderTest, tokens: list[int]) -> None:
    """A request that computed `tokens` (its full blocks cached) and finished."""
    request = Request("done", tokens)
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens)) is not None
    manager.free(request)
    manager.free_block_hashes(request)


def test_a_sync_load_fills_fresh_blocks_after_the_hits_and_caches_them() -> None:
    snapshots = []
    for manager in both():
        computed_and_freed(manager, list(range(8)))  # blocks 1, 2 cached, freed
        request = Request("r", range(20))
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert hits == ([1, 2],) and num_hit_tokens == 8
        # 8 external tokens (blocks 3, 4), then 4 new tokens: only the new block is returned
        assert external(manager, request, 4, hits, 8) == ([5],)
        manager.check_invariants()
        snapshot = manager.snapshot()
        assert snapshot.blocks["r"] == ((1, 2, 3, 4, 5),)
        assert snapshot.num_cached == {"r": 5}  # the loaded blocks are cached at once
        sibling = Request("s", [*range(16), 99])
        assert manager.get_computed_blocks(sibling) == (([1, 2, 3, 4],), 16)
        snapshots.append(snapshot)
    assert snapshots[0] == snapshots[1]


def test_an_async_load_caches_nothing_until_it_lands() -> None:
    """A block still being loaded is never hit: its hash is set only by `cache_blocks`."""
    snapshots = []
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert external(manager, request, 0, None, 12, delay=True) == ([],)
        manager.check_invariants()
        assert manager.snapshot().blocks["r"] == ((1, 2, 3),)
        assert manager.snapshot().num_cached == {"r": 0}
        sibling = Request("s", [*range(12), 99])
        assert manager.get_computed_blocks(sibling)[1] == 0  # nothing to hit while loading
        request.num_computed_tokens = 12  # the caller's count once the load lands
        manager.cache_blocks(request, 12)
        manager.check_invariants()
        assert manager.snapshot().num_cached == {"r": 3}
        assert manager.get_computed_blocks(sibling)[1] == 12
        assert manager.allocate_slots(request, 8) == ([4, 5],)  # a running request from here
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_a_delayed_request_that_runs_before_cache_blocks_caches_then() -> None:
    """Without the `cache_blocks` call, the next allocation caches the loaded blocks."""
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert external(manager, request, 0, None, 9, delay=True) == ([],)
        request.num_computed_tokens = 9
        assert manager.allocate_slots(request, 11) == ([4, 5],)
        assert manager.snapshot().num_cached == {"r": 5}
        manager.check_invariants()


def test_external_tokens_push_hits_out_of_a_window() -> None:
    """vLLM 0.33.0's own run (docs/design/connector-path.md §1): window 8, a 24-token hit
    [null x4, 5, 6] and 8 external tokens: the table becomes [null x6, 7, 8]; blocks 5 and 6
    stay in the free queue at ref_cnt 0, untouched; the nulls count as cached."""
    config = dataclasses.replace(manager_config(sliding_window=8, num_blocks=13), max_model_len=64)
    snapshots = []
    for manager in both(config):
        computed_and_freed(manager, list(range(24)))  # blocks 1-6, 5 and 6 cached last
        request = Request("r", range(40))
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert hits == ([0, 0, 0, 0, 5, 6],) and num_hit_tokens == 24
        free_before = manager.snapshot().pool.free_order
        assert external(manager, request, 0, hits, 8, delay=True) == ([],)
        manager.check_invariants()
        snapshot = manager.snapshot()
        assert snapshot.blocks["r"] == ((0, 0, 0, 0, 0, 0, 7, 8),)
        assert snapshot.pool.ref_cnt[5] == snapshot.pool.ref_cnt[6] == 0
        assert snapshot.pool.free_order == tuple(b for b in free_before if b not in (7, 8))
        assert snapshot.num_cached == {"r": 6}
        assert snapshot.pool.block_hash[7] is None and snapshot.pool.block_hash[8] is None
        request.num_computed_tokens = 32
        manager.cache_blocks(request, 32)
        assert manager.snapshot().num_cached == {"r": 8}
        assert manager.snapshot().pool.block_hash[7] is not None
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_hits_pushed_out_of_the_window_are_free_blocks_for_the_allocation() -> None:
    """The trimmed hits are not touched, so they count as free blocks (vLLM 0.33 counts only
    the hits it keeps): a pool that fits the request only with them admits it, and here hands
    them out first, as the queue's head."""
    config = manager_config(sliding_window=8, num_blocks=9)  # blocks 1..8
    snapshots = []
    for manager in both(config):
        computed_and_freed(manager, list(range(24)))  # queue: 7, 8, then 6..1 (all cached)
        occupant = Request("o", [7] * 8)
        manager.get_computed_blocks(occupant)
        assert manager.allocate_slots(occupant, 8) == ([7, 8],)
        request = Request("r", range(44))
        hits, _ = manager.get_computed_blocks(request)
        assert hits == ([0, 0, 0, 0, 5, 6],)
        # 24 hit + 8 external + 12 new tokens: 11 blocks, the first 6 null at 32 tokens: 5
        # fresh blocks of the 6 free; with 5 and 6 touched only 4 would be free
        assert external(manager, request, 12, hits, 8) == ([4, 3, 2],)
        assert manager.snapshot().blocks["r"] == ((0, 0, 0, 0, 0, 0, 6, 5, 4, 3, 2),)
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_every_group_takes_its_external_blocks_before_any_group_its_new_blocks() -> None:
    """Full attention and a window of 4 over one pool: phase 2 (external blocks, group by
    group), then the new blocks (group by group)."""
    config = groups_config([full(), window(4)], 16)
    snapshots = []
    for manager in both(config):
        request = Request("r", range(16))
        manager.get_computed_blocks(request)
        new = external(manager, request, 4, None, 12)
        # window 4 at 12 tokens: positions 0 and 1 are skipped (null); the full group loads
        # 3 blocks (1-3), the window group 1 (4); then one new block each (5, 6)
        assert new == ([5], [6])
        assert manager.snapshot().blocks["r"] == ((1, 2, 3, 5), (0, 0, 4, 6))
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_a_refused_allocation_with_external_tokens_changes_nothing() -> None:
    for manager in both(manager_config(num_blocks=5)):  # 4 free blocks
        computed_and_freed(manager, list(range(8)))
        request = Request("r", range(30))
        hits, _ = manager.get_computed_blocks(request)
        before = manager.snapshot()
        assert external(manager, request, 10, hits, 12) is None  # 8 blocks, 4 free
        assert manager.snapshot() == before
        assert external(manager, request, 0, hits, 30 - 8, full_sequence_must_fit=True) is None
        assert manager.snapshot() == before


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m, r: m.allocate_slots(r, 0),
            InvalidArgumentError,
            "num_tokens 0 must adopt new_computed_blocks or external tokens",
        ),
        (
            lambda m, r: external(m, r, 1, None, 20),
            InvalidArgumentError,
            "21 tokens computed after this step, but the request has 20",
        ),
        (
            lambda m, r: external(m, r, 1, None, -1),
            InvalidArgumentError,
            "num_external_computed_tokens must be an int >= 0",
        ),
        (
            lambda m, r: m.allocate_slots(r, 1, None, 0, delay_cache_blocks=1),
            ArgumentTypeError,
            "delay_cache_blocks must be a bool",
        ),
    ],
)
def test_bad_external_arguments_are_refused_and_change_nothing(
    call: Any, error: type[Exception], message: str
) -> None:
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        before = manager.snapshot()
        with pytest.raises(error, match=message):
            call(manager, request)
        assert manager.snapshot() == before


def test_external_tokens_for_a_running_request_are_refused() -> None:
    """vLLM 0.33 would silently make them new slots and cache them at once (no scheduler path
    passes them): pagedkv refuses, naming the request."""
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 4) is not None
        request.num_computed_tokens = 4
        before = manager.snapshot()
        with pytest.raises(RequestError, match="'r': num_external_computed_tokens for a request"):
            external(manager, request, 4, None, 4)
        assert manager.snapshot() == before


def test_external_tokens_with_a_mamba_group_are_refused() -> None:
    mamba = MambaSpec(block_size=B, shapes=((1,),), dtypes=("float16",))
    config = dataclasses.replace(groups_config([full(), mamba], 16), enable_caching=False)
    for manager in both(config):
        request = Request("r", range(20))
        before = manager.snapshot()
        with pytest.raises(InvalidArgumentError, match="Mamba group \\(group 1\\)"):
            external(manager, request, 4, None, 4)
        assert manager.snapshot() == before


def test_the_spec_counts_the_loaded_tokens_as_the_requests_own_kv() -> None:
    """Attention truth: the window reads the external blocks at the next step; the spec's
    ghost KV holds the request's KV there from the load on."""
    (spec_side,) = [GROUP_FACTORIES["spec"](manager_config(sliding_window=8, num_blocks=13))]
    spec: Any = spec_side
    request = Request("r", range(40))
    spec.get_computed_blocks(request)
    assert external(spec, request, 4, None, 20) is not None
    truth = spec.manager.truth
    assert truth.checks["attention truth: external tokens loaded"] == 20
    request.num_computed_tokens = 24
    spec.check_invariants()  # the window at 24 reads the loaded positions 17-23


def test_a_whole_prompt_load_with_a_window_then_recomputing_its_last_token_is_caught() -> None:
    """vLLM 0.33's scheduler recomputes the last token of a prompt a load covered entirely; with
    a window the allocation dropped, for the token at 15, block 1 (tokens 4-7), which the
    token at 14 reads (7-14): the spec's attention-truth check refuses that step
    (docs/semantics.md, External tokens)."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config(sliding_window=8, num_blocks=13))
    request = Request("r", range(15))
    spec.get_computed_blocks(request)
    assert external(spec, request, 0, None, 15, delay=True) == ([],)
    assert spec.snapshot().blocks["r"] == ((0, 0, 1, 2),)
    request.num_computed_tokens = 15
    spec.cache_blocks(request, 15)
    spec.check_invariants()
    request.num_computed_tokens = 14  # the last token recomputed
    with pytest.raises(InvariantViolation, match="reads position 7, held by the null block"):
        spec.allocate_slots(request, 1)


def test_no_groups_external_blocks_evict_another_groups_hit() -> None:
    """vLLM #43884 (fixed in 0.33 by PR #44409): the full-attention group's external block
    comes from the free queue's head, where the window group's kept hit (block 12) sits until
    it is touched; every group's hits are touched before any group allocates, so the full group
    takes block 11 (a hit the external tokens pushed out of the window) instead."""
    config = groups_config([full(), window(8)], 13)  # blocks 1-12: one request's worth
    snapshots = []
    for manager in both(config):
        computed_and_freed(manager, list(range(24)))  # queue: 6..1, then 12..7
        request = Request("r", range(40))
        hits, _ = manager.get_computed_blocks(request)
        assert hits == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 11, 12])
        assert external(manager, request, 0, hits, 4, delay=True) == ([], [])
        assert manager.snapshot().blocks["r"] == ((1, 2, 3, 4, 5, 6, 11), (0, 0, 0, 0, 0, 12, 10))
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_a_failed_load_caches_its_valid_prefix_and_is_recomputed_in_place() -> None:
    """vLLM 0.33's "recompute" policy for an async load that failed from block 2: the valid
    prefix (8 tokens) is cached, the request recomputes the rest into the blocks it holds. The
    spec's ghost KV learns the failure (`external_load_failed`): blocks 3 and 4 hold garbage
    until recomputed."""
    snapshots = []
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert external(manager, request, 0, None, 16, delay=True) == ([],)
        if isinstance(manager, SpecManagerAdapter):
            manager.manager.external_load_failed(request, 8)
        request.num_computed_tokens = 8
        manager.cache_blocks(request, 8)
        assert manager.snapshot().num_cached == {"r": 2}
        assert manager.allocate_slots(request, 12) == ([5],)  # recomputed into blocks 3, 4
        request.num_computed_tokens = 20
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_caching_past_a_failed_load_is_caught_by_the_spec() -> None:
    """A caller that caches the whole load although it failed from block 2: the next request
    that hits those blocks would read garbage; the spec's attention-truth check says so."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config())
    request = Request("r", range(20))
    spec.get_computed_blocks(request)
    external(spec, request, 0, None, 16, delay=True)
    spec.manager.external_load_failed(request, 8)
    request.num_computed_tokens = 16
    spec.cache_blocks(request, 16)  # the caller's mistake: blocks 3, 4 never landed
    with pytest.raises(InvariantViolation, match="a prefix-cache hit of request 's'"):
        spec.get_computed_blocks(Request("s", [*range(16), 99]))


def test_a_failed_sync_load_under_the_fail_policy_evicts_its_blocks_from_there() -> None:
    """vLLM 0.33's "fail" policy for a sync load (cached at the allocation) that failed from
    block 2: the scheduler evicts the request's blocks from there and finishes it with an
    error; the next lookup stops at the valid prefix."""
    snapshots = []
    for manager in both():
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert external(manager, request, 3, None, 16) == ([5],)  # blocks 1-4 loaded, cached
        if isinstance(manager, SpecManagerAdapter):
            manager.manager.external_load_failed(request, 8)
        manager.evict_blocks([3, 4, 5])
        manager.free(request)
        manager.free_block_hashes(request)
        manager.check_invariants()
        hits, num_tokens = manager.get_computed_blocks(Request("s", [*range(16), 99]))
        assert hits == ([1, 2],) and num_tokens == 8
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_a_failed_sync_load_left_cached_is_caught_by_the_spec() -> None:
    """Without the eviction (the caller's mistake: vLLM's "recompute" policy relies on the
    request recomputing in the very next forward pass, before any reader), a finished request
    leaves blocks 3 and 4 cached over garbage, and the next request that hits them is caught."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config())
    request = Request("r", range(20))
    spec.get_computed_blocks(request)
    external(spec, request, 3, None, 16)
    spec.manager.external_load_failed(request, 8)
    spec.free(request)
    spec.free_block_hashes(request)
    with pytest.raises(InvariantViolation, match="a prefix-cache hit of request 's'"):
        spec.get_computed_blocks(Request("s", [*range(16), 99]))


def test_recomputing_a_window_from_a_failed_block_reads_dropped_blocks() -> None:
    """vLLM 0.33's scheduler recomputes from the first failed block, but with a window the
    allocation nulled, for all 32 loaded tokens, blocks 0-5; the token at 24 reads 17-24: the
    spec's attention-truth check refuses that step (docs/semantics.md, External tokens)."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config(sliding_window=8, num_blocks=13))
    request = Request("r", range(40))
    spec.get_computed_blocks(request)
    assert external(spec, request, 0, None, 32, delay=True) == ([],)
    assert spec.snapshot().blocks["r"] == ((0, 0, 0, 0, 0, 0, 1, 2),)
    spec.manager.external_load_failed(request, 24)  # from the first loaded block on
    request.num_computed_tokens = 24
    spec.cache_blocks(request, 24)
    with pytest.raises(InvariantViolation, match="reads position 17, held by the null block"):
        spec.allocate_slots(request, 16)


def test_recomputing_a_chunk_from_a_failed_block_writes_a_dropped_block() -> None:
    """The chunked-local form (found by `--against vllm==0.33.0 --layer hybrid --seed 1`): a
    full-attention and a chunked group; 17 tokens loaded drop the chunk group's blocks before
    the last loaded token's chunk (blocks 0-3); a failure from block 2 recomputes tokens 8-12
    into null blocks, and the next token's chunk reads them."""
    chunk = ChunkedLocalAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=8
    )
    full = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1, dtype="float16")
    spec: Any = GROUP_FACTORIES["spec"](groups_config([full, chunk], 20))
    request = Request("r", range(24))
    spec.get_computed_blocks(request)
    assert external(spec, request, 0, None, 17, delay=True) == ([], [])
    assert spec.snapshot().blocks["r"] == ((1, 2, 3, 4, 5), (0, 0, 0, 0, 6))
    spec.manager.external_load_failed(request, 8)
    request.num_computed_tokens = 8
    spec.cache_blocks(request, 8)
    assert spec.allocate_slots(request, 5) == ([], [])
    request.num_computed_tokens = 13
    with pytest.raises(InvariantViolation, match="group 1 reads position 8, held by the null"):
        spec.check_invariants()


def test_a_failed_load_report_off_a_block_boundary_or_without_blocks_is_refused() -> None:
    """`external_load_failed` names the request and the rule broken, and changes nothing: the
    valid tokens must be a multiple of B within the slots the request holds."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config())
    request = Request("r", range(20))
    with pytest.raises(RequestError, match="'r'"):
        spec.manager.external_load_failed(request, 0)
    spec.get_computed_blocks(request)
    external(spec, request, 0, None, 16, delay=True)
    before = spec.snapshot()
    for valid in (6, 20, -4):
        with pytest.raises(InvalidArgumentError, match=f"request 'r'.*got {valid}"):
            spec.manager.external_load_failed(request, valid)
        assert spec.snapshot() == before
    spec.manager.external_load_failed(request, 16)  # the whole of its 16 slots: nothing failed
    spec.check_invariants()


def test_an_abort_while_loading_keeps_the_blocks_until_the_load_finishes() -> None:
    """vLLM 0.33 (the fix of #32255): a request aborted in WAITING_FOR_REMOTE_KVS keeps its
    blocks until `finished_recving`; then it is freed and its blocks, never cached, are handed
    out to the next request."""
    snapshots = []
    for manager in both(manager_config(num_blocks=6)):
        request = Request("r", range(20))
        manager.get_computed_blocks(request)
        assert external(manager, request, 0, None, 16, delay=True) == ([],)
        other = Request("s", range(100, 120))
        manager.get_computed_blocks(other)
        assert manager.allocate_slots(other, 20) is None  # r's 4 blocks are still held
        if isinstance(manager, SpecManagerAdapter):
            manager.manager.external_load_finished(request)
        manager.free(request)
        assert manager.allocate_slots(other, 20) == ([5, 4, 3, 2, 1],)
        manager.check_invariants()
        snapshots.append(manager.snapshot())
    assert snapshots[0] == snapshots[1]


def test_freeing_a_request_whose_load_is_in_flight_is_caught_at_reuse() -> None:
    """vLLM #32255: an abort freed the blocks a remote write was still filling, and the next
    request got them. The spec knows the load is in flight until it lands, fails or is
    reported finished; handing one of its blocks out before that breaks the rule by name."""
    spec: Any = GROUP_FACTORIES["spec"](manager_config(num_blocks=6))
    request = Request("r", range(20))
    spec.get_computed_blocks(request)
    external(spec, request, 0, None, 16, delay=True)
    spec.free(request)  # the scheduler's mistake: the load still writes blocks 1-4
    other = Request("s", range(100, 120))
    spec.get_computed_blocks(other)
    with pytest.raises(InvariantViolation, match=r"block \d handed out again while request 'r'"):
        spec.allocate_slots(other, 8)
    # Reported finished before any reuse, the early free did no harm.
    spec = GROUP_FACTORIES["spec"](manager_config(num_blocks=6))
    spec.get_computed_blocks(request)
    external(spec, request, 0, None, 16, delay=True)
    spec.free(request)
    spec.manager.external_load_finished(request)
    spec.get_computed_blocks(other)
    assert spec.allocate_slots(other, 20) == ([5, 4, 3, 2, 1],)
    spec.check_invariants()


def test_a_landed_or_failed_load_is_over() -> None:
    """Landing (`cache_blocks`) or a failure report ends the load: the request's blocks are
    reused freely after its free, without a separate report."""
    for land in ("cache_blocks", "failed"):
        spec: Any = GROUP_FACTORIES["spec"](manager_config(num_blocks=6))
        request = Request("r", range(20))
        spec.get_computed_blocks(request)
        external(spec, request, 0, None, 16, delay=True)
        if land == "cache_blocks":
            request.num_computed_tokens = 16
            spec.cache_blocks(request, 16)
        else:
            spec.manager.external_load_failed(request, 0)
        spec.free(request)
        other = Request("s", range(100, 120))
        spec.get_computed_blocks(other)
        assert spec.allocate_slots(other, 20) is not None
        spec.check_invariants()


def connector_client(coverage: Coverage) -> ManagerClient:
    """The campaigns' client over pagedkv's manager (5 usable blocks), playing a connector."""
    return ManagerClient.build(
        manager_config(num_blocks=6),
        GROUP_FACTORIES["impl"],
        coverage,
        check_every=1,
        external_tokens=True,
    )


def test_the_campaign_client_holds_an_aborted_load_until_it_finishes() -> None:
    """The campaigns' scheduler stand-in keeps vLLM 0.33's order after #32255: a request
    aborted while its async load is in flight keeps its blocks until the load finishes (at the
    next step), so the next admission cannot take them; then they are freed and it can."""
    coverage = Coverage()
    client = connector_client(coverage)

    def arrive(first: int) -> Arrive:
        return Arrive(tuple(range(first, first + 20)), -1, 0, False, None, (), None, False)

    client.execute(arrive(0))
    client.execute(Admit(0, 0, 0, 0, 16, True))  # 16 tokens loading into 4 of the 5 blocks
    client.execute(Finish(0))  # aborted while loading: held until the load finishes
    assert [live.record.request_id for live in client.receiving] == ["req-1"]
    client.execute(arrive(100))
    client.execute(Admit(0, 0, 0))  # needs 5 blocks, 1 is free: refused, nothing handed out
    assert not client.live[0].running
    client.execute(Step(0, 0, (), 0, 0, 0))  # the load finishes: req-1 is freed
    assert client.receiving == []
    client.execute(Admit(0, 0, 0))
    assert client.live[0].running
    client.finish_run()
    assert coverage.counts["KV connector: requests aborted while their load was in flight"] == 1
    held = "KV connector: admissions while a transfer held a finished request's blocks"
    assert coverage.counts[held] == 1


def test_a_block_a_send_still_reads_is_not_handed_out() -> None:
    """A finished request whose KV a connector still sends (vLLM: `request_finished` returned
    True) is freed at `finished_sending`; a caller that frees it earlier is caught when one of
    its blocks is handed out before the send finished, and not after."""
    for report_first in (False, True):
        spec: Any = GROUP_FACTORIES["spec"](manager_config(num_blocks=6))
        request = Request("r", range(16))
        spec.get_computed_blocks(request)
        assert spec.allocate_slots(request, 16) == ([1, 2, 3, 4],)
        request.num_computed_tokens = 16
        spec.manager.external_send_started(request)
        if report_first:
            spec.manager.external_send_finished(request)
        spec.free(request)  # the caller's mistake unless the send was reported finished
        other = Request("s", range(100, 120))
        spec.get_computed_blocks(other)
        if report_first:
            assert spec.allocate_slots(other, 20) is not None
            spec.check_invariants()
        else:
            with pytest.raises(InvariantViolation, match=r"request 'r''s send still reads it"):
                spec.allocate_slots(other, 20)


def test_the_campaign_client_frees_a_sending_request_when_the_send_finishes() -> None:
    """A Finish with `delay_free` keeps the request's blocks until the next step (the
    connector's `finished_sending`), as vLLM 0.33's scheduler does."""
    coverage = Coverage()
    client = connector_client(coverage)
    client.execute(Arrive(tuple(range(16)), -1, 0, False, None, (), None, False))
    client.execute(Admit(0, 0, 0))
    client.execute(Finish(0, True))
    assert [live.record.request_id for live in client.sending] == ["req-1"]
    assert client.spec.held("req-1") is not None
    client.execute(Step(0, 0, (), 0, 0, 0))
    assert client.sending == [] and client.spec.held("req-1") is None
    client.finish_run()
    assert coverage.counts["KV connector: frees delayed while a send read the blocks"] == 1
