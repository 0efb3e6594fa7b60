"""allocate_slots' admission fast path (one full-attention group, caching on) answers as the
full path would: a new request with a lookup's hits.

The fast path acts only once every check of the full path is seen to pass but the hits' own
(which raise as the full path's would); anything else falls through. Each scenario below puts a
new request one step away from an edge of those checks (the tokens past the request's, drafts,
lookahead, max_model_len, a pool too small, hits out of place, another Request with the id, vLLM
semantics) and makes the same calls on the spec and on the implementation: the same result or
the same error and message, and the same state after.
"""

from __future__ import annotations

import itertools

import pytest
from manager_fixtures import MANAGER_FACTORIES, manager_config

import pagedkv
from pagedkv import FullAttentionSpec, KVCacheManager, Request
from pagedkv import uniform_kv_cache_config as config_of
from pagedkv.vocab.semantics import VLLM_0_8_5, VLLM_0_33

CONFIGS = {
    "full attention": {},
    "small pool": {"num_blocks": 6},
    "short max_model_len": {"max_model_len": 16},
    "vLLM 0.8.5 semantics": {"semantics": VLLM_0_8_5},
    "vLLM 0.33 semantics": {"semantics": VLLM_0_33},
}
HIT_EDITS = ("as found", "reversed", "one dropped", "none")


def _outcome(config: dict[str, object], step: tuple[int, int, int, int, str, bool]) -> list[object]:
    """Each side's answer to one admission, and its state after."""
    prompt_len, num_tokens_delta, lookahead, num_drafts, edit, impostor = step
    answers = []
    for side in ("spec", "impl"):
        manager = MANAGER_FACTORIES[side](manager_config(**config))  # type: ignore[arg-type]
        holder = Request("holder", range(12))
        assert manager.allocate_slots(holder, 12) is not None  # blocks 0..2 cached
        request = Request("r", list(range(prompt_len)))
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        group = list(hits)
        if edit == "reversed":
            group.reverse()
        elif edit == "one dropped":
            group = group[1:]
        elif edit == "none":
            group = []
        if num_drafts:
            request.append_output_token_ids([5] * num_drafts)
            request.spec_token_ids = [5] * num_drafts
        num_tokens = request.num_tokens - num_hit_tokens + num_tokens_delta
        if impostor:
            request = Request("r", list(range(prompt_len)))  # another object, the same id
            manager.get_computed_blocks(Request("other", range(3)))
        try:
            result: object = manager.allocate_slots(request, num_tokens, group, lookahead)
        except Exception as error:  # the outcome is the point: class and message compared
            result = (type(error), str(error))
        answers.append((result, manager.snapshot()))
    return answers


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_admission_near_the_fast_paths_edges_answers_as_the_spec(name: str) -> None:
    steps = itertools.product(
        (5, 8, 13, 16),  # prompts: a hit of 1 or 2 blocks, or all 3 and more
        (-1, 0, 1),  # num_tokens one short of the prompt, exact, one past (refused)
        (0, 1, 4),  # lookahead
        (0, 2),  # drafts after the prompt
        HIT_EDITS,
        (False, True),  # another Request object with the id
    )
    for step in steps:
        spec, impl = _outcome(CONFIGS[name], step)  # type: ignore[misc]
        assert impl == spec, step


def test_an_admission_with_hits_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new request's admission with a lookup's hits never reaches the full path, and leaves
    the caller's hit list as it was."""
    if pagedkv.COMPILED:
        pytest.skip("a compiled KVCacheManager's methods cannot be patched")
    full_path_calls = []
    full_path = KVCacheManager._allocate_slots

    def counted(self: KVCacheManager, *args: object) -> object:
        full_path_calls.append(args[1])
        return full_path(self, *args)

    monkeypatch.setattr(KVCacheManager, "_allocate_slots", counted)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    manager = KVCacheManager(config_of(spec, 10), 64)
    assert manager.allocate_slots(Request("holder", range(12)), 12) is not None
    assert full_path_calls == [12]  # no hits: the full path
    request = Request("r", range(14))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    given = list(hits[0])
    new = manager.allocate_slots(request, 14 - num_hit_tokens, hits)
    assert full_path_calls == [12]
    assert num_hit_tokens == 12 and new is not None
    assert [block.block_id for block in new[0]] == [4]
    assert hits[0] == given  # not extended with the new block
    assert manager.get_block_ids("r") == ([1, 2, 3, 4],)
    manager.check_invariants()
