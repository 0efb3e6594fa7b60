"""Contracts of pagedkv's pure functions, as plain-assert checkers for CrossHair.

Each `contract_*` function is one contract: its leading `assert` statements are the
preconditions (CrossHair explores only inputs that pass them), then it calls the function under
test, the one the library itself runs, and every later `assert` is a postcondition.
`crosshair check --analysis_kind asserts` searches for inputs that reach a failing postcondition
(or any other exception); `python -m proofs.crosshair` runs every contract with bounds and
replays each counterexample by calling the contract again, concretely.

The functions under test are reached through their modules (`block_counts.fits`, not `fits`), so a
planted bug (`proofs.crosshair.planted`) replaces what the contract calls. Classes are built
through their constructors from the contract's arguments, so CrossHair can reach any valid state.
Only ints, bools and lists or tuples of them are arguments: CrossHair prints counterexamples as
Python expressions, and the runner evaluates them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv import block_counts, block_hash
from pagedkv.planning import kv_cache_config
from pagedkv.single_type import sliding_window as window_impl
from pagedkv.vocab import kv_cache_interface
from pagedkv.vocab.kv_cache_interface import (
    DTYPE_SIZES,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

MAX_BLOCKS = 4
"""Scope: the longest hit pattern a contract explores."""
MAX_INPUTS = 3
"""Scope: the most multimodal inputs a contract explores."""
MAX_WORKERS = 3
"""Scope: the most workers whose configs `contract_unify_kv_cache_configs` unifies."""
MAX_SCANNED_BLOCKS = 3
"""Scope: the most consecutive blocks `contract_mm_scan_over_blocks` scans."""

NULL = -1
"""What `contract_scan_window_hit` passes as the null block (the hits are block positions)."""


# -- allocate_slots arithmetic ---------------------------------------------------------------


def contract_num_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> None:
    """The required blocks are the fewest that give every slot of the step a block."""
    assert block_size >= 1
    assert num_computed_tokens >= 0
    assert num_tokens >= 1
    assert num_lookahead_tokens >= 0
    required = block_counts.num_required_blocks(
        num_computed_tokens, num_tokens, num_lookahead_tokens, block_size
    )
    slots = num_computed_tokens + num_tokens + num_lookahead_tokens
    assert required * block_size >= slots, "a slot without a block"
    assert (required - 1) * block_size < slots, "a block without a slot"


def contract_allocation_step(
    num_held: int,
    num_hits: int,
    num_computed_tokens: int,
    num_tokens: int,
    num_lookahead_tokens: int,
    num_spec_tokens: int,
    block_size: int,
) -> None:
    """One allocate_slots step: the new blocks complete the required ones exactly, and the
    blocks to cache are full of real tokens, never fewer than before the step, never more than
    the request holds."""
    assert block_size >= 1
    assert num_held >= 0
    assert num_hits >= 0
    assert num_hits == 0 or (num_held == 0 and num_computed_tokens == 0)  # hits start a request
    assert 0 <= num_computed_tokens <= num_held * block_size  # computed tokens have slots
    assert num_tokens >= 1
    assert num_lookahead_tokens >= 0
    assert 0 <= num_spec_tokens <= num_tokens  # speculative tokens are scheduled tokens
    computed = num_computed_tokens + num_hits * block_size
    required = block_counts.num_required_blocks(
        computed, num_tokens, num_lookahead_tokens, block_size
    )
    new = block_counts.num_new_blocks(required, num_held, num_hits)
    full = block_counts.num_full_blocks(computed, num_tokens, num_spec_tokens, block_size)
    held_after = num_held + num_hits + max(new, 0)
    assert held_after * block_size >= computed + num_tokens + num_lookahead_tokens, "slot missing"
    assert new <= 0 or held_after == required, "allocates more than the missing blocks"
    real_tokens = computed + num_tokens - num_spec_tokens
    assert full * block_size <= real_tokens, "caches a block that is not full"
    assert (full + 1) * block_size > real_tokens, "leaves a full block uncached"
    assert full >= computed // block_size, "fewer full blocks than before the step"
    assert full <= held_after, "caches a block the request does not hold"


def contract_fits(num_new: int, num_free: int, num_evictable_hits: int) -> None:
    """The capacity check: the step fits iff, after touching the hits (those in the free queue
    leave it), the free queue still has a block for each new one; more free blocks or fewer new
    ones never turn a fit into a refusal."""
    assert 0 <= num_evictable_hits <= num_free  # evictable hits are free blocks
    result = block_counts.fits(num_new, num_free, num_evictable_hits)
    free_after_touch = num_free - num_evictable_hits  # the touched hits leave the free queue
    assert result == (max(num_new, 0) <= free_after_touch), "capacity misjudged"
    if result:
        assert block_counts.fits(num_new, num_free + 1, num_evictable_hits), "not monotone"
        assert block_counts.fits(num_new - 1, num_free, num_evictable_hits), "not monotone"


# -- sliding window ----------------------------------------------------------------------------


def contract_first_useful_block(
    num_computed_tokens: int, sliding_window: int, block_size: int, position: int
) -> None:
    """Block `position` lies before the first useful block iff every one of its tokens is
    outside the window of the next token (so `remove_skipped_blocks` frees exactly those)."""
    assert num_computed_tokens >= 0
    assert sliding_window >= 1
    assert block_size >= 1
    assert position >= 0
    first = window_impl.first_useful_block(num_computed_tokens, sliding_window, block_size)
    window_start = num_computed_tokens - sliding_window + 1  # first token the next one sees
    last_token = (position + 1) * block_size - 1
    assert (position < first) == (last_token < window_start), "skip boundary off"


def contract_num_window_blocks(sliding_window: int, block_size: int) -> None:
    """A hit must end with the fewest blocks that hold the W - 1 tokens before the next token."""
    assert sliding_window >= 1
    assert block_size >= 1
    needed = window_impl.num_window_blocks(sliding_window, block_size)
    assert needed >= 0
    assert needed * block_size >= sliding_window - 1, "the cached run misses window tokens"
    assert needed == 0 or (needed - 1) * block_size < sliding_window - 1, "needs a block too many"


def contract_scan_window_hit(cached: list[bool], num_needed: int) -> None:
    """The right-to-left scan returns the longest usable prefix of the hit pattern and looks up
    only the positions from the right end down to the start of the run it returns.

    Usable: the prefix ends in `max(num_needed, 1)` cached positions (those before them come back
    as the null block), or, failing any such prefix, it is the run of hits from position 0.
    """
    assert len(cached) <= MAX_BLOCKS
    assert 0 <= num_needed <= MAX_BLOCKS + 1
    looked_up: list[int] = []

    def lookup(position: int) -> int | None:
        looked_up.append(position)
        return position if cached[position] else None

    hits = window_impl.scan_window_hit(len(cached), num_needed, lookup, NULL)
    length = len(hits)
    first = 0
    while first < length and hits[first] == NULL:
        first += 1
    needed = max(num_needed, 1)
    assert length <= len(cached)
    assert hits[first:] == list(range(first, length)), "a hit that is not its position's block"
    assert all(cached[first:length]), "a miss in the hit"

    def usable(prefix: int) -> bool:
        return prefix >= needed and all(cached[prefix - needed : prefix])

    if usable(length):
        assert length - first == needed, "more than the window's blocks returned as hits"
        assert looked_up == list(range(len(cached) - 1, first - 1, -1)), "lookups not lazy"
    else:
        assert first == 0, "a short run after null blocks"
        assert length == len(cached) or not cached[length], "the run from 0 is cut short"
        assert looked_up == list(range(len(cached) - 1, -1, -1)), "a position looked up twice"
    longer = range(length + 1, len(cached) + 1)
    assert not any(usable(prefix) for prefix in longer), "a longer usable prefix exists"


# -- multimodal extra keys ---------------------------------------------------------------------


def _valid_ranges(ranges: list[tuple[int, int]]) -> bool:
    """Placeholder ranges as `Request` accepts them: offset >= 0, length >= 1, sorted, disjoint."""
    return all(offset >= 0 and length >= 1 for offset, length in ranges) and all(
        a_offset + a_length <= b_offset
        for (a_offset, a_length), (b_offset, _) in itertools.pairwise(ranges)
    )


def _overlapping(ranges: list[tuple[int, int]], start: int, end: int) -> list[int]:
    return [
        i for i, (offset, length) in enumerate(ranges) if offset < end and start < offset + length
    ]


def contract_mm_inputs_in_block(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Scanning from input 0, the block's inputs are exactly those sharing a token with it, and
    every input the next scan passes over ends at or before the block's end."""
    assert len(ranges) <= MAX_INPUTS
    assert _valid_ranges(ranges)
    assert 0 <= start < end
    indices, next_idx = block_hash.mm_inputs_in_block(ranges, start, end, 0)
    assert indices == _overlapping(ranges, start, end), "wrong inputs"
    assert 0 <= next_idx <= len(ranges)
    assert all(offset + length <= end for offset, length in ranges[:next_idx]), "skips too far"


