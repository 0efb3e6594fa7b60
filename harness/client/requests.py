"""The requests a client sends, and its own record of each, checked against the `Request`.

Both sides of a pair read the same `Request` objects, so a mistake in the shared `Request` type
(a token dropped on append, a salt lost at construction) would change both alike and never show
as a divergence. The client therefore keeps its own record of what it sent (the id, the prompt,
the extra keys, every token it appended, the computed count it set) and holds the request to it:
the cheap fields after every step that touched the request, every field on a full check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.harness.divergence import Divergence
from pagedkv.harness.domain import MultimodalInputs
from pagedkv.vocab.request import PlaceholderRange, Request

MM_HASHES = ("img-a", "img-b")
"""Content hashes multimodal inputs are drawn from (few: equal and unequal keys both occur)."""
SALTS = ("tenant-1", "tenant-2")
"""Cache salts requests are drawn from."""

STEP_FIELDS = (
    "request_id",
    "num_tokens",
    "all_token_ids (the last ones)",
    "num_computed_tokens",
    "spec_token_ids",
)
"""What `RequestRecord.check` compares, in order."""
ALL_FIELDS = (
    "prompt_token_ids",
    "all_token_ids",
    "output_token_ids",
    "num_prompt_tokens",
    "mm_positions",
    "mm_hashes",
    "lora_id",
    "cache_salt",
    "prompt_logprobs",
)
"""What `RequestRecord.check_all` compares after `check`'s fields, in order."""


@dataclass
class RequestRecord:
    """What the client sent for one request, kept apart from the `Request` object.

    Attributes:
        request: the object both sides are given.
        request_id, prompt, mm, lora_id, cache_salt, prompt_logprobs: what it was built with.
        tokens: every token, the prompt's and those the client appended.
        num_computed_tokens: the value the client last set.
        appended: how many tokens the last append added (the cheap check compares them).
    """

    request: Request
    request_id: str
    prompt: tuple[int, ...]
    mm: MultimodalInputs
    lora_id: int | None
    cache_salt: str | None
    prompt_logprobs: bool
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    appended: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append(self, token_ids: list[int]) -> None:
        """Append generated tokens to the request and to the record."""
        self.request.append_output_token_ids(token_ids)
        self.tokens.extend(token_ids)
        self.appended = len(token_ids)

    def set_computed(self, num_computed_tokens: int) -> None:
        self.request.num_computed_tokens = num_computed_tokens
        self.num_computed_tokens = num_computed_tokens

    def check(self, operation: str) -> None:
        """The fields a step may change: the id, the token count, the last tokens appended, the
        computed count, no draft left behind.

        Raises:
            Divergence: ("request", operation, the field) on the first that differs.
        """
        request = self.request
        tail = -self.appended if self.appended else len(self.tokens)
        seen = (
            request.request_id,
            request.num_tokens,
            list(request.all_token_ids[tail:]),
            request.num_computed_tokens,
            request.spec_token_ids,
        )
        no_drafts: list[int] = []
        sent = (
            self.request_id,
            len(self.tokens),
            self.tokens[tail:],
            self.num_computed_tokens,
            no_drafts,
        )
        if seen != sent:
            self._expect_all(operation, STEP_FIELDS, seen, sent)

    def check_all(self, operation: str) -> None:
        """Every observable field of the request against the record.

        Raises:
            Divergence: ("request", operation, the field) on the first that differs.
        """
        self.check(operation)
        request = self.request
        prompt_length = len(self.prompt)
        seen = (
            tuple(request.prompt_token_ids),
            list(request.all_token_ids),
            list(request.output_token_ids),
            request.num_prompt_tokens,
            tuple((p.offset, p.length) for p in request.mm_positions),
            tuple(request.mm_hashes),
            request.lora_id,
            request.cache_salt,
            request.prompt_logprobs,
        )
        sent = (
            self.prompt,
            self.tokens,
            self.tokens[prompt_length:],
            prompt_length,
            tuple((offset, length) for offset, length, _ in self.mm),
            tuple(h for *_, h in self.mm),
            self.lora_id,
            self.cache_salt,
            self.prompt_logprobs,
        )
        if seen != sent:
            self._expect_all(operation, ALL_FIELDS, seen, sent)

    def _expect_all(
        self,
        operation: str,
        names: tuple[str, ...],
        seen: tuple[object, ...],
        sent: tuple[object, ...],
    ) -> None:
        """`_expect` field by field, in order (the first that differs raises)."""
        for name, seen_value, sent_value in zip(names, seen, sent, strict=True):
            self._expect(operation, name, seen_value, sent_value)

    def _expect(self, operation: str, name: str, seen: object, sent: object) -> None:
        if seen != sent:
            raise Divergence(
                f"request {self.request_id!r}: its {name} is {seen!r}, but the client sent "
                f"{sent!r} (the shared Request type lost or changed it)",
                "request",
                operation,
                name,
            )


def new_request(
    request_id: str,
    tokens: list[int],
    mm: MultimodalInputs,
    lora_id: int | None,
    cache_salt: str | None,
    prompt_logprobs: bool = False,
) -> RequestRecord:
    """A `Request` with these fields, and the client's record of it."""
    request = Request(
        request_id,
        tokens,
        mm_positions=[PlaceholderRange(offset, length) for offset, length, _ in mm],
        mm_hashes=[content for _, _, content in mm],
        lora_id=lora_id,
        cache_salt=cache_salt,
        prompt_logprobs=prompt_logprobs,
    )
    return RequestRecord(
        request,
        request_id,
        tuple(tokens),
        mm,
        lora_id,
        cache_salt,
        prompt_logprobs,
        tokens=list(tokens),
    )
