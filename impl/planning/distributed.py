"""Make the workers of a torch.distributed job agree on one KV cache config.

Each rank plans its own config from its own free memory; one manager then hands out block ids
for all of them, so every rank must have the same specs and use the smallest `num_blocks`. This
is `unify_kv_cache_configs` done over the process group instead of in one process. torch is
imported only when `unify_num_blocks` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.planning.kv_cache_config import check_kv_cache_groups_match, sorted_kv_cache_groups
from pagedkv.vocab.errors import KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _as_groups(rank: int, gathered: Any) -> tuple[KVCacheGroupSpec, ...]:
    if not isinstance(gathered, tuple) or not all(
        isinstance(group, KVCacheGroupSpec) for group in gathered
    ):
        raise KVCacheConfigError(f"rank {rank} sent no KV cache groups but {gathered!r}")
    return gathered


def unify_num_blocks(config: KVCacheConfig, group: ProcessGroup | None = None) -> KVCacheConfig:
    """This rank's config with every rank's specs checked equal and the minimum `num_blocks`.

    A collective: every rank of `group` must call it. First each rank's groups (sorted by type
    id) are all-gathered and compared on every rank, so a mismatch raises the same error on all
    of them, before any rank enters the next collective; then `num_blocks` is all-reduced with
    MIN. Tensors are kept: only their first `num_blocks` pages will be used. With the NCCL
    backend the reduction runs on the current CUDA device, otherwise on the CPU.

    Args:
        config: this rank's config, e.g. from `get_kv_cache_config` (not changed).
        group: the process group; None means the default (world) group.

    Returns:
        A new config: this rank's tensors, groups sorted by type id, the minimum `num_blocks`.

    Raises:
        KVCacheConfigError: torch.distributed is not initialized, or the ranks' specs differ
            (the message names the ranks, a layer of each, and both specs; see
            `check_kv_cache_groups_match`, where "worker" means the rank in `group`).

    Complexity: two collectives; O(ranks * groups) to compare.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise KVCacheConfigError(
            "unify_num_blocks needs an initialized torch.distributed process group; "
            "in one process use unify_kv_cache_configs"
        )
    groups = sorted_kv_cache_groups(config)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, groups, group=group)
    check_kv_cache_groups_match([_as_groups(rank, item) for rank, item in enumerate(gathered)])

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    num_blocks = torch.tensor([config.num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=group)
    return KVCacheConfig(int(num_blocks.item()), config.tensors, groups)
