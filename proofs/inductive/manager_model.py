"""The manager's per-request state over the pool, as a transition system over arrays.

The pool is abstracted to what the request-level invariants read: each block's ref_cnt and
whether it is hashed (a block is free iff its ref_cnt is 0: `pool_model` proves the queue
agrees). Over it, per request r (an uninterpreted sort: any number of requests):

    table[r][i]     the block at position i of r's block table (0: the null block)
    length[r]       how many positions r's table has

and a ghost witness that ref_cnt counts table entries, so that "ref_cnt = the number of
requests holding the block" is a first-order statement (a count is not, for unbounded pools
and request sets; a bijection is):

    holders[b]          the number of entries naming block b
    holder_req[b][j]    for j < holders[b], the request of b's j-th entry ...
    holder_pos[b][j]    ... and its position
    slot[r][i]          j such that entry (r, i) is b's j-th

Every manager call is a fold of these steps (the spec's calls in `spec/manager.py`):

    append_new(r, b)   `allocate_slots` takes a free block b from the pool (evicting its hash)
                       and appends it to r's table
    append_hit(r, b)   `allocate_slots` touches a prefix hit b and appends it (b cached and
                       not in r's table yet: the request's chain hashes are distinct; a null
                       hit only where the attention allows null blocks, after null hits only)
    seal(r, i)         `cache_full_blocks` hashes r's block at i
    drop(r, i)         a sliding window passes r's first non-null block i: it is released and
                       position i holds the null block
    pop_last(r)        `free` (a finish or a preemption) releases r's last block, tail first
    reset              `reset_prefix_cache` with no block in use drops every hash

The spec releases a window's dropped blocks newest first, and frees in order without caching;
the fold here does both oldest first. The states after the whole call are the same (ref_cnts
and hashes do not depend on the order: only the free queue's order does, which `pool_model`
proves for any order); the states in between are not states the spec shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from proofs.inductive.algebra import Algebra, Array, Bool, Int, Req

NULL: int = 0


@dataclass(frozen=True)
class ManagerParams:
    """The pool's size, the most blocks a request may hold (cdiv(max_model_len, block
    size)), whether the attention allows null blocks (sliding window), whether caching is on."""

    n: Int
    max_blocks: Int
    allows_null: Bool
    caching: Bool


@dataclass(frozen=True)
class ManagerState:
    """The abstract pool, the tables and the ghost witness (module docstring)."""

    ref: Array
    hashed: Array
    table: Array
    length: Array
    holders: Array
    holder_req: Array
    holder_pos: Array
    slot: Array


def init(m: Algebra, p: ManagerParams, any_request: Req) -> ManagerState:
    """No request holds anything; every block free, unhashed."""
    return ManagerState(
        ref=m.array(0),
        hashed=m.array(False),
        table=m.request_array(m.array(NULL)),
        length=m.request_array(0),
        holders=m.array(0),
        holder_req=m.array(m.array(any_request)),
        holder_pos=m.array(m.array(0)),
        slot=m.request_array(m.array(0)),
    )


def is_block(m: Algebra, p: ManagerParams, b: Int) -> Bool:
    return m.all_(b >= 1, b < p.n)


def names(m: Algebra, s: ManagerState, r: Req, b: Int) -> Bool:
    """Whether r's table names b."""
    return m.not_(m.forall(0, s.length[r], lambda i: s.table[r][i] != b))


# -- the witness -----------------------------------------------------------------------------


def _add_entry(m: Algebra, s: ManagerState, r: Req, i: Int, b: Int) -> ManagerState:
    """Entry (r, i), naming b (not the null block), joins b's holders."""
    j = s.holders[b]
    return dataclasses.replace(
        s,
        holders=m.store(s.holders, b, j + 1),
        holder_req=m.store(s.holder_req, b, m.store(s.holder_req[b], j, r)),
        holder_pos=m.store(s.holder_pos, b, m.store(s.holder_pos[b], j, i)),
        slot=m.store(s.slot, r, m.store(s.slot[r], i, j)),
    )


