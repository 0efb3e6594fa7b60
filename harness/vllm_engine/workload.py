"""The requests of a vLLM tier run: seeded token-id prompts with shared prefixes, greedy lengths.

Every prompt is drawn from one `random.Random(seed)`, so a seed and a count give the same list
in every process. Most prompts start with the common prefix of one of a few families (a few
whole blocks: what the prefix cache can hit) and end with a suffix of their own; the rest share
nothing. Some prompts are longer than the engine's token budget per step, so their prefill is
chunked. Token ids avoid 0 (no special meaning is given to any id: the models have no stop
token, and the sampling ignores EOS).

Generation is greedy (temperature 0) with `ignore_eos`, so each request's output length is its
`max_tokens` and the same prompts give the same tokens in any mode whose cache is right.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadShape:
    """How a workload is drawn.

    Attributes:
        block_size: the engine's block size in tokens; prefixes are whole blocks of it.
        num_families: how many families of common prefixes.
        prefix_blocks: the shortest and longest family prefix, in blocks.
        family_share: the fraction of prompts that start with a family's prefix.
        suffix_tokens: the shortest and longest suffix after a family prefix.
        lone_tokens: the shortest and longest prompt that shares nothing.
        long_share: the fraction of prompts drawn long (`long_tokens`), longer than one chunk.
        long_tokens: the shortest and longest long prompt.
        max_tokens: the fewest and most tokens a request generates.
    """

    vocab_size: int = 512
    block_size: int = 32
    num_families: int = 4
    prefix_blocks: tuple[int, int] = (1, 3)
    family_share: float = 0.75
    suffix_tokens: tuple[int, int] = (4, 48)
    lone_tokens: tuple[int, int] = (8, 64)
    long_share: float = 0.15
    long_tokens: tuple[int, int] = (100, 160)
    max_tokens: tuple[int, int] = (4, 24)


DEFAULT_SHAPE = WorkloadShape()


@dataclass(frozen=True)
class Workload:
    """The requests, in the order they are submitted.

    Attributes:
        prompts: each request's prompt token ids.
        max_tokens: each request's output length (greedy, EOS ignored).
        families: each request's family index, or None for one that shares no prefix.
    """

    seed: int
    shape: WorkloadShape
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    families: tuple[int | None, ...]

    @property
    def num_requests(self) -> int:
        """How many requests."""
        return len(self.prompts)

    def num_longer_than(self, num_tokens: int) -> int:
        """How many prompts have more than `num_tokens` tokens (those a budget of `num_tokens`
        tokens per step must chunk)."""
        return sum(len(prompt) > num_tokens for prompt in self.prompts)


def make_workload(
    num_requests: int, seed: int = 0, shape: WorkloadShape = DEFAULT_SHAPE
) -> Workload:
    """`num_requests` requests drawn from `seed` (see the module's docstring).

    A family's prefix is its first `prefix_blocks` blocks; a long prompt takes a family prefix
    when it is drawn in a family and pads the rest with its own tokens.

    Complexity: O(total prompt tokens).

    Raises:
        ValueError: `num_requests` is negative.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, shape.vocab_size) for _ in range(count)]

    prefixes = [
        tokens(shape.block_size * rng.randint(*shape.prefix_blocks))
        for _ in range(shape.num_families)
    ]
    prompts: list[tuple[int, ...]] = []
    max_tokens: list[int] = []
    families: list[int | None] = []
    for _ in range(num_requests):
        family: int | None = None
        prompt: list[int] = []
        if rng.random() < shape.family_share:
            family = rng.randrange(shape.num_families)
            prompt = list(prefixes[family])
        if rng.random() < shape.long_share:
            prompt += tokens(max(1, rng.randint(*shape.long_tokens) - len(prompt)))
        elif family is not None:
            prompt += tokens(rng.randint(*shape.suffix_tokens))
        else:
            prompt = tokens(rng.randint(*shape.lone_tokens))
        prompts.append(tuple(prompt))
        max_tokens.append(rng.randint(*shape.max_tokens))
        families.append(family)
    return Workload(seed, shape, tuple(prompts), tuple(max_tokens), tuple(families))
