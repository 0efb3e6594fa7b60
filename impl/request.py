"""The request: what the block manager needs to know about one sequence.

Only the fields that hashing and allocation read: token ids, multimodal placeholders and their
content hashes, the LoRA adapter, the tenant's cache salt, whether prompt logprobs are wanted,
speculative tokens, and how many tokens are computed. Scheduling state lives elsewhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from pagedkv.errors import InvalidArgumentError


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one multimodal input sits in the prompt: tokens `[offset, offset + length)`."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise InvalidArgumentError(
                f"placeholder range needs offset >= 0 and length > 0, got "
                f"offset={self.offset}, length={self.length}"
            )

    @property
    def end(self) -> int:
        """One past the last token of the input."""
        return self.offset + self.length


class TokenView(Sequence[int]):
    """A read-only view of a token list (slices are copies)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView):
            return self._tokens == other._tokens
        return isinstance(other, (list, tuple)) and list(other) == self._tokens

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._tokens)


class Request:
    """One sequence as the KV cache manager sees it.

    The prompt, multimodal placeholders, LoRA id and cache salt are fixed at construction and
    validated there: placeholders must be sorted, disjoint, inside the prompt, and paired one to
    one with `mm_hashes`. Output tokens grow with `append_output_token_ids`; speculative tokens
    and `num_computed_tokens` are set by the scheduler.

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: the prompt, immutable.
        mm_positions: placeholder ranges of multimodal inputs, sorted by offset.
        mm_hashes: content hash of each multimodal input (same length as `mm_positions`).
        lora_id: the LoRA adapter's integer id, or None.
        cache_salt: a tenant secret; requests with different salts never share a block.
        prompt_logprobs: the request wants prompt logprobs (it skips the prefix cache).
        spec_token_ids: speculative (draft) tokens scheduled but not yet accepted.
        num_computed_tokens: tokens whose KV is already in the cache.
    """

    __slots__ = (
        "_all_token_ids",
        "_token_view",
        "cache_salt",
        "lora_id",
        "mm_hashes",
        "mm_positions",
        "num_computed_tokens",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "spec_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        mm_positions: Sequence[PlaceholderRange] = (),
        mm_hashes: Sequence[str] = (),
        lora_id: int | None = None,
        cache_salt: str | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        if len(mm_positions) != len(mm_hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: {len(mm_positions)} multimodal placeholder ranges but "
                f"{len(mm_hashes)} multimodal hashes; they must pair one to one"
            )
        for prev, cur in itertools.pairwise(mm_positions):
            if cur.offset < prev.end:
                raise InvalidArgumentError(
                    f"request {request_id!r}: multimodal ranges must be sorted and disjoint, "
                    f"got {prev} before {cur}"
                )
        if mm_positions and mm_positions[-1].end > len(prompt_token_ids):
            raise InvalidArgumentError(
                f"request {request_id!r}: multimodal range {mm_positions[-1]} ends past the "
                f"prompt ({len(prompt_token_ids)} tokens)"
            )
        if lora_id is not None and lora_id <= 0:
            raise InvalidArgumentError(f"request {request_id!r}: lora_id must be > 0")
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._token_view = TokenView(self._all_token_ids)
        self.mm_positions: tuple[PlaceholderRange, ...] = tuple(mm_positions)
        self.mm_hashes: tuple[str, ...] = tuple(mm_hashes)
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.prompt_logprobs = prompt_logprobs
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output tokens, read-only: tokens are only ever appended.

        Because a request's tokens never change, block hashes stored for it stay valid for as
        long as the same object is used (the manager refuses another object with the same id).
        """
        return self._token_view

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self._all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens (one id or several)."""
        if isinstance(token_ids, int):
            self._all_token_ids.append(token_ids)
        else:
            self._all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        extras = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("mm_positions", self.mm_positions),
                ("lora_id", self.lora_id),
            )
            if value
        )
        if self.cache_salt is not None:
            extras += ", cache_salt=<redacted>"
        return (
            f"Request({self.request_id!r}, tokens={self._all_token_ids!r}, "
            f"num_computed_tokens={self.num_computed_tokens}{extras})"
        )
