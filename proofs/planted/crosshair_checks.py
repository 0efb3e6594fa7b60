"""The CrossHair contracts and spec/impl pairs, rebound to face each planted pure-function bug.

For every variant of `proofs.planted.catalog` that replaces a module-level function, every
contract (`proofs.crosshair.contracts`) and pair (`proofs.crosshair.pairs`) that calls that
function directly (through its module, `block_counts.fits`, or by name) gets a copy whose code is
the original's and whose globals see the broken function instead (the approach of
`proofs.crosshair.planted`). The copies are exported here as
`contract_<variant>__<contract>` and `impl_<variant>__<pair>`, so that
`crosshair check proofs.planted.crosshair_checks.<name>` reaches them in a fresh process; nothing is
patched in any process.

A contract that reaches the function only through another function (a class method, say) is not
rebound: CrossHair sees only the pure functions.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from proofs.crosshair.contracts import CONTRACTS as _CONTRACTS
from proofs.crosshair.contracts import Contract
from proofs.crosshair.pairs import PAIRS as _PAIRS
from proofs.crosshair.pairs import Pair
from proofs.planted.catalog import VARIANTS, FunctionPatch, Variant


def _names(code: types.CodeType) -> Iterator[str]:
    """Global and attribute names `code` and its nested functions use."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def _replacements(function: Callable[..., Any], patch: FunctionPatch) -> dict[str, object]:
    """Globals of `function` to replace so that its direct calls reach the planted function."""
    names = set(_names(function.__code__))
    attribute = patch.original.__name__
    replaced: dict[str, object] = {}
    for name in names:
        value = function.__globals__.get(name)
        if value is patch.original:
            replaced[name] = patch.replacement
        elif (
            isinstance(value, types.ModuleType)
            and attribute in names
            and getattr(value, attribute, None) is patch.original
        ):
            replaced[name] = types.SimpleNamespace(**{**vars(value), attribute: patch.replacement})
    return replaced


def _renamed_copy(
    function: Callable[..., Any], name: str, replaced: dict[str, object]
) -> Callable[..., Any]:
    """`function`'s code under `name` (frames show it, so replay finds its preconditions)."""
    if sys.version_info >= (3, 11):
        code = function.__code__.replace(co_name=name, co_qualname=name)
    else:  # pragma: no cover - Python 3.10 has no co_qualname
        code = function.__code__.replace(co_name=name)
    copy = types.FunctionType(
        code, {**function.__globals__, **replaced}, name, function.__defaults__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = dict(function.__annotations__)  # CrossHair draws inputs by type
    copy.__doc__ = function.__doc__
    copy.__qualname__ = name
    copy.__module__ = __name__
    return copy


def _build(variant: Variant) -> list[Contract | Pair]:
    items: list[Contract | Pair] = []
    for patch in variant.replaced_functions:
        for contract in _CONTRACTS:
            replaced = _replacements(contract.check, patch)
            if replaced:
                suffix = contract.check.__name__.removeprefix("contract_")
                name = f"contract_{variant.name}__{suffix}"
                items.append(Contract(_renamed_copy(contract.check, name, replaced), ()))
        for pair in _PAIRS:
            replaced = _replacements(pair.impl, patch)
            if replaced:
                name = f"impl_{variant.name}__{pair.impl.__name__.removeprefix('impl_')}"
                items.append(Pair(_renamed_copy(pair.impl, name, replaced), pair.spec, ()))
    return items


CHECKS_BY_VARIANT: dict[str, tuple[Contract | Pair, ...]] = {
    variant.name: tuple(_build(variant)) for variant in VARIANTS
}
"""Variant name -> its rebound contracts, then its rebound pairs (empty: CrossHair is blind)."""

CONTRACTS: tuple[Contract, ...] = tuple(
    item for items in CHECKS_BY_VARIANT.values() for item in items if isinstance(item, Contract)
)
PAIRS: tuple[Pair, ...] = tuple(
    item for items in CHECKS_BY_VARIANT.values() for item in items if isinstance(item, Pair)
)

# Export every copy and every pair's spec side under its name, for the crosshair command line.
for _contract in CONTRACTS:
    globals()[_contract.check.__name__] = _contract.check
for _pair in PAIRS:
    globals()[_pair.impl.__name__] = _pair.impl
    globals()[_pair.spec.__name__] = _pair.spec
