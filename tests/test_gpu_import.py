"""`import pagedkv.gpu` needs neither cupy nor torch and touches no device."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pagedkv.gpu


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout.strip()


def test_importing_the_package_imports_no_array_library() -> None:
    loaded = _run(
        "import sys, pagedkv.gpu; "
        "print(sorted(m for m in ('cupy', 'torch', 'numpy') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_resolving_every_export_imports_neither_cupy_nor_torch() -> None:
    loaded = _run(
        "import sys, pagedkv.gpu as g; [getattr(g, n) for n in g.__all__]; "
        "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_every_export_resolves_to_an_object_of_that_name() -> None:
    for name in pagedkv.gpu.__all__:
        assert getattr(pagedkv.gpu, name).__name__ == name


def test_an_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(pagedkv.gpu, "no_such_name")  # noqa: B009 - a dynamic lookup is the point
