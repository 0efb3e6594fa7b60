"""vLLM 0.33.0's (or 0.32.0's) own `KVCacheManager` against pagedkv's on KV cache groups of
several block sizes with prefix caching (no EAGLE), step by step.

    python tests/vllm_033_mixed_block_sizes.py [0.33.0|0.32.0] < cases.json

Each case on stdin names the groups (`groups`: `["full", B]`, `["window", B, W]` or
`["chunked", B, C]`), the pool (`num_blocks`), the retention interval (`retention`, null for
dense), and the seeds and the steps per seed. Each seed drives both managers alike with a small
scheduler over requests sharing prefixes: arrivals, admissions with hits, a connector's external
tokens (their cache sometimes delayed until the load lands: `cache_blocks`) and chunked
prefill, decode steps, preemption on a full pool, `evict_blocks` (a failed load's), finishing.
After every call the answers (hits, hit tokens, new block ids per group) and the state (the free
queue head to tail, which blocks carry a primary hash, every request's block ids per group, how
many secondary "partial" keys index each block, the index's entries) must be equal. pagedkv
runs `KVCacheManager` under `vllm-0.33` (`vllm-0.32`) with its invariants checked after each
call. Prints one
JSON line: per case the calls compared and the hits seen, or the first difference. Exit status
3: the package index is unreachable and nothing is cached.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from vllm_campaign import UNREACHABLE, _unreachable

from pagedkv import KVCacheManager, Request
from pagedkv.harness.adapters import free_order
from pagedkv.harness.vllm.stand_ins_0_33 import PLANNING_MODULES, PLANNING_STAND_INS
from pagedkv.harness.vllm.views import torch_or_stand_in, vllm_layer_spec
from pagedkv.harness.vllm.wheel import FetchError, source_tree
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from pagedkv.vocab.semantics import VLLM_0_32, VLLM_0_33

MAX_MODEL_LEN = 1024
RELEASE = sys.argv[1] if len(sys.argv) > 1 else "0.33.0"
"""The release checked, "0.33.0" or "0.32.0" (pagedkv under `vllm-0.33` or `vllm-0.32`)."""


def pagedkv_spec(group: list[Any]) -> KVCacheSpec:
    kind, block_size = group[0], group[1]
    common: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": "float16",
    }
    if kind == "window":
        return SlidingWindowSpec(**common, sliding_window=group[2])
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=group[2])
    return FullAttentionSpec(**common)


def pagedkv_config(specs: list[KVCacheSpec], num_blocks: int, retention: int | None) -> Any:
    return KVCacheConfig(
        num_blocks,
        {f"layer.{g}": KVCacheTensor(s.page_size_bytes * num_blocks) for g, s in enumerate(specs)},
        [KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
        prefix_cache_retention_interval=retention,
    )


class Vllm:
    """vLLM 0.33.0's manager, built as its scheduler builds it (S and H from the sizes)."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, retention: int | None) -> None:
        torch = torch_or_stand_in()
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as interface
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.request import RequestStatus

        from pagedkv.harness.vllm.v0_33 import RequestView

        kv_cache_utils.init_none_hash(sha256)
        ours = pagedkv_config(specs, num_blocks, retention)
        hash_size, scheduler_size = ours.hash_block_size, ours.scheduler_block_size
        groups = [
            interface.KVCacheGroupSpec([f"layer.{g}"], vllm_layer_spec(spec, interface, torch))
            for g, spec in enumerate(specs)
        ]
        config = interface.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
            **({"hash_block_size": hash_size} if RELEASE == "0.33.0" else {}),
        )
        self.manager = VllmManager(
            config,
            MAX_MODEL_LEN,
            scheduler_block_size=scheduler_size,
            hash_block_size=hash_size,
            enable_caching=True,
        )
        hasher = kv_cache_utils.get_request_block_hasher(hash_size, sha256)
        self.view_of = lambda request: RequestView(request, hasher)
        self.status = RequestStatus
        self.views: dict[str, Any] = {}
        self.running: set[str] = set()
        self.hits: Any = None

    def _view(self, request: Request) -> Any:
        view = self.views.setdefault(request.request_id, self.view_of(request)).refresh()
        running = request.request_id in self.running
        view.status = self.status.RUNNING if running else self.status.WAITING
        return view

    def lookup(self, request: Request) -> tuple[Any, int]:
        view = self._view(request)
        blocks, num_tokens, view.shared_prefix_boundary = self.manager.get_computed_blocks(view)
        self.hits = blocks
        return [[b.block_id for b in group] for group in blocks.blocks], num_tokens

    def allocate(
        self,
        request: Request,
        num_tokens: int,
        num_hit_tokens: int,
        external: int = 0,
        delay: bool = False,
    ) -> Any:
        hits = self.hits if num_hit_tokens else None
        new = self.manager.allocate_slots(
            self._view(request),
            num_tokens,
            num_hit_tokens,
            hits,
            num_external_computed_tokens=external,
            delay_cache_blocks=delay,
        )
        self.hits = None
        if new is None:
            return None
        self.running.add(request.request_id)
        return [[block.block_id for block in group] for group in new.blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        self.manager.cache_blocks(self._view(request), num_tokens)

    def evict_blocks(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks(set(block_ids))

    def free(self, request: Request) -> None:
        view = self._view(request)
        self.manager.free(view)
        if request.request_id in self.running:
            self.running.discard(request.request_id)
            view.num_preemptions += 1

    def state(self) -> Any:
        pool = self.manager.block_pool
        managers = self.manager.coordinator.single_type_managers
        held = {
            request_id: [[b.block_id for b in m.req_to_blocks[request_id]] for m in managers]
            for request_id in managers[0].req_to_blocks
        }
        secondary = pool.cached_block_hashes_by_block
        return (
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            [block.block_hash is not None for block in pool.blocks],
            {request_id: lists for request_id, lists in held.items() if any(lists)},
            {block_id: len(keys) for block_id, keys in secondary.items() if keys},
            sum(
                len(blocks) if isinstance(blocks, dict) else 1
                for blocks in pool.cached_block_hash_to_block._cache.values()
            ),
        )


class Pagedkv:
    """pagedkv's `KVCacheManager` under vllm-0.33, invariants checked after each call."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, retention: int | None) -> None:
        self.manager = KVCacheManager(
            pagedkv_config(specs, num_blocks, retention),
            MAX_MODEL_LEN,
            semantics=VLLM_0_33 if RELEASE == "0.33.0" else VLLM_0_32,
            debug_invariants=True,
        )
        self.hits: Any = None

    def lookup(self, request: Request) -> tuple[Any, int]:
        self.hits, num_tokens = self.manager.get_computed_blocks(request)
        return [[b.block_id for b in group] for group in self.hits], num_tokens

    def allocate(
        self,
        request: Request,
        num_tokens: int,
        num_hit_tokens: int,
        external: int = 0,
        delay: bool = False,
    ) -> Any:
        hits = self.hits if num_hit_tokens else None
        new = self.manager.allocate_slots(
            request,
            num_tokens,
            hits,
            num_external_computed_tokens=external,
            delay_cache_blocks=delay,
        )
        self.hits = None
        return None if new is None else [[block.block_id for block in group] for group in new]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        self.manager.cache_blocks(request, num_tokens)

    def evict_blocks(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks(sorted(set(block_ids)))

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def state(self) -> Any:
        pool = self.manager.block_pool
        managers = self.manager.coordinator.single_type_managers
        return (
            list(free_order(pool.free_block_queue, len(pool.blocks))),
            [block.block_hash is not None for block in pool.blocks],
            {
                request_id: [[b.block_id for b in m.req_to_blocks[request_id]] for m in managers]
                for request_id in managers[0].req_to_blocks
            },
            {block_id: len(keys) for block_id, keys in pool.partial_keys.items()},
            sum(len(blocks) for blocks in pool.cached_block_hash_to_block.values()),
        )


class Different(AssertionError):
    pass


def run(case: dict[str, Any], seed: int) -> dict[str, int]:
    """One seed of `case`: both managers driven alike, compared after every call."""
    rng = random.Random(seed)
    specs = [pagedkv_spec(group) for group in case["groups"]]
    sides = [Vllm(specs, case["num_blocks"], case["retention"])]
    sides.append(Pagedkv(specs, case["num_blocks"], case["retention"]))  # type: ignore[arg-type]
    largest = max(spec.block_size for spec in specs)
    prefixes = [[rng.randint(1, 9) for _ in range(rng.randint(largest, 4 * largest))] for _ in "ab"]
    pairs: dict[str, tuple[Request, Request]] = {}
    waiting: list[str] = []
    running: list[str] = []
    seen = {
        "calls": 0,
        "admitted with hits": 0,
        "admitted with external tokens": 0,
        "hit tokens": 0,
        "preempted": 0,
        "evict_blocks": 0,
    }

    def both(what: str, call: Any, pair: tuple[Request, Request]) -> Any:
        answers = [call(side, request) for side, request in zip(sides, pair, strict=True)]
        states = [side.state() for side in sides]
        if answers[0] != answers[1] or states[0] != states[1]:
            raise Different(f"seed {seed}, {what} of {pair[0].request_id}: {answers} {states}")
        seen["calls"] += 1
        return answers[0]

    for arrivals in range(case["steps"]):
        op = rng.random()
        if op < 0.25 or not (waiting or running):
            tokens = rng.choice([*prefixes, []])
            tokens = tokens + [rng.randint(1, 9) for _ in range(rng.randint(1, largest + 3))]
            request_id = f"r{arrivals}"
            pairs[request_id] = (Request(request_id, tokens), Request(request_id, tokens))
            waiting.append(request_id)
        elif op < 0.5 and waiting:
            request_id = waiting.pop(rng.randrange(len(waiting)))
            pair = pairs[request_id]
            _, num_hit = both("lookup", lambda side, request: side.lookup(request), pair)
            remaining = pair[0].num_tokens - num_hit
            external = rng.randint(1, remaining - 1) if remaining > 1 and rng.random() < 0.3 else 0
            delay = bool(external) and rng.random() < 0.5
            num_tokens = rng.randint(1, remaining - external)
            new = both(
                "admission",
                lambda side, request, n=num_tokens, h=num_hit, e=external, d=delay: side.allocate(
                    request, n, h, e, d
                ),
                pair,
            )
            if new is None:
                waiting.append(request_id)
                continue
            for request in pair:
                request.num_computed_tokens = num_hit + external + num_tokens
            running.append(request_id)
            seen["admitted with hits"] += bool(num_hit)
            seen["admitted with external tokens"] += bool(external)
            seen["hit tokens"] += num_hit
            if delay:  # the load lands
                landed = num_hit + external
                both("cache_blocks", lambda s, r, n=landed: s.cache_blocks(r, n), pair)
        elif op < 0.9 and running:
            request_id = rng.choice(running)
            pair = pairs[request_id]
            if pair[0].num_computed_tokens == pair[0].num_tokens:
                if pair[0].num_tokens + 1 > MAX_MODEL_LEN:
                    continue
                token = rng.randint(1, 9)
                for request in pair:
                    request.append_output_token_ids(token)
                num_tokens = 1
            else:
                num_tokens = rng.randint(1, pair[0].num_tokens - pair[0].num_computed_tokens)
            new = both(
                "step",
                lambda side, request, n=num_tokens: side.allocate(request, n, 0),
                pair,
            )
            if new is None:  # preempted
                both("free", lambda side, request: side.free(request), pair)
                for request in pair:
                    request.num_computed_tokens = 0
                running.remove(request_id)
                waiting.append(request_id)
                seen["preempted"] += 1
            else:
                for request in pair:
                    request.num_computed_tokens += num_tokens
        elif running and rng.random() < 0.3:  # a connector's failed load: evict some blocks
            pair = pairs[rng.choice(running)]
            block_ids = [rng.randrange(1, case["num_blocks"]) for _ in range(rng.randint(1, 4))]
            both("evict_blocks", lambda s, r, ids=block_ids: s.evict_blocks(ids), pair)
            seen["evict_blocks"] += 1
        elif running:
            request_id = running.pop(rng.randrange(len(running)))
            both("free", lambda side, request: side.free(request), pairs[request_id])
    return seen


def check(case: dict[str, Any]) -> dict[str, Any]:
    totals: dict[str, int] = {}
    try:
        for seed in range(case["seeds"]):
            for name, count in run(case, seed).items():
                totals[name] = totals.get(name, 0) + count
    except Different as difference:
        return {"difference": str(difference)[:4000]}
    return totals


def main() -> int:
    cases = json.load(sys.stdin)
    try:
        if RELEASE == "0.32.0":
            from pagedkv.harness.vllm import v0_32

            root = source_tree("0.32.0", v0_32.MODULES, v0_32.STAND_INS)
        else:
            root = source_tree("0.33.0", PLANNING_MODULES, PLANNING_STAND_INS)
    except FetchError as error:
        print(json.dumps({"setup_error": str(error)}))
        return UNREACHABLE if _unreachable(error) else 2
    sys.path.insert(0, str(root))
    print(json.dumps([check(case) for case in cases]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
