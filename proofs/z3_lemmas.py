"""z3 proofs of the integer arithmetic the block manager rests on, with Python's `//` exact.

Each lemma states, over unbounded integers, a hypothesis and a conclusion; it is proved when z3
finds the hypothesis together with the negated conclusion unsatisfiable within `TIMEOUT_MS`.
Every divisor a lemma uses must be provably non-zero under its hypothesis (checked the same way),
so that z3's arbitrary value for division by zero never enters a proof.

Python's floor division is modelled explicitly (`Arithmetic.floordiv`): z3's integer `/` is
SMT-LIB's Euclidean division, which differs from `//` when the divisor is negative. The model is
itself a lemma (`floordiv_is_pythons`) and is checked against Python on a grid of values.

Wrong variants (`a // b` for a ceiling, `<` for `<=`, no `+ 1` page, z3's own division) must be
refuted: z3 gives a counterexample, which is replayed in plain Python and must falsify the claim.

    python -m proofs.z3_lemmas      exit status 0 when everything holds, else 1
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import z3

TIMEOUT_MS = 10_000
"""Bound on each z3 check (the lemma and each of its divisors); the lemmas take milliseconds."""

# z3 ships no type information: its terms are typed Any here, named for the reader.
Term: TypeAlias = Any
"""A z3 integer term (`z3.ArithRef`)."""
Formula: TypeAlias = Any
"""A z3 boolean term (`Formula`)."""
Claim: TypeAlias = tuple[Formula, Formula]
"""(hypothesis, conclusion) over z3 integer terms."""


class Arithmetic:
    """Python's `//`, `%` and the ceiling division `cdiv(a, b) = -(-a // b)` over z3 terms.

    Records every divisor used, so that the prover can demand it be non-zero.
    """

    def __init__(self) -> None:
        self.divisors: list[Term] = []

    def floordiv(self, a: Term, b: Term) -> Term:
        """Python's `a // b` (b != 0): z3's `/` with a positive divisor is the floor; for a
        negative one, `a // b == (-a) // (-b)`."""
        self.divisors.append(b)
        return z3.If(b > 0, a / b, (-a) / (-b))

    def mod(self, a: Term, b: Term) -> Term:
        """Python's `a % b` (b != 0): `a - b * (a // b)`, with the sign of b."""
        return a - b * self.floordiv(a, b)

    def cdiv(self, a: Term, b: Term) -> Term:
        """`-(-a // b)`, the ceiling division of `pagedkv.vocab.kv_cache_interface.cdiv`."""
        return -self.floordiv(-a, b)

    @staticmethod
    def max(a: Term, b: Term) -> Term:
        return z3.If(a >= b, a, b)

    @staticmethod
    def min(a: Term, b: Term) -> Term:
        return z3.If(a <= b, a, b)


def ints(names: str) -> list[Term]:
    return list(z3.Ints(names))


# -- the lemmas ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lemma:
    """A claim over the integers, to be proved, or (a wrong variant) to be refuted.

    Attributes:
        name: the function that builds it.
        statement: what it says (the function's docstring).
        claim: builds (hypothesis, conclusion) with the given arithmetic.
        replay: the same claim evaluated in plain Python on a counterexample's values (True
            when hypothesis implies conclusion there); required for wrong variants.
        expect_proof: True for a lemma, False for a wrong variant.
    """

    name: str
    statement: str
    claim: Callable[[Arithmetic], Claim]
    replay: Callable[[Mapping[str, int]], bool] | None = None
    expect_proof: bool = True


LEMMAS: list[Lemma] = []
WRONG_VARIANTS: list[Lemma] = []


def lemma(build: Callable[[Arithmetic], Claim]) -> Callable[[Arithmetic], Claim]:
    LEMMAS.append(Lemma(build.__name__, _doc(build), build))
    return build


def wrong_variant(
    replay: Callable[[Mapping[str, int]], bool],
) -> Callable[[Callable[[Arithmetic], Claim]], Callable[[Arithmetic], Claim]]:
    def register(build: Callable[[Arithmetic], Claim]) -> Callable[[Arithmetic], Claim]:
        WRONG_VARIANTS.append(Lemma(build.__name__, _doc(build), build, replay, False))
        return build

    return register


