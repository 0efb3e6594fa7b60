"""The part of the call space a campaign draws from: everything, unless an implementation is
known to differ from the spec outside it for reasons documented in docs/semantics.md."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.vocab.request import Request


@dataclass(frozen=True)
class Domain:
    """Restrictions on what the state machines draw; the defaults restrict nothing.

    Attributes:
        min_window: the narrowest sliding window drawn (tokens).
        eagle_with_sliding_window: whether a sliding-window manager may run with `use_eagle`.
        multimodal: whether requests carry multimodal inputs.
    """

    min_window: int = 1
    eagle_with_sliding_window: bool = True
    multimodal: bool = True

    def admit(self, request: Request) -> Request:
        """`request` as the domain allows it: without multimodal inputs if it has none.

        (The machines restrict drawn requests here rather than in the strategy, so that the
        strategy, and the derandomized examples CI draws from it, stay as they are.)
        """
        if self.multimodal or not request.mm_positions:
            return request
        return Request(
            request.request_id,
            request.prompt_token_ids,
            lora_id=request.lora_id,
            cache_salt=request.cache_salt,
            prompt_logprobs=request.prompt_logprobs,
        )

    def describe(self) -> str:
        """The restrictions in words, or "" for the full domain."""
        parts = []
        if self.min_window > 1:
            parts.append(f"windows of {self.min_window}+ tokens")
        if not self.eagle_with_sliding_window:
            parts.append("no eagle with a sliding window")
        if not self.multimodal:
            parts.append("no multimodal inputs")
        return ", ".join(parts)


FULL_DOMAIN = Domain()
