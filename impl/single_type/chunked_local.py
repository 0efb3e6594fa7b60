"""Chunked local attention: a token reads the tokens of its own chunk of `attention_chunk_size`
tokens only.

A hit needs only the blocks of its last chunk cached, and the blocks of earlier chunks are freed,
the null block taking their place, as under a sliding window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.single_type.base import SingleTypeKVCacheManager
from pagedkv.vocab.hashes import BlockHashType
from pagedkv.vocab.kv_cache_interface import ChunkedLocalAttentionSpec
from pagedkv.vocab.refusals import chunk_hit_detail

T = TypeVar("T")


def chunk_start_block(num_tokens: int, attention_chunk_size: int, block_size: int) -> int:
    """The position of the block holding the first token of the chunk of token `num_tokens`:
    every block before it holds tokens of earlier chunks only.

    Complexity: O(1).
    """
    return num_tokens // attention_chunk_size * attention_chunk_size // block_size


def scan_chunk_hit(
    num_blocks: int,
    attention_chunk_size: int,
    block_size: int,
    lookup: Callable[[int], T | None],
    null: T,
) -> list[T]:
    """The longest hit of at most `num_blocks` blocks for chunked local attention.

    A hit of L blocks lets the request compute from token L * B on, which reads its own chunk
    only: L is valid iff positions `chunk_start_block(L * B)` to L - 1 are cached (`lookup(i)`
    is the block cached for position i, or None); the positions before are `null`. The Ls that
    share a chunk start s form one range [lo, hi], and the longest valid one among them is
    min(hi, s + the run of hits from s) if that reaches lo. So the ranges are tried from the
    top, each by one forward scan from its chunk start that stops at the first miss; the ranges'
    scans do not overlap. L = 0 is always valid.

        C = 8, B = 4:  lookup: hit  miss  hit  hit  miss   (num_blocks = 5)
        L in [4, 5] (s = 4): position 4 misses, so L = 4 would need s + 0 >= 4: valid
        result:  null  null  null  null

    Complexity: O(num_blocks) lookups at most.
    """
    top = num_blocks
    while top > 0:
        chunk = top * block_size // attention_chunk_size
        start = chunk * attention_chunk_size // block_size  # chunk_start_block(top * B)
        lowest = -(-chunk * attention_chunk_size // block_size)  # the least L in this chunk
        found: list[T] = []
        for position in range(start, top):
            block = lookup(position)
            if block is None:
                break
            found.append(block)
        if start + len(found) >= lowest:
            return [null] * start + found
        top = lowest - 1
    return []


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """A token attends to the tokens of its own chunk of `attention_chunk_size` tokens only.

    Positions whose blocks hold only tokens of earlier chunks than the next token's hold the
    null block, a prefix of every block list, as under a sliding window. EAGLE is not supported
    (vLLM refuses it).

    Layout of a hit with block size 4 and chunk size 8, 3 hashes (token 12 reads tokens 8..11):

        hashes:  h0    h1    h2
        cached:  no    yes   yes
        result:  NULL  NULL  b2          (block 2 starts token 12's chunk)
    """

    kind = "chunked local attention"
    allows_null_blocks = True
    supports_eagle = False

    def __init__(
        self, kv_cache_spec: ChunkedLocalAttentionSpec, block_pool: BlockPool, group_id: int
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """The longest hit within `block_hashes` (`scan_chunk_hit`): the nulls of the earlier
        chunks, then the cached blocks of its last chunk.

        Complexity: O(len(block_hashes)).
        """
        get_cached_block = self.block_pool.cached_block if not self.group_id else self.cached_block
        return self.scan_hit(
            len(block_hashes), lambda i: get_cached_block(block_hashes[i]), self.null_block
        )

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """`scan_chunk_hit` for this chunk size. Complexity: O(num_blocks)."""
        return scan_chunk_hit(num_blocks, self.attention_chunk_size, self.block_size, lookup, null)

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """A hit is the nulls of the chunks before its end's chunk, then cached blocks: exactly
        its first `chunk_start_block(len(hits) * B)` positions are null.

        Complexity: O(len(hits)).
        """
        null_block = self.null_block
        num_nulls = self.num_leading_nulls(hits)
        expected = min(
            chunk_start_block(
                len(hits) * self.block_size, self.attention_chunk_size, self.block_size
            ),
            len(hits),
        )
        if num_nulls != expected or any(block is null_block for block in hits[num_nulls:]):
            return chunk_hit_detail(num_nulls, len(hits), expected)
        return None

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """The blocks before the one holding the first token of the next token's chunk
        (`chunk_start_block`). Complexity: O(1)."""
        return chunk_start_block(num_computed_tokens, self.attention_chunk_size, self.block_size)
