"""A Hugging Face Gemma-3 text model run token-packed through pagedkv's paged KV cache.

As `paged_llama`, with Gemma-3's own modules and weights, in the model's own order::

    embed_tokens (scaled by sqrt(hidden_size) inside the module) -> per layer:
    input_layernorm, q/k/v_proj, q_norm/k_norm, RoPE at each token's absolute position with
    the layer type's own rotary table (sliding layers a local base, full layers a global one),
    write K/V into the paged cache through the layer's group's slot mapping, paged attention
    over the group's block table (a sliding layer sees its last `sliding_window` tokens),
    o_proj, post_attention_layernorm, residual, pre_feedforward_layernorm, mlp,
    post_feedforward_layernorm, residual -> norm -> lm_head (only the rows that sample) ->
    final logit softcapping if the config has one

Only attention differs from the dense model: where `transformers` masks a dense cache to the
window, the executor reads the window's pages through the block table. Each layer's window comes
from its cache's layout (`KVCacheLayout.sliding_window`), and each layer's block table and slot
mapping from its KV cache group (`GroupedStepMetadata`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.engine.executor import AttentionExecutor
from pagedkv.engine.model import check_gemma3
from pagedkv.engine.stage_timer import StageTimer
from pagedkv.vocab.errors import InvalidArgumentError


class PagedGemma3Runner:
    """Runs one step of a `Gemma3ForCausalLM` through an `AttentionExecutor`.

    Args:
        model: a Gemma-3 text causal LM (`pagedkv.engine.model.check_gemma3`).
        executor: owns the paged caches, one per decoder layer.
        timer: where the seconds spent in K/V writes and attention are added.
    """

    def __init__(self, model: Any, executor: AttentionExecutor, timer: StageTimer) -> None:
        check_gemma3(model)
        self.model = model
        self.executor = executor
        self.timer = timer
        self.layers = list(model.model.layers)
        self.layer_types: list[str] = list(model.config.layer_types)
        from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

        self.apply_rotary_pos_emb = apply_rotary_pos_emb

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the tokens at `sample_rows`, after writing every token's K/V.

        The executor's `begin_step` must have been called with this step's metadata.

        Args:
            input_ids: int64 [T], the step's tokens, request after request.
            positions: int64 [T], each token's position in its request.
            sample_rows: int64 [S], the rows whose next-token logits are wanted.

        Returns:
            float32 [S, vocab_size].

        Raises:
            InvalidArgumentError: `input_ids` and `positions` differ in length.
        """
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise InvalidArgumentError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                f"must be two vectors of one length"
            )
        inner = self.model.model
        num_tokens = input_ids.shape[0]
        hidden = inner.embed_tokens(input_ids)
        rotary = {
            layer_type: inner.rotary_emb(hidden, positions[None], layer_type)
            for layer_type in sorted(set(self.layer_types))
        }
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            normed = layer.input_layernorm(hidden)
            query = attn.q_norm(attn.q_proj(normed).view(num_tokens, -1, head_dim))
            key = attn.k_norm(attn.k_proj(normed).view(num_tokens, -1, head_dim))
            value = attn.v_proj(normed).view(num_tokens, -1, head_dim)
            cos, sin = rotary[self.layer_types[index]]
            # [T, heads, D] with cos/sin [T, D]: unsqueeze the head dimension.
            query, key = self.apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
            with self.timer.measure("kv_write"):
                self.executor.write_kv(index, key, value)
            with self.timer.measure("attention"):
                out = self.executor.attention(index, query, attn.scaling)
            attended = attn.o_proj(out.reshape(num_tokens, -1))
            hidden = hidden + layer.post_attention_layernorm(attended)
            mlp_out = layer.mlp(layer.pre_feedforward_layernorm(hidden))
            hidden = hidden + layer.post_feedforward_layernorm(mlp_out)
        logits: torch.Tensor = self.model.lm_head(inner.norm(hidden[sample_rows]))
        softcap = self.model.config.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()
