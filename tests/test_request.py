"""Request validation: inconsistent multimodal data or LoRA ids fail at construction."""

from __future__ import annotations

import pytest

from pagedkv import InvalidArgumentError, PlaceholderRange, Request


def test_tokens_grow_with_outputs() -> None:
    request = Request("r", [1, 2])
    request.append_output_token_ids(3)
    request.append_output_token_ids([4, 5])
    assert list(request.all_token_ids) == [1, 2, 3, 4, 5]
    assert list(request.output_token_ids) == [3, 4, 5]
    assert (request.num_tokens, request.num_prompt_tokens) == (5, 2)


def test_the_live_token_list_is_one_list_that_grows() -> None:
    request = Request("r", [1, 2])
    tokens = request.live_token_ids()
    request.append_output_token_ids(3)
    request.append_output_token_ids([4, 5])
    assert request.live_token_ids() is tokens
    assert tokens == [1, 2, 3, 4, 5] == list(request.all_token_ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mm_positions": [PlaceholderRange(0, 1)], "mm_hashes": []}, "pair one to one"),
        (
            {
                "mm_positions": [PlaceholderRange(2, 2), PlaceholderRange(3, 1)],
                "mm_hashes": ["a", "b"],
            },
            "sorted and disjoint",
        ),
        ({"mm_positions": [PlaceholderRange(3, 2)], "mm_hashes": ["a"]}, "ends past the prompt"),
        ({"lora_id": 0}, r"lora_id must be an int in \[1, 2147483647\]"),
    ],
)
def test_inconsistent_requests_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Request("r", [0, 0, 0, 0], **kwargs)  # type: ignore[arg-type]


def test_placeholder_ranges_must_be_non_empty() -> None:
    with pytest.raises(InvalidArgumentError):
        PlaceholderRange(0, 0)
    with pytest.raises(InvalidArgumentError):
        PlaceholderRange(-1, 2)


def test_repr_never_shows_the_cache_salt() -> None:
    assert "secret" not in repr(Request("r", [1], cache_salt="secret"))
    assert "redacted" in repr(Request("r", [1], cache_salt="secret"))
