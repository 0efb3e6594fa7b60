"""Shadow mode: vLLM's own `KVCacheManager` serves the scheduler; every call is also made on
pagedkv's manager (the implementation, or the spec) and the answers compared.

vLLM's answers stay authoritative. Each mirrored call becomes one trace line
(`pagedkv.vllm_plugin.trace`) that `Replayer.apply` makes on pagedkv and checks against
vLLM's answer; every `snapshot_every` calls the whole state is compared too (usage, the free
queue's order, every request's blocks). At the first divergence, pagedkv failure, or call
pagedkv does not model, mirroring stops for the rest of the engine's life (leaving one
request out would change block ids for all), the event is logged once with the trace that
replays it, counted, and written to the summary; vLLM runs on. With `strict` it raises
`ShadowStoppedError` instead (inside the scheduler: the engine core stops).
"""

from __future__ import annotations

from typing import Any

from .recorder import Recorder, RequestOutOfDomainError, block_ids
from .replay import Divergence, Replayer
from .report import Report
from .trace import Event, TraceSink

# Calls that change nothing pagedkv mirrors (queries, vLLM's stats and events, the queues of
# Mamba states for a connector and of new blocks to zero, which only vLLM's workers read):
# forwarded, counted as unmirrored.
FORWARDED = frozenset(
    {
        "coordinator",
        "kv_cache_config",
        "empty_kv_cache_blocks",
        "enable_caching",
        "num_kv_cache_groups",
        "mamba_shared_prefix_checkpoint",
        "prefix_cache_stats",
        "log_stats",
        "max_model_len",
        "make_prefix_cache_stats",
        "record_prefix_cache_stats",
        "prefix_cache_lookup_enabled",
        "estimate_cached_tokens",
        "take_events",
        "take_boundary_state_offloads",
        "get_block_ids",
        "get_num_common_prefix_blocks",
        "create_kv_cache_blocks",
    }
)


class ShadowStoppedError(RuntimeError):
    """Strict shadow mode: pagedkv diverged from vLLM, failed, or met a call it does not
    model."""


