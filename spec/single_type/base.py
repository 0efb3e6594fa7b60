"""The reference per-type manager: one KV cache group's blocks, in ids, for one attention type.

A subclass (one module per attention type) states plainly what its attention reads: which
earlier position a token reads first (`first_read`, what the attention-truth invariant holds
every decision to), which cached blocks a lookup may hit (`longest_hit`, by brute force over
candidate lengths), which hits it could have produced (`hit_shape_error`) and how many leading
positions the next token no longer reads (`num_skipped`). This base class keeps, for every type
alike, each request's block-id list and how many of its positions are cached, and makes the
changes the spec manager asks for once a call's preconditions hold: hits added, blocks taken,
full blocks cached, skipped blocks dropped, blocks freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.spec.block_counts import ceil_div
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.vocab.hashes import BlockHashType, CacheKey, HashFn, cache_key
from pagedkv.vocab.kv_cache_interface import KVCacheSpec
from pagedkv.vocab.request import Request

Lookup = Callable[[BlockHashType], "int | None"]
"""The first block cached under a hash, or None (the pool's get_cached_block, for one group)."""


class SpecSingleTypeManager:
    """Reference model of `pagedkv.single_type.SingleTypeKVCacheManager`.

    Attributes:
        kind: the attention type, in words.
        allows_null_blocks: whether positions it no longer reads hold the null block (a prefix
            of a request's list, and of a hit).
        supports_eagle: whether EAGLE's last-block drop is defined for this attention type.
        prefix_closed: whether its group's index is prefix-closed (a request frees its blocks
            tail first and never drops one early: full attention).
        spec: the group's KV cache spec.
        block_size: its block size.
        extra_blocks: blocks a request holds beyond those its token slots fill (Mamba's
            speculative states; 0 for attention).
        group_id: the KV cache group.
        use_eagle: hits drop their last block (set by the registry).
        retention_interval: the config's `prefix_cache_retention_interval` (set by the
            registry; only a sliding window acts on it, `pagedkv.spec.retention`).
        junction_ignores_eagle: the semantics' switch of that name (set by the manager; only a
            sliding window under sparse retention with EAGLE acts on it).
        remarks_keyed_boundary: the semantics' `mamba_remarks_keyed_boundary`, with several
            groups (set by the manager; only a Mamba group in mode "align" acts on it).
        blocks: request id -> its block ids, in position order (null block 0 = skipped).
        num_cached: request id -> how many of its positions are cached.
        left_out: ghost state: block id -> the key retention kept it from being cached under,
            until the block is handed out again.
        at_replay_boundary: ghost state: the blocks cached as the tail of a request's replay
            boundary, until handed out again (for a campaign's coverage).
    """

    kind = ""
    allows_null_blocks = False
    supports_eagle = True
    prefix_closed = False
    holds_state = False
    """Whether a block holds one recurrent state rather than one slot per token (Mamba in
    mode "align"): the attention-truth ghost writes a step's state at its last token."""

    def __init__(self, spec: KVCacheSpec, pool: SpecBlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.extra_blocks = 0
        self.pool = pool
        self.group_id = group_id
        self.use_eagle = False
        self.retention_interval: int | None = None
        self.junction_ignores_eagle = False  # set by the manager from its semantics
        self.remarks_keyed_boundary = False  # likewise (mamba_remarks_keyed_boundary)
        self.blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.left_out: dict[int, CacheKey] = {}
        self.at_replay_boundary: set[int] = set()

    # -- what the attention type reads (its subclass) ----------------------------------------

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to."""
        raise NotImplementedError

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        """The longest hit within `block_hashes` (a prefix of the request's), skipped positions
        as the null block; `for_eagle`: the hit that, less its last block, is an EAGLE hit."""
        raise NotImplementedError

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """Why `hits` (no null block out of place) cannot be a hit found with `for_eagle`, then
        less its last block with `use_eagle`; None if they can."""
        return None

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Leading positions the token at `num_computed_tokens` no longer reads."""
        return 0

    def retained(self, request: Request, junction: int, positions: range) -> list[bool] | None:
        """Which of `positions` a cache call puts in the prefix cache (`junction`: the
        request's shared-prefix junction, in tokens); None: every one (dense)."""
        return None

    def replay_tail(self, request: Request) -> set[int]:
        """The positions sparse retention keeps for the request's replay boundaries (none when
        it keeps every block)."""
        return set()

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """The most blocks the full-sequence gate reserves for one request in this group
        (vLLM 0.33's `max_admission_blocks_per_request`); None: every block its tokens need.
        Attention that frees blocks as a request advances holds only the blocks its reads and
        the tokens in flight (`max_in_flight_tokens`) span."""
        return None

    # -- how many blocks a request holds (every type alike) ----------------------------------

    def num_required(self, num_slots: int) -> int:
        """Blocks a request with `num_slots` token slots holds: the blocks those slots fill,
        plus `extra_blocks`."""
        return ceil_div(num_slots, self.block_size) + self.extra_blocks

    def num_slots(self, num_held: int) -> int:
        """Token slots `num_held` blocks give (`extra_blocks` of them give none)."""
        return max(num_held - self.extra_blocks, 0) * self.block_size

    def slot_range(self, num_held: int) -> range:
        """The token slot counts `n` for which `num_required(n) == num_held` (maybe none)."""
        blocks = num_held - self.extra_blocks
        if blocks <= 0:
            return range(1 if blocks == 0 else 0)
        return range((blocks - 1) * self.block_size + 1, blocks * self.block_size + 1)

    def num_missing(self, num_required: int, num_held: int, num_hits: int) -> int:
        """Blocks the request takes from the free queue to hold `num_required`, holding
        `num_held` and adopting `num_hits` (<= 0: none): every missing one."""
        return num_required - num_held - num_hits

    def num_missing_for(self, request_id: str, num_required: int, num_hits: int) -> int:
        """`num_missing` for the request's blocks held now."""
        return self.num_missing(num_required, len(self.blocks.get(request_id, [])), num_hits)

    def defers(self, hits: Sequence[int]) -> bool:
        """Whether these hits must wait for the next scheduler step (a Mamba state keyed in
        this one); never for attention."""
        return False

    def new_step_starts(self) -> None:
        """A new scheduler step starts (only a Mamba group in mode "align" keeps per-step
        state)."""

    def layout_error(self, request_id: str) -> str | None:
        """Why the request's block list breaks this type's layout (None: it holds); the
        manager states the null-prefix rule of the types whose nulls are a prefix."""
        return None

    # -- the request's blocks (every type alike) ---------------------------------------------

    def drop_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The positions the next token no longer reads hold the null block afterwards; the
        blocks they held are freed, the newest first."""
        held = self.blocks.get(request_id)
        if held is None:
            return
        skipped = min(self.num_skipped(num_computed_tokens), len(held))
        dropped = [block_id for block_id in held[:skipped] if block_id != NULL_BLOCK_ID]
        self.pool.free_blocks_unchecked(dropped[::-1])
        held[:skipped] = [NULL_BLOCK_ID] * skipped

    def add_hits(self, request_id: str, hits: Sequence[int]) -> None:
        """The request holds its blocks, then the hits (touched already)."""
        self.blocks[request_id] = self.blocks.get(request_id, []) + list(hits)

    def take_new_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        """`num_blocks` blocks from the head of the free queue, appended to the request's."""
        taken = self.pool.get_new_blocks_unchecked(num_blocks)
        self.blocks[request_id].extend(taken)
        return taken

    def cache_blocks(
        self,
        request: Request,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn,
        junction: int = 0,
    ) -> list[int]:
        """The request's positions [cached, num_full) that it holds and `retained` keeps are
        cached under the stored hashes (extended by the pool), and max(cached, num_full)
        positions count as cached; `cached` is the group's own count, `num_cached` (the hits)
        until it has one (a group's count may exceed another's: external tokens that push hits
        out of a window count the null positions as cached, as vLLM 0.33 does). Returns the
        blocks retention left out (recorded in `left_out`)."""
        held = self.blocks[request.request_id]
        num_cached = self.num_cached.get(request.request_id, num_cached)
        first = min(num_cached, len(held))
        end = max(min(num_full, len(held)), first)  # nothing when cached past num_full
        kept = self.retained(request, junction, range(first, end))
        self.pool.cache_full_blocks_unchecked(
            request,
            held,
            block_hashes,
            first,
            end,
            self.block_size,
            hash_fn,
            self.group_id,
            retained=kept,
            parent_from_stored=True,
        )
        self.num_cached[request.request_id] = max(num_cached, num_full)
        if kept is None:
            return []
        left_out = []
        replay_tail = self.replay_tail(request)
        for position, keep in zip(range(first, end), kept, strict=True):
            if held[position] == NULL_BLOCK_ID:
                continue
            if not keep:
                left_out.append(held[position])
                self.left_out[held[position]] = cache_key(block_hashes[position], self.group_id)
            elif position in replay_tail:
                self.at_replay_boundary.add(held[position])
        return left_out

    def handed_out(self, block_ids: Sequence[int]) -> None:
        """Blocks taken from the free queue: retention no longer keeps them from anything."""
        for block_id in block_ids:
            self.left_out.pop(block_id, None)
            self.at_replay_boundary.discard(block_id)

    def free(self, request_id: str, tail_first: bool) -> None:
        """The request's blocks are freed, last first or in order; it holds none after."""
        held = self.blocks.pop(request_id, [])
        self.pool.free_blocks_unchecked(held[::-1] if tail_first else held)
        self.num_cached.pop(request_id, None)

    def pop(self, request_id: str) -> list[int]:
        """The request's blocks less its leading null blocks, handed to a deferred free: it
        holds none after, and the blocks keep their references until the caller frees them."""
        held = self.blocks.pop(request_id, [])
        self.num_cached.pop(request_id, None)
        nulls = 0
        while nulls < len(held) and held[nulls] == NULL_BLOCK_ID:
            nulls += 1
        return held[nulls:]

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of the request with ref_cnt == num_running_requests."""
        held = self.blocks.get(request_id, [])
        shared = [self.pool.ref_cnt[block_id] == num_running_requests for block_id in held]
        return shared.index(False) if False in shared else len(shared)
