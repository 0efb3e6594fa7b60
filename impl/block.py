"""KVCacheBlock: the metadata of one physical KV block (the K/V data lives on the GPU)."""

from __future__ import annotations

from pagedkv.vocab.arguments import require_int
from pagedkv.vocab.errors import BlockStateError
from pagedkv.vocab.hashes import CacheKey


class KVCacheBlock:
    """One physical block: its id, reference count, hash, and free-queue links.

    One object per block for the pool's lifetime (identity is stable, equality is identity), so
    requests can hold block objects while the pool changes their counts and links. The links are
    owned by `FreeKVCacheBlockQueue`; `block_hash` is set once and cleared only by `reset_hash`.
    A cached block's `block_hash` is its index key: its hash in KV cache group 0, a `GroupKey`
    (group, hash) in a hybrid model's other groups.

    Attributes:
        owner_queue: the one free queue this block may ever be linked into, set when a queue is
            built over it; a queue refuses the blocks of another (`FreeKVCacheBlockQueue`).
    """

    __slots__ = (
        "_block_hash",
        "block_id",
        "next_free_block",
        "owner_queue",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: object) -> None:
        if type(block_id) is not int:
            block_id = require_int("KVCacheBlock", "block_id", block_id)
        self.block_id: int = block_id
        self.ref_cnt = 0
        self._block_hash: CacheKey | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.owner_queue: object | None = None

    @property
    def block_hash(self) -> CacheKey | None:
        """The index key of the block's full contents (its hash, with its KV cache group when
        that is not 0), or None while it is not cached."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: CacheKey) -> None:
        if self._block_hash is not None:
            raise BlockStateError(self.block_id, "block hash is already set")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (on eviction or prefix-cache reset)."""
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash}, prev_free_block={prev_id}, "
            f"next_free_block={next_id})"
        )