class ShadowKVCacheManager:
    """vLLM's manager, with each call mirrored to pagedkv (module docstring)."""

    def __init__(
        self,
        vllm_manager: Any,
        replayer: Replayer,
        recorder: Recorder,
        sink: TraceSink,
        report: Report,
        *,
        strict: bool,
        snapshot_every: int,
    ) -> None:
        self._vllm = vllm_manager
        self._replayer = replayer
        self._recorder = recorder
        self._sink = sink
        self._report = report
        self._strict = strict
        self._snapshot_every = snapshot_every
        self._until_snapshot = snapshot_every
        self.active = True

    # -- mirrored calls ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Any) -> Any:
        answer = self._vllm.get_computed_blocks(request)
        if self.active:
            blocks, num_tokens, boundary = answer
            self._mirror(
                "lookup",
                request,
                vllm={"tokens": num_tokens, "blocks": block_ids(blocks), "boundary": boundary},
            )
        return answer

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
        answer = self._vllm.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
        if not self.active:
            return answer
        unmodelled = [
            name
            for name, value in (
                ("num_external_computed_tokens", num_external_computed_tokens),
                ("delay_cache_blocks", delay_cache_blocks),
                ("num_encoder_tokens", num_encoder_tokens),
                ("reserved_blocks", reserved_blocks),
            )
            if value
        ]
        if unmodelled or num_new_tokens == 0:
            self._stop(f"allocate_slots with {', '.join(unmodelled) or 'num_new_tokens 0'}")
            return answer
        hits = [] if new_computed_blocks is None else block_ids(new_computed_blocks)
        num_hits = sum(len(group) for group in hits[:1]) * self._block_size()
        self._mirror(
            "allocate",
            request,
            n=num_new_tokens,
            hits=hits,
            lookahead=self._recorder.lookahead(
                request, num_hits, num_new_tokens, num_lookahead_tokens
            ),
            fit=full_sequence_must_fit,
            vllm=None if answer is None else block_ids(answer),
        )
        return answer

    def get_blocks(self, request_id: str) -> Any:
        answer = self._vllm.get_blocks(request_id)
        if self.active:
            self._mirror("blocks", None, req=request_id, vllm=block_ids(answer))
        return answer

    def free(self, request: Any) -> None:
        self._vllm.free(request)
        if self.active:
            finished = bool(request.is_finished())
            self._mirror("free", request, finished=finished)
            if finished:
                self._recorder.forget(request.request_id)

    def new_step_starts(self) -> None:
        """A scheduler step begins: Mamba states keyed before it may hit from now on."""
        self._vllm.new_step_starts()
        if self.active:
            self._mirror("step", None)

    def take_new_block_ids(self) -> Any:
        """The new attention blocks vLLM's workers zero (for a Mamba model): compared with
        the blocks pagedkv allocated since the last call."""
        answer = self._vllm.take_new_block_ids()
        if self.active:
            self._mirror("zero", None, vllm=list(answer))
        return answer

    def take_kv_cache_block_copies(self) -> Any:
        """vLLM's copy-on-write copies of Mamba states, made only by partial hash hits (refused
        at start): any copy stops the mirror, as a call pagedkv does not model."""
        answer = self._vllm.take_kv_cache_block_copies()
        if self.active:
            copies, retained = answer
            if copies or retained:
                self._stop(f"take_kv_cache_block_copies answered {len(copies)} copies")
            else:
                self._report.unmirrored("take_kv_cache_block_copies")
        return answer

    def reset_prefix_cache(self) -> bool:
        answer: bool = self._vllm.reset_prefix_cache()
        if self.active:
            self._mirror("reset", None, vllm=answer)
        return answer

    @property
    def usage(self) -> float:
        usage: float = self._vllm.usage
        return usage

    def __getattr__(self, name: str) -> Any:
        # Only names this class does not define arrive here.
        value = getattr(self._vllm, name)
        if self.active:
            if name in FORWARDED:
                self._report.unmirrored(name)
            elif not name.startswith("__"):
                self._stop(f"{name} (pagedkv mirrors no such call)")
        return value

    # -- the mirror --------------------------------------------------------------------------

    def _block_size(self) -> int:
        size: int = self._replayer.manager.block_size
        return size

    def _mirror(self, call: str, request: Any | None, **fields: Any) -> None:
        try:
            event = self._recorder.event(call, request, **fields)
        except RequestOutOfDomainError as error:
            self._stop(str(error))
            return
        self._apply(event)
        if self.active:
            self._until_snapshot -= 1
            if self._until_snapshot == 0:
                self._until_snapshot = self._snapshot_every
                self._apply(self._recorder.event("snapshot", None, vllm=self._vllm_state()))

    def _apply(self, event: Event) -> None:
        self._sink.write(event)
        self._report.count(event["call"])
        try:
            divergence = self._replayer.apply(event)
        except Exception as error:  # pagedkv must never take vLLM down
            message = f"call #{event['i']} ({event['call']}): {type(error).__name__}: {error}"
            self._end("failure", event["call"], message)
            return
        if divergence is not None:
            self._end(divergence.what, event["call"], str(divergence), divergence)

    def _end(
        self, kind: str, call: str, message: str, divergence: Divergence | None = None
    ) -> None:
        self.active = False
        self._sink.write({"i": self._recorder.index, "call": "divergence", "message": message})
        trace = self._sink.dump()
        self._report.divergence(call, "failure" if divergence is None else kind, message, trace)
        self._report.stop(f"{'failure' if divergence is None else 'divergence'}: {message}")
        if self._strict:
            raise ShadowStoppedError(f"pagedkv shadow stopped at {message}; trace: {trace}")

    def _stop(self, reason: str) -> None:
        """Stop mirroring at a call or request pagedkv does not model (not a divergence)."""
        self.active = False
        self._sink.dump()
        self._report.stop(f"out of domain: {reason}")
        if self._strict:
            raise ShadowStoppedError(f"pagedkv shadow stopped: out of domain: {reason}")

    def _vllm_state(self) -> dict[str, Any]:
        vllm = self._vllm
        groups = [single.req_to_blocks for single in vllm.coordinator.single_type_managers]
        held = sorted({rid for group in groups for rid, blocks in group.items() if blocks})
        return {
            "usage": vllm.usage,
            "free": [
                block.block_id for block in vllm.block_pool.free_block_queue.get_all_free_blocks()
            ],
            "tables": {rid: block_ids([group.get(rid, ()) for group in groups]) for rid in held},
        }

    def close(self) -> None:
        self._report.write()
        self._sink.close()
