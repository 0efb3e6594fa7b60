"""Block-pool benchmark: impl vs spec on one operation stream, and impl at 1k vs 1M blocks.

A deterministic stream of block-pool calls (allocate a few blocks and cache them, look up a
prefix and touch the hits, free a sequence tail first, probe the index) is recorded once by
driving a pool, then replayed on fresh pools and timed. Every replay must end in the same state
as the recording, so the numbers are for correct work. Times are medians of several runs, and
ratios are taken within one run of this script.

    ./dev bench                    # default sizes
    ./dev bench --ops 50000 --runs 3 --json results/bench.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv import BlockHashType, BlockPool, Request
from pagedkv.harness.adapters import ObjectPoolAdapter, SpecPoolAdapter
from pagedkv.spec import SpecBlockPool

Op = tuple[str, Any]  # (call name, its arguments in block ids)
NO_TOKENS = Request("bench", [])  # every hash is given, so the request's tokens are never read


def _hash_fn(_: object) -> int:
    raise AssertionError("the stream gives every hash; nothing is hashed while timing")


@dataclass(frozen=True)
class Stream:
    """Recorded calls, in block ids, plus the state they must leave behind."""

    num_blocks: int
    ops: list[Op]
    final_free_order: tuple[int, ...]


def record_stream(num_blocks: int, num_ops: int, seed: int, max_live_blocks: int) -> Stream:
    """Drive a pool with a serving-like mix and record every call with its id arguments."""
    rng = random.Random(seed)
    driver = ObjectPoolAdapter(BlockPool(num_blocks, enable_caching=True))
    # 64 "documents", each a chain of 8 block hashes: sequences allocate and cache a document's
    # first blocks, and later sequences look the same prefix up, so hits and evictions happen.
    chains = [
        [BlockHashType(rng.getrandbits(64), (doc, i), None) for i in range(8)] for doc in range(64)
    ]
    live: list[list[int]] = []
    ops: list[Op] = []
    num_live_blocks = 0
    while len(ops) < num_ops:
        roll = rng.random()
        chain = chains[rng.randrange(len(chains))]
        length = rng.randint(1, 4)
        if roll < 0.35 and num_live_blocks + length <= max_live_blocks:
            block_ids = driver.get_new_blocks(length)
            ops.append(("get_new_blocks", length))
            driver.cache_full_blocks(NO_TOKENS, block_ids, chain[:length], 0, length, 16, _hash_fn)
            ops.append(("cache_full_blocks", (block_ids, chain[:length])))
        elif roll < 0.6:
            block_ids = []
            for block_hash in chain[:length]:
                ops.append(("get_cached_block", block_hash))
                block_id = driver.get_cached_block(block_hash)
                if block_id is None:
                    break
                block_ids.append(block_id)
            if not block_ids or num_live_blocks + len(block_ids) > max_live_blocks:
                continue
            driver.touch(block_ids)
            ops.append(("touch", block_ids))
        elif live:
            block_ids = live.pop(rng.randrange(len(live)))
            ordered = block_ids[::-1]  # tail first, as the manager frees
            driver.free_blocks(ordered)
            ops.append(("free_blocks", ordered))
            num_live_blocks -= len(block_ids)
            continue
        else:
            continue
        live.append(block_ids)
        num_live_blocks += len(block_ids)
    return Stream(num_blocks, ops, driver.snapshot().free_order)


def prepare(pool: BlockPool | SpecBlockPool, ops: list[Op]) -> Callable[[], None]:
    """A closure running `ops` on `pool`; ids become the pool's own block objects beforehand."""
    if isinstance(pool, BlockPool):
        objects = pool.blocks
        to_blocks: Callable[[list[int]], list[Any]] = lambda ids: [objects[i] for i in ids]  # noqa: E731
    else:
        to_blocks = list
    calls: list[Callable[[], object]] = []
    for name, arg in ops:
        if name == "get_new_blocks":
            calls.append(functools.partial(pool.get_new_blocks, arg))
        elif name == "cache_full_blocks":
            block_ids, hashes = arg
            calls.append(functools.partial(_cache, pool, to_blocks(block_ids), hashes))
        elif name == "get_cached_block":
            calls.append(functools.partial(pool.get_cached_block, arg))
        elif name == "touch":
            calls.append(functools.partial(pool.touch, to_blocks(arg)))
        else:
            calls.append(functools.partial(pool.free_blocks, to_blocks(arg)))

    def run() -> None:
        for call in calls:
            call()

    return run


def _cache(pool: BlockPool | SpecBlockPool, blocks: list[Any], hashes: list[BlockHashType]) -> None:
    pool.cache_full_blocks(NO_TOKENS, blocks, list(hashes), 0, len(blocks), 16, _hash_fn)


def time_stream(
    make_pool: Callable[[], BlockPool | SpecBlockPool], stream: Stream, runs: int
) -> float:
    """Median seconds of `runs` replays on fresh pools; each must end in the recorded state."""
    seconds = []
    for _ in range(runs):
        pool = make_pool()
        run = prepare(pool, stream.ops)
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
        adapter = ObjectPoolAdapter(pool) if isinstance(pool, BlockPool) else SpecPoolAdapter(pool)
        if adapter.snapshot().free_order != stream.final_free_order:
            raise AssertionError("a replay diverged from the recorded stream")
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000, help="calls per stream")
    parser.add_argument("--runs", type=int, default=5, help="replays per measurement (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)

    small, large, live = 1_000, 1_000_000, 400
    stream = record_stream(small, args.ops, args.seed, live)

    spec_seconds = time_stream(lambda: SpecBlockPool(small, True), stream, args.runs)
    impl_seconds = time_stream(lambda: BlockPool(small, True), stream, args.runs)
    large_stream = record_stream(large, args.ops, args.seed, live)
    large_seconds = time_stream(lambda: BlockPool(large, True), large_stream, args.runs)

    n = len(stream.ops)
    results = {
        "ops_per_stream": n,
        "runs": args.runs,
        "spec_ops_per_s_1k": n / spec_seconds,
        "impl_ops_per_s_1k": n / impl_seconds,
        "impl_over_spec_speed": spec_seconds / impl_seconds,
        "impl_ns_per_op_1k": impl_seconds / n * 1e9,
        "impl_ns_per_op_1m": large_seconds / len(large_stream.ops) * 1e9,
    }
    results["per_op_ratio_1m_over_1k"] = results["impl_ns_per_op_1m"] / results["impl_ns_per_op_1k"]
    print(f"pagedkv block-pool benchmark: {n:,} calls per stream, median of {args.runs} replays")
    print(f"  spec, 1,000 blocks        {results['spec_ops_per_s_1k']:>12,.0f} calls/s")
    print(f"  impl, 1,000 blocks        {results['impl_ops_per_s_1k']:>12,.0f} calls/s")
    print(f"  impl / spec speed         {results['impl_over_spec_speed']:>12.1f}x")
    print(f"  impl per call, 1k blocks  {results['impl_ns_per_op_1k']:>12,.0f} ns")
    print(f"  impl per call, 1M blocks  {results['impl_ns_per_op_1m']:>12,.0f} ns")
    ratio = results["per_op_ratio_1m_over_1k"]
    print(f"  1M / 1k per-call ratio    {ratio:>12.2f}  (O(1) calls: about 1)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
