"""The smaller promises of a manager of several KV cache groups, which the scenario tests leave
open: the defaults it is built with, the call a refused overlapping call names, and the cadence of
`debug_invariants` (argument and environment variable)."""

from __future__ import annotations

import pytest

from pagedkv import (
    ArgumentTypeError,
    FullAttentionSpec,
    InvalidArgumentError,
    InvariantViolation,
    KVCacheConfig,
    KVCacheManager,
    KVCacheSpec,
    Request,
    SlidingWindowSpec,
    sha256,
)
from pagedkv.block_hash import Sha256Memo
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config
from pagedkv.manager import CHECK_INVARIANTS_ENV, SHA256_MEMO_TOKENS
from pagedkv.vocab.errors import ConcurrentUseError


def _config(block_size: int = 2) -> KVCacheConfig:
    specs: list[KVCacheSpec] = [
        SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype="float16",
            sliding_window=block_size,
        ),
        FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16"),
    ]
    return hybrid_kv_cache_config(specs, 20)


def _admit(manager: KVCacheManager, request: Request) -> None:
    """get_computed_blocks, then allocate_slots for the rest of the prompt: two calls."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens


# -- defaults ------------------------------------------------------------------------------------


def test_a_manager_keeps_its_config_and_gathers_no_stats_unless_asked() -> None:
    config = _config()
    manager = KVCacheManager(config, 32)
    assert manager.kv_cache_config is config
    assert manager.log_stats is False
    assert manager.make_prefix_cache_stats() is None
    logging = KVCacheManager(config, 32, log_stats=True)
    assert logging.log_stats is True
    assert logging.make_prefix_cache_stats() is not None


def test_the_sha256_memo_holds_the_memo_budget_in_blocks_and_at_least_one() -> None:
    manager = KVCacheManager(_config(), 32)
    assert isinstance(manager.caching_hash_fn, Sha256Memo)
    assert manager.caching_hash_fn.maxsize == SHA256_MEMO_TOKENS // 2
    huge = KVCacheManager(_config(SHA256_MEMO_TOKENS), SHA256_MEMO_TOKENS)
    assert isinstance(huge.caching_hash_fn, Sha256Memo)
    assert huge.caching_hash_fn.maxsize == 1  # one block of 2**18 tokens fills the budget


# -- overlapping calls ---------------------------------------------------------------------------


def test_a_call_re_entering_the_manager_is_refused_under_its_own_name() -> None:
    """A hash function that calls back into the manager is refused, and the refusal names the
    call that was refused (what a user reads to find the offending callback)."""
    manager = KVCacheManager(_config(), 32)
    running = Request("running", range(4))
    _admit(manager, running)
    refused: list[str] = []
    calls = [
        manager.make_prefix_cache_stats,
        lambda: manager.free_block_hashes(running),
        manager.reset_prefix_cache,
        lambda: manager.get_num_common_prefix_blocks(running, 1),
        lambda: manager.get_block_ids("running"),
        manager.check_invariants,
    ]

    def reentering_hash(key: object) -> int:
        for call in calls:
            try:
                call()
            except ConcurrentUseError as error:
                refused.append(error.call)
        return sha256(key)

    manager.caching_hash_fn = reentering_hash
    manager.get_computed_blocks(Request("newcomer", [3, 3, 3]))  # one full block: one hash
    assert refused == [
        "KVCacheManager.make_prefix_cache_stats",
        "KVCacheManager.free_block_hashes",
        "KVCacheManager.reset_prefix_cache",
        "KVCacheManager.get_num_common_prefix_blocks",
        "KVCacheManager.get_block_ids",
        "KVCacheManager.check_invariants",
    ]
    manager.check_invariants()


# -- debug_invariants ----------------------------------------------------------------------------


def _corrupt(manager: KVCacheManager) -> None:
    manager._requests["ghost"] = Request("ghost", [1])  # tracked with neither blocks nor hashes


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_debug_invariants_checks_after_every_nth_call(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every 2nd state-changing call ends with the check: a corruption made right after one
    is found by the 2nd call after it, not the 1st."""
    if how == "argument":
        manager = KVCacheManager(_config(), 32, debug_invariants=2)
    else:
        monkeypatch.setenv(CHECK_INVARIANTS_ENV, " 2 ")
        manager = KVCacheManager(_config(), 32)
    assert manager.debug_invariants == 2
    _admit(manager, Request("a", range(4)))  # 2 calls: checked, and counting afresh
    _corrupt(manager)
    manager.get_computed_blocks(Request("b", [1]))
    with pytest.raises(InvariantViolation, match="every tracked request has blocks"):
        manager.get_computed_blocks(Request("c", [1]))


def test_debug_invariants_zero_and_an_empty_variable_are_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CHECK_INVARIANTS_ENV, "  ")
    for manager in (
        KVCacheManager(_config(), 32),
        KVCacheManager(_config(), 32, debug_invariants=0),
    ):
        assert manager.debug_invariants == 0
        _admit(manager, Request("a", range(4)))
        _corrupt(manager)
        for name in "bcd":
            manager.get_computed_blocks(Request(name, [1]))  # never checked


def test_debug_invariants_of_the_wrong_type_or_value_are_refused_by_name() -> None:
    with pytest.raises(ArgumentTypeError) as wrong_type:
        KVCacheManager(_config(), 32, debug_invariants="2")
    with pytest.raises(InvalidArgumentError) as negative:
        KVCacheManager(_config(), 32, debug_invariants=-1)
    for error in (wrong_type.value, negative.value):
        assert str(error).startswith("KVCacheManager"), str(error)
        assert "debug_invariants" in str(error)
        assert "an int >= 0" in str(error)


def test_a_variable_that_is_no_number_of_calls_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_INVARIANTS_ENV, "often")
    with pytest.raises(InvalidArgumentError) as info:
        KVCacheManager(_config(), 32)
    assert str(info.value) == (
        f"{CHECK_INVARIANTS_ENV} must be a number of calls (0: off), got 'often'"
    )
