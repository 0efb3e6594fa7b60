"""Replace mode: pagedkv's `KVCacheManager` serves vLLM's scheduler through the methods and
shapes of vLLM's own manager.

Answers are vLLM's `KVCacheBlocks` over pagedkv's blocks (the scheduler reads only
`block_id`); prefix-cache stats are vLLM's own `PrefixCacheStats`, kept as vLLM's manager keeps
them, so vLLM's loggers and Prometheus metrics read them unchanged. Calls through the same
`Recorder` and `Replayer` as shadow mode: the trace of a replace run replays offline. A call or
argument pagedkv does not model raises `OutOfDomainError`; the engine refuses such
configurations at start (`pagedkv.vllm_plugin.domain`), so reaching one is a plugin bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.manager import KVCacheManager

from .domain import OutOfDomainError
from .recorder import Recorder, block_ids
from .replay import Replayer
from .trace import TraceSink


@dataclass(frozen=True)
class FacadeSingleTypeManager:
    """What vLLM's scheduler and engine core read of a per-group manager."""

    kv_cache_spec: Any
    block_size: int
    kv_cache_group_id: int


class FacadeCoordinator:
    """What vLLM reads of the coordinator: the groups' specs and sizes; no partial hits."""

    enable_partial_hash_hits = False

    def __init__(self, vllm_config: Any) -> None:
        self.single_type_managers = tuple(
            FacadeSingleTypeManager(group.kv_cache_spec, group.kv_cache_spec.block_size, index)
            for index, group in enumerate(vllm_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> int:
        raise OutOfDomainError("KV connectors", "coordinator.get_num_blocks_to_allocate")


class PagedKVFacade:
    """pagedkv's manager with vLLM 0.32's `KVCacheManager` surface (the scheduler's calls)."""

    mamba_shared_prefix_checkpoint = False

    def __init__(
        self,
        vllm_manager: Any,
        manager: KVCacheManager,
        recorder: Recorder,
        sink: TraceSink,
        kv_cache_blocks: type,
        prefix_cache_stats: type,
    ) -> None:
        self._manager = manager
        self._replayer = Replayer(manager)
        self._recorder = recorder
        self._sink = sink
        self._blocks = kv_cache_blocks
        self._stats_type = prefix_cache_stats
        self.kv_cache_config = vllm_manager.kv_cache_config
        self.max_model_len = vllm_manager.max_model_len
        self.enable_caching = vllm_manager.enable_caching
        self.use_eagle = False
        self.log_stats = vllm_manager.log_stats
        self.num_kv_cache_groups = len(self.kv_cache_config.kv_cache_groups)
        self.coordinator = FacadeCoordinator(self.kv_cache_config)
        self.prefix_cache_stats = prefix_cache_stats() if self.log_stats else None
        self.empty_kv_cache_blocks = kv_cache_blocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    def _call(self, call: str, request: Any | None, **fields: Any) -> Any:
        event = self._recorder.event(call, request, **fields)
        self._sink.write(event)
        self._replayer.apply(event)
        return self._replayer.answer

    def create_kv_cache_blocks(self, blocks: Any) -> Any:
        return self._blocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- admission and allocation ------------------------------------------------------------

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return bool(self.enable_caching and not request.skip_reading_prefix_cache)

    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]:
        hits, num_tokens, boundary = self._call("lookup", request)
        return self.create_kv_cache_blocks(tuple(hits)), num_tokens, boundary

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        for name, value in (
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("delay_cache_blocks", delay_cache_blocks),
            ("num_encoder_tokens", num_encoder_tokens),
            ("reserved_blocks", reserved_blocks),
        ):
            if value:
                raise OutOfDomainError(f"allocate_slots({name}=...)", f"got {value!r}")
        hits = [] if new_computed_blocks is None else block_ids(new_computed_blocks)
        num_hits = sum(len(group) for group in hits[:1]) * self._manager.block_size
        answer = self._call(
            "allocate",
            request,
            n=num_new_tokens,
            hits=hits,
            lookahead=self._recorder.lookahead(
                request, num_hits, num_new_tokens, num_lookahead_tokens
            ),
            fit=full_sequence_must_fit,
        )
        return None if answer is None else self.create_kv_cache_blocks(tuple(answer))

    def free(self, request: Any) -> None:
        finished = bool(request.is_finished())
        self._call("free", request, finished=finished)
        if finished:
            self._recorder.forget(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if not self._call("reset", None):
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # -- queries -----------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self._manager.usage

    def get_blocks(self, request_id: str) -> Any:
        return self._blocks(tuple(self._manager.get_blocks(request_id)))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._manager.get_block_ids(request_id)

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's estimate: per group, the end of the last block with a hash; the least over
        the groups."""
        cached: int | None = None
        size = self._manager.block_size
        for blocks in self._manager.get_blocks(request.request_id):
            group = max(
                (
                    (position + 1) * size
                    for position, block in enumerate(blocks)
                    if block.block_hash is not None and block.block_id != 0
                ),
                default=0,
            )
            cached = group if cached is None else min(cached, group)
        return cached or 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    # -- vLLM's stats, kept as vLLM's manager keeps them -------------------------------------

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> Any:
        if self.prefix_cache_stats is None:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._stats_type()
        return stats

    # -- queues for vLLM's workers, and those empty in pagedkv's domain ---------------------

    def take_events(self) -> list[Any]:
        return []

    def new_step_starts(self) -> None:
        """vLLM's scheduler calls it first in every step: the manager forgets the Mamba states
        keyed in the last one (a no-op without a Mamba group in mode "align")."""
        self._call("step", None)

    def take_new_block_ids(self) -> list[int]:
        """The attention blocks allocated since the last call, group by group, for vLLM's
        workers to zero: none unless a Mamba group (or mixed precision) needs it, as vLLM's
        manager records them (`Replayer`, trace line "zero")."""
        answer: list[int] = self._call("zero", None)
        return answer

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    # -- outside the domain ------------------------------------------------------------------

    @property
    def block_pool(self) -> Any:
        raise OutOfDomainError("KV connectors and deferred frees", "the scheduler read block_pool")

    def __getattr__(self, name: str) -> Any:
        # An AttributeError, so that getattr(manager, name, default) and hasattr still work.
        raise AttributeError(
            f"pagedkv's façade of vLLM's KVCacheManager has no {name!r} (outside pagedkv's "
            f"domain); PAGEDKV_VLLM=shadow runs vLLM's own manager"
        )

    def close(self) -> None:
        """Close the trace file (if one is written)."""
        self._sink.close()
