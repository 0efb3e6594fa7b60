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

_C = "pagedkv.kv_cache_coordinator.xǁ"
_M = "pagedkv.manager.xǁKVCacheManagerǁ"
_P = "pagedkv.block_pool.xǁBlockPoolǁ"
_CHUNKED = "pagedkv.single_type.chunked_local.xǁChunkedLocalAttentionManagerǁ"
_WINDOW = "pagedkv.single_type.sliding_window.xǁSlidingWindowManagerǁ"
_FULL = "pagedkv.single_type.full_attention.xǁFullAttentionManagerǁ"
_BASE = "pagedkv.single_type.base.xǁSingleTypeKVCacheManagerǁ"
_T = "pagedkv.single_type."

_SHARED_1 = (
    "SingleTypeKVCacheManager.add_hits never finds a list for the request, so the mutant "
    "(get(None) or None: no request id is None; extend(None): the else branch) takes the "
    "same `blocks is None` path: its only caller, the coordinator's add_hits, passes hits "
    "only for a request with no list in group 0 (_check_hits refuses hits for one that "
    "holds blocks, and a list is never empty: the call that makes it appends >= 1 block, "
    "num_tokens being >= 1), and [] only when group 0 has no list; lists are made here and "
    "deleted by free in every group together"
)
_SHARED_2 = (
    "`and` -> `or` in an assert: check_pool / check_cache_full_blocks already refused every"
    " other type with a typed error, so both operands are true"
)
_SHARED_3 = (
    "`for_eagle` is never read in this method's body, so its default value cannot change "
    "what it returns"
)
_SHARED_4 = "`settled = None` is falsy like False and is read only by `while not settled`"
_SHARED_5 = (
    "a block taken from the free queue has ref_cnt 0 (the pool queues a block only when its"
    " count reaches 0), so `= 1` and `+= 1` give the same count"
)
_SHARED_6 = (
    "block id 0 owned by the pool is the null block, declined anyway; a foreign block 0 "
    "fails the ownership test: False either way"
)
_SHARED_7 = (
    "slicing [:length] when length == len(block_hashes) passes an equal copy; each "
    "find_longest_cache_hit (full attention, sliding window, chunked local) only reads "
    "block_hashes during the call (its len and items) and keeps no reference"
)
_SHARED_8 = (
    "strict only matters when zip's arguments differ in length: `found` is made as [None] *"
    " len(units) and only assigned by index (found[index] for index in enumerate(units)), "
    "so units and found always have equal lengths and zip yields the same pairs with or "
    "without strict"
)
_SHARED_9 = (
    "strict only matters when zip's arguments differ in length: every `hits` comes from "
    "_unit_hit, which returns one list per group of the unit ([... for k in "
    "range(len(groups))]); EAGLE's pop shortens the inner lists, never the outer one, so "
    "unit.groups and hits always have equal lengths and zip yields the same pairs"
)
_SHARED_10 = (
    "strict only matters when zip's arguments differ in length: the zip runs only for hits "
    "that passed check_allocation, which returns () for None and otherwise a tuple of "
    "exactly num_groups lists (its fast path tests len(new_computed_blocks) == num_groups, "
    "its slow path refuses any other length), and allocate_slots replaces hits with no "
    "blocks by (); so hits has one list per single_type_manager and zip yields the same "
    "pairs"
)
_SHARED_11 = (
    "the mutant only makes the decode fast path decline in more cases, and the full path "
    "then makes the same changes and returns the same blocks (the fast path acts only where"
    " it makes exactly the full path's changes); here: at num_computed == 0"
)
_SHARED_12 = (
    "the mutant only narrows the fast path: what it turns away goes to _append_checked, "
    "which appends the same ints (require_int and int() return an exact int unchanged, "
    "require_token_ids gives tuple(items) for in-range ints) and refuses what the original "
    "refuses there"
)
_SHARED_13 = (
    "the mutant recomputes the first multimodal input also when the carried index is 0: "
    "first_mm_input(positions, start) is the first input ending after start, and the scan "
    "from index 0 passes over every input ending at or before start, so both reach the same"
    " index"
)
_SHARED_14 = (
    "the mutated test only holds in more cases (len * B <= T - B implies len / B <= T - B "
    "and len * B <= T + B); in each added case (len(block_hashes) + 1) * B > T, so "
    "len(block_hashes) >= T // B = len(chain) and "
    "block_hashes.extend(chain[len(block_hashes):]) adds nothing; the extra pass only "
    "hashes (a named algorithm from get_hash_fn: the sha256 memo's contents decide only "
    "what is recomputed, never a value), and nothing else in the branch changes state"
)
_SHARED_15 = "typing.cast returns its second argument unchanged at run time, whatever the first"
_SHARED_16 = "with group 0, self.cached_block(h) is block_pool.cached_block(h): the same lookup"
_SHARED_17 = (
    "zip's strictness cannot matter: _check_hits's only caller, _allocate_slots, passes the"
    " hits check_allocation returned, a tuple of exactly num_groups lists (it refuses any "
    "other count), one per single_type_manager"
)
_SHARED_18 = (
    "zip's strictness cannot matter: _check_request runs only for ids in _first_blocks, so "
    "held[0] is a list and the lengths check has already raised unless every group holds a "
    "list of that length; group_blocks then has one list per manager"
)

