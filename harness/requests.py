"""Hypothesis strategies for small requests whose prefixes collide often.

Tokens come from a 2-3 letter alphabet and prompts span few blocks, so equal blocks, shared
prefixes and full hits happen on most runs; LoRA ids, multimodal ranges and cache salts are drawn
from tiny sets so that equal and unequal extra keys both occur.
"""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.vocab.request import PlaceholderRange, Request

MM_HASHES = ("img-a", "img-b")
SALTS = ("tenant-1", "tenant-2")


@st.composite
def placeholder_ranges(
    draw: st.DrawFn, num_tokens: int, block_size: int = 1
) -> tuple[PlaceholderRange, ...]:
    """0-2 sorted, disjoint ranges inside `[0, num_tokens)`, often starting or ending on a block
    boundary (where off-by-one mistakes in the overlap rule show)."""
    if num_tokens == 0:
        return ()
    cut = st.one_of(
        st.integers(0, num_tokens),
        st.integers(0, num_tokens // block_size).map(lambda k: k * block_size),
    )
    cuts = draw(st.lists(cut, min_size=0, max_size=4, unique=True).map(sorted))
    ranges = [
        PlaceholderRange(start, end - start)
        for start, end in zip(cuts[0::2], cuts[1::2], strict=False)
        if end > start
    ]
    return tuple(ranges)


@st.composite
def requests(
    draw: st.DrawFn,
    request_id: str,
    *,
    alphabet: int,
    max_tokens: int,
    extra_keys: bool = True,
    min_tokens: int = 0,
    salts: bool = True,
    block_size: int = 1,
) -> Request:
    """A request with a prompt of `min_tokens..max_tokens` tokens from `range(alphabet)`.

    With `extra_keys`, maybe multimodal ranges and a LoRA id, and (if `salts`) a cache salt.
    """
    prompt = draw(st.lists(st.integers(0, alphabet - 1), min_size=min_tokens, max_size=max_tokens))
    if not extra_keys:
        return Request(request_id, prompt)
    positions = draw(placeholder_ranges(len(prompt), block_size))
    mm_hashes = [draw(st.sampled_from(MM_HASHES)) for _ in positions]
    return Request(
        request_id,
        prompt,
        mm_positions=positions,
        mm_hashes=mm_hashes,
        lora_id=draw(st.sampled_from((None, None, 1, 2))),
        cache_salt=draw(st.sampled_from((None, None, *SALTS))) if salts else None,
    )
