"""A model's KV cache groups and the config over them, as vLLM 0.33 builds them for hybrid models.

A hybrid model mixes layer kinds: Gemma-3 has five sliding-window layers to each full one,
gpt-oss one to one, Llama-4 three chunked-local layers to each full one. vLLM 0.33's hybrid KV
cache manager gives each kind its own block tables, so a window layer keeps only its window's
blocks, and serves them all from one pool of block ids. It builds the layout in these steps
(`vllm/v1/core/kv_cache_planning.py`), each a function here:

    unify_kv_cache_spec_page_size   every page grows to the largest: block size x a whole ratio
    get_kv_cache_groups             layers of one spec, split into groups of one size
    kv_cache_bytes_per_block        one block id = one page of each layer of the largest group
    get_kv_cache_config_from_groups tensors shared position by position across the groups
    get_grouped_kv_cache_config     budget -> memory checked -> num_blocks -> the config
    max_concurrency                 num_blocks / (blocks one request holds, summed over groups)

Gemma-3-4B (34 layers, layer i full when i + 1 is a multiple of 6), grouped:

    by spec, in model order:  full 5, 11, 17, 23, 29           sliding: the other 29 layers
    group size:               5, the fewest layers of one spec (the most, 29, would be used if
                              it were below 1.5 x 5: gpt-oss-20b + an EAGLE layer, 12 + 13)
    groups:                   full (5, 11, 17, 23, 29); sliding split cdiv(29, 5) = 6 ways,
                              layers[i::6] -> five groups of 5 layers and one of 4
    one block:                5 pages, one per position; the j-th layer of every group uses
                              the tensor of position j (`KVCacheTensor.shared_by`)

A group of fewer layers than the group size leaves its last positions unused ("padding layers",
vLLM warns how much memory they may waste). Where pagedkv stops short of vLLM 0.33, it refuses
with `KVCacheConfigError` rather than plan something else: pages that do not divide the largest
page (vLLM pads them), layers of one kind with different page sizes (vLLM groups them with a spec
per layer), and layouts whose attention backend aligns the block stride (taken as 1 here) or
packs pages block-outermost. Specs and configs are frozen; nothing given is changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pagedkv.block_counts import cdiv
from pagedkv.planning.byte_sizes import GiB
from pagedkv.planning.kv_cache_config import check_kv_cache_specs
from pagedkv.vocab.arguments import require_instance, require_int
from pagedkv.vocab.errors import InvalidArgumentError, KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
)

GROUP_SIZE_SLACK = 1.5
"""vLLM 0.33 makes groups as large as the most layers of one spec when that is below this many
times the fewest; otherwise as large as the fewest."""


def unify_kv_cache_spec_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """A copy in which every layer's page is the largest page of the model.

    A smaller page whose size divides the largest grows by that ratio of its block size (a
    window layer of half the page bytes gets blocks of twice the tokens), as vLLM 0.33 does; a
    smaller Mamba page, whose state does not grow with its block size, is padded to the largest.

    Raises:
        KVCacheConfigError: a page does not divide the largest one (vLLM 0.33 pads such pages;
            pagedkv's specs have no padded pages); or no layers.
        InvalidArgumentError: a value that is not a spec.

    Complexity: O(num_layers).
    """
    check_kv_cache_specs(kv_cache_specs)
    largest = max(spec.page_size_bytes for spec in kv_cache_specs.values())
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_specs.items():
        page = spec.page_size_bytes
        if isinstance(spec, MambaSpec):  # a state does not grow with the block size: padded
            unified[name] = (
                spec if page == largest else dataclasses.replace(spec, page_size_padded=largest)
            )
            continue
        if largest % page:
            raise KVCacheConfigError(
                f"layer {name!r}: its {page:,}-byte page does not divide the largest page "
                f"({largest:,} bytes), so no block size gives every layer one page size "
                f"(vLLM 0.33 pads such pages; pagedkv does not)"
            )
        unified[name] = (
            spec
            if page == largest
            else dataclasses.replace(spec, block_size=spec.block_size * (largest // page))
        )
    return unified


def get_kv_cache_groups(kv_cache_specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """The layers split into KV cache groups of one spec each, as vLLM 0.33 splits them.

    One spec for every layer: one group, every layer in model order. Otherwise pages are
    unified (`unify_kv_cache_spec_page_size`), layers bucketed by spec (buckets in the order
    their first layer appears), and each bucket of n layers split into `cdiv(n, group_size)`
    groups, group i taking `layers[i::num_groups]` (so each pipeline stage's share of a group
    stays even); `group_size` is the fewest layers of one spec, or the most when that is below
    `GROUP_SIZE_SLACK` times the fewest.

    Args:
        kv_cache_specs: layer name -> spec, in model order (not changed).

    Raises:
        KVCacheConfigError: no layers; pages that cannot be unified; or layers of one kind whose
            specs differ (vLLM 0.33 puts them in one group with a spec per layer, which
            pagedkv's groups do not hold).
        InvalidArgumentError: a value that is not a spec.

    Complexity: O(num_layers).
    """
    check_kv_cache_specs(kv_cache_specs)
    distinct = set(kv_cache_specs.values())
    if len(distinct) == 1:
        return (KVCacheGroupSpec(list(kv_cache_specs), distinct.pop()),)
    kinds = {(type(spec), spec.block_size, _window_of(spec)) for spec in distinct}
    if len(kinds) == 1:
        raise KVCacheConfigError(
            f"layers of one kind with {len(distinct)} different specs ({_describe(distinct)}): "
            f"vLLM 0.33 keeps them in one group with a spec per layer, which pagedkv's KV "
            f"cache groups do not hold"
        )
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in unify_kv_cache_spec_page_size(kv_cache_specs).items():
        buckets.setdefault(spec, []).append(name)
    fewest = min(len(names) for names in buckets.values())
    most = max(len(names) for names in buckets.values())
    group_size = most if most < fewest * GROUP_SIZE_SLACK else fewest
    groups = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), group_size)
        groups += [KVCacheGroupSpec(names[i::num_groups], spec) for i in range(num_groups)]
    return tuple(groups)


def _window_of(spec: KVCacheSpec) -> int | None:
    """The window or chunk that makes two specs of one class different kinds, if any."""
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return window if isinstance(window, int) else None


def _describe(specs: set[KVCacheSpec]) -> str:
    shown = sorted(spec.type_id for spec in specs)
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def _check_groups(groups: Sequence[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    if isinstance(groups, (str, KVCacheGroupSpec)) or not isinstance(groups, Sequence):
        raise InvalidArgumentError(f"kv_cache_groups must be a sequence of groups, got {groups!r}")
    if not groups:
        raise KVCacheConfigError("a KV cache config needs at least one group")
    for group in groups:
        if not isinstance(group, KVCacheGroupSpec):
            raise InvalidArgumentError(f"not a KVCacheGroupSpec: {group!r}")
    pages = {group.kv_cache_spec.page_size_bytes for group in groups}
    if len(pages) != 1:
        raise KVCacheConfigError(
            f"the groups' pages differ ({sorted(pages)} bytes): one block id must address "
            f"a page of every group; unify the page sizes first"
        )
    return tuple(groups)


def kv_cache_bytes_per_block(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id takes: a page for each layer of the largest group.

    Raises:
        KVCacheConfigError: no groups, or groups whose pages differ.
        InvalidArgumentError: an item that is not a group.

    Complexity: O(groups).
    """
    groups = _check_groups(kv_cache_groups)
    return max(len(group.layer_names) for group in groups) * groups[0].kv_cache_spec.page_size_bytes


def get_kv_cache_config_from_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int
) -> KVCacheConfig:
    """The config of exactly `num_blocks` blocks over `kv_cache_groups`.

    The j-th layer of every group uses one tensor of `num_blocks` pages (`shared_by` names them;
    a tensor only one layer uses names none), so the model holds `kv_cache_bytes_per_block *
    num_blocks` bytes in all.

    Raises:
        KVCacheConfigError: no groups, or groups whose pages differ.
        InvalidArgumentError: `num_blocks` < 1, or an item that is not a group.

    Complexity: O(num_layers).
    """
    groups = _check_groups(kv_cache_groups)
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise InvalidArgumentError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    size = groups[0].kv_cache_spec.page_size_bytes * num_blocks
    positions = []
    for position in range(max(len(group.layer_names) for group in groups)):
        sharers = [g.layer_names[position] for g in groups if position < len(g.layer_names)]
        positions.append(KVCacheTensor(size, sharers if len(sharers) > 1 else ()))
    tensors = {
        name: positions[position]
        for group in groups
        for position, name in enumerate(group.layer_names)
    }
    return KVCacheConfig(num_blocks, tensors, groups)


def blocks_per_request(
    group: KVCacheGroupSpec, *, max_model_len: int, max_in_flight_tokens: int
) -> int:
    """Blocks one request of `max_model_len` tokens holds at most in `group` (each of its
    layers one page of each): `cdiv(spec.max_memory_usage_bytes(...), page)`.

    Complexity: O(1).
    """
    spec = group.kv_cache_spec
    return cdiv(
        spec.max_memory_usage_bytes(max_model_len, max_in_flight_tokens), spec.page_size_bytes
    )


def max_memory_usage_bytes_from_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec], *, max_model_len: int, max_in_flight_tokens: int
) -> int:
    """Bytes one request of `max_model_len` tokens holds: its blocks in every group, summed,
    times `kv_cache_bytes_per_block` (so a group's unused positions count, as in vLLM 0.33).

    Raises:
        InvalidArgumentError, KVCacheConfigError: as `kv_cache_bytes_per_block`, or a limit < 1.

    Complexity: O(groups).
    """
    per_block = kv_cache_bytes_per_block(kv_cache_groups)
    limits = {"max_model_len": max_model_len, "max_in_flight_tokens": max_in_flight_tokens}
    return per_block * sum(blocks_per_request(group, **limits) for group in kv_cache_groups)


