"""One manager operation at a time, on prepared state, for any `Side`.

Each `Operation` prepares a manager and requests (untimed), then its run makes `ops` calls of one
kind; the check afterwards asserts the calls did what the operation is named for, so a side that
took a shortcut would fail rather than look fast. Requests use distinct tokens unless the
operation is about shared ones. Block size 16 throughout (`kv_sides.BLOCK_SIZE`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_sides import BLOCK_SIZE, Side

Run = Callable[[], object]
Check = Callable[[object], None]
Setup = Callable[[Side, Any, int], tuple[Run, Check]]  # (side, manager, ops)


@dataclass(frozen=True)
class Operation:
    """A named kind of call, how many per timed run, and the pool size it needs."""

    name: str
    ops: int
    num_blocks: int
    setup: Setup


_next_token = itertools.count(1)
_next_request = itertools.count(1)


def request_id(kind: str) -> str:
    """An id never used before in this process, so prepared managers can be reused."""
    return f"{kind}{next(_next_request)}"


def unique_tokens(count: int) -> list[int]:
    """Tokens no other request of this process shares (so no accidental prefix hits)."""
    return [next(_next_token) for _ in range(count)]


def admit(manager: Any, request: Any) -> int:
    """Look the request up and allocate its whole prompt; it is then computed. Returns hits."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert blocks is not None, "the pool is too small for the prepared state"
    request.num_computed_tokens = request.num_tokens
    return int(num_hit_tokens)


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"the timed calls did not {what}")


def _decoding(side: Side, manager: Any, count: int, prompt_len: int) -> list[Any]:
    """`count` running requests, prompt computed, one sampled token waiting to be scheduled."""
    requests = []
    for _ in range(count):
        request = side.make_request(request_id("d"), unique_tokens(prompt_len))
        admit(manager, request)
        request.append_output_token_ids(next(_next_token))
        requests.append(request)
    return requests


def decode_inside_a_block(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """32 running requests, round robin; every step stays inside its last block (21 of 32)."""
    running = _decoding(side, manager, 32, 20)
    sequence = [running[i % len(running)] for i in range(ops)]
    allocate = manager.allocate_slots

    def run() -> object:
        for request in sequence:
            allocate(request, 1)
        return allocate(running[0], 1)

    return run, lambda result: _expect(
        list(side.blocks_of(result)) == [], "stay inside the last block"
    )


def decode_fills_a_block(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """Each step completes the request's block, which is then hashed and cached."""
    requests = _decoding(side, manager, ops, BLOCK_SIZE - 1)
    allocate = manager.allocate_slots

    def run() -> object:
        return [allocate(request, 1) for request in requests]

    def check(results: Any) -> None:
        cached = side.num_cached(manager)
        _expect(all(list(side.blocks_of(r)) == [] for r in results), "allocate nothing")
        _expect(all(cached[r.request_id] == 1 for r in requests), "cache one block each")

    return run, check


def decode_needs_a_new_block(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """Each step starts a new block: one block from the free queue, nothing to hash."""
    requests = _decoding(side, manager, ops, BLOCK_SIZE)
    allocate = manager.allocate_slots

    def run() -> object:
        return [allocate(request, 1) for request in requests]

    def check(results: Any) -> None:
        _expect(all(len(side.blocks_of(r)) == 1 for r in results), "get a block")

    return run, check


def _prefill(
    side: Side, manager: Any, prompts: list[list[int]], expected_hit_tokens: int
) -> tuple[Run, Check]:
    requests = [side.make_request(request_id("p"), prompt) for prompt in prompts]
    lookup = manager.get_computed_blocks
    allocate = manager.allocate_slots

    def run() -> object:
        hit_tokens = []
        for request in requests:
            hits, num_hit_tokens = lookup(request)
            if allocate(request, request.num_tokens - num_hit_tokens, hits) is None:
                return None
            hit_tokens.append(num_hit_tokens)
        return hit_tokens

    return run, lambda result: _expect(
        result == [expected_hit_tokens] * len(prompts), f"admit with {expected_hit_tokens} hits"
    )


def prefill_without_hits(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """Look up and allocate a new 512-token prompt: 32 blocks hashed, allocated and cached."""
    return _prefill(side, manager, [unique_tokens(512) for _ in range(ops)], 0)


def prefill_with_hits(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """A 528-token prompt whose first 512 tokens another request holds: 32 hits, 1 new block."""
    prefix = unique_tokens(512)
    admit(manager, side.make_request(request_id("holder"), prefix))
    prompts = [prefix + unique_tokens(BLOCK_SIZE) for _ in range(ops)]
    return _prefill(side, manager, prompts, 512)


def _lookup(side: Side, manager: Any, ops: int, num_tokens: int) -> tuple[Run, Check]:
    """Fresh requests whose whole prompt is cached: every block hashed, all but the last hit."""
    prompt = unique_tokens(num_tokens)
    admit(manager, side.make_request(request_id("holder"), prompt))
    requests = [side.make_request(request_id("l"), prompt) for _ in range(ops)]
    lookup = manager.get_computed_blocks

    def run() -> object:
        return [lookup(request)[1] for request in requests]

    expected = num_tokens - BLOCK_SIZE  # the last full block is recomputed, never a hit
    return run, lambda result: _expect(result == [expected] * ops, "hit the cached prompt")


def lookup_1k_tokens(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    return _lookup(side, manager, ops, 1_024)


def lookup_32k_tokens(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    return _lookup(side, manager, ops, 32_768)


def free_a_request(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """A finished request's 32 cached blocks go back to the free queue, and its hashes go."""
    requests = [side.make_request(request_id("f"), unique_tokens(512)) for _ in range(ops)]
    for request in requests:
        admit(manager, request)
    free = manager.free
    free_hashes = manager.free_block_hashes

    def run() -> object:
        for request in requests:
            free(request)
            free_hashes(request)
        return manager.block_pool.get_num_free_blocks()

    all_free = manager.num_gpu_blocks - 1
    return run, lambda result: _expect(result == all_free, "free every block")


def lookup_128k_tokens_cold(side: Side, manager: Any, ops: int) -> tuple[Run, Check]:
    """A 131,072-token prompt nothing of which is cached: 8,192 blocks hashed, one miss."""
    requests = [side.make_request(request_id("long"), unique_tokens(1 << 17)) for _ in range(ops)]
    lookup = manager.get_computed_blocks

    def run() -> object:
        return [lookup(request)[1] for request in requests]

    return run, lambda result: _expect(result == [0] * ops, "miss")


def operations(scale: int) -> list[Operation]:
    """The per-operation table; `scale` divides the number of calls per run (quick runs)."""

    def n(ops: int) -> int:
        return max(ops // scale, 1)

    return [
        Operation("decode inside a block", n(16_000), 2_000, decode_inside_a_block),
        Operation("decode fills a block", n(1_000), 2_000, decode_fills_a_block),
        Operation("decode needs a new block", n(900), 2_000, decode_needs_a_new_block),
        Operation("prefill 512 tokens, no hits", n(60), 2_000, prefill_without_hits),
        Operation("prefill 528 tokens, 512 hit", n(200), 2_000, prefill_with_hits),
        Operation("lookup 1k tokens, cached", n(200), 2_000, lookup_1k_tokens),
        Operation("lookup 32k tokens, cached", n(4), 4_096, lookup_32k_tokens),
        Operation("free 32 blocks + hashes", n(60), 2_000, free_a_request),
    ]
