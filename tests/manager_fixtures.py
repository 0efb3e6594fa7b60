"""Building managers for tests: spec and impl behind the same id-based interface.

The harness speaks one list of ids per KV cache group. Tests of one group read better in flat
lists: `MANAGER_FACTORIES` gives both sides behind `OneGroupView`, which flattens that one
group's answers and wraps the hits it is given (`GROUP_FACTORIES` gives the per-group protocol
itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pagedkv.harness.adapters import pagedkv_manager, spec_manager
from pagedkv.harness.protocol import ManagerConfig, ManagerSnapshot, ManagerUnderTest
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    uniform_kv_cache_config,
)
from pagedkv.vocab.prefix_cache_stats import PrefixCacheStats
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, Semantics


class OneGroupView:
    """A manager under test of one KV cache group, seen in flat lists: its answers' one group,
    hits wrapped as that group's (any value: a wrong one reaches the manager in the group's
    place, so that the manager refuses it), its snapshot's blocks one tuple per request.

    Attributes:
        manager: the manager under test (per-group protocol).
    """

    def __init__(self, manager: ManagerUnderTest) -> None:
        self.manager = manager

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        hits, num_tokens = self.manager.get_computed_blocks(request)
        (group_hits,) = hits
        return list(group_hits), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        hits: Any = None if new_computed_blocks is None else (new_computed_blocks,)
        new = self.manager.allocate_slots(request, num_tokens, hits, num_lookahead_tokens)
        if new is None:
            return None
        (group_blocks,) = new
        return list(group_blocks)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self.manager.free_block_hashes(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        (count,) = self.manager.get_num_common_prefix_blocks(request, num_running_requests)
        return count

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.manager.make_prefix_cache_stats()

    def take_events(self) -> Any:
        return self.manager.take_events()  # type: ignore[attr-defined]

    @property
    def usage(self) -> float:
        return self.manager.usage

    def snapshot(self) -> ManagerSnapshot:
        snapshot = self.manager.snapshot()
        blocks: Any = {request_id: held[0] for request_id, held in snapshot.blocks.items()}
        return dataclasses.replace(snapshot, blocks=blocks)

    def check_invariants(self) -> None:
        self.manager.check_invariants()


def one_group(factory: Callable[[ManagerConfig], ManagerUnderTest]) -> Callable[..., OneGroupView]:
    """`factory`'s managers of one group, seen in flat lists."""

    def build(config: ManagerConfig) -> OneGroupView:
        return OneGroupView(factory(config))

    return build


MakeManager = Callable[..., OneGroupView]


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


GROUP_FACTORIES = {"spec": spec_manager, "impl": pagedkv_manager}
"""Both sides in the harness's per-group protocol."""

MANAGER_FACTORIES = {side: one_group(factory) for side, factory in GROUP_FACTORIES.items()}
"""Both sides of one group, seen in flat lists (`OneGroupView`)."""


def invariant_report(check: Callable[[], None]) -> tuple[str, str]:
    """What `check()` raised, as (invariant, detail); its message must be made of the two."""
    with pytest.raises(InvariantViolation) as info:
        check()
    error = info.value
    assert str(error) == f"invariant {error.invariant!r} violated: {error.detail}"
    return error.invariant, error.detail
