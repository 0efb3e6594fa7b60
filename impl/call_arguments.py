"""The argument checks of each public call of the block pool and the manager, in their order.

The spec and the implementation run the same function at the top of each call, so both refuse
the same input, in the same words, before either changes anything; the differential harness
holds pagedkv's own objects to the spec's wording. Calls are named as the implementation's API
names them ("BlockPool.touch", "KVCacheManager.allocate_slots"), and block arguments are checked
with each side's notion of a block (a `KVCacheBlock`, or a block id).

What each check accepts is in `pagedkv.vocab.arguments`; the rules about state (a free block, a hit
that is not cached, ...) stay with each side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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

IsBlock = Callable[[object], bool] | type
"""Whether a value is a block in one side's terms: a predicate (an int block id), or the block
class itself (`KVCacheBlock`), tested with isinstance and no call per item."""

POOL = "BlockPool"
MANAGER = "KVCacheManager"


def is_block_id(value: object) -> bool:
    """A block as the spec and the harness name it: an int (not a bool)."""
    return is_int(value)


def not_a_block(call: str, argument: str, value: object, *, context: str = "") -> ArgumentTypeError:
    """The error for an item of a block list that is no block at all."""
    error = argument_error(call, argument, "a block", value, type_ok=False, context=context)
    assert isinstance(error, ArgumentTypeError)
    return error


def block_list(
    call: str, argument: str, blocks: object, is_block: IsBlock, *, context: str = ""
) -> list[Any]:
    """The items of `blocks` as a new list (read once), each a block in `is_block`'s terms.

    Raises:
        ArgumentTypeError: `blocks` is not iterable, or names the first item that is no block.

    Complexity: O(len(blocks)).
    """
    items: list[Any] = require_iterable(call, argument, blocks, context=context)
    if isinstance(is_block, type) and all(map(is_block.__instancecheck__, items)):
        return items  # the common case in one C-level pass
    for index, item in enumerate(items):
        if not _is_one(is_block, item):
            raise not_a_block(call, f"{argument}[{index}]", item, context=context)
    return items


def _is_one(is_block: IsBlock, value: object) -> bool:
    """Whether `value` is a block in `is_block`'s terms (a class or a predicate)."""
    return isinstance(value, is_block) if isinstance(is_block, type) else is_block(value)


# -- the block pool ----------------------------------------------------------------------------


def check_pool(
    num_gpu_blocks: object,
    enable_caching: object,
    semantics: object,
    enable_kv_cache_events: object = False,
) -> None:
    """BlockPool(num_gpu_blocks, enable_caching, semantics, enable_kv_cache_events): an int
    >= 1, a bool, a Semantics, a bool."""
    require_int(POOL, "num_gpu_blocks", num_gpu_blocks, 1)
    require_bool(POOL, "enable_caching", enable_caching)
    require_instance(POOL, "semantics", semantics, Semantics)
    require_bool(POOL, "enable_kv_cache_events", enable_kv_cache_events)


def check_get_new_blocks(num_blocks: object) -> int:
    """BlockPool.get_new_blocks(num_blocks): an int >= 0."""
    return require_int(f"{POOL}.get_new_blocks", "num_blocks", num_blocks, 0)


def check_block_hash(call: str, argument: str, value: object) -> BlockHashType:
    """A `BlockHashType` whose fields can be hashed (it becomes, or looks up, an index key)."""
    block_hash = require_instance(call, argument, value, BlockHashType)
    try:
        hash(block_hash)
    except TypeError:
        raise argument_error(
            call, argument, "a hashable BlockHashType", value, type_ok=False
        ) from None
    return block_hash


