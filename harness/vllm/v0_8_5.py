"""vLLM 0.8.5's own `BlockPool` and `KVCacheManager` as a pool and a manager under test.

The five modules vLLM 0.8.5's KV cache manager is made of are fetched from its wheel
(`pagedkv.harness.vllm.wheel`); the few parts of vllm they import (logger, utils, config, the
request and stats types) are replaced by the stand-ins below, written for this purpose. The
adapters translate pagedkv's `Request` into the attributes vLLM reads and vLLM's block objects
into ids (`ObjectPoolAdapter`, `FlatObjectManagerAdapter`); its manager answers in flat lists, one
KV cache group's, which `OneGroupAdapter` makes one list per group, as the harness speaks.

Hash seeding: vLLM and pagedkv each seed every hash chain with a `NONE_HASH` that is random per
process unless PYTHONHASHSEED is set. `load()` sets vLLM's to pagedkv's, so both chains start
from the same value in any process, with or without PYTHONHASHSEED.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.harness.adapters import FlatObjectManagerAdapter, ObjectPoolAdapter, OneGroupAdapter
from pagedkv.harness.domain import Domain
from pagedkv.harness.protocol import ManagerConfig
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.vllm.engine_0_33 import Loaded
from pagedkv.harness.vllm.views import RequestViews, torch_or_stand_in, vllm_attention_spec
from pagedkv.vocab.hashes import NONE_HASH
from pagedkv.vocab.kv_cache_interface import AttentionSpec
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics

VERSION = "0.8.5"
MODULES = (
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/specialized_manager.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/kv_cache_interface.py",
)
STAND_INS = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/metrics/__init__.py": "",
    "vllm/logger.py": "import logging\n\ninit_logger = logging.getLogger\n",
    "vllm/config.py": "class VllmConfig:\n    pass\n",
    "vllm/utils.py": (
        "import hashlib, pickle\n\n"
        "GiB_bytes = 1 << 30\n\n"
        "def cdiv(a, b):\n    return -(a // -b)\n\n"
        "def sha256(obj):\n"
        "    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)\n"
        "    return int.from_bytes(hashlib.sha256(data).digest(), 'big')\n\n"
        "def get_dtype_size(dtype):\n    return dtype.itemsize\n"
    ),
    "vllm/v1/metrics/stats.py": (
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass PrefixCacheStats:\n"
        "    reset: bool = False\n    requests: int = 0\n    queries: int = 0\n    hits: int = 0\n"
    ),
    "vllm/v1/request.py": (
        "import enum\n\n"
        "class RequestStatus(enum.Enum):\n    RUNNING = 1\n\n"
        "class Request:\n    pass\n"
    ),
}
HASH_SEEDING = "vLLM's NONE_HASH set to pagedkv's"
LOGGERS = ("vllm",)
DOMAIN = Domain(min_window_over_block=4, cache_salts=False, max_groups=1)
"""Outside it vLLM 0.8.5 differs from every semantics of the spec (docs/semantics.md): it has one
KV cache group only (no hybrid manager), no cache salt, and it fails an internal assert when a
sliding window skips the parent of the next block to cache: the computed tokens may run ahead of
the cached blocks by a block less one token plus the drafts a step accepts (the client accepts
at most 3), so a window narrower than `block_size + 4` can skip that parent. Real windows are far
wider than a block plus a few drafts."""
"""vLLM logs a warning for every refused prefix-cache reset: thousands in a campaign."""


class VllmRequest:
    """pagedkv's `Request` as vLLM 0.8.5 reads it: `lora_request`, `sampling_params`, `status`.

    Everything else (tokens, computed tokens, drafts, multimodal ranges) is read through to the
    wrapped request, so the view always shows its current state.
    """

    def __init__(self, request: Request, running_status: object) -> None:
        self.request = request
        self.lora_request = (
            None if request.lora_id is None else SimpleNamespace(lora_int_id=request.lora_id)
        )
        self.sampling_params = SimpleNamespace(
            prompt_logprobs=1 if request.prompt_logprobs else None
        )
        self.status = running_status

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


def request_views(running_status: object) -> RequestViews[VllmRequest]:
    return RequestViews(lambda request: VllmRequest(request, running_status))


class Vllm085Pool(ObjectPoolAdapter):
    """vLLM 0.8.5's `BlockPool` through block ids; requests are shown as vLLM reads them."""

    def __init__(self, pool: Any, views: RequestViews[VllmRequest]) -> None:
        super().__init__(pool)
        self.views = views

    def cache_full_blocks(self, request: Request, *args: Any) -> None:
        super().cache_full_blocks(self.views(request), *args)  # type: ignore[arg-type]


