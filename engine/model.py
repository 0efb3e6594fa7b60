"""The model the engine serves: a `transformers` Llama, Gemma-3 or Llama-4 text model, seeded
and random, or a local checkpoint.

Nothing is downloaded. A synthetic model is `LlamaForCausalLM` built from a small `LlamaConfig`,
`Gemma3ForCausalLM` from a small `Gemma3TextConfig` (sliding-window and full-attention layers:
a hybrid model, whose KV cache has several groups), or `Llama4ForCausalLM` from a small
`Llama4TextConfig` (chunked local attention beside full attention, mixture-of-experts layers),
with weights drawn under a fixed seed. Its weights are drawn wider than transformers' training
init (std `SYNTHETIC_INIT_STD` instead of 0.02): with 0.02 a random Llama's greedy output falls
into a two- or three-token loop within a few tokens and hardly depends on the context, so it
would prove little; at 0.2 every output token depends on the whole prompt (changing the first
prompt token changes the first output token), so a K/V row written to the wrong slot or a wrong
page in a block table changes what is generated. The synthetic Gemma-3 models draw theirs the
same way and do not tie the output head to the embedding: Gemma-3 scales its embedding by
sqrt(hidden_size), and with tied random weights every prompt then yields one constant token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedkv.engine.kv_layout import LayerAttention
from pagedkv.engine.presets import (
    CHUNKED,
    FULL,
    GEMMA3_PRESETS,
    LLAMA4_PRESETS,
    PRESETS,
    SLIDING,
    SYNTHETIC_PRESETS,
)
from pagedkv.vocab.errors import InvalidArgumentError

SYNTHETIC_INIT_STD = 0.2


def synthetic_model(
    preset: str = "small",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """The synthetic model called `preset`: a Llama (`synthetic_llama`), a Gemma-3
    (`synthetic_gemma3`) or a Llama-4 (`synthetic_llama4`).

    Raises:
        InvalidArgumentError: an unknown preset.
    """
    if preset in GEMMA3_PRESETS:
        return synthetic_gemma3(preset, seed=seed, dtype=dtype, device=device)
    if preset in LLAMA4_PRESETS:
        return synthetic_llama4(preset, seed=seed, dtype=dtype, device=device)
    if preset not in SYNTHETIC_PRESETS:
        raise InvalidArgumentError(
            f"unknown synthetic model {preset!r}; presets: {', '.join(PRESETS)}"
        )
    return synthetic_llama(preset, seed=seed, dtype=dtype, device=device)


def synthetic_gemma3(
    preset: str = "gemma3-2group",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """A `Gemma3ForCausalLM` with seeded random weights, in eval mode, no stop token.

    Args:
        preset: a key of `GEMMA3_PRESETS`.
        seed: the weights' seed (the global torch RNG is left as it was).
        dtype: the weights' dtype.
        device: where the weights live.

    Raises:
        InvalidArgumentError: an unknown preset.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = GEMMA3_PRESETS.get(preset)
    if shape is None:
        raise InvalidArgumentError(
            f"unknown synthetic Gemma-3 model {preset!r}; presets: {', '.join(GEMMA3_PRESETS)}"
        )
    config = Gemma3TextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=len(shape.layer_types),
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        sliding_window=shape.sliding_window,
        layer_types=list(shape.layer_types),
        initializer_range=SYNTHETIC_INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def synthetic_llama4(
    preset: str = "llama4-2group",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """A `Llama4ForCausalLM` (text only) with seeded random weights, in eval mode, no stop
    token.

    Args:
        preset: a key of `LLAMA4_PRESETS`.
        seed: the weights' seed (the global torch RNG is left as it was).
        dtype: the weights' dtype.
        device: where the weights live.

    Raises:
        InvalidArgumentError: an unknown preset.
    """
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    shape = LLAMA4_PRESETS.get(preset)
    if shape is None:
        raise InvalidArgumentError(
            f"unknown synthetic Llama-4 model {preset!r}; presets: {', '.join(LLAMA4_PRESETS)}"
        )
    config = Llama4TextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        intermediate_size_mlp=shape.intermediate_size,
        num_hidden_layers=len(shape.layer_types),
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        attention_chunk_size=shape.attention_chunk_size,
        layer_types=list(shape.layer_types),
        no_rope_layers=[int(kind == CHUNKED) for kind in shape.layer_types],
        moe_layers=list(shape.moe_layers),
        num_local_experts=shape.num_experts,
        num_experts_per_tok=1,
        floor_scale=shape.floor_scale,
        initializer_range=SYNTHETIC_INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Llama4ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def synthetic_llama(
    preset: str = "small",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """A `LlamaForCausalLM` with seeded random weights, in eval mode, no stop token.

    Args:
        preset: a key of `SYNTHETIC_PRESETS`.
        seed: the weights' seed (the global torch RNG is left as it was).
        dtype: the weights' dtype.
        device: where the weights live.

    Raises:
        InvalidArgumentError: an unknown preset.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SYNTHETIC_PRESETS.get(preset)
    if shape is None:
        raise InvalidArgumentError(
            f"unknown synthetic model {preset!r}; presets: {', '.join(SYNTHETIC_PRESETS)}"
        )
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=SYNTHETIC_INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def load_local_model(
    path: str | Path, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Any:
    """A Llama, Gemma-3 or Llama-4 text checkpoint from a local directory (never the network).

    Raises:
        InvalidArgumentError: no such directory, it holds no loadable model, or the model is
            neither (see `check_model`).
    """
    from transformers import AutoModelForCausalLM

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise InvalidArgumentError(f"--model {path}: no config.json there (a local directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"--model {path}: cannot load it: {error}") from error
    check_model(model)
    return model.to(device=device).eval()


MODEL_TYPES = ("llama", "gemma3_text", "llama4_text")
"""The `config.model_type`s the engine runs: `LlamaForCausalLM`, `Gemma3ForCausalLM` and
`Llama4ForCausalLM`."""


def check_model(model: Any) -> str:
    """The engine runs the model's modules itself: a Llama (`check_llama`), a Gemma-3 text
    model (`check_gemma3`) or a Llama-4 text model (`check_llama4`). Returns its model type.

    Raises:
        InvalidArgumentError: another model type, or a layout or option the engine cannot run.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gemma3_text":
        check_gemma3(model)
        return "gemma3_text"
    if model_type == "llama4_text":
        check_llama4(model)
        return "llama4_text"
    if model_type != "llama":
        raise InvalidArgumentError(
            f"the engine runs models of type {', '.join(map(repr, MODEL_TYPES))} (a Llama, a "
            f"Gemma-3 or a Llama-4 text model), got {model_type!r}"
        )
    check_llama(model)
    return "llama"


def check_gemma3(model: Any) -> None:
    """A `Gemma3ForCausalLM` the paged attention computes exactly: causal, no attention logit
    softcapping, each layer sliding-window or full attention.

    Raises:
        InvalidArgumentError: names what is missing or which option is not supported.
    """
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gemma3_text":
        raise InvalidArgumentError(
            f"not a Gemma-3 text model: model_type {getattr(config, 'model_type', None)!r}"
        )
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    missing = [name for name in needed if not hasattr(inner, name)]
    if missing or not hasattr(model, "lm_head"):
        raise InvalidArgumentError(
            f"not a Gemma3ForCausalLM layout: missing {missing or ['lm_head']}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise InvalidArgumentError("use_bidirectional_attention: the engine is causal only")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise InvalidArgumentError(
            "attn_logit_softcapping: the paged attention has no logit softcapping"
        )
    unknown = sorted(set(config.layer_types) - {SLIDING, FULL})
    if unknown:
        raise InvalidArgumentError(f"layer types {unknown}: the engine runs {SLIDING} and {FULL}")


def check_llama4(model: Any) -> None:
    """A `Llama4ForCausalLM` (text only) whose layers are chunked local or full attention.

    Raises:
        InvalidArgumentError: names what is missing or which option is not supported.
    """
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llama4_text":
        raise InvalidArgumentError(
            f"not a Llama-4 text model: model_type {getattr(config, 'model_type', None)!r}"
        )
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    missing = [name for name in needed if not hasattr(inner, name)]
    if missing or not hasattr(model, "lm_head"):
        raise InvalidArgumentError(
            f"not a Llama4ForCausalLM layout: missing {missing or ['lm_head']}"
        )
    unknown = sorted(set(config.layer_types) - {CHUNKED, FULL})
    if unknown:
        raise InvalidArgumentError(f"layer types {unknown}: the engine runs {CHUNKED} and {FULL}")


def layer_attention(model: Any) -> tuple[LayerAttention, ...]:
    """What each decoder layer attends to: a Llama's layers all to every earlier token, a
    Gemma-3's and a Llama-4's as their `layer_types` say (sliding window, chunked local
    attention, or full).

    Raises:
        InvalidArgumentError: as `check_model`.
    """
    config = model.config
    model_type = check_model(model)
    if model_type == "llama":
        return (LayerAttention(),) * int(config.num_hidden_layers)
    if model_type == "gemma3_text":
        window = LayerAttention(sliding_window=int(config.sliding_window))
        return tuple(window if kind == SLIDING else LayerAttention() for kind in config.layer_types)
    chunk = LayerAttention(attention_chunk_size=int(config.attention_chunk_size))
    return tuple(chunk if kind == CHUNKED else LayerAttention() for kind in config.layer_types)


def check_llama(model: Any) -> None:
    """The engine runs a Llama's modules itself, so the model must be laid out as one.

    Raises:
        InvalidArgumentError: names what is missing or which model type it is.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type != "llama":
        raise InvalidArgumentError(
            f"the engine runs Llama-architecture models (model_type 'llama'), got {model_type!r}"
        )
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    missing = [name for name in needed if not hasattr(inner, name)]
    if missing or not hasattr(model, "lm_head"):
        raise InvalidArgumentError(
            f"not a LlamaForCausalLM layout: missing {missing or ['lm_head']}"
        )


def stop_token_ids(model: Any) -> tuple[int, ...]:
    """The model's end-of-sequence ids (its generation config's `eos_token_id`), maybe none."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
