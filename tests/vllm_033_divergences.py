"""The differences between vLLM 0.33.0 and the spec outside the `--against` domain, replayed.

    python tests/vllm_033_divergences.py [vllm==0.32.0]

docs/semantics.md lists the behaviours of vLLM 0.33.0 that no semantics of the spec has, and
`pagedkv verify --against vllm==0.33.0` leaves them out of its domain. This replays one
shortest case of each on the spec and on vLLM's code and prints what each side did as one JSON
line, so a test can pin that the difference is still there (and the docs still true); and one
case of each rule that used to differ (EAGLE with a window, on one group and on several; a
multimodal input's place in a block), so a test can pin that they agree.
Exit status 3: the package index is unreachable and nothing is cached.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from vllm_campaign import UNREACHABLE, _unreachable

from pagedkv.harness.adapters import spec_manager, spec_pool
from pagedkv.harness.protocol import ManagerConfig
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.swarm.runs import hybrid_kv_cache_config
from pagedkv.harness.vllm.against import prepare
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.vocab.hashes import sha256
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.request import PlaceholderRange, Request
from pagedkv.vocab.semantics import Semantics


def sliding_config(window: int, use_eagle: bool, semantics: Semantics) -> ManagerConfig:
    spec = SlidingWindowSpec(
        block_size=1, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window
    )
    return ManagerConfig(
        uniform_kv_cache_config(spec, 5), 8, True, "sha256", use_eagle, False, semantics
    )


def mm_offset(target: Any) -> dict[str, object]:
    """The same image at another offset inside an otherwise equal block."""
    first = Request("a", [0, 0], mm_positions=[PlaceholderRange(0, 1)], mm_hashes=["img-a"])
    second = Request("b", [0, 0], mm_positions=[PlaceholderRange(1, 1)], mm_hashes=["img-a"])
    seen: dict[str, object] = {}
    pools = (
        ("spec", spec_pool(4, True, target.adapter.semantics)),
        ("vllm", target.pool_factory(4, True, target.adapter.semantics)),
    )
    for side, pool in pools:
        pool.get_new_blocks(2)
        try:
            pool.cache_full_blocks(first, [1], [], 0, 1, 2, sha256)
            pool.cache_full_blocks(second, [2], [], 0, 1, 2, sha256)
            index = pool.snapshot().index
            seen[side] = sorted(ids for ids in index.values())
        except AssertionError as error:
            seen[side] = type(error).__name__
    return seen


def eagle_sliding_hit(target: Any) -> dict[str, object]:
    """An eagle lookup in a sliding window of 3 tokens, after a 3-token prompt was cached."""
    seen: dict[str, object] = {}
    config = sliding_config(window=3, use_eagle=True, semantics=target.adapter.semantics)
    for side, manager in (("spec", spec_manager(config)), ("vllm", target.manager_factory(config))):
        first = Request("a", [0, 0, 0])
        manager.get_computed_blocks(first)
        manager.allocate_slots(first, 3)
        seen[side] = manager.get_computed_blocks(Request("b", [0, 0, 0, 0]))
    return seen


def eagle_hybrid_hit(target: Any) -> dict[str, object]:
    """An eagle lookup with a full-attention and a sliding-window group (block size 1), after
    the same 3-token prompt was cached: how many tokens does the hit cover?"""
    specs = [
        FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="float16"),
        SlidingWindowSpec(
            block_size=1, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=2
        ),
    ]
    config = ManagerConfig(
        hybrid_kv_cache_config(specs, 9), 8, True, "sha256", True, False, target.adapter.semantics
    )
    seen: dict[str, object] = {}
    for side, manager in (("spec", spec_manager(config)), ("vllm", target.manager_factory(config))):
        first = Request("a", [0, 0, 0])
        manager.get_computed_blocks(first)
        manager.allocate_slots(first, 3)
        _, num_tokens = manager.get_computed_blocks(Request("b", [0, 0, 0]))
        seen[side] = num_tokens
    return seen


def preempted_lookup(target: Any) -> dict[str, object]:
    """`lookup_hashes_every_full_block`: a request preempted right after a step whose draft
    token was accepted (its newest full block computed, not yet cached), looked up again once
    another request cached that block: how many tokens does the hit cover?"""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="float16")
    flipped = replace(target.adapter.semantics, lookup_hashes_every_full_block=False)
    seen: dict[str, object] = {}
    sides = (
        ("spec", target.adapter.semantics),
        ("spec without the switch", flipped),
        ("vllm", target.adapter.semantics),
    )
    for side, semantics in sides:
        config = ManagerConfig(
            uniform_kv_cache_config(spec, 12), 10, True, "sha256", False, False, semantics
        )
        manager = target.manager_factory(config) if side == "vllm" else spec_manager(config)
        first = Request("a", [0, 0])
        manager.get_computed_blocks(first)
        manager.allocate_slots(first, 2)
        first.num_computed_tokens = 2
        first.append_output_token_ids(0)
        first.spec_token_ids = [0]
        manager.allocate_slots(first, 2)  # the sampled token and one draft
        first.spec_token_ids = []
        first.num_computed_tokens = 4  # the draft accepted
        first.append_output_token_ids([0, 0])
        manager.free(first)  # preempted
        first.num_computed_tokens = 0
        second = Request("b", [0, 0, 0, 0, 0, 1])
        manager.get_computed_blocks(second)
        manager.allocate_slots(second, 6)
        seen[side] = manager.get_computed_blocks(first)[1]
    return seen


def stale_parent(target: Any) -> dict[str, object]:
    """A request's block freed while it still lists it, reused by another request, then the
    request's next block cached: does it chain to the request's own hashes?"""
    first, second = Request("a", [0, 0, 1, 1]), Request("b", [2, 2])
    own = request_block_hashes(sha256, 2, first)[1]
    seen: dict[str, object] = {}
    pools = (
        ("spec", spec_pool(3, True, target.adapter.semantics)),
        ("vllm", target.pool_factory(3, True, target.adapter.semantics)),
    )
    for side, pool in pools:
        parent, child = pool.get_new_blocks(2)
        stored: list[Any] = []
        pool.cache_full_blocks(first, [parent, child], stored, 0, 1, 2, sha256)
        pool.free_blocks([parent])  # the request still lists it
        (reused,) = pool.get_new_blocks(1)
        pool.cache_full_blocks(second, [reused], [], 0, 1, 2, sha256)
        pool.cache_full_blocks(first, [parent, child], stored, 1, 2, 2, sha256)
        seen[side] = {
            "reused": reused == parent,
            "own chain": pool.snapshot().block_hash[child] == own,
        }
    return seen


def one_token_window(target: Any) -> dict[str, object]:
    """A full block computed under a one-token window: is it cached?"""
    seen: dict[str, object] = {}
    config = sliding_config(window=1, use_eagle=False, semantics=target.adapter.semantics)
    for side, manager in (("spec", spec_manager(config)), ("vllm", target.manager_factory(config))):
        request = Request("a", [0])
        manager.get_computed_blocks(request)
        manager.allocate_slots(request, 1)
        seen[side] = [h is not None for h in manager.snapshot().pool.block_hash]
    return seen


def null_ref_cnt(side: str, manager: Any) -> int:
    """The null block's `ref_cnt`: vLLM's from its pool adapter (its manager adapter leaves it
    out for 0.32.0), the spec's from its snapshot."""
    pool = manager.pool.snapshot() if side == "vllm" else manager.snapshot().pool
    return int(pool.ref_cnt[0])


