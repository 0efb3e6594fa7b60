"""The vocabulary the inductive models are written in, and its plain-Python interpretation.

A model (`pool_model.py`, `manager_model.py`) is written once, against `Algebra`: integers,
booleans, total arrays (`a[i]`, `store`, `tabulate`, constant arrays), `ite`, `branch` and
bounded quantifiers. Two interpretations run it:

- `Concrete` (here): Python ints and bools, and `Table`s (a dict of explicit entries over a
  default). The model is then an executable pool, run in lock step against the spec
  (`pool_executable.py`), and its invariants are an executable check;
- `Symbolic` (`symbolic.py`): z3 terms. The same code then builds the SMT transition relation
  and the invariant that `pool_proof.py` proves inductive for a symbolic pool size.

Arithmetic and comparisons are Python's operators, which z3 terms overload the same way; the
model never uses `and`, `or`, `not` or `if` on a value that may be symbolic, only the methods
below. z3 ships no type information: terms are typed `Any` here, named for the reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeAlias, TypeVar

Int: TypeAlias = Any
"""An integer: a Python int, or a z3 integer term."""
Bool: TypeAlias = Any
"""A boolean: a Python bool, or a z3 boolean term."""
Array: TypeAlias = Any
"""A total array: a `Table`, or a z3 array term."""
Key: TypeAlias = Any
"""An index key: a `pagedkv.vocab.hashes.CacheKey`, or a z3 constant of an uninterpreted sort."""
Req: TypeAlias = Any
"""A request: its id, or a z3 constant of an uninterpreted sort."""

T = TypeVar("T")


class Algebra(Protocol):
    """What a model may do with its values (see the module docstring)."""

    no_key: Key
    """The key an unhashed block's key slot holds."""

    def ite(self, cond: Bool, then: T, other: T) -> T:
        """`then` if `cond` else `other` (both already built)."""
        ...

    def branch(self, cond: Bool, then: Callable[[], T], other: Callable[[], T]) -> T:
        """`then()` if `cond` else `other()`; a symbolic `cond` builds both (states: field-wise
        `ite`, see `pool_model.PoolState`)."""
        ...

    def all_(self, *conds: Bool) -> Bool: ...

    def any_(self, *conds: Bool) -> Bool: ...

    def not_(self, cond: Bool) -> Bool: ...

    def implies(self, cond: Bool, then: Bool) -> Bool: ...

    def array(self, default: Any) -> Array:
        """The array over integers holding `default` everywhere."""
        ...

    def key_array(self, default: Any) -> Array:
        """The array over keys holding `default` everywhere."""
        ...

    def request_array(self, default: Any) -> Array:
        """The array over requests holding `default` everywhere."""
        ...

    def store(self, array: Array, index: Any, value: Any) -> Array:
        """`array` with `value` at `index`."""
        ...

    def tabulate(self, lo: Int, hi: Int, value: Callable[[Int], Any], base: Array) -> Array:
        """The array holding `value(i)` at every i in [lo, hi) and `base[i]` elsewhere."""
        ...

    def forall(self, lo: Int, hi: Int, holds: Callable[[Int], Bool]) -> Bool:
        """`holds(i)` for every integer i in [lo, hi)."""
        ...

    def forall_entries(self, array: Array, holds: Callable[[Any, Any], Bool]) -> Bool:
        """`holds(i, array[i])` for every index i (integer or key) of `array`, where `holds`
        is vacuous at the array's default (a False row, or an all-False array of rows)."""
        ...


class Table(dict[Any, Any]):
    """A total array: explicit entries over a default, never changed once built (`store`
    and `tabulate` copy). Reading an index that was never written gives the default."""

    __slots__ = ("default",)

    def __init__(self, entries: dict[Any, Any], default: Any) -> None:
        super().__init__(entries)
        self.default = default

    def __missing__(self, index: Any) -> Any:
        return self.default

    def stored(self) -> Iterator[tuple[Any, Any]]:
        """The explicit entries (index, value); every other index holds the default."""
        return iter(self.items())

    def __repr__(self) -> str:
        return f"Table({dict(self)!r}, default={self.default!r})"


class Concrete:
    """The plain-Python interpretation: the model as an executable pool."""

    no_key: Key = None

    def ite(self, cond: Bool, then: T, other: T) -> T:
        return then if cond else other

    def branch(self, cond: Bool, then: Callable[[], T], other: Callable[[], T]) -> T:
        return then() if cond else other()

    def all_(self, *conds: Bool) -> Bool:
        return all(conds)

    def any_(self, *conds: Bool) -> Bool:
        return any(conds)

    def not_(self, cond: Bool) -> Bool:
        return not cond

    def implies(self, cond: Bool, then: Bool) -> Bool:
        return (not cond) or bool(then)

    def array(self, default: Any) -> Array:
        return Table({}, default)

    def key_array(self, default: Any) -> Array:
        return Table({}, default)

    def request_array(self, default: Any) -> Array:
        return Table({}, default)

    def store(self, array: Array, index: Any, value: Any) -> Array:
        table = Table(array, array.default)
        table[index] = value
        return table

    def tabulate(self, lo: Int, hi: Int, value: Callable[[Int], Any], base: Array) -> Array:
        table = Table(base, base.default)
        table.update([(i, value(i)) for i in range(lo, hi)])
        return table

    def forall(self, lo: Int, hi: Int, holds: Callable[[Int], Bool]) -> Bool:
        return all(holds(i) for i in range(lo, hi))

    def forall_entries(self, array: Array, holds: Callable[[Any, Any], Bool]) -> Bool:
        return all(holds(index, value) for index, value in array.stored())


CONCRETE = Concrete()


def first_false(conditions: Iterable[tuple[str, Bool]]) -> str | None:
    """The name of the first condition that does not hold (concrete values), or None."""
    for name, holds in conditions:
        if not holds:
            return name
    return None
