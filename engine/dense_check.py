"""The proof: the engine's greedy tokens equal `transformers`' own dense `generate`, token for
token, and the logits they were sampled from agree within `LOGITS_ATOL`.

Each request is regenerated alone by `model.generate(do_sample=False)` with a dense KV cache,
from the prompt, with the same stop tokens and `max_tokens`, and no logits processor (a fresh
`GenerationConfig`, so a checkpoint's sampling defaults do not apply). The engine's tokens come
from batches mixing prefill chunks and decodes of other requests, pages scattered over the pool,
prefix hits on blocks other requests wrote, and recomputation after preemption.

Tolerance, fp32: the two sides compute the same functions in different orders (chunked and
batched matmuls, a gather over pages and a masked softmax against SDPA), so each logit differs
by a few float32 roundings carried through the layers: measured below 2e-5 on the synthetic
models (logits of magnitude up to about 20). `LOGITS_ATOL` = 1e-3 leaves fifty times that,
while a single K/V row in the wrong slot, a wrong page or a wrong position moves logits by
0.1 or more and changes the tokens. Lower precisions round every activation (bfloat16 keeps 8
bits), so two correct implementations legitimately drift apart: the check is for float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.engine_request import EngineRequest

LOGITS_ATOL = 1e-3
"""Largest allowed |engine logit - dense logit| over every generated position (float32)."""


@dataclass(frozen=True)
class RequestComparison:
    """One request, engine vs dense.

    Attributes:
        request_id: the request.
        engine_tokens: what the engine generated.
        dense_tokens: what `generate` generated.
        max_logit_diff: largest |difference| over the positions both generated (logits).
        min_margin: the smallest gap between the dense top-1 and top-2 logits (how close a
            near-tie came to deciding a token).
    """

    request_id: str
    engine_tokens: tuple[int, ...]
    dense_tokens: tuple[int, ...]
    max_logit_diff: float
    min_margin: float

    @property
    def first_mismatch(self) -> int | None:
        """The first output position where the tokens differ (or the lengths do), or None."""
        for index, (mine, theirs) in enumerate(
            zip(self.engine_tokens, self.dense_tokens, strict=False)
        ):
            if mine != theirs:
                return index
        if len(self.engine_tokens) != len(self.dense_tokens):
            return min(len(self.engine_tokens), len(self.dense_tokens))
        return None

    def passed(self, atol: float) -> bool:
        return self.first_mismatch is None and self.max_logit_diff <= atol


@dataclass(frozen=True)
class DenseCheck:
    """Every request's comparison, and the tolerance they were held to."""

    comparisons: tuple[RequestComparison, ...]
    atol: float

    @property
    def passed(self) -> bool:
        return all(comparison.passed(self.atol) for comparison in self.comparisons)

    @property
    def failures(self) -> list[RequestComparison]:
        return [c for c in self.comparisons if not c.passed(self.atol)]

    @property
    def max_logit_diff(self) -> float:
        return max((c.max_logit_diff for c in self.comparisons), default=0.0)

    @property
    def min_margin(self) -> float:
        return min((c.min_margin for c in self.comparisons), default=float("inf"))

    @property
    def num_tokens(self) -> int:
        return sum(len(c.dense_tokens) for c in self.comparisons)


def dense_generate(model: Any, item: EngineRequest) -> tuple[list[int], torch.Tensor]:
    """`model.generate` for one request: its tokens and float32 [generated, vocab] logits."""
    from transformers import GenerationConfig

    stop = sorted(item.stop_token_ids)
    config = GenerationConfig(
        max_new_tokens=item.max_tokens,
        do_sample=False,
        eos_token_id=stop or None,
        pad_token_id=stop[0] if stop else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    device = next(model.parameters()).device
    prompt = torch.tensor([item.prompt_token_ids], dtype=torch.int64, device=device)
    with torch.inference_mode():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=config
        )
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    logits = torch.cat([row.float().cpu() for row in out.logits])
    return tokens, logits


def compare_with_dense(
    model: Any,
    requests: Sequence[EngineRequest],
    engine_logits: dict[str, torch.Tensor],
    *,
    atol: float = LOGITS_ATOL,
    on_request: Callable[[RequestComparison], None] | None = None,
) -> DenseCheck:
    """Regenerate each finished request densely and compare tokens and logits.

    Args:
        model: the model the engine ran.
        requests: finished requests.
        engine_logits: request id -> the engine's logits rows (`RunResult.logits`).
        atol: the logits tolerance.
        on_request: called after each request's comparison (progress).
    """
    comparisons = []
    for item in requests:
        dense_tokens, dense_logits = dense_generate(model, item)
        mine = engine_logits[item.request_id]
        both = min(mine.shape[0], dense_logits.shape[0])
        diff = (mine[:both] - dense_logits[:both]).abs().max().item() if both else 0.0
        top2 = dense_logits.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item() if top2.shape[0] else float("inf")
        comparison = RequestComparison(
            item.request_id,
            tuple(item.output_token_ids),
            tuple(dense_tokens),
            float(diff),
            float(margin),
        )
        comparisons.append(comparison)
        if on_request is not None:
            on_request(comparison)
    return DenseCheck(tuple(comparisons), atol)