def _remove_entry(m: Algebra, s: ManagerState, r: Req, i: Int, b: Int) -> ManagerState:
    """Entry (r, i), naming b (not the null block), leaves b's holders: b's last holder takes
    its slot."""
    j = s.slot[r][i]
    last = s.holders[b] - 1
    moved_req, moved_pos = s.holder_req[b][last], s.holder_pos[b][last]
    return dataclasses.replace(
        s,
        holders=m.store(s.holders, b, last),
        holder_req=m.store(s.holder_req, b, m.store(s.holder_req[b], j, moved_req)),
        holder_pos=m.store(s.holder_pos, b, m.store(s.holder_pos[b], j, moved_pos)),
        slot=m.store(s.slot, moved_req, m.store(s.slot[moved_req], moved_pos, j)),
    )


def _append(m: Algebra, s: ManagerState, r: Req, b: Int) -> ManagerState:
    i = s.length[r]
    s = dataclasses.replace(
        s,
        table=m.store(s.table, r, m.store(s.table[r], i, b)),
        length=m.store(s.length, r, i + 1),
    )
    return m.branch(b == NULL, lambda: s, lambda: _add_entry(m, s, r, i, b))


# -- guards and steps ------------------------------------------------------------------------


def append_new_guard(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, b: Int) -> Bool:
    return m.all_(s.length[r] < p.max_blocks, is_block(m, p, b), s.ref[b] == 0)


def append_new(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, b: Int) -> ManagerState:
    s = dataclasses.replace(s, ref=m.store(s.ref, b, 1), hashed=m.store(s.hashed, b, False))
    return _append(m, s, r, b)


def append_hit_guard(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, b: Int) -> Bool:
    length = s.length[r]
    null_hit = m.all_(p.allows_null, m.any_(length == 0, s.table[r][length - 1] == NULL))
    cached_hit = m.all_(is_block(m, p, b), s.hashed[b], m.not_(names(m, s, r, b)))
    return m.all_(p.caching, length < p.max_blocks, m.ite(b == NULL, null_hit, cached_hit))


def append_hit(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, b: Int) -> ManagerState:
    counted = m.branch(
        b == NULL, lambda: s, lambda: dataclasses.replace(s, ref=m.store(s.ref, b, s.ref[b] + 1))
    )
    return _append(m, counted, r, b)


def seal_guard(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, i: Int) -> Bool:
    b = s.table[r][i]
    return m.all_(p.caching, i >= 0, i < s.length[r], b != NULL, m.not_(s.hashed[b]))


def seal(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, i: Int) -> ManagerState:
    return dataclasses.replace(s, hashed=m.store(s.hashed, s.table[r][i], True))


def _release(m: Algebra, s: ManagerState, r: Req, i: Int) -> ManagerState:
    """Entry (r, i) gives up its reference (it names a block, not the null block)."""
    b = s.table[r][i]
    s = _remove_entry(m, s, r, i, b)
    return dataclasses.replace(s, ref=m.store(s.ref, b, s.ref[b] - 1))


def drop_guard(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, i: Int) -> Bool:
    return m.all_(
        p.allows_null,
        i >= 0,
        i < s.length[r],
        s.table[r][i] != NULL,
        m.forall(0, i, lambda j: s.table[r][j] == NULL),
    )


def drop(m: Algebra, p: ManagerParams, s: ManagerState, r: Req, i: Int) -> ManagerState:
    s = _release(m, s, r, i)
    return dataclasses.replace(s, table=m.store(s.table, r, m.store(s.table[r], i, NULL)))


def pop_last_guard(m: Algebra, p: ManagerParams, s: ManagerState, r: Req) -> Bool:
    return s.length[r] > 0


def pop_last(m: Algebra, p: ManagerParams, s: ManagerState, r: Req) -> ManagerState:
    last = s.length[r] - 1
    released = m.branch(s.table[r][last] == NULL, lambda: s, lambda: _release(m, s, r, last))
    return dataclasses.replace(released, length=m.store(released.length, r, last))


