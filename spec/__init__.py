"""pagedkv.spec: the executable specification pagedkv's implementation is checked against.

Plain lists and dicts, preconditions checked first, every invariant stated once in a
`check_invariants()`. Obviously right over fast; standard library only. The spec decides every
rule itself (arguments: `arguments`, its default semantics: `semantics`); it shares only the
vocabulary of `pagedkv.vocab` with the implementation, and importing it loads no module of the
optimized pool or manager.
"""

from pagedkv.spec.block_hash import block_extra_keys, request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.block_state import TRANSITIONS, BlockState, Event, state_of
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS

__all__ = [
    "NULL_BLOCK_ID",
    "PAGEDKV_SEMANTICS",
    "TRANSITIONS",
    "BlockState",
    "Event",
    "SpecBlockPool",
    "SpecKVCacheManager",
    "block_extra_keys",
    "request_block_hashes",
    "state_of",
]
