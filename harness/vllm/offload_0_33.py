"""vLLM 0.33.0's own CPU offload tier (`CPUOffloadingManager` with its LRU and ARC policies) as
a tier under test, answering in pagedkv's vocabulary (`pagedkv.vocab.offload`).

`source_tree(VERSION, MEMBERS, STAND_INS)` fetches the wheel members below (by range requests,
cached in ~/.cache/pagedkv) beside stand-ins written for this purpose (not taken from vLLM) for
what they import but the tier never uses: the logger, the connector's stats record, KV hints.
Import it in a process where no other vllm tree is imported (its root goes first on sys.path).

`VllmOffloadTier` translates: one `ReqContext` per request id, given the request's key
positions before each call; vLLM's chunk-id arrays become tuples; its events, pagedkv's
`OffloadEvent`s; its state (chunks and their `ref_cnt`, the chunk pool, the policy's ranks or
lists, the offer counts, each request's access record) an `OffloadTierSnapshot`, so that whole
states are compared, not only answers. vLLM checks misuse with asserts or not at all, so only
calls a scheduler makes are sent to it (docs/semantics.md, "The CPU offload tier").
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pagedkv.harness.vllm.views import torch_or_stand_in
from pagedkv.vocab.offload import (
    AccessSnapshot,
    LookupResult,
    OffloadEvent,
    OffloadKey,
    OffloadRequest,
    OffloadTierConfig,
    OffloadTierSnapshot,
    StoreOutput,
)

VERSION = "0.33.0"
MEMBERS = (
    "vllm/utils/math_utils.py",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/kv_offload/base.py",
    "vllm/v1/kv_offload/config.py",
    "vllm/v1/kv_offload/cpu/common.py",
    "vllm/v1/kv_offload/cpu/manager.py",
    "vllm/v1/kv_offload/cpu/policies/base.py",
    "vllm/v1/kv_offload/cpu/policies/factory.py",
    "vllm/v1/kv_offload/cpu/policies/lru.py",
    "vllm/v1/kv_offload/cpu/policies/arc.py",
)
_PACKAGES = (
    "vllm/__init__.py",
    "vllm/utils/__init__.py",
    "vllm/v1/__init__.py",
    "vllm/v1/metrics/__init__.py",
    "vllm/v1/kv_offload/__init__.py",
    "vllm/v1/kv_offload/cpu/__init__.py",
    "vllm/v1/kv_offload/cpu/policies/__init__.py",
    "vllm/distributed/__init__.py",
    "vllm/distributed/kv_transfer/__init__.py",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/__init__.py",
)
STAND_INS: dict[str, str] = {name: "" for name in _PACKAGES}
STAND_INS["vllm/logger.py"] = """
import logging