def reset_guard(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    """No block but the null block is in use (`pool_proof` proves this is the pool's test)."""
    return m.forall(1, p.n, lambda b: s.ref[b] == 0)


def reset(m: Algebra, p: ManagerParams, s: ManagerState) -> ManagerState:
    return dataclasses.replace(s, hashed=m.array(False))


# -- the invariant ---------------------------------------------------------------------------

Invariant = Callable[[Algebra, ManagerParams, ManagerState], Bool]


def _per_request(m: Algebra, s: ManagerState, holds: Callable[[Req, Int], Bool]) -> Bool:
    """`holds(r, length)` for every request (vacuous for one with an empty table)."""
    return m.forall_entries(s.length, holds)


def _per_entry(m: Algebra, s: ManagerState, holds: Callable[[Req, Int, Int], Bool]) -> Bool:
    """`holds(r, i, block)` for every position i of every request's table."""
    return _per_request(
        m, s, lambda r, length: m.forall(0, length, lambda i: holds(r, i, s.table[r][i]))
    )


def _ref_nonnegative(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return m.forall(1, p.n, lambda b: s.ref[b] >= 0)


def _tables_name_blocks(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_entry(m, s, lambda r, i, b: m.all_(b >= 0, b < p.n))


def _at_most_max_blocks(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_request(m, s, lambda r, length: m.all_(length >= 0, length <= p.max_blocks))


def _null_only_if_allowed(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_entry(m, s, lambda r, i, b: m.implies(b == NULL, p.allows_null))


def _null_prefix(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_entry(
        m,
        s,
        lambda r, i, b: m.implies(b == NULL, m.forall(0, i, lambda j: s.table[r][j] == NULL)),
    )


def _held_once(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_entry(
        m,
        s,
        lambda r, i, b: m.implies(b != NULL, m.forall(0, i, lambda j: s.table[r][j] != b)),
    )


def _held_counted(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return _per_entry(m, s, lambda r, i, b: m.implies(b != NULL, s.ref[b] >= 1))


def _ref_is_holders(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return m.forall(1, p.n, lambda b: s.ref[b] == s.holders[b])


def _witness_entries(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    def entry(b: Int, j: Int) -> Bool:
        r, i = s.holder_req[b][j], s.holder_pos[b][j]
        return m.all_(i >= 0, i < s.length[r], s.table[r][i] == b, s.slot[r][i] == j)

    return m.forall(
        1,
        p.n,
        lambda b: m.all_(s.holders[b] >= 0, m.forall(0, s.holders[b], lambda j: entry(b, j))),
    )


def _witness_slots(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    def slotted(r: Req, i: Int, b: Int) -> Bool:
        j = s.slot[r][i]
        return m.implies(
            b != NULL,
            m.all_(
                j >= 0,
                j < s.holders[b],
                s.holder_req[b][j] == r,
                s.holder_pos[b][j] == i,
            ),
        )

    return _per_entry(m, s, slotted)


def _shared_cached(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return m.forall(1, p.n, lambda b: m.implies(s.holders[b] >= 2, s.hashed[b]))


def _no_hash_without_caching(m: Algebra, p: ManagerParams, s: ManagerState) -> Bool:
    return m.implies(m.not_(p.caching), m.forall(1, p.n, lambda b: m.not_(s.hashed[b])))


INVARIANTS: dict[str, Invariant] = {
    "ref_cnt >= 0": _ref_nonnegative,
    "a request's table names blocks of the pool": _tables_name_blocks,
    "a request holds at most cdiv(max_model_len, block_size) blocks": _at_most_max_blocks,
    "null blocks only where the attention allows them": _null_only_if_allowed,
    "null blocks only as a prefix": _null_prefix,
    "a request names a block at most once": _held_once,
    "every held block's ref_cnt counts the request (>= 1)": _held_counted,
    "ref_cnt = holders (the entries naming the block)": _ref_is_holders,
    "witness: each of a block's holders is an entry naming it": _witness_entries,
    "witness: each entry naming a block is one of its holders": _witness_slots,
    "a block held twice is cached": _shared_cached,
    "no block is hashed while caching is off": _no_hash_without_caching,
}
"""The per-request invariant, conjunct by conjunct. The two witness conjuncts make `holders[b]`
the number of entries naming b (a bijection between [0, holders[b]) and those entries), so
"ref_cnt = holders" is `check_invariants()`'s "a block's ref_cnt is the number of requests
holding it" (with "a request names a block at most once"); "a block held twice is cached" is
its "a block held by two requests is cached"."""
