"""The attention-truth invariant: ghost KV content, the checks, the rules it fixed, known bugs.

The spec keeps what every block holds (`pagedkv.spec.ghost_kv`) and checks that every position a
request reads holds its own KV (`pagedkv.spec.attention_truth`). These tests pin the rules the
invariant found wrong (EAGLE with a sliding window, on one group and several; a multimodal input
keyed without its place), on the spec and the implementation alike; the invariant's reports word
for word; and the known bugs it names under vLLM 0.8.5's semantics instead of failing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedkv import KVCacheManager
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config
from pagedkv.spec.attention_truth import ATTENTION_TRUTH, AttentionTruth
from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.known_bugs import FATAL_ENV, KNOWN_BUGS, known_bugs
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.single_type import FullAttention, SlidingWindow
from pagedkv.vocab.hashes import MultimodalKey
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.request import PlaceholderRange, Request
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5, VLLM_0_33
from tests.manager_fixtures import invariant_report

WINDOW = SlidingWindowSpec(
    block_size=16, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=32
)
FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
FULL4 = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
FOUR_BLOCKS = [token for token in range(4) for _ in range(16)]


def _full() -> FullAttention:
    """What full attention reads (a per-type manager of block size 2, over a pool of its own)."""
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float32")
    return FullAttention(spec, SpecBlockPool(4, True), 0)


def _window(sliding_window: int) -> SlidingWindow:
    """What a sliding window of block size 2 reads."""
    spec = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=sliding_window
    )
    return SlidingWindow(spec, SpecBlockPool(4, True), 0)


def _ids(blocks: Sequence[object]) -> list[int]:
    return [block if isinstance(block, int) else block.block_id for block in blocks]  # type: ignore[attr-defined]


def _eagle_window_hit(
    manager: KVCacheManager | SpecKVCacheManager,
) -> tuple[list[int], int]:
    """The issue's example: a request computes 71 tokens under a 32-token window with EAGLE;
    another with the same four first blocks looks up."""
    first = Request("a", [*FOUR_BLOCKS, *[4] * 7])
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 71, hits)
    first.num_computed_tokens = 71
    hits, num_tokens = manager.get_computed_blocks(Request("b", [*FOUR_BLOCKS, *[6] * 5]))
    return _ids(hits[0]), num_tokens


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_an_eagle_window_hit_keeps_the_whole_window_of_its_next_token(cls: type) -> None:
    """Token 48 reads tokens 17..47: blocks 1 and 2 must be cached blocks, not the null block
    (vLLM 0.33's rule: the hit of a window one block wider, less its last block)."""
    manager = cls(uniform_kv_cache_config(WINDOW, num_blocks=20), 8192, use_eagle=True)
    assert _eagle_window_hit(manager) == ([0, 2, 3], 48)


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_vllm_0_8_5_keeps_its_eagle_window_hit_one_block_short(cls: type) -> None:
    manager = cls(
        uniform_kv_cache_config(WINDOW, num_blocks=20), 8192, use_eagle=True, semantics=VLLM_0_8_5
    )
    assert _eagle_window_hit(manager) == ([0, 0, 3], 48)


def test_the_spec_names_vllm_0_8_5s_eagle_window_hit_a_known_bug() -> None:
    manager = SpecKVCacheManager(
        uniform_kv_cache_config(WINDOW, num_blocks=20), 8192, use_eagle=True, semantics=VLLM_0_8_5
    )
    _eagle_window_hit(manager)
    title = KNOWN_BUGS["eagle_window_hit_one_short"].title
    assert manager.truth.take_checks()[f"states of a known bug: {title}"] == 1
    assert manager.truth.tainted == {"b": title}


def test_a_known_bug_fails_like_any_untruth_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FATAL_ENV, "fail")
    manager = SpecKVCacheManager(
        uniform_kv_cache_config(WINDOW, num_blocks=20), 8192, use_eagle=True, semantics=VLLM_0_8_5
    )
    invariant, detail = invariant_report(lambda: _eagle_window_hit(manager))
    assert invariant == KNOWN_BUGS["eagle_window_hit_one_short"].title
    assert detail == (
        "a prefix-cache hit of request 'b': group 0 reads position 17, held by the null block; "
        "the request's own is group 0's KV of token 1 at position 17 after 17 tokens ending "
        "[0, 0, 0, 0, 0, 1]"
    )


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_an_eagle_hit_over_several_groups_keeps_every_window_whole(cls: type) -> None:
    """A full-attention group and a 32-token window: the window group's hit is [null, 7, 8]
    (vLLM 0.33's coordinator), never [null, null, 8]."""
    manager = cls(hybrid_kv_cache_config([FULL, WINDOW], 40), 8192, use_eagle=True)
    first = Request("a", [*FOUR_BLOCKS, *[4] * 7])
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 71, hits)
    first.num_computed_tokens = 71
    hits, num_tokens = manager.get_computed_blocks(Request("b", [*FOUR_BLOCKS, *[6] * 5]))
    assert ([_ids(group) for group in hits], num_tokens) == ([[1, 2, 3], [0, 7, 8]], 48)


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_an_eagle_hit_over_several_groups_may_use_the_last_full_block(cls: type) -> None:
    """A prompt of whole blocks: EAGLE matches one block past the lookup (its last full block)
    and drops it, so the hit is one block longer than a lookup without EAGLE less one."""
    manager = cls(hybrid_kv_cache_config([FULL, WINDOW], 40), 8192, use_eagle=True)
    first = Request("a", [*FOUR_BLOCKS, 4])
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 65, hits)
    first.num_computed_tokens = 65
    hits, num_tokens = manager.get_computed_blocks(Request("b", FOUR_BLOCKS))
    assert ([_ids(group) for group in hits], num_tokens) == ([[1, 2, 3], [0, 7, 8]], 48)