EQUIVALENT: dict[str, str] = {
    "pagedkv.block.xǁKVCacheBlockǁ__init____mutmut_1": (
        "require_int returns an exact int unchanged; every other type took that path already"
    ),
    "pagedkv.block_hash.x_chain_block_hash__mutmut_2": (
        "with keys=(None,), chain_block_hashes reads extra_keys[0], None, for its one "
        "block: hash_fn gets the same input"
    ),
    "pagedkv.block_hash.x_mm_inputs_in_block__mutmut_8": (
        "`and` for `or` disables the shortcut for a block past every input; the loop then "
        "passes over each input (sorted and disjoint, all ending before the block) and "
        "returns the same ([], len(ranges))"
    ),
    f"{_P}__init____mutmut_10": _SHARED_2,
    f"{_P}append_new_block_locked__mutmut_15": _SHARED_5,
    f"{_P}cache_full_blocks__mutmut_28": _SHARED_2,
    f"{_P}cache_full_blocks__mutmut_29": _SHARED_2,
    f"{_P}cache_full_blocks_locked__mutmut_1": (
        "the default group_id is never used: both callers (BlockPool.cache_full_blocks and "
        "SingleTypeKVCacheManager.cache_blocks) pass group_id explicitly"
    ),
    f"{_P}cache_full_blocks_locked__mutmut_23": (
        "mm_idx is read only by `elif mm_idx < 0` before its first assignment, true for -1 "
        "and -2 alike; the vLLM branch overwrites it"
    ),
    f"{_P}cache_full_blocks_locked__mutmut_55": _SHARED_13,
    f"{_P}cache_full_blocks_locked__mutmut_56": _SHARED_13,
    f"{_P}cache_full_blocks_locked__mutmut_88": (
        "the mutant calls require_int on every returned value, not only on values whose "
        "type is not exactly int: require_int returns an exact int unchanged (its result is"
        " not used here) and raises on anything else exactly as before"
    ),
    f"{_P}cache_next_full_block_locked__mutmut_19": _SHARED_6,
    f"{_P}cache_next_full_block_locked__mutmut_20": _SHARED_6,
    f"{_P}cache_next_full_block_locked__mutmut_28": (
        "parent_hash_value is used only as `parent or NONE_HASH` in chain_block_hashes; '' "
        "and None are both falsy"
    ),
    f"{_P}get_new_blocks_locked__mutmut_13": _SHARED_5,
    f"{_P}intern_hashes_locked__mutmut_2": (
        "a stored hash equals its block's key (hits are lookups under those hashes): "
        "check_hits_locked's identity test falls back to != with the same answer, and "
        "nothing else compares stored hashes by identity"
    ),
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_55": _SHARED_15,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_59": _SHARED_15,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_60": _SHARED_15,
    "pagedkv.free_queue.xǁFreeKVCacheBlockQueueǁ__init____mutmut_61": _SHARED_15,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_14": (
        "`hits = None` makes a full-attention unit be looked up again in every pass after "
        "the first instead of being cut with min(); the re-lookup returns exactly `current`"
        " blocks: its first lookup (pass 1) found h = min(P, limit) blocks of its cached "
        "prefix P within limit <= len(block_hashes), then dropped one, F = h - 1, so P >= F"
        " + 1 and len(block_hashes) >= F + 1 (when h = 0 nothing is dropped: P = 0 or no "
        "hashes, every re-lookup is [] and current is 0 either way); every later pass has "
        "current <= length <= F. Verified it finds min(P, current) = current blocks (so no "
        "verified.clear()); unverified (for_eagle is ignored by full attention's scan_hit) "
        "it finds current + 1 within min(current + 1, len(block_hashes)) = current + 1 and "
        "drops one: current. So current and the other units' lookups are unchanged (a "
        "unit's own entry in `verified` is read only for that unit), its found hits are a "
        "prefix, at least `length` long, of the same cached blocks (cached_block is a pure "
        "dict read), and the final group_hits[:length] gives the same blocks"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_47": (
        "for_eagle=None instead of False: _unit_hit passes it only to "
        "unit.manager.scan_hit; full attention's scan_hit ignores it and sliding window's "
        "reads it only in `eagle_contiguous_blocks if for_eagle else "
        "sliding_window_contiguous_blocks`, where None is falsy like False (chunked local "
        "attention, whose scan_hit ignores it too, cannot reach _eagle_common_hit: EAGLE "
        "with it is refused at construction)"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_64": _SHARED_8,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_67": _SHARED_8,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_68": _SHARED_8,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_72": _SHARED_9,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_75": _SHARED_9,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_76": _SHARED_9,
    f"{_C}HybridKVCacheCoordinatorǁ_eagle_common_hit__mutmut_79": (
        "the mutant also slices the non-full units' hits to [:length], which changes "
        "nothing: each non-full unit is looked up in every pass and no lookup returns more "
        "than `current` (unverified: within min(current + 1, len(block_hashes)), less the "
        "last block when non-empty; verified: within current), so current never rises "
        "within a pass; the loop ends either on `current >= length`, so every unit's hit in"
        " the last pass has exactly `length` blocks, or on single_pass (two units, units[0]"
        " full), where the only non-full unit is the last one, whose length is `length`. "
        "The slice is then an equal new list, and the original list is referenced by "
        "nothing else (found is local)"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_13": (
        "answered[] is read only in `answered[group] == length`, where length is a len() >="
        " 0: an initial -2 never matches, as -1 never does"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_14": _SHARED_4,
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_20": (
        "`break` for `continue`: the groups skipped in a pass are a suffix of "
        "_skipping_groups, so break leaves out only groups continue skips too, with settled"
        " unchanged. Proof: every answered[g] is the length just after g's ask, so it is >="
        " every later length; nothing is skipped in pass 1 (answered is -1); in pass k >= "
        "2, starting at L (the length after pass k-1), a skip needs answered[g] == the "
        "current length, so no group is skipped after a shortening in the same pass (their "
        "answers are >= L > current). Let g* be the last group that shortened the hit in "
        "pass k-1: groups after g* were skipped or answered exactly L, groups before it "
        "were asked or skipped at a length > L; so a group skipped in pass k (before any "
        "shortening, length L) is g* or after it, and every later group has answered == L "
        "and is skipped too"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_23": _SHARED_7,
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_27": (
        "the mutant only asks a group again where the original skips it, i.e. within its "
        "own last answer L, and that ask returns the same blocks: scan_window_hit's answer "
        "L within L0 either ends on the run of cached positions i..L-1 at which its scan "
        "from the right first counted num_needed (nulls before i), and a scan within L "
        "counts the same positions from L - 1 and stops at the same i; or it is the run of "
        "cached positions from 0 that never reached num_needed, and within L it still does "
        "not; scan_chunk_hit's answer L lies in the range [lowest, top] of the chunk it "
        "tried, so within L the same chunk start is found and positions start..L-1 are "
        "cached (L = 0 gives [] both times). No extra ask shortens the hit, answered stays "
        "L, hits[group] becomes an equal list of the same blocks, and the passes go on as "
        "in the original"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_28": (
        "`<=` also sets settled = False when a group answers exactly the current length (it"
        " cannot answer more: it is asked within the length). Until the original's last "
        "pass the mutant does the same asks (settled is already False in every earlier "
        "pass: each had a shortening); after that last pass every group's answered equals "
        "the final length (asked ones answered it, skipped ones matched it), so the "
        "mutant's one extra pass skips every group and ends with the same hits"
    ),
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_30": _SHARED_4,
    f"{_C}HybridKVCacheCoordinatorǁ_longest_common_hit__mutmut_6": _SHARED_7,
    f"{_C}KVCacheCoordinatorǁadd_hits__mutmut_11": _SHARED_10,
    f"{_C}KVCacheCoordinatorǁadd_hits__mutmut_12": _SHARED_10,
    f"{_C}KVCacheCoordinatorǁadd_hits__mutmut_8": _SHARED_10,
    f"{_M}__init____mutmut_24": (
        "`and` -> `or` in an assert: check_manager, called just before, already refused a "
        "max_model_len that is not an int and an enable_caching that is not a bool with a "
        "typed error, so both operands are true"
    ),
    f"{_M}__init____mutmut_25": (
        "`and` -> `or` in an assert: check_manager, called just before, already refused a "
        "use_eagle or log_stats that is not a bool with a typed error, so both operands are"
        " true"
    ),
    f"{_M}_allocate_slots__mutmut_14": (
        "`and` -> `or` in an assert: check_allocation, just before it, already refused any "
        "non-Request request and any non-int num_tokens with a typed error, so both forms "
        "hold"
    ),
    f"{_M}_allocate_slots__mutmut_141": (
        "the mutant runs _num_evictable_hits where the original skips it: with num_hits == "
        "0, hits is () (any(hits) false) and _num_evictable_hits(()) sums nothing: 0, as "
        "before"
    ),
    f"{_M}_allocate_slots__mutmut_161": (
        "`>=` adds the min() for num_new == 0, which gives min(0, free, room) <= 0; "
        "allocate_new_blocks of a count <= 0 returns [] in every group and changes nothing,"
        " as with 0"
    ),
    f"{_M}_allocate_slots__mutmut_162": (
        "skipping the min() for num_new == 1 keeps 1, which the min() keeps too: fits() "
        "passed, so at least 1 block is free, and the room max_num_blocks_per_req - held - "
        "hits is >= 1 (without the cap num_required <= max_num_blocks_per_req; with it, "
        "num_required > max was refused unless held + hits < max)"
    ),
    f"{_M}_allocate_slots__mutmut_168": (
        "dropping the free count from min(): fits() passed, so num_new <= "
        "get_num_blocks_to_allocate(num_new) <= free - evictable hits <= free, and the free"
        " count is never the least"
    ),
    f"{_M}_allocate_slots__mutmut_60": (
        "None for () where there are no hits: hits is then read only as `len(hits[0]) if "
        "hits else 0` (0 for both), under `if num_hits` (skipped) and by "
        "coordinator.add_hits, whose `if hits and hits[0]` is false for both, so it takes "
        "the same branch"
    ),
    f"{_M}_check_hits__mutmut_30": _SHARED_17,
    f"{_M}_check_hits__mutmut_33": _SHARED_17,
    f"{_M}_check_hits__mutmut_34": _SHARED_17,
    f"{_M}_check_invariants__mutmut_2": (
        "null_block is read only to leave null blocks out of `holders`; with None they are "
        "counted under block id 0 (a pool's block 0 is its null block), and holders[0] is "
        "never read: the ref_cnt loop runs over pool.blocks[1:] only"
    ),
    f"{_M}_check_request__mutmut_21": _SHARED_18,
    f"{_M}_check_request__mutmut_24": _SHARED_18,
    f"{_M}_check_request__mutmut_25": _SHARED_18,
    f"{_M}_check_request__mutmut_60": _SHARED_18,
    f"{_M}_check_request__mutmut_63": _SHARED_18,
    f"{_M}_check_request__mutmut_64": _SHARED_18,
    f"{_M}_check_request__mutmut_76": (
        "num_cached is an int (num_cached_block holds only the int num_full) and "
        "len(stored) an int, so num_cached > min(T / B, len(stored)) holds exactly when "
        "num_cached > min(T // B, len(stored)): for ints n, T >= 0 and B > 0, n > T / B iff"
        " n > T // B, and T / B is exact enough for that below 2**53 tokens, far more than "
        "a request's token list can hold; the detail message does not show the min"
    ),
    f"{_M}_forget_if_done__mutmut_12": (
        "the default only matters for a Request with no record, and there is none: _track, "
        "the only writer of _requests, gives every tracked Request a record, and only "
        "_forget_if_done removes one, together with its request, so pop(request) finds the "
        "key"
    ),
    f"{_M}_get_computed_blocks__mutmut_24": _SHARED_14,
    f"{_M}_get_computed_blocks__mutmut_26": _SHARED_14,
    f"{_M}allocate_slots__mutmut_105": (
        "the mutant only makes the decode fast path decline in more cases (here a step "
        "whose slots end exactly at the end of one new block), and the full path then makes"
        " the same changes and returns the same blocks (the fast path acts only where it "
        "makes exactly the full path's changes)"
    ),
    f"{_M}allocate_slots__mutmut_16": (
        "the id only matters when record is not None: with no record the fast path's test "
        '`record is not None and ...` fails whatever _first_blocks.get("XXXX") returns (a '
        "dict lookup, no side effect), and the full path runs as before"
    ),
    f"{_M}allocate_slots__mutmut_59": _SHARED_11,
    f"{_M}allocate_slots__mutmut_60": _SHARED_11,
    f"{_M}allocate_slots__mutmut_64": (
        "the mutant only makes the decode fast path decline in more cases, and the full "
        "path then makes the same changes and returns the same blocks (the fast path acts "
        "only where it makes exactly the full path's changes); here: with a window or "
        "chunked first group it always declines, and with full attention skips_a_block "
        "answers False (num_skipped_blocks is 0), so the test is True as before"
    ),
    f"{_BASE}add_hits__mutmut_1": _SHARED_1,
    f"{_BASE}add_hits__mutmut_2": _SHARED_1,
    f"{_BASE}add_hits__mutmut_5": _SHARED_1,
    f"{_BASE}allocate_new_blocks__mutmut_1": (
        "with num_blocks == 0 the mutant calls get_new_blocks_locked(0), which pops nothing"
        " and returns [], then extends the request's list (made by add_hits earlier in the "
        "same allocate_slots) by [] and returns that new empty list: the same result, "
        "nothing changed"
    ),
    f"{_BASE}cache_blocks__mutmut_12": (
        "`>=` adds a cache_full_blocks_locked call with start == end, which hashes nothing,"
        " announces no event and extends by []; its parent check passes (the last cached "
        "position is a held block that keeps its hash, or the null block with a stored "
        "hash)"
    ),
    f"{_BASE}skips_a_block__mutmut_4": (
        "`>=` differs only at num_skipped == 0, where it reads blocks[-1] (req_to_blocks "
        "never holds an empty list: allocate_slots needs num_tokens >= 1, so a request's "
        "first call appends at least one block) and may answer True; the mutant only makes "
        "the decode fast path (its one caller) decline in more cases, and the full path "
        "then makes the same changes and returns the same blocks"
    ),
    f"{_T}chunked_local.x_scan_chunk_hit__mutmut_2": (
        "the extra pass at top == 0 has chunk 0, start 0, lowest 0 and finds nothing, so "
        "the result is [] as before; top never drops below -1, where both loops stop"
    ),
    f"{_CHUNKED}find_longest_cache_hit__mutmut_1": _SHARED_3,
    f"{_CHUNKED}find_longest_cache_hit__mutmut_3": _SHARED_16,
    f"{_CHUNKED}scan_hit__mutmut_1": _SHARED_3,
    f"{_FULL}find_longest_cache_hit__mutmut_1": _SHARED_3,
    f"{_FULL}scan_hit__mutmut_1": _SHARED_3,
    f"{_WINDOW}find_longest_cache_hit__mutmut_3": _SHARED_16,
    f"{_WINDOW}scan_hit__mutmut_1": (
        "the default of `for_eagle` is never used: scan_hit's only callers, "
        "SlidingWindowManager.find_longest_cache_hit and "
        "HybridKVCacheCoordinator._eagle_common_hit, pass it explicitly"
    ),
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_1": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_10": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_13": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_16": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_17": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_18": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_3": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_4": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_5": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_7": _SHARED_12,
    "pagedkv.vocab.request.xǁRequestǁappend_output_token_ids__mutmut_8": _SHARED_12,
}
"""Survivor -> why no test can kill it."""
