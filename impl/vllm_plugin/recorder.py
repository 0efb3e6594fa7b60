"""vLLM's calls as trace lines (`pagedkv.vllm_plugin.trace`): what a vLLM `Request` is in
pagedkv's terms, and what each call asked.

A vLLM request id names one request object from its first call to the free that finishes it
(vLLM may reuse the id after). The recorder sends a request's identity once and then only the
tokens it gained, so a trace holds each token once.
"""

from __future__ import annotations

from typing import Any

from pagedkv.vocab.errors import PagedKVError

from .trace import Event


class RequestOutOfDomainError(PagedKVError):
    """A vLLM request pagedkv's `Request` cannot stand for (prompt embeddings, a token list
    that shrank)."""


def block_ids(groups: Any) -> list[list[int]]:
    """Block ids per group of vLLM's `KVCacheBlocks`, pagedkv's block lists or the spec's ids."""
    blocks = getattr(groups, "blocks", groups)
    return [
        [block if isinstance(block, int) else block.block_id for block in group] for group in blocks
    ]


class Recorder:
    """Turns each call on the manager into one trace line (`event`), keeping per request id
    the vLLM object it names and how many of its tokens were sent."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.index = 0
        self._sent: dict[str, tuple[Any, int]] = {}
        self._lora_ids: dict[tuple[str, str], int] = {}

    def event(self, call: str, request: Any | None = None, **fields: Any) -> Event:
        event: Event = {"i": self.index, "call": call}
        self.index += 1
        if request is not None:
            event.update(self._request_fields(request))
        event.update(fields)
        return event

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def lookahead(self, request: Any, hits: int, num_new_tokens: int, lookahead: int) -> int:
        """Lookahead slots as vLLM's manager grants them: never past max_model_len."""
        used: int = request.num_computed_tokens + hits + num_new_tokens
        return max(0, min(lookahead, self.max_model_len - used))

    def _request_fields(self, request: Any) -> Event:
        request_id = request.request_id
        tokens = request.all_token_ids
        fields: Event = {"req": request_id}
        known = self._sent.get(request_id)
        if known is None or known[0] is not request:
            if getattr(request, "prompt_embeds", None) is not None:
                raise RequestOutOfDomainError(f"request {request_id!r}: prompt embeddings")
            prompt = list(request.prompt_token_ids or ())
            fields["new"] = {
                "prompt": prompt,
                "salt": getattr(request, "cache_salt", None),
                "lora": self._lora_id(getattr(request, "lora_request", None)),
                "logprobs": bool(getattr(request, "skip_reading_prefix_cache", False)),
                "mm": [
                    [
                        str(feature.identifier),
                        feature.mm_position.offset,
                        feature.mm_position.length,
                    ]
                    for feature in getattr(request, "mm_features", None) or ()
                ],
            }
            sent = len(prompt)
        else:
            sent = known[1]
        if len(tokens) < sent:
            raise RequestOutOfDomainError(
                f"request {request_id!r}: its tokens shrank from {sent} to {len(tokens)}"
            )
        if len(tokens) > sent:
            fields["add"] = list(tokens[sent:])
        self._sent[request_id] = (request, len(tokens))
        fields["computed"] = request.num_computed_tokens
        return fields

    def _lora_id(self, lora: Any) -> int | None:
        if lora is None:
            return None
        key = (str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "")))
        return self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
