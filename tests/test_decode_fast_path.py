"""allocate_slots' decode fast path takes exactly the steps the full path would leave unchanged.

The fast path returns [] for a running request's step that needs no block, completes none and
breaks no rule; everything else falls through to the full path. Each scenario below puts a
request one step away from every edge of that test (a token short of or past a block boundary,
drafts, lookahead, max_model_len, a refusal, a sliding-window skip, caching off, vLLM
semantics) and makes the same call on the spec and on the implementation: the same result or the
same error and message, and the same state after.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from manager_fixtures import MANAGER_FACTORIES, manager_config

import pagedkv
from pagedkv import FullAttentionSpec, InvariantViolation, KVCacheManager, Request, RequestError
from pagedkv import uniform_kv_cache_config as config_of
from pagedkv.vocab.semantics import VLLM_0_8_5

BLOCK_SIZE = 4
CONFIGS = {
    "full attention": {},
    "caching off": {"enable_caching": False},
    "sliding window": {"sliding_window": 6},
    "vLLM semantics": {"semantics": VLLM_0_8_5},
    "short max_model_len": {"max_model_len": 12},
}


def _outcome(config: dict[str, object], step: tuple[int, int, int, int, int]) -> object:
    """One side's answer to one step, and its state after, for both sides."""
    prompt_len, computed, num_tokens, lookahead, num_drafts = step
    answers = []
    for side in ("spec", "impl"):
        manager = MANAGER_FACTORIES[side](manager_config(**config))  # type: ignore[arg-type]
        request = Request("r", range(prompt_len))
        assert manager.allocate_slots(request, prompt_len) is not None
        request.num_computed_tokens = prompt_len
        request.append_output_token_ids([7, 8][:num_drafts] or [7])  # sampled (+ drafts)
        request.spec_token_ids = [8] * num_drafts
        request.num_computed_tokens = prompt_len + computed if computed > -2 else -1
        try:
            result: object = manager.allocate_slots(request, num_tokens, None, lookahead)
        except Exception as error:  # the outcome is the point: class and message compared
            result = (type(error), str(error))
        answers.append((result, manager.snapshot()))
    return answers


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_step_near_the_fast_paths_edges_answers_as_the_spec(name: str) -> None:
    steps = itertools.product(
        range(2, 10),  # prompt lengths around the block boundaries of 4 and 8
        (-1, 0, 1, -2),  # num_computed_tokens one short, exact, one past, negative (-2)
        (0, 1, 2, 3),  # num_tokens (0 is refused)
        (-1, 0, 1, 4),  # lookahead (-1 is refused)
        (0, 1, 2),  # drafts (more than num_tokens is refused)
    )
    for step in steps:
        spec, impl = _outcome(CONFIGS[name], step)  # type: ignore[misc]
        assert impl == spec, step


def test_a_step_inside_a_block_still_checks_invariants_when_asked() -> None:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(config_of(spec, 10), 64, debug_invariants=True)
    request = Request("r", range(5))
    assert manager.get_block_ids("r") == ([],)
    assert manager.allocate_slots(request, 5) is not None
    assert manager.get_block_ids("r") == ([1, 2],)
    request.num_computed_tokens = 5
    request.append_output_token_ids(7)
    manager.block_pool.blocks[2].ref_cnt += 1  # a corruption only the invariant check sees
    with pytest.raises(InvariantViolation, match="ref_cnt"):
        manager.allocate_slots(request, 1)


@pytest.mark.parametrize("side", sorted(MANAGER_FACTORIES))
def test_a_step_by_another_request_with_the_same_id_is_refused(side: str) -> None:
    manager = MANAGER_FACTORIES[side](manager_config())
    request = Request("r", range(5))
    assert manager.allocate_slots(request, 5) is not None
    impostor = Request("r", range(6))
    impostor.num_computed_tokens = 5
    with pytest.raises(RequestError, match="another Request object"):
        manager.allocate_slots(impostor, 1)


# -- the fill and new-block fast paths, step by step against the spec --------------------------

Step = tuple[str, int, int]  # (request, num_tokens, lookahead); num_tokens 0: free the request


