"""Build hook: compile pagedkv's hot modules with mypyc where possible, else install pure Python.

Metadata and packages live in pyproject.toml; this file only decides whether a wheel carries
mypyc-compiled extension modules next to the Python sources (the modules are listed once, in
`impl/_build_info.py`). `PAGEDKV_BUILD` chooses:

    auto      (default) compile when a C compiler is found; if compiling fails, install pure
    compiled  compile, or fail the build (CI: a silent fallback would make its checks vacuous)
    pure      never compile

Editable installs (`pip install -e .`, `./dev setup`) are always pure Python: mutation testing,
planted bugs and CrossHair work on the sources. Compiling needs mypy (`MYPY_REQUIREMENT`), which
a wheel build asks for as a build requirement; after the build, nothing of mypy is needed.
`import pagedkv; pagedkv.COMPILED` says which build is installed.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD_INFO = ROOT / "impl" / "_build_info.py"
STAGE = Path("build") / "mypyc"  # relative: mypyc writes C sources under the working directory
MYPY_REQUIREMENT = "mypy==2.4.1"  # mypyc's output depends on its version: the dev pin's
MODES = ("auto", "compiled", "pure")
COMPILING_COMMANDS = {"bdist_wheel", "build", "build_ext", "install"}
# mypy follows imports to type-check the compiled modules; torch (typing-only imports in impl/)
# would cost a minute and is not needed to compile anything.
MYPY_CONFIG = """\
[mypy]
[mypy-torch,torch.*]
follow_imports = skip
ignore_missing_imports = True
"""


def mypyc_modules(build_info: Path = BUILD_INFO) -> list[str]:
    """`MYPYC_MODULES` from `impl/_build_info.py`, read without importing pagedkv."""
    for node in ast.parse(build_info.read_text()).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "MYPYC_MODULES"
            and node.value is not None
        ):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"{build_info} defines no MYPYC_MODULES")


def build_mode(environ: Mapping[str, str]) -> str:
    """The requested mode: PAGEDKV_BUILD, "auto" when unset."""
    mode = environ.get("PAGEDKV_BUILD", "auto").strip() or "auto"
    if mode not in MODES:
        raise SystemExit(f"PAGEDKV_BUILD must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def c_compiler(environ: Mapping[str, str]) -> str | None:
    """The C compiler setuptools would call (CC, else Python's own), if it is on PATH."""
    command = environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = command.split()
    return shutil.which(words[0]) if words else None


def wants_compiled(mode: str, argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this setup.py run should compile (or, for `egg_info`, ask for mypy).

    Raises:
        SystemExit: mode "compiled" without a C compiler.
    """
    if mode == "pure" or "editable_wheel" in argv:
        return False
    if c_compiler(environ) is None:
        if mode == "compiled":
            raise SystemExit("PAGEDKV_BUILD=compiled, but no C compiler was found (CC or cc)")
        print("pagedkv: no C compiler found; installing pure Python", file=sys.stderr)
        return False
    return True


def stage_sources(modules: Sequence[str]) -> list[str]:
    """Copy impl/ and vocab/ to build/mypyc/src/pagedkv/, so that mypyc names the modules pagedkv.*.

    The staged `__init__.py` is empty: mypy then checks only what the compiled modules import.

    Returns:
        The staged paths of `modules`, and mypy's options, as mypycify takes them.
    """
    package = STAGE / "src" / "pagedkv"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for folder, staged in (("impl", package), ("vocab", package / "vocab")):
        for source in (ROOT / folder).rglob("*.py"):
            target = staged / source.relative_to(ROOT / folder)
            if target == package / "__init__.py":
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    (package / "__init__.py").write_text("")
    (package / "py.typed").write_text("")
    config = STAGE / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    paths = [
        str(package / f"{name.removeprefix('pagedkv.').replace('.', '/')}.py") for name in modules
    ]
    return ["--config-file", str(config), *paths]


class OptionalBuildExt(build_ext):  # type: ignore[misc]  # setuptools ships no types
    """In auto mode, a failed compile leaves a pure-Python install instead of a failed build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # the compiler's failure, whatever form it takes
            if build_mode(os.environ) != "auto":
                raise
            print(f"pagedkv: compiling failed ({error}); installing pure Python", file=sys.stderr)
            for extension in self.extensions:
                Path(self.get_ext_fullpath(extension.name)).unlink(missing_ok=True)
            self.extensions.clear()


def setup_arguments(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """What to add to pyproject.toml's configuration for this run of setup.py."""
    mode = build_mode(environ)
    if not wants_compiled(mode, argv, environ):
        return {}
    if not COMPILING_COMMANDS.intersection(argv):
        return {"setup_requires": [MYPY_REQUIREMENT]}  # egg_info: PEP 517 build requirements
    try:
        from mypyc.build import mypycify
    except ImportError:
        if mode == "compiled":
            raise SystemExit(f"PAGEDKV_BUILD=compiled needs {MYPY_REQUIREMENT}") from None
        print("pagedkv: mypy is not installed; installing pure Python", file=sys.stderr)
        return {}
    try:
        extensions = mypycify(
            stage_sources(mypyc_modules()),
            opt_level="3",
            debug_level="0",
            group_name="pagedkv",
            target_dir=str(STAGE / "c"),
        )
    except (Exception, SystemExit) as error:  # mypyc reports type errors with SystemExit
        if mode == "compiled":
            raise
        print(f"pagedkv: mypyc failed ({error}); installing pure Python", file=sys.stderr)
        return {}
    return {"ext_modules": extensions, "cmdclass": {"build_ext": OptionalBuildExt}}


if __name__ == "__main__":
    setup(**setup_arguments(sys.argv, os.environ))
