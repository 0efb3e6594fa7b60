"""Which vLLM configurations pagedkv can serve or shadow, and the translation of vLLM's
`KVCacheConfig` into pagedkv's.

A configuration outside the domain is refused as a whole, when the engine starts, by feature
name: replace mode raises `OutOfDomainError`; shadow mode leaves vLLM's manager alone and says
why. Nothing is served halfway. vLLM objects are read by attribute and typed `Any`: pagedkv
never imports vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedkv.vocab.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

SHADOW_HINT = (
    "PAGEDKV_VLLM=shadow keeps vLLM's own manager serving and reports what pagedkv cannot mirror"
)


class OutOfDomainError(RuntimeError):
    """A vLLM feature pagedkv's manager does not model, named, with the way out."""

    def __init__(self, feature: str, detail: str, *, replace: bool = True) -> None:
        self.feature = feature
        self.detail = detail
        hint = f"; {SHADOW_HINT}" if replace else ""
        super().__init__(f"pagedkv does not serve {feature}: {detail}{hint}")


def config_refusals(vllm_config: Any, *, replace: bool) -> Iterator[OutOfDomainError]:
    """The features of an engine configuration pagedkv's manager does not model (scheduler
    calls or arguments it has no rule for), each once."""

    def refuse(feature: str, detail: str) -> OutOfDomainError:
        return OutOfDomainError(feature, detail, replace=replace)

    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        yield refuse("KV connectors", "kv_transfer_config is set (external KV, offloading)")
    scheduler = vllm_config.scheduler_config
    if getattr(scheduler, "async_scheduling", False):
        yield refuse("asynchronous scheduling", "scheduler_config.async_scheduling is on")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        yield refuse("pipeline parallelism", "several batches in flight defer block frees")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            yield refuse("context parallelism", f"parallel_config.{name} > 1")
    model = vllm_config.model_config
    if getattr(model, "is_encoder_decoder", False):
        yield refuse("encoder-decoder models", "cross-attention blocks and encoder tokens")
    if getattr(vllm_config, "speculative_config", None) is not None:
        yield refuse(
            "speculative decoding", "lookahead slots and EAGLE were not run inside vLLM's engine"
        )
    if getattr(scheduler, "watermark", 0.0):
        yield refuse("the admission watermark", "scheduler_config.watermark > 0")
    events = getattr(vllm_config, "kv_events_config", None)
    if replace and events is not None and getattr(events, "enable_kv_cache_events", False):
        yield refuse("KV cache events", "pagedkv's events are not yet vLLM's (one per block)")