def _doc(function: Callable[..., object]) -> str:
    return " ".join((function.__doc__ or "").split())


# Division.


@lemma
def floordiv_is_pythons(m: Arithmetic) -> Claim:
    """For b != 0, q = a // b and r = a % b satisfy a == b*q + r with 0 <= r < b if b > 0 and
    b < r <= 0 if b < 0: the definition of Python's floor division."""
    a, b = ints("a b")
    q, r = m.floordiv(a, b), m.mod(a, b)
    sign = z3.And(
        z3.Implies(b > 0, z3.And(r >= 0, r < b)), z3.Implies(b < 0, z3.And(b < r, r <= 0))
    )
    return b != 0, z3.And(a == b * q + r, sign)


@lemma
def cdiv_is_least_integer_at_least_quotient(m: Arithmetic) -> Claim:
    """For b > 0, c = cdiv(a, b) satisfies c*b >= a and (c-1)*b < a, and every k with k*b >= a
    is >= c: c is the least integer >= a/b."""
    a, b, k = ints("a b k")
    c = m.cdiv(a, b)
    least = z3.Implies(k * b >= a, k >= c)
    return b > 0, z3.And(c * b >= a, (c - 1) * b < a, least)


@lemma
def cdiv_forms_agree(m: Arithmetic) -> Claim:
    """For b > 0, -(-a // b) == a // b + (1 if a % b else 0): the implementation's and the
    spec's ceiling divisions agree."""
    a, b = ints("a b")
    return b > 0, m.cdiv(a, b) == m.floordiv(a, b) + z3.If(m.mod(a, b) != 0, 1, 0)


# allocate_slots.


def _allocation(m: Arithmetic) -> tuple[list[Formula], dict[str, Term]]:
    """The quantities of one allocate_slots call that passed its preconditions.

    C computed tokens, H held blocks, h hits (only for a request holding nothing), T scheduled
    tokens of which S speculative, L lookahead slots, B block size, M max blocks per request.
    """
    c, held, hits, t, s, look, b, most = ints("C H h T S L B M")
    computed = c + hits * b
    required = m.cdiv(computed + t + look, b)
    new = required - held - hits
    full = m.floordiv(computed + t - s, b)
    hypothesis = [
        b > 0,
        t > 0,
        s >= 0,
        s <= t,
        look >= 0,
        held >= 0,
        hits >= 0,
        c >= 0,
        c <= held * b,  # num_computed_tokens within the request's slots
        z3.Implies(hits > 0, z3.And(held == 0, c == 0)),  # hits only for a fresh request
        required <= most,  # past max_model_len raises first
    ]
    values = {"required": required, "new": new, "full": full, "computed": computed}
    values.update({"C": c, "H": held, "h": hits, "T": t, "S": s, "L": look, "B": b, "M": most})
    return hypothesis, values


@lemma
def required_blocks_hold_every_slot(m: Arithmetic) -> Claim:
    """required = cdiv(computed + hits*B + tokens + lookahead, B) blocks hold every slot, and
    one block fewer would not: required*B >= slots > (required-1)*B."""
    hypothesis, v = _allocation(m)
    slots = v["computed"] + v["T"] + v["L"]
    return z3.And(hypothesis), z3.And(
        v["required"] * v["B"] >= slots, (v["required"] - 1) * v["B"] < slots
    )


@lemma
def new_blocks_are_the_shortfall(m: Arithmetic) -> Claim:
    """After allocating max(new, 0) blocks, new = required - held - hits, the request holds at
    least required blocks, and exactly required when it needed any."""
    hypothesis, v = _allocation(m)
    after = v["H"] + v["h"] + m.max(v["new"], z3.IntVal(0))
    exact = z3.Implies(v["new"] > 0, after == v["required"])
    return z3.And(hypothesis), z3.And(after >= v["required"], exact)


