"""A Hugging Face Llama run token-packed through pagedkv's paged KV cache.

The step's tokens of every scheduled request are one packed row of T tokens (no padding). The
runner uses the model's own modules and weights, in the model's own order::

    embed_tokens -> per layer: input_layernorm, q/k/v_proj, RoPE at each token's absolute
    position (the model's rotary_emb and apply_rotary_pos_emb), write K/V into the paged cache
    through the slot mapping, paged attention over the block table, o_proj, residual,
    post_attention_layernorm, mlp, residual -> norm -> lm_head (only the rows that sample)

Only attention differs from the dense model: where `transformers` concatenates a dense cache,
the executor reads the pages the block table names.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.engine.executor import AttentionExecutor
from pagedkv.engine.model import check_llama
from pagedkv.engine.stage_timer import StageTimer
from pagedkv.vocab.errors import InvalidArgumentError


class PagedLlamaRunner:
    """Runs one step of a `LlamaForCausalLM` through an `AttentionExecutor`.

    Args:
        model: a Llama-layout causal LM (`pagedkv.engine.model.check_llama`).
        executor: owns the paged caches, one per decoder layer.
        timer: where the seconds spent in K/V writes and attention are added.
    """

    def __init__(self, model: Any, executor: AttentionExecutor, timer: StageTimer) -> None:
        check_llama(model)
        self.model = model
        self.executor = executor
        self.timer = timer
        self.layers = list(model.model.layers)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

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
        cos, sin = inner.rotary_emb(hidden, positions[None])
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            normed = layer.input_layernorm(hidden)
            query = attn.q_proj(normed).view(num_tokens, -1, head_dim)
            key = attn.k_proj(normed).view(num_tokens, -1, head_dim)
            value = attn.v_proj(normed).view(num_tokens, -1, head_dim)
            # [T, heads, D] with cos/sin [T, D]: unsqueeze the head dimension.
            query, key = self.apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
            with self.timer.measure("kv_write"):
                self.executor.write_kv(index, key, value)
            with self.timer.measure("attention"):
                out = self.executor.attention(index, query, attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(num_tokens, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits: torch.Tensor = self.model.lm_head(inner.norm(hidden[sample_rows]))
        return logits.float()
