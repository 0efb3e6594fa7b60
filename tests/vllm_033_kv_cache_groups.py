"""vLLM 0.33.0's own KV cache planning (`vllm/v1/core/kv_cache_planning.py`) on given layers.

    python tests/vllm_033_kv_cache_groups.py < cases.json

Each case on stdin names a model's layers (`kinds`: "full", "sliding" or "chunked" per layer;
`sliding_window`, `attention_chunk_size`, `block_size`, `num_kv_heads`, `head_size`, `dtype`, and
per-layer `block_sizes` or `num_kv_heads_per_layer` to vary pages) and the limits
(`max_model_len`, `max_num_batched_tokens`, `available_memory`, `disable_hybrid`). This fetches
the planning module beside the modules `pagedkv verify --against vllm==0.33.0` already loads,
runs vLLM's `get_global_kv_cache_groups`, `get_kv_cache_configs` and
`get_max_concurrency_for_kv_cache_config` on vLLM's own specs for those layers (async
scheduling on, its default: two batches in flight), and prints one JSON line: per case the groups
(kind, block size, layers), `num_blocks`, the tensors (size, layers) and the max concurrency,
or the error vLLM raised. `tests/test_kv_cache_groups.py` compares pagedkv's plans with it.
Exit status 3: the package index is unreachable and nothing is cached.
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace
from typing import Any

from vllm_campaign import UNREACHABLE, _unreachable

from pagedkv.harness.vllm.engine_0_33 import ASYNC_SCHEDULING_BATCHES
from pagedkv.harness.vllm.stand_ins_0_33 import PLANNING_MODULES, PLANNING_STAND_INS
from pagedkv.harness.vllm.views import torch_or_stand_in
from pagedkv.harness.vllm.wheel import FetchError, source_tree


def vllm_config(case: dict[str, Any], layout: Any) -> Any:
    """The fields of a `VllmConfig` that vLLM's planning reads, for `case`."""
    batched = case["max_num_batched_tokens"]
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=case.get("disable_hybrid", False),
            max_num_batched_tokens=batched,
        ),
        model_config=SimpleNamespace(
            max_model_len=case["max_model_len"],
            original_max_model_len=case["max_model_len"],
            supports_kv_cache_grouping=False,
        ),
        cache_config=SimpleNamespace(
            num_gpu_blocks_override=case.get("num_gpu_blocks_override"),
            prefix_cache_retention_interval=None,
            get_resolved_kv_cache_layout=lambda: layout,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        speculative_config=None,
        num_prefill_lookahead_tokens=0,
        device_config=SimpleNamespace(device_type="cuda"),
        max_in_flight_tokens=ASYNC_SCHEDULING_BATCHES * batched,
    )


def layer_specs(case: dict[str, Any], interface: Any, torch: Any) -> dict[str, Any]:
    """vLLM's spec of each layer of `case`, named `layers.{i}`."""
    specs = {}
    for index, kind in enumerate(case["kinds"]):
        common = {
            "block_size": case.get("block_sizes", {}).get(str(index), case["block_size"]),
            "num_kv_heads": case.get("num_kv_heads_per_layer", {}).get(
                str(index), case["num_kv_heads"]
            ),
            "head_size": case["head_size"],
            "dtype": getattr(torch, case["dtype"]),
        }
        if kind == "sliding":
            spec = interface.SlidingWindowSpec(**common, sliding_window=case["sliding_window"])
        elif kind == "chunked":
            spec = interface.ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=case["attention_chunk_size"]
            )
        else:
            spec = interface.FullAttentionSpec(**common)
        specs[f"layers.{index}"] = spec
    return specs


def kind_of(spec: Any, interface: Any) -> str:
    if isinstance(spec, interface.SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, interface.ChunkedLocalAttentionSpec):
        return "chunked"
    return "full"


def plan(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's groups, config and concurrency for `case`, or the error it raised."""
    from vllm.v1 import kv_cache_interface as interface
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_layout import KVCacheLayout

    torch = torch_or_stand_in()
    config = vllm_config(case, KVCacheLayout.LBHNC)
    specs = layer_specs(case, interface, torch)
    try:
        groups = planning.get_global_kv_cache_groups(config, [dict(specs)])
        (built,) = planning.get_kv_cache_configs(
            config, [specs], [case["available_memory"]], groups
        )
    except (ValueError, NotImplementedError, AssertionError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {
        "groups": [
            {
                "kind": kind_of(group.kv_cache_spec, interface),
                "block_size": group.kv_cache_spec.block_size,
                "layers": list(group.layer_names),
            }
            for group in built.kv_cache_groups
        ],
        "num_blocks": built.num_blocks,
        "tensors": [
            {"size": tensor.size, "layers": list(tensor.layers), "offset": tensor.offset}
            for tensor in built.kv_cache_tensors
        ],
        "max_concurrency": get_max_concurrency_for_kv_cache_config(config, built),
    }


def main() -> int:
    cases = json.load(sys.stdin)
    try:
        root = source_tree("0.33.0", PLANNING_MODULES, PLANNING_STAND_INS)
    except FetchError as error:
        print(json.dumps({"setup_error": str(error)}))
        return UNREACHABLE if _unreachable(error) else 2
    sys.path.insert(0, str(root))
    logging.getLogger("vllm").setLevel(logging.ERROR)
    print(json.dumps([plan(case) for case in cases]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
