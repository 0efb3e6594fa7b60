"""The `pagedkv` command: `pagedkv verify` (the differential campaign), `pagedkv plan` (KV memory),
`pagedkv run` (the end-to-end engine, `pagedkv[engine]`).

Each subcommand lives in its own module, exposing `add_arguments(parser)` and `run(args) -> int`;
it is imported only when chosen, so `pagedkv plan` never imports hypothesis. A subcommand whose
optional dependency is missing (`pip install pagedkv`, then `pagedkv verify`) says which extra
to install and exits 2. `pagedkv --version` prints the installed version and build.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("pagedkv.harness.verify", "differential campaign: spec vs an implementation"),
    "plan": ("pagedkv.planning.cli", "KV cache memory plan for a model and a memory budget"),
    "run": ("pagedkv.engine.run_command", "serve a workload end to end on a paged KV cache"),
}
EXTRAS: dict[str, str] = {"hypothesis": "verify"}
"""Top-level module -> the optional extra (pyproject.toml) that installs it."""


def version_line() -> str:
    """`pagedkv 0.1.0 (pure Python, Python 3.12.1)`: the installed distribution's version, which
    build runs (`pagedkv.COMPILED`) and on which Python."""
    import pagedkv

    try:
        version = metadata.version("pagedkv")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "(not installed)"
    build = "compiled with mypyc" if pagedkv.COMPILED else "pure Python"
    return f"pagedkv {version} ({build}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """`--version`: like argparse's own, but the line is made only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_line())
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, summary) in SUBCOMMANDS.items():
        subparsers.add_parser(name, help=summary, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints usage and exits
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        print(
            f"pagedkv {argv[0]}: needs {missing}, which is not installed: "
            f"pip install 'pagedkv[{EXTRAS[missing]}]'",
            file=sys.stderr,
        )
        return 2
    sub = argparse.ArgumentParser(prog=f"pagedkv {argv[0]}", description=module.__doc__)
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
