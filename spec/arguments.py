"""The argument rules of each public call of the pool and the manager, decided by the spec.

One function per call, its checks in the order the call makes them; the first broken one raises.
A block is a block id: an int that is not a bool. The type checks and the wording of a refusal
(`pagedkv.vocab.arguments`) are shared vocabulary; which argument must satisfy which rule is
written here, independently of the implementation's `pagedkv.call_arguments`, so that a wrong
rule on either side shows up as a divergence.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import (
    argument_error,
    is_int,
    per_group_error,
    require_bool,
    require_callable,
    require_instance,
    require_int,
    require_iterable,
    require_str,
)
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.vocab.hashes import BlockHashType, CacheKey, GroupKey
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
)
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import (
    SEVERAL_BLOCK_SIZES_SEMANTICS,
    Semantics,
)

VLLM_0_8_5_ONLY = (
    "capacity_counts_null_blocks",
    "vllm_new_block_mm_keys",
    "cap_at_max_model_len",
    "eagle_window_hit_one_short",
    "mm_keys_without_position",
)
"""The semantics switches of vLLM 0.8.5's behaviour: one KV cache group only (it had no hybrid
manager). `null_block_refcounted` is 0.8.5's and 0.32.0's, whose hybrid manager counts the null
block in every group, so it takes any number of groups."""

POOL = "BlockPool"
MANAGER = "KVCacheManager"


def not_a_block(call: str, argument: str, value: object, context: str = "") -> ArgumentTypeError:
    """The refusal of a value that is not a block id at all."""
    error = argument_error(call, argument, "a block", value, type_ok=False, context=context)
    assert isinstance(error, ArgumentTypeError)
    return error


def require_block_ids(call: str, argument: str, values: object, context: str = "") -> list[int]:
    """The items of `values` (any iterable, read once) as a list, each a block id."""
    items: list[int] = require_iterable(call, argument, values, context=context)
    for index, item in enumerate(items):
        if not is_int(item):
            raise not_a_block(call, f"{argument}[{index}]", item, context)
    return items


# -- the block pool ----------------------------------------------------------------------------


def check_pool(
    num_gpu_blocks: object,
    enable_caching: object,
    semantics: object,
    enable_kv_cache_events: object,
) -> None:
    """BlockPool(...): an int >= 1 (the null block is one of them), a bool, a Semantics, a bool."""
    require_int(POOL, "num_gpu_blocks", num_gpu_blocks, 1)
    require_bool(POOL, "enable_caching", enable_caching)
    require_instance(POOL, "semantics", semantics, Semantics)
    require_bool(POOL, "enable_kv_cache_events", enable_kv_cache_events)


def check_get_new_blocks(num_blocks: object) -> int:
    """BlockPool.get_new_blocks(num_blocks): an int >= 0."""
    return require_int(f"{POOL}.get_new_blocks", "num_blocks", num_blocks, 0)


def check_block_hash(call: str, argument: str, value: object) -> BlockHashType:
    """A BlockHashType that can be hashed: it is looked up in, or enters, the index."""
    block_hash = require_instance(call, argument, value, BlockHashType)
    try:
        hash(block_hash)
    except TypeError:
        raise argument_error(
            call, argument, "a hashable BlockHashType", value, type_ok=False
        ) from None
    return block_hash


def check_cache_key(call: str, argument: str, value: object) -> CacheKey:
    """A block's index key: a hashable BlockHashType, or a GroupKey of a group >= 1 over one."""
    if isinstance(value, GroupKey):
        require_int(call, f"{argument}.group_id", value.group_id, 1)
        check_block_hash(call, f"{argument}.block_hash", value.block_hash)
        return value
    return check_block_hash(call, argument, value)


