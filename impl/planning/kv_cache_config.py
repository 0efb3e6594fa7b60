"""From a memory budget to a KV cache config, and from many workers' configs to one.

    check_enough_kv_cache_memory   does one request of max_model_len fit? if not, say what would
    estimate_max_model_len         the largest max_model_len that fits (binary search)
    get_kv_cache_config            budget -> num_blocks, one tensor per layer, one group
    unify_kv_cache_configs         workers' configs -> equal specs checked, min num_blocks

This is vLLM 0.8.5's one-group path: a model mixing layer kinds is planned as full attention.
vLLM 0.33's groups for hybrid models are `pagedkv.planning.kv_cache_groups`. Nothing here
changes what it is given: specs and configs are frozen, mappings are copied.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from pagedkv.vocab.arguments import (
    argument_error,
    require_instance,
    require_int,
    require_iterable,
)
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

logger = logging.getLogger(__name__)

GiB = 1 << 30


def num_blocks_for_budget(available_memory: int, page_size_bytes: int, num_layers: int) -> int:
    """The most blocks whose pages, one per layer, fit in `available_memory` bytes.

    Complexity: O(1).
    """
    return available_memory // page_size_bytes // num_layers


def _check_limits(
    call: str, max_model_len: int, max_num_batched_tokens: int | None, available_memory: object = 0
) -> int:
    """Validate the limits (and a memory budget: an int, maybe <= 0); return
    max_num_batched_tokens, max_model_len when it is None."""
    require_int(call, "available_memory", available_memory)
    require_int(call, "max_model_len", max_model_len, 1)
    if max_num_batched_tokens is None:
        return max_model_len
    return require_int(call, "max_num_batched_tokens", max_num_batched_tokens, 1)


def check_kv_cache_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> None:
    """Refuse what is not a mapping of layer name to spec (ArgumentTypeError), a value that is
    not a spec (InvalidArgumentError), or no layers at all (KVCacheConfigError).

    Complexity: O(num_layers).
    """
    if not isinstance(kv_cache_specs, Mapping):
        raise ArgumentTypeError(
            f"kv_cache_specs must be a mapping of layer name to KVCacheSpec, got {kv_cache_specs!r}"
        )
    if not kv_cache_specs:
        raise KVCacheConfigError("the model has no KV cache layers")
    for name, spec in kv_cache_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise InvalidArgumentError(f"layer {name!r}: not a KVCacheSpec: {spec!r}")


def _needed_bytes(
    spec_counts: Counter[KVCacheSpec], max_model_len: int, max_num_batched_tokens: int
) -> int:
    return sum(
        count * spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        for spec, count in spec_counts.items()
    )


def memory_needed_bytes(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Bytes of KV cache that one request of `max_model_len` tokens needs, over all layers.

    Args:
        kv_cache_specs: layer name -> spec.
        max_model_len: the longest request (>= 1).
        max_num_batched_tokens: the most tokens one step computes (>= 1); None means
            `max_model_len` (a whole request may be computed in one step). Only sliding-window
            layers depend on it.

    Raises:
        InvalidArgumentError: a limit < 1 or a value that is not a spec.
        KVCacheConfigError: no layers.

    Complexity: O(num_layers).
    """
    batched = _check_limits("memory_needed_bytes", max_model_len, max_num_batched_tokens)
    check_kv_cache_specs(kv_cache_specs)
    return _needed_bytes(Counter(kv_cache_specs.values()), max_model_len, batched)


