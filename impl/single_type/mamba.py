"""Mamba states (vLLM 0.33's `MambaManager`): `MambaAlignManager` serves `mamba_cache_mode`
"align" (prefix caching on, its class docstring), `MambaManager` mode "none": a request's
recurrent state lives in one block of `max_model_len` tokens, updated in place, and
`num_speculative_blocks` more blocks hold its draft tokens' states. Nothing is cached in mode
"none" (the manager refuses caching with it), so nothing is hit.
`pagedkv.spec.single_type.mamba` states the rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.single_type.base import SingleTypeKVCacheManager, T
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey, HashFn
from pagedkv.vocab.kv_cache_interface import MambaSpec
from pagedkv.vocab.refusals import MAMBA_HIT_DETAIL, mamba_align_hit_detail
from pagedkv.vocab.request import Request


class MambaManager(SingleTypeKVCacheManager):
    """One state block per request (plus its speculative states' blocks); a block wholly
    before the last computed token is no longer read."""

    kind = "Mamba state"
    allows_null_blocks = True

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.extra_blocks = kv_cache_spec.num_speculative_blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """No hit (caching is off with a Mamba group). Complexity: O(1)."""
        return []

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """No hit. Complexity: O(1)."""
        return []

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """Every hit: no lookup finds one. Complexity: O(1)."""
        return MAMBA_HIT_DETAIL

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the last computed token (`num_computed_tokens - 1`, vLLM's
        `get_num_skipped_tokens`). Complexity: O(1)."""
        return (num_computed_tokens - 1) // self.block_size


class MambaAlignManager(SingleTypeKVCacheManager):
    """Mamba states with prefix caching (vLLM 0.33's `MambaManager` in mode "align", engine
    defaults: no speculative or checkpoint blocks, no EAGLE). A request's table is positional:
    column c stands for the state after (c + 1) * B tokens; a step ending at e writes column
    `cdiv(e, B) - 1` (its running column) from the state in column `(s - 1) // B`, and every
    other column is the null block. `pagedkv.spec.single_type.mamba.MambaAlignState` states
    the rules.

    Attributes:
        keyed_this_step: the keys this group cached since the last `new_step_starts`.
        retired: request id -> columns before it are freed and null (the range walk's start).
        last_state: request id -> the column its last growing step started from.
    """

    kind = "Mamba state"
    allows_null_blocks = True
    supports_eagle = False
    acts_on_retention = True
    holds_state = True

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.keyed_this_step: set[CacheKey] = set()
        self.retired: dict[str, int] = {}
        self.last_state: dict[str, int] = {}
        # Speculative columns; not `extra_blocks`, whose groups take the per-group path.
        self.num_speculative = kv_cache_spec.num_speculative_blocks
        self.allocated: set[str] = set()
        self._plan: tuple[str, int, int] = ("", 0, 0)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[KVCacheBlock]:
        """The last cached state within `block_hashes`, right to left, after null blocks.
        Complexity: O(len(block_hashes)) lookups on a miss."""
        cached_block = self.cached_block
        for position in range(len(block_hashes) - 1, -1, -1):
            block = cached_block(block_hashes[position])
            if block is not None:
                return [self.null_block] * position + [block]
        return []

    def scan_hit(
        self, num_blocks: int, lookup: Callable[[int], T | None], null: T, for_eagle: bool = False
    ) -> list[T]:
        """`find_longest_cache_hit` over any lookup. Complexity: O(num_blocks) lookups."""
        for position in range(num_blocks - 1, -1, -1):
            found = lookup(position)
            if found is not None:
                return [null] * position + [found]
        return []

    def hit_shape_error(
        self, hits: Sequence[KVCacheBlock], use_eagle: bool, for_eagle: bool
    ) -> str | None:
        """Null blocks, then one cached state. Complexity: O(len(hits))."""
        nulls = self.num_leading_nulls(hits)
        if hits and nulls != len(hits) - 1:
            return mamba_align_hit_detail(nulls, len(hits) - nulls)
        return None

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Columns before the one holding the state the next token reads. Complexity: O(1)."""
        return (num_computed_tokens - 1) // self.block_size

    def skips_a_block(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> bool:
        """Whether a real block lies before the column the next token reads.
        Complexity: O(skipped columns)."""
        null_block = self.null_block
        end = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        return any(block is not null_block for block in blocks[:end])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every real block before the column the next token reads, the newest first,
        walking over the null blocks between them from the request's retired count on; the
        columns before the skipped count are retired. Complexity: O(columns walked)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        retired = self.retired.get(request_id, 0)
        if skipped <= retired:
            return
        null_block = self.null_block
        removed = []
        for position in range(skipped - 1, retired - 1, -1):
            block = blocks[position]
            if block is not null_block:
                removed.append(block)
                blocks[position] = null_block
        if removed:
            self.block_pool.free_blocks_locked(removed)
        self.retired[request_id] = skipped

    def num_required(self, num_slots: int) -> int:
        """Columns a table with `num_slots` token slots needs: its running column's, plus its
        speculative columns. Complexity: O(1)."""
        return -(-num_slots // self.block_size) + self.num_speculative

    def num_slots(self, num_held: int) -> int:
        """Token slots `num_held` columns give (speculative ones give none). Complexity: O(1)."""
        return max(num_held - self.num_speculative, 0) * self.block_size

    def plan_step(self, request_id: str, end: int, num_hits: int) -> None:
        """The step about to be counted and allocated: its tokens end at `end` (drafts in,
        lookahead slots out: vLLM 0.33's `num_tokens_main_model`), after `num_hits` hits.
        Complexity: O(1)."""
        self._plan = (request_id, end, num_hits)

    def planned_new(self) -> int:
        """The columns the planned step's table lacks. Complexity: O(1)."""
        request_id, end, num_hits = self._plan
        return self.num_required(end) - len(self.req_to_blocks.get(request_id, ())) - num_hits

    def num_blocks_to_allocate(self, num_new: int) -> int:
        """Blocks taken when the planned request's table lacks `num_new` columns: one (its new
        running column), plus its speculative columns on its first allocation.
        Complexity: O(1)."""
        if num_new <= 0:
            return 0
        cap = 1 if self._plan[0] in self.allocated else 1 + self.num_speculative
        return min(num_new, cap)

    def allocate_new_blocks(self, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """Grow the planned step's table to its running column R plus k speculative ones
        (`num_blocks`, attention's count, is not this group's): null blocks up to R, then
        (a request allocated before) its speculative blocks before R moved to the end, their
        columns nulled, then blocks from the queue's head. Records the previous state (the
        last running column, or a new request's hit column) and marks the request allocated.
        Returns the table's suffix from its old length (nulls, moved and new blocks).
        Complexity: O(columns added)."""
        blocks = self.req_to_blocks[request_id]
        first = request_id not in self.allocated
        self.allocated.add(request_id)
        _, end, _ = self._plan
        required = self.num_required(end)
        previous = len(blocks)
        if required <= previous:
            return []
        speculative = self.num_speculative
        if blocks:
            self.last_state[request_id] = previous - 1 - (0 if first else speculative)
        running = required - 1 - speculative
        null_block = self.null_block
        if running > previous:
            blocks.extend([null_block] * (running - previous))
        if not first:
            for position in range(max(previous - speculative, 0), min(previous, running)):
                block = blocks[position]
                assert block.ref_cnt == 1 and block.block_hash is None
                blocks.append(block)
                blocks[position] = null_block
        blocks.extend(self.block_pool.get_new_blocks_locked(required - len(blocks)))
        return blocks[previous:]

    def retained(self, request: Request, junction: int, first: int, end: int) -> list[bool]:
        """vLLM 0.33's reachable-block mask for a run of one block: the column ending at each
        replay boundary (`num_prompt_tokens - 1`, aligned down) and at the junction; with a
        positive interval, every segment's last column. Complexity: O(end - first)."""
        block_size = self.block_size
        interval = self.retention_interval
        if interval:
            per_segment = interval // block_size
            mask = [i % per_segment == per_segment - 1 for i in range(first, end)]
        else:
            mask = [False] * (end - first)
        for boundary in (request.num_prompt_tokens - 1, junction):
            column = boundary // block_size - 1
            if boundary > 0 and first <= column < end:
                mask[column - first] = True
        return mask

    def cache_blocks(
        self,
        request: Request,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn,
        junction: int = 0,
    ) -> None:
        """The base class's caching (null columns skipped), recording every key a state is
        cached under in `keyed_this_step`; then the state at the prompt's replay boundary is
        keyed again when the cached length is that boundary and it lost its key, and recorded
        in `keyed_this_step` again while keyed with `remarks_keyed_boundary` (the spec's
        `MambaAlignState.cache_blocks`). Complexity: O(columns cached * block_size)."""
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        first = min(self.num_cached_block.get(request_id, num_cached), len(blocks))
        end = min(num_full, len(blocks))
        super().cache_blocks(request, block_hashes, num_cached, num_full, hash_fn, junction)
        null_block = self.null_block
        group_id = self.group_id
        if end > first:
            mask = self.retained(request, junction, first, end) if self.sparse else None
            for position in range(first, end):
                if blocks[position] is not null_block and (mask is None or mask[position - first]):
                    key = block_hashes[position]
                    self.keyed_this_step.add(GroupKey(group_id, key) if group_id else key)
        position = num_full - 1
        at_boundary = (
            0 < num_full == (request.num_prompt_tokens - 1) // self.block_size
            and position < len(blocks)
            and blocks[position] is not null_block
        )
        if at_boundary and self.remarks_keyed_boundary:
            key = block_hashes[position]
            self.keyed_this_step.add(GroupKey(group_id, key) if group_id else key)
        if at_boundary and blocks[position].block_hash is None:
            self.block_pool.cache_full_blocks_locked(
                request,
                blocks,
                block_hashes,
                position,
                num_full,
                self.block_size,
                hash_fn,
                group_id,
                None,
                True,  # parent_from_stored
            )
            key = block_hashes[position]
            self.keyed_this_step.add(GroupKey(group_id, key) if group_id else key)

    def defers(self, hits: Sequence[KVCacheBlock]) -> bool:
        """Whether the hit's state was keyed in this scheduler step (by its key).
        Complexity: O(1)."""
        if not hits:
            return False
        key = hits[-1].block_hash
        return key is not None and key in self.keyed_this_step

    def new_step_starts(self) -> None:
        """A new scheduler step: the states keyed so far are written. Complexity: O(keys)."""
        self.keyed_this_step.clear()

    def free(self, request_id: str, tail_first: bool) -> None:
        """The base class's free; the request's columns are forgotten.
        Complexity: O(blocks held)."""
        super().free(request_id, tail_first)
        self.retired.pop(request_id, None)
        self.last_state.pop(request_id, None)
        self.allocated.discard(request_id)

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks less every null block. Complexity: O(blocks held)."""
        null_block = self.null_block
        popped = [block for block in super().pop(request_id) if block is not null_block]
        self.retired.pop(request_id, None)
        self.last_state.pop(request_id, None)
        self.allocated.discard(request_id)
        return popped

    def layout_error(self, request_id: str) -> str | None:
        """Why the request's table breaks the layout the spec states (None if it holds).
        Complexity: O(blocks held)."""
        blocks = self.req_to_blocks[request_id]
        if not blocks:
            return None
        null_block = self.null_block
        tail = max(len(blocks) - 1 - self.num_speculative, 0)
        num_cached = self.num_cached_block.get(request_id, 0)
        for position in range(tail, len(blocks)):
            block = blocks[position]
            if block is null_block:
                return f"its running or speculative column {position} holds the null block"
            if block.ref_cnt > 1 and num_cached <= position:
                return f"its block {block.block_id} is shared and not cached at its boundary"
        previous = self.last_state.get(request_id)
        for position in range(tail):
            block = blocks[position]
            if block is null_block:
                continue
            if position != previous:
                return (
                    f"column {position} holds block {block.block_id}, neither a running or "
                    f"speculative column (from {tail}) nor the previous state ({previous})"
                )
            if position < self.retired.get(request_id, 0):
                return f"column {position} holds block {block.block_id} though retired"
        return None
