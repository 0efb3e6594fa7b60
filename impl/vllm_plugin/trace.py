"""The call trace: every KV cache manager call vLLM's scheduler made, in pagedkv's terms.

One JSON Lines file. Line 1 is the header (`TRACE_FORMAT`, the vLLM and pagedkv versions, the
mode, the semantics and the manager's construction); each further line is one call, with the
request it names, the tokens the request gained since its last line, its computed tokens,
the call's arguments, and, when vLLM's own manager answered it (shadow mode), vLLM's answer
under "vllm". `pagedkv.vllm_plugin.replay` re-drives pagedkv from it; shadow mode does exactly
that, live, one call at a time, so an offline replay takes the path the engine took.

Call lines ("call" key):
    lookup    get_computed_blocks           vllm: {tokens, blocks, boundary}
    allocate  allocate_slots: n, hits, lookahead, fit           vllm: block ids or None
    blocks    get_blocks                    vllm: block ids per group
    free      free: finished (then also the request's hashes are dropped)
    reset     reset_prefix_cache            vllm: bool
    step      new_step_starts (a scheduler step begins: Mamba states keyed before now hit)
    zero      take_new_block_ids, with a Mamba group    vllm: the new attention block ids
    snapshot  the whole state               vllm: {usage, free, tables}
A request's first line carries "new": its identity (prompt, salt, LoRA id, prompt logprobs,
multimodal ranges); later lines "add": the tokens appended since.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

TRACE_FORMAT = "pagedkv-vllm-trace/1"

Event = dict[str, Any]


class TraceFormatError(ValueError):
    """A file that is not a pagedkv vLLM trace, or a line it cannot read."""


def spec_to_json(spec: KVCacheSpec) -> dict[str, Any]:
    if isinstance(spec, MambaSpec):
        return {
            "kind": "MambaSpec",
            "block_size": spec.block_size,
            "shapes": [list(shape) for shape in spec.shapes],
            "dtypes": list(spec.dtypes),
            "page_size_padded": spec.page_size_padded,
            "mamba_type": spec.mamba_type,
            "mamba_cache_mode": spec.mamba_cache_mode,
        }
    if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec):
        raise TraceFormatError(
            f"a trace holds attention and Mamba specs only, not {type(spec).__name__}"
        )
    data: dict[str, Any] = {
        "kind": type(spec).__name__,
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": spec.dtype,
        "use_mla": spec.use_mla,
    }
    if isinstance(spec, SlidingWindowSpec):
        data["sliding_window"] = spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        data["attention_chunk_size"] = spec.attention_chunk_size
    return data


def spec_from_json(data: dict[str, Any]) -> KVCacheSpec:
    if data["kind"] == "MambaSpec":
        return MambaSpec(
            block_size=data["block_size"],
            shapes=data["shapes"],
            dtypes=data["dtypes"],
            page_size_padded=data["page_size_padded"],
            mamba_type=data["mamba_type"],
            mamba_cache_mode=data["mamba_cache_mode"],
        )
    fields = {key: data[key] for key in ("block_size", "num_kv_heads", "head_size", "dtype")}
    kind = data["kind"]
    if kind == "FullAttentionSpec":
        return FullAttentionSpec(**fields, use_mla=data["use_mla"])
    if kind == "SlidingWindowSpec":
        return SlidingWindowSpec(
            **fields, use_mla=data["use_mla"], sliding_window=data["sliding_window"]
        )
    if kind == "ChunkedLocalAttentionSpec":
        return ChunkedLocalAttentionSpec(
            **fields, use_mla=data["use_mla"], attention_chunk_size=data["attention_chunk_size"]
        )
    raise TraceFormatError(f"unknown spec kind {kind!r}")


def config_to_json(config: KVCacheConfig) -> dict[str, Any]:
    return {
        "num_blocks": config.num_blocks,
        "groups": [
            {"layers": list(group.layer_names), "spec": spec_to_json(group.kv_cache_spec)}
            for group in config.kv_cache_groups
        ],
        "retention": config.prefix_cache_retention_interval,
    }


def config_from_json(data: dict[str, Any]) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(tuple(group["layers"]), spec_from_json(group["spec"]))
        for group in data["groups"]
    ]
    tensors = {
        name: KVCacheTensor(size=group.kv_cache_spec.page_size_bytes * data["num_blocks"])
        for group in groups
        for name in group.layer_names
    }
    return KVCacheConfig(
        data["num_blocks"],
        tensors,
        groups,
        prefix_cache_retention_interval=data["retention"],
    )


class TraceSink:
    """Where a run's trace lines go: a file in `directory` as they come (buffered; flushed at
    a divergence and at close), or, without a directory, memory, up to `limit` lines (past it
    the trace is dropped and `complete` turns False: a later divergence has no replay)."""

    def __init__(self, header: Event, directory: str | None, limit: int) -> None:
        self.header = header
        self.limit = limit
        self.complete = True
        self.path: str | None = None
        self._file: IO[str] | None = None
        self._lines: list[str] = []
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            fd, self.path = tempfile.mkstemp(
                prefix=f"pagedkv-vllm-{os.getpid()}-", suffix=".jsonl", dir=directory
            )
            self._file = os.fdopen(fd, "w", encoding="utf-8")
            self._file.write(json.dumps(header) + "\n")

    def write(self, event: Event) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        elif self.complete:
            if len(self._lines) >= self.limit:
                self.complete = False  # from here on a line costs nothing
                self._lines.clear()
            else:
                self._lines.append(json.dumps(event, separators=(",", ":")))

    def dump(self) -> str | None:
        """The trace as a file (written now when it was kept in memory), or None if dropped."""
        if self._file is not None:
            self._file.flush()
            return self.path
        if not self.complete:
            return None
        fd, path = tempfile.mkstemp(prefix=f"pagedkv-vllm-{os.getpid()}-", suffix=".jsonl")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(self.header) + "\n")
            out.writelines(line + "\n" for line in self._lines)
        self.path = path
        return path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str) -> tuple[Event, Iterator[Event]]:
    """The header and the call lines of a trace file.

    Raises:
        TraceFormatError: the file does not start with a header of `TRACE_FORMAT`.
    """
    handle = open(path, encoding="utf-8")  # noqa: SIM115 (closed by the generator)
    first = handle.readline()
    try:
        header = json.loads(first)
    except json.JSONDecodeError as error:
        handle.close()
        raise TraceFormatError(f"{path}: line 1 is not JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        handle.close()
        raise TraceFormatError(f"{path}: not a {TRACE_FORMAT} trace")

    def calls() -> Iterator[Event]:
        with handle:
            for number, line in enumerate(handle, start=2):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TraceFormatError(f"{path}:{number}: {error}") from None
                yield event

    return header, calls()
