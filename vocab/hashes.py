"""Block keys and the functions that hash them: the prefix cache's vocabulary.

A full block's key is a `BlockHashType`: the chained hash value (block k's value covers its
tokens, its extra keys and block k-1's value, so two requests share block k only if blocks 0..k
agree), its token ids, and its extra keys. The index compares whole keys, so equal hash values
with different tokens or extra keys never hit.

A block's extra keys hold, in order, the LoRA id (an int), each multimodal input overlapping
the block (a `MultimodalKey`: its content hash and where it lies relative to the block; under
vLLM 0.8.5's semantics its content hash alone, a str) and the tenant's `CacheSalt` (a type of its
own). `Request` validates those types, so no value of one field can imitate another's: a
multimodal hash is never a salt, a salt never a LoRA id.

How a request's blocks are keyed is each side's own: `pagedkv.spec.block_hash` defines it plainly,
`pagedkv.block_hash` computes it fast.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, TypeAlias

from pagedkv.vocab.arguments import require_str
from pagedkv.vocab.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class CacheSalt:
    """A tenant's cache salt as an extra key; equal only to a `CacheSalt` with the same value.

    Its repr hides the value: block hashes end up in logs and error messages.
    """

    value: str

    def __repr__(self) -> str:
        return "CacheSalt(<redacted>)"


@dataclass(frozen=True, slots=True)
class MultimodalKey:
    """A multimodal input as an extra key of a block starting at token s: its content hash,
    where it starts relative to the block (`offset - s`, negative when it began in an earlier
    block) and its length in tokens. Which token of which input sits in each slot is then
    fixed by the key: two blocks with the same tokens and the same image at different places
    hold different KV and never share a key (vLLM 0.33 keys the hash and the relative offset;
    its identifiers fix an input's length)."""

    mm_hash: str
    offset: int
    length: int


ExtraKey: TypeAlias = "int | str | MultimodalKey | CacheSalt"
"""A LoRA id (int), a multimodal input (`MultimodalKey`; its content hash alone, a str, under
vLLM 0.8.5's semantics), or a tenant's cache salt (`CacheSalt`)."""

HashFn: TypeAlias = Callable[[object], int]
HashAlgo: TypeAlias = Literal["sha256", "builtin"]


class BlockHashType(NamedTuple):
    """A full block's identity: chained hash value, its token ids, and its extra keys."""

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...] | None = None


class GroupKey(NamedTuple):
    """The index key of a block cached for KV cache group `group_id` (> 0) of a hybrid model.

    Every group of a model keeps its own layers' KV for the same tokens in its own blocks, so
    the pool indexes a block under its hash and its group. Group 0's key is the `BlockHashType`
    itself: a single-group manager's keys are unchanged.
    """

    group_id: int
    block_hash: BlockHashType


CacheKey: TypeAlias = "BlockHashType | GroupKey"
"""What the pool's index is keyed by, and what a cached block carries as its hash."""


def cache_key(block_hash: BlockHashType, group_id: int) -> CacheKey:
    """The index key of a block of group `group_id` whose contents hash to `block_hash`."""
    return block_hash if group_id == 0 else GroupKey(group_id, block_hash)


def key_hash(key: CacheKey) -> BlockHashType:
    """The block hash inside an index key."""
    return key.block_hash if isinstance(key, GroupKey) else key


def key_group(key: CacheKey) -> int:
    """The KV cache group of an index key."""
    return key.group_id if isinstance(key, GroupKey) else 0


_pickle_dumps = pickle.dumps
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_sha256 = hashlib.sha256
_int_from_bytes = int.from_bytes


def sha256(obj: object) -> int:
    """SHA-256 of the pickled object (highest protocol), as a big-endian int: vLLM 0.8.5's
    `sha256`, stable across processes. Its callees are bound once (once per block hashed)."""
    return _int_from_bytes(_sha256(_pickle_dumps(obj, _PICKLE_PROTOCOL)).digest(), "big")


def _none_hash() -> int:
    seed = os.getenv("PYTHONHASHSEED")
    return int.from_bytes(os.urandom(32), "big") if seed is None else sha256(seed)


NONE_HASH: Final[int] = _none_hash()
"""Seeds every chain: random per process, or derived from PYTHONHASHSEED when it is set."""

HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "builtin": hash}
"""The prefix-cache hash functions by name.

- "sha256" (pagedkv's default): 256 bits over the pickled key; a collision is not a concern.
- "builtin": CPython's `hash()`, vLLM 0.8.5's default: fast, 64 bits, str keys randomized per
  process unless PYTHONHASHSEED is set. Prone to collisions by design: a collision of hash
  values alone never shares a block (the index key compares tokens and extra keys as well), but
  two chains whose parent values collide share their later equal blocks, which a
  sliding-window lookup (probing block by block) then hits. Token ids are validated to
  `[0, MAX_TOKEN_ID]`, where `hash(token)` is the token itself, so the systematic collisions of
  `hash()` on ints (`hash(-1) == hash(-2)`, `hash(2**61 - 1) == hash(0)`) cannot arise; chance
  collisions of 64-bit values remain. Use it for vLLM conformance, not where a wrong cache hit
  is a data leak.
"""


def get_hash_fn(algo: object) -> HashFn:
    """The hash function named `algo` ("sha256" or "builtin", see `HASH_FUNCTIONS`).

    Raises:
        ArgumentTypeError: `algo` is not a str.
        InvalidArgumentError: no hash function has that name.
    """
    name = require_str("get_hash_fn", "algo", algo)
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown caching hash algorithm {algo!r}; expected one of {sorted(HASH_FUNCTIONS)}"
        ) from None
