"""Why each mutant argued equivalent survives: it behaves exactly like the original, so no test
can kill it. `proofs/mutation.py` writes each argument beside its survivor in the score file, and
`tests/test_mutation_score.py` checks that every argument names a listed survivor.

An argument is a claim about the code, made once and checked by reading it: each says which
value or path the mutant changes and why nothing observable follows (a check made earlier
already refused the case, a fast path declining hands over to a full path with the same result,
a value read only in a truth test, ...). Keyed by mutmut's mutant name, which is stable while
the mutated sources are (`sources_sha256` in the score file); a change to a mutated module
invalidates the names, and the next full run lists the survivors afresh.
"""

from __future__ import annotations

_DEFAULT_UNREACHABLE = (
    "the default is never used: with caching on, allocate_slots records num_cached_block and "
    "req_to_block_hashes for every request it gives blocks (nothing can fail in between), free "
    "drops them with the blocks, and free_block_hashes refuses while blocks are held"
)

_M = "pagedkv.manager.xǁKVCacheManagerǁ"
_H = "pagedkv.hybrid_manager.xǁHybridKVCacheManagerǁ"

_TYPES_ALREADY_CHECKED = (
    "`and` -> `or` in an assert: the argument checks before it (check_manager, "
    "check_hybrid_manager, check_allocation, check_hybrid_allocation) already refused any "
    "non-int, non-bool or non-Request value with a typed error, so both forms hold"
)
_RECOMPUTE_MORE_OFTEN = (
    "the mutant only runs the rehash in more cases: where the original skips it, "
    "len(block_hashes) * B > num_tokens - B, so the stored hashes cover every full block, "
    "chain[len(block_hashes):] is empty and extending by it changes nothing"
)
_EQUAL_COPY = (
    "slicing [:length] when length == len(block_hashes) passes an equal copy; "
    "find_longest_cache_hit only reads it and keeps no reference"
)
_FALSY = "`settled = None` is falsy like False and is read only by `while not settled`"
_EXTRA_ASK = (
    "the mutant only asks a group again: scan_window_hit and scan_chunk_hit asked at a group's "
    "own last answer L return the same blocks of length L, so no extra ask shortens the hit"
)
_NOTHING_TO_FIT = (
    "the mutant runs fits() or _num_evictable_hits where the original skips them: "
    "_num_evictable_hits of no hits is 0, and fits(0, free, evictable) holds since "
    "evictable <= free (every ref_cnt-0 hit is in the free queue)"
)
_NO_BLOCKS_TAKEN = (
    "get_new_blocks_locked(n) with n <= 0 returns [] and changes nothing (range(n) is empty, "
    "no count check fails)"
)
_EMPTY_CACHING = (
    "`>=` adds a cache_full_blocks_locked call with start == end, which hashes nothing, "
    "announces no event and extends by []; its parent check passes (the last cached position "
    "is a held block that keeps its hash, or the null block with a stored hash)"
)
_FAST_PATH_DECLINES_MORE = (
    "the mutant only makes the decode fast path decline in more cases, and the full path then "
    "makes the same changes and returns the same blocks (req_to_blocks never holds an empty "
    "list, so _skips_a_block's blocks[first_useful - 1] is always readable)"
)
_STRICT_ZIP = "zip's strictness cannot matter: len(held) != num_groups already raised"

