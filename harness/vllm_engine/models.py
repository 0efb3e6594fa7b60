"""The tiny models vLLM's own engine serves in the vLLM tier: made locally, never downloaded.

Two random-weights checkpoints, written once to a cache directory (`build/vllm-models/<name>`)
under a fixed torch seed:

- `llama`: a `LlamaForCausalLM` (vocab 512, hidden 256, 2 layers, 4 query heads of 64, 2 KV
  heads): one KV cache group.
- `gemma3`: a `Gemma3ForCausalLM` text model, one sliding-window layer (window 64) to one
  full-attention layer, twice: vLLM makes two KV cache groups of it.
- `qwen3_next`: a `Qwen3NextForCausalLM` (a Mamba hybrid), one gated-delta-net layer to one
  full-attention layer, twice, with a two-expert MoE: vLLM makes a Mamba group and an attention
  group of it, in `mamba_cache_mode="align"` with prefix caching. vLLM's CPU kernel for the
  gated delta net runs in bfloat16 only (`LinearAttention.dtype`), which needs AVX-512 BF16.

The weights are drawn wider than transformers' training init (std 0.2, as the synthetic models of
`pagedkv.engine.model`): with 0.02 a random model's greedy output falls into a short loop that
hardly depends on the context, so a wrong block would seldom change a token. Gemma-3 does not tie
its output head to the embedding, for the same reason. Neither has a stop token.

torch and transformers are imported inside the functions: `pagedkv` has no import-time
dependency, and only the vLLM tier's environment has them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS_DIR = Path("build/vllm-models")
"""Where `ensure_model` writes the checkpoints by default (relative to the working directory)."""

INIT_STD = 0.2
"""The weights' standard deviation (see the module's docstring)."""

SEED = 0
"""torch's seed for every model's weights."""


@dataclass(frozen=True)
class LinearAttention:
    """The gated-delta-net layers of a Qwen3-Next model (`layer_types` "linear_attention") and
    its MoE feed-forward.

    Attributes:
        num_value_heads, num_key_heads, key_head_dim, value_head_dim, conv_kernel_dim: the
            layers' shape (transformers' `linear_*` fields).
        num_experts, num_experts_per_tok, moe_intermediate_size,
            shared_expert_intermediate_size: the MoE's shape.
        dtype: the only dtype vLLM's CPU gated-delta-net kernel runs in.
    """

    num_value_heads: int
    num_key_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class TinyModel:
    """One tiny model's shape.

    Attributes:
        name: what `--model` calls it.
        num_kv_cache_groups: how many KV cache groups vLLM makes of it.
        sliding_window: the sliding layers' window in tokens, or None (full attention only).
        linear_attention: the gated-delta-net layers' shape (a Qwen3-Next), or None.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    num_kv_cache_groups: int
    sliding_window: int | None = None
    linear_attention: LinearAttention | None = None

    @property
    def dtype(self) -> str:
        """The dtype vLLM runs it in: float32, unless its layers need another."""
        return "float32" if self.linear_attention is None else self.linear_attention.dtype


MODELS: dict[str, TinyModel] = {
    "llama": TinyModel(
        name="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        layer_types=("full_attention",) * 2,
        max_position_embeddings=1024,
        num_kv_cache_groups=1,
    ),
    "gemma3": TinyModel(
        name="gemma3",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        layer_types=("sliding_attention", "full_attention") * 2,
        max_position_embeddings=1024,
        num_kv_cache_groups=2,
        sliding_window=64,
    ),
    "qwen3_next": TinyModel(
        name="qwen3_next",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        layer_types=("linear_attention", "full_attention") * 2,
        max_position_embeddings=1024,
        num_kv_cache_groups=2,
        linear_attention=LinearAttention(
            num_value_heads=4,
            num_key_heads=2,
            key_head_dim=64,
            value_head_dim=64,
            conv_kernel_dim=4,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
        ),
    ),
}


def model_dir(name: str, cache_dir: Path = MODELS_DIR) -> Path:
    """Where the model called `name` is (or will be) written."""
    return cache_dir / name


def ensure_model(name: str, cache_dir: Path = MODELS_DIR) -> Path:
    """The directory of the model called `name`, written there first if it is not yet.

    A directory whose `pagedkv-model.json` records another shape (an older version of this
    module) is written again. The same name always gives the same weights: they are drawn under
    `SEED` with torch's global generator forked, so the caller's random state is left as it was.
    The checkpoint is written beside the directory and renamed into place, so runs started at
    once never read a half-written one.

    Raises:
        KeyError: no model is called `name`.
    """
    shape = MODELS[name]
    directory = model_dir(name, cache_dir)
    recorded = _shape_record(shape)
    if _holds(directory, recorded):
        return directory
    model = _build(shape)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    model.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps(recorded, indent=1) + "\n")
    if _holds(directory, recorded):  # another run wrote it meanwhile
        shutil.rmtree(staging)
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    return directory


MARKER = "pagedkv-model.json"
"""The file in a model's directory that records the shape it was written from."""


def _holds(directory: Path, recorded: dict[str, object]) -> bool:
    marker = directory / MARKER
    return marker.is_file() and bool(json.loads(marker.read_text()) == recorded)


def _shape_record(shape: TinyModel) -> dict[str, object]:
    """What `MARKER` records of a shape. A field left at None is not recorded, so the models
    written before it existed keep their record (and their cached checkpoints)."""
    fields = {key: value for key, value in vars(shape).items() if key != "layer_types"}
    if shape.linear_attention is None:
        del fields["linear_attention"]
    else:
        fields["linear_attention"] = vars(shape.linear_attention)
    return {
        "shape": fields,
        "layer_types": list(shape.layer_types),
        "init_std": INIT_STD,
        "seed": SEED,
    }


def _build(shape: TinyModel) -> Any:
    import torch

    common: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": len(shape.layer_types),
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        if shape.linear_attention is not None:
            return _build_qwen3_next(common, shape, shape.linear_attention)
        if shape.sliding_window is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            return LlamaForCausalLM(LlamaConfig(**common)).eval()
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **common,
            query_pre_attn_scalar=shape.head_dim,
            sliding_window=shape.sliding_window,
            layer_types=list(shape.layer_types),
            tie_word_embeddings=False,
        )
        return Gemma3ForCausalLM(config).eval()


def _build_qwen3_next(common: dict[str, Any], shape: TinyModel, linear: LinearAttention) -> Any:
    """A Qwen3-Next of `shape`: every layer's feed-forward a MoE (no dense-only layer), the output
    head apart from the embedding."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **common,
        layer_types=list(shape.layer_types),
        linear_num_value_heads=linear.num_value_heads,
        linear_num_key_heads=linear.num_key_heads,
        linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim,
        linear_conv_kernel_dim=linear.conv_kernel_dim,
        num_experts=linear.num_experts,
        num_experts_per_tok=linear.num_experts_per_tok,
        moe_intermediate_size=linear.moe_intermediate_size,
        shared_expert_intermediate_size=linear.shared_expert_intermediate_size,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    return Qwen3NextForCausalLM(config).eval()
