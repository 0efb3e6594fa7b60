"""Setup errors are not divergences: factories are tried before a campaign and watched during it.

A factory that raises (a missing attribute in an adapter, a constructor that takes other
arguments) would otherwise fail the campaign's first step and be reported as a divergence
found after 0 steps. `check_pool_factory` and `check_manager_factory` build and observe a few
objects first; `Guarded` wraps a factory for the campaign and keeps the first error it raises,
so the report can call it a setup error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.harness.protocol import ManagerConfig, ManagerFactory, PoolFactory
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.semantics import Semantics


class SetupError(Exception):
    """The implementation under test could not be set up: nothing was checked yet."""


@dataclass
class Guarded:
    """A factory that remembers the first exception it raised (as a `SetupError`)."""

    factory: Any
    target: str
    error: SetupError | None = field(default=None)

    def __call__(self, *args: Any) -> Any:
        try:
            return self.factory(*args)
        except Exception as error:
            if self.error is None:
                self.error = SetupError(f"{self.target} raised {error!r} when called with {args}")
                self.error.__cause__ = error
            raise self.error from error


def _observe(built: Any, call: str, target: str) -> None:
    try:
        built.snapshot()
        built.check_invariants()
    except Exception as error:
        message = f"{target}: the object from {call} cannot be observed: {error!r}"
        raise SetupError(message) from error


def check_pool_factory(factory: PoolFactory, target: str, semantics: Semantics) -> None:
    """Build pools with caching on and off and observe them.

    Raises:
        SetupError: the factory or its pool's `snapshot()` / `check_invariants()` raised.
    """
    for caching in (True, False):
        call = f"{target}(4, {caching}, {semantics.name})"
        try:
            pool = factory(4, caching, semantics)
        except Exception as error:
            raise SetupError(f"{call} raised {error!r}") from error
        _observe(pool, call, target)


def probe_configs(semantics: Semantics) -> list[ManagerConfig]:
    """Manager configurations covering the campaign's switches: attention type, caching, eagle,
    stats and both hash functions."""
    full: KVCacheSpec = FullAttentionSpec(
        block_size=2, num_kv_heads=1, head_size=1, dtype="float16"
    )
    sliding = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=5
    )
    return [
        ManagerConfig(uniform_kv_cache_config(spec, 4), 8, caching, algo, eagle, stats, semantics)
        for spec in (full, sliding)
        for caching, algo, eagle, stats in (
            (True, "sha256", False, True),
            (False, "builtin", True, False),
        )
    ]


def check_manager_factory(factory: ManagerFactory, target: str, semantics: Semantics) -> None:
    """Build managers over `probe_configs` and observe them.

    Raises:
        SetupError: the factory or its manager's `snapshot()` / `check_invariants()` raised.
    """
    for config in probe_configs(semantics):
        spec = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        call = f"{target}(ManagerConfig({type(spec).__name__}, caching={config.enable_caching}))"
        try:
            manager = factory(config)
        except Exception as error:
            raise SetupError(f"{call} raised {error!r}") from error
        _observe(manager, call, target)