def estimate_max_model_len_from_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int,
) -> int:
    """The largest max_model_len in `[1, max_model_len]` whose one request fits in
    `available_memory` (`max_memory_usage_bytes_from_groups`), or 0 if none (binary search).

    Complexity: O(groups * log max_model_len).
    """
    low, high = 0, max_model_len  # `low` fits (or is 0); nothing above `high` does
    while low < high:
        mid = (low + high + 1) // 2
        needed = max_memory_usage_bytes_from_groups(
            kv_cache_groups, max_model_len=mid, max_in_flight_tokens=max_in_flight_tokens
        )
        if needed <= available_memory:
            low = mid
        else:
            high = mid - 1
    return low


def check_enough_memory_for_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int,
) -> None:
    """vLLM 0.33's start-up check: one request of max_model_len must fit in the budget less
    one block (the null block the pool holds back).

    Raises:
        KVCacheConfigError: nothing is left after the null block, or the request does not fit;
            the message names the GiB needed and left and the largest max_model_len that fits.
        InvalidArgumentError: as `kv_cache_bytes_per_block`, or a limit < 1.

    Complexity: O(groups * log max_model_len).
    """
    require_int("check_enough_memory_for_groups", "available_memory", available_memory)
    require_int("check_enough_memory_for_groups", "max_model_len", max_model_len, 1)
    require_int("check_enough_memory_for_groups", "max_in_flight_tokens", max_in_flight_tokens, 1)
    usable = available_memory - kv_cache_bytes_per_block(kv_cache_groups)
    if usable <= 0:
        raise KVCacheConfigError(
            f"no memory is left for the KV cache after the null block ({available_memory:,} "
            f"bytes in all); raise gpu_memory_utilization or free device memory"
        )
    limits = {"max_model_len": max_model_len, "max_in_flight_tokens": max_in_flight_tokens}
    needed = max_memory_usage_bytes_from_groups(kv_cache_groups, **limits)
    if needed <= usable:
        return
    largest = estimate_max_model_len_from_groups(kv_cache_groups, usable, **limits)
    fits = (
        f"the largest max_model_len that fits is {largest:,}"
        if largest
        else "not even max_model_len=1 fits"
    )
    raise KVCacheConfigError(
        f"one request of max_model_len={max_model_len:,} needs {needed / GiB:.2f} GiB "
        f"({needed:,} bytes) of KV cache, more than the {usable / GiB:.2f} GiB ({usable:,} "
        f"bytes) left after the null block; {fits}. Raise gpu_memory_utilization or lower "
        f"max_model_len."
    )


