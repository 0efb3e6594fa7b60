"""The refusals of the block- and request-level rules, each worded once.

The spec and the implementation each decide on their own whether a rule is broken (the spec
plainly, the implementation in its cheapest way), then raise the error built here, so both say
the same thing about the same misuse. Each function names the block or the request and the rule
(`BlockStateError.rule`, `RequestError.rule`: stable strings that callers may match on); the
argument checks that come before them are in `pagedkv.call_arguments`.
"""

from __future__ import annotations

from pagedkv.vocab.errors import (
    BlockStateError,
    InvalidArgumentError,
    KVCacheConfigError,
    MaxModelLenExceededError,
    OffloadChunkError,
    RequestError,
)

# -- the configuration (a manager's construction) ------------------------------------------------


def groups_of_several_block_sizes(block_sizes: list[int], reason: str) -> KVCacheConfigError:
    """Groups of several block sizes with prefix caching, outside the domain pagedkv serves
    (docs/semantics.md, "KVCacheManager": several block sizes with caching)."""
    return KVCacheConfigError(
        f"KVCacheManager with prefix caching serves groups of several block sizes "
        f"({block_sizes}) only {reason}"
    )


def group_block_size_unserved(
    group: int, kind: str, block_size: int, rule: str, required: int, why: str
) -> KVCacheConfigError:
    """A group of a mixed-size config with prefix caching whose block size is not the one its
    attention type needs there (`rule`: "hash block size" or "scheduler block size")."""
    return KVCacheConfigError(
        f"KV cache group {group} ({kind}) has block size {block_size}: with prefix caching and "
        f"groups of several block sizes, a {kind} group's block size must be the {rule} "
        f"{required} ({why})"
    )


MAMBA_HIT_DETAIL = (
    "a Mamba group caches no state (mamba_cache_mode 'none'), so no lookup finds a hit"
)
"""Why no hit fits a Mamba group in mode "none" (never reached: caching is off with one, so
hits are refused before their shape is asked)."""


def mamba_align_hit_detail(nulls: int, cached: int) -> str:
    """Why a hit cannot be a Mamba group's in mode "align": its null blocks, then exactly one
    cached state (the state after the hit's last token)."""
    return (
        f"a Mamba hit (mamba_cache_mode 'align') is null blocks then one cached state, got "
        f"{nulls} null blocks then {cached} blocks"
    )


def mamba_cache_mode_unserved(group: int, mode: str, enable_caching: bool) -> KVCacheConfigError:
    if mode == "none":
        return KVCacheConfigError(
            f"KV cache group {group}: a Mamba group with mamba_cache_mode 'none' needs prefix "
            "caching off (vLLM 0.33 caches states only in mode 'align')"
        )
    if mode == "align":
        return KVCacheConfigError(
            f"KV cache group {group}: a Mamba group with mamba_cache_mode 'align' needs prefix "
            "caching on (vLLM 0.33 switches it to 'none' with caching off)"
        )
    return KVCacheConfigError(
        f"KV cache group {group}: mamba_cache_mode {mode!r} is not served; use 'align' with "
        f"prefix caching on or 'none' with it off (enable_caching={enable_caching})"
    )


def mamba_align_unserved(group: int, what: str) -> KVCacheConfigError:
    """Mamba prefix caching (mode "align") is served for Mamba groups beside full-attention
    groups of their block size, with fewer speculative blocks than that size, no checkpoint
    blocks, no EAGLE (docs/design/mamba-align.md, plan steps 4-6 for the rest)."""
    return KVCacheConfigError(
        f"KV cache group {group}: mamba_cache_mode 'align' is not served yet with {what} "
        "(served: Mamba groups beside full-attention groups, fewer speculative blocks than "
        "the block size, no prefill checkpoint blocks, no EAGLE)"
    )


def no_manager_for(spec_type: str) -> KVCacheConfigError:
    return KVCacheConfigError(f"no attention manager for {spec_type}")


