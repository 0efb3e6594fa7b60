"""Re-drive pagedkv's manager (the implementation or the spec) from trace lines and compare
each answer with vLLM's.

`Replayer.apply` is the one place a trace line becomes pagedkv calls: shadow mode calls it
live after each of vLLM's answers, replace mode uses its answers, and `replay_trace` (behind
`pagedkv verify --replay-trace FILE`) runs a saved file through it offline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.manager import KVCacheManager
from pagedkv.vocab.kv_cache_interface import AttentionSpec, KVCacheSpec, MambaSpec
from pagedkv.vocab.request import PlaceholderRange, Request
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME

from .recorder import block_ids
from .trace import Event, config_from_json, read_trace


@dataclass(frozen=True)
class Divergence:
    """pagedkv answered a call otherwise than vLLM did."""

    index: int
    call: str
    request_id: str | None
    what: str
    vllm: Any
    pagedkv: Any

    def __str__(self) -> str:
        where = f" of request {self.request_id!r}" if self.request_id else ""
        return (
            f"call #{self.index} ({self.call}{where}): {self.what}: "
            f"vLLM {self.vllm!r}, pagedkv {self.pagedkv!r}"
        )


def build_manager(header: Event, side: str) -> Any:
    """pagedkv's manager (`side` "impl") or the spec's (`side` "spec") as the header built it."""
    config = config_from_json(header["config"])
    semantics = SEMANTICS_BY_NAME[header["semantics"]]
    arguments = (config, header["max_model_len"], header["enable_caching"], "sha256", False, False)
    if side == "spec":
        from pagedkv.spec.manager import SpecKVCacheManager

        return SpecKVCacheManager(
            *arguments,
            semantics=semantics,
            max_in_flight_tokens=header["max_in_flight_tokens"],
        )
    return KVCacheManager(
        *arguments,
        semantics=semantics,
        max_in_flight_tokens=header["max_in_flight_tokens"],
        debug_invariants=header.get("check_every", 0),
    )


class Replayer:
    """pagedkv's manager and its requests, driven by trace lines.

    Attributes:
        manager: the manager under comparison.
        answer: pagedkv's answer to the last line applied (its own block objects).
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.answer: Any = None
        self._requests: dict[str, Request] = {}
        self._hits: dict[str, Any] = {}
        specs = self._specs()
        dtypes = {spec.dtype for spec in specs if isinstance(spec, AttentionSpec)}
        zeroing = len(dtypes) > 1 or any(isinstance(spec, MambaSpec) for spec in specs)
        # vLLM's workers zero new attention blocks for a Mamba model or mixed precision (its
        # `KVCacheConfig.needs_kv_cache_zeroing`): each such group's new block ids, until taken.
        self._to_zero: dict[int, list[int]] = {
            index: []
            for index, spec in enumerate(specs)
            if zeroing and isinstance(spec, AttentionSpec)
        }

    def apply(self, event: Event) -> Divergence | None:
        """Make the line's call on pagedkv; the first difference from vLLM's answer, if the
        line holds one. pagedkv's own refusals propagate (a failure, not a divergence)."""
        call = event["call"]
        # A line that names a request object carries its state ("computed"); "blocks" names an id.
        request = self._request(event) if "computed" in event else None
        manager = self.manager
        if call == "lookup":
            assert request is not None
            hits, num_tokens = manager.get_computed_blocks(request)
            self._hits[request.request_id] = hits
            self.answer = (hits, num_tokens, manager.shared_prefix_boundary(request.request_id))
            return self._compare_lookup(event, request)
        if call == "allocate":
            assert request is not None
            hits = self._hits.pop(request.request_id, None) if any(event["hits"]) else None
            if hits is not None and block_ids(hits) != event["hits"]:
                return self._diverged(event, "hits passed back", event["hits"], block_ids(hits))
            self.answer = manager.allocate_slots(
                request,
                event["n"],
                hits,
                event["lookahead"],
                full_sequence_must_fit=event["fit"],
            )
            ours = None if self.answer is None else block_ids(self.answer)
            for index, new in self._to_zero.items():
                new.extend(ours[index] if ours is not None else ())
            if "vllm" in event and ours != event["vllm"]:
                return self._diverged(event, "new blocks", event["vllm"], ours)
            return None
        if call == "blocks":
            return self._compare(event, "blocks held", self._table(event["req"]))
        if call == "free":
            assert request is not None
            manager.free(request)
            self._hits.pop(request.request_id, None)
            if event["finished"]:
                manager.free_block_hashes(request)
                del self._requests[request.request_id]
            return None
        if call == "reset":
            self.answer = manager.reset_prefix_cache()
            return self._compare(event, "reset succeeded", self.answer)
        if call == "step":
            manager.new_step_starts()
            return None
        if call == "zero":
            self.answer = [block for new in self._to_zero.values() for block in new]
            for new in self._to_zero.values():
                new.clear()
            return self._compare(event, "blocks to zero", self.answer)
        if call == "snapshot":
            return self._compare_snapshot(event)
        raise ValueError(f"trace line {event.get('i')}: unknown call {call!r}")

    # -- requests ----------------------------------------------------------------------------

    def _request(self, event: Event) -> Request:
        request_id = event["req"]
        new = event.get("new")
        if new is not None:
            request = Request(
                request_id,
                new["prompt"],
                mm_positions=[PlaceholderRange(offset, length) for _, offset, length in new["mm"]],
                mm_hashes=[identifier for identifier, _, _ in new["mm"]],
                lora_id=new["lora"],
                cache_salt=new["salt"],
                prompt_logprobs=new["logprobs"],
            )
            self._requests[request_id] = request
        else:
            request = self._requests[request_id]
        added = event.get("add")
        if added:
            request.append_output_token_ids(added)
        request.num_computed_tokens = event["computed"]
        return request

    # -- comparisons -------------------------------------------------------------------------

    def _diverged(self, event: Event, what: str, vllm: Any, ours: Any) -> Divergence:
        return Divergence(event["i"], event["call"], event.get("req"), what, vllm, ours)

    def _compare(self, event: Event, what: str, ours: Any) -> Divergence | None:
        if "vllm" in event and event["vllm"] != ours:
            return self._diverged(event, what, event["vllm"], ours)
        return None

    def _compare_lookup(self, event: Event, request: Request) -> Divergence | None:
        if "vllm" not in event:
            return None
        vllm = event["vllm"]
        hits, num_tokens, boundary = self.answer
        if vllm["tokens"] != num_tokens:
            return self._diverged(event, "hit tokens", vllm["tokens"], num_tokens)
        if vllm["blocks"] != block_ids(hits) and (num_tokens or any(vllm["blocks"])):
            return self._diverged(event, "hit blocks", vllm["blocks"], block_ids(hits))
        if self._sparse() and vllm["boundary"] != boundary:
            return self._diverged(event, "shared-prefix boundary", vllm["boundary"], boundary)
        return None

    def _compare_snapshot(self, event: Event) -> Divergence | None:
        vllm = event["vllm"]
        usage = self.manager.usage
        usage = usage() if callable(usage) else usage
        if abs(vllm["usage"] - usage) > 1e-9:
            return self._diverged(event, "usage", vllm["usage"], usage)
        free = self._free_order()
        if vllm["free"] != free:
            return self._diverged(event, "free queue order", vllm["free"], free)
        tables = {request_id: self._table(request_id) for request_id in self._held()}
        if vllm["tables"] != tables:
            return self._diverged(event, "block tables", vllm["tables"], tables)
        return None

    # -- pagedkv's state, impl or spec -------------------------------------------------------

    def _sparse(self) -> bool:
        """Whether pagedkv keeps shared-prefix junctions (else vLLM's boundary is not
        pagedkv's): under a retention interval, or with a Mamba group in mode "align" (vLLM's
        scheduler cuts chunks at the junction whatever the retention)."""
        manager = self.manager
        if isinstance(manager, KVCacheManager):
            retention = manager.kv_cache_config.prefix_cache_retention_interval
        else:
            retention = manager.retention_interval
        return retention is not None or any(
            isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
            for spec in self._specs()
        )

    def _specs(self) -> list[KVCacheSpec]:
        manager = self.manager
        if isinstance(manager, KVCacheManager):
            return [group.kv_cache_spec for group in manager.kv_cache_config.kv_cache_groups]
        return list(manager.specs)

    def _groups(self) -> Sequence[Mapping[str, Sequence[Any]]]:
        manager = self.manager
        if isinstance(manager, KVCacheManager):
            return [single.req_to_blocks for single in manager.coordinator.single_type_managers]
        return [single.blocks for single in manager.managers]

    def _held(self) -> Iterable[str]:
        return sorted({rid for group in self._groups() for rid, held in group.items() if held})

    def _table(self, request_id: str) -> list[list[int]]:
        return block_ids([group.get(request_id, ()) for group in self._groups()])

    def _free_order(self) -> list[int]:
        manager = self.manager
        if not isinstance(manager, KVCacheManager):
            return list(manager.pool.free_order)
        ids: list[int] = []
        block = manager.block_pool.free_block_queue.free_list_head
        limit = manager.num_gpu_blocks
        while block is not None and len(ids) <= limit:
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


@dataclass
class ReplayResult:
    """What an offline replay found: how many lines it applied and the first divergence."""

    header: Event
    side: str
    calls: int = 0
    divergence: Divergence | None = None
    failure: str | None = None
    recorded: list[str] = field(default_factory=list)


def replay_trace(path: str, side: str = "impl") -> ReplayResult:
    """Re-drive pagedkv's `side` from the trace at `path` until vLLM's answers and its part.

    A divergence recorded in the file (shadow mode writes one line "divergence" at the end)
    is listed in `recorded`; the replay finds its own.
    """
    header, calls = read_trace(path)
    result = ReplayResult(header, side)
    replayer = Replayer(build_manager(header, side))
    for event in calls:
        if event["call"] == "divergence":
            result.recorded.append(event["message"])
            continue
        if result.divergence is not None or result.failure is not None:
            continue  # read on only for what the run recorded
        try:
            result.divergence = replayer.apply(event)
        except Exception as error:  # reported, as shadow mode reports it
            name = type(error).__name__
            result.failure = f"call #{event['i']} ({event['call']}): {name}: {error}"
            continue
        result.calls += 1
    return result
