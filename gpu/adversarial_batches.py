"""Batches built to find where a kernel's arithmetic is weakest, checked within the same bound.

Random inputs (`synthetic_batch.make_batch`) keep every probability within a few binades of the
row maximum and every value near 1, so they never reach the corners where a kernel loses
precision. Each kind here is one such corner, laid out like any synthetic batch (NaN-poisoned
paged cache, random page permutation) and compared with the float64 reference within
`error_bound.attention_error_bound`:

- `dominant`: per sequence one key `gap` binades above the rest (gaps `DOMINANT_GAPS`), whose
  value is 0 while every other value is positive: the output is made only of keys with
  `p = 2^-gap`, so any precision lost in small probabilities is the whole error. The kernel
  that split P into two fp16 terms lost keys below `2^-25` and most digits below `2^-13`.
- `long`: one sequence of `LONG_CONTEXT` keys with such a key, read by one CTA (no split).
- `masked`: causal prefill whose last tile no key of the first rows can see, and a sliding
  window cut into forced splits, some of which hold no key for some rows (their partial is
  empty, its log-sum-exp -inf).
- `extreme`: scores of hundreds, values near the dtype's largest and smallest normals, and
  uniform attention over values of both signs (|o| far below `sum p |v|`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.gpu.synthetic_batch import BatchShape, SyntheticBatch, lay_out_batch
from pagedkv.vocab.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

ADVERSARIAL_KINDS: tuple[str, ...] = ("dominant", "long", "masked", "extreme")
DOMINANT_GAPS: tuple[int, ...] = (6, 14, 24, 33, 45, 70)
"""log2 of (the dominant key's probability / every other key's), one sequence each."""
DOMINANT_CONTEXT = 2048
LONG_CONTEXT = 32768
LONG_GAP = 30
VALUE_SCALE = 1024.0
"""Values of the small keys: uniform in [0.5, 1.5] times this, so the outputs stay normal."""
EXTREME_SCALES: dict[str, int] = {"float16": 12, "bfloat16": 100, "float32": 100}
"""log2 of the large and (negated) the small value magnitude of each dtype's `extreme` batch."""
BLOCK_SIZE = 16


@dataclass(frozen=True)
class AdversarialCase:
    """One adversarial batch.

    Attributes:
        kind: one of `ADVERSARIAL_KINDS`.
        batch: the step's tensors.
        num_splits: the split count the kind needs (None: the plan's own).
    """

    kind: str
    batch: SyntheticBatch
    num_splits: int | None


def adversarial_case(
    kind: str, dtype: torch.dtype, head_size: int, seed: int = 0
) -> AdversarialCase:
    """Build one adversarial batch on the CPU.

    Args:
        kind: one of `ADVERSARIAL_KINDS`.
        dtype: float16, bfloat16 or float32.
        head_size: 64, 128 or 256.
        seed: the random draw (the construction is the same for every seed).

    Raises:
        InvalidArgumentError: an unknown kind or dtype.

    Complexity: O(keys * head_size).
    """
    import torch

    name = str(dtype).removeprefix("torch.")
    if kind not in ADVERSARIAL_KINDS or name not in EXTREME_SCALES:
        raise InvalidArgumentError(f"no adversarial {kind!r} batch of {dtype}")
    generator = torch.Generator().manual_seed(seed)
    if kind == "dominant":
        return _dominant(kind, DOMINANT_GAPS, DOMINANT_CONTEXT, dtype, head_size, generator)
    if kind == "long":
        return _dominant(kind, (LONG_GAP,), LONG_CONTEXT, dtype, head_size, generator)
    if kind == "masked":
        return _masked(dtype, head_size, generator)
    return _extreme(EXTREME_SCALES[name], dtype, head_size, generator)


def _layout(
    shape: BatchShape,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> SyntheticBatch:
    import torch

    num_pages = sum(shape.pages_per_seq) + 3
    pages = (torch.randperm(num_pages, generator=generator) + 1).tolist()
    return lay_out_batch(shape, keys, values, query, dtype=dtype, pages=pages)


def _dominant(
    kind: str,
    gaps: tuple[int, ...],
    context: int,
    dtype: torch.dtype,
    head_size: int,
    generator: torch.Generator,
) -> AdversarialCase:
    """Decode rows of a GQA group of 4; per sequence key `context // 3` sits `gap` binades
    above the others (scores scale * q.k: q about 1 everywhere, the key a multiple of 1)."""
    import torch

    heads = 4
    shape = BatchShape((1,) * len(gaps), (context,) * len(gaps), heads, 1, head_size, BLOCK_SIZE)
    query = 1 + 0.05 * torch.randn((len(gaps), heads, head_size), generator=generator)
    keys, values = [], []
    for gap in gaps:
        key = 0.05 * torch.randn((context, 1, head_size), generator=generator)
        key[context // 3] = gap * math.log(2) / math.sqrt(head_size)
        value = VALUE_SCALE * (0.5 + torch.rand((context, 1, head_size), generator=generator))
        value[context // 3] = 0
        keys.append(key)
        values.append(value)
    return AdversarialCase(kind, _layout(shape, keys, values, query, dtype, generator), 1)


def _masked(dtype: torch.dtype, head_size: int, generator: torch.Generator) -> AdversarialCase:
    """Sequence 0: 17 new tokens at positions 95..111 (a 32-key tile starts at 96, past the
    first row); sequence 1: 16 new tokens after 200 under a window of 24, cut into 4 splits."""
    import torch

    shape = BatchShape((17, 16), (112, 216), 2, 2, head_size, BLOCK_SIZE, sliding_window=24)
    keys = [torch.randn((n, 2, head_size), generator=generator) for n in shape.seq_lens]
    values = [torch.randn((n, 2, head_size), generator=generator) for n in shape.seq_lens]
    query = torch.randn((sum(shape.query_lens), 2, head_size), generator=generator)
    return AdversarialCase("masked", _layout(shape, keys, values, query, dtype, generator), 4)


def _extreme(
    scale_log2: int, dtype: torch.dtype, head_size: int, generator: torch.Generator
) -> AdversarialCase:
    """Four decode sequences: scores of hundreds (q and k 16 times larger than normal),
    values 2^scale_log2 and 2^-scale_log2 times normal, and q = 0 (every key weighs the same)
    over 4096 values of both signs."""
    import torch

    heads = 4
    seq_lens = (1000, 700, 700, 4096)
    shape = BatchShape((1,) * len(seq_lens), seq_lens, heads, 1, head_size, BLOCK_SIZE)
    query = torch.randn((len(seq_lens), heads, head_size), generator=generator)
    query[0] *= 16
    query[3] = 0
    keys, values = [], []
    magnitudes = (1.0, 2.0**scale_log2, 2.0**-scale_log2, 1.0)
    for seq, (n, magnitude) in enumerate(zip(seq_lens, magnitudes, strict=True)):
        key = torch.randn((n, 1, head_size), generator=generator) * (16 if seq == 0 else 1)
        keys.append(key)
        values.append(magnitude * torch.randn((n, 1, head_size), generator=generator))
    return AdversarialCase("extreme", _layout(shape, keys, values, query, dtype, generator), None)