def eagle_unsupported(kind: str) -> KVCacheConfigError:
    return KVCacheConfigError(f"EAGLE is not supported with {kind}")


def vllm_0_8_5_switches_with_groups(num_groups: int, switches: list[str]) -> KVCacheConfigError:
    return KVCacheConfigError(
        f"vLLM 0.8.5's switches need one KV cache group (0.8.5 had no hybrid manager), got "
        f"{num_groups} groups and {', '.join(switches)}"
    )


def retention_without_sparse_group(interval: int) -> KVCacheConfigError:
    return KVCacheConfigError(
        f"prefix_cache_retention_interval={interval} needs a sliding-window or Mamba group: "
        "retention sparsifies only their cached blocks (set it to None or 0)"
    )


def retention_off_the_block_grid(interval: int, scheduler_block_size: int) -> KVCacheConfigError:
    return KVCacheConfigError(
        f"prefix_cache_retention_interval={interval} must be >= 0 and a multiple of "
        f"scheduler_block_size={scheduler_block_size}"
    )


# -- block rules (the pool) ----------------------------------------------------------------------


def foreign_block(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "block does not belong to this pool")


def free_of_free_block(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "free of a block whose ref_cnt is 0")


def freed_twice(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "the same block twice in one free_blocks call")


def popped_blocks_unknown(block_ids: list[list[int]]) -> BlockStateError:
    first = next((block_id for group in block_ids for block_id in group), -1)
    return BlockStateError(
        first,
        "a deferred free releases blocks pop_blocks_for_free handed over, once",
        f"{block_ids} is no batch popped and not yet freed",
    )


def cache_of_free_block(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "cache of a free block")


def hash_already_set(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "block hash is already set")


def cached_twice(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "the same block twice in one cache call")


def parent_without_hash(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "the block before the first block to cache has no hash")


def too_few_tokens(
    request_id: str, num_tokens: int, position: int, block_size: int
) -> InvalidArgumentError:
    start = position * block_size
    return InvalidArgumentError(
        f"request {request_id!r} has {num_tokens} tokens; block {position} needs tokens "
        f"[{start}, {start + block_size})"
    )


# -- request rules (the manager) -----------------------------------------------------------------


def id_in_use(request_id: str) -> RequestError:
    return RequestError(
        request_id,
        "request id already in use by another Request object",
        "free it and drop its hashes (free_block_hashes) before reusing the id",
    )


def more_drafts_than_scheduled(
    request_id: str, num_spec: int, num_tokens: int
) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"request {request_id!r}: {num_spec} speculative tokens but only {num_tokens} "
        f"scheduled (speculative tokens are part of num_tokens)"
    )


def computed_outside_slots(
    request_id: str, num_computed: int, num_held: int, block_size: int, group: int | None = None
) -> RequestError:
    where = "" if group is None else f" in KV cache group {group}"
    return RequestError(
        request_id,
        "num_computed_tokens outside the request's slots",
        f"{num_computed} computed, {num_held} blocks of {block_size} held{where}",
    )


def hits_without_caching(request_id: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"request {request_id!r}: new_computed_blocks given while prefix caching is off"
    )


def hits_for_running_request(request_id: str) -> RequestError:
    return RequestError(
        request_id,
        "new_computed_blocks for a request that already holds blocks or computed tokens",
    )


def nothing_to_allocate(request_id: str) -> InvalidArgumentError:
    """num_tokens 0 is a call that adopts a prefix hit or external tokens (an async load's
    admission); with neither it asks for nothing (vLLM 0.33: ValueError)."""
    return InvalidArgumentError(
        f"request {request_id!r}: allocate_slots with num_tokens 0 must adopt "
        "new_computed_blocks or external tokens"
    )


