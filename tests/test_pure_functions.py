"""The pure functions behind allocate_slots, the sliding window, multimodal keys and budgets.

Worked examples with exact values, then every small input: the CrossHair contracts
(`proofs/crosshair/contracts.py`) run concretely over exhaustive tiny domains, and each impl
function agrees with its spec twin there. CrossHair searches symbolically; this does not depend on
it finding anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from pagedkv import block_counts, block_hash
from pagedkv.planning import kv_cache_config
from pagedkv.single_type import chunked_local
from pagedkv.single_type import sliding_window as window
from pagedkv.spec import block_counts as spec_counts
from pagedkv.spec import block_hash as spec_hash
from pagedkv.spec.single_type import chunked_local as spec_chunk
from pagedkv.spec.single_type import sliding_window as spec_window
from pagedkv.vocab import kv_cache_interface
from pagedkv.vocab.hashes import BlockHashType, MultimodalKey
from pagedkv.vocab.request import PlaceholderRange, Request
from proofs.crosshair import contracts, pairs
from proofs.crosshair.runner import call_contract

# -- worked examples -------------------------------------------------------------------------


def test_a_decode_step_inside_the_last_block_needs_no_new_block() -> None:
    # 40 computed tokens in 3 blocks of 16, one token scheduled: still 3 blocks, 2 full.
    assert block_counts.num_required_blocks(40, 1, 0, 16) == 3
    assert block_counts.num_new_blocks(3, 3, 0) == 0
    assert block_counts.num_full_blocks(40, 1, 0, 16) == 2
    assert block_counts.fits(0, 0, 0)


def test_lookahead_and_speculative_tokens_count_for_slots_not_for_caching() -> None:
    # 15 computed + 3 scheduled (2 of them speculative) + 2 lookahead, blocks of 4.
    assert block_counts.num_required_blocks(15, 3, 2, 4) == 5
    assert block_counts.num_full_blocks(15, 3, 2, 4) == 4  # 16 real tokens
    assert block_counts.num_full_blocks(14, 3, 2, 4) == 3  # 15 real tokens


def test_free_hits_do_not_count_as_free_blocks() -> None:
    assert block_counts.fits(3, 5, 2)
    assert not block_counts.fits(4, 5, 2)
    assert block_counts.fits(-2, 1, 1)  # nothing to allocate always fits


def test_first_useful_block_is_the_block_holding_the_windows_first_token() -> None:
    # Window 4, blocks of 2, 10 computed: the next token (10) sees tokens 7..10; block 3 holds 7.
    assert window.first_useful_block(10, 4, 2) == 3
    assert window.first_useful_block(9, 4, 2) == 3  # sees 6..9: block 3 starts at 6
    assert window.first_useful_block(8, 4, 2) == 2
    assert window.first_useful_block(0, 4, 2) == -2  # nothing to skip yet


def test_a_window_of_w_tokens_needs_cdiv_w_minus_1_cached_blocks() -> None:
    assert window.num_window_blocks(8, 4) == 2
    assert window.num_window_blocks(9, 4) == 2
    assert window.num_window_blocks(10, 4) == 3
    assert window.num_window_blocks(1, 4) == 0


def test_scan_window_hit_looks_up_from_the_right_and_stops_at_the_first_long_run() -> None:
    cached = [True, False, True, True, False]
    looked_up: list[int] = []

    def lookup(position: int) -> str | None:
        looked_up.append(position)
        return f"b{position}" if cached[position] else None

    assert window.scan_window_hit(5, 2, lookup, "null") == ["null", "null", "b2", "b3"]
    assert looked_up == [4, 3, 2]


def test_scan_window_hit_without_a_long_run_keeps_the_run_from_position_0() -> None:
    cached = [True, True, False, True]
    hits = window.scan_window_hit(4, 3, lambda i: f"b{i}" if cached[i] else None, "null")
    assert hits == ["b0", "b1"]
    assert window.scan_window_hit(0, 3, lambda i: None, "null") == []


def test_scan_chunk_hit_scans_forward_from_the_chunk_start_of_the_longest_hit() -> None:
    """Chunks of 8 tokens, blocks of 4: a hit of 5 blocks would compute token 20, whose chunk
    starts at block 4; block 4 misses, but a hit of 4 (token 16: chunk start 4) needs none."""
    cached = [True, False, True, True, False]
    looked_up: list[int] = []

    def lookup(position: int) -> str | None:
        looked_up.append(position)
        return f"b{position}" if cached[position] else None

    assert chunked_local.scan_chunk_hit(5, 8, 4, lookup, "null") == ["null"] * 4
    assert looked_up == [4]
    looked_up.clear()
    assert chunked_local.scan_chunk_hit(4, 8, 4, lookup, "null") == ["null"] * 4
    assert chunked_local.scan_chunk_hit(3, 8, 4, lookup, "null") == ["null", "null", "b2"]
    assert looked_up == [2]


def test_scan_chunk_hit_falls_back_to_an_earlier_chunk() -> None:
    """Chunks of 6 tokens, blocks of 4: a hit of 2 blocks (token 8, chunk start token 6 in
    block 1) needs block 1; it misses, and a hit of 1 block (token 4, chunk 0) needs block 0."""
    cached = [True, False, True]
    hits = chunked_local.scan_chunk_hit(2, 6, 4, lambda i: f"b{i}" if cached[i] else None, "null")
    assert hits == ["b0"]
    assert chunked_local.scan_chunk_hit(0, 6, 4, lambda i: None, "null") == []
    assert chunked_local.chunk_start_block(8, 6, 4) == 1


def test_scan_chunk_hit_is_the_specs_longest_chunked_hit_on_every_small_input() -> None:
    compared = 0
    for block_size, chunk, length in itertools.product(range(1, 5), range(1, 13), range(8)):
        for cached in itertools.product((False, True), repeat=length):
            hashes = [BlockHashType(i, (i,)) for i in range(length)]
            spec = spec_chunk.chunked_local_hit(
                lambda h, c=cached: h.hash_value + 1 if c[h.hash_value] else None,
                hashes,
                chunk,
                block_size,
            )
            impl = chunked_local.scan_chunk_hit(
                length, chunk, block_size, lambda i, c=cached: i + 1 if c[i] else None, 0
            )
            assert impl == spec, (block_size, chunk, cached)
            compared += 1
    assert compared > 10_000


def test_the_chunk_start_is_the_specs_skip_count() -> None:
    for computed, chunk, b in itertools.product(range(40), range(1, 13), POSITIVE):
        expected = spec_chunk.chunked_local_skipped(computed, chunk, b)
        assert chunked_local.chunk_start_block(computed, chunk, b) == expected


def test_mm_inputs_in_block_and_where_the_next_scan_starts() -> None:
    ranges = [(1, 3), (4, 1), (8, 5)]  # tokens 1-3, 4, 8-12
    assert block_hash.mm_inputs_in_block(ranges, 0, 4, 0) == ([0], 1)
    assert block_hash.mm_inputs_in_block(ranges, 4, 8, 1) == ([1], 2)
    assert block_hash.mm_inputs_in_block(ranges, 8, 12, 2) == ([2], 2)  # continues past 12
    assert block_hash.mm_inputs_in_block(ranges, 12, 16, 2) == ([2], 3)
    assert block_hash.mm_inputs_in_block(ranges, 16, 20, 3) == ([], 3)
    # vLLM 0.8.5's touching rule: an input ending at the block's start joins it.
    assert block_hash.mm_inputs_in_block([(0, 4)], 4, 8, 0, True) == ([0], 1)
    assert block_hash.mm_inputs_in_block([(0, 4)], 4, 8, 0) == ([], 1)


def test_extra_keys_are_unchanged_by_the_scan_over_tuples() -> None:
    request = Request(
        "r",
        list(range(16)),
        mm_positions=[PlaceholderRange(1, 3), PlaceholderRange(4, 1), PlaceholderRange(8, 5)],
        mm_hashes=["a", "b", "c"],
        lora_id=7,
    )
    keys = [block_hash.generate_block_hash_extra_keys(request, s, s + 4, 0)[0] for s in (0, 4, 8)]
    a, b = MultimodalKey("a", 1, 3), MultimodalKey("b", 0, 1)
    assert keys == [(7, a), (7, b), (7, MultimodalKey("c", 0, 5))]
    assert block_hash.generate_block_hash_extra_keys(request, 12, 16, 2) == (
        (7, MultimodalKey("c", -4, 5)),
        3,
    )
    for start in range(0, 16, 4):
        for mm_position in (True, False):
            assert block_hash.generate_block_hash_extra_keys(
                request, start, start + 4, 0, mm_position=mm_position
            )[0] == spec_hash.block_extra_keys(request, start, start + 4, mm_position=mm_position)


def test_budget_formulas() -> None:
    assert kv_cache_interface.attention_page_size_bytes(16, 8, 128, 2, False) == 65536
    assert kv_cache_interface.attention_page_size_bytes(16, 1, 576, 2, True) == 18432
    assert kv_cache_interface.full_attention_max_blocks(100, 16) == 7
    # window 4096, 2048 batched, max_model_len 32768, blocks of 16: cdiv(6143, 16) + 1
    assert kv_cache_interface.sliding_window_max_blocks(4096, 32768, 2048, 16) == 385
    assert kv_cache_interface.sliding_window_max_blocks(4096, 100, 2048, 16) == 8
    assert kv_cache_config.num_blocks_for_budget(1000, 64, 3) == 5


# -- every small input -------------------------------------------------------------------------


def _holds_everywhere(contract: object, domain: Iterable[tuple[object, ...]]) -> int:
    """Run the contract on every input; count those meeting the preconditions."""
    assert callable(contract)
    met = 0
    for args in domain:
        failed, what = call_contract(contract, args, {})
        assert not failed, f"{args}: {what}"
        met += what == "passes on replay"
    assert met, "no input met the preconditions"
    return met


SMALL = range(0, 7)
POSITIVE = range(1, 5)


def test_allocation_contracts_hold_on_every_small_input() -> None:
    _holds_everywhere(
        contracts.contract_num_required_blocks, itertools.product(SMALL, POSITIVE, SMALL, POSITIVE)
    )
    _holds_everywhere(
        contracts.contract_allocation_step,
        itertools.product(range(3), range(3), SMALL, POSITIVE, range(3), range(3), POSITIVE),
    )
    _holds_everywhere(contracts.contract_fits, itertools.product(range(-2, 5), SMALL, SMALL))


def test_window_contracts_hold_on_every_small_input() -> None:
    _holds_everywhere(
        contracts.contract_first_useful_block,
        itertools.product(range(13), range(1, 7), POSITIVE, SMALL),
    )
    _holds_everywhere(
        contracts.contract_num_window_blocks, itertools.product(range(1, 10), POSITIVE)
    )
    patterns = [list(p) for n in range(5) for p in itertools.product([False, True], repeat=n)]
    _holds_everywhere(
        contracts.contract_scan_window_hit,
        [(pattern, needed) for pattern in patterns for needed in range(6)],
    )


def _range_lists(max_inputs: int, max_token: int) -> list[list[tuple[int, int]]]:
    """Every sorted, disjoint list of up to `max_inputs` ranges inside [0, max_token)."""
    spans = [(o, n) for o in range(max_token) for n in range(1, max_token - o + 1)]
    result: list[list[tuple[int, int]]] = [[]]
    for count in range(1, max_inputs + 1):
        for combo in itertools.combinations(spans, count):
            if all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(combo)):
                result.append(list(combo))
    return result


RANGE_LISTS = _range_lists(3, 7)
BLOCKS = [(s, e) for s in range(8) for e in range(s + 1, 9)]


def test_mm_contracts_hold_on_every_small_input() -> None:
    domain = [(ranges, s, e) for ranges in RANGE_LISTS for s, e in BLOCKS[::3]]
    _holds_everywhere(contracts.contract_mm_inputs_in_block, domain)
    _holds_everywhere(contracts.contract_mm_touching_last_input, domain)
    _holds_everywhere(
        contracts.contract_mm_scan_over_blocks,
        [(ranges, b, 7 // b + 1) for ranges in RANGE_LISTS[::5] for b in (1, 2, 3)],
    )


def test_budget_contracts_hold_on_every_small_input() -> None:
    _holds_everywhere(
        contracts.contract_sliding_window_max_memory,
        itertools.product(POSITIVE, range(1, 6), range(1, 9), range(1, 4), range(4)),
    )
    _holds_everywhere(
        contracts.contract_memory_monotone_in_max_model_len,
        itertools.product(POSITIVE, range(1, 5), range(1, 3), range(1, 7), range(1, 7)),
    )
    _holds_everywhere(
        contracts.contract_num_blocks_for_budget, itertools.product(range(40), range(1, 6), (1, 3))
    )
    _holds_everywhere(
        contracts.contract_unify_kv_cache_configs,
        [
            (list(nb), [0, 1, 0][: len(nb)], r)
            for n in (1, 2, 3)
            for nb in itertools.product((1, 2, 5), repeat=n)
            for r in range(n)
        ],
    )


@pytest.mark.parametrize("pair", pairs.PAIRS, ids=lambda p: p.name)
def test_impl_and_spec_twins_agree_on_every_small_input(pair: pairs.Pair) -> None:
    arity = len(pair.examples[0])
    first = pair.examples[0][0]
    domain: Iterable[tuple[object, ...]]
    if isinstance(first, list) and first and isinstance(first[0], bool):
        patterns = [list(p) for n in range(5) for p in itertools.product([False, True], repeat=n)]
        domain = itertools.product(patterns, range(1, 10), POSITIVE)
    elif isinstance(first, list):
        domain = [(ranges, s, e) for ranges in RANGE_LISTS for s, e in BLOCKS[::2]]
    else:
        domain = itertools.product(*[range(-1, 5)] * (arity - 1), range(0, 4))
    compared = 0
    for args in domain:
        impl, spec = pair.impl(*args), pair.spec(*args)
        assert impl == spec, (args, impl, spec)
        compared += impl is not None
    assert compared


def test_spec_skip_count_is_the_impl_boundary_clamped_at_zero() -> None:
    for computed, w, b in itertools.product(range(30), range(1, 9), POSITIVE):
        expected = max(window.first_useful_block(computed, w, b), 0)
        assert spec_window.sliding_window_skipped(computed, w, b) == expected


def test_spec_ceil_div_is_ceiling_division() -> None:
    for a, b in itertools.product(range(-9, 30), range(1, 7)):
        assert spec_counts.ceil_div(a, b) == -(-a // b) == block_counts.cdiv(a, b)
