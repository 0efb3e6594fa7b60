"""Hypothesis strategies for the clients' operations and for small requests.

Tokens come from a 2-3 letter alphabet and prompts span few blocks, so equal blocks, shared
prefixes and full hits happen on most runs; LoRA ids, multimodal ranges and cache salts are drawn
from tiny sets so that equal and unequal extra keys both occur.
"""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.harness.client.manager_ops import Arrive
from pagedkv.harness.client.pool_ops import NewRequest
from pagedkv.harness.client.requests import MM_HASHES, SALTS
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.vocab.request import PlaceholderRange, Request

Multimodal = tuple[tuple[int, int, str], ...]


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


@st.composite
def multimodal_inputs(draw: st.DrawFn, num_tokens: int, block_size: int) -> Multimodal:
    """0-2 multimodal inputs as (offset, length, content hash), sorted and disjoint."""
    ranges = draw(placeholder_ranges(num_tokens, block_size))
    return tuple((r.offset, r.length, draw(st.sampled_from(MM_HASHES))) for r in ranges)


@st.composite
def arrivals(
    draw: st.DrawFn,
    alphabet: int,
    longest: int,
    block_size: int,
    *,
    num_earlier: int,
    domain: Domain = FULL_DOMAIN,
) -> Arrive:
    """An arrival: up to `longest` tokens from `range(alphabet)`, maybe after whole blocks of
    one of `num_earlier` earlier requests (with its extra keys, or its own), maybe with a LoRA
    id, multimodal inputs and a salt (as `domain` allows), rarely wanting prompt logprobs."""
    share, share_len, share_keys = -1, 0, False
    if num_earlier and draw(st.booleans(), label="shares a prefix"):
        share = draw(st.integers(0, num_earlier - 1), label="earlier request")
        share_len = block_size * draw(st.integers(1, 4)) + draw(st.sampled_from((0, 0, 1)))
        share_keys = draw(st.booleans(), label="its extra keys")
    tokens = draw(
        st.lists(st.integers(0, alphabet - 1), min_size=0 if share >= 0 else 1, max_size=longest),
        label="tokens",
    )
    mm: Multimodal = ()
    lora, salt = None, None
    if draw(st.booleans(), label="extra keys"):
        if domain.multimodal:
            mm = draw(multimodal_inputs(len(tokens), block_size), label="multimodal")
        lora = draw(st.sampled_from((None, None, 1, 2)), label="lora")
        if domain.cache_salts:
            salt = draw(st.sampled_from((None, None, *SALTS)), label="salt")
    logprobs = draw(st.sampled_from((False,) * 9 + (True,)), label="prompt logprobs")
    return Arrive(tuple(tokens), share, share_len, share_keys, lora, mm, salt, logprobs)


@st.composite
def new_requests(
    draw: st.DrawFn,
    alphabet: int,
    block_size: int,
    *,
    num_earlier: int,
    domain: Domain = FULL_DOMAIN,
) -> NewRequest:
    """A pool client's request: a fresh one, or a follow-up extending an earlier one (same tokens
    and extra keys, then more tokens): follow-ups are what make prefix hits common."""
    if num_earlier and draw(st.booleans(), label="follow-up"):
        follow = draw(st.integers(0, num_earlier - 1), label="earlier")
        more = draw(
            st.lists(st.integers(0, alphabet - 1), max_size=2 * block_size), label="more tokens"
        )
        return NewRequest(tuple(more), follow, 4 * block_size, None, (), None)
    tokens = draw(st.lists(st.integers(0, alphabet - 1), max_size=4 * block_size), label="tokens")
    mm: Multimodal = ()
    lora, salt = None, None
    if draw(st.booleans(), label="extra keys"):
        if domain.multimodal:
            mm = draw(multimodal_inputs(len(tokens), block_size), label="multimodal")
        lora = draw(st.sampled_from((None, None, 1, 2)), label="lora")
        if domain.cache_salts:
            salt = draw(st.sampled_from((None, None, *SALTS)), label="salt")
    return NewRequest(tuple(tokens), -1, 0, lora, mm, salt)