def external_for_running_request(request_id: str, num_external: int) -> RequestError:
    """External tokens extend a request's first allocation, after its hits: vLLM 0.33's
    scheduler asks a connector only for a request with no computed tokens (a running request's
    would silently become new slots, cached at once)."""
    return RequestError(
        request_id,
        "num_external_computed_tokens for a request that already holds blocks or computed tokens",
        f"{num_external} external tokens",
    )


def external_with_mamba(request_id: str, group: int) -> InvalidArgumentError:
    """A Mamba group's external state is a different protocol (vLLM 0.33's
    `get_computed_blocks_for_connector`), outside pagedkv's model of the connector path."""
    return InvalidArgumentError(
        f"request {request_id!r}: num_external_computed_tokens with a Mamba group (group "
        f"{group}) is not modelled"
    )


NOT_CACHED_HITS = "new_computed_blocks must be the request's cached blocks"


def mamba_align_many_speculative_blocks(
    group: int, num_speculative_blocks: int, block_size: int
) -> KVCacheConfigError:
    """Mode "align" is served with fewer speculative blocks than the block size: with k >= B a
    step's accepted drafts may pass a boundary the step keys, and vLLM 0.33's worker copies
    only the last boundary's state (`postprocess_mamba`), leaving the keyed column stale."""
    return mamba_align_unserved(
        group,
        f"num_speculative_blocks={num_speculative_blocks} not below its block size {block_size}",
    )


def mamba_align_speculation(
    request_id: str, group: int, num_spec: int, num_speculative_blocks: int
) -> InvalidArgumentError:
    """With Mamba prefix caching (mode "align") each draft token's state takes one of the
    group's `num_speculative_blocks` speculative columns (vLLM 0.33's worker writes the state
    after draft j into column R + j), so a step has at most that many drafts."""
    return InvalidArgumentError(
        f"request {request_id!r}: {num_spec} speculative tokens with a Mamba group in "
        f"mamba_cache_mode 'align' (group {group}) of num_speculative_blocks="
        f"{num_speculative_blocks}: each draft's state needs a speculative block"
    )


def mamba_unaligned_chunk(
    request_id: str, group: int, start: int, end: int, block_size: int
) -> RequestError:
    """A step starting inside a Mamba block must end by that block's end: the state the step
    leaves is written into the column of its last token, so a step from inside block c past its
    end leaves column c holding the state at `start`, which caching would key at (c + 1) * B
    (vLLM 0.33's scheduler never cuts such a chunk, `_mamba_block_aligned_split`; its manager
    does not check)."""
    boundary = -(-start // block_size) * block_size
    return RequestError(
        request_id,
        "a step starting inside a Mamba block ends by that block's end",
        f"tokens [{start}, {end}) cross {boundary} in KV cache group {group} (block size "
        f"{block_size}): cut the chunk at {boundary}",
    )


def hits_of_unequal_length(request_id: str, lengths: list[int]) -> RequestError:
    """A hybrid hit covers the same token prefix in every group."""
    return RequestError(
        request_id,
        "new_computed_blocks must cover the same blocks in every KV cache group",
        f"{lengths} hits per group",
    )


def hits_of_unequal_tokens(request_id: str, tokens: list[int]) -> RequestError:
    """With several block sizes, a hit covers the same tokens in every group (its block
    counts then differ)."""
    return RequestError(
        request_id,
        "new_computed_blocks must cover the same tokens in every KV cache group",
        f"{tokens} tokens per group",
    )


def more_hits_than_hashes(request_id: str, num_hits: int, num_stored: int) -> RequestError:
    return RequestError(
        request_id, NOT_CACHED_HITS, f"{num_hits} hits but {num_stored} stored block hashes"
    )


def hit_not_cached(request_id: str, block_id: int, position: int) -> RequestError:
    return RequestError(
        request_id,
        NOT_CACHED_HITS,
        f"block {block_id} at position {position} is not cached under the request's hash there",
    )


def null_hit(block_id: int) -> BlockStateError:
    return BlockStateError(block_id, "a null block is no hit: this attention type never skips one")


def window_hit_detail(num_nulls: int, num_after_nulls: int, num_needed: int) -> str:
    """Why a hit with null blocks is no sliding-window hit (`hit_shape`'s detail)."""
    return f"{num_nulls} null blocks, then {num_after_nulls} blocks; the window needs {num_needed}"


def chunk_hit_detail(num_nulls: int, num_hits: int, num_expected: int) -> str:
    """Why a hit is no chunked-local hit (`hit_shape`'s detail)."""
    return (
        f"{num_nulls} null blocks in a hit of {num_hits} blocks; its chunk starts at block "
        f"{num_expected}"
    )


def hit_shape(request_id: str, detail: str) -> RequestError:
    return RequestError(
        request_id, "new_computed_blocks is not a hit this attention type can produce", detail
    )


def cache_without_blocks(request_id: str) -> RequestError:
    return RequestError(request_id, "cache_blocks for a request that holds no blocks")


def cache_past_computed(request_id: str, num_tokens: int, num_computed: int) -> RequestError:
    """Blocks are cached only over tokens the caller counts as computed: a hash over KV not yet
    written would serve another request garbage."""
    return RequestError(
        request_id,
        "cache_blocks past the request's computed tokens",
        f"{num_tokens} tokens to cache, {num_computed} computed",
    )


def more_tokens_than_request(
    request_id: str, num_after: int, num_tokens: int
) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"request {request_id!r}: {num_after} tokens computed after this step, but the request "
        f"has {num_tokens}"
    )