def get_grouped_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_in_flight_tokens: int | None = None,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    """One worker's KV cache config as vLLM 0.33 builds it, hybrid models in several groups.

    Steps: `get_kv_cache_groups`; with `num_blocks_override` the budget becomes that many
    blocks; `check_enough_memory_for_groups`; `num_blocks = available_memory //
    kv_cache_bytes_per_block`; `get_kv_cache_config_from_groups`.

    Args:
        kv_cache_specs: layer name -> spec, in model order (not changed).
        available_memory: bytes for the KV cache on this worker.
        max_model_len: the longest request (>= 1).
        max_in_flight_tokens: tokens scheduled but not yet computed at once, what windowed and
            chunked layers keep beyond their window (vLLM 0.33's `max_in_flight_tokens`:
            max_num_batched_tokens times the batches in flight, 2 with its default async
            scheduling); None means max_model_len.
        num_blocks_override: use this many blocks (>= 1) instead of the budget's.

    Raises:
        KVCacheConfigError: layers that cannot be grouped (see `get_kv_cache_groups`), or not
            enough memory (see `check_enough_memory_for_groups`).
        InvalidArgumentError: a limit or the override < 1, or a budget that is not an int.

    Complexity: O(num_layers + groups * log max_model_len).
    """
    call = "get_grouped_kv_cache_config"
    require_int(call, "available_memory", available_memory)
    require_int(call, "max_model_len", max_model_len, 1)
    in_flight = (
        max_model_len
        if max_in_flight_tokens is None
        else require_int(call, "max_in_flight_tokens", max_in_flight_tokens, 1)
    )
    if num_blocks_override is not None and (
        not isinstance(num_blocks_override, int)
        or isinstance(num_blocks_override, bool)
        or num_blocks_override < 1
    ):
        raise InvalidArgumentError(
            f"num_blocks_override must be an int >= 1, got {num_blocks_override!r}"
        )
    groups = get_kv_cache_groups(kv_cache_specs)
    per_block = kv_cache_bytes_per_block(groups)
    if num_blocks_override is not None:
        available_memory = num_blocks_override * per_block
    check_enough_memory_for_groups(
        groups, available_memory, max_model_len=max_model_len, max_in_flight_tokens=in_flight
    )
    return get_kv_cache_config_from_groups(groups, available_memory // per_block)


def max_concurrency(
    config: KVCacheConfig, *, max_model_len: int, max_in_flight_tokens: int
) -> float:
    """Requests of max_model_len the pool holds at once, as vLLM 0.33 logs it
    (`get_max_concurrency_for_kv_cache_config`): num_blocks over the blocks one request holds
    in all groups together (the null block counted in num_blocks, as vLLM counts it).

    Complexity: O(groups).
    """
    require_instance("max_concurrency", "config", config, KVCacheConfig)
    limits = {"max_model_len": max_model_len, "max_in_flight_tokens": max_in_flight_tokens}
    total = sum(blocks_per_request(group, **limits) for group in config.kv_cache_groups)
    return config.num_blocks / total