def contract_mm_scan_over_blocks(
    ranges: list[tuple[int, int]], block_size: int, num_blocks: int
) -> None:
    """The linear scan over consecutive blocks (each starting where the last one stopped, as
    `hash_request_tokens` does) finds, for every block, exactly the inputs overlapping it."""
    assert len(ranges) <= MAX_INPUTS
    assert _valid_ranges(ranges)
    assert block_size >= 1
    assert 0 <= num_blocks <= MAX_SCANNED_BLOCKS
    mm_idx = 0
    for block in range(num_blocks):
        start, end = block * block_size, (block + 1) * block_size
        indices, next_idx = block_hash.mm_inputs_in_block(ranges, start, end, mm_idx)
        assert indices == _overlapping(ranges, start, end), f"block {block}: wrong inputs"
        assert next_idx >= mm_idx, "the scan went back"
        mm_idx = next_idx


def contract_mm_touching_last_input(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """vLLM 0.8.5's keys for a block that `cache_full_blocks` hashes (scan from the last input,
    touching inputs included): the last input iff it overlaps the block or ends at its start."""
    assert len(ranges) <= MAX_INPUTS
    assert _valid_ranges(ranges)
    assert 0 <= start < end
    first_idx = max(len(ranges) - 1, 0)
    indices, _ = block_hash.mm_inputs_in_block(ranges, start, end, first_idx, True)
    expected = []
    if ranges:
        offset, length = ranges[-1]
        if (offset < end and start < offset + length) or offset + length == start:
            expected = [len(ranges) - 1]
    assert indices == expected


# -- memory budget -----------------------------------------------------------------------------

_DTYPES = tuple(DTYPE_SIZES)


def contract_page_size(
    block_size: int, num_kv_heads: int, head_size: int, dtype_index: int, use_mla: bool
) -> None:
    """A page holds K and V (or one MLA latent) of every token of a block; full attention and
    sliding window layers of the same shape have the same page size."""
    assert block_size >= 1 and num_kv_heads >= 1 and head_size >= 1
    assert 0 <= dtype_index < len(_DTYPES)
    dtype = _DTYPES[dtype_index]
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        use_mla=use_mla,
    )
    per_token = (1 if use_mla else 2) * num_kv_heads * head_size * DTYPE_SIZES[dtype]
    assert spec.page_size_bytes == block_size * per_token
    if not use_mla:
        window = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=1,
        )
        assert window.page_size_bytes == spec.page_size_bytes


