"""The full-sequence admission gate (`allocate_slots(..., full_sequence_must_fit=True)`, vLLM
0.33's `scheduler_reserve_full_isl`, on by default in its scheduler), spec and impl side by side.

With the gate, a step is allocated only if the blocks every group lacks for all of the
request's tokens (at most max_model_len; no lookahead, no drafts) would fit, counted as the
step's own check counts them (held blocks and hits cover their positions; a hit at ref_cnt 0
leaves the free queue when touched). A window or chunk group counts at most its admission cap:
the blocks its reads and the tokens in flight span (`max_in_flight_tokens`). The gate runs
before anything changes: a refusal leaves even the blocks a window no longer reads in place.

The numbers: a pool of 10 blocks (1..9 free), block size 4, max_model_len 64.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from manager_fixtures import GROUP_FACTORIES, manager_config

from pagedkv import (
    ArgumentTypeError,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    Request,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.spec.manager import SpecKVCacheManager

SIDES = sorted(GROUP_FACTORIES)


def both(config: ManagerConfig) -> list[ManagerUnderTest]:
    return [GROUP_FACTORIES[side](config) for side in SIDES]


def gated(manager: ManagerUnderTest, request: Request, num_tokens: int, hits: Any = None) -> Any:
    return manager.allocate_slots(request, num_tokens, hits, 0, full_sequence_must_fit=True)


def admit(manager: ManagerUnderTest, request: Request, num_tokens: int, gate: bool) -> Any:
    """A waiting request's admission as a scheduler makes it: lookup, then allocate_slots; a
    refusal changes nothing."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    before = manager.snapshot()
    result = manager.allocate_slots(
        request, num_tokens, hits, 0, **({"full_sequence_must_fit": True} if gate else {})
    )
    if result is not None:
        request.num_computed_tokens = num_hit_tokens + num_tokens
    else:
        assert manager.snapshot() == before
    manager.check_invariants()
    return result


def window_config(
    window: int = 5, max_in_flight_tokens: int | None = None, chunked: bool = False
) -> ManagerConfig:
    spec: KVCacheSpec
    if chunked:
        spec = ChunkedLocalAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=8
        )
    else:
        spec = SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window
        )
    # Chunked local attention with caching off: with caching, a lookup hits a new request's
    # earlier chunks as null blocks, which the gate then counts as held.
    config = manager_config(enable_caching=not chunked)
    return dataclasses.replace(
        config,
        kv_cache_config=uniform_kv_cache_config(spec, 10),
        max_in_flight_tokens=max_in_flight_tokens,
    )


@pytest.mark.parametrize(
    ("prompt", "gate", "expected"),
    [
        (36, True, ([1],)),  # 9 blocks in all: they fit
        (37, True, None),  # 10 blocks: the first chunk is refused
        (37, False, ([1],)),  # without the gate only the chunk counts
    ],
)
def test_the_gate_admits_only_a_request_whose_whole_prompt_fits(
    prompt: int, gate: bool, expected: tuple[list[int], ...] | None
) -> None:
    for manager in both(manager_config()):
        assert admit(manager, Request("r", range(prompt)), 4, gate) == expected


def test_the_gate_counts_at_most_max_model_len_tokens() -> None:
    """A request longer than max_model_len (the scheduler stops it there) reserves the blocks
    of max_model_len tokens: 36 here, 9 blocks, which fit."""
    config = dataclasses.replace(manager_config(), max_model_len=36)
    for manager in both(config):
        assert admit(manager, Request("r", range(50)), 4, True) == ([1],)


def test_evictable_hits_count_against_the_free_blocks() -> None:
    """A freed request leaves blocks 1..3 cached at ref_cnt 0; a sibling sharing 12 tokens hits
    all three, which leave the free queue when touched: 6 free blocks remain for what it lacks.
    40 tokens lack 7 blocks (refused); 36 lack 6 (admitted)."""
    for prompt, fits in ((40, False), (36, True)):
        for manager in both(manager_config()):
            holder = Request("holder", range(12))
            assert admit(manager, holder, 12, False) == ([1, 2, 3],)
            manager.free(holder)
            sibling = Request("sibling", list(range(12)) + [99] * (prompt - 12))
            hits, num_hit_tokens = manager.get_computed_blocks(sibling)
            assert hits == ([1, 2, 3],) and num_hit_tokens == 12
            result = gated(manager, sibling, 4, hits)
            assert (result is not None) is fits, (prompt, result)


@pytest.mark.parametrize(
    ("in_flight", "chunked", "admitted"),
    [
        (4, False, True),  # window 5: cap cdiv(min(4 + 4, 64), 4) + 1 = 3 blocks
        (None, False, False),  # no cap: all 10 blocks counted, 9 free
        (28, False, True),  # cap cdiv(32, 4) + 1 = 9: just fits
        (29, False, False),  # cap 10
        (4, True, True),  # chunks of 8 (caching off): cap cdiv(min(8 + 4, 64), 4) = 3
        (28, True, True),  # cap cdiv(36, 4) = 9
        (29, True, False),  # cap 10
    ],
)
def test_a_window_or_chunk_group_reserves_at_most_its_admission_cap(
    in_flight: int | None, chunked: bool, admitted: bool
) -> None:
    config = window_config(max_in_flight_tokens=in_flight, chunked=chunked)
    for manager in both(config):
        result = admit(manager, Request("r", range(40)), 4, True)
        assert (result == ([1],)) is admitted and (result is None) is not admitted