def check_cache_key(call: str, argument: str, value: object) -> CacheKey:
    """A block's index key: a hashable `BlockHashType`, or a `GroupKey` of a KV cache group
    >= 1 over one (group 0's key is the hash itself)."""
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
    is_block: IsBlock,
    group_id: object = 0,
) -> Sequence[Any] | None:
    """BlockPool.cache_full_blocks' argument checks, in order; then its range checks.

    Types: a Request; a sequence of blocks (any iterable, read once); a list of stored hashes
    (it grows); counts that are ints >= 0; block_size an int >= 1; a callable hash function; a
    KV cache group id, an int >= 0. Then: caching is on; 0 <= num_cached_blocks <=
    num_full_blocks <= len(blocks); at least num_cached_blocks stored hashes; every stored hash
    the call reads (from the parent's position on) is a hashable BlockHashType; the blocks to
    cache and the parent are blocks.

    Returns:
        The blocks as a sequence, or None when there is nothing to cache (num_cached_blocks ==
        num_full_blocks).

    Complexity: O(num_full_blocks - num_cached_blocks) plus, for an iterator, reading it.
    """
    call = f"{POOL}.cache_full_blocks"
    require_instance(call, "request", request, Request)
    assert isinstance(request, Request)
    sequence: Sequence[Any] = (
        blocks if isinstance(blocks, (list, tuple)) else require_iterable(call, "blocks", blocks)
    )
    hashes: list[Any] = require_instance(call, "block_hashes", block_hashes, list)
    num_cached = require_int(call, "num_cached_blocks", num_cached_blocks, 0)
    num_full = require_int(call, "num_full_blocks", num_full_blocks, 0)
    require_int(call, "block_size", block_size, 1)
    require_callable(call, "hash_fn", hash_fn)
    if type(group_id) is not int or group_id < 0:
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
            f"request {request.request_id!r} has {len(hashes)} stored block hashes, "
            f"fewer than num_cached_blocks ({num_cached})"
        )
    first_read = max(num_cached - 1, 0)
    for position in range(first_read, min(num_full, len(hashes))):
        check_block_hash(call, f"block_hashes[{position}]", hashes[position])
    if num_cached == num_full:
        return None
    for position in range(first_read, num_full):
        if not _is_one(is_block, sequence[position]):
            raise not_a_block(call, f"blocks[{position}]", sequence[position])
    return sequence


# -- the manager ---------------------------------------------------------------------------------

VLLM_0_8_5_ONLY = (
    "capacity_counts_null_blocks",
    "vllm_new_block_mm_keys",
    "cap_at_max_model_len",
    "eagle_window_hit_one_short",
    "mm_keys_without_position",
)
"""The semantics switches of vLLM 0.8.5's behaviour: with one KV cache group only (0.8.5 had no
hybrid manager). `null_block_refcounted` is also 0.32.0's, with any number of groups."""


def check_manager(
    kv_cache_config: object,
    max_model_len: object,
    enable_caching: object,
    caching_hash_algo: object,
    use_eagle: object,
    log_stats: object,
    semantics: object,
    enable_kv_cache_events: object = False,
    max_in_flight_tokens: object = None,
) -> KVCacheConfig:
    """KVCacheManager's constructor arguments: their types (max_in_flight_tokens None or an
    int >= 1), then (KVCacheConfigError) with caching, groups of several block sizes only in
    the domain `_check_several_block_sizes` states, a Mamba group only in mamba_cache_mode
    "none" with caching off. The hash algorithm's name is checked by `get_hash_fn`, each group's
    spec by the registry of per-type managers (`pagedkv.single_type`), the semantics by
    `check_semantics`.

    Returns:
        The config.

    Complexity: O(KV cache groups).
    """
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
        checked = require_instance(MANAGER, "semantics", semantics, Semantics)
        _check_several_block_sizes(config, block_sizes, use_eagle, checked)
    groups = config.kv_cache_groups
    num_mamba = sum(isinstance(group.kv_cache_spec, MambaSpec) for group in groups)
    for group, group_spec in enumerate(groups):
        spec = group_spec.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        mode = spec.mamba_cache_mode
        if mode == "none" and enable_caching is False:
            continue
        if mode != "align" or enable_caching is not True:
            raise refusals.mamba_cache_mode_unserved(group, mode, bool(enable_caching))
        _check_mamba_align(config, group, spec, num_mamba, use_eagle is True, block_sizes)
    return config


