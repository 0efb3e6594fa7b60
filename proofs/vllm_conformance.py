"""Check vLLM 0.8.5's own BlockPool and KVCacheManager against pagedkv's spec (on demand).

SEMANTICS.md claims pagedkv's spec, under `VLLM_0_8_5` semantics, is vLLM 0.8.5's behaviour.
This script puts the claim to the test with vLLM's code itself: it downloads the vllm 0.8.5 wheel
(no dependencies), extracts the five modules the KV cache manager is made of into a cache
directory, gives them minimal stand-ins for the rest of vllm (logger, utils, config, request and
stats types), and runs the differential campaigns of `pagedkv verify` with vLLM's classes as the
implementation under test: valid calls only (vLLM leaves misuse undefined), no cache salts.
Nothing of vLLM is committed to this repository; it is fetched at run time.

    .venv/bin/python -m proofs.vllm_conformance [--steps N] [--cache DIR]

Exit status: 0 no divergence, 1 a divergence (with the shrunk sequence), 2 vLLM unavailable.
Both sides must derive NONE_HASH from the same PYTHONHASHSEED; the script re-runs itself with
one set if needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

VLLM_VERSION = "0.8.5"
VLLM_MODULES = (
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/specialized_manager.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/kv_cache_interface.py",
)
# Stand-ins for the parts of vllm those modules import; written here, not taken from vLLM.
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


def fetch_vllm(cache: Path) -> Path:
    """A directory holding vLLM's KV cache modules and the stand-ins; downloaded once."""
    root = cache / f"vllm-{VLLM_VERSION}-kv"
    if (root / VLLM_MODULES[-1]).exists():
        return root
    wheels = cache / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"vllm=={VLLM_VERSION}",
            "--no-deps",
            "-q",
            "-d",
            str(wheels),
        ],
        check=True,
    )
    (wheel,) = wheels.glob(f"vllm-{VLLM_VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in VLLM_MODULES:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
    for name, text in STAND_INS.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


class VllmRequest:
    """pagedkv's Request as vLLM's code reads it (lora_request, sampling_params, status)."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self.lora_request = (
            None if request.lora_id is None else SimpleNamespace(lora_int_id=request.lora_id)
        )
        self.sampling_params = SimpleNamespace(
            prompt_logprobs=1 if request.prompt_logprobs else None
        )
        self.status = sys.modules["vllm.v1.request"].RequestStatus.RUNNING

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _views() -> Any:
    views: dict[int, VllmRequest] = {}

    def view(request: Any) -> VllmRequest:
        found = views.get(id(request))
        if found is None or found._request is not request:
            found = views[id(request)] = VllmRequest(request)
        return found

    return view


def make_factories() -> tuple[Any, Any]:
    """Pool and manager factories over vLLM's classes (vLLM must be importable)."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    from pagedkv.harness.adapters import ObjectManagerAdapter, ObjectPoolAdapter
    from pagedkv.kv_cache_interface import SlidingWindowSpec as OurSlidingWindowSpec
    from pagedkv.prefix_cache_stats import PrefixCacheStats

    class VllmPool(ObjectPoolAdapter):
        def __init__(self, pool: Any) -> None:
            super().__init__(pool)
            self.view = _views()

        def cache_full_blocks(self, request: Any, *args: Any) -> None:
            super().cache_full_blocks(self.view(request), *args)

    class VllmManager(ObjectManagerAdapter):
        def __init__(self, manager: Any) -> None:
            super().__init__(manager)
            self.view = _views()

        def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
            return super().get_computed_blocks(self.view(request))

        def allocate_slots(
            self,
            request: Any,
            num_tokens: int,
            new_computed_blocks: Sequence[int] | None = None,
            num_lookahead_tokens: int = 0,
        ) -> list[int] | None:
            return super().allocate_slots(
                self.view(request), num_tokens, new_computed_blocks, num_lookahead_tokens
            )

        def free(self, request: Any) -> None:
            super().free(self.view(request))

        def free_block_hashes(self, request: Any) -> None:
            super().free_block_hashes(self.view(request))

        def get_num_common_prefix_blocks(self, request: Any, num_running_requests: int) -> int:
            return super().get_num_common_prefix_blocks(self.view(request), num_running_requests)

        def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
            stats = self.manager.make_prefix_cache_stats()
            if stats is None:
                return None
            return PrefixCacheStats(stats.reset, stats.requests, stats.queries, stats.hits)

    def vllm_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Any) -> Any:
        return VllmPool(BlockPool(num_gpu_blocks, enable_caching))

    def vllm_manager(config: Any) -> Any:
        ours = config.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        common = {
            "block_size": ours.block_size,
            "num_kv_heads": ours.num_kv_heads,
            "head_size": ours.head_size,
            "dtype": getattr(torch, ours.dtype),
            "use_mla": ours.use_mla,
        }
        spec = (
            SlidingWindowSpec(**common, sliding_window=ours.sliding_window)
            if isinstance(ours, OurSlidingWindowSpec)
            else FullAttentionSpec(**common)
        )
        num_blocks = config.kv_cache_config.num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks,
            {"layers.0": KVCacheTensor(spec.page_size_bytes * num_blocks)},
            [KVCacheGroupSpec(["layers.0"], spec)],
        )
        return VllmManager(
            KVCacheManager(
                kv_cache_config,
                config.max_model_len,
                config.enable_caching,
                config.caching_hash_algo,
                config.use_eagle,
                config.log_stats,
            )
        )

    return vllm_pool, vllm_manager


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps per campaign")
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "pagedkv", help="download cache"
    )
    args = parser.parse_args(argv)
    if "PYTHONHASHSEED" not in os.environ:  # NONE_HASH must be the same on both sides
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        command = [sys.executable, "-m", "proofs.vllm_conformance", *(argv or sys.argv[1:])]
        return subprocess.run(command, env=env, check=False).returncode
    try:
        sys.path.insert(0, str(fetch_vllm(args.cache)))
        pool_factory, manager_factory = make_factories()
    except (subprocess.CalledProcessError, ImportError, OSError) as error:
        print(f"vllm {VLLM_VERSION} is not available here: {error}", file=sys.stderr)
        return 2

    from pagedkv.harness.campaign import run_campaign
    from pagedkv.harness.lockstep import CampaignStats
    from pagedkv.harness.manager_machine import make_manager_machine
    from pagedkv.harness.pool_machine import make_pool_machine
    from pagedkv.harness.verify import Campaign, format_report
    from pagedkv.semantics import VLLM_0_8_5

    logging.getLogger().setLevel(logging.ERROR)  # vLLM logs each refused reset
    campaigns = []
    stats = CampaignStats()
    machine: Any = make_pool_machine(pool_factory, semantics=VLLM_0_8_5, misuse=False, stats=stats)
    campaigns.append(("block pool", machine, stats))
    for sliding in (False, True):
        stats = CampaignStats()
        machine = make_manager_machine(
            manager_factory,
            sliding_window=sliding,
            semantics=VLLM_0_8_5,
            misuse=False,
            stats=stats,
        )
        kind = "sliding window" if sliding else "full attention"
        campaigns.append((f"KV cache manager, {kind}", machine, stats))
    for layer, machine, stats in campaigns:
        result = run_campaign(machine, stats, max_steps=args.steps, max_seconds=None)
        campaign = Campaign(
            layer, f"vllm {VLLM_VERSION}", VLLM_0_8_5, False, machine, stats, args.steps
        )
        print(format_report(campaign, result), flush=True)
        if not result.ok:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