def estimate_max_model_len(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """The largest max_model_len in `[1, max_model_len]` whose one request fits, or 0 if none.

    Memory needed never decreases as max_model_len grows, so a binary search finds it. Only
    max_model_len varies; `max_num_batched_tokens` (None: the given `max_model_len`) stays fixed.

    Args:
        kv_cache_specs: layer name -> spec (not changed).
        available_memory: bytes available for the KV cache.
        max_model_len: the upper end of the search (>= 1).
        max_num_batched_tokens: as in `memory_needed_bytes`.

    Raises:
        InvalidArgumentError, KVCacheConfigError: as in `memory_needed_bytes`.

    Complexity: O(distinct specs * log max_model_len) after O(num_layers) to count the specs.
    """
    batched = _check_limits(
        "estimate_max_model_len", max_model_len, max_num_batched_tokens, available_memory
    )
    check_kv_cache_specs(kv_cache_specs)
    spec_counts = Counter(kv_cache_specs.values())
    low, high = 0, max_model_len  # invariant: `low` fits (or is 0); everything above `high` not
    while low < high:
        mid = (low + high + 1) // 2
        if _needed_bytes(spec_counts, mid, batched) <= available_memory:
            low = mid
        else:
            high = mid - 1
    return low


def check_enough_kv_cache_memory(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Refuse a budget that cannot hold even one request of `max_model_len` tokens.

    Args:
        kv_cache_specs: layer name -> spec (not changed).
        available_memory: bytes available for the KV cache.
        max_model_len: as in `memory_needed_bytes`.
        max_num_batched_tokens: as in `memory_needed_bytes`.

    Raises:
        KVCacheConfigError: `available_memory` <= 0; or one request needs more than it, with a
            message that names the needed and available GiB and the largest max_model_len that
            fits (vLLM 0.8.5 meant to, but a string-concatenation slip dropped the number).
        InvalidArgumentError: as in `memory_needed_bytes`.

    Complexity: O(num_layers + distinct specs * log max_model_len).
    """
    batched = _check_limits(
        "check_enough_kv_cache_memory", max_model_len, max_num_batched_tokens, available_memory
    )
    check_kv_cache_specs(kv_cache_specs)
    if available_memory <= 0:
        raise KVCacheConfigError(
            f"no memory is available for the KV cache ({available_memory:,} bytes); "
            f"raise gpu_memory_utilization or free device memory"
        )
    needed = memory_needed_bytes(
        kv_cache_specs, max_model_len=max_model_len, max_num_batched_tokens=batched
    )
    if needed <= available_memory:
        return
    largest = estimate_max_model_len(
        kv_cache_specs,
        available_memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
    )
    fits = (
        f"the largest max_model_len that fits is {largest:,}"
        if largest
        else "not even max_model_len=1 fits"
    )
    raise KVCacheConfigError(
        f"one request of max_model_len={max_model_len:,} needs {needed / GiB:.2f} GiB "
        f"({needed:,} bytes) of KV cache, more than the {available_memory / GiB:.2f} GiB "
        f"({available_memory:,} bytes) available; {fits}. Raise gpu_memory_utilization or "
        f"lower max_model_len."
    )


def unify_hybrid_kv_cache_specs(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """A copy in which sliding-window and chunked-local layers become full attention if the
    model also has full-attention layers.

    One block table must serve every layer, and a full-attention layer cannot drop blocks that
    left a window or a chunk, so the window is given up (the same heads, head size, dtype and
    block size). vLLM 0.8.5 has no chunked-local spec; vLLM 0.33 promotes both kinds this way
    when its hybrid KV cache manager is off (`--disable-hybrid-kv-cache-manager`).

    Complexity: O(num_layers).
    """
    specs = dict(kv_cache_specs)
    local = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
    has_full = any(isinstance(spec, FullAttentionSpec) for spec in specs.values())
    has_local = any(isinstance(spec, local) for spec in specs.values())
    if has_full and has_local:
        for name, spec in specs.items():
            if isinstance(spec, local):
                specs[name] = FullAttentionSpec(
                    block_size=spec.block_size,
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size,
                    dtype=spec.dtype,
                    use_mla=spec.use_mla,
                )
    return specs


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    """The KV cache config of one worker: memory checked, specs unified, budget split.

    Steps: `check_enough_kv_cache_memory` on the specs as given; `unify_hybrid_kv_cache_specs`;
    every layer must then have the same spec (one group, one page size); `num_blocks =
    available_memory // page_size // num_layers`, or `num_blocks_override` if given (which may
    exceed the budget: it is for tests and for operators who know better); one tensor of
    `page_size * num_blocks` bytes per layer.

    Args:
        kv_cache_specs: layer name -> spec, in model order (not changed).
        available_memory: bytes available for the KV cache on this worker.
        max_model_len: as in `memory_needed_bytes`.
        max_num_batched_tokens: as in `memory_needed_bytes`.
        num_blocks_override: use this many blocks (>= 1) instead of the budget's.

    Raises:
        KVCacheConfigError: not enough memory (see `check_enough_kv_cache_memory`), or layers
            whose specs still differ after unification (names two such layers and their specs).
        InvalidArgumentError: a limit or the override < 1.

    Complexity: O(num_layers + distinct specs * log max_model_len).
    """
    if num_blocks_override is not None and (
        not isinstance(num_blocks_override, int)
        or isinstance(num_blocks_override, bool)
        or num_blocks_override < 1
    ):
        raise InvalidArgumentError(
            f"num_blocks_override must be an int >= 1, got {num_blocks_override!r}"
        )
    check_enough_kv_cache_memory(
        kv_cache_specs,
        available_memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    specs = unify_hybrid_kv_cache_specs(kv_cache_specs)
    names = list(specs)
    first_name, spec = names[0], specs[names[0]]
    for name in names[1:]:
        if specs[name] != spec:
            raise KVCacheConfigError(
                f"layers need one KV cache spec (one page size, one block table), but layer "
                f"{first_name!r} has {spec} and layer {name!r} has {specs[name]}"
            )
    page_size = spec.page_size_bytes
    num_blocks = num_blocks_for_budget(available_memory, page_size, len(names))
    if num_blocks_override is not None:
        logger.info(
            "num_blocks %d overridden by num_blocks_override=%d", num_blocks, num_blocks_override
        )
        num_blocks = num_blocks_override
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens; %.2fx max_model_len=%d",
        num_blocks,
        spec.block_size,
        num_blocks * spec.block_size,
        num_blocks * spec.block_size / max_model_len,
        max_model_len,
    )
    tensor = KVCacheTensor(size=page_size * num_blocks)
    return KVCacheConfig(
        num_blocks=num_blocks,
        tensors=dict.fromkeys(names, tensor),
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def sorted_kv_cache_groups(config: KVCacheConfig) -> tuple[KVCacheGroupSpec, ...]:
    """The config's groups sorted by spec `type_id` (stable), the order workers compare in.

    Complexity: O(g log g) for g groups.
    """
    return tuple(sorted(config.kv_cache_groups, key=lambda group: group.kv_cache_spec.type_id))


def check_kv_cache_groups_match(
    groups_per_worker: Sequence[Sequence[KVCacheGroupSpec]],
) -> None:
    """Every worker's groups, in `sorted_kv_cache_groups` order, must have worker 0's specs.

    Layer names are not compared: pipeline-parallel workers hold different layers.

    Raises:
        KVCacheConfigError: a worker has another number of groups, or a group whose spec differs;
            the message names the worker, the group, a layer of each side, and both specs.
        InvalidArgumentError: no workers.

    Complexity: O(workers * groups).
    """
    if not groups_per_worker:
        raise InvalidArgumentError("at least one worker's KV cache groups are needed")
    reference = groups_per_worker[0]
    for worker, groups in enumerate(groups_per_worker[1:], start=1):
        if len(groups) != len(reference):
            raise KVCacheConfigError(
                f"worker {worker} has {len(groups)} KV cache groups, worker 0 has "
                f"{len(reference)}: {[g.kv_cache_spec.type_id for g in groups]} vs "
                f"{[g.kv_cache_spec.type_id for g in reference]}"
            )
        for index, (ours, theirs) in enumerate(zip(reference, groups, strict=True)):
            if ours.kv_cache_spec != theirs.kv_cache_spec:
                raise KVCacheConfigError(
                    f"KV cache specs differ between workers in group {index}: worker 0 layer "
                    f"{ours.layer_names[0]!r} has {ours.kv_cache_spec}, worker {worker} layer "
                    f"{theirs.layer_names[0]!r} has {theirs.kv_cache_spec}"
                )


def unify_kv_cache_configs(kv_cache_configs: Iterable[KVCacheConfig]) -> list[KVCacheConfig]:
    """New configs, one per worker, that one manager can drive: same specs, min num_blocks.

    Each result has its worker's tensors (a tensor larger than `num_blocks` pages is fine: only
    the first `num_blocks` are used), its groups sorted by type id, and the minimum `num_blocks`
    over all workers. The configs given are not changed; an iterator is read once.

    Raises:
        KVCacheConfigError: specs differ (see `check_kv_cache_groups_match`).
        InvalidArgumentError: no configs.
        ArgumentTypeError: `kv_cache_configs` is one config, a str or not iterable, or an item
            is not a KVCacheConfig.

    Complexity: O(workers * (groups log groups + num_layers)).
    """
    call = "unify_kv_cache_configs"
    if isinstance(kv_cache_configs, (KVCacheConfig, str, bytes)):
        raise argument_error(
            call,
            "kv_cache_configs",
            "a collection of KVCacheConfig (one per worker)",
            kv_cache_configs,
            type_ok=False,
        )
    configs: list[object] = require_iterable(call, "kv_cache_configs", kv_cache_configs)
    for index, config in enumerate(configs):
        require_instance(call, f"kv_cache_configs[{index}]", config, KVCacheConfig)
    workers: list[KVCacheConfig] = configs  # type: ignore[assignment]
    if not workers:
        raise InvalidArgumentError("at least one KV cache config is needed")
    groups = [sorted_kv_cache_groups(config) for config in workers]
    check_kv_cache_groups_match(groups)
    num_blocks = min(config.num_blocks for config in workers)
    return [
        KVCacheConfig(num_blocks, config.tensors, config_groups)
        for config, config_groups in zip(workers, groups, strict=True)
    ]