@lemma
def full_blocks_fit_in_held_blocks(m: Arithmetic) -> Claim:
    """full = (computed + hits*B + tokens - spec) // B satisfies 0 <= full <= required, and
    full <= the blocks held after the allocation: cache_full_blocks never runs past them."""
    hypothesis, v = _allocation(m)
    after = v["H"] + v["h"] + m.max(v["new"], z3.IntVal(0))
    return z3.And(hypothesis), z3.And(
        v["full"] >= 0, v["full"] <= v["required"], v["full"] <= after
    )


@lemma
def capacity_check_implies_allocation_fits(m: Arithmetic) -> Claim:
    """If new > 0 and new <= free - free_hits (free_hits: hits with ref_cnt 0, which touching
    takes off the free queue), then get_new_blocks(min(new, free after touching, M - held after
    hits)) asks for exactly new blocks, no more than are free."""
    hypothesis, v = _allocation(m)
    free, free_hits = ints("free free_hits")
    touched = free - free_hits
    asked = m.min(m.min(v["new"], touched), v["M"] - v["H"] - v["h"])
    pool = [free >= 0, free_hits >= 0, free_hits <= v["h"], free_hits <= free]
    check = z3.And(v["new"] > 0, v["new"] <= free - free_hits)
    return z3.And(*hypothesis, *pool, check), z3.And(asked == v["new"], asked <= touched)


# The sliding window.


def _skipped(m: Arithmetic, n: Term, w: Term, b: Term) -> Term:
    """`max((n - W + 1) // B, 0)`: the leading positions remove_skipped_blocks nulls out."""
    return m.max(m.floordiv(n - w + 1, b), z3.IntVal(0))


def _needed(m: Arithmetic, w: Term, b: Term) -> Term:
    """`max(cdiv(W - 1, B), 1)`: the cached blocks a sliding-window hit must end with."""
    return m.max(m.cdiv(w - 1, b), z3.IntVal(1))


@lemma
def skipped_blocks_are_wholly_before_the_window(m: Arithmetic) -> Claim:
    """With n computed tokens, window W >= 1 and block size B >= 1, position p >= 0 is skipped
    (p < max((n - W + 1) // B, 0)) iff block p, tokens [p*B, (p+1)*B), ends at or before the
    window's first token n - W + 1."""
    n, w, b, p = ints("n W B p")
    hypothesis = z3.And(n >= 0, w >= 1, b >= 1, p >= 0)
    return hypothesis, (p < _skipped(m, n, w, b)) == ((p + 1) * b <= n - w + 1)


@lemma
def skipped_blocks_never_exceed_held_blocks(m: Arithmetic) -> Claim:
    """If n <= held*B (computed tokens lie in held blocks), at most held positions are skipped;
    with W >= 2 the block holding token n - 1, the last computed one, is never skipped (with
    W = 1 a token attends to itself only, and every computed block may go)."""
    n, w, b, held = ints("n W B H")
    skipped = _skipped(m, n, w, b)
    hypothesis = z3.And(n >= 0, w >= 1, b >= 1, held >= 0, n <= held * b)
    last_kept = z3.Implies(z3.And(n >= 1, w >= 2), skipped <= m.floordiv(n - 1, b))
    return hypothesis, z3.And(skipped <= held, last_kept)


@lemma
def window_hit_run_covers_the_window(m: Arithmetic) -> Claim:
    """needed = max(cdiv(W - 1, B), 1) blocks hold the W - 1 tokens before a block boundary, and
    one block fewer would not (for W >= 2)."""
    w, b = ints("W B")
    needed = _needed(m, w, b)
    minimal = z3.Implies(w >= 2, (needed - 1) * b < w - 1)
    return z3.And(w >= 1, b >= 1), z3.And(needed * b >= w - 1, minimal)


@lemma
def window_hit_nulls_lie_outside_the_window(m: Arithmetic) -> Claim:
    """A sliding-window hit of length L >= needed fills positions [0, L - needed) with the null
    block; all of them are skipped once the L*B hit tokens are computed."""
    w, b, length = ints("W B L")
    needed = _needed(m, w, b)
    hypothesis = z3.And(w >= 1, b >= 1, length >= needed)
    return hypothesis, length - needed <= _skipped(m, length * b, w, b)


