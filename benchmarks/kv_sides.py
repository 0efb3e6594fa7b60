"""The managers a side-by-side benchmark drives: pagedkv's, and vLLM's own code (0.8.5, 0.33.0).

A `Side` builds a manager (block size 16, full attention, prefix caching on) and the request
objects that manager reads. vLLM's modules are fetched at run time, never committed
(`pagedkv.harness.vllm.wheel.source_tree`); its requests are written here to cost what vLLM's
own `Request` costs the manager: plain attributes, a read-only token view whose indexing is a
Python method, `num_tokens` a property (`VllmShapedRequest`, `Vllm033ShapedRequest`).

vLLM 0.33.0 hashes a request's full blocks on the request, as its tokens arrive, and its calls
take and return other types; `Vllm033Manager` (a subclass of its `KVCacheManager`) takes the
calls the benchmarks make. Its request hashes the blocks it gained when the manager next reads
them, at the start of `get_computed_blocks` and `allocate_slots` (`update_block_hashes`, the
call vLLM's request makes when tokens are appended and at construction): the same work as
vLLM's, done inside the timed calls as pagedkv's hashing is, whatever the benchmark prepares
untimed. The subclass's translation costs vLLM one Python call per manager call.
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
VLLM_033 = "0.33.0"


def _flat(answer: Any) -> Any:
    """A flat answer's blocks: the list itself (vLLM 0.8.5's)."""
    return answer


def _first_group(answer: Any) -> Any:
    """The one KV cache group's blocks of an answer per group (pagedkv's, vLLM 0.33's)."""
    return answer[0]


def _own_num_cached(manager: Any) -> Any:
    return manager.num_cached_block


def _group_num_cached(manager: Any) -> Any:
    return manager.coordinator.single_type_managers[0].num_cached_block


@dataclass(frozen=True)
class Side:
    """One manager implementation, as the benchmarks build and feed it. Each answers in its own
    shape (the timed calls pass a lookup's hits back as they came); the checks read the one KV
    cache group's blocks of an answer through `blocks_of`, its cached-block counts through
    `num_cached`."""

    name: str
    make_manager: Callable[[int, str], Any]  # (num_blocks, caching_hash_algo) -> manager
    make_request: Callable[[str, Sequence[int]], Any]  # (request_id, prompt) -> request
    blocks_of: Callable[[Any], Any] = _flat  # a lookup's hits or new blocks -> a sequence
    num_cached: Callable[[Any], Any] = _own_num_cached  # manager -> request id -> count


def pagedkv_side(name: str, kv_events: bool = False, semantics: str = "pagedkv") -> Side:
    """pagedkv's `KVCacheManager` and `Request`, from whichever build `pagedkv` imports; with
    `kv_events`, its managers queue KV cache events (left queued: the emitting is timed); under
    `semantics` (a name of `pagedkv.vocab.semantics.SEMANTICS_BY_NAME`)."""
    from pagedkv import FullAttentionSpec, KVCacheManager, Request, uniform_kv_cache_config
    from pagedkv.vocab.semantics import SEMANTICS_BY_NAME

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bf16")

    def make_manager(num_blocks: int, hash_algo: str) -> KVCacheManager:
        config = uniform_kv_cache_config(spec, num_blocks)
        # Passed only when needed, so the same side drives an older build.
        extra: dict[str, Any] = {"enable_kv_cache_events": True} if kv_events else {}
        if semantics != "pagedkv":
            extra["semantics"] = SEMANTICS_BY_NAME[semantics]
        return KVCacheManager(config, MAX_MODEL_LEN, caching_hash_algo=hash_algo, **extra)

    return Side(name, make_manager, Request, _first_group, _group_num_cached)


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


def fetch_vllm_modules(version: str = "0.8.5") -> Path:
    """vLLM `version`'s KV cache modules (0.8.5 or 0.33.0) with their stand-ins, fetched once
    into pagedkv's cache."""
    from pagedkv.harness.vllm.wheel import source_tree

    if version == VLLM_033:
        from pagedkv.harness.vllm import stand_ins_0_33

        return source_tree(VLLM_033, stand_ins_0_33.MODULES, stand_ins_0_33.STAND_INS)
    from pagedkv.harness.vllm import v0_8_5

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