def _drive(
    config: dict[str, object], requests: dict[str, dict[str, object]], script: list[Step]
) -> None:
    """Run `script` on the spec and the implementation side by side: each request is looked up
    on its first step and then advanced by the tokens it was given (its prompt, then sampled
    tokens); after every step both sides must answer alike and hold the same state (events
    included)."""
    events = bool(config.pop("events", False))
    sides = []
    for side in ("spec", "impl"):
        manager_kwargs: dict[str, object] = dict(config)
        made = manager_config(**manager_kwargs)  # type: ignore[arg-type]
        if events:
            made = replace(made, enable_kv_cache_events=True)
        manager = MANAGER_FACTORIES[side](made)
        live = {
            name: Request(
                name,
                [100 * index + i for i in range(int(kwargs["prompt"]))],
                **{key: value for key, value in kwargs.items() if key != "prompt"},
            )
            for index, (name, kwargs) in enumerate(requests.items())
        }
        sides.append((manager, live))
    for position, (name, num_tokens, lookahead) in enumerate(script):
        answers = []
        for manager, live in sides:
            request = live[name]
            answer: object
            if num_tokens == 0:
                manager.free(request)
                request.num_computed_tokens = 0
                answer = None
            else:
                hits: list[int] | None = None
                if name not in manager.snapshot().blocks:  # not running: look it up first
                    hits, num_hit_tokens = manager.get_computed_blocks(request)
                    request.num_computed_tokens = num_hit_tokens
                while request.num_tokens < request.num_computed_tokens + num_tokens:
                    request.append_output_token_ids(7)
                try:
                    answer = manager.allocate_slots(request, num_tokens, hits, lookahead)
                except Exception as error:  # refusals are compared: class and message
                    answer = (type(error), str(error))
                if isinstance(answer, list):
                    request.num_computed_tokens += num_tokens
            answers.append((answer, manager.snapshot(), manager.take_events()))
        assert answers[1] == answers[0], (position, script[position])


# A prompt of 12 tokens (3 blocks of 4), prefilled 2 tokens at a time with lookahead: later
# steps fill blocks whose hashes the lookup already stored, and cross into blocks the lookahead
# reserved.
CHUNKED_WITH_LOOKAHEAD = [("a", 2, 6)] + [("a", 2, 0)] * 9
# One request's cached blocks are freed; another's decode steps then take them from the free
# queue (evicting their hashes) until none is left (None), and fill blocks on the way.
EVICT_THEN_RUN_OUT = [("a", 8, 0), ("a", 0, 0), ("b", 4, 0)] + [("b", 1, 0)] * 12
SCRIPTS = {"chunked with lookahead": CHUNKED_WITH_LOOKAHEAD, "evict, run out": EVICT_THEN_RUN_OUT}
REQUEST_KINDS: dict[str, dict[str, object]] = {
    "plain": {},
    "LoRA": {"lora_id": 3},
    "salted": {"cache_salt": "tenant"},
}
FAST_PATH_CONFIGS = {**CONFIGS, "events": {"events": True}, "few blocks": {"num_blocks": 5}}


@pytest.mark.parametrize("kind", sorted(REQUEST_KINDS))
@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("name", sorted(FAST_PATH_CONFIGS))
def test_steps_that_fill_a_block_or_take_a_new_one_answer_as_the_spec(
    name: str, script: str, kind: str
) -> None:
    prompts = {"a": 12, "b": 4} if script == "chunked with lookahead" else {"a": 8, "b": 4}
    requests = {
        request: {"prompt": length, **REQUEST_KINDS[kind]} for request, length in prompts.items()
    }
    _drive(dict(FAST_PATH_CONFIGS[name]), requests, SCRIPTS[script])


def test_decode_steps_that_fill_or_open_a_block_take_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The full path runs for the prefill only: every later step of a plain request, inside a
    block, filling one or opening one, is answered by the fast path."""
    if pagedkv.COMPILED:
        pytest.skip("a compiled KVCacheManager's methods cannot be patched")
    full_path_calls = []
    full_path = KVCacheManager._allocate_slots

    def counted(self: KVCacheManager, *args: object) -> object:
        full_path_calls.append(args[1])
        return full_path(self, *args)

    monkeypatch.setattr(KVCacheManager, "_allocate_slots", counted)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(config_of(spec, 10), 64)
    request = Request("r", range(5))
    assert manager.allocate_slots(request, 5) is not None
    results = []
    for token in range(11):  # tokens 5..15: three fills, two new blocks, the rest inside
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(token)
        new = manager.allocate_slots(request, 1)
        assert new is not None
        (group,) = new
        results.append([block.block_id for block in group])
    assert full_path_calls == [5]
    assert results == [[], [], [], [3], [], [], [], [4], [], [], []]
    assert manager.coordinator.single_type_managers[0].num_cached_block["r"] == 4
    manager.check_invariants()
