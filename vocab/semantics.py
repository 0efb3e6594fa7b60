"""Switches between pagedkv's deliberate differences and vLLM's behaviour (0.8.5, 0.33.0).

docs/semantics.md lists where pagedkv differs from vLLM on purpose. Each difference that changes
the outcome of a *valid* call sequence has a switch here, so a conformance run can turn it off.
Misuse (freeing a free block, removing a block that is not queued, ...) raises in both modes:
vLLM leaves it undefined (silent corruption), so there is nothing to conform to.

The default hash (difference 3) is the manager's `caching_hash_algo` argument, and the cache salt
(difference 4) changes nothing for requests without one, which is every vLLM 0.8.5 request. The
salt joins every block's extra keys, not only the first's, so that tenant isolation does not
depend on hash values never colliding (see `pagedkv.spec.block_hash.block_extra_keys`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Semantics:
    """Which side of each deliberate difference to take. Defaults are pagedkv's.

    Attributes:
        null_block_refcounted: vLLM's `touch` and `free_blocks` change the null block's
            ref_cnt like any block's (difference 1; pagedkv keeps it at 0).
        capacity_counts_null_blocks: `allocate_slots` counts null blocks among the evictable
            computed blocks when checking capacity (difference 2).
        vllm_new_block_mm_keys: `cache_full_blocks` computes the multimodal keys of a block it
            hashes itself (one completed by generated tokens) as vLLM 0.8.5 does: from the last
            multimodal input only, which also joins a block starting exactly where it ends
            (difference 6). pagedkv uses every input that truly overlaps the block, exactly as
            `hash_request_tokens` does, so a block's hash never depends on which path made it.
        cap_at_max_model_len: `allocate_slots` past `max_model_len` silently allocates fewer
            blocks instead of raising (difference 7).
        usage_excludes_null_block: `get_usage()` leaves the null block out of both the used
            and the total count, as vLLM releases after 0.8.5 do (0.8.5 counts it as used).
        free_uncached_to_head: `free_blocks` puts a block that reaches ref_cnt 0 without a
            hash at the head of the free queue (reused first, in the caller's order) instead
            of the tail, as vLLM releases after 0.8.5 do; hashed blocks still join the tail.
        free_tail_first_without_caching: the manager's `free` releases a request's blocks
            last first even when prefix caching is off (vLLM after 0.8.5); 0.8.5 and pagedkv
            release them in order then.
        lookup_hashes_every_full_block: `get_computed_blocks` looks up every full block of the
            request, tokens it generated before a preemption included, as vLLM releases after
            0.8.5 do (they hash each block as its tokens arrive); 0.8.5 and pagedkv look up the
            hashes stored for the request, which after a preemption end at its last cached
            block.
        eagle_window_hit_one_short: with `use_eagle`, a sliding-window hit is the usual one
            (ending in the cdiv(W - 1, B) cached blocks the window needs) less its last block,
            as vLLM 0.8.5 finds it: the token at the hit's end then misses one block of its
            window, which holds the null block (a vLLM 0.8.5 bug). pagedkv and vLLM 0.33 find
            the hit of a window one block wider and drop that block.
        mm_keys_without_position: a multimodal input joins a block's extra keys as its content
            hash alone, as vLLM 0.8.5 keys it: two blocks with the same tokens and the same
            input at different places share a key, and one serves the other's KV (a vLLM 0.8.5
            bug). pagedkv keys the input with its place in the block (`MultimodalKey`), as vLLM
            0.33 does.
        deferred_free_flattened: `free_popped_blocks` releases the blocks of a deferred free
            in one call, the last group's last block first, as vLLM 0.33's scheduler drains
            `pop_blocks_for_free` (`free_blocks(reversed(blocks))`, vLLM #48489): the first
            group's cached blocks are then evicted last, where `free` evicts them first.
            pagedkv releases them as `free` would, group by group, each group's last first.
        junction_ignores_eagle: under sparse retention with EAGLE, a request's shared-prefix
            junction keeps only the run of blocks a hit stopping at the junction reads, as
            vLLM 0.32.0 retains them. pagedkv and vLLM 0.33 also keep the run one block lower:
            a sibling that diverges right after the junction has no block past it for EAGLE
            to drop, so its hit lands a block lower, and finds it only if that run is cached.
        mamba_remarks_keyed_boundary: with a Mamba group in mode "align" beside other groups,
            every cache call whose cached length is the prompt's replay boundary records the
            state there as keyed in this step while the request still holds it, even when it
            was keyed before, as vLLM 0.32.0 does (its partial-tail path re-registers the key):
            a sibling's hit on it waits one more scheduler step. pagedkv and vLLM 0.33 record
            only a state keyed now.
        partial_prefix_keys: with groups of several block sizes and caching, a full-attention
            group whose blocks exceed the hash block size H also indexes the block holding the
            prompt's last H boundary (before its last token) under the chain hash there, a
            secondary "partial" key, as vLLM 0.33 does (its `cache_partial_block`): an index
            entry no lookup hits without a Mamba group in mode "align", removed with the
            block's hash. pagedkv indexes each block under its own key only.
    """

    null_block_refcounted: bool = False
    capacity_counts_null_blocks: bool = False
    vllm_new_block_mm_keys: bool = False
    cap_at_max_model_len: bool = False
    usage_excludes_null_block: bool = False
    free_uncached_to_head: bool = False
    free_tail_first_without_caching: bool = False
    lookup_hashes_every_full_block: bool = False
    eagle_window_hit_one_short: bool = False
    mm_keys_without_position: bool = False
    deferred_free_flattened: bool = False
    junction_ignores_eagle: bool = False
    partial_prefix_keys: bool = False
    mamba_remarks_keyed_boundary: bool = False

    @property
    def name(self) -> str:
        for name, semantics in SEMANTICS_BY_NAME.items():
            if self == semantics:
                return name
        return repr(self)


PAGEDKV = Semantics()
VLLM_0_8_5 = Semantics(
    null_block_refcounted=True,
    capacity_counts_null_blocks=True,
    vllm_new_block_mm_keys=True,
    cap_at_max_model_len=True,
    eagle_window_hit_one_short=True,
    mm_keys_without_position=True,
)
VLLM_0_33 = Semantics(
    usage_excludes_null_block=True,
    free_uncached_to_head=True,
    free_tail_first_without_caching=True,
    lookup_hashes_every_full_block=True,
    deferred_free_flattened=True,
    partial_prefix_keys=True,
)
"""vLLM 0.33.0's block pool: pagedkv's null-block and capacity rules, and the two switches above.
Its manager differs further; docs/semantics.md lists how `--against` accounts for that."""
VLLM_0_32 = dataclasses.replace(
    VLLM_0_33,
    null_block_refcounted=True,
    junction_ignores_eagle=True,
    mamba_remarks_keyed_boundary=True,
)
"""vLLM 0.32.0: 0.33.0's rules, except that `touch` and `free_blocks` count the null block's
ref_cnt like any block's (0.33.0 passes it over), and that with EAGLE a shared-prefix junction
keeps no run a block below it; docs/semantics.md, "vLLM 0.32.0"."""
SEVERAL_BLOCK_SIZES_SEMANTICS = (PAGEDKV, VLLM_0_33, VLLM_0_32)
"""The semantics under which the managers serve groups of several block sizes with caching
(the behaviour checked against vLLM 0.33.0 and 0.32.0); any other is refused by name."""
SEMANTICS_BY_NAME: dict[str, Semantics] = {
    "pagedkv": PAGEDKV,
    "vllm-0.8.5": VLLM_0_8_5,
    "vllm-0.32": VLLM_0_32,
    "vllm-0.33": VLLM_0_33,
}