def _check_mamba_align(
    config: KVCacheConfig,
    group: int,
    spec: MambaSpec,
    num_mamba: int,
    use_eagle: bool,
    block_sizes: list[int],
) -> None:
    """A Mamba group in mode "align" (caching on): vLLM 0.33's engine defaults only, refused
    in the spec's order (`pagedkv.spec.arguments.check_mamba_align`). Complexity: O(groups)."""
    if spec.num_speculative_blocks >= spec.block_size:
        raise refusals.mamba_align_many_speculative_blocks(
            group, spec.num_speculative_blocks, spec.block_size
        )
    if spec.num_prefill_checkpoint_blocks > 0:
        raise refusals.mamba_align_unserved(
            group, f"num_prefill_checkpoint_blocks={spec.num_prefill_checkpoint_blocks}"
        )
    if use_eagle:
        raise refusals.mamba_align_unserved(group, "EAGLE (use_eagle=True)")
    groups = config.kv_cache_groups
    if not any(isinstance(other.kv_cache_spec, FullAttentionSpec) for other in groups):
        raise refusals.mamba_align_unserved(group, "no full-attention group beside it")
    for other, other_group in enumerate(groups):
        other_spec = other_group.kv_cache_spec
        if not isinstance(other_spec, (FullAttentionSpec, MambaSpec)):
            name = type(other_spec).__name__
            raise refusals.mamba_align_unserved(group, f"a {name} group beside it (group {other})")
    if len(block_sizes) > 1:
        raise refusals.mamba_align_unserved(group, f"groups of several block sizes {block_sizes}")


# Per attention type in a mixed-size config with caching: (kind, rule, block size wanted,
# why) -- the size being "S" (the scheduler block size).
_MIXED_SIZE_RULES: dict[type, tuple[str, str, str]] = {
    ChunkedLocalAttentionSpec: (
        "chunked local attention",
        "S",
        "their LCM: vLLM 0.33 asserts it at the first lookup",
    ),
}


def _check_several_block_sizes(
    config: KVCacheConfig,
    block_sizes: list[int],
    use_eagle: object,
    semantics: Semantics,
) -> None:
    """Groups of several block sizes with caching: pagedkv's, vLLM 0.33's or 0.32's semantics, no
    EAGLE, chunked attention at S (the spec's `check_several_block_sizes`, in its
    order). Complexity: O(groups)."""
    if semantics not in SEVERAL_BLOCK_SIZES_SEMANTICS:
        raise refusals.groups_of_several_block_sizes(
            block_sizes,
            "under the semantics 'pagedkv', 'vllm-0.33' and 'vllm-0.32' (the behaviour "
            f"checked against vLLM 0.33.0 and 0.32.0), not {semantics.name}",
        )
    if use_eagle:
        raise refusals.groups_of_several_block_sizes(
            block_sizes,
            "without EAGLE (vLLM 0.33 drops a block of each group's own size, then rounds the "
            "hit down to their LCM: not modelled yet)",
        )
    sizes = {"S": config.scheduler_block_size}
    names = {"S": "scheduler block size"}
    for group, group_spec in enumerate(config.kv_cache_groups):
        spec = group_spec.kv_cache_spec
        rule = _MIXED_SIZE_RULES.get(type(spec))
        if rule is not None and spec.block_size != sizes[rule[1]]:
            kind, size, why = rule
            raise refusals.group_block_size_unserved(
                group, kind, spec.block_size, names[size], sizes[size], why
            )


def check_semantics(semantics: Semantics, num_groups: int) -> None:
    """vLLM 0.8.5's switches only with one KV cache group (KVCacheConfigError).

    Complexity: O(1).
    """
    if num_groups > 1:
        switches = [name for name in VLLM_0_8_5_ONLY if getattr(semantics, name)]
        if switches:
            raise refusals.vllm_0_8_5_switches_with_groups(num_groups, switches)


def check_request(method: str, request: object) -> Request:
    """`request` if it is a Request (every request-level call of the manager takes one)."""
    return require_instance(f"{MANAGER}.{method}", "request", request, Request)


def request_context(request: Request) -> str:
    return f" for request {request.request_id!r}"


def check_lookup(request: object) -> Request:
    """KVCacheManager.get_computed_blocks(request): a Request whose prompt_logprobs is a bool."""
    checked = check_request("get_computed_blocks", request)
    require_bool(
        f"{MANAGER}.get_computed_blocks",
        "request.prompt_logprobs",
        checked.prompt_logprobs,
        context=request_context(checked),
    )
    return checked