def pagedkv_spec(spec: Any) -> KVCacheSpec:
    """pagedkv's spec of one vLLM group spec of the kinds it serves.

    Raises:
        OutOfDomainError: any other kind (MLA variants with a window, encoder-only,
            cross-attention, sink, HiSparse ...), named by its class; a Mamba spec with what
            `pagedkv_mamba_spec` refuses.
    """
    kind = type(spec).__name__
    if kind == "MambaSpec":
        return pagedkv_mamba_spec(spec)
    common = {
        "block_size": spec.block_size,
        "num_kv_heads": getattr(spec, "num_kv_heads", 1),
        "head_size": getattr(spec, "head_size", 1),
        "dtype": _dtype_name(getattr(spec, "dtype", "float16")),
    }
    if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
        # A full-attention spec that records a window or a chunk (vLLM's layers when the
        # hybrid allocator is off) is still managed as full attention.
        return FullAttentionSpec(**common, use_mla=kind == "MLAAttentionSpec")
    if kind == "SlidingWindowSpec" and not getattr(spec, "extra_retained_tokens", 0):
        return SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
    if kind == "ChunkedLocalAttentionSpec":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.attention_chunk_size)
    raise OutOfDomainError(
        f"{kind} layers",
        "pagedkv serves full attention, sliding window, chunked local and Mamba states",
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


MAMBA_UNMODELLED = (
    ("num_speculative_blocks", 0, "Mamba speculative state blocks"),
    ("num_prefill_checkpoint_blocks", 0, "Mamba prefill checkpoint blocks"),
    ("prefill_checkpoint_alignment", None, "Mamba prefill checkpoint alignment"),
)
"""vLLM `MambaSpec` fields pagedkv's manager has no rule for beyond the value it models
(field, the value served, the feature refused): each changes which blocks a request holds."""


def pagedkv_mamba_spec(spec: Any) -> MambaSpec:
    """pagedkv's `MambaSpec` of vLLM's: the same block size, state shapes and dtypes, padded
    page, cache mode ("align" or "none") and backend (`mamba_type`, vLLM's enum member named in
    lower case: `GDN_ATTN` -> "gdn_attn"). vLLM's fields that only its workers read (heads,
    tensor-parallel replication) are not carried.

    Raises:
        OutOfDomainError: speculative or prefill-checkpoint blocks (`MAMBA_UNMODELLED`), or a
            cache mode pagedkv does not know.
    """
    for name, served, feature in MAMBA_UNMODELLED:
        value = getattr(spec, name, served)
        if value != served:
            raise OutOfDomainError(feature, f"MambaSpec.{name}={value!r}")
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode not in ("align", "none"):
        raise OutOfDomainError(
            f"mamba_cache_mode {mode!r}", "pagedkv models Mamba states in 'align' and 'none'"
        )
    backend = getattr(spec, "mamba_type", "mamba2")
    return MambaSpec(
        block_size=spec.block_size,
        shapes=tuple(tuple(shape) for shape in spec.shapes),
        dtypes=tuple(_dtype_name(dtype) for dtype in spec.dtypes),
        page_size_padded=getattr(spec, "page_size_padded", None),
        mamba_type=str(getattr(backend, "name", backend)).lower(),
        mamba_cache_mode=mode,
    )


def manager_refusals(vllm_manager: Any, *, replace: bool) -> Iterator[OutOfDomainError]:
    """The features vLLM's built manager turned on that pagedkv does not model: partial hash
    hits (a `prefix_match_unit` below a Mamba block, with copy-on-write of Mamba states) and
    the Mamba shared-prefix checkpoint. vLLM's scheduler reads both from its manager when it is
    built, before the plugin substitutes it."""
    coordinator = getattr(vllm_manager, "coordinator", None)
    if getattr(coordinator, "enable_partial_hash_hits", False):
        yield OutOfDomainError(
            "partial hash hits",
            "coordinator.enable_partial_hash_hits (a prefix_match_unit below the Mamba block)",
            replace=replace,
        )
    if getattr(vllm_manager, "mamba_shared_prefix_checkpoint", False):
        yield OutOfDomainError(
            "the Mamba shared-prefix checkpoint",
            "enable_mamba_shared_prefix_checkpoint is on",
            replace=replace,
        )


def pagedkv_config(config: Any) -> KVCacheConfig:
    """pagedkv's `KVCacheConfig` of vLLM's: the same groups, layers and block count, and the
    retention interval. Each layer gets a tensor of its own sized for `num_blocks` pages:
    the manager reads only the groups and the count (vLLM's workers keep their own layout).

    Raises:
        OutOfDomainError: a group pagedkv does not serve (`pagedkv_spec`), groups of several
            block sizes (a Mamba group in mode "none" beside attention), a hash block size
            other than the block size, or host-resident groups.
    """
    groups: list[KVCacheGroupSpec] = []
    tensors: dict[str, KVCacheTensor] = {}
    for group in config.kv_cache_groups:
        if getattr(group, "host_resident", False):
            raise OutOfDomainError("host-resident KV cache groups", "HiSparse")
        spec = pagedkv_spec(group.kv_cache_spec)
        names = tuple(group.layer_names)
        groups.append(KVCacheGroupSpec(names, spec))
        page = spec.page_size_bytes if isinstance(spec, AttentionSpec | MambaSpec) else 1
        for name in names:
            tensors[name] = KVCacheTensor(size=page * config.num_blocks)
    sizes = sorted({group.kv_cache_spec.block_size for group in groups})
    if len(sizes) > 1:
        raise OutOfDomainError("KV cache groups of several block sizes", f"block sizes {sizes}")
    hash_block_size = getattr(config, "hash_block_size", None)
    if hash_block_size not in (None, sizes[0]):
        raise OutOfDomainError(
            "a hash block size other than the block size",
            f"hash_block_size {hash_block_size}, block_size {sizes[0]}",
        )
    sparse = any(
        isinstance(spec, SlidingWindowSpec)
        or (isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align")
        for spec in (group.kv_cache_spec for group in groups)
    )
    retention = getattr(config, "prefix_cache_retention_interval", None)
    return KVCacheConfig(
        config.num_blocks,
        tensors,
        groups,
        # Only a window group or a Mamba group in "align" acts on it; vLLM's engine sets it
        # for every model.
        prefix_cache_retention_interval=retention if sparse else None,
    )
