"""Counting prefix-cache evictions from outside the pool.

The pool evicts lazily: a freed block keeps its hash (and stays hittable) until `allocate_slots`
hands it out for new content. A block only ever gets its hash while a request holds it, as one
of that request's leading full blocks, so watching each request's block list after every
allocation sees every cached block; a block seen cached that comes back as a *new* block of an
allocation was evicted. This is exactly vLLM's eviction (`_maybe_evict_cached_block`), counted
through the manager's public state (`KVCacheManager.get_blocks`, `KVCacheBlock.block_hash`).

A request holds one block list per KV cache group, all from one pool: each group's list is
watched on its own (a sliding-window group's list starts with null blocks where the
window moved on; the blocks it dropped stay cached until they are handed out again, which is an
eviction as well).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedkv.block import KVCacheBlock


class EvictionCounter:
    """Evictions so far, and the cached block ids they are judged against.

    Complexity: O(groups + new blocks + newly cached blocks) per `after_allocation`.
    """

    def __init__(self) -> None:
        self.num_evictions = 0
        self.cached_block_ids: set[int] = set()
        self.group_num_seen: dict[str, list[int]] = {}  # per group, leading blocks seen cached

    def after_allocation(
        self,
        request_id: str,
        request_blocks: Sequence[Sequence[KVCacheBlock]],
        new_blocks: Sequence[Iterable[KVCacheBlock]],
        null_block: KVCacheBlock,
    ) -> None:
        """Account for one successful `allocate_slots` of `request_id`.

        Args:
            request_id: the request that was allocated for.
            request_blocks: its block list in each KV cache group after the call.
            new_blocks: what the call returned (blocks taken from the free queue), per group.
            null_block: the pool's null block (a skipped position, never cached).
        """
        for blocks in new_blocks:
            for block in blocks:
                if block.block_id in self.cached_block_ids:
                    self.cached_block_ids.discard(block.block_id)
                    self.num_evictions += 1
        seen_per_group = self.group_num_seen.setdefault(request_id, [0] * len(request_blocks))
        for group, blocks in enumerate(request_blocks):
            seen = seen_per_group[group]
            while seen < len(blocks) and (
                blocks[seen] is null_block or blocks[seen].block_hash is not None
            ):
                if blocks[seen] is not null_block:
                    self.cached_block_ids.add(blocks[seen].block_id)
                seen += 1
            seen_per_group[group] = seen

    def after_free(self, request_id: str) -> None:
        """The request gave its blocks back (preempted or finished); its blocks stay cached."""
        self.group_num_seen.pop(request_id, None)