class Vllm033ShapedRequest:
    """What vLLM 0.33.0's KV cache manager reads of a request, laid out as its `Request` is:
    plain attributes, and the hashes of its full blocks in a list."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], running: object) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        self.output_token_ids = _ReadOnlyTokens(self._output_token_ids)
        self.all_token_ids = _ReadOnlyTokens(self._all_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.status = running  # only the watermark reads it, and the watermark is 0
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.skip_reading_prefix_cache = False
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.session_id = None

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


def vllm_033_side(modules: Path) -> Side:
    """vLLM 0.33.0's `KVCacheManager`, imported from `modules` (`fetch_vllm_modules("0.33.0")`),
    behind the calls the benchmarks make. Its hash functions: "sha256" is vLLM's (SHA-256 of
    the pickled key, as bytes); vLLM 0.33.0 has no "builtin", so that name gives `hash()` as
    8 bytes, the nearest equivalent of vLLM 0.8.5's builtin hash."""
    from pagedkv.harness.vllm.views import torch_or_stand_in

    sys.path.insert(0, str(modules))
    torch = torch_or_stand_in()  # before vLLM's modules import it
    from vllm.utils.hashing import sha256
    from vllm.v1 import kv_cache_interface as interface
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    def builtin_bytes(key: object) -> bytes:
        return hash(key).to_bytes(8, "little", signed=True)

    hash_fns = {"sha256": sha256, "builtin": builtin_bytes}
    spec = interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )

    class Vllm033Manager(KVCacheManager):  # type: ignore[misc]
        """vLLM 0.33.0's manager taking pagedkv's calls: hits and new blocks one list per KV
        cache group (its `KVCacheBlocks.blocks`)."""

        def __init__(self, num_blocks: int, hasher: Callable[[Any], list[bytes]]) -> None:
            page = spec.page_size_bytes
            size = page * num_blocks
            config = interface.KVCacheConfig(
                num_blocks,
                [interface.KVCacheTensor(size, ["layers.0"], size, page)],
                [interface.KVCacheGroupSpec(["layers.0"], spec)],
            )
            super().__init__(
                config, MAX_MODEL_LEN, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE
            )
            self.num_gpu_blocks = num_blocks
            self.hasher = hasher

        def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
            request.block_hashes.extend(self.hasher(request))
            blocks, num_tokens, _ = super().get_computed_blocks(request)
            return blocks.blocks, num_tokens

        def allocate_slots(self, request: Any, num_tokens: int, hits: Any = None) -> Any:
            request.block_hashes.extend(self.hasher(request))
            if hits and hits[0]:
                computed = self.create_kv_cache_blocks(hits)
                blocks = super().allocate_slots(
                    request, num_tokens, len(hits[0]) * BLOCK_SIZE, computed
                )
            else:
                blocks = super().allocate_slots(request, num_tokens)
            return None if blocks is None else blocks.blocks

        def free_block_hashes(self, request: Any) -> None:
            """vLLM 0.33.0 keeps hashes on the request: nothing to drop."""

    seeded: list[str] = []

    def make_manager(num_blocks: int, hash_algo: str) -> Any:
        hash_fn = hash_fns[hash_algo]
        if seeded != [hash_algo]:  # vLLM seeds every chain from a NONE_HASH of its hash
            kv_cache_utils.init_none_hash(hash_fn)
            seeded[:] = [hash_algo]
        hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        return Vllm033Manager(num_blocks, hasher)

    def make_request(request_id: str, prompt: Sequence[int]) -> Vllm033ShapedRequest:
        return Vllm033ShapedRequest(request_id, prompt, RequestStatus.RUNNING)

    return Side(f"vLLM {VLLM_033}", make_manager, make_request, _first_group, _group_num_cached)
