"""pagedkv.spec: the executable specification pagedkv's implementation is checked against.

Plain lists and dicts, preconditions checked first, every invariant stated once in a
`check_invariants()`. Obviously right over fast; standard library only.
"""

from pagedkv.spec.block_hash import block_extra_keys, request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID, SpecBlockPool
from pagedkv.spec.block_state import TRANSITIONS, BlockState, Event, state_of

__all__ = [
    "NULL_BLOCK_ID",
    "TRANSITIONS",
    "BlockState",
    "Event",
    "SpecBlockPool",
    "block_extra_keys",
    "request_block_hashes",
    "state_of",
]