def contract_full_attention_max_memory(
    block_size: int, max_model_len: int, max_num_batched_tokens: int
) -> None:
    """One request of max_model_len tokens needs the fewest pages that hold it, whatever the
    batch size."""
    assert block_size >= 1 and max_model_len >= 1 and max_num_batched_tokens >= 1
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="int8")
    blocks = kv_cache_interface.full_attention_max_blocks(max_model_len, block_size)
    assert blocks * block_size >= max_model_len and (blocks - 1) * block_size < max_model_len
    assert spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens) == (
        blocks * spec.page_size_bytes
    )


def contract_sliding_window_max_memory(
    block_size: int,
    sliding_window: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    window_offset: int,
) -> None:
    """A sliding-window layer's pages hold the tokens one step keeps (the last W - 1 computed
    ones and at most max_num_batched_tokens new ones, at most max_model_len in all) wherever
    they start inside a block, and never exceed full attention's by more than one block."""
    assert block_size >= 1 and sliding_window >= 1
    assert max_model_len >= 1 and max_num_batched_tokens >= 1
    assert 0 <= window_offset < block_size  # where the kept tokens start inside their block
    spec = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="int8",
        sliding_window=sliding_window,
    )
    blocks = kv_cache_interface.sliding_window_max_blocks(
        sliding_window, max_model_len, max_num_batched_tokens, block_size
    )
    kept = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    spanned = -(-(window_offset + kept) // block_size)  # blocks touched by the kept tokens
    assert spanned <= blocks, "the kept tokens do not fit"
    assert blocks <= kv_cache_interface.full_attention_max_blocks(max_model_len, block_size) + 1
    assert spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens) == (
        blocks * spec.page_size_bytes
    )


