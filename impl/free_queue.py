"""FreeKVCacheBlockQueue: the free list, the LRU order and the eviction order, in one structure."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import cast

from pagedkv.block import KVCacheBlock
from pagedkv.vocab.arguments import require_instance, require_iterable
from pagedkv.vocab.errors import FreeQueueError, InvariantViolation, NoFreeBlocksError


class FreeKVCacheBlockQueue:
    """An intrusive doubly linked list over the blocks' own `prev/next_free_block` fields.

    Head = next block handed out = least recently freed; `append` puts a freed block at the tail.
    Manipulating the list allocates no Python objects. The queue owns the blocks it was built
    over (their `owner_queue`) and refuses any other block, so it never relinks a block of
    another pool. An owned block is queued iff it has a neighbour or is the head; `remove` and
    `append` check this and refuse to corrupt the list. Not thread-safe: it is the pool's
    internal structure, and the pool guards its calls. Invariants: `check_invariants()`.
    """

    __slots__ = ("free_list_head", "free_list_tail", "num_free_blocks")
    free_list_head: KVCacheBlock | None
    free_list_tail: KVCacheBlock | None
    num_free_blocks: int

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Queue `blocks` in the given order (read once; an iterator works too).

        Raises:
            ArgumentTypeError: `blocks` is not iterable, or an item is not a KVCacheBlock.
            FreeQueueError: a block listed twice, in use (ref_cnt != 0), or already owned by
                another queue; no block is changed then.

        Complexity: O(len(blocks)).
        """
        call = "FreeKVCacheBlockQueue"
        items: list[object] = require_iterable(call, "blocks", blocks)  # each item checked:
        seen: set[int] = set()
        for index, item in enumerate(items):
            block = require_instance(call, f"blocks[{index}]", item, KVCacheBlock)
            if id(block) in seen:
                raise FreeQueueError(block.block_id, "a block listed twice for a new free queue")
            if block.ref_cnt != 0:
                raise FreeQueueError(
                    block.block_id, "a block in use cannot start in a free queue", "ref_cnt != 0"
                )
            if block.owner_queue is not None:
                raise FreeQueueError(block.block_id, "a block of another free queue")
            seen.add(id(block))
        self._link_new(cast("list[KVCacheBlock]", items))

    @classmethod
    def _of_new_blocks(cls, blocks: list[KVCacheBlock]) -> FreeKVCacheBlockQueue:
        """A queue of blocks the caller has just made: distinct, with ref_cnt 0, owned by no
        queue. The constructor without its per-block checks, which a pool of a million new
        blocks would pay for nothing (a BlockPool builds its queue this way).

        Complexity: O(len(blocks)).
        """
        queue = cls(())
        queue._link_new(blocks)
        return queue

    def _link_new(self, blocks: list[KVCacheBlock]) -> None:
        """Own and link `blocks`, in order, as the whole queue (they passed the checks)."""
        self.num_free_blocks = len(blocks)
        self.free_list_head = blocks[0] if blocks else None
        self.free_list_tail = blocks[-1] if blocks else None
        for block in blocks:
            block.owner_queue = self
        for prev, block in itertools.pairwise(blocks):
            prev.next_free_block = block
            block.prev_free_block = prev

    def contains(self, block: object) -> bool:
        """Whether `block` is a KVCacheBlock linked into this queue. Complexity: O(1)."""
        return (
            isinstance(block, KVCacheBlock) and block.owner_queue is self and self._is_linked(block)
        )

    def _is_linked(self, block: KVCacheBlock) -> bool:
        """Whether an owned block is in the queue: it has a neighbour or is the head."""
        return (
            block.prev_free_block is not None
            or block.next_free_block is not None
            or self.free_list_head is block
        )

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head.

        Raises:
            NoFreeBlocksError: the queue is empty.

        Complexity: O(1).
        """
        block = self.free_list_head
        if block is None:
            raise NoFreeBlocksError(1, 0, "No free blocks available")
        self._unlink(block)
        return block

    def remove(self, block: object) -> None:
        """Unlink `block` from any position.

        Raises:
            ArgumentTypeError: `block` is not a KVCacheBlock.
            FreeQueueError: `block` belongs to another queue, or is not in this one.

        Complexity: O(1).
        """
        if not (
            isinstance(block, KVCacheBlock)
            and block.owner_queue is self
            and (
                block.prev_free_block is not None
                or block.next_free_block is not None
                or self.free_list_head is block
            )
        ):
            owned = self._owned(block, "remove")  # raises unless it is ours
            raise FreeQueueError(owned.block_id, "remove of a block that is not in the free queue")
        self._unlink(block)

    def append(self, block: object) -> None:
        """Link `block` at the tail.

        Raises:
            ArgumentTypeError: `block` is not a KVCacheBlock.
            FreeQueueError: `block` belongs to another queue, or is already in this one.

        Complexity: O(1).
        """
        if not (
            isinstance(block, KVCacheBlock)
            and block.owner_queue is self
            and block.prev_free_block is None
            and block.next_free_block is None
            and self.free_list_head is not block
        ):
            owned = self._owned(block, "append")  # raises unless it is ours
            raise FreeQueueError(owned.block_id, "append of a block already in the free queue")
        owned = block
        tail = self.free_list_tail
        if tail is None:
            self.free_list_head = owned
        else:
            tail.next_free_block = owned
            owned.prev_free_block = tail
        self.free_list_tail = owned
        self.num_free_blocks += 1

    def append_released(self, blocks: list[KVCacheBlock]) -> None:
        """Link `blocks` at the tail, in order: `append` for each, without its checks, for the
        pool that owns this queue, with blocks it has just released (its own, in use until now,
        so not queued). Complexity: O(len(blocks)), one call for all."""
        tail = self.free_list_tail
        for block in blocks:
            if tail is None:
                self.free_list_head = block
            else:
                tail.next_free_block = block
                block.prev_free_block = tail
            tail = block
        self.free_list_tail = tail
        self.num_free_blocks += len(blocks)

    def appendleft(self, block: object) -> None:
        """Link `block` at the head: it is the next block handed out.

        Raises:
            ArgumentTypeError: `block` is not a KVCacheBlock.
            FreeQueueError: `block` belongs to another queue, or is already in this one.

        Complexity: O(1).
        """
        owned = self._owned(block, "appendleft")
        if self._is_linked(owned):
            raise FreeQueueError(owned.block_id, "append of a block already in the free queue")
        head = self.free_list_head
        if head is None:
            self.free_list_tail = owned
        else:
            head.prev_free_block = owned
            owned.next_free_block = head
        self.free_list_head = owned
        self.num_free_blocks += 1

    def _owned(self, block: object, method: str) -> KVCacheBlock:
        """`block` if it is a KVCacheBlock of this queue (typed `object`, so that a compiled
        build refuses any other value as the pure one does)."""
        if isinstance(block, KVCacheBlock) and block.owner_queue is self:
            return block
        checked = require_instance(f"FreeKVCacheBlockQueue.{method}", "block", block, KVCacheBlock)
        raise FreeQueueError(checked.block_id, f"{method} of a block of another free queue")

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None:
            self.free_list_head = nxt
        else:
            prev.next_free_block = nxt
        if nxt is None:
            self.free_list_tail = prev
        else:
            nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queued blocks, head to tail. Complexity: O(num_free_blocks)."""
        blocks = []
        block = self.free_list_head
        while block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def check_invariants(self) -> None:
        """Links agree both ways, head/tail are the ends, and the counter is the length.

        Raises:
            InvariantViolation: naming the broken invariant.

        Complexity: O(num_free_blocks).
        """
        seen: set[int] = set()
        prev: KVCacheBlock | None = None
        block = self.free_list_head
        while block is not None:
            if id(block) in seen:
                raise InvariantViolation(
                    "no block twice in the free order", f"block {block.block_id} is reached twice"
                )
            seen.add(id(block))
            if block.prev_free_block is not prev:
                raise InvariantViolation(
                    "free queue links agree both ways",
                    f"block {block.block_id}.prev_free_block is "
                    f"{_block_id(block.prev_free_block)}, expected {_block_id(prev)}",
                )
            prev, block = block, block.next_free_block
        if prev is not self.free_list_tail:
            raise InvariantViolation(
                "free queue tail is its last block",
                f"tail is {_block_id(self.free_list_tail)}, last block is {_block_id(prev)}",
            )
        if len(seen) != self.num_free_blocks:
            raise InvariantViolation(
                "num_free_blocks counts the queue",
                f"counter {self.num_free_blocks}, queue length {len(seen)}",
            )


def _block_id(block: KVCacheBlock | None) -> int | None:
    return None if block is None else block.block_id
