"""The proof: the engine's greedy tokens equal `transformers`' own dense `generate`, token for
token, and the logits they were sampled from agree within `LOGITS_ATOL`.

Each request is regenerated alone by `model.generate(do_sample=False)` with a dense KV cache,
from the prompt, with the same stop tokens and `max_tokens`, and no logits processor (a fresh
`GenerationConfig`, so a checkpoint's sampling defaults do not apply). The engine's tokens come
from batches mixing prefill chunks and decodes of other requests, pages scattered over the pool,
prefix hits on blocks other requests wrote, and recomputation after preemption.

Tolerance: the engine computes the same functions as the dense model in another order (chunked
and batched matmuls, a gather over pages and a masked softmax instead of SDPA), so its logits
differ by float rounding, which grows with the model's activations. The check measures that
rounding level on the spot: transformers' own two dense computations of the same logits,
`generate` (token by token with its dense KV cache) and one forward pass over the whole
sequence, differ by `noise_floor`; the tolerance is `NOISE_FACTOR` times the largest such
difference over the run (at least `MIN_LOGITS_ATOL`). In float32 the engine's differences are of
the same size as transformers' own (measured: 8e-5 vs 1.1e-4 on the `tiny` synthetic Llama,
7e-4 vs 5e-4 on `small`, whose residual stream reaches magnitudes of 600), while a real bug (a
K/V row in the wrong slot, pages in the wrong order, a wrong position) moves logits by 0.1 or
more and changes tokens. In bfloat16 or float16 every activation is rounded to 8 or 11 bits and
two correct implementations can pick different tokens at a near-tie: the check is meant for
float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.engine_request import EngineRequest

NOISE_FACTOR = 10.0
"""The tolerance, in multiples of transformers' own generate-vs-forward logit difference."""

MIN_LOGITS_ATOL = 1e-4
"""The tolerance never goes below this (a run whose dense paths happen to agree exactly)."""


@dataclass(frozen=True)
class RequestComparison:
    """One request, engine vs dense.

    Attributes:
        request_id: the request.
        engine_tokens: what the engine generated.
        dense_tokens: what `generate` generated.
        max_logit_diff: largest |difference| over the positions both generated (logits).
        dense_noise: largest |difference| between `generate`'s logits and one dense forward
            pass over the prompt and the generated tokens (transformers against itself).
        min_margin: the smallest gap between the dense top-1 and top-2 logits (how close a
            near-tie came to deciding a token).
    """

    request_id: str
    engine_tokens: tuple[int, ...]
    dense_tokens: tuple[int, ...]
    max_logit_diff: float
    dense_noise: float
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
    """Every request's comparison, and the logits tolerance they were held to."""

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
    def noise_floor(self) -> float:
        """transformers' largest generate-vs-forward logit difference over the run."""
        return max((c.dense_noise for c in self.comparisons), default=0.0)

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


def dense_forward_logits(model: Any, item: EngineRequest, tokens: Sequence[int]) -> torch.Tensor:
    """One dense forward pass over the prompt and `tokens[:-1]`: float32 [len(tokens), vocab],
    the logits each of `tokens` was sampled from."""
    device = next(model.parameters()).device
    sequence = [*item.prompt_token_ids, *tokens[:-1]]
    ids = torch.tensor([sequence], dtype=torch.int64, device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(item.prompt_token_ids) - 1 :]
    result: torch.Tensor = logits.float().cpu()
    return result


def compare_with_dense(
    model: Any,
    requests: Sequence[EngineRequest],
    engine_logits: dict[str, torch.Tensor],
    *,
    atol: float | None = None,
    on_request: Callable[[RequestComparison], None] | None = None,
) -> DenseCheck:
    """Regenerate each finished request densely and compare tokens and logits.

    Args:
        model: the model the engine ran.
        requests: finished requests.
        engine_logits: request id -> the engine's logits rows (`RunResult.logits`).
        atol: the logits tolerance; None: `NOISE_FACTOR` x the run's noise floor (module
            docstring), at least `MIN_LOGITS_ATOL`.
        on_request: called after each request's comparison (progress).
    """
    comparisons = []
    for item in requests:
        dense_tokens, dense_logits = dense_generate(model, item)
        forward = dense_forward_logits(model, item, dense_tokens)
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
            float((forward - dense_logits).abs().max().item()) if dense_tokens else 0.0,
            float(margin),
        )
        comparisons.append(comparison)
        if on_request is not None:
            on_request(comparison)
    if atol is None:
        noise = max((c.dense_noise for c in comparisons), default=0.0)
        atol = max(MIN_LOGITS_ATOL, NOISE_FACTOR * noise)
    return DenseCheck(tuple(comparisons), atol)
