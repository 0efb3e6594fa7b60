"""One request as the engine drives it: the manager's `Request` plus what scheduling needs.

A request's life::

    WAITING --admitted--> RUNNING --max_tokens or a stop token--> FINISHED
       ^                     |
       +----preempted--------+   (its blocks freed, num_computed_tokens = 0: recomputed later,
                                  prompt and the tokens generated so far, hits included)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.request import Request


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens generated
    STOP = "stop"  # a stop token was generated (it is kept in the output)


@dataclass(eq=False)
class EngineRequest:
    """A prompt to complete greedily with at most `max_tokens` new tokens.

    Attributes:
        request: what the KV cache manager sees (token ids, num_computed_tokens).
        max_tokens: new tokens to generate at most (>= 1).
        stop_token_ids: generating one of these finishes the request.
        arrival_step: the first engine step at which the request may be scheduled.
        status: where the request is in its life (module docstring).
        num_preemptions: times its blocks were taken back.
        finish_reason: why it finished, once it has.
        arrival_time: when it joined the waiting queue (`time.perf_counter()`, set by the
            engine at the start of its arrival step).
        first_token_time: when its first output token was sampled.
        last_token_time: when its latest output token was sampled.
    """

    request: Request
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        rid = self.request.request_id
        if self.request.num_prompt_tokens < 1:
            raise InvalidArgumentError(f"request {rid!r}: the prompt must have at least 1 token")
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise InvalidArgumentError(
                f"request {rid!r}: max_tokens must be an int >= 1, got {self.max_tokens!r}"
            )
        if self.arrival_step < 0:
            raise InvalidArgumentError(
                f"request {rid!r}: arrival_step must be >= 0, got {self.arrival_step}"
            )

    @classmethod
    def from_prompt(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        stop_token_ids: Sequence[int] = (),
        arrival_step: int = 0,
    ) -> EngineRequest:
        return cls(
            Request(request_id, prompt_token_ids),
            max_tokens,
            frozenset(stop_token_ids),
            arrival_step,
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.request.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may generate."""
        return self.request.num_prompt_tokens + self.max_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return self.request.num_tokens - self.request.num_computed_tokens

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first output token, in seconds (None before)."""
        if self.arrival_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first) / (outputs - 1), in seconds
        (vLLM's benchmark's TPOT); None before a second token."""
        num_outputs = len(self.request.output_token_ids)
        if num_outputs < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (num_outputs - 1)

    def append_token(self, token_id: int) -> bool:
        """Record a sampled token; True when the request is now finished."""
        self.request.append_output_token_ids(token_id)
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.request.output_token_ids) >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