MANAGER_EQUIVALENTS: dict[str, str] = {
    f"{_H}__init____mutmut_24": _TYPES_ALREADY_CHECKED,
    f"{_H}__init____mutmut_25": _TYPES_ALREADY_CHECKED,
    f"{_M}__init____mutmut_23": _TYPES_ALREADY_CHECKED,
    f"{_M}__init____mutmut_24": _TYPES_ALREADY_CHECKED,
    f"{_M}_allocate_slots__mutmut_12": _TYPES_ALREADY_CHECKED,
    f"{_H}_allocate_slots__mutmut_14": _TYPES_ALREADY_CHECKED,
    f"{_M}_get_computed_blocks__mutmut_21": _RECOMPUTE_MORE_OFTEN,
    f"{_M}_get_computed_blocks__mutmut_23": _RECOMPUTE_MORE_OFTEN,
    f"{_H}_get_computed_blocks__mutmut_21": _RECOMPUTE_MORE_OFTEN,
    f"{_H}_get_computed_blocks__mutmut_23": _RECOMPUTE_MORE_OFTEN,
    f"{_H}_longest_common_hit__mutmut_6": _EQUAL_COPY,
    f"{_H}_longest_common_hit__mutmut_23": _EQUAL_COPY,
    f"{_H}_longest_common_hit__mutmut_13": (
        "answered[] is compared with length, which is >= 0: an initial -2 never matches, as "
        "-1 never does"
    ),
    f"{_H}_longest_common_hit__mutmut_14": _FALSY,
    f"{_H}_longest_common_hit__mutmut_30": _FALSY,
    f"{_H}_longest_common_hit__mutmut_20": (
        "`break` for `continue`: in a pass, the groups skipped (last answer == length) are the "
        "tail after the group that last shortened the hit, and all of them allow that length; "
        "no group is skipped after a shortening in the same pass, so break leaves out only "
        "groups continue skips too, with settled still True"
    ),
    f"{_H}_longest_common_hit__mutmut_27": _EXTRA_ASK,
    f"{_H}_longest_common_hit__mutmut_28": _EXTRA_ASK,
    f"{_H}_allocate_slots__mutmut_134": _NOTHING_TO_FIT,
    f"{_H}_fits__mutmut_3": _NOTHING_TO_FIT,
    f"{_M}_allocate_slots__mutmut_131": _NOTHING_TO_FIT,
    f"{_H}_allocate_slots__mutmut_180": _NO_BLOCKS_TAKEN,
    f"{_H}_allocate_slots__mutmut_182": _NO_BLOCKS_TAKEN,
    f"{_M}_allocate_slots__mutmut_149": _NO_BLOCKS_TAKEN + "; here min(0, free, room) is 0",
    f"{_H}_allocate_slots__mutmut_154": (
        "max(num_new, 1) differs only when num_new <= 0; then num_full <= num_required <= "
        "held + hits and num_cached <= num_full, so both min(., num_blocks) are unchanged"
    ),
    f"{_H}_allocate_slots__mutmut_174": _EMPTY_CACHING,
    f"{_M}_allocate_slots__mutmut_172": _EMPTY_CACHING,
    f"{_M}_allocate_slots__mutmut_156": (
        "dropping the free count from min(): as for allocate_slots__mutmut_55, fits() "
        "guaranteed num_new <= free - evictable hits"
    ),
    f"{_M}__init____mutmut_62": (
        "_sliding_window is read only in truth tests (None and 0 alike), and passed to "
        "first_useful_block only when it is true"
    ),
    f"{_M}allocate_slots__mutmut_15": (
        "with record None the fast path's condition (record is not None and ...) is False "
        "whatever the lookup under 'XXXX' returns, and the lookup has no side effect"
    ),
    f"{_M}allocate_slots__mutmut_58": _FAST_PATH_DECLINES_MORE,
    f"{_M}allocate_slots__mutmut_59": _FAST_PATH_DECLINES_MORE,
    f"{_M}allocate_slots__mutmut_104": _FAST_PATH_DECLINES_MORE,
    f"{_M}_skips_a_block__mutmut_9": _FAST_PATH_DECLINES_MORE,
    f"{_M}_forget_if_done__mutmut_12": (
        "pop without a default never raises: _track adds a plain Request's record together "
        "with the request, _forget_if_done removes both together, and a Request hashes by "
        "identity with an immutable request_id"
    ),
    f"{_H}_check_invariants__mutmut_2": (
        "with null_block None, holders also counts block 0, but the check loops over "
        "pool.blocks[1:] and never reads holders[0]"
    ),
    f"{_H}_check_request__mutmut_15": _STRICT_ZIP,
    f"{_H}_check_request__mutmut_18": _STRICT_ZIP,
    f"{_H}_check_request__mutmut_19": _STRICT_ZIP,
    f"{_H}_check_request__mutmut_60": (
        "for an int k, k > min(n // B, s) exactly when k > min(n / B, s) (k > floor(x) iff k > x)"
    ),
}
"""The request-level managers' (`manager.py`, `hybrid_manager.py`): tests/test_manager_edges.py
killed the rest of their survivors but two timeouts."""

_P = "pagedkv.block_pool.xǁBlockPoolǁ"
_R = "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_"

_POOL_TYPES_CHECKED = (
    "`and` -> `or` in an assert: check_pool / check_cache_full_blocks already refused every "
    "other type with a typed error, so both operands are true"
)
_REF_CNT_WAS_0 = (
    "a block taken from the free queue has ref_cnt 0 (the pool queues a block only when its "
    "count reaches 0), so `= 1` and `+= 1` give the same count"
)
_CARRIED_INDEX_0 = (
    "the mutant recomputes the first multimodal input also when the carried index is 0: "
    "first_mm_input(positions, start) is the first input ending after start, and the scan from "
    "index 0 passes over every input ending at or before start, so both reach the same index"
)
_NULL_OR_FOREIGN_0 = (
    "block id 0 owned by the pool is the null block, declined anyway; a foreign block 0 fails "
    "the ownership test: False either way"
)
_CAST = "typing.cast returns its second argument unchanged at run time, whatever the first"
_GROUP_0_LOOKUP = (
    "with group 0, self.cached_block(h) is block_pool.cached_block(h): the same lookup"
)
_FAST_APPEND_NARROWED = (
    "the mutant only narrows the fast path: what it turns away goes to _append_checked, which "
    "appends the same ints (require_int and int() return an exact int unchanged, "
    "require_token_ids gives tuple(items) for in-range ints) and refuses what the original "
    "refuses there"
)

