"""The build hook (setup.py) and the COMPILED flag: which build is installed, and how it is chosen.

`./dev test` runs this file twice: on the editable dev install (PAGEDKV_EXPECT_BUILD=pure) and on
the compiled variant it builds into build/compiled (PAGEDKV_EXPECT_BUILD=compiled), so a build
that silently fell back to pure Python fails there.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zipfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

import pagedkv
import setup  # the build hook at the repository root (pytest puts the root on sys.path)
from pagedkv._build_info import MYPYC_MODULES

ROOT = Path(__file__).resolve().parent.parent


def package_folders() -> set[str]:
    """The top-level source folders pyproject.toml maps onto pagedkv's packages."""
    config = read_configuration(ROOT / "pyproject.toml")
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {folder.split("/")[0] for folder in package_dir.values()}


def test_the_flag_says_which_modules_run_compiled() -> None:
    for name in MYPYC_MODULES:
        origin = importlib.import_module(name).__file__
        assert origin is not None
        assert origin.endswith(tuple(EXTENSION_SUFFIXES)) == (name in pagedkv.COMPILED_MODULES)
    all_compiled = pagedkv.COMPILED_MODULES == MYPYC_MODULES
    assert pagedkv.COMPILED is all_compiled


def test_the_expected_build_is_the_one_imported() -> None:
    expected = os.environ.get("PAGEDKV_EXPECT_BUILD")
    if expected is None:
        pytest.skip("PAGEDKV_EXPECT_BUILD is unset (./dev test sets it to pure or compiled)")
    assert expected in ("pure", "compiled")
    assert pagedkv.COMPILED is (expected == "compiled"), pagedkv.COMPILED_MODULES
    if expected == "pure":
        assert pagedkv.COMPILED_MODULES == ()


def test_the_hook_compiles_the_listed_modules_of_impl() -> None:
    assert setup.mypyc_modules() == list(MYPYC_MODULES)
    for name in MYPYC_MODULES:
        path = name.removeprefix("pagedkv.").replace(".", "/")
        assert (ROOT / "impl" / f"{path}.py").is_file(), name


def test_the_mypy_that_compiles_is_the_pinned_one() -> None:
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert setup.MYPY_REQUIREMENT in pins


def test_the_build_mode_comes_from_pagedkv_build() -> None:
    assert setup.build_mode({}) == "auto"
    assert setup.build_mode({"PAGEDKV_BUILD": " compiled "}) == "compiled"
    with pytest.raises(SystemExit, match="PAGEDKV_BUILD must be one of auto, compiled, pure"):
        setup.build_mode({"PAGEDKV_BUILD": "fast"})


def test_editable_and_pure_builds_never_compile() -> None:
    argv = ["setup.py", "bdist_wheel"]
    assert not setup.wants_compiled("pure", argv, {})
    assert not setup.wants_compiled("compiled", ["setup.py", "editable_wheel"], {})
    assert setup.setup_arguments(argv, {"PAGEDKV_BUILD": "pure"}) == {}


def test_without_a_compiler_auto_is_pure_and_compiled_fails() -> None:
    no_compiler = {"CC": "/nonexistent/cc"}
    assert setup.c_compiler(no_compiler) is None
    assert not setup.wants_compiled("auto", ["setup.py", "bdist_wheel"], no_compiler)
    with pytest.raises(SystemExit, match="no C compiler"):
        setup.wants_compiled("compiled", ["setup.py", "bdist_wheel"], no_compiler)


def test_a_wheel_build_asks_for_mypy_only_when_it_will_compile() -> None:
    egg_info = ["setup.py", "egg_info"]  # what PEP 517's get_requires_for_build_wheel runs
    compiler = {"CC": sys.executable}  # any program on PATH counts as found
    assert setup.setup_arguments(egg_info, compiler) == {"setup_requires": [setup.MYPY_REQUIREMENT]}
    assert setup.setup_arguments(egg_info, {**compiler, "PAGEDKV_BUILD": "pure"}) == {}
    assert setup.setup_arguments(egg_info, {"CC": "/nonexistent/cc"}) == {}


@pytest.mark.slow
@pytest.mark.skipif(pagedkv.COMPILED, reason="builds from the sources: the pure run covers it")
def test_a_compiler_that_fails_leaves_a_pure_wheel(tmp_path: Path) -> None:
    """auto mode: mypyc's C code does not compile (CC=false), so the wheel carries sources only."""
    source = tmp_path / "src"
    source.mkdir()
    for name in package_folders():
        (source / name).symlink_to(ROOT / name, target_is_directory=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        (source / name).symlink_to(ROOT / name)
    env = {**os.environ, "PAGEDKV_BUILD": "auto", "CC": "false"}
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q"]
    build = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path / "wheel"), str(source)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "wheel").glob("pagedkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [name for name in names if name.endswith("pagedkv/manager.py")]
    assert not [name for name in names if name.endswith(".so")]