def contract_memory_monotone_in_max_model_len(
    block_size: int,
    sliding_window: int,
    max_num_batched_tokens: int,
    shorter: int,
    longer: int,
) -> None:
    """Memory needed never decreases as max_model_len grows, for both kinds of layer: the
    binary search of `estimate_max_model_len` rests on it."""
    assert block_size >= 1 and sliding_window >= 1 and max_num_batched_tokens >= 1
    assert 1 <= shorter <= longer
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="int8")
    window = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="int8",
        sliding_window=sliding_window,
    )
    for spec in (full, window):
        assert spec.max_memory_usage_bytes(
            shorter, max_num_batched_tokens
        ) <= spec.max_memory_usage_bytes(longer, max_num_batched_tokens), spec


def contract_num_blocks_for_budget(
    available_memory: int, page_size_bytes: int, num_layers: int
) -> None:
    """The budget's blocks are the most whose pages, one per layer, fit in the memory."""
    assert available_memory >= 0 and page_size_bytes >= 1 and num_layers >= 1
    blocks = kv_cache_config.num_blocks_for_budget(available_memory, page_size_bytes, num_layers)
    per_block = page_size_bytes * num_layers
    assert blocks >= 0
    assert blocks * per_block <= available_memory, "over budget"
    assert (blocks + 1) * per_block > available_memory, "a block that fits is left out"


# -- multi-worker unification ------------------------------------------------------------------

_FULL = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="int8")
_WINDOW = SlidingWindowSpec(
    block_size=2, num_kv_heads=1, head_size=1, dtype="int8", sliding_window=3
)


def _worker_config(worker: int, num_blocks: int, extra_pages: int) -> KVCacheConfig:
    """A worker's config with a full and a sliding-window group, listed in an order that
    depends on the worker (unification sorts them), tensors `extra_pages` larger than needed."""
    groups = [
        KVCacheGroupSpec([f"w{worker}.full"], _FULL),
        KVCacheGroupSpec([f"w{worker}.window"], _WINDOW),
    ]
    if worker % 2:
        groups.reverse()
    tensors = {
        group.layer_names[0]: KVCacheTensor(
            group.kv_cache_spec.page_size_bytes * (num_blocks + extra_pages)
        )
        for group in groups
    }
    return KVCacheConfig(num_blocks, tensors, groups)


