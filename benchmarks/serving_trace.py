"""A deterministic serving trace: conversations over a few long system prompts.

Each conversation starts from one of a handful of system prompts (hundreds of tokens, shared by
many requests), then runs one to four turns; turn k's prompt is turn k-1's prompt and output
plus a new user message, so follow-ups hit their own history too. Outputs are tens to hundreds
of tokens. Everything derives from one seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TraceConfig:
    """Sizes of the trace (defaults: a few minutes of a small deployment)."""

    seed: int = 0
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (384, 1024)
    num_conversations: int = 160
    turns: tuple[int, int] = (1, 4)
    user_tokens: tuple[int, int] = (16, 160)
    output_tokens: tuple[int, int] = (16, 256)
    vocab_size: int = 32_000
    arrivals_per_step: float = 0.5


@dataclass
class Turn:
    """One request of a conversation: the new user message and how many tokens it generates."""

    user_tokens: list[int]
    output_tokens: list[int]


@dataclass
class Conversation:
    """A system prompt and its turns; `arrival_step` is when the first turn arrives."""

    conversation_id: int
    system_prompt: list[int]
    turns: list[Turn]
    arrival_step: int
    history: list[int] = field(default_factory=list)


def make_trace(config: TraceConfig) -> list[Conversation]:
    """The conversations of the trace, in arrival order."""
    rng = random.Random(config.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(config.vocab_size) for _ in range(rng.randint(*bounds))]

    system_prompts = [tokens(config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    conversations = []
    step = 0.0
    for conversation_id in range(config.num_conversations):
        step += rng.expovariate(config.arrivals_per_step)
        turns = [
            Turn(tokens(config.user_tokens), tokens(config.output_tokens))
            for _ in range(rng.randint(*config.turns))
        ]
        # A few popular system prompts carry most of the traffic.
        system_prompt = system_prompts[
            min(int(rng.paretovariate(1.2)) - 1, len(system_prompts) - 1)
        ]
        conversations.append(Conversation(conversation_id, system_prompt, turns, int(step)))
    return conversations
