"""Mamba states without prefix caching (vLLM 0.33's `MambaManager`, `mamba_cache_mode` "none"):
a request's recurrent state lives in one block of `max_model_len` tokens, updated in place, and
`num_speculative_blocks` more blocks hold its draft tokens' states. Nothing is cached (the
manager refuses caching with a Mamba group), so nothing is hit. `pagedkv.spec.single_type.mamba`
states the rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.single_type.base import SingleTypeKVCacheManager, T
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import MambaSpec
from pagedkv.vocab.refusals import MAMBA_HIT_DETAIL


class MambaManager(SingleTypeKVCacheManager):
    """One state block per request (plus its speculative states' blocks); a block wholly
    before the last computed token is no longer read."""

    kind = "Mamba state"
    allows_null_blocks = True

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.extra_blocks = kv_cache_spec.num_speculative_blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """No hit (caching is off with a Mamba group). Complexity: O(1)."""
        return []

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """No hit. Complexity: O(1)."""
        return []

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """Every hit: no lookup finds one. Complexity: O(1)."""
        return MAMBA_HIT_DETAIL

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the last computed token (`num_computed_tokens - 1`, vLLM's
        `get_num_skipped_tokens`). Complexity: O(1)."""
        return (num_computed_tokens - 1) // self.block_size
