"""Chained block hashes and extra keys: the optimized scan against the spec's plain definitions."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import (
    NONE_HASH,
    BlockHashType,
    BlockPool,
    InvalidArgumentError,
    PlaceholderRange,
    Request,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    sha256,
)
from pagedkv.block_hash import Sha256Memo
from pagedkv.harness.machines.strategies import requests
from pagedkv.manager import SHA256_MEMO_TOKENS
from pagedkv.spec import block_extra_keys, request_block_hashes
from pagedkv.spec.block_hash import vllm_new_block_extra_keys
from pagedkv.vocab.hashes import CacheSalt, MultimodalKey
from pagedkv.vocab.semantics import PAGEDKV, VLLM_0_8_5


@given(
    request=requests("r", alphabet=3, max_tokens=24),
    block_size=st.integers(1, 5),
    algo=st.sampled_from(["sha256", "builtin"]),
)
def test_hash_request_tokens_matches_the_spec(request: Request, block_size: int, algo: str) -> None:
    hash_fn = get_hash_fn(algo)
    assert hash_request_tokens(hash_fn, block_size, request) == (
        request_block_hashes(hash_fn, block_size, request)
    )


@given(
    request=requests("r", alphabet=2, max_tokens=24),
    start=st.integers(0, 24),
    length=st.integers(1, 6),
    start_mm_idx=st.integers(0, 2),
)
def test_extra_keys_scan_matches_the_overlap_definition(
    request: Request, start: int, length: int, start_mm_idx: int
) -> None:
    """From any index at or before the first input still reaching the block, the scan is exact."""
    end = start + length
    first_relevant = next(
        (i for i, p in enumerate(request.mm_positions) if p.end > start),
        len(request.mm_positions),
    )
    keys, _ = generate_block_hash_extra_keys(request, start, end, min(start_mm_idx, first_relevant))
    assert keys == block_extra_keys(request, start, end)


@given(request=requests("r", alphabet=2, max_tokens=24), start=st.integers(0, 24))
def test_vllm_new_block_keys_scan_from_the_last_input(request: Request, start: int) -> None:
    end = start + 2
    last = max(len(request.mm_positions) - 1, 0)
    keys, _ = generate_block_hash_extra_keys(
        request, start, end, last, include_touching=True, mm_position=False
    )
    assert keys == vllm_new_block_extra_keys(request, start, end)


def test_extra_keys_order_lora_then_multimodal_then_salt() -> None:
    request = Request(
        "r",
        [0] * 8,
        mm_positions=[PlaceholderRange(1, 2), PlaceholderRange(3, 2)],
        mm_hashes=["a", "b"],
        lora_id=7,
        cache_salt="s",
    )
    a, b = MultimodalKey("a", 1, 2), MultimodalKey("b", 3, 2)
    assert generate_block_hash_extra_keys(request, 0, 4, 0) == ((7, a, b, CacheSalt("s")), 1)
    # Block [4, 8): input "b" ends at 5, so it joins (it began a token before the block); the
    # salt joins every block.
    b_before = MultimodalKey("b", -1, 2)
    assert generate_block_hash_extra_keys(request, 4, 8, 1) == ((7, b_before, CacheSalt("s")), 2)
    # vLLM 0.8.5's keys: each input's hash alone.
    assert generate_block_hash_extra_keys(request, 0, 4, 0, mm_position=False) == (
        (7, "a", "b", CacheSalt("s")),
        1,
    )


def test_an_input_ending_where_a_block_starts_joins_it_only_in_vllm_semantics() -> None:
    request = Request("r", [0] * 8, mm_positions=[PlaceholderRange(0, 4)], mm_hashes=["a"])
    assert generate_block_hash_extra_keys(request, 4, 8, 0)[0] is None
    assert generate_block_hash_extra_keys(request, 4, 8, 0, include_touching=True)[0] == (
        MultimodalKey("a", -4, 4),
    )


def test_block_completed_by_generated_tokens_hashes_like_a_prompt_block() -> None:
    """pagedkv: a block's hash does not depend on whether the pool or the lookup computed it."""
    prompt = Request(
        "r",
        [0] * 6,
        mm_positions=[PlaceholderRange(1, 1), PlaceholderRange(3, 1)],
        mm_hashes=["first", "second"],
    )
    prompt.append_output_token_ids([9, 9])  # block [4, 8) starts where "second" ends
    for semantics, expected_keys in ((PAGEDKV, None), (VLLM_0_8_5, ("second",))):
        pool = BlockPool(4, True, semantics)
        blocks = pool.get_new_blocks(2)
        hashes: list[BlockHashType] = []
        pool.cache_full_blocks(prompt, blocks, hashes, 0, 2, 4, sha256)
        assert hashes[1].extra_keys == expected_keys
    # Block [0, 4) holds both inputs; vLLM's generated-block path sees only the last one.
    early = Request(
        "s",
        [0] * 3,
        mm_positions=[PlaceholderRange(0, 1), PlaceholderRange(2, 1)],
        mm_hashes=["first", "second"],
    )
    early.append_output_token_ids([9])
    ours, theirs = BlockPool(4, True), BlockPool(4, True, VLLM_0_8_5)
    both = (MultimodalKey("first", 0, 1), MultimodalKey("second", 2, 1))
    for pool, keys in ((ours, both), (theirs, ("second",))):
        hashes = []
        pool.cache_full_blocks(early, pool.get_new_blocks(1), hashes, 0, 1, 4, sha256)
        assert hashes[0].extra_keys == keys
    assert hash_request_tokens(sha256, 4, early)[0].extra_keys == both