def past_max_model_len(
    request_id: str,
    num_required: int,
    max_blocks: int,
    max_model_len: int,
    block_size: int,
    group: int | None = None,
) -> MaxModelLenExceededError:
    where = "" if group is None else f", KV cache group {group}"
    return MaxModelLenExceededError(
        request_id,
        "allocation past max_model_len",
        f"{num_required} blocks needed, at most {max_blocks} (max_model_len {max_model_len}, "
        f"block size {block_size}{where})",
    )


def cached_blocks_lost(request_id: str, num_full: int, num_cached: int) -> RequestError:
    return RequestError(
        request_id,
        "fewer full blocks than already cached",
        f"{num_full} full, {num_cached} cached: did num_computed_tokens go back?",
    )


def hashes_dropped_while_held(request_id: str) -> RequestError:
    return RequestError(
        request_id,
        "free_block_hashes of a request that still holds blocks",
        "free it first; a running request's cached blocks need their stored hashes",
    )


# -- the CPU offload tier ------------------------------------------------------------------------


def load_of_absent_chunk(key: bytes) -> OffloadChunkError:
    return OffloadChunkError(key, "prepare_load of a key the tier does not hold")


def load_of_pending_chunk(key: bytes) -> OffloadChunkError:
    return OffloadChunkError(
        key, "prepare_load of a chunk whose store is pending", "lookup says HIT_PENDING"
    )


def complete_load_of_unpinned_chunk(
    key: bytes, num_pins: int, num_completions: int
) -> OffloadChunkError:
    return OffloadChunkError(
        key,
        "complete_load of a chunk no pending load pins",
        f"{num_completions} completion(s) for {max(num_pins, 0)} pin(s)",
    )


def complete_store_of_chunk_not_pending(key: bytes, held: bool) -> OffloadChunkError:
    state = "stored and ready" if held else "not held"
    return OffloadChunkError(key, "complete_store of a chunk whose store is not pending", state)


def key_offered_twice(key: bytes, call: str) -> OffloadChunkError:
    return OffloadChunkError(key, f"{call} names the key twice")


def submit_after_finish(request_id: str, call: str) -> RequestError:
    return RequestError(
        request_id, f"{call} after on_request_finished", "a finished request submits no transfer"
    )


def offload_key_type(value: object) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"an offload key is bytes of a block hash and a 4-byte group index, got {value!r}",
        argument="keys",
        rule="offload key",
    )
