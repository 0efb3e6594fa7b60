"""The refusals of the vocabulary's constructors and of `Request.append_output_token_ids`, word
for word.

A `KVCacheBlock`, a `FreeKVCacheBlockQueue` or a `Request` built from a bad value, and a token
list that is no list of token ids, are refused with a typed error that names the call, the
argument (with its index inside a list), the rule and the value; a refused append leaves the
request's tokens as they were. The accepted edges are shown too: token ids 0 and MAX_TOKEN_ID,
a tuple, an iterator.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv import KVCacheBlock, Request
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.vocab.errors import ArgumentTypeError, FreeQueueError, InvalidArgumentError
from pagedkv.vocab.request import MAX_TOKEN_ID, PlaceholderRange

IN_RANGE = f"must be an int in [0, {MAX_TOKEN_ID}]"


def _in_use_block() -> KVCacheBlock:
    block = KVCacheBlock(4)
    block.ref_cnt = 1
    return block


def _block_of_another_queue() -> KVCacheBlock:
    block = KVCacheBlock(5)
    FreeKVCacheBlockQueue([block])
    return block


def _twice() -> FreeKVCacheBlockQueue:
    block = KVCacheBlock(3)
    return FreeKVCacheBlockQueue([block, block])


CONSTRUCTIONS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "a block id of another type",
        lambda: KVCacheBlock("1"),
        ArgumentTypeError,
        "KVCacheBlock: block_id must be an int, got '1' (str)",
    ),
    (
        "a bool block id",
        lambda: KVCacheBlock(True),
        ArgumentTypeError,
        "KVCacheBlock: block_id must be an int, got True (bool)",
    ),
    (
        "a queue of no iterable",
        lambda: FreeKVCacheBlockQueue(5),  # type: ignore[arg-type]
        ArgumentTypeError,
        "FreeKVCacheBlockQueue: blocks must be an iterable, got 5",
    ),
    (
        "a queue item that is no block",
        lambda: FreeKVCacheBlockQueue([KVCacheBlock(1), "x"]),  # type: ignore[list-item]
        ArgumentTypeError,
        "FreeKVCacheBlockQueue: blocks[1] must be a KVCacheBlock, got 'x' (str)",
    ),
    (
        "a block listed twice",
        _twice,
        FreeQueueError,
        "block 3: a block listed twice for a new free queue",
    ),
    (
        "a block in use",
        lambda: FreeKVCacheBlockQueue([_in_use_block()]),
        FreeQueueError,
        "block 4: a block in use cannot start in a free queue (ref_cnt != 0)",
    ),
    (
        "a block of another queue",
        lambda: FreeKVCacheBlockQueue([_block_of_another_queue()]),
        FreeQueueError,
        "block 5: a block of another free queue",
    ),
    (
        "a request id of another type",
        lambda: Request(5, [1]),  # type: ignore[arg-type]
        ArgumentTypeError,
        "Request: request_id must be a str, got 5",
    ),
    (
        "a prompt token out of range",
        lambda: Request("r", [1, -1]),
        InvalidArgumentError,
        f"Request 'r': prompt_token_ids[1] {IN_RANGE}, got -1",
    ),
    (
        "multimodal positions of no iterable",
        lambda: Request("r", [1, 2], mm_positions=5, mm_hashes=[]),  # type: ignore[arg-type]
        ArgumentTypeError,
        "Request 'r': mm_positions must be an iterable, got 5",
    ),
    (
        "a multimodal position that is no range",
        lambda: Request("r", [1, 2], mm_positions=[5], mm_hashes=["h"]),  # type: ignore[list-item]
        ArgumentTypeError,
        "Request 'r': mm_positions[0] must be a PlaceholderRange, got 5",
    ),
    (
        "multimodal hashes of no iterable",
        lambda: Request("r", [1, 2], mm_positions=[], mm_hashes=5),  # type: ignore[arg-type]
        ArgumentTypeError,
        "Request 'r': mm_hashes must be an iterable, got 5",
    ),
    (
        "a multimodal hash that is no str",
        lambda: Request(
            "r",
            [1, 2],
            mm_positions=[PlaceholderRange(0, 1)],
            mm_hashes=[5],  # type: ignore[list-item]
        ),
        ArgumentTypeError,
        "Request 'r': mm_hashes[0] must be a str, got 5",
    ),
    (
        "LoRA id 0",
        lambda: Request("r", [1], lora_id=0),
        InvalidArgumentError,
        f"Request 'r': lora_id must be an int in [1, {2**31 - 1}], got 0",
    ),
    (
        "prompt_logprobs of another type",
        lambda: Request("r", [1], prompt_logprobs=1),  # type: ignore[arg-type]
        ArgumentTypeError,
        "Request 'r': prompt_logprobs must be a bool, got 1",
    ),
]


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [case[1:] for case in CONSTRUCTIONS],
    ids=[case[0] for case in CONSTRUCTIONS],
)
def test_a_bad_construction_is_refused_word_for_word(
    build: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        build()
    assert type(info.value) is error
    assert str(info.value) == message


APPEND = "Request.append_output_token_ids for request 'r'"
APPENDS: list[tuple[str, object, type[Exception], str]] = [
    ("a token below 0", -1, InvalidArgumentError, f"{APPEND}: token_ids {IN_RANGE}, got -1"),
    (
        "a token past MAX_TOKEN_ID",
        MAX_TOKEN_ID + 1,
        InvalidArgumentError,
        f"{APPEND}: token_ids {IN_RANGE}, got {MAX_TOKEN_ID + 1}",
    ),
    (
        "a bool",
        True,
        ArgumentTypeError,
        f"{APPEND}: token_ids must be an iterable, got True (bool)",
    ),
    (
        "a list with a token below 0",
        [1, -1],
        InvalidArgumentError,
        f"{APPEND}: token_ids[1] {IN_RANGE}, got -1",
    ),
    (
        "a list with a token past MAX_TOKEN_ID",
        [MAX_TOKEN_ID + 1],
        InvalidArgumentError,
        f"{APPEND}: token_ids[0] {IN_RANGE}, got {MAX_TOKEN_ID + 1}",
    ),
    (
        "a list with a bool",
        [True],
        ArgumentTypeError,
        f"{APPEND}: token_ids[0] {IN_RANGE}, got True (bool)",
    ),
    (
        "a str",
        "ab",
        ArgumentTypeError,
        f"{APPEND}: token_ids must be an iterable of token ids, got 'ab' (str)",
    ),
]


@pytest.mark.parametrize(
    ("token_ids", "error", "message"),
    [case[1:] for case in APPENDS],
    ids=[case[0] for case in APPENDS],
)
def test_a_bad_append_is_refused_word_for_word_and_changes_nothing(
    token_ids: object, error: type[Exception], message: str
) -> None:
    request = Request("r", [1, 2])
    request.append_output_token_ids(3)
    with pytest.raises(error) as info:
        request.append_output_token_ids(token_ids)  # type: ignore[arg-type]
    assert type(info.value) is error
    assert str(info.value) == message
    assert list(request.all_token_ids) == [1, 2, 3]
    assert list(request.output_token_ids) == [3]


def test_the_edges_of_the_token_range_and_every_sequence_type_are_appended() -> None:
    request = Request("r", [1])
    request.append_output_token_ids(0)
    request.append_output_token_ids(MAX_TOKEN_ID)
    request.append_output_token_ids([0, MAX_TOKEN_ID])
    request.append_output_token_ids((4, 5))
    request.append_output_token_ids(iter([6]))
    assert list(request.output_token_ids) == [0, MAX_TOKEN_ID, 0, MAX_TOKEN_ID, 4, 5, 6]
    assert request.num_tokens == 8
