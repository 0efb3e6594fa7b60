"""Where hypothesis keeps what the machines' `TestCase`s write: not in the user's working directory.

Left alone, hypothesis writes `.hypothesis/` into the working directory of whoever runs a test:
its example database (`.hypothesis/examples`, the failing examples it replays next time) and a
cache of the constants it finds in the modules under test (`.hypothesis/constants`). A user who
imports `make_pool_machine(...).TestCase` into a test suite of their own should not find that
folder beside their code. So `keep_out_of_working_directory` makes a machine's `TestCase`

- save and replay examples in pagedkv's cache (`$PAGEDKV_CACHE/hypothesis/examples`, by default
  `~/.cache/pagedkv/hypothesis/examples`) when its settings would use hypothesis's default
  database in the working directory; a database the settings chose (None included, as every
  derandomized profile of this repository has) is kept;
- run with hypothesis's storage (constants and other caches) in `$PAGEDKV_CACHE/hypothesis`,
  unless `HYPOTHESIS_STORAGE_DIRECTORY` or `set_hypothesis_home_dir` already put it elsewhere.

Settings passed to `run_state_machine_as_test(machine, settings=...)` are the caller's and stay
as they are. One write is not the machines' to move: under pytest, hypothesis's plugin caches the
constants of the user's own modules (those outside site-packages, such as a factory module in
the working directory) while it collects, before any test runs; installed pagedkv is in
site-packages and is not among them. `HYPOTHESIS_STORAGE_DIRECTORY` moves that cache too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine

from pagedkv.harness.vllm.wheel import cache_root

M = TypeVar("M", bound=type[RuleBasedStateMachine])


def hypothesis_home() -> Path:
    """Where the machines' hypothesis storage goes: `$PAGEDKV_CACHE/hypothesis`."""
    return cache_root() / "hypothesis"


def _default_home() -> Path:
    return Path.cwd() / ".hypothesis"


def _writes_into_working_directory(database: Any) -> bool:
    return isinstance(database, DirectoryBasedExampleDatabase) and Path(
        database.path
    ).absolute() == (_default_home() / "examples")


@contextlib.contextmanager
def storage_outside_working_directory() -> Iterator[None]:
    """Hypothesis's storage in `hypothesis_home()` for the duration, where it would otherwise be
    the working directory's `.hypothesis/`."""
    try:
        from hypothesis.configuration import set_hypothesis_home_dir, storage_directory

        where: Any = storage_directory(intent_to_write=False)
    except (ImportError, TypeError):  # a hypothesis without these: leave its storage alone
        yield
        return
    home = Path(getattr(where, "home_directory", where))
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY") or home.absolute() != _default_home():
        yield
        return
    set_hypothesis_home_dir(hypothesis_home())
    try:
        yield
    finally:
        set_hypothesis_home_dir(home)


def keep_out_of_working_directory(machine: M) -> M:
    """`machine`, its `TestCase` writing nothing into the working directory (module docstring)."""
    test_case: Any = cast(Any, machine).TestCase
    chosen = test_case.settings
    if not chosen.derandomize and _writes_into_working_directory(chosen.database):
        examples = DirectoryBasedExampleDatabase(hypothesis_home() / "examples")
        test_case.settings = settings(chosen, database=examples)
    run_test = test_case.runTest

    def runTest(self: Any) -> None:  # noqa: N802 - unittest's name
        with storage_outside_working_directory():
            run_test(self)

    runTest.is_hypothesis_test = True  # type: ignore[attr-defined]  # as hypothesis marks it
    test_case.runTest = runTest
    return machine