def test_chain_hash_depends_on_every_earlier_block() -> None:
    a = hash_request_tokens(sha256, 2, Request("a", [1, 2, 3, 4]))
    b = hash_request_tokens(sha256, 2, Request("b", [9, 2, 3, 4]))
    assert a[1].token_ids == b[1].token_ids and a[1].extra_keys == b[1].extra_keys
    assert a[1] != b[1]
    assert a[0] == hash_block_tokens(sha256, None, [1, 2])
    assert a[1] == hash_block_tokens(sha256, a[0].hash_value, (3, 4))


def test_a_partial_tail_is_never_hashed() -> None:
    assert len(hash_request_tokens(sha256, 4, Request("r", list(range(11))))) == 2
    assert hash_request_tokens(sha256, 4, Request("r", [1, 2, 3])) == []


def test_first_block_chains_from_none_hash() -> None:
    expected = sha256((NONE_HASH, (1, 2), None))
    assert hash_block_tokens(sha256, None, [1, 2]).hash_value == expected
    assert hash_block_tokens(sha256, 0, [1, 2]).hash_value == expected  # 0 counts as no parent


def test_sha256_is_stable_and_builtin_is_available() -> None:
    assert sha256((1, (2, 3), None)) == sha256((1, (2, 3), None))
    assert get_hash_fn("builtin") is hash
    with pytest.raises(InvalidArgumentError, match="unknown caching hash algorithm 'md5'"):
        get_hash_fn("md5")


def test_none_hash_is_reproducible_across_processes_with_pythonhashseed() -> None:
    code = "import pagedkv; print(pagedkv.NONE_HASH)"

    def none_hash(seed: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert none_hash("42") == none_hash("42") == str(sha256("42"))
    assert none_hash(None) != none_hash(None)


def test_salts_separate_tenants_and_equal_salts_share() -> None:
    tokens = [1, 2, 3, 4]
    alice = hash_request_tokens(sha256, 2, Request("a", tokens, cache_salt="alice"))
    alice_again = hash_request_tokens(sha256, 2, Request("b", tokens, cache_salt="alice"))
    bob = hash_request_tokens(sha256, 2, Request("c", tokens, cache_salt="bob"))
    unsalted = hash_request_tokens(sha256, 2, Request("d", tokens))
    assert alice == alice_again
    assert not set(alice) & set(bob)
    assert not set(alice) & set(unsalted)
    assert alice[1].extra_keys == (CacheSalt("alice"),)  # every block carries the salt


def test_salt_key_never_equals_a_lora_id_or_multimodal_hash() -> None:
    salted = Request("a", [1, 2], cache_salt="7")
    other = Request("b", [1, 2], mm_positions=[PlaceholderRange(0, 1)], mm_hashes=["7"])
    lora = Request("c", [1, 2], lora_id=7)
    keys = {generate_block_hash_extra_keys(r, 0, 2, 0)[0] for r in (salted, other, lora)}
    assert len(keys) == 3


def test_equal_hash_values_with_different_tokens_never_hit() -> None:
    """A hash collision alone cannot produce a hit: the index key holds tokens and extra keys."""

    def colliding(_: object) -> int:
        return 42

    pool = BlockPool(4, True)
    blocks = pool.get_new_blocks(1)
    victim = Request("victim", [1, 2])
    pool.cache_full_blocks(victim, blocks, [], 0, 1, 2, colliding)
    for tokens, salt in (([3, 4], None), ([1, 2], "tenant")):
        attacker = hash_request_tokens(colliding, 2, Request("x", tokens, cache_salt=salt))
        assert attacker[0].hash_value == 42
        assert pool.get_cached_block(attacker[0]) is None
    assert pool.get_cached_block(BlockHashType(42, (1, 2), None)) is blocks[0]


def test_hash_request_tokens_rejects_a_non_positive_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        hash_request_tokens(sha256, 0, Request("r", [1]))


@given(
    inputs=st.lists(
        st.tuples(
            st.integers(0, 2**256 - 1),
            st.lists(st.integers(0, 50), max_size=4).map(tuple),
            st.none() | st.tuples(st.integers(1, 3)),
        ),
        max_size=12,
    )
)
def test_the_sha256_memo_gives_sha256_values_and_forgets_the_oldest(
    inputs: list[tuple[int, tuple[int, ...], tuple[int, ...] | None]],
) -> None:
    memo = Sha256Memo(maxsize=4)
    for item in inputs + inputs[::-1]:  # each again, some still remembered, some forgotten
        assert memo(item) == sha256(item)
    assert memo._cached.cache_info().currsize == min(len(set(inputs)), 4)


def test_a_sha256_manager_hashes_through_a_memo_that_pickles_empty() -> None:
    from pagedkv import FullAttentionSpec, KVCacheManager, uniform_kv_cache_config

    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    config = uniform_kv_cache_config(spec, 8)
    manager = KVCacheManager(config, 64, caching_hash_algo="sha256")
    assert isinstance(manager.caching_hash_fn, Sha256Memo)
    assert manager.caching_hash_fn.maxsize == SHA256_MEMO_TOKENS // 2
    assert KVCacheManager(config, 64, caching_hash_algo="builtin").caching_hash_fn is hash
    manager.get_computed_blocks(Request("r", range(6)))
    assert manager.caching_hash_fn._cached.cache_info().currsize == 3
    copied = pickle.loads(pickle.dumps(manager.caching_hash_fn))
    assert copied._cached.cache_info().currsize == 0
    assert pickle.dumps(copied) == pickle.dumps(manager.caching_hash_fn)  # state compares equal
