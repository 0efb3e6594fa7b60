"""Tenant isolation: requests with different cache salts never share a block.

Where a wrong cache hit is a data leak, the salt is the boundary: in any order of arrival,
eviction (a small pool under pressure) or prefix-cache reset, a request only ever reuses blocks
whose content was computed for its own salt. With equal salts, sharing works as usual.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedkv import BlockHashType, KVCacheManager, Request, hash_request_tokens
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]
SALTS = ("tenant-a", "tenant-b", None)


def _manager(num_blocks: int, sliding: bool) -> KVCacheManager:
    spec = (
        SlidingWindowSpec(
            block_size=2, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=3
        )
        if sliding
        else FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    )
    return KVCacheManager(uniform_kv_cache_config(spec, num_blocks), max_model_len=64)


@given(
    sliding=st.booleans(),
    num_blocks=st.integers(3, 12),
    events=st.lists(
        st.tuples(st.sampled_from(("arrive", "finish", "reset")), st.sampled_from(SALTS)),
        max_size=30,
    ),
)
def test_no_block_crosses_tenants(
    sliding: bool, num_blocks: int, events: list[tuple[str, str | None]]
) -> None:
    manager = _manager(num_blocks, sliding)
    owner: dict[int, str | None] = {}  # block id -> the salt its content was computed for
    live: list[Request] = []
    for number, (event, salt) in enumerate(events):
        if event == "arrive":
            request = Request(f"r{number}", PROMPT, cache_salt=salt)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            for block in hits[0]:
                if block is not manager.block_pool.null_block:
                    assert owner[block.block_id] == salt, "a hit crossed tenants"
            new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
            if new is None:
                continue
            for block in new[0]:
                owner[block.block_id] = salt  # its content is computed for this tenant now
            request.num_computed_tokens = request.num_tokens
            live.append(request)
        elif event == "finish" and live:
            request = live.pop(0)
            manager.free(request)
            manager.free_block_hashes(request)
        elif event == "reset":
            manager.reset_prefix_cache()
        for request in live:
            salts = {
                owner[b.block_id]
                for b in manager.get_blocks(request.request_id)[0]
                if b is not manager.block_pool.null_block
            }
            assert salts <= {request.cache_salt}
    manager.check_invariants()


def test_the_same_salt_shares_and_another_salt_does_not() -> None:
    manager = _manager(16, sliding=False)
    first = Request("a", PROMPT, cache_salt="tenant-a")
    manager.allocate_slots(first, len(PROMPT))
    first.num_computed_tokens = len(PROMPT)
    same = Request("b", PROMPT, cache_salt="tenant-a")
    other = Request("c", PROMPT, cache_salt="tenant-b")
    unsalted = Request("d", PROMPT)
    assert manager.get_computed_blocks(same)[1] == 8
    assert manager.get_computed_blocks(other) == (([],), 0)
    assert manager.get_computed_blocks(unsalted) == (([],), 0)


def test_a_hash_value_collision_alone_never_hits() -> None:
    """With every hash value forced equal, lookups still compare tokens and extra keys.

    The attacker's later blocks hold the victim's tokens; only the salt in every block's extra
    keys tells them apart, under full attention (which stops at the first miss) and under a
    sliding window (which probes each block on its own).
    """

    def collide(_: object) -> int:
        return 7

    for sliding in (False, True):
        manager = _manager(16, sliding=sliding)
        manager.caching_hash_fn = collide
        victim = Request("victim", [1, 2, 3, 4, 5, 6, 7], cache_salt="tenant-a")
        manager.allocate_slots(victim, victim.num_tokens)
        attacker = Request("attacker", [9, 9, 3, 4, 5, 6, 7], cache_salt="tenant-b")
        assert all(h.hash_value == 7 for h in hash_request_tokens(collide, 2, attacker))
        (hits,), _ = manager.get_computed_blocks(attacker)
        assert all(block is manager.block_pool.null_block for block in hits), hits
        # Same tenant, same tokens: the exact key finds the victim's blocks.
        neighbour = Request("neighbour", [1, 2, 3, 4, 5, 6, 7], cache_salt="tenant-a")
        assert manager.get_computed_blocks(neighbour)[1] == 6
    unsalted = BlockHashType(7, (3, 4), None)
    assert manager.block_pool.get_cached_block(unsalted) is None  # the key holds the salt