def check_allocation(
    request: object,
    num_tokens: object,
    new_computed_blocks: object,
    num_lookahead_tokens: object,
    num_groups: int,
    is_block: IsBlock,
    full_sequence_must_fit: object = False,
    num_external_computed_tokens: object = 0,
    delay_cache_blocks: object = False,
) -> tuple[list[Any], ...]:
    """KVCacheManager.allocate_slots' argument checks, in order.

    A Request; num_tokens an int >= 0; num_lookahead_tokens an int >= 0; full_sequence_must_fit
    a bool; num_external_computed_tokens an int >= 0; delay_cache_blocks a bool; the request's
    num_computed_tokens an int and its spec_token_ids a list; new_computed_blocks None or one
    iterable of blocks per KV cache group, in a list or a tuple of `num_groups` of them.

    Returns:
        The hits, one new list per group; an empty tuple for None (no hits in any group).

    Complexity: O(KV cache groups) plus the hits.
    """
    if (
        type(num_tokens) is int
        and num_tokens >= 0
        and type(num_lookahead_tokens) is int
        and num_lookahead_tokens >= 0
        and type(full_sequence_must_fit) is bool
        and type(num_external_computed_tokens) is int
        and num_external_computed_tokens >= 0
        and type(delay_cache_blocks) is bool
        and isinstance(request, Request)
        and type(request.num_computed_tokens) is int
        and type(request.spec_token_ids) is list
    ):
        # Every check passed, in one test: no hits, or a lookup's hits (the common calls).
        if new_computed_blocks is None:
            return ()
        if (
            type(new_computed_blocks) is tuple
            and len(new_computed_blocks) == num_groups
            and isinstance(is_block, type)
        ):
            hits: list[list[Any]] = []
            for group_hits in new_computed_blocks:
                if type(group_hits) is not list and type(group_hits) is not tuple:
                    break
                if not all(map(is_block.__instancecheck__, group_hits)):
                    break
                hits.append(list(group_hits))
            else:
                return tuple(hits)
    call = f"{MANAGER}.allocate_slots"
    checked = check_request("allocate_slots", request)
    context = request_context(checked)
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
        return ()
    if not isinstance(new_computed_blocks, (list, tuple)) or len(new_computed_blocks) != num_groups:
        raise per_group_error(
            call, "new_computed_blocks", num_groups, new_computed_blocks, context=context
        )
    return tuple(
        block_list(call, f"new_computed_blocks[{group}]", group_hits, is_block, context=context)
        for group, group_hits in enumerate(new_computed_blocks)
    )


def check_popped_blocks(popped: object, num_groups: int, is_block: IsBlock) -> list[list[Any]]:
    """KVCacheManager.free_popped_blocks' argument check: one iterable of blocks per KV cache
    group, in a list or a tuple of `num_groups` of them. Complexity: O(groups + blocks)."""
    call = f"{MANAGER}.free_popped_blocks"
    if not isinstance(popped, (list, tuple)) or len(popped) != num_groups:
        raise per_group_error(call, "popped", num_groups, popped)
    return [
        block_list(call, f"popped[{group}]", group_blocks, is_block)
        for group, group_blocks in enumerate(popped)
    ]


def check_cache_blocks(request: object, num_computed_tokens: object) -> Request:
    """KVCacheManager.cache_blocks(request, num_computed_tokens): a Request and an int >= 0.
    Complexity: O(1)."""
    checked = check_request("cache_blocks", request)
    require_int(
        f"{MANAGER}.cache_blocks",
        "num_computed_tokens",
        num_computed_tokens,
        0,
        context=request_context(checked),
    )
    return checked


def check_common_prefix(request: object, num_running_requests: object) -> Request:
    """KVCacheManager.get_num_common_prefix_blocks(request, num_running_requests): a Request
    and an int >= 0."""
    checked = check_request("get_num_common_prefix_blocks", request)
    if type(num_running_requests) is not int or num_running_requests < 0:
        require_int(
            f"{MANAGER}.get_num_common_prefix_blocks",
            "num_running_requests",
            num_running_requests,
            0,
            context=request_context(checked),
        )
    return checked