# Memory budget (kv_cache_interface, kv_cache_config).


@lemma
def num_blocks_is_the_most_that_fit(m: Arithmetic) -> Claim:
    """n = available // page_size // num_layers is the largest n with n*page_size*num_layers <=
    available (available >= 0, page_size >= 1, num_layers >= 1)."""
    available, page, layers = ints("available page layers")
    n = m.floordiv(m.floordiv(available, page), layers)
    hypothesis = z3.And(available >= 0, page >= 1, layers >= 1)
    return hypothesis, z3.And(
        n >= 0, n * page * layers <= available, (n + 1) * page * layers > available
    )


@lemma
def tensor_holds_exactly_num_blocks_pages(m: Arithmetic) -> Claim:
    """With page = coef*B*heads*head_size*dtype_bytes (coef 2, or 1 for MLA; all >= 1), a tensor
    of page*num_blocks bytes is a whole number of pages, num_blocks of them: KVCacheConfig's
    check `size % page or size // page < num_blocks` passes for uniform_kv_cache_config."""
    coef, b, heads, head_size, dtype, blocks = ints("coef B heads head_size dtype num_blocks")
    page = coef * b * heads * head_size * dtype
    size = page * blocks
    hypothesis = z3.And(
        z3.Or(coef == 1, coef == 2), b >= 1, heads >= 1, head_size >= 1, dtype >= 1, blocks >= 1
    )
    return hypothesis, z3.And(page >= 1, m.mod(size, page) == 0, m.floordiv(size, page) == blocks)


@lemma
def full_attention_pages_hold_max_model_len(m: Arithmetic) -> Claim:
    """cdiv(max_model_len, B) pages per layer hold one request of max_model_len tokens, and
    equal max_num_blocks_per_req, the manager's per-request bound."""
    length, b = ints("max_model_len B")
    pages = m.cdiv(length, b)
    return z3.And(length >= 1, b >= 1), z3.And(pages * b >= length, (pages - 1) * b < length)


@lemma
def sliding_window_pages_hold_any_window(m: Arithmetic) -> Claim:
    """A run of s >= 1 consecutive tokens starting at any token x >= 0 touches at most
    cdiv(s, B) + 1 blocks: the `+ 1` of the sliding window's max_memory_usage_bytes, with
    s = min(W - 1 + max_num_batched_tokens, max_model_len)."""
    x, s, b = ints("x s B")
    touched = m.floordiv(x + s - 1, b) - m.floordiv(x, b) + 1
    return z3.And(x >= 0, s >= 1, b >= 1), touched <= m.cdiv(s, b) + 1


@lemma
def sliding_window_never_needs_more_than_full_attention_plus_one(m: Arithmetic) -> Claim:
    """cdiv(min(W - 1 + T, max_model_len), B) + 1 <= cdiv(max_model_len, B) + 1: a sliding
    window layer never budgets more than a full attention layer's pages plus one."""
    w, t, length, b = ints("W T max_model_len B")
    window = m.cdiv(Arithmetic.min(w - 1 + t, length), b) + 1
    hypothesis = z3.And(w >= 1, t >= 1, length >= 1, b >= 1)
    return hypothesis, window <= m.cdiv(length, b) + 1


# -- wrong variants: each must be refuted, and the counterexample must replay in Python -------
#
# Each replay evaluates "hypothesis implies conclusion" with Python's own operators.