POOL_EQUIVALENTS: dict[str, str] = {
    f"{_P}__init____mutmut_10": _POOL_TYPES_CHECKED,
    f"{_P}cache_full_blocks__mutmut_28": _POOL_TYPES_CHECKED,
    f"{_P}cache_full_blocks__mutmut_29": _POOL_TYPES_CHECKED,
    f"{_P}get_new_blocks_locked__mutmut_13": _REF_CNT_WAS_0,
    f"{_P}append_new_block_locked__mutmut_15": _REF_CNT_WAS_0,
    f"{_P}cache_full_blocks_locked__mutmut_23": (
        "mm_idx is read only by `elif mm_idx < 0` before its first assignment, true for -1 and "
        "-2 alike; the vLLM branch overwrites it"
    ),
    f"{_P}cache_full_blocks_locked__mutmut_55": _CARRIED_INDEX_0,
    f"{_P}cache_full_blocks_locked__mutmut_56": _CARRIED_INDEX_0,
    f"{_P}cache_full_blocks_locked__mutmut_85": (
        "require_int returns an exact int unchanged and raises on anything else, so calling it "
        "on every value changes nothing"
    ),
    f"{_P}cache_next_full_block_locked__mutmut_19": _NULL_OR_FOREIGN_0,
    f"{_P}cache_next_full_block_locked__mutmut_20": _NULL_OR_FOREIGN_0,
    f"{_P}cache_next_full_block_locked__mutmut_28": (
        "parent_hash_value is used only as `parent or NONE_HASH` in chain_block_hashes; '' and "
        "None are both falsy"
    ),
    f"{_P}intern_hashes_locked__mutmut_2": (
        "a stored hash equals its block's key (hits are lookups under those hashes): "
        "check_hits_locked's identity test falls back to != with the same answer, and nothing "
        "else compares stored hashes by identity"
    ),
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_55": _CAST,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_59": _CAST,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_60": _CAST,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_61": _CAST,
    "pagedkv.block_hash.x_chain_block_hash__mutmut_2": (
        "with keys=(None,), chain_block_hashes reads extra_keys[0], None, for its one block: "
        "hash_fn gets the same input"
    ),
    "pagedkv.block.xǁKVCacheBlockǁ__init____mutmut_1": (
        "require_int returns an exact int unchanged; every other type took that path already"
    ),
    "pagedkv.attention.xǁSlidingWindowManagerǁfind_longest_cache_hit__mutmut_2": _GROUP_0_LOOKUP,
    "pagedkv.attention.xǁChunkedLocalAttentionManagerǁfind_longest_cache_hit__mutmut_2": (
        _GROUP_0_LOOKUP
    ),
    "pagedkv.attention.x_scan_chunk_hit__mutmut_2": (
        "the extra pass at top == 0 has chunk 0, start 0, lowest 0 and finds nothing, so the "
        "result is [] as before; top never drops below -1, where both loops stop"
    ),
    **{f"{_R}{n}": _FAST_APPEND_NARROWED for n in (1, 3, 4, 5, 7, 8, 10, 13, 16, 17, 18)},
}
"""The pool's and the structures' under it: tests/test_pool_edges.py killed the rest of their
survivors but four timeouts."""

EARLIER: dict[str, str] = {
    "pagedkv.manager.xǁKVCacheManagerǁallocate_slots__mutmut_55": (
        "dropping the free count from min(): fits() guaranteed num_new <= free - evictable hits, "
        "and touching takes at most the evictable hits off the queue, so num_new never exceeds "
        "the free count left"
    ),
    "pagedkv.manager.xǁKVCacheManagerǁ_check_cached_blocks__mutmut_4": _DEFAULT_UNREACHABLE,
    "pagedkv.manager.xǁKVCacheManagerǁ_check_cached_blocks__mutmut_6": _DEFAULT_UNREACHABLE,
    "pagedkv.manager.xǁKVCacheManagerǁ_check_cached_blocks__mutmut_7": _DEFAULT_UNREACHABLE,
    "pagedkv.manager.xǁKVCacheManagerǁ_check_cached_blocks__mutmut_10": _DEFAULT_UNREACHABLE,
    "pagedkv.manager.xǁKVCacheManagerǁ_check_cached_blocks__mutmut_12": _DEFAULT_UNREACHABLE,
    "pagedkv.block_hash.x_mm_inputs_in_block__mutmut_8": (
        "`and` for `or` disables the shortcut for a block past every input; the loop then passes "
        "over each input (sorted and disjoint, all ending before the block) and returns the same "
        "([], len(ranges))"
    ),
}
"""Arguments written with the score of round 3's first full run."""

EQUIVALENT: dict[str, str] = {**EARLIER, **MANAGER_EQUIVALENTS, **POOL_EQUIVALENTS}
"""Survivor -> why no test can kill it."""
