"""The model the engine serves: a `transformers` Llama, seeded and random, or a local checkpoint.

Nothing is downloaded. A synthetic model is `LlamaForCausalLM` built from a small `LlamaConfig`
with weights drawn under a fixed seed. Its weights are drawn wider than transformers' training
init (std `SYNTHETIC_INIT_STD` instead of 0.02): with 0.02 a random Llama's greedy output falls
into a two- or three-token loop within a few tokens and hardly depends on the context, so it
would prove little; at 0.2 every output token depends on the whole prompt (changing the first
prompt token changes the first output token), so a K/V row written to the wrong slot or a wrong
page in a block table changes what is generated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedkv.engine.presets import SYNTHETIC_PRESETS
from pagedkv.vocab.errors import InvalidArgumentError

SYNTHETIC_INIT_STD = 0.2


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
    """A Llama-architecture checkpoint from a local directory (never the network).

    Raises:
        InvalidArgumentError: no such directory, it holds no loadable model, or the model is
            not a Llama (see `check_llama`).
    """
    from transformers import AutoModelForCausalLM

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise InvalidArgumentError(f"--model {path}: no config.json there (a local directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"--model {path}: cannot load it: {error}") from error
    check_llama(model)
    return model.to(device=device).eval()


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
