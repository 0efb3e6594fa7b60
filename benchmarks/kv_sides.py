"""The two managers a side-by-side benchmark drives: pagedkv's, and vLLM 0.8.5's own code.

A `Side` builds a manager (block size 16, full attention, prefix caching on) and the request
objects that manager reads. vLLM's modules are fetched at run time, never committed
(`pagedkv.harness.vllm.wheel.source_tree`); its requests are `VllmShapedRequest`s, written here
to cost what vLLM's own `Request` costs the manager: plain attributes, a read-only token view
whose indexing is a Python method, `num_tokens` a property.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, overload

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1 << 18  # room for the 128k-token prompt


@dataclass(frozen=True)
class Side:
    """One manager implementation, as the benchmarks build and feed it."""

    name: str
    make_manager: Callable[[int, str], Any]  # (num_blocks, caching_hash_algo) -> manager
    make_request: Callable[[str, Sequence[int]], Any]  # (request_id, prompt) -> request


def pagedkv_side(name: str, kv_events: bool = False) -> Side:
    """pagedkv's `KVCacheManager` and `Request`, from whichever build `pagedkv` imports; with
    `kv_events`, its managers queue KV cache events (left queued: the emitting is timed)."""
    from pagedkv import FullAttentionSpec, KVCacheManager, Request, uniform_kv_cache_config

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bf16")

    def make_manager(num_blocks: int, hash_algo: str) -> KVCacheManager:
        config = uniform_kv_cache_config(spec, num_blocks)
        # Passed only when on, so the same side drives a build without events (an older one).
        events: dict[str, Any] = {"enable_kv_cache_events": True} if kv_events else {}
        return KVCacheManager(config, MAX_MODEL_LEN, caching_hash_algo=hash_algo, **events)

    return Side(name, make_manager, Request)


class _ReadOnlyTokens(Sequence[int]):
    """A read-only view of a token list, indexed by a Python method (as vLLM's ConstantList)."""

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)


class VllmShapedRequest:
    """What vLLM 0.8.5's KV cache manager reads of a request, laid out as vLLM's `Request` is."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.request_id = request_id
        self.sampling_params = SimpleNamespace(prompt_logprobs=None)
        self.lora_request = None
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.mm_positions: list[Any] = []
        self.mm_hashes: list[str] = []
        self.output_token_ids = _ReadOnlyTokens(self._output_token_ids)
        self.all_token_ids = _ReadOnlyTokens(self._all_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)


def fetch_vllm_modules() -> Path:
    """vLLM 0.8.5's KV cache modules with their stand-ins, fetched once into pagedkv's cache."""
    from pagedkv.harness.vllm import v0_8_5
    from pagedkv.harness.vllm.wheel import source_tree

    return source_tree("0.8.5", v0_8_5.MODULES, v0_8_5.STAND_INS)


def vllm_side(modules: Path) -> Side:
    """vLLM 0.8.5's `KVCacheManager`, imported from `modules` (see `fetch_vllm_modules`)."""
    sys.path.insert(0, str(modules))
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16, False)

    def make_manager(num_blocks: int, hash_algo: str) -> Any:
        tensors = {"layers.0": KVCacheTensor(spec.page_size_bytes * num_blocks)}
        config = KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(["layers.0"], spec)])
        return KVCacheManager(config, MAX_MODEL_LEN, True, hash_algo)

    return Side("vLLM 0.8.5", make_manager, VllmShapedRequest)
