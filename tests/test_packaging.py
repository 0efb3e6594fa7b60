"""spec/, vocab/ and impl/ import only the standard library; importing pagedkv loads no extra; the
spec shares vocabulary with impl, no rule or algorithm, and names each shared invariant as impl
does."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["spec", "impl", "vocab"])
def test_spec_and_impl_import_only_the_standard_library(folder: str) -> None:
    allowed = set(sys.stdlib_module_names) | {"pagedkv"}
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / folder).rglob("*.py")
        for module in _imported_modules(path)
        if module.split(".")[0] not in allowed and not _is_lazy(path, module)
    }
    assert not offenders


def _pagedkv_modules(path: Path) -> set[str]:
    """The pagedkv modules a file imports; `from pagedkv import x` counts as `pagedkv.x`."""
    names = {module for module in _imported_modules(path) if module.startswith("pagedkv.")}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "pagedkv":
            names.update(f"pagedkv.{alias.name}" for alias in node.names)
    return names


def _is_lazy(path: Path, module: str) -> bool:
    """An import inside a function body or under `if TYPE_CHECKING:` never runs at import time."""
    tree = ast.parse(path.read_text())
    for scope in ast.walk(tree):
        guarded = isinstance(scope, ast.If) and ast.unparse(scope.test).endswith("TYPE_CHECKING")
        if guarded or isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(scope):
                if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
                    return True
                if isinstance(node, ast.ImportFrom) and node.module == module:
                    return True
    return False


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("spec", ("pagedkv.spec", "pagedkv.vocab")),
        ("vocab", ("pagedkv.vocab",)),
    ],
)
def test_spec_and_vocab_import_nothing_of_the_implementation(
    folder: str, allowed: tuple[str, ...]
) -> None:
    """The spec shares vocabulary (`pagedkv.vocab`: errors, refusal wording, Request, hash
    types, specs, semantics, event records) and nothing else with impl: no rule, no algorithm."""
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / folder).rglob("*.py")
        for module in _pagedkv_modules(path)
        if not module.startswith(allowed)
    }
    assert not offenders


def test_importing_the_spec_loads_no_module_of_the_implementation() -> None:
    """`import pagedkv.spec` runs `pagedkv/__init__.py`, which loads its names lazily: the spec
    and the vocabulary are all that is loaded."""
    code = (
        "import sys, pagedkv.spec;print(sorted(m for m in sys.modules if m.startswith('pagedkv')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout)  # a printed list of str
    outside = [
        m for m in loaded if m != "pagedkv" and not m.startswith(("pagedkv.spec", "pagedkv.vocab"))
    ]
    assert "pagedkv.spec.manager" in loaded and not outside


def test_pagedkv_loads_its_public_names_on_first_use() -> None:
    code = (
        "import sys, pagedkv;"
        "before = 'pagedkv.manager' in sys.modules;"
        "manager = pagedkv.KVCacheManager;"
        "print(before, manager.__module__, 'pagedkv.manager' in sys.modules,"
        " sorted(set(pagedkv.__all__) - set(dir(pagedkv))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "pagedkv.manager", "True", "[]"]
    import pagedkv

    missing = [name for name in pagedkv.__all__ if getattr(pagedkv, name, None) is None]
    assert not missing
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pagedkv.Nope  # noqa: B018


def test_importing_pagedkv_loads_no_optional_dependency() -> None:
    code = (
        "import sys, pagedkv, pagedkv.spec, pagedkv.gpu;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'cupy', 'numpy', 'hypothesis', 'ml_dtypes'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


REPRESENTATION_ONLY = {
    # The spec's plain containers and its transition table.
    "spec": {
        "one ref_cnt and one hash slot per block",
        "every block state change is in TRANSITIONS",
        "prefix closure: a cached block's parent hash is cached",  # needs the spec's ghost map
        # its record of blocks whose hash was a partial key, for that prefix closure
        "a block hashed under a partial key is hashed",
    },
    # The implementation's block objects and linked list.
    "impl": {
        "the null block is block 0",
        "blocks[i].block_id == i",
        "every block belongs to the pool's free queue",
        "free queue links agree both ways",
        "free queue tail is its last block",
        "num_free_blocks counts the queue",
        "the fast path's record of a tracked request is its own",
    },
}


def _invariant_names(*paths: str) -> set[str]:
    """The names the files give InvariantViolation."""
    pattern = re.compile(r'InvariantViolation\(\s*"([^"]+)"')
    return {name for path in paths for name in pattern.findall((ROOT / path).read_text())}


def test_spec_and_impl_name_each_shared_invariant_alike() -> None:
    """An invariant both sides check has one name, so a report reads the same from either; the
    ones only a representation has are listed above."""
    spec = _invariant_names("spec/block_pool.py", "spec/manager.py")
    impl = _invariant_names("impl/block_pool.py", "impl/free_queue.py", "impl/manager.py")
    assert REPRESENTATION_ONLY["spec"] <= spec and REPRESENTATION_ONLY["impl"] <= impl
    assert spec - REPRESENTATION_ONLY["spec"] == impl - REPRESENTATION_ONLY["impl"]
