"""A Hugging Face Llama-4 text model run token-packed through pagedkv's paged KV cache.

As `paged_llama`, with Llama-4's own modules and weights, in the model's own order::

    embed_tokens -> per layer: input_layernorm, q/k/v_proj; on RoPE layers (Llama-4's chunked
    local layers) RoPE at each token's absolute position (complex rotation) then the L2 q/k
    norm; on NoPE layers (its full-attention layers) the query scaled by attention temperature
    tuning at each token's absolute position; write K/V into the paged cache through the
    layer's group's slot mapping, paged attention over the group's block table (a chunked layer
    sees only its own chunk), o_proj, residual, post_attention_layernorm, feed_forward (a
    mixture of experts with a shared expert, or a dense MLP), residual -> norm -> lm_head

Only attention differs from the dense model: where `transformers` masks a dense cache to the
chunk, the executor reads the chunk's pages through the block table. Each layer's chunk comes
from its cache's layout (`KVCacheLayout.attention_chunk_size`), and each layer's block table and
slot mapping from its KV cache group (`GroupedStepMetadata`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.engine.executor import AttentionExecutor
from pagedkv.engine.model import check_llama4
from pagedkv.engine.stage_timer import StageTimer
from pagedkv.vocab.errors import InvalidArgumentError


class PagedLlama4Runner:
    """Runs one step of a `Llama4ForCausalLM` through an `AttentionExecutor`.

    Args:
        model: a Llama-4 text causal LM (`pagedkv.engine.model.check_llama4`).
        executor: owns the paged caches, one per decoder layer.
        timer: where the seconds spent in K/V writes and attention are added.
    """

    def __init__(self, model: Any, executor: AttentionExecutor, timer: StageTimer) -> None:
        check_llama4(model)
        self.model = model
        self.executor = executor
        self.timer = timer
        self.layers = list(model.model.layers)
        from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

        self.apply_rotary_emb = apply_rotary_emb

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
        freqs_cis = inner.rotary_emb(hidden, positions[None])  # complex [1, T, D / 2]
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            normed = layer.input_layernorm(hidden)
            query = attn.q_proj(normed).view(1, num_tokens, -1, head_dim)
            key = attn.k_proj(normed).view(1, num_tokens, -1, head_dim)
            value = attn.v_proj(normed).view(num_tokens, -1, head_dim)
            if attn.use_rope:
                query, key = self.apply_rotary_emb(query, key, freqs_cis)
            if hasattr(attn, "qk_norm"):
                query, key = attn.qk_norm(query), attn.qk_norm(key)
            if attn.attn_temperature_tuning and not attn.use_rope:
                scales = (
                    torch.log1p(torch.floor((positions.float() + 1.0) / attn.floor_scale))
                    * attn.attn_scale
                    + 1.0
                )
                query = (query * scales.view(1, num_tokens, 1, 1)).to(query.dtype)
            with self.timer.measure("kv_write"):
                self.executor.write_kv(index, key[0], value)
            with self.timer.measure("attention"):
                out = self.executor.attention(index, query[0], attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(num_tokens, -1))
            feed_forward = layer.feed_forward(layer.post_attention_layernorm(hidden))
            if layer.is_moe_layer:
                feed_forward = feed_forward[0]
            hidden = hidden + feed_forward.view(hidden.shape)
        logits: torch.Tensor = self.model.lm_head(inner.norm(hidden[sample_rows]))
        return logits.float()
