"""One registry of attention types: each type is one module in impl and one in the spec, picked
by its spec type, and drawn by the harness; no per-type module repeats another's lines.

A new attention type is one module per side, one entry in each registry and one draw
(CONTRIBUTING.md); these tests fail until all of them are there.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from pagedkv.harness.swarm.runs import ATTENTION_DRAWS, STATE_DRAWS
from pagedkv.single_type import SINGLE_TYPE_MANAGERS, SingleTypeKVCacheManager
from pagedkv.spec.single_type import SPEC_SINGLE_TYPE_MANAGERS, SpecSingleTypeManager

ROOT = Path(__file__).resolve().parent.parent
MIN_RUN = 6
"""Lines in a row two per-type modules may not share (the issue's measure of repetition)."""


def test_every_spec_type_has_a_manager_on_each_side_and_a_draw() -> None:
    drawn = set(ATTENTION_DRAWS) | set(STATE_DRAWS)
    assert set(SINGLE_TYPE_MANAGERS) == set(SPEC_SINGLE_TYPE_MANAGERS) == drawn
    for spec_type, manager_class in SINGLE_TYPE_MANAGERS.items():
        spec_class = SPEC_SINGLE_TYPE_MANAGERS[spec_type]
        assert issubclass(manager_class, SingleTypeKVCacheManager)
        assert issubclass(spec_class, SpecSingleTypeManager)
        assert manager_class.kind == spec_class.kind, spec_type
        assert manager_class.allows_null_blocks == spec_class.allows_null_blocks, spec_type
        assert manager_class.supports_eagle == spec_class.supports_eagle, spec_type


def test_only_a_type_whose_hits_may_hold_null_blocks_checks_a_hit_shape() -> None:
    """`allocate_slots` asks for a hit's shape only where `allows_null_blocks` (a full-attention
    hit has one shape: its cached prefix); a type that checks one without nulls must say so."""
    for manager_class in SINGLE_TYPE_MANAGERS.values():
        overrides = manager_class.hit_shape_error is not SingleTypeKVCacheManager.hit_shape_error
        assert overrides == manager_class.allows_null_blocks, manager_class.__name__


@pytest.mark.parametrize("side", ["impl", "spec"])
def test_each_attention_type_is_one_module_beside_the_pool(side: str) -> None:
    """The per-type managers together, in one folder beside the pool they draw from."""
    registry = SINGLE_TYPE_MANAGERS if side == "impl" else SPEC_SINGLE_TYPE_MANAGERS
    folder = ROOT / side / "single_type"
    assert (ROOT / side / "block_pool.py").is_file()
    modules = {manager_class.__module__ for manager_class in registry.values()}
    assert len(modules) == len(registry)
    for module in modules:
        assert (folder / f"{module.rsplit('.', 1)[1]}.py").is_file(), module


def _code_lines(path: Path) -> list[str]:
    """The module's lines, stripped, blank lines, comments and the signatures of functions
    left out: an override repeats its base's signature by necessity (the contract it keeps),
    which is not a repeated line of logic."""
    text = path.read_text()
    signature_lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            signature_lines.update(range(node.lineno, node.body[0].lineno))
    lines = (
        line.strip()
        for number, line in enumerate(text.splitlines(), 1)
        if number not in signature_lines
    )
    return [line for line in lines if line and not line.startswith("#")]


def test_signatures_are_the_only_lines_left_out() -> None:
    """The comparison still sees a function's body: only its header is left out."""
    lines = _code_lines(ROOT / "impl" / "single_type" / "base.py")
    assert not any(line.startswith("def ") for line in lines)
    assert "self.num_cached_block.pop(request_id, None)" in lines


def _shared_run(first: list[str], second: list[str]) -> list[str]:
    """The longest run of lines both have in a row (an empty list if none)."""
    best: list[str] = []
    for i, j in itertools.product(range(len(first)), range(len(second))):
        length = 0
        while (
            i + length < len(first)
            and j + length < len(second)
            and first[i + length] == second[j + length]
        ):
            length += 1
        if length > len(best):
            best = first[i : i + length]
    return best


@pytest.mark.parametrize("side", ["impl", "spec"])
def test_no_per_type_manager_repeats_another_s_lines(side: str) -> None:
    folder = ROOT / side / "single_type"
    modules = sorted(path for path in folder.glob("*.py") if path.name != "__init__.py")
    for first, second in itertools.combinations(modules, 2):
        run = _shared_run(_code_lines(first), _code_lines(second))
        assert len(run) < MIN_RUN, (first.name, second.name, run)
