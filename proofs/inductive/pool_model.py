"""The block pool as a transition system over arrays, written once for proof and execution.

State (`PoolState`), for a pool of `n` blocks (block 0 the null block):

    ref[b]          b's ref_cnt
    order[i]        the block at position i: positions 0..n-2 hold blocks 1..n-1, each once
    pos[b]          b's position (order's inverse)
    num_free        the free queue is order[0:num_free], head first; order[num_free:] is in use
    hashed[b]       whether b carries a hash; key[b] that hash (its index key)
    index[k][b]     whether the index lists b under key k
    stamp[b]        when b entered the index; a key's blocks are listed by stamp (first first)
    stamped[t]      the block stamped t (stamp's inverse on hashed blocks: stamps are distinct)
    clock           the next stamp

Keeping every non-null block in one permutation, the free ones in front, is what lets arrays
state the queue's counting facts: `num_free` is the queue's length because order is a bijection
between [0, num_free) and the queued blocks, and "free + in use = n - 1" is the permutation's
length. A position-to-block array cannot say that a linked list's links form one chain from
head to tail: the model has no links (`pool_executable.py` reads the order off the permutation;
the implementation's doubly linked queue is checked by the campaign and the exhaustive search).

Every public pool operation is a fold of single-block steps, each with a guard (`*_guard`) that
the operation's preconditions establish before the first step (`pool_proof.py` proves that):

    get_new_blocks(k)       k x `pop`: the head leaves the queue, ref_cnt 1, evicted if hashed
    touch(ids)              `touch` per id: a queued block leaves the queue; ref_cnt + 1
    free_blocks(ids)        `release` per id: ref_cnt - 1; at 0 the block joins the queue, at
                            the tail, or under `free_uncached_to_head` an unhashed one at
                            position `ahead` (the number of blocks this call put at the head)
    cache_full_blocks(...)  `seal` per block to cache: it takes its key and enters the index
    reset_prefix_cache()    `reset`: every queued block's hash is dropped, the index emptied

The null block is passed over by every step (`touch` and `release` count it only under
`null_refcounted`, vLLM 0.8.5's semantics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from proofs.inductive.algebra import Algebra, Array, Bool, Int, Key

NULL: int = 0
"""The null block's id."""


@dataclass(frozen=True)
class PoolParams:
    """What a pool is built with: its size and the switches its steps read."""

    n: Int
    caching: Bool
    null_refcounted: Bool
    free_uncached_to_head: Bool


@dataclass(frozen=True)
class PoolState:
    """The pool's state (module docstring)."""

    ref: Array
    order: Array
    pos: Array
    num_free: Int
    hashed: Array
    key: Array
    index: Array
    stamp: Array
    stamped: Array
    clock: Int


def init(m: Algebra, p: PoolParams) -> PoolState:
    """A fresh pool: every block but the null block free, in id order; nothing hashed."""
    return PoolState(
        ref=m.array(0),
        order=m.tabulate(0, p.n - 1, lambda i: i + 1, m.array(0)),
        pos=m.tabulate(1, p.n, lambda b: b - 1, m.array(0)),
        num_free=p.n - 1,
        hashed=m.array(False),
        key=m.array(m.no_key),
        index=m.key_array(m.array(False)),
        stamp=m.array(0),
        stamped=m.array(0),
        clock=0,
    )


# -- observations ----------------------------------------------------------------------------


def is_block(m: Algebra, p: PoolParams, b: Int) -> Bool:
    return m.all_(b >= 0, b < p.n)


def queued(m: Algebra, s: PoolState, b: Int) -> Bool:
    """Whether (non-null) block b is in the free queue."""
    return s.pos[b] < s.num_free


def head(s: PoolState) -> Int:
    """The block `pop` takes."""
    return s.order[0]


# -- guards: the preconditions each single-block step needs ----------------------------------


