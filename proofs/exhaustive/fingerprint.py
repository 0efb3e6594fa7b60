"""A canonical form of everything an object holds, for the exhaustive search's merge key.

The search merges two worlds when their keys are equal. The spec's snapshot decides the spec's
future, but an object under test may hold state its snapshot does not show (a stale cache, a
counter, a link the snapshot does not read): merging on the spec's state alone would explore
only one of two differently broken implementations. So each world's key also holds the
fingerprint of the object under test: its whole object graph, walked from the root.

Canonical within a process: dict and set orders are ignored (entries are sorted by the hash of
their canonical keys; they do not change what a correct implementation does, and history makes
them differ), immutable values (tuples, named tuples, so block hashes)
are compared by value however they are shared, and mutable objects by the order in which the
walk first reaches them (so aliasing between lists, blocks and requests counts, and cycles such
as the free queue's links end). The fingerprint is Python's hash of that form: 64 bits, so two
of a search's states merge wrongly with probability below 1e-7 at a million states.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types

_ATOM_TYPES = frozenset({int, float, str, bytes, bool, type(None)})
HISTORY_FIELDS = frozenset({"kv_event_queue"})
"""Attributes that record history, not state: the KV cache events not yet taken grow with every
step, so keying on them would make the space infinite. The search compares them with the spec's
after every step instead (they are in both snapshots)."""
_REFERENCES = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    enum.Enum,
)


def _by_key_hash(item: tuple[object, object]) -> int:
    return hash(item[0])


def canonical(root: object) -> object:
    """The hashable canonical form of everything reachable from `root` (module docstring)."""
    seen: dict[int, int] = {}

    def walk(value: object) -> object:
        kind = type(value)
        if kind in _ATOM_TYPES:
            return value
        if isinstance(value, tuple):
            return tuple([walk(item) for item in value])
        if isinstance(value, _REFERENCES):
            return ("ref", getattr(value, "__qualname__", repr(value)))
        if _is_frozen_dataclass(kind) and _hashable(value):
            return value  # immutable and hashed by value: placeholders, specs
        key = id(value)
        if key in seen:
            return ("seen", seen[key])
        seen[key] = len(seen)
        if kind is list:
            return ("list", tuple([walk(item) for item in value]))  # type: ignore[attr-defined]
        if isinstance(value, dict):
            items = sorted([(walk(k), v) for k, v in value.items()], key=_by_key_hash)
            return ("dict", tuple([(k, walk(v)) for k, v in items]))
        if isinstance(value, (set, frozenset)):
            return ("set", tuple(sorted([walk(item) for item in value], key=hash)))
        fields = getattr(value, "__dict__", None)
        walked = (
            [(name, walk(fields[name])) for name in sorted(fields) if name not in HISTORY_FIELDS]
            if fields
            else []
        )
        for name in _slot_names(kind):
            if name not in HISTORY_FIELDS and hasattr(value, name):
                walked.append((name, walk(getattr(value, name))))
        return (kind.__qualname__, tuple(walked))

    return walk(root)


def _hashable(value: object) -> bool:
    """A frozen dataclass may still hold a dict (a KV cache config's tensors): then it is walked."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


_FROZEN: dict[type, bool] = {}
_SLOTS: dict[type, tuple[str, ...]] = {}


def _is_frozen_dataclass(cls: type) -> bool:
    if cls not in _FROZEN:
        params = getattr(cls, "__dataclass_params__", None)
        _FROZEN[cls] = dataclasses.is_dataclass(cls) and params is not None and bool(params.frozen)
    return _FROZEN[cls]


def _slot_names(cls: type) -> tuple[str, ...]:
    if cls not in _SLOTS:
        names: list[str] = []
        for klass in cls.__mro__:
            slots = getattr(klass, "__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if not name.startswith("__") and name not in names:
                    names.append(name)
        _SLOTS[cls] = tuple(names)
    return _SLOTS[cls]


def fingerprint(root: object) -> int:
    """A 64-bit hash of `canonical(root)`."""
    return hash(canonical(root))