def test_a_refusal_leaves_even_the_blocks_a_window_no_longer_reads() -> None:
    """A running request of 40 tokens, 8 computed, holds blocks 1 and 2 under a window of 4;
    block 1 lies wholly before the next token's window. Its next chunk through the gate needs
    10 - 2 = 8 more blocks, 7 are free: None, and block 1 is still held (a refusal without the
    gate drops it first). Without the gate the chunk takes one block after dropping block 1."""
    for manager in both(window_config(window=4)):
        request = Request("r", range(40))
        assert admit(manager, request, 8, False) == ([1, 2],)
        before = manager.snapshot()
        assert gated(manager, request, 4) is None
        assert manager.snapshot() == before
        assert manager.allocate_slots(request, 4) == ([3],)
        assert manager.snapshot().blocks["r"] == ((0, 2, 3),)


def _mamba_hybrid() -> ManagerConfig:
    specs: list[KVCacheSpec] = [
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16"),
        MambaSpec(
            block_size=40,
            shapes=[(1,)],
            dtypes=["float16"],
            page_size_padded=16,
            num_speculative_blocks=1,
        ),
    ]
    names = ["layers.0", "layers.1"]
    kv_cache_config = KVCacheConfig(
        10,
        {
            name: KVCacheTensor(spec.page_size_bytes * 10)
            for name, spec in zip(names, specs, strict=True)
        },
        [KVCacheGroupSpec([name], spec) for name, spec in zip(names, specs, strict=True)],
    )
    return dataclasses.replace(
        manager_config(enable_caching=False), kv_cache_config=kv_cache_config, max_model_len=40
    )


@pytest.mark.parametrize(("prompt", "expected"), [(28, ([1], [2, 3])), (29, None)])
def test_groups_of_several_block_sizes_sum_what_each_lacks(
    prompt: int, expected: tuple[list[int], ...] | None
) -> None:
    """Full attention of block size 4 beside a Mamba group (one 40-token block and one
    speculative block), caching off: a prompt of 28 tokens lacks 7 + 2 blocks, 29 lacks 8 + 2;
    9 are free."""
    for manager in both(_mamba_hybrid()):
        assert admit(manager, Request("r", range(prompt)), 4, True) == expected


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_a_gate_that_is_not_a_bool_is_refused_alike(value: object) -> None:
    messages = []
    for manager in (
        SpecKVCacheManager(manager_config().kv_cache_config, 64),
        KVCacheManager(manager_config().kv_cache_config, 64),
    ):
        with pytest.raises(ArgumentTypeError) as info:
            manager.allocate_slots(Request("r", range(8)), 4, full_sequence_must_fit=value)  # type: ignore[arg-type]
        messages.append(str(info.value))
        assert "full_sequence_must_fit" in messages[-1] and "'r'" in messages[-1]
    assert messages[0] == messages[1]


@pytest.mark.parametrize(("value", "error"), [(0, InvalidArgumentError), ("4", ArgumentTypeError)])
def test_max_in_flight_tokens_is_none_or_a_positive_int(value: object, error: type) -> None:
    kv_cache_config = manager_config().kv_cache_config
    messages = []
    for manager_class in (SpecKVCacheManager, KVCacheManager):
        with pytest.raises(error) as info:
            manager_class(kv_cache_config, 64, max_in_flight_tokens=value)  # type: ignore[arg-type]
        messages.append(str(info.value))
        assert "max_in_flight_tokens" in messages[-1]
    assert messages[0] == messages[1]


def test_the_spec_states_each_cap_as_the_shared_vocabulary_computes_it() -> None:
    """The spec's per-type `admission_cap` (its own statement) against
    `KVCacheSpec.max_admission_blocks`, which the implementation uses, over a grid."""
    for block_size, span, in_flight, max_model_len in itertools.product(
        (1, 2, 3, 4, 7), (1, 2, 5, 8, 13), (1, 3, 8, 30), (1, 9, 40)
    ):
        specs: list[KVCacheSpec] = [
            SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype="float16",
                sliding_window=span,
            ),
            ChunkedLocalAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype="float16",
                attention_chunk_size=span,
            ),
            FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16"),
        ]
        for spec in specs:
            manager = SpecKVCacheManager(
                uniform_kv_cache_config(spec, 4),
                max_model_len,
                enable_caching=False,
                max_in_flight_tokens=in_flight,
            )
            expected = spec.max_admission_blocks(max_model_len, in_flight)
            assert manager.admission_caps == (expected,), (spec, in_flight, max_model_len)
