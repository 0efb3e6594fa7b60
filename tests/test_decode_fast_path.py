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

import pytest
from manager_fixtures import MANAGER_FACTORIES, manager_config

from pagedkv import FullAttentionSpec, InvariantViolation, KVCacheManager, Request, RequestError
from pagedkv import uniform_kv_cache_config as config_of
from pagedkv.semantics import VLLM_0_8_5

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
    assert [block.block_id for block in manager.allocate_slots(request, 5) or []] == [1, 2]
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
