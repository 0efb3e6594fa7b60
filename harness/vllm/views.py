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
from pagedkv.vocab.kv_cache_interface import AttentionSpec, SlidingWindowSpec
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
    """vLLM's `FullAttentionSpec` or `SlidingWindowSpec` (from its `interface` module) for the
    one KV cache group of `config`, with `extra` fields the release's spec takes."""
    ours = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(ours, AttentionSpec), "the harness builds attention specs only"
    common = {
        "block_size": ours.block_size,
        "num_kv_heads": ours.num_kv_heads,
        "head_size": ours.head_size,
        "dtype": getattr(torch, ours.dtype),
        **extra,
    }
    if isinstance(ours, SlidingWindowSpec):
        return interface.SlidingWindowSpec(**common, sliding_window=ours.sliding_window)
    return interface.FullAttentionSpec(**common)


def torch_or_stand_in() -> Any:
    """torch, or, where it is not installed, a module named `torch` holding only the dtypes
    vLLM's KV cache specs name (registered for vLLM's imports; call before importing them)."""
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

    itemsizes = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}
    module: Any = ModuleType("torch", "pagedkv's stand-in: only the dtypes vLLM's specs name")
    module.dtype = dtype
    for name, itemsize in itemsizes.items():
        setattr(module, name, dtype(name, itemsize))
    sys.modules["torch"] = module
    return module
