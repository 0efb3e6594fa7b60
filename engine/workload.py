"""Workloads for `pagedkv run`: a built-in synthetic chat trace, or prompts from a JSONL file.

The chat trace: a few system prompts shared by many requests (a skewed choice, so one is
popular), each followed by a user message; some requests are a later turn of an earlier
conversation (its whole prompt plus a new message), so they share a longer prefix. Requests
arrive over the first steps, so prefills and decodes of others mix in one batch. Everything
derives from one seed.

A JSONL file has one request per line::

    {"prompt_token_ids": [1, 2, 3], "max_tokens": 16}
    {"prompt": "Hello", "id": "greeting", "arrival_step": 4}

`prompt_token_ids` or `prompt` (text, needs the model's tokenizer), and optionally `max_tokens`,
`id` and `arrival_step`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.engine_request import EngineRequest
from pagedkv.vocab.errors import InvalidArgumentError


@dataclass(frozen=True)
class ChatTraceConfig:
    """The shape of the synthetic chat trace.

    Attributes:
        num_requests: requests in the trace.
        max_tokens: (low, high) of each request's `max_tokens`, drawn uniformly.
        num_system_prompts: distinct system prompts.
        system_prompt_tokens: (low, high) length of a system prompt.
        user_tokens: (low, high) length of a user message.
        follow_up_share: chance that a request continues an earlier conversation.
        max_prompt_tokens: follow-ups stop growing past this many prompt tokens.
        arrivals_per_step: requests arriving per engine step, on average.
        seed: the trace's seed.
    """

    num_requests: int = 48
    max_tokens: tuple[int, int] = (12, 48)
    num_system_prompts: int = 3
    system_prompt_tokens: tuple[int, int] = (48, 160)
    user_tokens: tuple[int, int] = (8, 64)
    follow_up_share: float = 0.3
    max_prompt_tokens: int = 384
    arrivals_per_step: float = 1.0
    seed: int = 0

    @classmethod
    def scaled(
        cls, *, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0
    ) -> ChatTraceConfig:
        """The default trace's proportions, scaled to prompts of at most about
        `max_prompt_tokens` (a follow-up may add one user message past it) and outputs of
        `[max_tokens / 4, max_tokens]` tokens.

        Raises:
            InvalidArgumentError: `max_prompt_tokens` < 8 or `max_tokens` < 1.
        """
        if max_prompt_tokens < 8 or max_tokens < 1:
            raise InvalidArgumentError(
                f"prompts need at least 8 tokens and outputs 1, got {max_prompt_tokens} and "
                f"{max_tokens}"
            )
        return cls(
            num_requests=num_requests,
            max_tokens=(max(1, max_tokens // 4), max_tokens),
            system_prompt_tokens=(max(1, max_prompt_tokens // 8), 5 * max_prompt_tokens // 12),
            user_tokens=(max(1, max_prompt_tokens // 48), max(1, max_prompt_tokens // 6)),
            max_prompt_tokens=max_prompt_tokens,
            seed=seed,
        )

    def __post_init__(self) -> None:
        for name in ("max_tokens", "system_prompt_tokens", "user_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidArgumentError(f"{name} must be (low, high) with 1 <= low <= high")
        if self.num_requests < 1 or self.num_system_prompts < 1:
            raise InvalidArgumentError("num_requests and num_system_prompts must be >= 1")
        if not 0.0 <= self.follow_up_share <= 1.0 or self.arrivals_per_step <= 0:
            raise InvalidArgumentError(
                "follow_up_share must be in [0, 1] and arrivals_per_step > 0"
            )


def synthetic_chat_trace(
    config: ChatTraceConfig, *, vocab_size: int, stop_token_ids: Sequence[int] = ()
) -> list[EngineRequest]:
    """The trace's requests, in arrival order (token ids below `vocab_size`)."""
    rng = random.Random(config.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(rng.randint(*bounds))]

    system_prompts = [tokens(config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    prompts: list[list[int]] = []
    requests = []
    arrival = 0.0
    for index in range(config.num_requests):
        earlier = [p for p in prompts if len(p) < config.max_prompt_tokens]
        if earlier and rng.random() < config.follow_up_share:
            prompt = rng.choice(earlier) + tokens(config.user_tokens)
        else:
            system = min(int(rng.paretovariate(1.0)) - 1, len(system_prompts) - 1)
            prompt = system_prompts[system] + tokens(config.user_tokens)
        prompts.append(prompt)
        requests.append(
            EngineRequest.from_prompt(
                f"chat-{index:03d}",
                prompt,
                rng.randint(*config.max_tokens),
                stop_token_ids=stop_token_ids,
                arrival_step=int(arrival),
            )
        )
        arrival += rng.expovariate(config.arrivals_per_step)
    return requests


def load_prompts_jsonl(
    path: str | Path,
    *,
    vocab_size: int,
    default_max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    tokenize: Callable[[str], list[int]] | None = None,
) -> list[EngineRequest]:
    """The requests of a JSONL file (module docstring).

    Args:
        path: the file.
        vocab_size: token ids must be below it.
        default_max_tokens: for lines without `max_tokens`.
        stop_token_ids: the model's stop tokens.
        tokenize: text -> token ids, for `prompt` lines; None: such lines are refused.

    Raises:
        InvalidArgumentError: the file cannot be read or has no request, or a line (named as
            `FILE:LINE`) is not a JSON object, has no or a bad prompt, a bad `max_tokens`,
            `id` or `arrival_step`, a token id outside the vocabulary, or a repeated id.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read {path}: {error}") from error
    requests: list[EngineRequest] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        item = _parse_line(
            line, where, f"line-{number}", vocab_size, default_max_tokens, stop_token_ids, tokenize
        )
        if item.request_id in seen:
            raise InvalidArgumentError(f"{where}: id {item.request_id!r} is used twice")
        seen.add(item.request_id)
        requests.append(item)
    if not requests:
        raise InvalidArgumentError(f"{path} holds no request")
    return requests


def _parse_line(
    line: str,
    where: str,
    default_id: str,
    vocab_size: int,
    default_max_tokens: int,
    stop_token_ids: Sequence[int],
    tokenize: Callable[[str], list[int]] | None,
) -> EngineRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{where}: not JSON: {error}") from error
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}: a line must be a JSON object")
    unknown = set(record) - {"prompt_token_ids", "prompt", "max_tokens", "id", "arrival_step"}
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown keys {sorted(unknown)}")
    if ("prompt_token_ids" in record) == ("prompt" in record):
        raise InvalidArgumentError(f"{where}: give exactly one of prompt_token_ids and prompt")
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise InvalidArgumentError(f"{where}: prompt must be a string")
        if tokenize is None:
            raise InvalidArgumentError(
                f"{where}: a text prompt needs a tokenizer: pass --model with a tokenizer, or "
                f"give prompt_token_ids"
            )
        token_ids = tokenize(record["prompt"])
    else:
        token_ids = record["prompt_token_ids"]
    if (
        not isinstance(token_ids, list)
        or not token_ids
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)
    ):
        raise InvalidArgumentError(f"{where}: the prompt must be a non-empty list of token ids")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )
    request_id = record.get("id", default_id)
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"{where}: id must be a non-empty string")
    max_tokens = _int_field(record, "max_tokens", default_max_tokens, 1, where)
    arrival_step = _int_field(record, "arrival_step", 0, 0, where)
    return EngineRequest.from_prompt(
        request_id,
        token_ids,
        max_tokens,
        stop_token_ids=stop_token_ids,
        arrival_step=arrival_step,
    )


def _int_field(record: dict[str, object], name: str, default: int, minimum: int, where: str) -> int:
    value = record.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return value