def _image_at(request_id: str, offset: int) -> Request:
    return Request(
        request_id,
        [5] * 8,
        mm_positions=[PlaceholderRange(offset, 2)],
        mm_hashes=["img"],
    )


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_the_same_image_elsewhere_in_a_block_is_no_hit(cls: type) -> None:
    """Blocks of the same tokens with the same image at another place hold other KV."""
    manager = cls(uniform_kv_cache_config(FULL4, num_blocks=10), 64)
    first = _image_at("a", 1)
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 8, hits)
    assert manager.get_computed_blocks(_image_at("b", 2)) == (([],), 0)
    hits, num_tokens = manager.get_computed_blocks(_image_at("c", 1))
    assert (_ids(hits[0]), num_tokens) == ([1], 4)


def test_a_multimodal_key_names_the_input_its_place_and_its_length() -> None:
    manager = SpecKVCacheManager(uniform_kv_cache_config(FULL4, num_blocks=10), 64)
    keys = [block_hash.extra_keys for block_hash in manager._chain(_image_at("a", 3))]
    assert keys == [(MultimodalKey("img", 3, 2),), (MultimodalKey("img", -1, 2),)]


@pytest.mark.parametrize("cls", [SpecKVCacheManager, KVCacheManager])
def test_vllm_0_8_5_hits_the_same_image_elsewhere(cls: type) -> None:
    manager = cls(uniform_kv_cache_config(FULL4, num_blocks=10), 64, semantics=VLLM_0_8_5)
    first = _image_at("a", 1)
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 8, hits)
    hits, num_tokens = manager.get_computed_blocks(_image_at("b", 2))
    assert (_ids(hits[0]), num_tokens) == ([1], 4)  # the KV of another placement of the image


def test_the_spec_names_that_hit_a_known_bug_of_vllm_0_8_5() -> None:
    manager = SpecKVCacheManager(
        uniform_kv_cache_config(FULL4, num_blocks=10), 64, semantics=VLLM_0_8_5
    )
    first = _image_at("a", 1)
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 8, hits)
    manager.get_computed_blocks(_image_at("b", 2))
    title = KNOWN_BUGS["mm_keys_without_position"].title
    assert manager.truth.take_checks()[f"states of a known bug: {title}"] == 1


# -- the invariant itself, its reports word for word --------------------------------------------


def _computed(truth: AttentionTruth, request: Request, table: list[int]) -> None:
    """`request`'s tokens computed into `table` (fresh blocks) in group 0."""
    truth.handed_out(table)
    truth.computed(request, (table,), 0, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def _report(truth: AttentionTruth, request: Request, table: list[int]) -> str:
    invariant, detail = invariant_report(lambda: truth.check_table(request, (table,)))
    assert invariant == ATTENTION_TRUTH
    return detail


def test_a_request_reads_its_own_kv_from_its_blocks() -> None:
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3, 4])
    _computed(truth, request, [1, 2])
    truth.check_table(request, ([1, 2],))  # no violation
    assert truth.take_checks()["attention truth: positions read checked"] == 4


def test_the_null_block_holds_no_ones_kv() -> None:
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3, 4])
    _computed(truth, request, [1, 2])
    assert _report(truth, request, [0, 2]) == (
        "the block table of request 'r': group 0 reads position 0, held by the null block; the "
        "request's own is group 0's KV of token 1 at position 0 after tokens []"
    )


def test_a_block_handed_out_again_holds_nothing_of_its_old_kv() -> None:
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3, 4])
    _computed(truth, request, [1, 2])
    truth.handed_out([2])
    assert _report(truth, request, [1, 2]) == (
        "the block table of request 'r': group 0 reads position 2, held by block 2, which holds "
        "nothing (no KV written since the block was handed out); the request's own is group "
        "0's KV of token 3 at position 2 after tokens [1, 2]"
    )