def contract_unify_kv_cache_configs(
    num_blocks: list[int], extra_pages: list[int], rotation: int
) -> None:
    """Unified configs take the minimum num_blocks and keep each worker's tensors; unifying is
    idempotent, independent of the workers' order, and leaves its input unchanged."""
    assert 1 <= len(num_blocks) <= MAX_WORKERS and len(extra_pages) == len(num_blocks)
    assert all(blocks >= 1 for blocks in num_blocks)
    assert all(extra >= 0 for extra in extra_pages)
    assert 0 <= rotation < len(num_blocks)
    configs = [
        _worker_config(worker, blocks, extra)
        for worker, (blocks, extra) in enumerate(zip(num_blocks, extra_pages, strict=True))
    ]
    unify = kv_cache_config.unify_kv_cache_configs
    unified = unify(configs)
    assert len(unified) == len(configs)
    for config, result in zip(configs, unified, strict=True):
        assert result.num_blocks == min(num_blocks), "not the minimum"
        assert result.tensors == config.tensors, "tensors changed"
        specs = [group.kv_cache_spec for group in result.kv_cache_groups]
        assert specs == sorted((_FULL, _WINDOW), key=lambda spec: spec.type_id), "groups unsorted"
    assert [c.num_blocks for c in configs] == num_blocks, "input changed"
    assert unify(unified) == unified, "not idempotent"
    rotated = configs[rotation:] + configs[:rotation]
    assert unify(rotated) == unified[rotation:] + unified[:rotation], "depends on worker order"


# -- the registry the runner reads -------------------------------------------------------------


@dataclass(frozen=True)
class Contract:
    """One contract and concrete inputs that meet its preconditions (so it is not vacuous)."""

    check: Callable[..., None]
    examples: tuple[tuple[object, ...], ...]

    @property
    def name(self) -> str:
        return self.check.__name__


CONTRACTS: tuple[Contract, ...] = (
    Contract(contract_num_required_blocks, ((0, 1, 0, 1), (5, 3, 2, 4), (16, 1, 0, 16))),
    Contract(contract_allocation_step, ((0, 2, 0, 3, 1, 1, 4), (3, 0, 10, 1, 0, 0, 4))),
    Contract(contract_fits, ((3, 5, 2), (0, 0, 0), (4, 5, 2))),
    Contract(contract_first_useful_block, ((10, 4, 2, 3), (10, 4, 2, 2), (3, 8, 4, 0))),
    Contract(contract_num_window_blocks, ((8, 4), (1, 4), (9, 4))),
    Contract(contract_scan_window_hit, (([True, False, True, True], 2), ([True, False], 3))),
    Contract(contract_mm_inputs_in_block, (([(0, 3), (5, 2)], 2, 6), ([], 0, 4))),
    Contract(contract_mm_scan_over_blocks, (([(1, 3), (4, 1)], 2, 3),)),
    Contract(contract_mm_touching_last_input, (([(0, 4)], 4, 8), ([(0, 4)], 5, 8))),
    Contract(contract_page_size, ((16, 8, 128, 2, False), (4, 1, 64, 0, True))),
    Contract(contract_full_attention_max_memory, ((16, 100, 8), (4, 4, 1))),
    Contract(contract_sliding_window_max_memory, ((4, 6, 100, 8, 3), (4, 1, 3, 2, 0))),
    Contract(contract_memory_monotone_in_max_model_len, ((4, 6, 8, 10, 30), (2, 1, 1, 1, 1))),
    Contract(contract_num_blocks_for_budget, ((1000, 64, 3), (0, 1, 1))),
    Contract(contract_unify_kv_cache_configs, (([3, 5, 2], [0, 1, 0], 1), ([4], [0], 0))),
)