def check_cache_full_blocks(
    enable_caching: bool,
    request: object,
    blocks: object,
    block_hashes: object,
    num_cached_blocks: object,
    num_full_blocks: object,
    block_size: object,
    hash_fn: object,
    group_id: object = 0,
) -> Sequence[int] | None:
    """BlockPool.cache_full_blocks(...), in order: the types (a Request; any iterable of
    blocks, read once; a list of stored hashes; counts that are ints >= 0; a block size >= 1; a
    callable; a group id >= 0); caching is on; 0 <= num_cached_blocks <= num_full_blocks <=
    len(blocks); at least num_cached_blocks stored hashes; each stored hash the call reads
    (from the parent's position on) is a hashable BlockHashType; each block it reads (the same
    positions) is a block id.

    Returns:
        The blocks as a sequence, or None when there is nothing to cache.
    """
    call = f"{POOL}.cache_full_blocks"
    checked_request = require_instance(call, "request", request, Request)
    sequence: Sequence[int] = (
        blocks if isinstance(blocks, (list, tuple)) else require_iterable(call, "blocks", blocks)
    )
    hashes: list[object] = require_instance(call, "block_hashes", block_hashes, list)
    num_cached = require_int(call, "num_cached_blocks", num_cached_blocks, 0)
    num_full = require_int(call, "num_full_blocks", num_full_blocks, 0)
    require_int(call, "block_size", block_size, 1)
    require_callable(call, "hash_fn", hash_fn)
    require_int(call, "group_id", group_id, 0)
    if not enable_caching:
        raise InvalidArgumentError("cache_full_blocks needs a pool with prefix caching on")
    if not num_cached <= num_full <= len(sequence):
        raise InvalidArgumentError(
            f"need 0 <= num_cached_blocks ({num_cached}) <= num_full_blocks "
            f"({num_full}) <= len(blocks) ({len(sequence)})"
        )
    if len(hashes) < num_cached:
        raise InvalidArgumentError(
            f"request {checked_request.request_id!r} has {len(hashes)} stored block hashes, "
            f"fewer than num_cached_blocks ({num_cached})"
        )
    first_read = max(num_cached - 1, 0)  # the parent of the first block to cache
    for position in range(first_read, min(num_full, len(hashes))):
        check_block_hash(call, f"block_hashes[{position}]", hashes[position])
    if num_cached == num_full:
        return None
    for position in range(first_read, num_full):
        if not is_int(sequence[position]):
            raise not_a_block(call, f"blocks[{position}]", sequence[position])
    return sequence


# -- the manager -------------------------------------------------------------------------------


