"""vLLM 0.33.0's own planning of a Mamba hybrid, from transformers' config of the model.

    python tests/vllm_033_mamba_plan.py < cases.json

Each case on stdin gives a config.json (`config`, read by transformers' config class) and what
vLLM would be started with: `dtype` (the model dtype, resolved), `cache_dtype`,
`mamba_cache_dtype`, `mamba_ssm_cache_dtype`, `block_size`, `prefix_caching`,
`gdn_prefill_backend`, `tensor_parallel_size`, `max_model_len`, `available_memory` and
`num_gpu_blocks_override`. For each case this runs vLLM 0.33.0's own code, fetched from its
wheel (`pagedkv.harness.vllm.wheel`):

- the model's hooks (`MambaModelConfig`, `NemotronHForCausalLMConfig`, models/config.py);
- its state shapes and dtypes: the model class's `get_mamba_state_shape_from_config` and
  `get_mamba_state_dtype_from_config` (models/*.py), over `MambaStateShapeCalculator` and
  `MambaStateDtypeCalculator` (mamba_utils.py);
- the platform's block-size alignment (`update_block_size_for_backend`,
  `_align_hybrid_block_size`, platforms/interface.py) with FlashAttention's kernel block sizes
  on Hopper (`[MultipleOf(16)]`) and `AttentionBackend`'s own block-size methods;
- each Mamba layer's spec (`MambaBase.get_kv_cache_spec`, mamba/abstract.py, with the changes
  `MambaMixer2` and Qwen's gated delta net make to it), each attention layer's
  `FullAttentionSpec` as `Attention.get_kv_cache_spec` builds it;
- `get_global_kv_cache_groups`, `get_kv_cache_configs` and `get_kv_cache_capacity`.

Methods are taken from the wheel's source text (`ast`) and run as they are; what they call
that is not planning (the layer registry, the current config, the model registry, the backend
class) is a stand-in written here, named as such. Which layers attend and which keep a state,
and each attention layer's heads, follow the model files (cited at `layers`). It prints one
JSON line: per case the block size, the Mamba page, the state shapes and dtypes, the groups,
`num_blocks`, the max concurrency and the KV cache size in tokens, or the error vLLM raised.
`tests/test_mamba_plan.py` compares pagedkv's plans with it. Exit status 3: the package index is
unreachable and nothing is cached.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_033_kv_cache_groups import PLANNING_MODULES, PLANNING_STAND_INS, vllm_config
from vllm_campaign import UNREACHABLE, _unreachable

from pagedkv.harness.vllm.views import torch_or_stand_in
from pagedkv.harness.vllm.wheel import FetchError, source_tree

MODEL_FILES = {
    "jamba": ("vllm/model_executor/models/jamba.py", "JambaForCausalLM"),
    "falcon_h1": ("vllm/model_executor/models/falcon_h1.py", "FalconH1ForCausalLM"),
    "nemotron_h": ("vllm/model_executor/models/nemotron_h.py", "NemotronHForCausalLM"),
    "granitemoehybrid": (
        "vllm/model_executor/models/granitemoehybrid.py",
        "GraniteMoeHybridForCausalLM",
    ),
    "qwen3_next": ("vllm/model_executor/models/qwen3_next.py", "Qwen3NextForCausalLM"),
}
# The Mamba layer class of each model: MambaMixer (Mamba-1), MambaMixer2, Qwen's gated delta net.
MAMBA_TYPES = {
    "jamba": "MAMBA1",
    "falcon_h1": "MAMBA2",
    "nemotron_h": "MAMBA2",
    "granitemoehybrid": "MAMBA2",
    "qwen3_next": "GDN_ATTN",
}
# Source files whose functions run here (read as text, never imported whole).
SOURCES = (
    *(path for path, _ in MODEL_FILES.values()),
    "vllm/model_executor/models/config.py",
    "vllm/platforms/interface.py",
    "vllm/model_executor/layers/mamba/abstract.py",
    "vllm/v1/attention/backend.py",
    "vllm/v1/attention/backends/gdn_attn.py",
    "vllm/utils/torch_utils.py",
    "vllm/distributed/utils.py",
)
RUNTIME_MODULES = (*PLANNING_MODULES, "vllm/model_executor/layers/mamba/mamba_utils.py")


def _node(source: str, name: str, within: str | None = None) -> ast.AST:
    """The top-level definition or assignment `name` of `source` (a method of class `within`)."""
    body = ast.parse(source).body
    if within is not None:
        (owner,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == within]
        body = owner.body
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
    raise LookupError(f"{name} not found{f' in {within}' if within else ''}")


def extract(source: str, *names: str, within: str | None = None) -> str:
    """The source text of `names` (methods of `within` lose their decorators: each becomes a
    plain function taking `cls` or `self` first)."""
    parts = []
    for name in names:
        node = _node(source, name, within)
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
        parts.append(ast.unparse(node))
    return "\n\n".join(parts) + "\n"


def define(source: str, filename: str, namespace: dict[str, Any]) -> None:
    """Run `source` (vLLM's own text) in `namespace`, its annotations left unevaluated as in
    vLLM's files."""
    code = compile("from __future__ import annotations\n" + source, filename, "exec")
    exec(code, namespace)


def stand_ins(sources: Path) -> dict[str, str]:
    """The planning stand-ins, and those mamba_utils.py needs, some of them vLLM's own code."""
    text = {name: (sources / name).read_text() for name in SOURCES}
    files = dict(PLANNING_STAND_INS)
    files["vllm/envs.py"] = (
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False\nVLLM_SSM_CONV_STATE_LAYOUT = None\n"
    )
    files["vllm/utils/torch_utils.py"] = (
        "from __future__ import annotations\n\nimport torch\n\n\n"
        "def get_dtype_size(dtype):\n    return dtype.itemsize\n\n\n"
        + extract(
            text["vllm/utils/torch_utils.py"],
            "STR_DTYPE_TO_TORCH_DTYPE",
            "get_kv_cache_torch_dtype",
        )
    )
    files["vllm/distributed/__init__.py"] = "from __future__ import annotations\n\n" + extract(
        text["vllm/distributed/utils.py"], "ensure_divisibility", "divide"
    )
    files["vllm/config/cache.py"] = """
MambaDType = str


class CacheConfig:
    DEFAULT_BLOCK_SIZE = 16


def get_kv_cache_dtype_handler(kv_cache_dtype):
    return None
"""
    files["vllm/config/mamba.py"] = """
import enum


class MambaBackendEnum(enum.Enum):
    TRITON = "triton"
    FLASHINFER = "flashinfer"
"""
    files["vllm/config/model.py"] = "ModelDType = str\n"
    files["vllm/v1/attention/backends/registry.py"] = """
import enum


class MambaAttentionBackendEnum(enum.Enum):
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN_ATTN = "gdn_attn"
"""
    # Stand-ins for what the alignment imports: the current config, the model registry, the
    # layers' checkpoint alignment (vLLM's own function over stand-in layers).
    files["vllm/config/vllm.py"] = """
import contextlib


@contextlib.contextmanager
def set_current_vllm_config(vllm_config):
    yield
"""
    files["vllm/model_executor/__init__.py"] = ""
    files["vllm/model_executor/layers/__init__.py"] = ""
    files["vllm/model_executor/layers/mamba/__init__.py"] = ""
    files["vllm/model_executor/models/__init__.py"] = """
class _Registry:
    current = None

    def resolve_model_cls(self, architecture, model_config=None):
        return self.current, architecture


ModelRegistry = _Registry()
"""
    files["vllm/model_executor/layers/mamba/abstract.py"] = (
        "from __future__ import annotations\n\nfrom math import lcm\n\n\n"
        "class MambaBase:\n    pass\n\n\nLAYERS = []\n\n\n"
        "def get_layers_from_vllm_config(vllm_config, layer_type):\n"
        "    return {str(i): layer for i, layer in enumerate(LAYERS)}\n\n\n"
        + extract(
            text["vllm/model_executor/layers/mamba/abstract.py"],
            "get_mamba_prefill_checkpoint_alignment",
        )
    )
    return files


def functions(sources: Path) -> dict[str, Any]:
    """vLLM's functions this script runs, by name, defined from the wheel's text."""
    text = {name: (sources / name).read_text() for name in SOURCES}
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import MambaSpec

    namespace: dict[str, Any] = {
        "logger": logging.getLogger("vllm"),
        "MambaStateShapeCalculator": MambaStateShapeCalculator,
        "MambaStateDtypeCalculator": MambaStateDtypeCalculator,
        "MambaSpec": MambaSpec,
        "MultipleOf": MultipleOf,
        "replace": replace,
        "torch": torch_or_stand_in(),
        "math": math,
        "itertools": itertools,
    }
    config = text["vllm/model_executor/models/config.py"]
    define(
        extract(config, "VerifyAndUpdateConfig", "MambaModelConfig", "NemotronHForCausalLMConfig"),
        "models/config.py",
        namespace,
    )
    platform_methods = (
        "update_block_size_for_backend",
        "_preferred_block_size_for_backends",
        "_check_aligned_block_size",
        "_align_hybrid_block_size",
    )
    define(
        extract(text["vllm/platforms/interface.py"], *platform_methods, within="Platform"),
        "platforms/interface.py",
        namespace,
    )
    backend_methods = ("get_preferred_block_size", "supports_block_size", "customize_spec")
    define(
        extract(text["vllm/v1/attention/backend.py"], *backend_methods, within="AttentionBackend"),
        "v1/attention/backend.py",
        namespace,
    )
    abstract = text["vllm/model_executor/layers/mamba/abstract.py"]
    define(
        extract(abstract, "get_kv_cache_spec", within="MambaBase").replace(
            "def get_kv_cache_spec", "def mamba_kv_cache_spec", 1
        ),
        "mamba/abstract.py",
        namespace,
    )
    define(
        extract(
            text["vllm/v1/attention/backends/gdn_attn.py"], "FLASHINFER_GDN_CHECKPOINT_ALIGNMENT"
        ),
        "v1/attention/backends/gdn_attn.py",
        namespace,
    )
    for model_type, (path, class_name) in MODEL_FILES.items():
        methods = ("get_mamba_state_dtype_from_config", "get_mamba_state_shape_from_config")
        define(extract(text[path], *methods, within=class_name), path, namespace)
        namespace[model_type] = type(
            class_name, (), {name: classmethod(namespace.pop(name)) for name in methods}
        )
    return namespace


def flash_attention(vllm: dict[str, Any]) -> type:
    """FlashAttention as vLLM 0.33 sees it on Hopper: kernel blocks of a multiple of 16 tokens
    (its `get_supported_kernel_block_sizes` without FA4's special cases), `AttentionBackend`'s
    own block-size methods and spec hook."""
    multiple_of = vllm["MultipleOf"]
    return type(
        "FlashAttentionBackend",
        (),
        {
            "get_supported_kernel_block_sizes": classmethod(lambda cls: [multiple_of(16)]),
            "get_preferred_block_size": classmethod(vllm["get_preferred_block_size"]),
            "supports_block_size": classmethod(vllm["supports_block_size"]),
            "customize_spec": classmethod(vllm["customize_spec"]),
            "get_name": classmethod(lambda cls: "FLASH_ATTN"),
            "is_ssm": classmethod(lambda cls: False),
        },
    )


def layers(model_type: str, hf_config: Any) -> list[tuple[int, str]]:
    """(layer index, "attn" or "mamba") in the order vLLM builds them: jamba.py reads
    `layers_block_type`, granitemoehybrid.py and qwen3_next.py `layer_types` ("full_attention"
    attends), nemotron_h.py `hybrid_override_pattern` ("*" attends, "M" is Mamba), and each
    Falcon-H1 layer builds its attention, then its Mamba block."""
    if model_type == "falcon_h1":
        return [(i, kind) for i in range(hf_config.num_hidden_layers) for kind in ("attn", "mamba")]
    if model_type == "nemotron_h":
        kinds = {"*": "attn", "M": "mamba"}
        return [
            (i, kinds[c]) for i, c in enumerate(hf_config.hybrid_override_pattern) if c in kinds
        ]
    given = hf_config.layers_block_type if model_type == "jamba" else hf_config.layer_types
    attends = {"attention", "full_attention"}
    return [(i, "attn" if kind in attends else "mamba") for i, kind in enumerate(given)]


def attention_head_size(model_type: str, hf_config: Any) -> int:
    """The attention layer's head size, as its model file takes it (jamba.py and
    granitemoehybrid.py: hidden_size // heads; the others: head_dim when set)."""
    by_hidden = hf_config.hidden_size // hf_config.num_attention_heads
    if model_type in ("jamba", "granitemoehybrid"):
        return by_hidden
    return getattr(hf_config, "head_dim", None) or by_hidden


def model_head_size(hf_config: Any) -> int:
    """`ModelConfig.get_head_size` (model_arch_config_convertor.py): head_dim when > 0."""
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim > 0:
        return int(head_dim)
    return int(hf_config.hidden_size // hf_config.num_attention_heads)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    yield


def plan(case: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.33's block size, specs, groups, blocks and concurrency for `case`."""
    import transformers
    from vllm.model_executor.layers.mamba import abstract
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype
    from vllm.v1 import kv_cache_interface as interface
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.kv_cache_layout import KVCacheLayout

    torch = torch_or_stand_in()
    transformers.logging.set_verbosity_error()
    hf_config = transformers.CONFIG_MAPPING[case["config"]["model_type"]].from_dict(case["config"])
    model_type = hf_config.model_type
    tp = case["tensor_parallel_size"]
    config = vllm_config(
        {**case, "max_num_batched_tokens": case["max_model_len"]}, KVCacheLayout.LBHNC
    )
    config.cache_config = SimpleNamespace(
        **vars(config.cache_config),
        block_size=case["block_size"],
        user_specified_block_size=case["block_size"] != 16,
        cache_dtype=case["cache_dtype"],
        enable_prefix_caching=case["prefix_caching"],
        mamba_cache_mode="none",
        mamba_block_size=None,
        mamba_page_size_padded=None,
        mamba_cache_dtype=case["mamba_cache_dtype"],
        mamba_ssm_cache_dtype=case["mamba_ssm_cache_dtype"],
        kv_cache_dtype_skip_layers=[],
        use_replayssm=False,
        prefix_match_unit=None,
    )
    config.model_config = SimpleNamespace(
        **vars(config.model_config),
        dtype=getattr(torch, case["dtype"]),
        hf_config=hf_config,
        hf_text_config=hf_config,
        use_mla=False,
        is_hybrid=True,
        architecture=MODEL_FILES[model_type][1],
        get_head_size=lambda: model_head_size(hf_config),
        get_num_kv_heads=lambda parallel: max(1, hf_config.num_key_value_heads // tp),
    )
    config.parallel_config.tensor_parallel_size = tp
    config.scheduler_config.enable_chunked_prefill = True
    config.num_speculative_tokens = 0
    config.additional_config = {"gdn_prefill_backend": case["gdn_prefill_backend"]}
    # the hooks vLLM runs for these architectures (VllmConfig.__post_init__)
    if model_type == "nemotron_h":
        vllm["NemotronHForCausalLMConfig"].verify_and_update_config(config)
    vllm["MambaModelConfig"].verify_and_update_config(config)
    model_cls = vllm[model_type]
    ModelRegistry.current = model_cls
    mamba_type = MambaAttentionBackendEnum[MAMBA_TYPES[model_type]]
    # the layers' checkpoint alignment (qwen_gdn_linear_attn.py: FlashInfer's prefill in align
    # mode exports states every FLASHINFER_GDN_CHECKPOINT_ALIGNMENT tokens; others: None)
    exports = (
        mamba_type.name == "GDN_ATTN"
        and config.cache_config.mamba_cache_mode == "align"
        and case["gdn_prefill_backend"] == "flashinfer"
    )
    alignment = vllm["FLASHINFER_GDN_CHECKPOINT_ALIGNMENT"] if exports else None
    kinds = layers(model_type, hf_config)
    abstract.LAYERS[:] = [
        SimpleNamespace(get_prefill_checkpoint_alignment=lambda: alignment)
        for _, kind in kinds
        if kind == "mamba"
    ]
    backend = flash_attention(vllm)
    has_attention = any(kind == "attn" for _, kind in kinds)
    platform = type(
        "Platform",
        (),
        {
            "_find_non_ssm_backends": classmethod(
                lambda cls, c: [backend] if has_attention else []
            ),
            **{
                name: classmethod(vllm[name])
                for name in (
                    "update_block_size_for_backend",
                    "_preferred_block_size_for_backends",
                    "_check_aligned_block_size",
                    "_align_hybrid_block_size",
                )
            },
        },
    )
    platform.update_block_size_for_backend(config)
    shapes = model_cls.get_mamba_state_shape_from_config(config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(config)
    layer = SimpleNamespace(
        get_state_shape=lambda: shapes,
        get_state_dtype=lambda: dtypes,
        mamba_type=mamba_type,
        is_kv_cache_tp_replicated=False,
    )
    mamba_spec = vllm["mamba_kv_cache_spec"](layer, config)
    if mamba_type.name == "MAMBA2":  # MambaMixer2.get_kv_cache_spec
        mamba_spec = replace(
            mamba_spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
        )
    elif exports:  # QwenGatedDeltaNetAttention.get_kv_cache_spec
        mamba_spec = replace(
            mamba_spec,
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=config.cache_config.mamba_block_size,
        )
    cache_dtype = case["cache_dtype"]
    attention_spec = interface.FullAttentionSpec(  # Attention.get_kv_cache_spec
        block_size=config.cache_config.block_size,
        num_kv_heads=max(1, hf_config.num_key_value_heads // tp),
        head_size=attention_head_size(model_type, hf_config),
        dtype=get_kv_cache_torch_dtype(cache_dtype, config.model_config.dtype),
        kv_quant_mode=interface.get_kv_quant_mode(cache_dtype),
    )
    assert cache_dtype == "auto" or cache_dtype in STR_DTYPE_TO_TORCH_DTYPE
    specs = {
        f"layers.{index}.{kind}": attention_spec if kind == "attn" else mamba_spec
        for index, kind in kinds
    }
    try:
        groups = planning.get_global_kv_cache_groups(config, [dict(specs)])
        (built,) = planning.get_kv_cache_configs(
            config, [specs], [case["available_memory"]], groups
        )
    except (ValueError, NotImplementedError, AssertionError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    num_tokens, concurrency = get_kv_cache_capacity(config, built)
    return {
        "block_size": config.cache_config.block_size,
        "mamba_block_size": config.cache_config.mamba_block_size,
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
        "mamba_page_size_padded": config.cache_config.mamba_page_size_padded,
        "state_shapes": [list(shape) for shape in shapes],
        "state_dtypes": [str(dtype).removeprefix("torch.") for dtype in dtypes],
        "state_bytes": mamba_spec.real_page_size_bytes,
        "page_size_bytes": mamba_spec.page_size_bytes,
        "groups": [
            {
                "kind": "mamba" if isinstance(group.kv_cache_spec, interface.MambaSpec) else "full",
                "block_size": group.kv_cache_spec.block_size,
                "blocks_per_request": -(
                    -group.kv_cache_spec.max_memory_usage_bytes(config)
                    // group.kv_cache_spec.page_size_bytes
                ),
                "layers": list(group.layer_names),
            }
            for group in built.kv_cache_groups
        ],
        "num_blocks": built.num_blocks,
        "max_concurrency": concurrency,
        "kv_cache_size_tokens": num_tokens,
    }


def main() -> int:
    cases = json.load(sys.stdin)
    try:
        sources = source_tree("0.33.0", SOURCES, {})
        root = source_tree("0.33.0", RUNTIME_MODULES, stand_ins(sources))
    except FetchError as error:
        print(json.dumps({"setup_error": str(error)}))
        return UNREACHABLE if _unreachable(error) else 2
    sys.path.insert(0, str(root))
    torch_or_stand_in()
    with quiet():
        vllm = functions(sources)
        print(json.dumps([plan(case, vllm) for case in cases]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
