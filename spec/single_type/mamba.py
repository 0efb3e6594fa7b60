"""Mamba states without prefix caching (vLLM 0.33's `MambaManager`, `mamba_cache_mode` "none"),
stated plainly: a request's recurrent state lives in one block of `max_model_len` tokens,
updated in place token by token, with `num_speculative_blocks` more blocks for the states of
draft tokens; nothing is cached, so nothing is ever hit.

The token at position p reads one thing, the state the token before it left: position p - 1
(`first_read`), so the attention-truth invariant demands that the request's own state is there.
Positions wholly before p - 1 are no longer read (`num_skipped`); with a block of
`max_model_len` tokens there are none, but the rule is the attention type's, not the size's.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.block_pool import SpecBlockPool
from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import MambaSpec
from pagedkv.vocab.refusals import MAMBA_HIT_DETAIL


class MambaState(SpecSingleTypeManager):
    """A recurrent state per request, in block 0, plus its speculative states' blocks."""

    kind = "Mamba state"
    allows_null_blocks = True  # a block wholly before the last computed token is not read

    def __init__(self, spec: MambaSpec, pool: SpecBlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.extra_blocks = spec.num_speculative_blocks

    def first_read(self, position: int) -> int:
        """The token at `position` reads the state after the token before it."""
        return max(position - 1, 0)

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        """No hit: states are not cached in this mode (the registry refuses caching)."""
        return []

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """Every hit: no lookup finds one."""
        return MAMBA_HIT_DETAIL

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the last computed token."""
        return max(num_computed_tokens - 1, 0) // self.block_size