def _replay_cdiv_as_floordiv(v: Mapping[str, int]) -> bool:
    return v["b"] <= 0 or (v["a"] // v["b"]) * v["b"] >= v["a"]


@wrong_variant(_replay_cdiv_as_floordiv)
def wrong_cdiv_as_floordiv(m: Arithmetic) -> Claim:
    """a // b blocks (no ceiling) hold a tokens: (a // b) * b >= a for b > 0."""
    a, b = ints("a b")
    return b > 0, m.floordiv(a, b) * b >= a


def _replay_z3_division(v: Mapping[str, int]) -> bool:
    return v["b"] == 0 or _euclid(v["a"], v["b"]) == v["a"] // v["b"]


@wrong_variant(_replay_z3_division)
def wrong_z3_division_is_pythons(m: Arithmetic) -> Claim:
    """z3's own integer division `/` equals Python's `//` (b != 0)."""
    a, b = ints("a b")
    m.divisors.append(b)
    return b != 0, a / b == m.floordiv(a, b)


def _replay_skip_strict(v: Mapping[str, int]) -> bool:
    n, w, b, p = v["n"], v["W"], v["B"], v["p"]
    skipped = max((n - w + 1) // b, 0)
    return (p < skipped) == ((p + 1) * b < n - w + 1)


@wrong_variant(_replay_skip_strict)
def wrong_skip_boundary_strict(m: Arithmetic) -> Claim:
    """Position p is skipped iff block p ends strictly before the window's first token (< for
    <=)."""
    n, w, b, p = ints("n W B p")
    hypothesis = z3.And(n >= 0, w >= 1, b >= 1, p >= 0)
    return hypothesis, (p < _skipped(m, n, w, b)) == ((p + 1) * b < n - w + 1)


def _replay_skip_one_block_too_many(v: Mapping[str, int]) -> bool:
    n, w, b, p = v["n"], v["W"], v["B"], v["p"]
    skipped = max((n - (w - b) + 1) // b, 0)
    return not p < skipped or (p + 1) * b <= n - w + 1


@wrong_variant(_replay_skip_one_block_too_many)
def wrong_skip_one_block_too_many(m: Arithmetic) -> Claim:
    """Skipping with a window B tokens short, max((n - (W - B) + 1) // B, 0) positions (the
    planted bug `window_off_by_one`), drops only blocks wholly before the window."""
    n, w, b, p = ints("n W B p")
    skipped = _skipped(m, n, w - b, b)
    hypothesis = z3.And(n >= 0, w >= 1, b >= 1, p >= 0, p < skipped)
    return hypothesis, (p + 1) * b <= n - w + 1


def _replay_pages_without_extra_block(v: Mapping[str, int]) -> bool:
    x, s, b = v["x"], v["s"], v["B"]
    return (x + s - 1) // b - x // b + 1 <= -(-s // b)


@wrong_variant(_replay_pages_without_extra_block)
def wrong_sliding_window_pages_without_extra_block(m: Arithmetic) -> Claim:
    """A run of s tokens touches at most cdiv(s, B) blocks (no + 1)."""
    x, s, b = ints("x s B")
    touched = m.floordiv(x + s - 1, b) - m.floordiv(x, b) + 1
    return z3.And(x >= 0, s >= 1, b >= 1), touched <= m.cdiv(s, b)


def _replay_num_blocks_rounded_up(v: Mapping[str, int]) -> bool:
    available, page, layers = v["available"], v["page"], v["layers"]
    return -(-available // (page * layers)) * page * layers <= available


@wrong_variant(_replay_num_blocks_rounded_up)
def wrong_num_blocks_rounded_up(m: Arithmetic) -> Claim:
    """num_blocks = cdiv(available, page_size * num_layers) blocks still fit in available."""
    available, page, layers = ints("available page layers")
    n = m.cdiv(available, page * layers)
    return z3.And(available >= 0, page >= 1, layers >= 1), n * page * layers <= available


def _euclid(a: int, b: int) -> int:
    """SMT-LIB's integer division (remainder always >= 0), which z3's `/` implements."""
    q = a // b
    if a - b * q < 0:  # Python's remainder has b's sign; Euclid's is never negative
        q += 1
    return q


# -- the prover ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LemmaOutcome:
    """What z3 said about one lemma or wrong variant.

    Attributes:
        lemma: the lemma.
        status: "proved", "refuted", "unknown" (timeout), or "undefined" (a divisor may be 0).
        seconds: time spent in z3.
        counterexample: the values z3 found (refuted only).
        replayed: the claim evaluated in Python on the counterexample (None if not replayed).
    """

    lemma: Lemma
    status: str
    seconds: float
    counterexample: dict[str, int] = field(default_factory=dict)
    replayed: bool | None = None

    @property
    def ok(self) -> bool:
        if self.lemma.expect_proof:
            return self.status == "proved"
        return self.status == "refuted" and self.replayed is False

    def describe(self) -> str:
        kind = "lemma" if self.lemma.expect_proof else "wrong variant"
        line = f"[{'ok' if self.ok else 'FAIL'}] {kind} {self.lemma.name}: {self.status}"
        line += f" ({self.seconds * 1000:.0f} ms)"
        if self.counterexample:
            values = ", ".join(f"{k}={v}" for k, v in sorted(self.counterexample.items()))
            line += f"\n      counterexample {values}"
            if self.replayed is not None:
                line += f"; in Python the claim is {self.replayed}"
        return f"{line}\n      {self.lemma.statement}"


def check(lemma_: Lemma, timeout_ms: int = TIMEOUT_MS) -> LemmaOutcome:
    """Prove the lemma (unsat of hypothesis and not conclusion), or find a counterexample."""
    arithmetic = Arithmetic()
    hypothesis, conclusion = lemma_.claim(arithmetic)
    start = time.perf_counter()
    for divisor in arithmetic.divisors:
        status, _ = _solve([hypothesis, divisor == 0], timeout_ms)
        if status != z3.unsat:
            return LemmaOutcome(lemma_, "undefined", time.perf_counter() - start)
    status, model = _solve([hypothesis, z3.Not(conclusion)], timeout_ms)
    seconds = time.perf_counter() - start
    if status == z3.unsat:
        return LemmaOutcome(lemma_, "proved", seconds)
    if status == z3.unknown or model is None:
        return LemmaOutcome(lemma_, "unknown", seconds)
    values = {
        str(constant): model.eval(constant, model_completion=True).as_long()
        for constant in _constants(z3.And(hypothesis, conclusion))
    }
    replayed = None if lemma_.replay is None else bool(lemma_.replay(values))
    return LemmaOutcome(lemma_, "refuted", seconds, values, replayed)


def _constants(expression: Term) -> list[Term]:
    """The integer variables of an expression, by name."""
    found: dict[str, Term] = {}
    pending = [expression]
    while pending:
        node = pending.pop()
        if z3.is_const(node) and node.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            found[str(node)] = node
        pending.extend(node.children())
    return [found[name] for name in sorted(found)]


def _solve(assertions: Sequence[Formula], timeout_ms: int) -> tuple[Any, Any]:
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*assertions)
    status = solver.check()
    return status, solver.model() if status == z3.sat else None


def floordiv_model_matches_python(span: int = 12) -> list[str]:
    """Evaluate the z3 model of `//`, `%` and cdiv on every a in [-span, span] and nonzero b in
    [-span // 2, span // 2]; return the mismatches with Python (none expected)."""
    mismatches = []
    arithmetic = Arithmetic()
    for a, b in itertools.product(range(-span, span + 1), range(-(span // 2), span // 2 + 1)):
        if b == 0:
            continue
        x, y = z3.IntVal(a), z3.IntVal(b)
        got = [
            z3.simplify(arithmetic.floordiv(x, y)).as_long(),
            z3.simplify(arithmetic.mod(x, y)).as_long(),
        ]
        want = [a // b, a % b]
        if b > 0:
            got.append(z3.simplify(arithmetic.cdiv(x, y)).as_long())
            want.append(-(-a // b))
        if got != want:
            mismatches.append(f"a={a}, b={b}: z3 model {got}, Python {want}")
    return mismatches


def _value(term: Term) -> int:
    return int(z3.simplify(term).as_long())


def formulas_match_code() -> list[str]:
    """Evaluate the formulas the lemmas model on a grid and compare them with pagedkv's code:
    cdiv, the sliding-window skip and hit-run lengths, num_blocks, page size and max memory.
    Returns the mismatches (none expected)."""
    from pagedkv.block_counts import cdiv
    from pagedkv.planning.kv_cache_config import get_kv_cache_config
    from pagedkv.spec.single_type.sliding_window import (
        contiguous_blocks_needed,
        sliding_window_skipped,
    )
    from pagedkv.vocab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    m = Arithmetic()
    v = z3.IntVal
    mismatches = []

    def compare(what: str, model: int, code: int) -> None:
        if model != code:
            mismatches.append(f"{what}: model {model}, code {code}")

    for a, b in itertools.product(range(-12, 13), range(1, 7)):
        compare(f"cdiv({a}, {b})", _value(m.cdiv(v(a), v(b))), cdiv(a, b))
    for n, w, b in itertools.product(range(13), range(1, 7), range(1, 5)):
        skipped = sliding_window_skipped(n, w, b)
        compare(f"skipped(n={n}, W={w}, B={b})", _value(_skipped(m, v(n), v(w), v(b))), skipped)
        needed = contiguous_blocks_needed(w, b)
        compare(f"needed(W={w}, B={b})", _value(_needed(m, v(w), v(b))), needed)
    for b, heads, head_size, dtype in itertools.product(
        (1, 2, 16), (1, 3), (1, 8), ("float16", "float32", "float8_e4m3fn")
    ):
        full = FullAttentionSpec(block_size=b, num_kv_heads=heads, head_size=head_size, dtype=dtype)
        page = full.page_size_bytes
        dtype_bytes = {"float16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
        compare(f"page size of {full}", 2 * b * heads * head_size * dtype_bytes, page)
        for length, tokens, w in itertools.product((1, 5, 33), (1, 4), (1, 3, 40)):
            pages = _value(m.cdiv(v(length), v(b)))
            compare(f"{full} max memory", pages * page, full.max_memory_usage_bytes(length, tokens))
            window = SlidingWindowSpec(
                block_size=b, num_kv_heads=heads, head_size=head_size, dtype=dtype, sliding_window=w
            )
            span = Arithmetic.min(v(w - 1 + tokens), v(length))
            pages = _value(m.cdiv(span, v(b)) + 1)
            code = window.max_memory_usage_bytes(length, tokens)
            compare(f"{window} max memory", pages * page, code)
        for layers, extra in itertools.product((1, 2, 3), (0, 1, page - 1, 5 * page + 7)):
            available = page * layers + extra  # enough for one request of max_model_len 1
            specs = {f"layers.{i}": full for i in range(layers)}
            config = get_kv_cache_config(specs, available, max_model_len=1)
            model = _value(m.floordiv(m.floordiv(v(available), v(page)), v(layers)))
            compare(f"num_blocks({available}, {page}, {layers})", model, config.num_blocks)
    return mismatches


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proofs.z3_lemmas", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--timeout-ms", type=int, default=TIMEOUT_MS)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    mismatches = floordiv_model_matches_python()
    print(f"[{'FAIL' if mismatches else 'ok'}] floor-division model vs Python on a grid")
    for mismatch in mismatches:
        print(f"      {mismatch}")
    code_mismatches = formulas_match_code()
    print(f"[{'FAIL' if code_mismatches else 'ok'}] modelled formulas vs pagedkv's code on a grid")
    for mismatch in code_mismatches[:20]:
        print(f"      {mismatch}")
    mismatches += code_mismatches
    verdicts = [check(item, args.timeout_ms) for item in [*LEMMAS, *WRONG_VARIANTS]]
    for verdict in verdicts:
        print(verdict.describe())
    failed = len(mismatches) + sum(1 for verdict in verdicts if not verdict.ok)
    proved = sum(1 for verdict in verdicts if verdict.ok and verdict.lemma.expect_proof)
    refuted = sum(1 for verdict in verdicts if verdict.ok and not verdict.lemma.expect_proof)
    print(
        f"z3 lemmas: {'FAILED' if failed else 'ok'}: {proved} of {len(LEMMAS)} proved, "
        f"{refuted} of {len(WRONG_VARIANTS)} wrong variants refuted and replayed, "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