class Vllm085Manager(FlatObjectManagerAdapter):
    """vLLM 0.8.5's `KVCacheManager` through flat lists of block ids and pagedkv requests."""

    def __init__(self, manager: Any, views: RequestViews[VllmRequest]) -> None:
        super().__init__(manager)
        self.views = views

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return super().get_computed_blocks(self.views(request))  # type: ignore[arg-type]

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """The gate's and the connector's keywords reach vLLM 0.8.5 (which has neither, and
        refuses them) only if given: its factory does not offer them."""
        view: Any = self.views(request)
        return super().allocate_slots(
            view,
            num_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
        )

    def free(self, request: Request) -> None:
        super().free(self.views(request))  # type: ignore[arg-type]

    def free_block_hashes(self, request: Request) -> None:
        super().free_block_hashes(self.views(request))  # type: ignore[arg-type]

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        view: Any = self.views(request)
        return super().get_num_common_prefix_blocks(view, num_running_requests)

    def make_prefix_cache_stats(self) -> Any:
        """vLLM 0.8.5's own stats record: block counts, no token counts (so the client compares
        the block counts only)."""
        return self.manager.make_prefix_cache_stats()


def load(semantics: Semantics, root: Path, settings: Sequence[str]) -> Loaded:
    """Pool and manager factories over vLLM 0.8.5's classes (its tree, at `root`, must be on
    sys.path). Its manager takes its arguments by hand, as 0.8.5's engine gives them: there is
    no engine setting to choose.

    Raises:
        SetupError: `settings` given.
    """
    if settings:
        raise SetupError(
            "--vllm-setting applies to vllm 0.33.0's engine configuration; vllm 0.8.5's manager "
            "takes no setting pagedkv does not already draw"
        )
    torch = torch_or_stand_in()  # before vLLM's modules import it
    from vllm.v1 import kv_cache_interface as interface
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv_cache_utils.NONE_HASH = NONE_HASH  # one seed for both hash chains (see the docstring)
    running = sys.modules["vllm.v1.request"].RequestStatus.RUNNING

    def vllm_pool(num_gpu_blocks: int, enable_caching: bool, _: Semantics) -> Vllm085Pool:
        return Vllm085Pool(BlockPool(num_gpu_blocks, enable_caching), request_views(running))

    def vllm_manager(config: ManagerConfig) -> OneGroupAdapter:
        ours = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        assert isinstance(ours, AttentionSpec), "the harness builds attention specs only"
        spec = vllm_attention_spec(config, interface, torch, use_mla=ours.use_mla)
        num_blocks = config.kv_cache_config.num_blocks
        kv_cache_config = interface.KVCacheConfig(
            num_blocks,
            {"layers.0": interface.KVCacheTensor(spec.page_size_bytes * num_blocks)},
            [interface.KVCacheGroupSpec(["layers.0"], spec)],
        )
        manager = KVCacheManager(
            kv_cache_config,
            config.max_model_len,
            config.enable_caching,
            config.caching_hash_algo,
            config.use_eagle,
            config.log_stats,
        )
        return OneGroupAdapter(Vllm085Manager(manager, request_views(running)))

    return Loaded(vllm_pool, vllm_manager, DOMAIN)
