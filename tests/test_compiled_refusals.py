"""The compiled build refuses ill-typed arguments exactly as the pure build does.

mypyc checks the declared type of every argument of a compiled function when it is called, and
of every attribute of an interpreted object (a `Request`) it reads, raising a bare TypeError
before any check of ours runs. So the public calls of the compiled modules take the values a
caller supplies as `object` and check them, and the decode fast path reads the request's
scheduler-set fields untyped: every case of `refusal_cases.py` must answer alike on both builds
(same error class, same message, same state). Runs on the compiled build (`./dev test` does),
comparing with the pure sources run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from refusal_cases import CASES, Outcome, outcome, recorded_outcomes

import pagedkv

ROOT = Path(__file__).resolve().parent.parent

on_compiled_build = pytest.mark.skipif(
    not pagedkv.COMPILED,
    reason="compares the compiled build with the pure one (./dev test runs it on the compiled one)",
)


@pytest.fixture(scope="module")
def pure_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """The cases run on the pure sources: a link tree of this checkout, in a subprocess."""
    package = tmp_path_factory.mktemp("pure") / "pagedkv"
    package.mkdir()
    for source in (ROOT / "impl").iterdir():
        (package / source.name).symlink_to(source)
    for folder in ("vocab", "spec", "harness", "gpu"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    script = ROOT / "tests" / "refusal_cases.py"
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    )
    report = json.loads(run.stdout)
    assert report["compiled"] is False, "the link tree must run the pure sources"
    outcomes: dict[str, Outcome] = report["outcomes"]
    return outcomes


@on_compiled_build
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_build_answers_as_the_pure_one(
    case: str, pure_outcomes: dict[str, Outcome]
) -> None:
    assert outcome(case) == pure_outcomes[case]


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_is_a_typed_refusal_that_changes_nothing(case: str) -> None:
    """On the build this process imports (pure in the main run, compiled in the compiled
    stage): an ill-typed argument is refused with pagedkv's typed error, atomically."""
    result = outcome(case)
    assert result["raised"] in {
        "pagedkv.vocab.errors.ArgumentTypeError",
        "pagedkv.vocab.errors.InvalidArgumentError",
    }, result
    assert result["message"], result
    assert not result["changed"], result


def test_the_record_names_every_case() -> None:
    assert sorted(recorded_outcomes()) == sorted(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_answers_as_recorded(case: str) -> None:
    """The error class and message users see, pinned (`tests/refusal_outcomes.json`) on both
    builds: a reworded message is a deliberate change, recorded with `--write`."""
    assert outcome(case) == recorded_outcomes()[case]
