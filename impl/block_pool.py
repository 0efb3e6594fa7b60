"""BlockPool: every block's metadata, the free queue, and the index of cached full blocks."""

from __future__ import annotations

import gc
import logging
from collections import Counter
from collections.abc import Iterable, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_hash import (
    chain_block_hash,
    chain_block_hashes,
    first_mm_input,
    generate_block_hash_extra_keys,
    hash_value_of,
)
from pagedkv.call_arguments import (
    block_list,
    check_cache_full_blocks,
    check_cache_key,
    check_get_new_blocks,
    check_pool,
    is_block_id,
)
from pagedkv.events.index import (
    HashCount,
    block_removed,
    block_stored,
    index_hash_counts,
    replay_hash_counts,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import require_int
from pagedkv.vocab.errors import (
    ConcurrentUseError,
    InvariantViolation,
    NoFreeBlocksError,
)
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey, HashFn, key_group
from pagedkv.vocab.kv_events import AllBlocksCleared, KVCacheEvent, KVEventReplayError
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import PAGEDKV, Semantics

logger = logging.getLogger(__name__)

_new_tuple = tuple.__new__  # GroupKey(group, hash) without the NamedTuple's Python-level __new__


class BlockPool:
    """Allocates, frees and caches the blocks of one KV cache.

    Blocks 1..N-1 start in the free queue in id order; block 0 is the `null_block`, a placeholder
    that sliding-window tables hold for skipped positions: never queued, hashed or handed out,
    and (unless `semantics.null_block_refcounted`) its ref_cnt never changes. Eviction is lazy: a
    freed cached block keeps its hash, can still be hit, and loses it only when handed out again.
    The index is keyed by `CacheKey`: a block cached for KV cache group 0 under its hash, one of
    a hybrid model's group g >= 1 under `GroupKey(g, hash)` (`cache_full_blocks`' `group_id`);
    a cached block's `block_hash` is that key.
    Every public method checks all its preconditions, argument types included
    (`pagedkv.call_arguments`), before it changes anything, and refuses blocks of another pool.
    Not thread-safe: a call that overlaps another state-changing call or invariant check on the
    same pool raises `ConcurrentUseError` and changes nothing (a guard of about 50 ns a call).
    With `enable_kv_cache_events`, every change of the index's key set is queued as a KV cache
    event (`pagedkv.vocab.kv_events`) until `take_events()`; off, nothing is queued and no hot path
    tests the flag (only a key entering or leaving the index does).
    Invariants: `check_invariants()`, which mirrors `pagedkv.spec.SpecBlockPool`.

    A `KVCacheManager` shares the pool's call token (`share_call_token`) and, holding it, calls
    the `*_locked` methods: the public method of the same name for a caller that holds the
    token and whose arguments are its own, already checked; the decode fast path's steps
    (`cache_next_full_block_locked`, `append_new_block_locked`), which make their whole change
    or return False (None) having changed nothing; the checks of a request's prefix hits
    (`intern_hashes_locked`, `check_hits_locked`); and, with several block sizes under
    vllm-0.33, a block's secondary key (`add_partial_key_locked`). Besides those it reads `blocks`,
    `null_block`, the O(1) queries and, for a lookup, the index (`cached_block`,
    `cached_block_hash_to_block`), and `tests/test_pool_surface.py` holds the manager's modules
    (its coordinators and per-type managers with it) to exactly that surface: every ref_cnt,
    free-queue and index write happens in the pool.

    Args:
        num_gpu_blocks: number of blocks, the null block included (>= 1).
        enable_caching: whether freed full blocks stay hittable until evicted.
        semantics: pagedkv's or vLLM 0.8.5's side of the deliberate differences.
        enable_kv_cache_events: queue KV cache events for `take_events()`.
    """

    def __init__(
        self,
        num_gpu_blocks: object,
        enable_caching: object,
        semantics: Semantics = PAGEDKV,
        enable_kv_cache_events: object = False,
    ) -> None:
        # Arguments a caller supplies are typed `object` and checked here, so that a compiled
        # build refuses a wrong type with the same typed error as the pure one (mypyc would
        # raise a bare TypeError before the body runs). The same holds for every public call.
        check_pool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events)
        assert isinstance(num_gpu_blocks, int) and isinstance(enable_caching, bool)
        assert isinstance(enable_kv_cache_events, bool)
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.semantics = semantics
        # A million new blocks would set off collections that cannot find garbage among them,
        # each one scanning every tracked object: three times the construction's own time.
        # The collector is paused while they are made and linked, then left as it was.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
            self.free_block_queue = FreeKVCacheBlockQueue._of_new_blocks(self.blocks)
        finally:
            if collecting:
                gc.enable()
        # {key: {block_id: block}}; one content may be cached in several blocks (no dedup, so
        # block tables stay append-only). The first-inserted block answers lookups. A key is a
        # hash (KV cache group 0) or a GroupKey (group, hash).
        self.cached_block_hash_to_block: dict[CacheKey, dict[int, KVCacheBlock]] = {}
        # Block id -> its secondary ("partial") keys, indexed beside its hash and removed with
        # it (vllm-0.33's `partial_prefix_keys`: `add_partial_key_locked`); empty otherwise.
        self.partial_keys: dict[int, list[CacheKey]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # What a consumer that applied every taken batch holds (replay_hash_counts), and the first
        # batch it could not apply: the replay invariant's base.
        self._taken_hash_counts: Counter[HashCount] = Counter()
        self._taken_replay_error: str | None = None
        # The call token: a public call pops it (list.pop is atomic) and puts it back when done;
        # a call that finds the list empty overlaps another one and is refused. A manager shares
        # it (share_call_token) and calls the `*_locked` methods, which assume it is held.
        self._idle: list[None] = [None]

    def _enter(self, call: str) -> None:
        """Take the call token, or refuse a call that overlaps another one."""
        try:
            self._idle.pop()
        except IndexError:
            raise ConcurrentUseError(call) from None

    def share_call_token(self) -> list[None]:
        """The call token, for an owner whose calls must exclude the pool's (a manager): a list
        that holds one None while no call runs. `pop()` takes the token, or raises IndexError
        while another call holds it; `append(None)` gives it back; both are atomic. Holding
        it, the owner may call the `*_locked` methods.

        Complexity: O(1); so are taking and giving back.
        """
        return self._idle

    def get_cached_block(self, block_hash: object) -> KVCacheBlock | None:
        """The first-inserted block cached under `block_hash`: a hash (KV cache group 0), or a
        `GroupKey` of a group >= 1. None when no block is.

        Raises:
            ArgumentTypeError: `block_hash` is neither a hashable BlockHashType nor a GroupKey
                over one.
            InvalidArgumentError: a GroupKey of a group < 1 (group 0's key is the hash itself).

        Complexity: O(1).
        """
        return self.cached_block(
            check_cache_key("BlockPool.get_cached_block", "block_hash", block_hash)
        )

    def cached_block(self, block_hash: CacheKey) -> KVCacheBlock | None:
        """`get_cached_block` for a key the caller made itself (no argument check): the lookup
        of the attention policies, once per block of a request. Complexity: O(1)."""
        cached = self.cached_block_hash_to_block.get(block_hash)
        if not cached:
            return None
        return next(iter(cached.values()))

    def get_new_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the queue head, evicting any cached ones.

        Returns:
            The blocks in pop order, each with ref_cnt 1 and no hash.

        Raises:
            ArgumentTypeError, InvalidArgumentError: `num_blocks` is not an int >= 0.
            NoFreeBlocksError: fewer than `num_blocks` blocks are free.
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(num_blocks).
        """
        self._enter("BlockPool.get_new_blocks")
        try:
            return self.get_new_blocks_locked(check_get_new_blocks(num_blocks))
        finally:
            self._idle.append(None)

    def get_new_blocks_locked(self, num_blocks: int) -> list[KVCacheBlock]:
        """`get_new_blocks` for a caller that holds the call token, with a count >= 0.

        Raises:
            NoFreeBlocksError: fewer than `num_blocks` blocks are free (nothing changed).

        Complexity: O(num_blocks).
        """
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise NoFreeBlocksError(num_blocks, num_free)
        popleft = self.free_block_queue.popleft
        blocks = []
        for _ in range(num_blocks):
            block = popleft()
            if block._block_hash is not None:
                self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
            blocks.append(block)
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop `block` from the index and clear its hash, if it has one. Complexity: O(1)."""
        block_hash = block._block_hash
        if block_hash is None:
            return
        cached = self.cached_block_hash_to_block[block_hash]
        del cached[block.block_id]
        if not cached:
            del self.cached_block_hash_to_block[block_hash]
            if self.enable_kv_cache_events:  # the key left the index
                self.kv_event_queue.append(block_removed(block_hash))
        block.reset_hash()
        if self.partial_keys:  # only with several block sizes under vllm-0.33
            for key in self.partial_keys.pop(block.block_id, ()):
                cached = self.cached_block_hash_to_block[key]
                del cached[block.block_id]
                if not cached:
                    del self.cached_block_hash_to_block[key]
                    if self.enable_kv_cache_events:
                        self.kv_event_queue.append(block_removed(key))

    def add_partial_key_locked(
        self,
        block: KVCacheBlock,
        key: CacheKey,
        parent: int | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Index the held `block` under `key` too (the spec pool's `add_partial_key_unchecked`:
        vLLM 0.33's `cache_partial_block`): a secondary key of a hashed block, removed with its
        hash; its hash if it has none. Nothing for the null block or a key it carries already.
        A key new to the index is announced by a BlockStored of its one hash block (`parent`:
        the hash value before it). Complexity: O(the block's partial keys)."""
        if block is self.null_block or block._block_hash == key:
            return
        keys = self.partial_keys.get(block.block_id)
        if keys is not None and key in keys:
            return
        if block._block_hash is None:
            block._block_hash = key
        elif keys is None:
            self.partial_keys[block.block_id] = [key]
        else:
            keys.append(key)
        if self.enable_kv_cache_events and key not in self.cached_block_hash_to_block:
            chunk = key.block_hash if isinstance(key, GroupKey) else key
            self.kv_event_queue.append(
                block_stored([chunk], parent, len(chunk.token_ids), lora_id, key_group(key))
            )
        self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit).

        `blocks` is read once, so any iterable works. A block with ref_cnt 0 leaves the free
        queue first. The null block is passed over.

        Raises:
            ArgumentTypeError: `blocks` is not iterable, or an item is not a KVCacheBlock.
            BlockStateError: a block does not belong to this pool.
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(len(blocks)).
        """
        self._enter("BlockPool.touch")
        try:
            self._touch(block_list("BlockPool.touch", "blocks", blocks, KVCacheBlock))
        finally:
            self._idle.append(None)

    def _touch(self, blocks: list[KVCacheBlock]) -> None:
        """touch for a list of KVCacheBlocks (the caller holds the call token)."""
        owned = self.blocks
        num_gpu_blocks = self.num_gpu_blocks
        for block in blocks:
            block_id = block.block_id
            if not 0 <= block_id < num_gpu_blocks or owned[block_id] is not block:
                raise refusals.foreign_block(block_id)  # _check_owned, inline
        self.touch_owned_locked(blocks)

    def touch_owned_locked(self, blocks: list[KVCacheBlock]) -> None:
        """`touch` for a caller that holds the call token, with blocks it has checked are this
        pool's (a manager's checked hits: `check_hits_locked`). Complexity: O(len(blocks))."""
        null_block = self.null_block
        remove = self.free_block_queue.remove
        for block in blocks:
            if block is null_block:
                if self.semantics.null_block_refcounted:
                    block.ref_cnt += 1
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; a block reaching 0 joins the queue tail.

        The caller's order is the eviction order (first freed, first evicted). The null block is
        passed over. Under `free_uncached_to_head`, blocks without a hash go to the head instead,
        in the caller's order, ahead of every queued block (they hold nothing worth keeping).

        Raises:
            ArgumentTypeError: `ordered_blocks` is not iterable, or an item is not a
                KVCacheBlock.
            BlockStateError: a block does not belong to this pool, has ref_cnt 0, or appears
                twice in the call.
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(number of blocks).
        """
        self._enter("BlockPool.free_blocks")
        try:
            self.free_blocks_locked(
                block_list("BlockPool.free_blocks", "ordered_blocks", ordered_blocks, KVCacheBlock)
            )
        finally:
            self._idle.append(None)

    def free_blocks_locked(self, blocks: list[KVCacheBlock]) -> None:
        """`free_blocks` for a caller that holds the call token, with a list of KVCacheBlocks.

        Raises:
            BlockStateError: as `free_blocks` (foreign, free, or listed twice); nothing changed.

        Complexity: O(len(blocks)).
        """
        null_block = self.null_block
        owned = self.blocks
        num_gpu_blocks = self.num_gpu_blocks
        # Blocks are hashed by identity: with none listed twice (the common case, one set in
        # C), the loop below need not track which it has seen.
        repeats = len(set(blocks)) != len(blocks)
        seen: set[int] = set()
        for block in blocks:
            block_id = block.block_id
            if not 0 <= block_id < num_gpu_blocks or owned[block_id] is not block:
                raise refusals.foreign_block(block_id)  # _check_owned, inline
            if block is null_block:
                continue
            if block.ref_cnt <= 0:
                raise refusals.free_of_free_block(block_id)
            if repeats:
                if block_id in seen:
                    raise refusals.freed_twice(block_id)
                seen.add(block_id)
        uncached_first = self.semantics.free_uncached_to_head
        to_tail: list[KVCacheBlock] = []
        to_head: list[KVCacheBlock] = []
        for block in blocks:
            if block is null_block:
                if self.semantics.null_block_refcounted:
                    block.ref_cnt -= 1
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if uncached_first and block._block_hash is None:
                    to_head.append(block)
                else:
                    to_tail.append(block)
        if to_tail:
            self.free_block_queue.append_released(to_tail)
        for block in reversed(to_head):
            self.free_block_queue.appendleft(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: object,
        num_cached_blocks: object,
        num_full_blocks: object,
        block_size: object,
        hash_fn: HashFn,
        group_id: object = 0,
    ) -> None:
        """Hash blocks `[num_cached_blocks, num_full_blocks)` and add them to the index.

        A block's hash comes from `block_hashes` when present there; otherwise it is computed
        from the request's tokens, chained to the previous block's hash value, and appended to
        `block_hashes` (the request's stored hashes). A null block in the range (a position a
        sliding window already dropped) is passed over: its hash is stored so the chain goes on,
        but nothing is indexed. When the previous block is a null block, the chain continues
        from the stored hash at its position. The blocks are indexed for KV cache group
        `group_id`: under their hash (group 0), or under `GroupKey(group_id, hash)`; the stored
        hashes are the request's, the same for every group.

        Raises:
            ArgumentTypeError: an argument of the wrong type (`check_cache_full_blocks` lists
                them), or a hash function that returns something else than an int.
            InvalidArgumentError: prefix caching is off, the counts are out of range, a stored
                hash is missing below `num_cached_blocks`, or the request has too few tokens.
            BlockStateError: a block to cache is foreign, free, already hashed, or listed twice;
                or the previous block is foreign, or neither hashed nor the null block.
            ConcurrentUseError: another call on this pool is running.

        Complexity: O((num_full_blocks - num_cached_blocks) * block_size) plus O(log inputs) for
        a request with multimodal inputs.
        """
        self._enter("BlockPool.cache_full_blocks")
        try:
            checked = check_cache_full_blocks(
                self.enable_caching,
                request,
                blocks,
                block_hashes,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                hash_fn,
                KVCacheBlock,
                group_id,
            )
            if checked is not None:
                assert isinstance(block_hashes, list) and isinstance(num_cached_blocks, int)
                assert isinstance(num_full_blocks, int) and isinstance(block_size, int)
                assert isinstance(group_id, int)
                self.cache_full_blocks_locked(
                    request,
                    checked,
                    block_hashes,
                    num_cached_blocks,
                    num_full_blocks,
                    block_size,
                    hash_fn,
                    group_id,
                )
        finally:
            self._idle.append(None)

    def cache_full_blocks_locked(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
        group_id: int = 0,
        retained: list[bool] | None = None,
        parent_from_stored: bool = False,
    ) -> None:
        """`cache_full_blocks` for a caller that holds the call token, with arguments of the
        checked types (`group_id` an int >= 0) and at least one block to cache: the block
        rules, then every hash, then the changes.

        `retained` (a manager's sparse retention): one flag per block of the range; a block
        flagged False is hashed into the chain but gets no hash and no index entry, and a
        parent left unhashed that way chains through the stored hash at its position.
        `parent_from_stored` (a manager, whose stored hashes are the chain): so does a parent
        whose hash `evict_blocks` took.

        Raises:
            ArgumentTypeError, InvalidArgumentError, BlockStateError: as `cache_full_blocks`
                for its block and token rules and the hash function's values; nothing changed.

        Complexity: as `cache_full_blocks`.
        """
        parent_hash_value = self._check_blocks_to_cache(
            blocks,
            block_hashes,
            num_cached_blocks,
            num_full_blocks,
            retained is not None or parent_from_stored,
        )
        first_parent = parent_hash_value
        # Compute every hash before changing anything, so a failure leaves no trace.
        num_given = len(block_hashes) - num_cached_blocks
        vllm_mm_keys = self.semantics.vllm_new_block_mm_keys
        # The request's slots are read directly (its identity is fixed at construction).
        with_extra_keys = (
            bool(request._mm_positions)
            or request._lora_id is not None
            or request._cache_salt is not None
        )
        mm_idx = -1  # the first multimodal input to scan, found at the first block hashed
        extra_keys = None
        new_hashes: list[BlockHashType] = []
        token_ids = request._all_token_ids
        for position in range(num_cached_blocks, num_full_blocks):
            if position - num_cached_blocks < num_given:
                block_hash = block_hashes[position]
            else:
                start = position * block_size
                end = start + block_size
                if len(token_ids) < end:
                    raise refusals.too_few_tokens(
                        request.request_id, len(token_ids), position, block_size
                    )
                if with_extra_keys:
                    if vllm_mm_keys:  # the last input only (difference 6)
                        mm_idx = max(len(request.mm_positions) - 1, 0)
                    elif mm_idx < 0:  # then carried from block to block: linear
                        mm_idx = first_mm_input(request.mm_positions, start)
                    extra_keys, mm_idx = generate_block_hash_extra_keys(
                        request,
                        start,
                        end,
                        mm_idx,
                        include_touching=vllm_mm_keys,
                        mm_position=not self.semantics.mm_keys_without_position,
                    )
                block_hash = chain_block_hash(
                    hash_fn, parent_hash_value, tuple(token_ids[start:end]), extra_keys
                )
                returned = hash_value_of(block_hash)
                if type(returned) is not int:
                    require_int(
                        "BlockPool.cache_full_blocks", "the value hash_fn returned", returned
                    )
                new_hashes.append(block_hash)
            parent_hash_value = block_hash.hash_value

        null_block = self.null_block
        index = self.cached_block_hash_to_block
        entered: list[int] | None = [] if self.enable_kv_cache_events else None
        for offset, block in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            block_hash = (
                block_hashes[num_cached_blocks + offset]
                if offset < num_given
                else new_hashes[offset - num_given]
            )
            if block is not null_block and (retained is None or retained[offset]):
                # The index key: the hash itself in group 0 (vocab.hashes.cache_key, inline).
                key: CacheKey = (
                    _new_tuple(GroupKey, (group_id, block_hash)) if group_id else block_hash
                )
                block._block_hash = key
                cached = index.get(key)
                if cached is None:
                    index[key] = {block.block_id: block}
                    if entered is not None:  # the key entered the index
                        entered.append(num_cached_blocks + offset)
                else:
                    cached[block.block_id] = block
        block_hashes.extend(new_hashes)
        if entered:
            self._announce_stored(
                request,
                block_hashes,
                entered,
                num_cached_blocks,
                first_parent,
                block_size,
                group_id,
            )

    def cache_next_full_block_locked(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> bool:
        """The decode step that fills a block: `cache_full_blocks_locked` for the one block
        `blocks[num_cached_blocks]` of KV cache group 0, in the common case (a request without
        extra keys, events off, a block and a parent that pass every block rule, a parent of
        group 0 when it is not the null block, a hash function that returns an int).

        The caller holds the call token and guarantees the block is full: the request has at
        least `(num_cached_blocks + 1) * block_size` tokens and `blocks` that many slots.

        Returns:
            True once the block is hashed, indexed and its hash appended to `block_hashes`
            (unless already stored); False, having changed nothing, when the case is not the
            common one: the caller then takes the full path, which refuses what is wrong with
            the message of its rule.

        Complexity: O(block_size) plus the hash function.
        """
        if (
            self.enable_kv_cache_events
            or request._mm_positions
            or request._lora_id is not None
            or request._cache_salt is not None
            or len(block_hashes) < num_cached_blocks
        ):
            return False
        owned = self.blocks
        num_gpu_blocks = self.num_gpu_blocks
        null_block = self.null_block
        block = blocks[num_cached_blocks]
        block_id = block.block_id
        if (
            not 0 <= block_id < num_gpu_blocks
            or owned[block_id] is not block
            or block is null_block
            or block.ref_cnt <= 0
            or block._block_hash is not None
        ):
            return False
        parent_hash_value: int | None = None
        if num_cached_blocks:
            parent = blocks[num_cached_blocks - 1]
            parent_id = parent.block_id
            if not 0 <= parent_id < num_gpu_blocks or owned[parent_id] is not parent:
                return False
            if parent is null_block:
                parent_hash_value = block_hashes[num_cached_blocks - 1].hash_value
            else:
                parent_hash = parent._block_hash
                if type(parent_hash) is not BlockHashType:
                    return False  # not hashed, or another group's key: the full path decides
                parent_hash_value = parent_hash.hash_value
        computed = len(block_hashes) == num_cached_blocks
        if computed:
            block_hash = chain_block_hashes(
                hash_fn,
                parent_hash_value,
                request._all_token_ids,
                num_cached_blocks * block_size,
                1,
                block_size,
            )[0]
            if type(hash_value_of(block_hash)) is not int:
                return False
        else:
            block_hash = block_hashes[num_cached_blocks]
        # -- every rule holds: the changes, as cache_full_blocks_locked makes them --
        block._block_hash = block_hash
        cached = self.cached_block_hash_to_block.get(block_hash)
        if cached is None:
            self.cached_block_hash_to_block[block_hash] = {block_id: block}
        else:
            cached[block_id] = block
        if computed:
            block_hashes.append(block_hash)
        return True

    def append_new_block_locked(self, blocks: list[KVCacheBlock]) -> KVCacheBlock | None:
        """The decode step that needs a new block: `get_new_blocks_locked(1)` appended to the
        request's `blocks`, for a caller that holds the call token.

        Returns:
            The block, once the queue's head (its cached hash evicted) has ref_cnt 1 and ends
            `blocks`; None, having changed nothing, when no block is free (the caller's full
            path then decides).

        Complexity: O(1).
        """
        queue = self.free_block_queue
        block = queue.free_list_head
        if block is None:
            return None
        # queue.popleft(), inline: one Python call less on the decode path
        following = block.next_free_block
        queue.free_list_head = following
        if following is None:
            queue.free_list_tail = None
        else:
            following.prev_free_block = None
            block.next_free_block = None
        queue.num_free_blocks -= 1
        if block._block_hash is not None:
            self._maybe_evict_cached_block(block)
        block.ref_cnt += 1
        blocks.append(block)
        return block

    def intern_hashes_locked(
        self, blocks: Sequence[KVCacheBlock], block_hashes: list[BlockHashType]
    ) -> None:
        """Store in `block_hashes[i]` the hash object `blocks[i]` is cached under, for each
        cached block (null blocks are passed over), for a caller that holds the call token and
        whose blocks are KV cache group 0's (their key is their hash; a hybrid manager interns
        group 0's hits only).

        `blocks` are a lookup's hits for `block_hashes`, so each stored hash equals its block's;
        storing the block's own object makes `check_hits_locked`'s test of a later allocation
        an identity test, not a comparison of two equal tuples of tokens.

        Complexity: O(len(blocks)).
        """
        for position, block in enumerate(blocks):
            cached_hash = block._block_hash
            if cached_hash is not None:  # a hash: group 0's key (no test of it on this path)
                block_hashes[position] = cached_hash  # type: ignore[assignment]

    def check_hits_locked(
        self,
        request_id: str,
        blocks: list[KVCacheBlock],
        block_hashes: Sequence[BlockHashType],
        allows_null_blocks: bool,
        group_id: int = 0,
    ) -> None:
        """Refuse prefix hits that are not this pool's blocks cached for KV cache group
        `group_id` under the request's stored hashes, position by position; a null block passes
        where `allows_null_blocks` (a skipped position of a sliding window or a chunked local
        group). For a caller that holds the call token, with no more hits than stored hashes.

        Raises:
            BlockStateError: a hit of another pool, or a null hit where none is allowed.
            RequestError: a hit not cached under the stored hash at its position (in another
                group, or under another hash).

        Complexity: O(len(blocks)); in group 0, an identity test per hit after
        `intern_hashes_locked`.
        """
        owned = self.blocks
        num_gpu_blocks = self.num_gpu_blocks
        null_block = self.null_block
        if group_id:
            for position, block in enumerate(blocks):
                block_id = block.block_id
                if not 0 <= block_id < num_gpu_blocks or owned[block_id] is not block:
                    raise refusals.foreign_block(block_id)  # _check_owned, inline
                if block is null_block:
                    if not allows_null_blocks:
                        raise refusals.null_hit(block_id)
                    continue
                if block._block_hash != _new_tuple(GroupKey, (group_id, block_hashes[position])):
                    raise refusals.hit_not_cached(request_id, block_id, position)
            return
        for position, block in enumerate(blocks):
            block_id = block.block_id
            if not 0 <= block_id < num_gpu_blocks or owned[block_id] is not block:
                raise refusals.foreign_block(block_id)  # _check_owned, inline
            block_hash = block._block_hash
            if block_hash is not block_hashes[position]:
                if block is null_block:
                    if not allows_null_blocks:
                        raise refusals.null_hit(block_id)
                    continue
                if block_hash != block_hashes[position]:
                    raise refusals.hit_not_cached(request_id, block_id, position)

    def _announce_stored(
        self,
        request: Request,
        chain: list[BlockHashType],
        positions: list[int],
        num_cached_blocks: int,
        first_parent: int | None,
        block_size: int,
        group_id: int,
    ) -> None:
        """Queue one BlockStored per run of consecutive `positions` whose keys (of KV cache group
        `group_id`) entered the index.

        A run's parent is the hash value its first block chains to: `first_parent` for the
        call's first position, else the hash of the position before it in `chain`.
        """
        start = 0
        for end in range(1, len(positions) + 1):
            if end < len(positions) and positions[end] == positions[end - 1] + 1:
                continue
            first, last = positions[start], positions[end - 1]
            parent = first_parent if first == num_cached_blocks else chain[first - 1].hash_value
            run = chain[first : last + 1]
            if len(run[0].token_ids) != block_size:  # keys of several hash blocks each
                run = self._event_keys(request, run, first, block_size)
            self.kv_event_queue.append(
                block_stored(run, parent, block_size, request.lora_id, group_id)
            )
            start = end

    def _event_keys(
        self, request: Request, run: list[BlockHashType], first: int, block_size: int
    ) -> list[BlockHashType]:
        """What events publish for blocks `first`, ... of several hash blocks each (groups of
        several block sizes: a key is the chain hash at its block's end, over its last H
        tokens): each key's hash value with all its block's tokens and their extra keys.
        Complexity: O(the run's tokens + multimodal inputs)."""
        token_ids = request.all_token_ids
        keys = []
        mm_idx = first_mm_input(request.mm_positions, first * block_size)
        mm_position = not self.semantics.mm_keys_without_position
        for offset, key in enumerate(run):
            start = (first + offset) * block_size
            extra_keys, mm_idx = generate_block_hash_extra_keys(
                request, start, start + block_size, mm_idx, mm_position=mm_position
            )
            tokens = tuple(token_ids[start : start + block_size])
            keys.append(BlockHashType(key.hash_value, tokens, extra_keys))
        return keys

    def _check_blocks_to_cache(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: list[BlockHashType],
        num_cached_blocks: int,
        num_full_blocks: int,
        sparse: bool = False,
    ) -> int | None:
        """cache_full_blocks' block rules in the spec's order; returns the parent's hash value
        (None at the chain's start; `sparse`: an unhashed parent was left out by retention, or
        lost its hash to `evict_blocks`, and chains through its stored hash)."""
        null_block = self.null_block
        owned = self.blocks
        num_gpu_blocks = self.num_gpu_blocks
        seen: set[int] = set()
        for block in blocks[num_cached_blocks:num_full_blocks]:
            block_id = block.block_id
            if not 0 <= block_id < num_gpu_blocks or owned[block_id] is not block:
                raise refusals.foreign_block(block_id)  # _check_owned, inline
            if block is null_block:
                continue
            if block.ref_cnt <= 0:
                raise refusals.cache_of_free_block(block_id)
            if block._block_hash is not None:
                raise refusals.hash_already_set(block_id)
            if block_id in seen:
                raise refusals.cached_twice(block_id)
            seen.add(block_id)
        if num_cached_blocks == 0:
            return None
        parent = blocks[num_cached_blocks - 1]
        if not 0 <= parent.block_id < num_gpu_blocks or owned[parent.block_id] is not parent:
            raise refusals.foreign_block(parent.block_id)
        if parent is null_block:
            return block_hashes[num_cached_blocks - 1].hash_value
        parent_key = parent._block_hash
        if parent_key is None:
            if sparse:
                return block_hashes[num_cached_blocks - 1].hash_value
            raise refusals.parent_without_hash(parent.block_id)
        # The hash value its key holds (vocab.hashes.key_hash, inline), whichever its group.
        return (
            parent_key.block_hash.hash_value
            if isinstance(parent_key, GroupKey)
            else parent_key.hash_value
        )

    def evict_blocks(self, block_ids: object) -> None:
        """Take each listed block's hash out of the prefix cache, the block staying where it is:
        its references, and its place in the free queue if it is free (vLLM 0.33's
        `BlockPool.evict_blocks`, which a KV connector calls for blocks whose load failed). A
        block without a hash, the null block among them, is passed over; so is a block listed
        again. A key that leaves the index is announced by a BlockRemoved.

        Raises:
            ArgumentTypeError: `block_ids` is not iterable, or an item is not an int.
            BlockStateError: an id is not a block of this pool (nothing changed).
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(len(block_ids)).
        """
        self._enter("BlockPool.evict_blocks")
        try:
            self.evict_blocks_locked(
                block_list("BlockPool.evict_blocks", "block_ids", block_ids, is_block_id)
            )
        finally:
            self._idle.append(None)

    def evict_blocks_locked(self, block_ids: list[int]) -> list[KVCacheBlock]:
        """`evict_blocks` for a caller that holds the call token, with a list of ints.

        Returns:
            The blocks that lost their hash, in order.

        Raises:
            BlockStateError: an id is not a block of this pool (nothing changed).

        Complexity: O(len(block_ids)).
        """
        num_gpu_blocks = self.num_gpu_blocks
        for block_id in block_ids:
            if not 0 <= block_id < num_gpu_blocks:
                raise refusals.foreign_block(block_id)
        blocks = self.blocks
        evicted = []
        for block_id in block_ids:
            block = blocks[block_id]
            if block._block_hash is not None:
                self._maybe_evict_cached_block(block)
                evicted.append(block)
        return evicted

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no block but the null block is in use.

        Returns:
            True if the cache was reset; False (with a warning logged) if blocks are in use.

        Raises:
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(num_gpu_blocks).
        """
        self._enter("BlockPool.reset_prefix_cache")
        try:
            return self.reset_prefix_cache_locked()
        finally:
            self._idle.append(None)

    def reset_prefix_cache_locked(self) -> bool:
        """`reset_prefix_cache` for a caller that holds the call token.

        Complexity: O(num_gpu_blocks).
        """
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block always counts as used
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        self.cached_block_hash_to_block = {}
        self.partial_keys = {}
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events queued since the last call, oldest first; the queue is emptied.

        Always empty with `enable_kv_cache_events` off.

        Raises:
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(events taken): they are also applied to the replay invariant's base.
        """
        self._enter("BlockPool.take_events")
        try:
            return self._take_events()
        finally:
            self._idle.append(None)

    def _take_events(self) -> list[KVCacheEvent]:
        """take_events (the caller holds the call token)."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        if self._taken_replay_error is None:
            try:
                replay_hash_counts(events, self._taken_hash_counts)
            except KVEventReplayError as error:
                self._taken_replay_error = str(error)
        return events

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue, evictable cached ones included. Complexity: O(1)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks not free, the null block counted as used (or, under
        `usage_excludes_null_block`, left out of both counts). Complexity: O(1)."""
        if self.semantics.usage_excludes_null_block:
            usable = self.num_gpu_blocks - 1
            return 1.0 - self.get_num_free_blocks() / usable if usable else 0.0
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks

    def _check_owned(self, block: KVCacheBlock) -> None:
        """Refuse a block of another pool (after its type was checked). The per-block loops
        inline this test."""
        block_id = block.block_id
        if not 0 <= block_id < self.num_gpu_blocks or self.blocks[block_id] is not block:
            raise refusals.foreign_block(block_id)

    def check_invariants(self) -> None:
        """Check every invariant of the spec's block pool on this pool.

        Raises:
            InvariantViolation: naming the first broken invariant and the state that breaks it.
            ConcurrentUseError: another call on this pool is running.

        Complexity: O(num_gpu_blocks + cached entries).
        """
        self._enter("BlockPool.check_invariants")
        try:
            self.check_invariants_locked()
        finally:
            self._idle.append(None)

    def check_invariants_locked(self) -> None:
        """`check_invariants` for a caller that holds the call token (a manager's own check
        runs the pool's first).

        Raises:
            InvariantViolation: naming the first broken invariant and the state that breaks it.

        Complexity: O(num_gpu_blocks + cached entries).
        """
        self.free_block_queue.check_invariants()
        null_block = self.null_block
        if null_block is not self.blocks[0] or null_block.block_id != 0:
            raise InvariantViolation("the null block is block 0", repr(null_block))
        if self.free_block_queue.contains(null_block):
            raise InvariantViolation("the null block is never free", repr(null_block))
        if null_block.block_hash is not None:
            raise InvariantViolation("the null block is never hashed", repr(null_block))
        if not self.semantics.null_block_refcounted and null_block.ref_cnt != 0:
            raise InvariantViolation("the null block's ref_cnt stays 0", repr(null_block))
        for block_id, block in enumerate(self.blocks):
            if block.block_id != block_id:
                raise InvariantViolation("blocks[i].block_id == i", repr(block))
            if block.owner_queue is not self.free_block_queue:
                raise InvariantViolation(
                    "every block belongs to the pool's free queue", repr(block)
                )
        queued = self.free_block_queue.get_all_free_blocks()
        for block in queued:
            if self.blocks[block.block_id] is not block:
                raise InvariantViolation("free blocks belong to the pool", repr(block))
        queued_ids = {block.block_id for block in queued}
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise InvariantViolation("ref_cnt >= 0", repr(block))
            if (block.ref_cnt == 0) != (block.block_id in queued_ids):
                raise InvariantViolation(
                    "a block is in the free queue iff its ref_cnt is 0", repr(block)
                )
        num_in_use = sum(1 for block in self.blocks[1:] if block.ref_cnt > 0)
        if len(queued) + num_in_use != self.num_gpu_blocks - 1:
            raise InvariantViolation(
                "free + in use == num_gpu_blocks - 1",
                f"{len(queued)} free + {num_in_use} in use != {self.num_gpu_blocks - 1}",
            )
        num_indexed = 0
        for block_hash, cached in self.cached_block_hash_to_block.items():
            if not cached:
                raise InvariantViolation(
                    "index entries are non-empty lists of distinct blocks", repr(block_hash)
                )
            for block_id, block in cached.items():
                num_indexed += 1
                if self.blocks[block_id] is not block or (
                    block.block_hash != block_hash
                    and block_hash not in self.partial_keys.get(block_id, ())
                ):
                    raise InvariantViolation(
                        "hash index <=> hashed blocks", f"{block_hash} -> {block!r}"
                    )
        num_hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        for block_id, keys in self.partial_keys.items():
            if not keys or self.blocks[block_id].block_hash is None or len(set(keys)) != len(keys):
                raise InvariantViolation(
                    "partial keys are distinct keys of hashed blocks", f"block {block_id}: {keys}"
                )
            num_hashed += len(keys)
        if num_hashed != num_indexed:
            raise InvariantViolation(
                "hash index <=> hashed blocks",
                f"{num_hashed} hashed blocks, {num_indexed} index entries",
            )
        if not self.enable_caching and num_hashed:
            raise InvariantViolation(
                "no block is hashed while caching is off", f"{num_hashed} hashed"
            )
        self._check_event_replay()

    def _check_event_replay(self) -> None:
        """Replaying every event emitted so far gives the index's count of keys per hash value."""
        if not self.enable_kv_cache_events:
            if self.kv_event_queue:
                raise InvariantViolation(
                    "no event is queued while events are off", repr(self.kv_event_queue[:3])
                )
            return
        if self._taken_replay_error is not None:
            raise InvariantViolation(
                "replaying the events reproduces the hash index",
                f"a taken batch: {self._taken_replay_error}",
            )
        try:
            replayed = replay_hash_counts(self.kv_event_queue, Counter(self._taken_hash_counts))
        except KVEventReplayError as error:
            raise InvariantViolation(
                "replaying the events reproduces the hash index", f"queued events: {error}"
            ) from None
        indexed = index_hash_counts(self.cached_block_hash_to_block)
        if replayed != indexed:
            raise InvariantViolation(
                "replaying the events reproduces the hash index",
                f"replay only: {dict(replayed - indexed)}, index only: {dict(indexed - replayed)}",
            )
