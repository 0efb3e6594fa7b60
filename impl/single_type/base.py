"""SingleTypeKVCacheManager: one KV cache group's blocks over the shared pool, one attention type.

Each attention type is a subclass in a module of its own (`full_attention`, `sliding_window`,
`chunked_local`), picked by the registry of this package (`pagedkv.single_type`) for the spec
type of its group. A subclass states what its attention reads: which cached blocks a lookup may
hit (`find_longest_cache_hit`, `scan_hit`), which hits it could have produced
(`hit_shape_error`) and how many leading positions the next token no longer reads
(`num_skipped_blocks`). This base class does the rest for every type, over the request's block
list it owns: hits added, blocks allocated, full blocks cached, skipped blocks dropped, blocks
freed. `pagedkv.spec.single_type` states each type's rules plainly.

The coordinator (`pagedkv.kv_cache_coordinator`) calls these methods while the manager holds
the pool's call token, once every precondition of the call has been checked: they change state
and never refuse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey, HashFn
from pagedkv.vocab.kv_cache_interface import KVCacheSpec
from pagedkv.vocab.request import Request

_new_tuple = tuple.__new__  # GroupKey(group, hash) without the NamedTuple's Python-level __new__
T = TypeVar("T")


class SingleTypeKVCacheManager(ABC):
    """The blocks of one KV cache group, for one attention type, over a shared block pool.

    Per request it keeps its block list (`req_to_blocks`: one entry per block position; positions
    the attention no longer reads hold the pool's null block, as a prefix) and how many of its
    positions are cached (`num_cached_block`).

    Attributes:
        kind: the attention type's name, as refusals and reports name it.
        allows_null_blocks: whether a request's block list may start with null blocks (positions
            the attention no longer reads); a hit may then start with them too.
        supports_eagle: whether EAGLE's last-block drop is defined for this attention type.
        group_id: the KV cache group whose blocks it keeps (0 for a single-group manager).
        use_eagle: hits drop their last block (set by the registry).
        retention_interval: the config's `prefix_cache_retention_interval` (set by the
            registry).
        acts_on_retention: whether the attention type caches sparsely under an interval
            (`retained`; a sliding window, a Mamba group in mode "align").
        holds_state: whether a block holds one recurrent state, its table positional with
            null blocks anywhere (a Mamba group in mode "align").
        sparse: it does here: an interval is set (set by the registry).
        junction_ignores_eagle: the semantics' switch of that name (set by the manager; a
            sliding window acts on it under sparse retention with EAGLE).
        remarks_keyed_boundary: the semantics' `mamba_remarks_keyed_boundary`, with several
            groups (set by the manager; a Mamba group in mode "align" acts on it).
        extra_blocks: blocks a request holds beyond those its token slots fill (Mamba's
            speculative states; 0 for attention).
    """

    kind: ClassVar[str]
    allows_null_blocks: ClassVar[bool]
    supports_eagle: ClassVar[bool] = True
    acts_on_retention: ClassVar[bool] = False
    holds_state: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.null_block = block_pool.null_block
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.use_eagle = False
        self.retention_interval: int | None = None
        self.junction_ignores_eagle = False
        self.remarks_keyed_boundary = False
        self.sparse = False
        self.extra_blocks = 0

    # -- what the attention type reads (its subclass) ----------------------------------------

    def cached_block(self, block_hash: BlockHashType) -> KVCacheBlock | None:
        """The block cached for this group under `block_hash`, or None. Complexity: O(1)."""
        key: CacheKey = (
            _new_tuple(GroupKey, (self.group_id, block_hash)) if self.group_id else block_hash
        )
        return self.block_pool.cached_block(key)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """The cached blocks a request with these hashes may reuse, skipped ones as null blocks:
        the longest hit within `block_hashes` (a coordinator may ask again for a shorter prefix).
        `for_eagle`: the hit that, less its last block, is an EAGLE hit (a sliding window's
        for a window one block wider, so that a whole window stays after the drop).

        Complexity: O(len(block_hashes)).
        """

    @abstractmethod
    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """`find_longest_cache_hit` over any lookup: `lookup(i)` is what position i holds cached
        (None: not cached), `null` stands for a skipped position (groups of one spec looked up
        together pass a list of blocks per position). Complexity: O(num_blocks) lookups."""

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """Why `hits`, with no null block out of place, cannot be a hit of this attention type
        found with `for_eagle` (and then, with `use_eagle`, less its last block); None if they
        can. Asked only of a type that `allows_null_blocks` (a hit without nulls is a cached
        prefix, of one shape). Complexity: O(len(hits))."""
        return None

    def num_leading_nulls(self, hits: Sequence[KVCacheBlock]) -> int:
        """How many null blocks `hits` start with. Complexity: O(the null blocks)."""
        null_block = self.null_block
        num_nulls = 0
        while num_nulls < len(hits) and hits[num_nulls] is null_block:
            num_nulls += 1
        return num_nulls

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """How many leading positions the token at `num_computed_tokens` no longer reads (<= 0:
        none). Complexity: O(1)."""
        return 0

    def retained(self, request: Request, junction: int, first: int, end: int) -> list[bool]:
        """For each position of [first, end), whether caching indexes it (`sparse` managers
        only; `junction`: the request's shared-prefix junction, in tokens, 0 for none).
        Complexity: O(end - first)."""
        return [True] * (end - first)

    # -- how many blocks a request holds (every type alike) ----------------------------------

    def num_required(self, num_slots: int) -> int:
        """Blocks a request with `num_slots` token slots holds: the blocks those slots fill,
        plus `extra_blocks`. Complexity: O(1)."""
        return -(-num_slots // self.block_size) + self.extra_blocks

    def num_slots(self, num_held: int) -> int:
        """Token slots `num_held` blocks give (`extra_blocks` of them give none).
        Complexity: O(1)."""
        return max(num_held - self.extra_blocks, 0) * self.block_size

    def num_blocks_to_allocate(self, num_new: int) -> int:
        """Blocks taken from the free queue when the request's list grows by `num_new`
        positions (every one, for attention). Complexity: O(1)."""
        return num_new

    def defers(self, hits: Sequence[KVCacheBlock]) -> bool:
        """Whether these hits must wait for the next scheduler step (never, for attention).
        Complexity: O(1)."""
        return False

    def new_step_starts(self) -> None:  # noqa: B027 (a hook most types leave empty)
        """A new scheduler step starts (only a Mamba group in mode "align" keeps per-step
        state). Complexity: O(1)."""

    def layout_error(self, request_id: str) -> str | None:
        """Why the request's list breaks a `holds_state` type's layout (None: it holds).
        Complexity: O(1)."""
        return None

    # -- the request's blocks (every type alike) ---------------------------------------------

    def skips_a_block(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> bool:
        """Whether `remove_skipped_blocks` would drop a block of `blocks` at this step (the
        decode fast path's question). Complexity: O(1)."""
        num_skipped = self.num_skipped_blocks(num_computed_tokens)
        return num_skipped > 0 and blocks[num_skipped - 1] is not self.null_block

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Put the null block at the positions the next token no longer reads, and free the
        blocks they held, the newest first. Scans from the newest such position back to the
        first null block (the nulls before it were set by earlier calls).

        Complexity: O(number of blocks dropped).
        """
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        null_block = self.null_block
        removed = []
        for position in range(self.num_skipped_blocks(num_computed_tokens) - 1, -1, -1):
            block = blocks[position]
            if block is null_block:
                break
            removed.append(block)
            blocks[position] = null_block
        if removed:
            self.block_pool.free_blocks_locked(removed)

    def add_hits(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        """Append `hits` (touched already; a list the caller hands over) to the request's
        blocks; the request's block list exists from here on. Complexity: O(len(hits))."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            self.req_to_blocks[request_id] = hits
        else:
            blocks.extend(hits)

    def allocate_new_blocks(self, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` (>= 0, free) blocks from the pool's queue head and append them to
        the request's blocks (`add_hits` made its list). Complexity: O(num_blocks)."""
        if num_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks_locked(num_blocks)
        self.req_to_blocks[request_id].extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self,
        request: Request,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn,
        junction: int = 0,
    ) -> None:
        """Cache the request's positions [cached, num_full) that it holds (the stored
        `block_hashes` give the hashes known, the pool appends the others), those `retained`
        keeps when `sparse`, and record max(cached, num_full) positions as cached; `cached` is
        the group's own count, `num_cached` (the hits) until it has one (external tokens that
        push hits out of a window count its null positions as cached, as vLLM 0.33 does).
        Complexity: O(blocks cached * block_size)."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, num_cached)
        blocks = self.req_to_blocks[request_id]
        num_blocks = len(blocks)
        # min(): only vLLM 0.8.5's capped allocation (cap_at_max_model_len) holds fewer blocks.
        first = num_cached if num_cached < num_blocks else num_blocks
        end = num_full if num_full < num_blocks else num_blocks
        if end > first:
            self.block_pool.cache_full_blocks_locked(
                request,
                blocks,
                block_hashes,
                first,
                end,
                self.block_size,
                hash_fn,
                self.group_id,
                self.retained(request, junction, first, end) if self.sparse else None,
                True,  # parent_from_stored
            )
        self.num_cached_block[request_id] = num_full if num_full > num_cached else num_cached

    def free(self, request_id: str, tail_first: bool) -> None:
        """Release the request's blocks, the last first (evicted first) or in order; forget it.
        An unknown request is a no-op. Complexity: O(blocks held)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None:
            self.block_pool.free_blocks_locked(blocks[::-1] if tail_first else blocks)
            del self.req_to_blocks[request_id]
        self.num_cached_block.pop(request_id, None)

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks less its leading null blocks, handed to a deferred free; forget
        it. The blocks keep their references. Complexity: O(blocks held)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        null_block = self.block_pool.null_block
        nulls = 0
        while nulls < len(blocks) and blocks[nulls] is null_block:
            nulls += 1
        return list(blocks[nulls:])

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of the request whose ref_cnt is `num_running_requests` (a null
        block's is 0). Complexity: O(the common prefix)."""
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count
