"""The reference block pool: every BlockPool operation, written the obviously-correct way.

State is four plain containers indexed by block id. The free order is a list (head first), the
index a dict from hash to the tuple of block ids cached under it (first inserted first). Each
operation checks its preconditions in the order its docstring lists them and raises the first one
broken, with the same exception class the implementation raises; only then does it change state.
Every change of a block's state is checked against `TRANSITIONS`. Arguments are checked first
(`pagedkv.spec.arguments`): a block is an int id, and an id outside the pool is a foreign block.
Refusals are worded by `pagedkv.vocab.refusals`, as the implementation words them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from pagedkv.spec.arguments import (
    check_cache_full_blocks,
    check_cache_key,
    check_get_new_blocks,
    check_pool,
    require_block_ids,
)
from pagedkv.spec.block_hash import block_extra_keys, block_hash, vllm_new_block_extra_keys
from pagedkv.spec.block_state import TRANSITIONS, BlockState, Event, state_of
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import require_int
from pagedkv.vocab.errors import (
    InvariantViolation,
    NoFreeBlocksError,
)
from pagedkv.vocab.hashes import (
    BlockHashType,
    CacheKey,
    HashFn,
    MultimodalKey,
    cache_key,
    key_group,
    key_hash,
)
from pagedkv.vocab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""The id of the null block, the placeholder for positions a sliding window dropped (the one
definition: spec, harness and proofs import it from here; the implementation's null block is
`BlockPool.blocks[0]`)."""