def null_count(target: Any) -> dict[str, object]:
    """The null block's `ref_cnt` after an admission whose sliding-window hit starts with the
    null block, then after both requests are freed. vLLM 0.32.0 places a hit's skipped
    positions without touching them; the spec, under `null_block_refcounted`, touches every
    hit. vLLM 0.33.0 and its semantics count nothing."""
    seen: dict[str, object] = {}
    config = sliding_config(window=2, use_eagle=False, semantics=target.adapter.semantics)
    for side, manager in (("spec", spec_manager(config)), ("vllm", target.manager_factory(config))):
        first, second = Request("a", [0, 0, 0]), Request("b", [0, 0, 0, 1])
        manager.get_computed_blocks(first)
        manager.allocate_slots(first, 3)
        hits, num_hits = manager.get_computed_blocks(second)
        assert hits[0][0] == 0, hits  # the hit starts with the null block
        manager.allocate_slots(second, 4 - num_hits, hits)
        counts = [null_ref_cnt(side, manager)]
        manager.free(second)
        manager.free(first)
        counts.append(null_ref_cnt(side, manager))
        seen[side] = counts
    return seen


if __name__ == "__main__":
    try:
        against = prepare(sys.argv[1] if len(sys.argv) > 1 else "vllm==0.33.0")
    except SetupError as error:
        print(json.dumps({"setup_error": str(error)}))
        sys.exit(UNREACHABLE if _unreachable(error) else 2)
    report = {
        "mm_offset": mm_offset(against),
        "eagle_sliding_hit": eagle_sliding_hit(against),
        "one_token_window": one_token_window(against),
        "stale_parent": stale_parent(against),
        "eagle_hybrid_hit": eagle_hybrid_hit(against),
        "preempted_lookup": preempted_lookup(against),
        "null_count": null_count(against),
    }
    print(json.dumps(report))