class _Logger(logging.LoggerAdapter):
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    def info_once(self, *args, **kwargs):
        self.info(*args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
"""
STAND_INS["vllm/v1/kv_hints/__init__.py"] = """
class KvHintsEnvelope:
    pass
"""
STAND_INS["vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py"] = """
class OffloadingConnectorStats:
    def set_gauge(self, name, value):
        pass

    def observe_histogram(self, name, value):
        pass

    def increase_counter(self, name, value):
        pass
"""


def install_torch_stand_in() -> None:
    """torch, or a stand-in that also names `Tensor` (base.py annotates a field with it)."""
    torch = torch_or_stand_in()
    if not hasattr(torch, "Tensor"):
        torch.Tensor = type("Tensor", (), {})


class VllmOffloadTier:
    """vLLM 0.33.0's `CPUOffloadingManager` (tree at `root`, on sys.path) behind pagedkv's
    tier surface, with events on."""

    def __init__(self, root: Path, config: OffloadTierConfig) -> None:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        install_torch_stand_in()
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu import manager

        self._base: Any = base
        self._manager_module: Any = manager
        self.manager: Any = manager.CPUOffloadingManager(
            num_chunks=config.num_chunks,
            cache_policy=config.policy,
            enable_events=True,
            store_threshold=config.store_threshold,
            max_tracker_size=config.max_tracker_size,
        )
        self._contexts: dict[str, Any] = {}

    def _context(self, request: OffloadRequest) -> Any:
        context = self._contexts.get(request.req_id)
        if context is None:
            context = self._contexts[request.req_id] = self._base.ReqContext(request.req_id)
        for key, position in request.key_positions.items():
            context.set_offload_key_position(key, position)
        return context

    def lookup(self, key: OffloadKey, request: OffloadRequest) -> LookupResult:
        result = self.manager.lookup(key, self._context(request))
        return LookupResult[result.name]

    def prepare_load(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> tuple[int, ...]:
        spec = self.manager.prepare_load(list(keys), self._context(request))
        return tuple(int(chunk) for chunk in spec.block_ids)

    def complete_load(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None:
        self.manager.complete_load(list(keys), self._context(request))

    def touch(self, keys: Collection[OffloadKey], request: OffloadRequest) -> None:
        self.manager.touch(list(keys), self._context(request))

    def prepare_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest
    ) -> StoreOutput | None:
        out = self.manager.prepare_store(list(keys), self._context(request))
        if out is None:
            return None
        return StoreOutput(
            tuple(out.keys_to_store),
            tuple(int(chunk) for chunk in out.store_spec.block_ids),
            tuple(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None:
        self.manager.complete_store(list(keys), self._context(request), success)

    def on_request_finished(self, request: OffloadRequest) -> None:
        self.manager.on_request_finished(self._context(request))

    def reset_cache(self) -> None:
        self.manager.reset_cache()

    def take_events(self) -> list[OffloadEvent]:
        return [
            OffloadEvent(tuple(event.keys), event.removed, event.metadata_only)
            for event in self.manager.take_events()
        ]

    def check_invariants(self) -> None:
        """vLLM states none; its state is held to the spec's through `snapshot`."""

    def snapshot(self) -> OffloadTierSnapshot:
        manager, policy = self.manager, self.manager._policy
        chunks = dict(policy.chunks) if hasattr(policy, "chunks") else {**policy.t1, **policy.t2}
        counts = manager.counts if manager.counts is not None else {}
        return OffloadTierSnapshot(
            refs=tuple(sorted((key, int(chunk.ref_cnt)) for key, chunk in chunks.items())),
            chunk_ids=tuple(sorted((key, int(chunk.chunk_id)) for key, chunk in chunks.items())),
            freed_ids=tuple(manager._free_list),
            num_fresh_used=manager._num_allocated_chunks,
            policy=self._policy_snapshot(policy),
            offer_counts=tuple(counts.items()),
            accesses=self._accesses(),
            events=tuple(
                OffloadEvent(tuple(event.keys), event.removed, event.metadata_only)
                for event in manager.events
            ),
        )

    def _policy_snapshot(self, policy: Any) -> tuple[tuple[str, object], ...]:
        if hasattr(policy, "t1"):
            return (
                ("t1", tuple(policy.t1)),
                ("t2", tuple(policy.t2)),
                ("b1", tuple(policy.b1)),
                ("b2", tuple(policy.b2)),
                ("target", policy.target_t1_size),
            )
        lru = sys.modules["vllm.v1.kv_offload.cpu.policies.lru"]
        request_ranks = {}
        for req_id, context in self._contexts.items():
            state = context.get_state(lru._RequestRank)
            current = state is not None and state.owner is policy
            if current and state.cache_generation == policy._cache_generation:
                request_ranks[req_id] = state.rank
        return (
            ("ranks", tuple(sorted(policy._ranks.items()))),
            ("next_rank", policy._next_rank),
            ("request_ranks", tuple(sorted(request_ranks.items()))),
        )

    def _accesses(self) -> tuple[tuple[str, AccessSnapshot], ...]:
        manager = self.manager
        records = []
        for req_id in sorted(self._contexts):
            state = self._contexts[req_id].get_state(self._manager_module._RequestCacheAccess)
            if state is None or state.owner is not manager:
                continue
            if state.cache_generation != manager._cache_generation:
                continue
            records.append(
                (
                    req_id,
                    AccessSnapshot(
                        tuple((g, tuple(state.key_groups[g])) for g in sorted(state.key_groups)),
                        tuple(sorted(state.inserted_keys)),
                        tuple(sorted(state.reused_keys)),
                        tuple(sorted(state.store_miss_keys)),
                        state.finished,
                    ),
                )
            )
        return tuple(records)