class SpecBlockPool:
    """Reference model of `pagedkv.BlockPool`, over block ids.

    Attributes:
        ref_cnt: ref_cnt[b] is the number of references to block b.
        block_hash: block_hash[b] is b's index key (its hash, and its KV cache group when that
            is not 0: `pagedkv.vocab.hashes.GroupKey`), or None.
        free_order: the free queue, head (next handed out) first.
        index: key -> ids of the blocks cached under it, first inserted first (a tuple: a
            snapshot copies the index with `dict()`, which neither rehashes a key nor shares a
            value that later changes).
        events: with `enable_kv_cache_events`, the KV cache events not yet taken, oldest first:
            a BlockStored when keys enter `index`, a BlockRemoved when one leaves it, an
            AllBlocksCleared at each reset (`pagedkv.vocab.kv_events` defines them).
        taken_hash_counts: ghost state: what a consumer that replayed every taken event holds,
            the number of index keys per (group, hash value).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        semantics: Semantics = PAGEDKV_SEMANTICS,
        enable_kv_cache_events: bool = False,
    ) -> None:
        check_pool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events)
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.semantics = semantics
        self.ref_cnt: list[int] = [0] * num_gpu_blocks
        self.block_hash: list[CacheKey | None] = [None] * num_gpu_blocks
        # Block 0 is taken out at once as the null block.
        self.free_order: list[int] = list(range(1, num_gpu_blocks))
        self.index: dict[CacheKey, tuple[int, ...]] = {}
        # Block id -> its secondary ("partial") keys, in the index beside its hash and removed
        # with it (vllm-0.33's `partial_prefix_keys`; `add_partial_key_unchecked`).
        self.partial_keys: dict[int, list[CacheKey]] = {}
        # The blocks whose hash is a partial key (`evict_blocks` had taken their own).
        self.partial_hashed: set[int] = set()
        self.enable_kv_cache_events = enable_kv_cache_events
        self.events: list[KVCacheEvent] = []
        self.taken_hash_counts: dict[tuple[int, int], int] = {}

    # -- queries -----------------------------------------------------------------------------

    def state(self, block_id: int) -> BlockState:
        return state_of(self.ref_cnt[block_id], self.block_hash[block_id] is not None)

    def get_cached_block(self, block_hash: CacheKey) -> int | None:
        """The first block cached under `block_hash` (a hash, or a `GroupKey`), or None.

        Preconditions: `block_hash` is a hashable BlockHashType, or a GroupKey of a group >= 1
        and a hashable BlockHashType (ArgumentTypeError, InvalidArgumentError).
        """
        check_cache_key("BlockPool.get_cached_block", "block_hash", block_hash)
        return self.get_cached_block_unchecked(block_hash)

    def get_cached_block_unchecked(self, block_hash: CacheKey) -> int | None:
        """`get_cached_block` past its argument check, for a caller that built the key itself
        (the spec managers)."""
        cached = self.index.get(block_hash, ())
        return cached[0] if cached else None

    def get_num_free_blocks(self) -> int:
        return len(self.free_order)

    def get_usage(self) -> float:
        """The null block counts as used; with `usage_excludes_null_block` it is left out."""
        if self.semantics.usage_excludes_null_block:
            usable = self.num_gpu_blocks - 1
            return 1.0 - (len(self.free_order) / usable) if usable else 0.0
        return 1.0 - (len(self.free_order) / self.num_gpu_blocks)

    # -- operations --------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` blocks from the head; a cached one is evicted; each gets ref_cnt 1.

        Preconditions: num_blocks is an int >= 0 (ArgumentTypeError, InvalidArgumentError);
        num_blocks <= free blocks (NoFreeBlocksError).
        """
        return self.get_new_blocks_unchecked(check_get_new_blocks(num_blocks))

    def get_new_blocks_unchecked(self, num_blocks: int) -> list[int]:
        """`get_new_blocks` past its argument check, for a caller that computed the count
        itself (the spec managers); the state precondition still raises."""
        if num_blocks > len(self.free_order):
            raise NoFreeBlocksError(num_blocks, len(self.free_order))
        taken = list(self.free_order[:num_blocks])
        self.free_order = self.free_order[num_blocks:]
        for block_id in taken:
            with self._transition(block_id, Event.ALLOC):
                cached_hash = self.block_hash[block_id]
                if cached_hash is not None:  # lazy eviction: the hash goes at reuse time
                    self._unindex(block_id, cached_hash)
                    self.block_hash[block_id] = None
                    self._drop_partial_keys(block_id)
                self.ref_cnt[block_id] += 1
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block; a block at ref_cnt 0 leaves the free queue first.

        The null block is passed over (or, with `null_block_refcounted`, counted like vLLM).
        Preconditions: `block_ids` is an iterable (read once) of ints (ArgumentTypeError); every
        id is a block of this pool (BlockStateError).
        """
        self.touch_unchecked(require_block_ids("BlockPool.touch", "blocks", block_ids))

    def touch_unchecked(self, touched: list[int]) -> None:
        """`touch` past its argument check, for a caller that built the ids itself (the spec
        managers); every state precondition still raises."""
        for block_id in touched:
            self._require_block(block_id)
        for block_id in touched:
            if block_id == NULL_BLOCK_ID:
                if self.semantics.null_block_refcounted:
                    self.ref_cnt[NULL_BLOCK_ID] += 1
                continue
            with self._transition(block_id, Event.TOUCH):
                if self.ref_cnt[block_id] == 0:
                    self.free_order.remove(block_id)
                self.ref_cnt[block_id] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """One reference fewer to each block, in the given order; at 0 a block joins the tail.

        The null block is passed over (or, with `null_block_refcounted`, counted like vLLM).
        With `free_uncached_to_head`, the blocks without a hash go to the head instead, in the
        given order, ahead of every queued block.
        Preconditions: `ordered_block_ids` is an iterable (read once) of ints
        (ArgumentTypeError); then per block in order: it is a block of this pool; unless it is
        the null block, its ref_cnt is > 0 and it was not listed before in this call
        (BlockStateError).
        """
        self.free_blocks_unchecked(
            require_block_ids("BlockPool.free_blocks", "ordered_blocks", ordered_block_ids)
        )

    def free_blocks_unchecked(self, freed: list[int]) -> None:
        """`free_blocks` past its argument check, for a caller that built the ids itself (the
        spec managers); every state precondition still raises."""
        seen: set[int] = set()
        for block_id in freed:
            self._require_block(block_id)
            if block_id == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[block_id] <= 0:
                raise refusals.free_of_free_block(block_id)
            if block_id in seen:
                raise refusals.freed_twice(block_id)
            seen.add(block_id)
        to_head: list[int] = []  # under free_uncached_to_head: unhashed blocks, reused first
        for block_id in freed:
            if block_id == NULL_BLOCK_ID:
                if self.semantics.null_block_refcounted:
                    self.ref_cnt[NULL_BLOCK_ID] -= 1
                continue
            with self._transition(block_id, Event.RELEASE):
                self.ref_cnt[block_id] -= 1
                if self.ref_cnt[block_id] == 0:
                    if self.semantics.free_uncached_to_head and self.block_hash[block_id] is None:
                        to_head.append(block_id)
                    else:
                        self.free_order.append(block_id)
        self.free_order[:0] = to_head

    def cache_full_blocks(
        self,
        request: Request,
        block_ids: Sequence[int],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
        group_id: int = 0,
    ) -> None:
        """Give blocks `block_ids[num_cached_blocks:num_full_blocks]` their hashes and index them.

        Block i's hash is `block_hashes[i]` if the request already has it; otherwise it is
        computed from the request's tokens `[i * block_size, (i + 1) * block_size)` and its extra
        keys (`block_extra_keys`, or `vllm_new_block_extra_keys` under vLLM semantics), chained
        to block i-1's hash value, and appended to `block_hashes`. The blocks are indexed for
        KV cache group `group_id`: under their hash (group 0), or under `GroupKey(group_id,
        hash)`; the stored hashes are the request's, the same for every group.

        Preconditions, in order:
          1. the argument checks of `check_cache_full_blocks` (ArgumentTypeError,
             InvalidArgumentError): the types; caching is on; 0 <= num_cached_blocks <=
             num_full_blocks <= len(block_ids); len(block_hashes) >= num_cached_blocks; the
             stored hashes read are hashable BlockHashTypes; the blocks read are ids; group_id
             an int >= 0
          (if num_cached_blocks == num_full_blocks the call does nothing)
          2. each block to cache other than the null block, in order: of this pool,
             ref_cnt > 0, not hashed, not listed twice (BlockStateError);
          3. the block before the first one to cache, if any, is of this pool, and is hashed or
             is the null block (BlockStateError);
          4. block by block, for each hash the request lacks: the request has the block's tokens
             (InvalidArgumentError), and `hash_fn` returns an int (ArgumentTypeError).

        A null block in the range (a position a sliding window already dropped) gets no hash and
        no index entry, but its hash is still stored in `block_hashes` so the chain goes on; a
        null block before the range chains through the stored hash at its position.
        """
        checked = check_cache_full_blocks(
            self.enable_caching,
            request,
            block_ids,
            block_hashes,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            hash_fn,
            group_id,
        )
        if checked is None:
            return
        self.cache_full_blocks_unchecked(
            request,
            checked,
            block_hashes,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            hash_fn,
            group_id,
        )

    def cache_full_blocks_unchecked(
        self,
        request: Request,
        checked: Sequence[int],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
        group_id: int = 0,
        *,
        retained: Sequence[bool] | None = None,
        parent_from_stored: bool = False,
    ) -> None:
        """`cache_full_blocks` past its argument checks (precondition 1), for a caller that
        built the arguments itself (the spec managers); preconditions 2-4 still raise.

        `retained` (a manager's sparse retention, `pagedkv.spec.retention`): one flag per
        position of the range; a position flagged False gets no hash and no index entry, like
        a null block, and a block before the range left unhashed that way chains through the
        stored hash at its position, as a null block does. `parent_from_stored` (a manager,
        whose stored hashes are the chain): so does a parent whose hash `evict_blocks` took,
        as vLLM 0.33 chains through the request's hashes, never the parent block's."""
        if num_cached_blocks == num_full_blocks:
            return
        to_cache = list(checked[num_cached_blocks:num_full_blocks])
        seen: set[int] = set()
        for block_id in to_cache:
            self._require_block(block_id)
            if block_id == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[block_id] <= 0:
                raise refusals.cache_of_free_block(block_id)
            if self.block_hash[block_id] is not None:
                raise refusals.hash_already_set(block_id)
            if block_id in seen:
                raise refusals.cached_twice(block_id)
            seen.add(block_id)
        parent_hash_value: int | None = None
        if num_cached_blocks > 0:
            parent_id = checked[num_cached_blocks - 1]
            self._require_block(parent_id)
            parent_hash = (
                block_hashes[num_cached_blocks - 1]
                if parent_id == NULL_BLOCK_ID
                or (
                    (retained is not None or parent_from_stored)
                    and self.block_hash[parent_id] is None
                )
                else self.block_hash[parent_id]
            )
            if parent_hash is None:
                raise refusals.parent_without_hash(parent_id)
            parent_hash_value = key_hash(parent_hash).hash_value
        first_parent = parent_hash_value  # what position num_cached_blocks chains to

        new_hashes: list[BlockHashType] = []
        for position in range(num_cached_blocks, num_full_blocks):
            if position < len(block_hashes):
                this_hash = block_hashes[position]
            else:
                start, end = position * block_size, (position + 1) * block_size
                if request.num_tokens < end:
                    raise refusals.too_few_tokens(
                        request.request_id, request.num_tokens, position, block_size
                    )
                tokens = tuple(request.all_token_ids[start:end])
                if self.semantics.vllm_new_block_mm_keys:
                    extra_keys = vllm_new_block_extra_keys(request, start, end)
                else:
                    extra_keys = block_extra_keys(
                        request, start, end, mm_position=not self.semantics.mm_keys_without_position
                    )
                this_hash = block_hash(hash_fn, parent_hash_value, tokens, extra_keys)
                require_int(
                    "BlockPool.cache_full_blocks",
                    "the value hash_fn returned",
                    this_hash.hash_value,
                )
                new_hashes.append(this_hash)
            parent_hash_value = this_hash.hash_value

        all_hashes = list(block_hashes) + new_hashes
        entered: list[int] = []  # positions whose key is new to the index
        for position, block_id in enumerate(to_cache, start=num_cached_blocks):
            if block_id == NULL_BLOCK_ID:
                continue
            if retained is not None and not retained[position - num_cached_blocks]:
                continue
            key = cache_key(all_hashes[position], group_id)
            with self._transition(block_id, Event.SEAL):
                self.block_hash[block_id] = key
                if key not in self.index:
                    entered.append(position)
                self.index[key] = (*self.index.get(key, ()), block_id)
        block_hashes.extend(new_hashes)
        if self.enable_kv_cache_events:
            self._emit_stored(
                request, all_hashes, entered, num_cached_blocks, first_parent, block_size, group_id
            )

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Take each listed block's hash out of the prefix cache, the block staying where it is:
        its references, and its place in the free queue if it is free (vLLM 0.33's
        `BlockPool.evict_blocks`, which a KV connector calls for blocks whose load failed). A
        block without a hash, the null block among them, is passed over; so is a block listed
        again. A key that leaves the index is announced by a BlockRemoved.

        Preconditions: `block_ids` is an iterable (read once) of ints (ArgumentTypeError);
        every id is a block of this pool (BlockStateError), checked for all before any changes.
        """
        self.evict_blocks_unchecked(
            require_block_ids("BlockPool.evict_blocks", "block_ids", block_ids)
        )

    def evict_blocks_unchecked(self, evicted: list[int]) -> list[tuple[int, CacheKey]]:
        """`evict_blocks` past its argument check (the spec manager's call); the range check
        still raises. Returns each block that lost its hash, with the key it lost, in order."""
        for block_id in evicted:
            self._require_block(block_id)
        dropped: list[tuple[int, CacheKey]] = []
        for block_id in evicted:
            key = self.block_hash[block_id]
            if key is None:
                continue
            with self._transition(block_id, Event.EVICT):
                self._unindex(block_id, key)
                self.block_hash[block_id] = None
                self._drop_partial_keys(block_id)
            dropped.append((block_id, key))
        return dropped

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, if no block but the null block is in use; else log and refuse."""
        num_in_use = self.num_gpu_blocks - 1 - len(self.free_order)
        if num_in_use != 0:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_in_use,
            )
            return False
        for block_id in self.free_order:
            with self._transition(block_id, Event.RESET):
                self.block_hash[block_id] = None
        self.index = {}
        self.partial_keys = {}
        self.partial_hashed = set()
        if self.enable_kv_cache_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events not yet taken, oldest first; a consumer's replay of them joins the ghost."""
        taken, self.events = self.events, []
        self.taken_hash_counts = replayed_hash_counts(self.taken_hash_counts, taken)
        return taken

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every block-pool invariant, each stated once.

        Raises:
            InvariantViolation: the first broken invariant and the state that breaks it.
        """
        n = self.num_gpu_blocks
        if len(self.ref_cnt) != n or len(self.block_hash) != n:
            raise InvariantViolation("one ref_cnt and one hash slot per block", repr(self))
        # The null block is block 0 and is never free, hashed or handed out.
        if NULL_BLOCK_ID in self.free_order:
            raise InvariantViolation("the null block is never free", repr(self.free_order))
        if self.block_hash[NULL_BLOCK_ID] is not None:
            raise InvariantViolation("the null block is never hashed", repr(self.block_hash[0]))
        if not self.semantics.null_block_refcounted and self.ref_cnt[NULL_BLOCK_ID] != 0:
            raise InvariantViolation("the null block's ref_cnt stays 0", repr(self.ref_cnt[0]))
        # The free order holds each block at most once.
        free = set(self.free_order)
        if len(free) != len(self.free_order):
            raise InvariantViolation("no block twice in the free order", repr(self.free_order))
        if any(not 0 <= block_id < n for block_id in self.free_order):
            raise InvariantViolation("free blocks belong to the pool", repr(self.free_order))
        # A block is free iff its ref_cnt is 0 (the null block apart).
        for block_id in range(1, n):
            if self.ref_cnt[block_id] < 0:
                raise InvariantViolation("ref_cnt >= 0", f"block {block_id}: {self.ref_cnt}")
            if (self.ref_cnt[block_id] == 0) != (block_id in free):
                raise InvariantViolation(
                    "a block is in the free queue iff its ref_cnt is 0",
                    f"block {block_id}: ref_cnt {self.ref_cnt[block_id]}, "
                    f"free order {self.free_order}",
                )
        # Conservation: free + in use == N, the null block apart.
        num_in_use = sum(1 for block_id in range(1, n) if self.ref_cnt[block_id] > 0)
        if len(self.free_order) + num_in_use != n - 1:
            raise InvariantViolation(
                "free + in use == num_gpu_blocks - 1", f"{len(self.free_order)} + {num_in_use}"
            )
        # The index lists exactly the hashed blocks, under their own hashes.
        indexed = {
            (cached_hash, block_id)
            for cached_hash, block_ids in self.index.items()
            for block_id in block_ids
        }
        hashed = {
            (cached_hash, block_id)
            for block_id, cached_hash in enumerate(self.block_hash)
            if cached_hash is not None
        }
        for block_id, keys in self.partial_keys.items():
            if not keys or self.block_hash[block_id] is None or len(set(keys)) != len(keys):
                raise InvariantViolation(
                    "partial keys are distinct keys of hashed blocks", f"block {block_id}: {keys}"
                )
            hashed.update((key, block_id) for key in keys)
        if any(self.block_hash[block_id] is None for block_id in self.partial_hashed):
            raise InvariantViolation(
                "a block hashed under a partial key is hashed", repr(sorted(self.partial_hashed))
            )
        if indexed != hashed:
            raise InvariantViolation(
                "hash index <=> hashed blocks",
                f"index only: {indexed - hashed}, blocks only: {hashed - indexed}",
            )
        for cached_hash, block_ids in self.index.items():
            if not block_ids or len(set(block_ids)) != len(block_ids):
                raise InvariantViolation(
                    "index entries are non-empty lists of distinct blocks",
                    f"{cached_hash} -> {block_ids}",
                )
        if not self.enable_caching and hashed:
            raise InvariantViolation("no block is hashed while caching is off", repr(hashed))
        # Replaying every event emitted so far reproduces the index, as (group, hash value) -> keys.
        if not self.enable_kv_cache_events:
            if self.events:
                raise InvariantViolation(
                    "no event is queued while events are off", repr(self.events[:3])
                )
            return
        replayed = replayed_hash_counts(self.taken_hash_counts, self.events)
        index_counts: dict[tuple[int, int], int] = {}
        for key in self.index:
            counted = (key_group(key), key_hash(key).hash_value)
            index_counts[counted] = index_counts.get(counted, 0) + 1
        if replayed != index_counts:
            replay_only = {v: n - index_counts.get(v, 0) for v, n in replayed.items()}
            index_only = {v: n - replayed.get(v, 0) for v, n in index_counts.items()}
            raise InvariantViolation(
                "replaying the events reproduces the hash index",
                f"replay only: { {v: n for v, n in replay_only.items() if n > 0} }, "
                f"index only: { {v: n for v, n in index_only.items() if n > 0} }",
            )

    # -- helpers -----------------------------------------------------------------------------

    def _require_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_gpu_blocks:
            raise refusals.foreign_block(block_id)

    def add_partial_key_unchecked(
        self,
        block_id: int,
        key: CacheKey,
        parent: int | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Index the held block `block_id` under `key` too (vLLM 0.33's `cache_partial_block`
        for a full-attention block above the hash block size): as a secondary key of a hashed
        block, removed with its hash; as its hash if it has none (`evict_blocks` took it).
        Nothing if the block is the null block or carries the key already. A key new to the
        index is announced by a BlockStored of its one hash block (its tokens, `parent` the
        hash value before it, the request's `lora_id`), as vLLM 0.33 announces it."""
        if block_id == NULL_BLOCK_ID or key == self.block_hash[block_id]:
            return
        if key in self.partial_keys.get(block_id, ()):
            return
        if self.block_hash[block_id] is None:
            with self._transition(block_id, Event.SEAL):
                self.block_hash[block_id] = key
            self.partial_hashed.add(block_id)
        else:
            self.partial_keys.setdefault(block_id, []).append(key)
        if self.enable_kv_cache_events and key not in self.index:
            chunk = key_hash(key)
            self.events.append(
                BlockStored(
                    block_hashes=(chunk.hash_value,),
                    parent_block_hash=parent,
                    token_ids=chunk.token_ids,
                    block_size=len(chunk.token_ids),
                    lora_id=lora_id,
                    extra_keys=(published_keys(chunk),),
                    group_idx=key_group(key),
                )
            )
        self.index[key] = (*self.index.get(key, ()), block_id)

    def _drop_partial_keys(self, block_id: int) -> None:
        """The block's partial keys leave the index with its hash."""
        self.partial_hashed.discard(block_id)
        for key in self.partial_keys.pop(block_id, ()):
            self._unindex(block_id, key)

    def _unindex(self, block_id: int, key: CacheKey) -> None:
        remaining = list(self.index[key])
        remaining.remove(block_id)
        if remaining:
            self.index[key] = tuple(remaining)
        else:
            del self.index[key]
            if self.enable_kv_cache_events:
                self.events.append(BlockRemoved((key_hash(key).hash_value,), key_group(key)))

    def _emit_stored(
        self,
        request: Request,
        chain: list[BlockHashType],
        entered: list[int],
        num_cached_blocks: int,
        first_parent: int | None,
        block_size: int,
        group_id: int,
    ) -> None:
        """One BlockStored per run of consecutive positions in `entered` (keys new to the index)
        of group `group_id`.

        A run's parent is the hash value its first block chains to: `first_parent` for the
        call's first position, else the hash of the position before the run.
        """
        runs: list[list[int]] = []
        for position in entered:
            if runs and runs[-1][-1] == position - 1:
                runs[-1].append(position)
            else:
                runs.append([position])
        for run in runs:
            first = run[0]
            parent = first_parent if first == num_cached_blocks else chain[first - 1].hash_value
            keys = [self._event_key(request, chain[p], p, block_size) for p in run]
            self.events.append(
                BlockStored(
                    block_hashes=tuple(key.hash_value for key in keys),
                    parent_block_hash=parent,
                    token_ids=tuple(token for key in keys for token in key.token_ids),
                    block_size=block_size,
                    lora_id=request.lora_id,
                    extra_keys=tuple(published_keys(key) for key in keys),
                    group_idx=group_id,
                )
            )

    def _event_key(
        self, request: Request, key: BlockHashType, position: int, block_size: int
    ) -> BlockHashType:
        """The key an event publishes for the block at `position`: its own, or, for a block of
        several hash blocks (groups of several block sizes: its key is the chain hash at its
        end, over its last H tokens), that hash value with all the block's tokens and their
        extra keys."""
        if len(key.token_ids) == block_size:
            return key
        start, end = position * block_size, (position + 1) * block_size
        extra_keys = block_extra_keys(
            request, start, end, mm_position=not self.semantics.mm_keys_without_position
        )
        return BlockHashType(key.hash_value, tuple(request.all_token_ids[start:end]), extra_keys)

    def _transition(self, block_id: int, event: Event) -> _Transition:
        return _Transition(self, block_id, event)

    def __repr__(self) -> str:
        return (
            f"SpecBlockPool(ref_cnt={self.ref_cnt}, free_order={self.free_order}, "
            f"hashed={[b for b, h in enumerate(self.block_hash) if h is not None]})"
        )


def published_keys(block_hash: BlockHashType) -> tuple[int | str, ...] | None:
    """A key's extra keys as events publish them: LoRA ids and multimodal content hashes (an
    input's place in the block is not published: the hash value covers it), never the
    tenant's cache salt (whoever knew it could hit the tenant's blocks)."""
    kept: list[int | str] = []
    for key in block_hash.extra_keys or ():
        if isinstance(key, MultimodalKey):
            kept.append(key.mm_hash)
        elif isinstance(key, (int, str)):
            kept.append(key)
    return tuple(kept) if kept else None


def replayed_hash_counts(
    counts: dict[tuple[int, int], int], events: list[KVCacheEvent]
) -> dict[tuple[int, int], int]:
    """`counts` ((group, hash value) -> keys) after a consumer applies `events` in order.

    Raises:
        InvariantViolation: a BlockRemoved of a hash value the consumer does not hold.
    """
    replayed = dict(counts)
    for event in events:
        if isinstance(event, AllBlocksCleared):
            replayed = {}
            continue
        for hash_value in event.block_hashes:
            counted = (event.group_idx, hash_value)
            if isinstance(event, BlockStored):
                replayed[counted] = replayed.get(counted, 0) + 1
            elif replayed.get(counted, 0) == 0:
                raise InvariantViolation(
                    "replaying the events reproduces the hash index",
                    f"BlockRemoved of hash {hash_value} (group {event.group_idx}), which no "
                    "BlockStored announced",
                )
            elif replayed[counted] == 1:
                del replayed[counted]
            else:
                replayed[counted] -= 1
    return replayed


class _Transition:
    """Checks that the state change made inside the `with` block is listed in TRANSITIONS."""

    __slots__ = ("before", "block_id", "event", "pool")

    def __init__(self, pool: SpecBlockPool, block_id: int, event: Event) -> None:
        self.pool, self.block_id, self.event = pool, block_id, event

    def __enter__(self) -> None:
        pool, block_id = self.pool, self.block_id  # pool.state(block_id), inlined
        self.before = state_of(pool.ref_cnt[block_id], pool.block_hash[block_id] is not None)

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is not None:
            return
        pool, block_id = self.pool, self.block_id
        after = state_of(pool.ref_cnt[block_id], pool.block_hash[block_id] is not None)
        allowed = TRANSITIONS.get((self.before, self.event), frozenset())
        if after not in allowed:
            raise InvariantViolation(
                "every block state change is in TRANSITIONS",
                f"block {self.block_id}: {self.before.value} --{self.event.value}--> "
                f"{after.value}; allowed: {sorted(state.value for state in allowed)}",
            )
