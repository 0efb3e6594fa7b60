"""The engine's scheduler on pagedkv's manager, without a model: exact decisions on tiny pools.

A stand-in model samples token `100 + number of outputs so far`; every step ends with the
scheduler's and the manager's invariant checks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from pagedkv import FullAttentionSpec, KVCacheManager, uniform_kv_cache_config
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine_request import EngineRequest, FinishReason, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.vocab.errors import InvalidArgumentError, InvariantViolation, RequestError


def make(
    *,
    num_blocks: int = 5,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 32,
    reserve_full_sequence: bool = True,
) -> Scheduler:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        reserve_full_sequence=reserve_full_sequence,
    )
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32")
    manager = KVCacheManager(
        uniform_kv_cache_config(spec, num_blocks), max_model_len, debug_invariants=1
    )
    return Scheduler(config, manager)


def request(name: str, prompt: list[int], max_tokens: int, **kwargs: Any) -> EngineRequest:
    return EngineRequest.from_prompt(name, prompt, max_tokens, **kwargs)


def next_token(item: EngineRequest) -> int:
    return 100 + len(item.output_token_ids)


def step(
    scheduler: Scheduler, token: Callable[[EngineRequest], int] = next_token
) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {c.item.request_id: token(c.item) for c in output.scheduled if c.samples}
    scheduler.update_from_output(output, sampled)
    scheduler.check_invariants()
    return output


def scheduled(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.item.request_id, c.num_computed_tokens, c.num_tokens) for c in output.scheduled]


def test_preemption_takes_the_newest_running_request_and_puts_it_first_in_line() -> None:
    scheduler = make(num_blocks=5)  # 4 usable blocks of 4 tokens
    a = request("a", [1, 2, 3, 4, 5, 6], 8)
    b = request("b", [7, 8, 9, 10, 11, 12], 8)
    c = request("c", [13], 1)
    for item in (a, b, c):
        scheduler.add_request(item)
    first = step(scheduler)
    assert scheduled(first) == [("a", 0, 6), ("b", 0, 6)]  # c does not fit: 4 blocks in use
    assert step(scheduler).preempted == []  # tokens 7 of a and b fit in their second blocks
    assert step(scheduler).preempted == []  # tokens 8 too
    third = step(scheduler)  # a's token 9 needs a third block: b, the newest, makes room
    assert third.preempted == [b]
    assert scheduled(third) == [("a", 8, 1)]
    assert third.num_admitted == 0  # nobody is admitted in a step that preempted
    assert list(scheduler.waiting) == [b, c]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert b.request.num_computed_tokens == 0
    assert scheduler.manager.get_block_ids("b") == ([],)
    assert list(b.output_token_ids) == [100, 101, 102]  # kept: recomputed, not regenerated


def test_the_newest_request_preempts_itself_when_nothing_is_left_to_take() -> None:
    scheduler = make(num_blocks=5)
    a = request("a", [1, 2, 3, 4, 5, 6, 7], 8)
    b = request("b", [8, 9, 10, 11, 12, 13, 14, 15], 8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # a holds 2 blocks (7 tokens), b 2 blocks (8 tokens, full)
    output = step(scheduler)  # a's token 8 fits; b's token 9 needs a block: b preempts itself
    assert output.preempted == [b]
    assert scheduled(output) == [("a", 7, 1)]
    assert scheduler.running == [a]


def test_a_preempted_request_is_recomputed_with_its_outputs_and_hits_its_own_blocks() -> None:
    scheduler = make(num_blocks=6)  # 5 usable: a and b hold 2 each, a's third takes the last
    a = request("a", [1, 2, 3, 4, 5, 6], 8)
    b = request("b", [7, 8, 9, 10, 11, 12], 8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    while not b.num_preemptions:
        step(scheduler)
    while b.status is RequestStatus.WAITING:
        output = step(scheduler)
    readmitted = [chunk for chunk in output.scheduled if chunk.item is b]
    # b was preempted with 6 prompt + 3 output tokens and its blocks went back tail first, so
    # a's fourth block evicted b's second; b's first (tokens 0-3) stayed cached: b recomputes
    # 4-8, in its old second block and a's third (cached when a finished: a second eviction).
    assert scheduler.evictions.num_evictions == 2
    assert scheduler.manager.get_block_ids("b") == ([3, 4, 5],)
    assert [(c.num_computed_tokens, c.num_tokens) for c in readmitted] == [(4, 5)]
    assert readmitted[0].samples and not readmitted[0].is_decode
    assert b.request.num_tokens == 10  # the 9 recomputed tokens and the one sampled after them


def test_chunked_prefill_spends_the_budget_and_samples_on_the_last_chunk_only() -> None:
    scheduler = make(num_blocks=9, budget=4)
    a = request("a", list(range(10)), 2)
    scheduler.add_request(a)
    chunks = [scheduled(step(scheduler)) for _ in range(4)]
    assert chunks == [[("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)], [("a", 10, 1)]]
    assert a.status is RequestStatus.FINISHED
    assert list(a.output_token_ids) == [100, 101]


def test_the_budget_is_shared_running_requests_first() -> None:
    scheduler = make(num_blocks=9, budget=5)
    a = request("a", [1, 2, 3], 4)
    b = request("b", [4, 5, 6, 7, 8, 9], 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert scheduled(step(scheduler)) == [("a", 0, 3), ("b", 0, 2)]
    assert scheduled(step(scheduler)) == [("a", 3, 1), ("b", 2, 4)]
    second = step(scheduler)
    assert scheduled(second) == [("a", 4, 1), ("b", 6, 1)]
    assert [c.is_decode for c in second.scheduled] == [True, True]


def test_admission_looks_the_prefix_cache_up() -> None:
    scheduler = make(num_blocks=9)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    a = request("a", [*system, 9], 2)
    b = request("b", [*system, 10, 11], 2, arrival_step=1)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    output = step(scheduler)
    assert scheduled(output) == [("a", 9, 1), ("b", 8, 2)]  # b's two system blocks were hits
    assert scheduler.stats.num_hit_tokens == 8
    assert scheduler.stats.num_lookup_tokens == 9 + 10
    assert scheduler.stats.prefix_hit_rate == pytest.approx(8 / 19)


def test_max_num_seqs_caps_the_running_requests() -> None:
    scheduler = make(num_blocks=9, max_num_seqs=2)
    items = [request(name, [index], 3) for index, name in enumerate("abc")]
    for item in items:
        scheduler.add_request(item)
    assert [c.item.request_id for c in step(scheduler).scheduled] == ["a", "b"]
    assert list(scheduler.waiting) == [items[2]]


def test_finishing_frees_the_blocks_and_drops_the_hashes() -> None:
    scheduler = make(num_blocks=9)
    a = request("a", [1, 2, 3, 4, 5], 2)
    b = request("b", [6, 7, 8, 9, 10], 5, stop_token_ids=[101])
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    step(scheduler)
    assert a.finish_reason is FinishReason.LENGTH and list(a.output_token_ids) == [100, 101]
    assert b.finish_reason is FinishReason.STOP and list(b.output_token_ids) == [100, 101]
    manager = scheduler.manager
    (group,) = manager.coordinator.single_type_managers
    assert not group.req_to_blocks and not manager.req_to_block_hashes
    assert scheduler.stats.num_finished == 2 and not scheduler.has_unfinished_requests
    assert manager.block_pool.get_num_free_blocks() == 8
    scheduler.add_request(request("a", [1], 1))  # a finished request's id may be reused


def test_requests_that_could_never_finish_are_refused_at_the_door() -> None:
    scheduler = make(num_blocks=5, max_model_len=20)
    with pytest.raises(RequestError, match="must not exceed max_model_len"):
        scheduler.add_request(request("long", [1] * 15, 6))
    with pytest.raises(RequestError, match="must fit in the pool on its own"):
        scheduler.add_request(request("big", [1] * 15, 2))  # 17 tokens: 5 blocks of 4, 4 usable
    scheduler.add_request(request("ok", [1] * 14, 2))
    with pytest.raises(RequestError, match="already in use by an unfinished request"):
        scheduler.add_request(request("ok", [2], 1))
    started = request("started", [1, 2], 2)
    started.request.append_output_token_ids(5)
    with pytest.raises(RequestError, match="only new requests"):
        scheduler.add_request(started)
    assert [item.request_id for item in scheduler.waiting] == ["ok"]


def test_a_missing_sampled_token_is_refused_and_changes_nothing() -> None:
    scheduler = make()
    a = request("a", [1, 2], 2)
    scheduler.add_request(a)
    output = scheduler.schedule()
    with pytest.raises(InvalidArgumentError, match=r"no sampled token for requests \['a'\]"):
        scheduler.update_from_output(output, {})
    assert a.request.num_computed_tokens == 0 and not a.output_token_ids


def _run_the_waiting_one(scheduler: Scheduler) -> None:
    item = scheduler.waiting.popleft()
    item.status = RequestStatus.RUNNING
    scheduler.running.append(item)


@pytest.mark.parametrize(
    ("corrupt", "invariant"),
    [
        (
            lambda s: s.waiting.append(s.running[0]),
            "every live request is either running or waiting, once",
        ),
        (lambda s: s.live_request_ids.add("ghost"), "every live request is either running"),
        (_run_the_waiting_one, "at most max_num_seqs requests run"),
        (
            lambda s: setattr(s.waiting[0].request, "num_computed_tokens", 1),
            "a waiting request has status WAITING and nothing computed",
        ),
        (
            lambda s: setattr(s.running[0].request, "num_computed_tokens", 12),
            "a running request has its computed tokens in its blocks",
        ),
        (
            lambda s: setattr(s.running[0], "status", RequestStatus.FINISHED),
            "a running request has its computed tokens in its blocks",
        ),
    ],
)
def test_check_invariants_names_what_broke(
    corrupt: Callable[[Scheduler], None], invariant: str
) -> None:
    scheduler = make(max_num_seqs=1)
    scheduler.add_request(request("a", [1, 2, 3, 4, 5], 4))
    scheduler.add_request(request("b", [6], 4))
    step(scheduler)
    corrupt(scheduler)
    with pytest.raises(InvariantViolation, match=invariant):
        scheduler.check_invariants()


def test_a_waiting_request_that_holds_blocks_breaks_an_invariant() -> None:
    scheduler = make()
    a = request("a", [1, 2, 3, 4, 5], 4)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.running.remove(a)  # forgotten by the scheduler, still holding its blocks
    a.status = RequestStatus.WAITING
    a.request.num_computed_tokens = 0
    scheduler.waiting.append(a)
    with pytest.raises(InvariantViolation, match="a waiting request holds no blocks"):
        scheduler.check_invariants()


def test_the_eviction_count_equals_the_pools_evictions_on_a_busy_random_run() -> None:
    """Evictions counted through the manager's public state match the pool's own, observed as
    cached block hashes that an allocation replaced."""
    rng = random.Random(7)
    scheduler = make(num_blocks=12, budget=12, max_num_seqs=4, max_model_len=40)
    manager = scheduler.manager
    observed = 0
    allocate = manager.allocate_slots

    def watched(*args: Any, **kwargs: Any) -> Any:
        nonlocal observed
        before = {b.block_id: b.block_hash for b in manager.block_pool.blocks if b.block_hash}
        result = allocate(*args, **kwargs)
        after = manager.block_pool.blocks
        observed += sum(1 for i, h in before.items() if after[i].block_hash != h)
        return result

    manager.allocate_slots = watched  # type: ignore[method-assign]
    prefixes = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    for index in range(40):
        prompt = rng.choice(prefixes)[: rng.randint(1, 8)] + [rng.randrange(3)] * rng.randint(1, 9)
        scheduler.add_request(request(f"r{index}", prompt, rng.randint(1, 12)))
    while scheduler.has_unfinished_requests:
        step(scheduler, lambda item: rng.randrange(3))
    assert scheduler.stats.num_preemptions > 0
    assert observed > 0
    assert scheduler.evictions.num_evictions == observed


def test_engine_config_and_requests_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="block_size must be a power of two"):
        EngineConfig(num_blocks=8, block_size=12)
    with pytest.raises(InvalidArgumentError, match=r"num_blocks must be an int >= 2"):
        EngineConfig(num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"max_num_batched_tokens must be an int >= 1"):
        EngineConfig(num_blocks=8, max_num_batched_tokens=0)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be an int >= 1"):
        request("a", [1], 0)
    with pytest.raises(InvalidArgumentError, match="at least 1 token"):
        request("a", [], 1)
    spec = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float32")
    manager = KVCacheManager(uniform_kv_cache_config(spec, 9), 32)
    with pytest.raises(InvalidArgumentError, match="the manager has 9 blocks of 8 tokens"):
        Scheduler(EngineConfig(num_blocks=9, block_size=4), manager)


def make_hybrid(*, num_blocks: int = 12, budget: int = 64) -> Scheduler:
    """Two KV cache groups over one pool: a sliding window of 4 tokens and full attention,
    blocks of 2 tokens."""
    from pagedkv.vocab.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float32")
    window = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=4
    )
    tensor = KVCacheTensor(full.page_size_bytes * num_blocks, ["window", "full"])
    kv_cache_config = KVCacheConfig(
        num_blocks,
        {"window": tensor, "full": tensor},
        [KVCacheGroupSpec(["window"], window), KVCacheGroupSpec(["full"], full)],
    )
    config = EngineConfig(
        num_blocks=num_blocks, block_size=2, max_num_batched_tokens=budget, max_model_len=32
    )
    manager = KVCacheManager(kv_cache_config, 32, debug_invariants=1)
    return Scheduler(config, manager)


def test_a_hybrid_manager_gives_each_group_its_blocks_and_the_window_drops_its_own() -> None:
    scheduler = make_hybrid(num_blocks=14)  # 13 usable: a needs 6 blocks in each group
    a = request("a", list(range(8)), 4)
    scheduler.add_request(a)
    assert scheduled(step(scheduler)) == [("a", 0, 8)]
    manager = scheduler.manager
    assert manager.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert scheduled(step(scheduler)) == [("a", 8, 1)]
    # Token 8 reads tokens 5-8: the window's blocks 0 and 1 (tokens 0-3) are nulled and freed.
    window, full = manager.get_block_ids("a")
    assert window[:2] == [0, 0] and 0 not in full
    assert len(window) == len(full) == 5
    while a.status is not RequestStatus.FINISHED:
        step(scheduler)
    assert list(a.output_token_ids) == [100, 101, 102, 103]
    assert scheduler.evictions.num_evictions == 0  # the pool never ran out


def test_a_hybrid_request_must_fit_with_every_groups_blocks() -> None:
    scheduler = make_hybrid(num_blocks=12, budget=4)  # 11 usable blocks
    # 12 tokens: 6 blocks of full attention and at most cdiv(3 + 4, 2) + 1 = 5 of the window.
    scheduler.add_request(request("fits", list(range(8)), 4))
    with pytest.raises(
        RequestError,
        match=r"a request must fit in the pool on its own \(14 tokens need 12 blocks of 2 in "
        r"its 2 KV cache groups together, the pool has 11\)",
    ):
        scheduler.add_request(request("big", list(range(10)), 4))


@pytest.mark.parametrize("reserve", [True, False])
def test_an_admission_waits_until_its_whole_prompt_fits_by_default(reserve: bool) -> None:
    """4 usable blocks, a budget of 4 tokens a step. `a` (3 tokens) takes one block and 3 of
    the budget; `b` (13 tokens: 4 blocks) could take its first token's block at once. vLLM
    0.33's full-sequence gate (the default) keeps it waiting until `a` finishes and frees its
    block; without the gate its first chunk is admitted beside `a`."""
    scheduler = make(budget=4, max_model_len=16, reserve_full_sequence=reserve)
    a = request("a", [1, 2, 3], 2)
    b = request("b", list(range(10, 23)), 1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = step(scheduler)
    if not reserve:
        assert scheduled(first) == [("a", 0, 3), ("b", 0, 1)]
        return
    assert scheduled(first) == [("a", 0, 3)] and list(scheduler.waiting) == [b]
    while a.status is not RequestStatus.FINISHED:
        assert b.status is RequestStatus.WAITING
        step(scheduler)
    assert scheduled(step(scheduler)) == [("b", 0, 4)]  # a's block freed: 4 blocks for b


def test_reserve_full_sequence_is_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="reserve_full_sequence"):
        EngineConfig(num_blocks=5, reserve_full_sequence=1)  # type: ignore[arg-type]
