"""Mamba states (vLLM 0.33's `MambaManager`). `MambaState` is mode "none", without prefix
caching; `MambaAlignState` is mode "align", with it (its docstring). Mode "none", stated
plainly: a request's recurrent state lives in one block of `max_model_len` tokens,
updated in place token by token, with `num_speculative_blocks` more blocks for the states of
draft tokens; nothing is cached, so nothing is ever hit.

The token at position p reads one thing, the state the token before it left: position p - 1
(`first_read`), so the attention-truth invariant demands that the request's own state is there.
Positions wholly before p - 1 are no longer read (`num_skipped`); with a block of
`max_model_len` tokens there are none, but the rule is the attention type's, not the size's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedkv.spec import retention
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.single_type.base import Lookup, SpecSingleTypeManager
from pagedkv.vocab.hashes import BlockHashType, CacheKey, HashFn, cache_key
from pagedkv.vocab.kv_cache_interface import MambaSpec
from pagedkv.vocab.refusals import MAMBA_HIT_DETAIL, mamba_align_hit_detail
from pagedkv.vocab.request import Request


class MambaState(SpecSingleTypeManager):
    """A recurrent state per request, in block 0, plus its speculative states' blocks."""

    kind = "Mamba state"
    allows_null_blocks = True  # a block wholly before the last computed token is not read

    def __init__(self, spec: MambaSpec, pool: SpecBlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.extra_blocks = spec.num_speculative_blocks

    def first_read(self, position: int) -> int:
        """The token at `position` reads the state after the token before it."""
        return max(position - 1, 0)

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        """No hit: states are not cached in this mode (the registry refuses caching)."""
        return []

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """Every hit: no lookup finds one."""
        return MAMBA_HIT_DETAIL

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the last computed token."""
        return max(num_computed_tokens - 1, 0) // self.block_size


class MambaAlignState(SpecSingleTypeManager):
    """Mamba states with prefix caching (vLLM 0.33's `MambaManager`, `mamba_cache_mode`
    "align", its engine defaults: no speculative or checkpoint blocks, no EAGLE), stated
    plainly.

    **A block is a state.** A request's table is positional: column c stands for the state
    after (c + 1) * B tokens, and a step that computes tokens up to e writes the state after e
    into column `R = cdiv(e, B) - 1`, its *running column*, having read the state it starts
    from (after s tokens) in column `(s - 1) // B`. So a request holds at most two real
    blocks: the running one and the one its last step started from (the *previous state*);
    every other column is the null block, wherever it is. A column is keyed (cached) at
    (c + 1) * B when the request's computed tokens reach that boundary, which is a true key
    only if a step ended there: the manager refuses a step that starts inside a block and ends
    past it (`mamba_unaligned_chunk`).

    **Hits** run right to left: the last column whose key is cached, after null blocks for the
    columns before it; the state it holds is all a later request reads.

    **Freeing.** The next token at n reads only column `(n - 1) // B`: every non-null column
    before it is freed (the newest first), walking over the nulls in between
    (`drop_skipped_blocks`).

    **Growing.** A step that needs the table longer pads it with null blocks and takes one
    block, the new running column, from the free queue's head (`take_new_blocks`): a step
    needs at most one new block (`num_missing`).

    **Deferral.** A state keyed during a scheduler step is written only when the step's
    forward pass runs, so a hit whose state was keyed since the last `new_step_starts` is
    refused for this step (`defers`, vLLM's rule: by the key, not the block).

    **Retention.** `pagedkv.spec.retention` with a run of one block: under an interval of 0
    only the states at the prompt's replay boundary and at the shared-prefix junction are
    keyed, under an interval R also every R-token segment's last block; None keys every state
    a step ended on a boundary at. The state at the prompt's replay boundary is keyed again
    when a cache call reaches exactly that boundary and it lost its key (`cache_blocks`).

    Attributes:
        keyed_this_step: the keys (hash and group) this group cached since the last
            `new_step_starts`.
        retired: request id -> the columns before it are freed and null.
        last_state: request id -> the column its last growing step started from (the hit
            column, or the previous running column); absent before any.
    """

    kind = "Mamba state"
    allows_null_blocks = True  # every column but the running and the previous state
    supports_eagle = False  # refused for mode "align" before the registry is asked
    holds_state = True

    def __init__(self, spec: MambaSpec, pool: SpecBlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.extra_blocks = spec.num_speculative_blocks
        self.keyed_this_step: set[CacheKey] = set()
        self.retired: dict[str, int] = {}
        self.last_state: dict[str, int] = {}
        self.allocated: set[str] = set()

    def first_read(self, position: int) -> int:
        """The token at `position` reads the state after the token before it."""
        return max(position - 1, 0)

    def longest_hit(
        self, lookup: Lookup, block_hashes: Sequence[BlockHashType], for_eagle: bool = False
    ) -> list[int]:
        """The last position whose state is cached, right to left, after null blocks; none if
        no state within `block_hashes` is."""
        for position in range(len(block_hashes) - 1, -1, -1):
            found = lookup(block_hashes[position])
            if found is not None:
                return [NULL_BLOCK_ID] * position + [found]
        return []

    def hit_shape_error(self, hits: Sequence[int], use_eagle: bool, for_eagle: bool) -> str | None:
        """A hit is null blocks, then one cached state."""
        nulls = list(itertools.takewhile(lambda block_id: block_id == NULL_BLOCK_ID, hits))
        if hits and len(nulls) != len(hits) - 1:
            return mamba_align_hit_detail(len(nulls), len(hits) - len(nulls))
        return None

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Columns before the one holding the state the token at `num_computed_tokens`
        reads."""
        return max(num_computed_tokens - 1, 0) // self.block_size

    def drop_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """As every type's (every non-null skipped column freed, the newest first), and the
        columns before the skipped count are retired."""
        super().drop_skipped_blocks(request_id, num_computed_tokens)
        if request_id in self.blocks:
            skipped = min(self.num_skipped(num_computed_tokens), len(self.blocks[request_id]))
            self.retired[request_id] = max(self.retired.get(request_id, 0), skipped)

    def num_missing(self, num_required: int, num_held: int, num_hits: int) -> int:
        """The blocks the table lacks, at most one (its new running column; the columns before
        it are null or relocated speculative blocks), plus k on the request's first allocation
        (its k speculative columns)."""
        return min(max(num_required - num_held - num_hits, 0), 1 + self.extra_blocks)

    def num_missing_for(self, request_id: str, num_required: int, num_hits: int) -> int:
        """`num_missing` for this request: a request that had an allocation takes one block
        at most (its speculative blocks move instead, `take_new_blocks`)."""
        missing = self.num_missing(num_required, len(self.blocks.get(request_id, [])), num_hits)
        return min(missing, 1) if request_id in self.allocated else missing

    def take_new_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        """The table grows by `num_blocks` columns to `R + 1 + k` (R its new running column):
        null blocks up to R; then (a request that had an allocation) each speculative block of
        the last growth that lies before R moves to the end, its column nulled (a block
        written by this request alone, unkeyed); then blocks from the free queue's head for
        the columns still missing. The step's previous state is recorded: the running column
        of the last growth, or a new request's hit column. Returns the columns added, in
        order (the table's suffix from its old length: null, moved and new blocks), which is
        what the allocation returns for this group. The request counts as allocated."""
        held = self.blocks[request_id]
        first = request_id not in self.allocated
        self.allocated.add(request_id)
        if num_blocks <= 0:
            return []
        k = self.extra_blocks
        previous = len(held)
        if held:
            self.last_state[request_id] = previous - 1 - (0 if first else k)
        running = previous + num_blocks - 1 - k
        held.extend([NULL_BLOCK_ID] * max(running - previous, 0))
        if not first:
            for position in range(max(previous - k, 0), min(previous, running)):
                block_id = held[position]
                assert self.pool.ref_cnt[block_id] == 1 and self.pool.block_hash[block_id] is None
                held.append(block_id)
                held[position] = NULL_BLOCK_ID
        held.extend(self.pool.get_new_blocks_unchecked(previous + num_blocks - len(held)))
        return held[previous:]

    def retained(self, request: Request, junction: int, positions: range) -> list[bool] | None:
        """`pagedkv.spec.retention`'s rule for a run of one block, without EAGLE."""
        if self.retention_interval is None:
            return None
        return retention.retained(
            positions,
            interval=self.retention_interval,
            boundaries=retention.reachable_boundaries(
                request.num_prompt_tokens, junction, self.block_size, False
            ),
            need=1,
            block_size=self.block_size,
            use_eagle=False,
        )

    def replay_tail(self, request: Request) -> set[int]:
        if self.retention_interval is None:
            return set()
        boundaries = retention.replay_boundaries(request.num_prompt_tokens, self.block_size, False)
        return {
            position
            for boundary in boundaries
            for position in retention.boundary_tail(boundary, 1, self.block_size, False)
        }

    def cache_blocks(
        self,
        request: Request,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn,
        junction: int = 0,
    ) -> list[int]:
        """As every type caches (null columns are skipped), and every key a state is cached
        under is recorded in `keyed_this_step`. Then, when the cached length `num_full * B` is
        the prompt's replay boundary (`P - 1` aligned down), the state there is keyed again if
        it lost its key (`evict_blocks`): vLLM 0.33 re-keys the prompt's last boundary state on
        every cache call (its partial-tail path, a no-op unless the key was taken). With
        `remarks_keyed_boundary` (vLLM 0.32.0) a state still keyed there is recorded in
        `keyed_this_step` again."""
        held = self.blocks[request.request_id]
        first = min(self.num_cached.get(request.request_id, num_cached), len(held))
        end = min(num_full, len(held))
        kept = self.retained(request, junction, range(first, end))
        left_out = super().cache_blocks(
            request, block_hashes, num_cached, num_full, hash_fn, junction
        )
        for index, position in enumerate(range(first, end)):
            if held[position] != NULL_BLOCK_ID and (kept is None or kept[index]):
                self.keyed_this_step.add(cache_key(block_hashes[position], self.group_id))
        boundary = (request.num_prompt_tokens - 1) // self.block_size
        position = num_full - 1
        at_boundary = 0 < num_full == boundary and position < len(held)
        if at_boundary and held[position] != NULL_BLOCK_ID and self.remarks_keyed_boundary:
            self.keyed_this_step.add(cache_key(block_hashes[position], self.group_id))
        if (
            at_boundary
            and held[position] != NULL_BLOCK_ID
            and self.pool.block_hash[held[position]] is None
        ):
            self.pool.cache_full_blocks_unchecked(
                request,
                held,
                block_hashes,
                position,
                num_full,
                self.block_size,
                hash_fn,
                self.group_id,
                parent_from_stored=True,
            )
            self.keyed_this_step.add(cache_key(block_hashes[position], self.group_id))
        return left_out

    def defers(self, hits: Sequence[int]) -> bool:
        """Whether a hit ends on a state keyed during this scheduler step (by its key)."""
        if not hits:
            return False
        key = self.pool.block_hash[hits[-1]]
        return key is not None and key in self.keyed_this_step

    def new_step_starts(self) -> None:
        """A new scheduler step: the states keyed so far are written."""
        self.keyed_this_step.clear()

    def forget_request(self, request_id: str) -> None:
        self.retired.pop(request_id, None)
        self.last_state.pop(request_id, None)
        self.allocated.discard(request_id)

    def free(self, request_id: str, tail_first: bool) -> None:
        super().free(request_id, tail_first)
        self.forget_request(request_id)

    def pop(self, request_id: str) -> list[int]:
        """The request's blocks less every null block (nulls lie between its states too)."""
        popped = [block_id for block_id in super().pop(request_id) if block_id != NULL_BLOCK_ID]
        self.forget_request(request_id)
        return popped

    def layout_error(self, request_id: str) -> str | None:
        """Why the request's table breaks the layout (module docstring; None if it holds):
        its last 1 + k columns (running and speculative) are real blocks, each shared only
        once cached at its boundary; every other real block is its previous state; nothing
        before `retired` is real."""
        held = self.blocks[request_id]
        if not held:
            return None
        tail = max(len(held) - 1 - self.extra_blocks, 0)
        num_cached = self.num_cached.get(request_id, 0)
        for position in range(tail, len(held)):
            block_id = held[position]
            if block_id == NULL_BLOCK_ID:
                return f"its running or speculative column {position} holds the null block"
            if self.pool.ref_cnt[block_id] > 1 and num_cached <= position:
                return f"its block {block_id} is shared and not cached at its boundary"
        previous = self.last_state.get(request_id)
        for position, block_id in enumerate(held[:tail]):
            if block_id == NULL_BLOCK_ID:
                continue
            if position != previous:
                return (
                    f"column {position} holds block {block_id}, neither a running or "
                    f"speculative column (from {tail}) nor the previous state ({previous})"
                )
            if position < self.retired.get(request_id, 0):
                return f"column {position} holds block {block_id} though retired"
        return None


def mamba_chunk(
    start: int,
    wanted: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    junction: int = 0,
) -> int:
    """The tokens a step from `start` computes when the scheduler's budget allows `wanted`, as
    vLLM 0.33's scheduler cuts a prefill chunk for a Mamba group in mode "align"
    (`_mamba_block_aligned_split`, default flags: no EAGLE, no sub-block tail, no checkpoint
    blocks); for a harness or a test to play the scheduler's part. During prefill (`start` below
    `max(num_prompt_tokens, num_tokens - 1)`): a chunk starting inside a block stops at its end;
    none runs past the last block boundary before the last token (`(num_tokens - 1) // B * B`,
    so that the prompt's replay state is a step's end) nor past the shared-prefix `junction`;
    a chunk that is not the last is cut down to a block boundary unless that leaves nothing (a
    budget smaller than a block advances inside it). Never past `num_tokens`; outside
    prefill, `wanted` up to there."""
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return max(min(wanted, num_tokens - start), 0)
    end = min(start + wanted, num_tokens)
    if start % block_size:
        end = min(end, -(-start // block_size) * block_size)
    last_cache_position = (num_tokens - 1) // block_size * block_size
    if start < last_cache_position:
        end = min(end, last_cache_position)
    if start < junction:
        end = min(end, junction)
    if end < prefill_end and end // block_size * block_size > start:
        end = end // block_size * block_size
    return end - start
