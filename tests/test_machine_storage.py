"""The machines' `TestCase`s keep hypothesis's examples out of the user's working directory
(`pagedkv.harness.machines.storage`), and leave a database the settings chose alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.configuration import storage_directory
from hypothesis.database import DirectoryBasedExampleDatabase

from pagedkv.harness.adapters import pagedkv_pool
from pagedkv.harness.machines.pool import make_pool_machine
from pagedkv.harness.machines.storage import (
    hypothesis_home,
    keep_out_of_working_directory,
    storage_outside_working_directory,
)

USER_TESTS = """\
from pagedkv.harness.adapters import pagedkv_pool
from pagedkv.harness.machines.pool import make_pool_machine


def leaky_pool(num_gpu_blocks, enable_caching, semantics):
    pool = pagedkv_pool(num_gpu_blocks, enable_caching, semantics)
    free_blocks = pool.free_blocks
    pool.free_blocks = lambda block_ids: free_blocks(list(block_ids)[1:])  # keeps one
    return pool


TestLeakyPool = make_pool_machine(leaky_pool).TestCase
"""
USER_CONFTEST = """\
from hypothesis import Phase, settings

# The database is left unset: hypothesis's default, in the working directory.
settings.register_profile("quick", phases=(Phase.explicit, Phase.reuse, Phase.generate))
settings.load_profile("quick")
"""


@pytest.mark.slow
def test_a_failing_machine_saves_its_example_in_pagedkvs_cache(tmp_path: Path) -> None:
    """A user's suite under hypothesis's default settings: the failure is saved (and replayed
    next time) under $PAGEDKV_CACHE/hypothesis, not in `.hypothesis/examples` beside the code."""
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    (work / "test_users_pool.py").write_text(USER_TESTS)
    (work / "conftest.py").write_text(USER_CONFTEST)
    env = {**os.environ, "PAGEDKV_CACHE": str(cache)}
    for name in ("HYPOTHESIS_PROFILE", "HYPOTHESIS_STORAGE_DIRECTORY", "CI"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the leak is found
    assert not (work / ".hypothesis" / "examples").exists()
    assert any((cache / "hypothesis" / "examples").iterdir())


def test_a_database_the_settings_chose_is_kept() -> None:
    """This repository's profiles set `database=None` (ci, nightly, mutation): kept as they are;
    hypothesis's default database in the working directory is moved to pagedkv's cache."""
    machine = make_pool_machine(pagedkv_pool)
    test_case = machine.TestCase
    database = test_case.settings.database
    if settings.default.database is None or settings.default.derandomize:
        assert database is settings.default.database or database is None
    else:
        assert isinstance(database, DirectoryBasedExampleDatabase)
        assert Path(database.path) == hypothesis_home() / "examples"
    test_case.settings = settings(test_case.settings, database=None)
    again = keep_out_of_working_directory(machine)
    assert again.TestCase.settings.database is None


def test_hypothesis_storage_is_moved_only_for_the_run() -> None:
    before = storage_directory(intent_to_write=False).home_directory
    with storage_outside_working_directory():
        inside = storage_directory(intent_to_write=False).home_directory
    assert storage_directory(intent_to_write=False).home_directory == before
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        assert inside == before
    else:
        assert inside == hypothesis_home()
