"""Planted bugs: the real contracts and pairs, run against deliberately wrong functions.

Each plant rebinds one contract's (or pair wrapper's) module global, e.g. `block_counts`, to a
copy of that module with one function replaced; the contract's code object is the same, so the
very assertions CI runs face the bug. Nothing in pagedkv is patched: the copies live here.

    cdiv_floor      required blocks by floor division: the step's last, partial block is missing
    window_off_by_1 the first useful block computed from the window's start + 1: a block the next
                    token still attends to is freed

`contract_false_alarm` is no bug: it holds, but CrossHair reports a counterexample for it, which
the runner must discard on replay. `python -m proofs.crosshair --suite
proofs.crosshair.planted` must exit 1 with a replayed counterexample for every plant, and list the
false alarm as discarded; `tests/test_crosshair.py` asserts it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from pagedkv import block_counts
from pagedkv.single_type import sliding_window
from proofs.crosshair import contracts as crosshair_contracts
from proofs.crosshair import pairs as crosshair_pairs
from proofs.crosshair.contracts import Contract
from proofs.crosshair.pairs import Pair


def _floor_required_blocks(
    num_computed_tokens: int, num_tokens: int, num_lookahead_tokens: int, block_size: int
) -> int:
    return (num_computed_tokens + num_tokens + num_lookahead_tokens) // block_size


def _first_useful_block_off_by_one(
    num_computed_tokens: int, sliding_window: int, block_size: int
) -> int:
    return (num_computed_tokens - sliding_window + 2) // block_size


def _module_with(module: types.ModuleType, **replacements: object) -> types.SimpleNamespace:
    """A stand-in for `module` with some attributes replaced."""
    return types.SimpleNamespace(**{**vars(module), **replacements})


def _rebound(function: Callable[..., Any], **globals_: object) -> Callable[..., Any]:
    """`function`'s own code, reading the given names from its globals replaced."""
    namespace = {**function.__globals__, **globals_}
    copy = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = dict(function.__annotations__)  # CrossHair draws inputs by type
    copy.__doc__ = function.__doc__
    copy.__module__ = __name__
    return copy


_COUNTS = _module_with(block_counts, num_required_blocks=_floor_required_blocks)
_WINDOW = _module_with(sliding_window, first_useful_block=_first_useful_block_off_by_one)

contract_num_required_blocks = _rebound(
    crosshair_contracts.contract_num_required_blocks, block_counts=_COUNTS
)
contract_first_useful_block = _rebound(
    crosshair_contracts.contract_first_useful_block, window_impl=_WINDOW
)
impl_num_required_blocks = _rebound(crosshair_pairs.impl_num_required_blocks, impl_counts=_COUNTS)
spec_num_required_blocks = crosshair_pairs.spec_num_required_blocks
impl_window_skipped = _rebound(crosshair_pairs.impl_window_skipped, impl_window=_WINDOW)
spec_window_skipped = crosshair_pairs.spec_window_skipped


def contract_false_alarm(length: int, taken: int) -> None:
    """Holds for every input, yet CrossHair 0.0.112 reports an IndexError for it (a slice copied
    and then deleted, VERIFICATION-NOTES.md): the runner must replay it and discard it."""
    assert 0 <= taken <= length <= 6
    items = list(range(length))
    out = items[:taken]
    del items[:taken]
    assert out == list(range(taken))
    assert items == list(range(taken, length))


CONTRACTS: tuple[Contract, ...] = (
    Contract(contract_num_required_blocks, ()),
    Contract(contract_first_useful_block, ()),
    Contract(contract_false_alarm, ((1, 1), (3, 2))),
)
PAIRS: tuple[Pair, ...] = (
    Pair(impl_num_required_blocks, spec_num_required_blocks, ()),
    Pair(impl_window_skipped, spec_window_skipped, ()),
)
