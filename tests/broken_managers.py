"""Deliberately broken KV cache managers: the request-level harness must catch each one.

Each factory has the `ManagerFactory` signature (`pagedkv verify --manager-impl
broken_managers:NAME`, with `tests/` on PYTHONPATH).
"""

from __future__ import annotations

from pagedkv.block import KVCacheBlock
from pagedkv.harness.adapters import ObjectManagerAdapter
from pagedkv.harness.protocol import ManagerConfig, ManagerUnderTest
from pagedkv.manager import KVCacheManager
from pagedkv.single_type import SlidingWindowManager
from pagedkv.vocab.request import Request


def _build(cls: type[KVCacheManager], config: ManagerConfig) -> ManagerUnderTest:
    return ObjectManagerAdapter(config.build(cls))


class ForwardFreeManager(KVCacheManager):
    """free releases blocks head first even with caching: prefixes are evicted before tails."""

    def free(self, request: Request) -> None:
        request_id = request.request_id
        for group in self.coordinator.single_type_managers:
            group.free(request_id, tail_first=False)
        self._forget_if_done(request_id)


class NoLastBlockRuleManager(KVCacheManager):
    """get_computed_blocks looks up every hash, so a fully cached prompt computes nothing."""

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hits, num_hit_tokens = super().get_computed_blocks(request)
        if not self.enable_caching:
            return hits, num_hit_tokens  # type: ignore[return-value]
        hashes = self.req_to_block_hashes[request.request_id]
        if not request.prompt_logprobs and len(hashes) * self.block_size == request.num_tokens:
            hits = self.coordinator.find_longest_cache_hit(hashes, hashes)
        return hits, len(hits[0]) * self.block_size  # type: ignore[return-value]


class WindowOffByOneManager(KVCacheManager):
    """The sliding window drops one block too many."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        for group in self.coordinator.single_type_managers:
            if isinstance(group, SlidingWindowManager):
                group.sliding_window -= group.block_size


class DenseDespiteRetentionManager(KVCacheManager):
    """A sliding-window group caches every full block whatever the retention interval."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        for group in self.coordinator.single_type_managers:
            group.sparse = False
        self._first_dense = True


class NoJunctionManager(KVCacheManager):
    """A hybrid lookup cut short by a sparse group pins no shared-prefix junction, so the
    request's window group never keeps the shared prefix's tail."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.coordinator.junction = lambda *args: 0  # type: ignore[method-assign]


def forward_free(config: ManagerConfig) -> ManagerUnderTest:
    return _build(ForwardFreeManager, config)


def no_last_block_rule(config: ManagerConfig) -> ManagerUnderTest:
    return _build(NoLastBlockRuleManager, config)


def window_off_by_one(config: ManagerConfig) -> ManagerUnderTest:
    return _build(WindowOffByOneManager, config)


def dense_despite_retention(config: ManagerConfig) -> ManagerUnderTest:
    return _build(DenseDespiteRetentionManager, config)


def no_junction(config: ManagerConfig) -> ManagerUnderTest:
    return _build(NoJunctionManager, config)
