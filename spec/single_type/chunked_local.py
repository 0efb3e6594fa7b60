"""Chunked local attention, stated plainly: a token reads the tokens of its own chunk of
`attention_chunk_size` tokens only, so a hit needs only its last chunk's blocks cached, and the
blocks of earlier chunks are dropped for the null block."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedkv.spec.block_counts import ceil_div
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import ChunkedLocalAttentionSpec
from pagedkv.vocab.refusals import chunk_hit_detail


def chunk_start_block(num_tokens: int, attention_chunk_size: int, block_size: int) -> int:
    """The first block position the token at `num_tokens` reads: the one holding the first
    token of its chunk, `num_tokens // C * C`. Every block before it lies in earlier chunks."""
    return num_tokens // attention_chunk_size * attention_chunk_size // block_size


def chunked_local_hit(
    lookup: Lookup,
    block_hashes: Sequence[BlockHashType],
    attention_chunk_size: int,
    block_size: int,
) -> list[int]:
    """The longest hit within `block_hashes` for chunked local attention, as block ids.

    A hit of L blocks lets the request compute from token L * B on; that token reads only its
    own chunk, so the hit is valid iff every block from its chunk's first block to L - 1 is
    cached, the blocks before it standing as null blocks. The longest valid L is found by trying
    every L from the longest down (L = 0 is always valid).
    """
    for length in range(len(block_hashes), -1, -1):
        first = min(
            chunk_start_block(length * block_size, attention_chunk_size, block_size), length
        )
        found = [lookup(block_hash) for block_hash in block_hashes[first:length]]
        if all(block_id is not None for block_id in found):
            return [NULL_BLOCK_ID] * first + [b for b in found if b is not None]
    raise AssertionError("the empty hit is always valid")


def chunked_local_skipped(
    num_computed_tokens: int, attention_chunk_size: int, block_size: int
) -> int:
    """How many leading block positions hold only tokens of chunks before the next token's."""
    return chunk_start_block(num_computed_tokens, attention_chunk_size, block_size)


class ChunkedLocalAttention(SpecSingleTypeManager):
    """A token reads the tokens of its own chunk of `attention_chunk_size` tokens only. EAGLE
    is not supported (vLLM refuses it)."""

    kind = "chunked local attention"
    allows_null_blocks = True  # positions of earlier chunks hold the null block
    supports_eagle = False

    def __init__(self, spec: ChunkedLocalAttentionSpec, pool: SpecBlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.attention_chunk_size = spec.attention_chunk_size

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to: its chunk's first."""
        return position // self.attention_chunk_size * self.attention_chunk_size

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        return chunked_local_hit(lookup, block_hashes, self.attention_chunk_size, self.block_size)

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """A hit is the nulls of the earlier chunks, then cached blocks: exactly the positions
        before its end's chunk are null."""
        nulls = list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hits))
        expected = min(
            chunk_start_block(
                len(hits) * self.block_size, self.attention_chunk_size, self.block_size
            ),
            len(hits),
        )
        if len(nulls) != expected or NULL_BLOCK_ID in hits[len(nulls) :]:
            return chunk_hit_detail(len(nulls), len(hits), expected)
        return None

    def num_skipped(self, num_computed_tokens: int) -> int:
        return chunked_local_skipped(
            num_computed_tokens, self.attention_chunk_size, self.block_size
        )

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """One chunk and the tokens in flight, never more than max_model_len (blocks of a
        chunk are freed once the next chunk starts)."""
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return ceil_div(num_tokens, self.block_size)
