"""Full attention, stated plainly: every earlier token is read, so a hit is the longest cached
prefix and no block is ever dropped."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.vocab.hashes import BlockHashType


def full_attention_hit(lookup: Lookup, block_hashes: Sequence[BlockHashType]) -> list[int]:
    """The longest prefix of `block_hashes` whose every hash is cached, as block ids."""
    for length in range(len(block_hashes), -1, -1):
        found = [lookup(block_hash) for block_hash in block_hashes[:length]]
        if all(block_id is not None for block_id in found):
            return [block_id for block_id in found if block_id is not None]
    raise AssertionError("the empty prefix is always cached")


class FullAttention(SpecSingleTypeManager):
    """Every earlier token is attended to: the cached prefix is reused, no block is dropped."""

    kind = "full attention"
    allows_null_blocks = False  # a block list never holds the null block
    prefix_closed = True  # blocks are freed tail first and never dropped early

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: every earlier one."""
        return 0

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        """The cached prefix (EAGLE's hit is the same one)."""
        return full_attention_hit(lookup, block_hashes)
