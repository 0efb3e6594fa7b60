"""How vLLM's code sees pagedkv's objects: one view per request, and torch's dtypes if need be.

vLLM reads attributes pagedkv's `Request` does not have (and some it names differently); each
adapter wraps a request in a view of its own. `RequestViews` keeps one view per request object,
so vLLM sees the same object at every call, as it would in a server. vLLM's KV cache specs
import torch only for dtypes; `torch_or_stand_in()` gives those without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from pagedkv.harness.protocol import ManagerConfig
from pagedkv.vocab.kv_cache_interface import (
    DTYPE_SIZES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.vocab.request import Request


class View(Protocol):
    """A view knows the request it shows."""

    @property
    def request(self) -> Request: ...


V = TypeVar("V", bound=View)


class RequestViews(Generic[V]):
    """One view per pagedkv request object, made by `make_view` on first sight."""

    def __init__(self, make_view: Callable[[Request], V]) -> None:
        self.make_view = make_view
        self.views: dict[int, V] = {}

    def __call__(self, request: Request) -> V:
        view = self.views.get(id(request))
        if view is None or view.request is not request:  # a new object may reuse a dead id
            view = self.views[id(request)] = self.make_view(request)
        return view

    def forget(self, request: Request) -> None:
        """Drop the request's view (a finished request: vLLM drops its object)."""
        self.views.pop(id(request), None)


def vllm_attention_spec(config: ManagerConfig, interface: Any, torch: Any, **extra: object) -> Any:
    """vLLM's spec (from its `interface` module) for the first KV cache group of `config`, with
    `extra` fields the release's spec takes."""
    return vllm_layer_spec(
        config.kv_cache_config.kv_cache_groups[0].kv_cache_spec, interface, torch, **extra
    )


def vllm_layer_spec(ours: object, interface: Any, torch: Any, **extra: object) -> Any:
    """vLLM's `FullAttentionSpec`, `SlidingWindowSpec`, `ChunkedLocalAttentionSpec` or
    `MambaSpec` for one of pagedkv's specs, with `extra` fields the release's spec takes."""
    if isinstance(ours, MambaSpec):
        return vllm_mamba_spec(ours, interface, torch, **extra)
    assert isinstance(ours, AttentionSpec), "the harness builds attention and Mamba specs only"
    common = {
        "block_size": ours.block_size,
        "num_kv_heads": ours.num_kv_heads,
        "head_size": ours.head_size,
        "dtype": getattr(torch, ours.dtype),
        **extra,
    }
    if isinstance(ours, SlidingWindowSpec):
        return interface.SlidingWindowSpec(**common, sliding_window=ours.sliding_window)
    if isinstance(ours, ChunkedLocalAttentionSpec):
        return interface.ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=ours.attention_chunk_size
        )
    return interface.FullAttentionSpec(**common)


class UnknownMambaTypeError(LookupError):
    """The loaded vLLM names no Mamba backend for a pagedkv `mamba_type`."""


def vllm_mamba_spec(ours: MambaSpec, interface: Any, torch: Any, **extra: object) -> Any:
    """vLLM 0.33's `MambaSpec` for pagedkv's: the same state shapes, dtypes (torch's), padded
    page, cache mode and extra blocks, `block_size` as given (max_model_len in mode "none"),
    and the backend `MambaAttentionBackendEnum` names `mamba_type` by ("mamba2" -> `MAMBA2`,
    "gdn_attn" -> `GDN_ATTN`). The fields pagedkv does not model keep vLLM's defaults (one
    head, no prefill checkpoint alignment, a state sharded across TP ranks), as
    `MambaBase.get_kv_cache_spec` leaves them.

    Raises:
        UnknownMambaTypeError: the loaded enum has no such member (the harness's stand-in for
            vLLM's backend registry names vLLM 0.33's five: MAMBA1, MAMBA2, SHORT_CONV, LINEAR,
            GDN_ATTN).
    """
    backends = interface.MambaAttentionBackendEnum
    name = ours.mamba_type.upper()
    if name not in backends.__members__:
        raise UnknownMambaTypeError(
            f"MambaSpec.mamba_type={ours.mamba_type!r}: the loaded vLLM's "
            f"MambaAttentionBackendEnum has no {name} (members: {', '.join(backends.__members__)})"
        )
    return interface.MambaSpec(
        block_size=ours.block_size,
        shapes=ours.shapes,
        dtypes=tuple(getattr(torch, dtype) for dtype in ours.dtypes),
        page_size_padded=ours.page_size_padded,
        mamba_type=backends[name],
        mamba_cache_mode=ours.mamba_cache_mode,
        num_speculative_blocks=ours.num_speculative_blocks,
        num_prefill_checkpoint_blocks=ours.num_prefill_checkpoint_blocks,
        **extra,
    )


def torch_or_stand_in() -> Any:
    """torch, or, where it is not installed, a module named `torch` holding only the dtypes
    KV cache specs name, pagedkv's (`DTYPE_SIZES`: attention caches and Mamba states) and so
    vLLM's (registered for vLLM's imports; call before importing them)."""
    try:
        import torch
    except ImportError:
        return _install_dtype_stand_in()
    return torch


def _install_dtype_stand_in() -> Any:
    class dtype:  # noqa: N801 - vLLM reads `torch.dtype`
        def __init__(self, name: str, itemsize: int) -> None:
            self.name = name
            self.itemsize = itemsize

        def __repr__(self) -> str:
            return f"torch.{self.name}"

    module: Any = ModuleType("torch", "pagedkv's stand-in: only the dtypes KV cache specs name")
    module.dtype = dtype
    for name, itemsize in DTYPE_SIZES.items():  # every dtype a pagedkv spec may name
        setattr(module, name, dtype(name, itemsize))
    sys.modules["torch"] = module
    return module