def test_another_prefixs_kv_is_not_the_requests_own() -> None:
    truth = AttentionTruth((_full(),), 2)
    _computed(truth, Request("s", [1, 9, 3, 4], lora_id=3, cache_salt="tenant"), [3, 4])
    request = Request("r", [1, 2, 3, 4, 5], lora_id=3, cache_salt="tenant")
    invariant, detail = invariant_report(
        lambda: truth.check_hit(request, ([3, 4],), 4, eagle=False)
    )
    assert (invariant, detail) == (
        ATTENTION_TRUTH,
        "a prefix-cache hit of request 'r': group 0 reads position 1, held by block 3, which "
        "holds group 0's KV of token 9 at position 1 after tokens [1], LoRA 3, a cache salt; "
        "the request's own is group 0's KV of token 2 at position 1 after tokens [1], LoRA 3, "
        "a cache salt",
    )


def test_another_tenants_kv_of_the_same_tokens_is_not_the_requests_own() -> None:
    truth = AttentionTruth((_full(),), 2)
    _computed(truth, Request("s", [1, 2], cache_salt="tenant-1"), [1])
    request = Request("r", [1, 2, 3], cache_salt="tenant-2")
    invariant, _ = invariant_report(lambda: truth.check_hit(request, ([1],), 2, eagle=False))
    assert invariant == ATTENTION_TRUTH


def test_tokens_claimed_computed_but_never_scheduled_are_the_callers_claim() -> None:
    """A caller that counts tokens no step scheduled: they were computed elsewhere, into the
    request's blocks (not a decision of the manager's), and counted as such."""
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3])
    truth.handed_out([1, 2])
    truth.computed(request, ([1, 2],), 0, 2)
    request.num_computed_tokens = 3
    truth.check_table(request, ([1, 2],))
    checks = truth.take_checks()
    assert checks["attention truth: tokens computed outside the manager's steps"] == 1
    assert truth.ghost.holds(2, 0) == (0, truth.ghost.histories_of(request)[2])


def test_a_position_past_the_table_is_held_by_no_block() -> None:
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3, 4])
    _computed(truth, request, [1, 2])
    assert _report(truth, request, [1]) == (
        "the block table of request 'r': group 0 reads position 2, held by no block (the table "
        "ends before it); the request's own is group 0's KV of token 3 at position 2 after "
        "tokens [1, 2]"
    )


def test_a_window_reads_only_its_last_tokens_and_a_chunk_only_its_own() -> None:
    window = AttentionTruth((_window(3),), 2)
    request = Request("r", [1, 2, 3, 4, 5])
    _computed(window, request, [1, 2, 3])
    window.check_table(request, ([0, 2, 3],))  # token 5 reads positions 3 and 4 only
    assert "reads position 3, held by the null block" in _report(window, request, [0, 0, 3])


def test_draft_tokens_are_computed_as_the_drafts_they_are() -> None:
    """A step's drafts are computed into their slots; accepted, they are the request's own."""
    truth = AttentionTruth((_full(),), 2)
    request = Request("r", [1, 2, 3])
    truth.handed_out([1, 2])
    request.spec_token_ids = [7]
    truth.computed(request, ([1, 2],), 0, 4)
    request.spec_token_ids = []
    request.append_output_token_ids([7, 8])
    request.num_computed_tokens = 4
    truth.check_table(request, ([1, 2],))  # the accepted draft's KV is the request's own


def test_the_spec_checks_every_running_request_at_every_full_check() -> None:
    manager = SpecKVCacheManager(uniform_kv_cache_config(FULL4, num_blocks=10), 64)
    request = Request("r", [1, 2, 3, 4, 5])
    manager.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    manager.check_invariants()
    manager.truth.handed_out([1])  # the ghost of a block the request holds, lost
    invariant, _ = invariant_report(manager.check_invariants)
    assert invariant == ATTENTION_TRUTH


def test_a_tainted_request_poisons_what_it_computes_until_it_is_freed() -> None:
    manager = SpecKVCacheManager(
        uniform_kv_cache_config(WINDOW, num_blocks=20), 8192, use_eagle=True, semantics=VLLM_0_8_5
    )
    _eagle_window_hit(manager)
    reader = manager.requests["b"]
    hits, _ = manager.get_computed_blocks(reader)  # again: the same known bug's state
    manager.allocate_slots(reader, 21, hits)  # computes its blocks 3 and 4 poisoned
    title = KNOWN_BUGS["eagle_window_hit_one_short"].title
    new_block = manager.blocks["b"][0][3]
    held = manager.truth.ghost.holds(new_block, 0)
    assert held is not None
    assert manager.truth.ghost.histories.poisoned_by(held[1]) == title
    assert manager.truth.tainted == {"b": title}
    manager.free(reader)
    assert manager.truth.tainted == {}


def test_known_bugs_are_vllm_0_8_5s_switches_only() -> None:
    assert known_bugs(PAGEDKV) == ()
    assert known_bugs(VLLM_0_33) == ()
    assert known_bugs(VLLM_0_8_5) == tuple(KNOWN_BUGS.values())
