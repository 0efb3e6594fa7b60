"""How far a correct kernel's output may be from the float64 reference, element by element.

The kernels read fp16 / bf16 / fp32 inputs (exact in fp32), compute in fp32 and round the output
once to the input dtype `T`. Write `u` for fp32's unit roundoff (2^-24) and `u_T` for `T`'s
(2^-8 bf16, 2^-11 fp16, 2^-24 fp32). For one output row with probabilities `p_k`, values `v_k`,
`n` visible keys and `S = sum_k p_k |v_k|` (per element), the fp32 computation differs from the
exact `o` by at most:

1. Q.K over D terms: each score is off by at most `gamma_D * sum_i |q_i k_i| * scale` with
   `gamma_D = D u / (1 - D u)`, and `sum_i |q_i k_i| <= |q| |k|` (Cauchy-Schwarz): call
   `Z = scale |q| max_k |k|` (`ReferenceTerms.score_norm`). Pre-scaling q, the log2-domain
   change of base and `exp2` (the hardware's approximation is within 2 ulp) add `4 u`. A
   relative error `rho = gamma_D Z + 4 u` in every `exp(score)` changes `o = sum p v / sum p`
   by at most `2 rho S` (first order: numerator and denominator).
2. P.V, the running sums and the rescaling: `n` fp32 additions per element. The worst case is
   `gamma_n S`, far too loose to catch a dropped key at `n` in the thousands; the bound uses the
   statistical form `4 u sqrt(n) S` (rounding errors of random sign, Higham's rule of thumb,
   with a factor 4 of margin), plus `16 u S` for the division by `l`, the split merge's weights
   and its sum over at most 64 partials.
3. Rounding the fp32 result to `T`: `u_T |o32| <= u_T (|o| + |o32 - o|)`, plus half the
   smallest subnormal gap of `T` where the result is tiny (2^-25 for fp16).

    bound = u_T |o| + (1 + u_T) (2 (gamma_D Z + 4 u) + 4 u sqrt(n) + 16 u) S + gap_T / 2

The old check, `|out - ref| <= atol + rtol |ref|` with (1.6e-2, 2e-2) for bf16 against a
bf16-rounded reference, let a kernel that drops one key at every split boundary pass
(`tests/test_gpu_emulator.py` shows a mutant doing exactly that pass the old check and fail
this one).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedkv.gpu.reference import ReferenceTerms

FP32_UNIT_ROUNDOFF = 2.0**-24
UNIT_ROUNDOFF: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
"""Unit roundoff (half an ulp at 1) of each output dtype."""
HALF_SUBNORMAL_GAP: dict[str, float] = {
    "float32": 2.0**-150,
    "bfloat16": 2.0**-134,
    "float16": 2.0**-25,
}
"""Half the gap between subnormals: the absolute rounding error of a tiny result."""


def attention_error_bound(terms: ReferenceTerms, dtype: str) -> torch.Tensor:
    """The per-element bound above, float64, shaped like `terms.out`.

    Complexity: O(elements).
    """
    u, u_t = FP32_UNIT_ROUNDOFF, UNIT_ROUNDOFF[dtype]
    head_size = terms.out.shape[-1]
    gamma_d = head_size * u / (1 - head_size * u)
    rho = gamma_d * terms.score_norm + 4 * u
    compute = 2 * rho + 4 * u * terms.num_keys.double().sqrt() + 16 * u
    bound: torch.Tensor = (
        u_t * terms.out.abs()
        + (1 + u_t) * compute[..., None] * terms.weighted_abs
        + HALF_SUBNORMAL_GAP[dtype]
    )
    return bound


def compare_to_reference(
    out: torch.Tensor, terms: ReferenceTerms, dtype: str, rows: int | None = None
) -> dict[str, Any]:
    """Check `out` against the reference, element by element, within `attention_error_bound`.

    Args:
        out: the kernel's output, [num_tokens, num_heads, head_size] (any device).
        terms: the reference terms of the same inputs.
        dtype: the kernel's dtype name.
        rows: compare only the first `rows` tokens (those the metadata covers); None: all.

    Returns:
        passed, finite, max_abs_error, worst ratio of error to bound, and the worst element.

    Complexity: O(elements).
    """
    import torch

    rows = out.shape[0] if rows is None else rows
    got = out[:rows].to(terms.out.device, torch.float64)
    expected = terms.out[:rows]
    bound = attention_error_bound(terms, dtype)[:rows]
    error = (got - expected).abs()
    finite = bool(got.isfinite().all())
    ratio = torch.where(got.isfinite(), error / bound, torch.full_like(error, math.inf))
    worst = int(ratio.argmax()) if ratio.numel() else 0
    return {
        "passed": finite and bool((error <= bound).all()),
        "finite": finite,
        "max_abs_error": float(error.nan_to_num(math.inf).max()) if error.numel() else 0.0,
        "max_error_over_bound": float(ratio.max()) if ratio.numel() else 0.0,
        "worst_element": list(map(int, torch.unravel_index(torch.tensor(worst), tuple(got.shape))))
        if ratio.numel()
        else [],
    }