def pop_guard(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return s.num_free > 0


def touch_guard(m: Algebra, p: PoolParams, s: PoolState, b: Int) -> Bool:
    return is_block(m, p, b)


def release_guard(m: Algebra, p: PoolParams, s: PoolState, b: Int, ahead: Int) -> Bool:
    return m.all_(
        is_block(m, p, b),
        m.implies(b != NULL, s.ref[b] > 0),
        ahead >= 0,
        ahead <= s.num_free,
    )


def seal_guard(m: Algebra, p: PoolParams, s: PoolState, b: Int) -> Bool:
    return m.all_(
        p.caching,
        is_block(m, p, b),
        m.implies(b != NULL, m.all_(s.ref[b] > 0, m.not_(s.hashed[b]))),
    )


def reset_guard(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    """A reset succeeds iff no block but the null block is in use (else it changes nothing)."""
    return s.num_free == p.n - 1


# -- single-block steps ----------------------------------------------------------------------


def _move(m: Algebra, p: PoolParams, s: PoolState, src: Int, dst: Int) -> PoolState:
    """The block at position `src` moves to position `dst`; the blocks between shift by one
    toward `src` (a rotation of order[min:max+1]); pos follows."""
    moved = s.order[src]
    back = dst < src  # toward the head: positions [dst, src) shift up by one
    lo = m.ite(back, dst, src)
    hi = m.ite(back, src, dst) + 1
    order = m.tabulate(
        lo,
        hi,
        lambda i: m.ite(i == dst, moved, m.ite(back, s.order[i - 1], s.order[i + 1])),
        s.order,
    )

    def new_pos(c: Int) -> Int:
        at = s.pos[c]
        shifted = m.ite(back, at + 1, at - 1)
        return m.ite(c == moved, dst, m.ite(m.all_(lo <= at, at < hi), shifted, at))

    return dataclasses.replace(s, order=order, pos=m.tabulate(1, p.n, new_pos, s.pos))


def _unhash(m: Algebra, s: PoolState, b: Int) -> PoolState:
    """b leaves the index, if it was in it (a cached block evicted at reuse)."""
    k = s.key[b]

    def drop() -> PoolState:
        return dataclasses.replace(
            s,
            hashed=m.store(s.hashed, b, False),
            index=m.store(s.index, k, m.store(s.index[k], b, False)),
        )

    return m.branch(s.hashed[b], drop, lambda: s)


def pop(m: Algebra, p: PoolParams, s: PoolState) -> PoolState:
    """The head leaves the queue (to the first position in use), with ref_cnt 1, evicted."""
    b = head(s)
    s = _move(m, p, s, 0, s.num_free - 1)
    s = dataclasses.replace(s, num_free=s.num_free - 1, ref=m.store(s.ref, b, s.ref[b] + 1))
    return _unhash(m, s, b)


def touch(m: Algebra, p: PoolParams, s: PoolState, b: Int) -> PoolState:
    """One more reference to b; a queued block leaves the queue first."""

    def null() -> PoolState:
        counted = dataclasses.replace(s, ref=m.store(s.ref, NULL, s.ref[NULL] + 1))
        return m.branch(p.null_refcounted, lambda: counted, lambda: s)

    def block() -> PoolState:
        def dequeue() -> PoolState:
            moved = _move(m, p, s, s.pos[b], s.num_free - 1)
            return dataclasses.replace(moved, num_free=s.num_free - 1)

        taken = m.branch(s.ref[b] == 0, dequeue, lambda: s)
        return dataclasses.replace(taken, ref=m.store(taken.ref, b, taken.ref[b] + 1))

    return m.branch(b == NULL, null, block)


def release(m: Algebra, p: PoolParams, s: PoolState, b: Int, ahead: Int) -> PoolState:
    """One reference fewer to b; at 0 it joins the queue: at the tail, or at position `ahead`
    if it is unhashed under `free_uncached_to_head`."""

    def null() -> PoolState:
        counted = dataclasses.replace(s, ref=m.store(s.ref, NULL, s.ref[NULL] - 1))
        return m.branch(p.null_refcounted, lambda: counted, lambda: s)

    def block() -> PoolState:
        dropped = dataclasses.replace(s, ref=m.store(s.ref, b, s.ref[b] - 1))

        def enqueue() -> PoolState:
            to_head = m.all_(p.free_uncached_to_head, m.not_(s.hashed[b]))
            dst = m.ite(to_head, ahead, s.num_free)
            moved = _move(m, p, dropped, s.pos[b], dst)
            return dataclasses.replace(moved, num_free=s.num_free + 1)

        return m.branch(s.ref[b] == 1, enqueue, lambda: dropped)

    return m.branch(b == NULL, null, block)


def released_to_head(m: Algebra, p: PoolParams, s: PoolState, b: Int) -> Bool:
    """Whether `release(b)` puts b at position `ahead` (so the next release's `ahead` is one
    more)."""
    return m.all_(b != NULL, s.ref[b] == 1, p.free_uncached_to_head, m.not_(s.hashed[b]))


def seal(m: Algebra, p: PoolParams, s: PoolState, b: Int, k: Key) -> PoolState:
    """b takes key k and enters the index under it, stamped (the null block is passed over)."""

    def block() -> PoolState:
        return dataclasses.replace(
            s,
            hashed=m.store(s.hashed, b, True),
            key=m.store(s.key, b, k),
            index=m.store(s.index, k, m.store(s.index[k], b, True)),
            stamp=m.store(s.stamp, b, s.clock),
            stamped=m.store(s.stamped, s.clock, b),
            clock=s.clock + 1,
        )

    return m.branch(b == NULL, lambda: s, block)


def reset(m: Algebra, p: PoolParams, s: PoolState) -> PoolState:
    """Every queued block's hash is dropped and the index emptied (under `reset_guard`)."""
    return dataclasses.replace(
        s,
        hashed=m.tabulate(1, p.n, lambda b: m.ite(queued(m, s, b), False, s.hashed[b]), s.hashed),
        index=m.key_array(m.array(False)),
    )


# -- the invariant ---------------------------------------------------------------------------

Invariant = Callable[[Algebra, PoolParams, PoolState], Bool]


def _permutation(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(
        0, p.n - 1, lambda i: m.all_(s.order[i] >= 1, s.order[i] < p.n, s.pos[s.order[i]] == i)
    )


def _inverse(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(
        1, p.n, lambda b: m.all_(s.pos[b] >= 0, s.pos[b] < p.n - 1, s.order[s.pos[b]] == b)
    )


def _queue_bounds(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.all_(s.num_free >= 0, s.num_free <= p.n - 1)


def _queued_iff_free(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(1, p.n, lambda b: queued(m, s, b) == (s.ref[b] == 0))


def _ref_nonnegative(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(1, p.n, lambda b: s.ref[b] >= 0)


def _null_never_queued(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(0, s.num_free, lambda i: s.order[i] != NULL)


def _null_never_hashed(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.not_(s.hashed[NULL])


def _null_ref(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.implies(m.not_(p.null_refcounted), s.ref[NULL] == 0)


def _hashed_indexed(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(0, p.n, lambda b: m.implies(s.hashed[b], s.index[s.key[b]][b]))


def _indexed_hashed(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    def row_holds(k: Key, row: Array) -> Bool:
        return m.forall_entries(
            row,
            lambda b, listed: m.implies(
                listed, m.all_(is_block(m, p, b), s.hashed[b], s.key[b] == k)
            ),
        )

    return m.forall_entries(s.index, row_holds)


def _no_hash_without_caching(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.implies(m.not_(p.caching), m.forall(0, p.n, lambda b: m.not_(s.hashed[b])))


def _stamps_past(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(0, p.n, lambda b: m.implies(s.hashed[b], s.stamp[b] < s.clock))


def _stamps_distinct(m: Algebra, p: PoolParams, s: PoolState) -> Bool:
    return m.forall(0, p.n, lambda b: m.implies(s.hashed[b], s.stamped[s.stamp[b]] == b))


INVARIANTS: dict[str, Invariant] = {
    "order is a permutation of the blocks 1..n-1": _permutation,
    "pos is order's inverse": _inverse,
    "0 <= free blocks <= n - 1": _queue_bounds,
    "a block is in the free queue iff its ref_cnt is 0": _queued_iff_free,
    "ref_cnt >= 0": _ref_nonnegative,
    "the null block is never free": _null_never_queued,
    "the null block is never hashed": _null_never_hashed,
    "the null block's ref_cnt stays 0": _null_ref,
    "every hashed block is indexed under its hash": _hashed_indexed,
    "the index lists only hashed blocks, under their own hashes": _indexed_hashed,
    "no block is hashed while caching is off": _no_hash_without_caching,
    "every index stamp is in the past": _stamps_past,
    "no two indexed blocks share a stamp (stamped inverts stamp)": _stamps_distinct,
}
"""The pool's invariant, conjunct by conjunct (names as `check_invariants()` reports them).

Together: the free queue is a duplicate-free list of exactly the non-null blocks with ref_cnt
0 (so free + in use = n - 1), ref_cnts never go negative, the index and the blocks' hashes
agree both ways and the index's order within a key is a strict order, and the null block is
never free, hashed or counted."""