def check_manager(
    kv_cache_config: object,
    max_model_len: object,
    enable_caching: object,
    caching_hash_algo: object,
    use_eagle: object,
    log_stats: object,
    semantics: object,
    enable_kv_cache_events: object,
    max_in_flight_tokens: object = None,
) -> KVCacheConfig:
    """KVCacheManager(...): a KVCacheConfig; max_model_len an int >= 1; flags that are bools; a
    str hash algorithm (its name is checked by `get_hash_fn`); a Semantics; max_in_flight_tokens
    None or an int >= 1; then
    (KVCacheConfigError) with caching, groups of several block sizes only as
    `check_several_block_sizes` allows; a Mamba group in mamba_cache_mode "none" with caching
    off, or in "align" with caching on (`check_mamba_align`). Each group's spec is checked
    next, by the registry of
    per-type managers (`pagedkv.spec.single_type`), then the semantics (`check_semantics`)."""
    config = require_instance(MANAGER, "kv_cache_config", kv_cache_config, KVCacheConfig)
    require_int(MANAGER, "max_model_len", max_model_len, 1)
    require_bool(MANAGER, "enable_caching", enable_caching)
    require_str(MANAGER, "caching_hash_algo", caching_hash_algo)
    require_bool(MANAGER, "use_eagle", use_eagle)
    require_bool(MANAGER, "log_stats", log_stats)
    require_instance(MANAGER, "semantics", semantics, Semantics)
    require_bool(MANAGER, "enable_kv_cache_events", enable_kv_cache_events)
    if max_in_flight_tokens is not None:
        require_int(MANAGER, "max_in_flight_tokens", max_in_flight_tokens, 1)
    block_sizes = sorted({group.kv_cache_spec.block_size for group in config.kv_cache_groups})
    if len(block_sizes) != 1 and enable_caching:
        checked_semantics = require_instance(MANAGER, "semantics", semantics, Semantics)
        check_several_block_sizes(config, use_eagle, checked_semantics)
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    mamba_groups = [group for group, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
    for group in mamba_groups:
        spec = specs[group]
        assert isinstance(spec, MambaSpec)
        if spec.mamba_cache_mode == "none" and not enable_caching:
            continue
        if spec.mamba_cache_mode != "align" or not enable_caching:
            raise refusals.mamba_cache_mode_unserved(
                group, spec.mamba_cache_mode, bool(enable_caching)
            )
        check_mamba_align(group, spec, specs, mamba_groups, bool(use_eagle), block_sizes)
    return config


def check_mamba_align(
    group: int,
    spec: MambaSpec,
    specs: Sequence[object],
    mamba_groups: Sequence[int],
    use_eagle: bool,
    block_sizes: Sequence[int],
) -> None:
    """A Mamba group in mode "align" (caching on) is served with vLLM 0.33's engine defaults
    only, in this order (KVCacheConfigError): fewer speculative blocks than its block size,
    no prefill checkpoint blocks, no EAGLE, a full-attention group in the config, every
    group full attention or Mamba, and every group of the Mamba group's block size
    (docs/semantics.md, "Mamba states with prefix caching")."""
    if spec.num_speculative_blocks >= spec.block_size:
        raise refusals.mamba_align_many_speculative_blocks(
            group, spec.num_speculative_blocks, spec.block_size
        )
    if spec.num_prefill_checkpoint_blocks:
        raise refusals.mamba_align_unserved(
            group, f"num_prefill_checkpoint_blocks={spec.num_prefill_checkpoint_blocks}"
        )
    if use_eagle:
        raise refusals.mamba_align_unserved(group, "EAGLE (use_eagle=True)")
    if not any(isinstance(other_spec, FullAttentionSpec) for other_spec in specs):
        raise refusals.mamba_align_unserved(group, "no full-attention group beside it")
    for other, other_spec in enumerate(specs):
        if not isinstance(other_spec, (FullAttentionSpec, MambaSpec)):
            name = type(other_spec).__name__
            raise refusals.mamba_align_unserved(group, f"a {name} group beside it (group {other})")
    if len(block_sizes) > 1:
        raise refusals.mamba_align_unserved(group, f"groups of several block sizes {block_sizes}")


def check_several_block_sizes(
    config: KVCacheConfig, use_eagle: object, semantics: Semantics
) -> None:
    """Groups of several block sizes with prefix caching (KVCacheConfigError), in order: the
    semantics are pagedkv's, vLLM 0.33's or vLLM 0.32's (the behaviour checked against vLLM
    0.33.0 and 0.32.0); no EAGLE; then group by group (Mamba groups are checked after), a
    chunked group's block size is the scheduler block size S (the LCM)."""
    sizes = sorted(set(config.block_sizes))
    if semantics not in SEVERAL_BLOCK_SIZES_SEMANTICS:
        raise refusals.groups_of_several_block_sizes(
            sizes,
            "under the semantics 'pagedkv', 'vllm-0.33' and 'vllm-0.32' (the behaviour "
            f"checked against vLLM 0.33.0 and 0.32.0), not {semantics.name}",
        )
    if use_eagle:
        raise refusals.groups_of_several_block_sizes(
            sizes,
            "without EAGLE (vLLM 0.33 drops a block of each group's own size, then rounds the "
            "hit down to their LCM: not modelled yet)",
        )
    scheduler_size = config.scheduler_block_size
    for group, group_spec in enumerate(config.kv_cache_groups):
        spec = group_spec.kv_cache_spec
        if type(spec) is ChunkedLocalAttentionSpec and spec.block_size != scheduler_size:
            raise refusals.group_block_size_unserved(
                group,
                "chunked local attention",
                spec.block_size,
                "scheduler block size",
                scheduler_size,
                "their LCM: vLLM 0.33 asserts it at the first lookup",
            )


def check_semantics(semantics: Semantics, num_groups: int) -> None:
    """None of vLLM 0.8.5's switches with several KV cache groups (KVCacheConfigError)."""
    switches = [name for name in VLLM_0_8_5_ONLY if getattr(semantics, name)]
    if switches and num_groups > 1:
        raise refusals.vllm_0_8_5_switches_with_groups(num_groups, switches)


def check_request(method: str, request: object) -> Request:
    """Every request-level call takes a Request first."""
    return require_instance(f"{MANAGER}.{method}", "request", request, Request)


def for_request(request: Request) -> str:
    """The context a request-level refusal names after the call."""
    return f" for request {request.request_id!r}"


def check_lookup(request: object) -> Request:
    """KVCacheManager.get_computed_blocks(request): a Request whose prompt_logprobs is a bool."""
    checked = check_request("get_computed_blocks", request)
    require_bool(
        f"{MANAGER}.get_computed_blocks",
        "request.prompt_logprobs",
        checked.prompt_logprobs,
        context=for_request(checked),
    )
    return checked


def check_allocation(
    request: object,
    num_tokens: object,
    new_computed_blocks: object,
    num_lookahead_tokens: object,
    num_groups: int,
    full_sequence_must_fit: object = False,
    num_external_computed_tokens: object = 0,
    delay_cache_blocks: object = False,
) -> tuple[list[int], ...]:
    """KVCacheManager.allocate_slots(...), in order: a Request; num_tokens an int >= 0;
    num_lookahead_tokens an int >= 0; full_sequence_must_fit a bool;
    num_external_computed_tokens an int >= 0; delay_cache_blocks a bool; the request's
    num_computed_tokens an int and its spec_token_ids a list; new_computed_blocks None or one
    iterable of block ids per KV cache group (a list or a tuple of `num_groups` of them).

    Returns:
        The hits, one new list per group (empty lists for None).
    """
    checked = check_request("allocate_slots", request)
    call = f"{MANAGER}.allocate_slots"
    context = for_request(checked)
    require_int(call, "num_tokens", num_tokens, 0, context=context)
    require_int(call, "num_lookahead_tokens", num_lookahead_tokens, 0, context=context)
    require_bool(call, "full_sequence_must_fit", full_sequence_must_fit, context=context)
    require_int(
        call, "num_external_computed_tokens", num_external_computed_tokens, 0, context=context
    )
    require_bool(call, "delay_cache_blocks", delay_cache_blocks, context=context)
    require_int(call, "request.num_computed_tokens", checked.num_computed_tokens, context=context)
    require_instance(call, "request.spec_token_ids", checked.spec_token_ids, list, context=context)
    if new_computed_blocks is None:
        return tuple([] for _ in range(num_groups))
    if not isinstance(new_computed_blocks, (list, tuple)) or len(new_computed_blocks) != num_groups:
        raise per_group_error(
            call, "new_computed_blocks", num_groups, new_computed_blocks, context=context
        )
    return tuple(
        require_block_ids(call, f"new_computed_blocks[{group}]", group_hits, context)
        for group, group_hits in enumerate(new_computed_blocks)
    )


def check_popped_blocks(popped: object, num_groups: int) -> list[list[int]]:
    """KVCacheManager.free_popped_blocks(popped): one iterable of block ids per KV cache group
    (a list or a tuple of `num_groups` of them), as `pop_blocks_for_free` returned them."""
    call = f"{MANAGER}.free_popped_blocks"
    if not isinstance(popped, (list, tuple)) or len(popped) != num_groups:
        raise per_group_error(call, "popped", num_groups, popped)
    return [
        require_block_ids(call, f"popped[{group}]", group_blocks)
        for group, group_blocks in enumerate(popped)
    ]


def check_cache_blocks(request: object, num_computed_tokens: object) -> Request:
    """KVCacheManager.cache_blocks(request, num_computed_tokens): a Request and an int >= 0."""
    checked = check_request("cache_blocks", request)
    require_int(
        f"{MANAGER}.cache_blocks",
        "num_computed_tokens",
        num_computed_tokens,
        0,
        context=for_request(checked),
    )
    return checked


def check_common_prefix(request: object, num_running_requests: object) -> Request:
    """KVCacheManager.get_num_common_prefix_blocks(request, num_running_requests): a Request and
    an int >= 0."""
    checked = check_request("get_num_common_prefix_blocks", request)
    require_int(
        f"{MANAGER}.get_num_common_prefix_blocks",
        "num_running_requests",
        num_running_requests,
        0,
        context=for_request(checked),
    )
    return checked
