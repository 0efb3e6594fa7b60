"""Building managers for tests: spec and impl behind the same id-based interface."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.harness.adapters import pagedkv_manager, spec_manager
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.semantics import PAGEDKV, Semantics

MakeManager = Callable[..., ManagerUnderTest]


def manager_config(
    *,
    block_size: int = 4,
    num_blocks: int = 10,
    max_model_len: int = 64,
    sliding_window: int | None = None,
    enable_caching: bool = True,
    hash_algo: str = "sha256",
    use_eagle: bool = False,
    log_stats: bool = False,
    semantics: Semantics = PAGEDKV,
) -> ManagerConfig:
    spec: KVCacheSpec
    if sliding_window is None:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16"
        )
    else:
        spec = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype="float16",
            sliding_window=sliding_window,
        )
    return ManagerConfig(
        uniform_kv_cache_config(spec, num_blocks),
        max_model_len,
        enable_caching,
        hash_algo,
        use_eagle,
        log_stats,
        semantics,
    )


MANAGER_FACTORIES = {"spec": spec_manager, "impl": pagedkv_manager}


def invariant_report(check: Callable[[], None]) -> tuple[str, str]:
    """What `check()` raised, as (invariant, detail); its message must be made of the two."""
    with pytest.raises(InvariantViolation) as info:
        check()
    error = info.value
    assert str(error) == f"invariant {error.invariant!r} violated: {error.detail}"
    return error.invariant, error.detail
