"""The z3 interpretation of the models' vocabulary (`algebra.Algebra`).

Arrays are z3 arrays (`tabulate` a lambda, constant arrays `K`), keys constants of an
uninterpreted sort `Key` (the models only compare keys), quantifiers bounded `ForAll`s.
`branch` builds both sides and merges them: a state field by field, so that a field neither
side changed stays the very same term.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import z3

from proofs.inductive.algebra import Array, Bool, Int, Key

T = TypeVar("T")

KEY = z3.DeclareSort("Key")
"""Index keys: the models compare them and nothing else, so any set of hashes is a model."""
REQUEST = z3.DeclareSort("Request")
"""Requests: the manager model compares them and nothing else."""


class Symbolic:
    """The z3 interpretation: the model as an SMT transition relation."""

    def __init__(self) -> None:
        self.no_key: Key = z3.Const("no_key", KEY)
        self._fresh = itertools.count()

    def fresh(self, prefix: str) -> str:
        return f"{prefix}!{next(self._fresh)}"

    def ite(self, cond: Bool, then: T, other: T) -> T:
        merged: T = _merge(cond, then, other)
        return merged

    def branch(self, cond: Bool, then: Callable[[], T], other: Callable[[], T]) -> T:
        merged: T = _merge(cond, then(), other())
        return merged

    def all_(self, *conds: Bool) -> Bool:
        return z3.And(*conds)

    def any_(self, *conds: Bool) -> Bool:
        return z3.Or(*conds)

    def not_(self, cond: Bool) -> Bool:
        return z3.Not(cond)

    def implies(self, cond: Bool, then: Bool) -> Bool:
        return z3.Implies(cond, then)

    def array(self, default: Any) -> Array:
        return z3.K(z3.IntSort(), _term(default))

    def key_array(self, default: Any) -> Array:
        return z3.K(KEY, _term(default))

    def request_array(self, default: Any) -> Array:
        return z3.K(REQUEST, _term(default))

    def store(self, array: Array, index: Any, value: Any) -> Array:
        return z3.Store(array, index, _term(value))

    def tabulate(self, lo: Int, hi: Int, value: Callable[[Int], Any], base: Array) -> Array:
        i = z3.Int(self.fresh("i"))
        return z3.Lambda([i], z3.If(z3.And(lo <= i, i < hi), _term(value(i)), base[i]))

    def forall(self, lo: Int, hi: Int, holds: Callable[[Int], Bool]) -> Bool:
        i = z3.Int(self.fresh("q"))
        return z3.ForAll([i], z3.Implies(z3.And(lo <= i, i < hi), holds(i)))

    def forall_entries(self, array: Array, holds: Callable[[Any, Any], Bool]) -> Bool:
        index = z3.Const(self.fresh("e"), array.domain())
        return z3.ForAll([index], holds(index, array[index]))


def _term(value: Any) -> Any:
    """A z3 term for a Python bool or int (models write literals like `False` and `0`)."""
    if isinstance(value, bool):
        return z3.BoolVal(value)
    if isinstance(value, int):
        return z3.IntVal(value)
    return value


def _merge(cond: Bool, then: Any, other: Any) -> Any:
    if then is other:
        return then
    if dataclasses.is_dataclass(then) and not isinstance(then, type):
        changes = {
            field.name: _merge(cond, getattr(then, field.name), getattr(other, field.name))
            for field in dataclasses.fields(then)
        }
        return dataclasses.replace(then, **changes)
    if isinstance(then, tuple):
        return tuple(_merge(cond, a, b) for a, b in zip(then, other, strict=True))
    return z3.If(cond, _term(then), _term(other))
