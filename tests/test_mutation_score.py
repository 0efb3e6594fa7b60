"""The committed mutation score (`proofs/mutation-score.json`) passes the gate and names survivors.

mutmut itself runs on demand (`python -m proofs.mutation`, a quarter of an hour on two cores),
never here: this checks the last result it wrote, and that the staging tree it runs in is laid
out the way mutmut expects.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from proofs import mutation
from proofs.mutation import (
    EQUIVALENT,
    GATE,
    MUTATED_MODULES,
    SCORE_PATH,
    SELECTED_TESTS,
    Score,
    Survivor,
    gate_problems,
    read_score,
    write_score,
)

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_score_passes_the_gate() -> None:
    score = read_score(SCORE_PATH)
    assert gate_problems(score) == []
    assert score.score >= GATE
    assert score.mutmut == "3.8.1"
    assert score.modules == list(MUTATED_MODULES)
    assert score.tests == list(SELECTED_TESTS)
    # A module whose mutants' statuses were carried from an earlier full run must not change.
    for name, digest in score.carried.items():
        assert mutation.module_sha256(name) == digest, name


def test_every_survivor_is_named_with_its_diff_and_its_equivalence_argument_if_any() -> None:
    """Survivors argued equivalent carry the argument (`proofs/mutation_equivalents.py`)."""
    score = read_score(SCORE_PATH)
    for survivor in score.survivors:
        assert survivor.name.startswith("pagedkv."), survivor.name
        assert survivor.diff.startswith("---"), survivor.name
        if survivor.status == "survived":
            assert survivor.equivalent == EQUIVALENT.get(survivor.name), survivor.name


def test_every_mutant_the_tests_let_live_is_argued_equivalent() -> None:
    """The committed run's survivors are timeouts (detected) or argued equivalent: no test is
    missing for any mutant that behaves differently."""
    unargued = [
        survivor.name
        for survivor in read_score(SCORE_PATH).survivors
        if survivor.status != "timeout" and survivor.equivalent is None
    ]
    assert unargued == []


def test_every_equivalence_argument_names_a_listed_survivor() -> None:
    listed = {survivor.name for survivor in read_score(SCORE_PATH).survivors}
    assert set(EQUIVALENT) <= listed


def test_the_selected_tests_and_mutated_modules_exist() -> None:
    for name in SELECTED_TESTS:
        assert (ROOT / "tests" / name).is_file(), name
    for name in MUTATED_MODULES:
        assert mutation.module_source(name).is_file(), name


def test_mutated_modules_are_named_inside_the_package() -> None:
    base = ROOT / "impl" / "single_type" / "base.py"
    assert mutation.module_source("single_type/base.py") == base
    assert mutation.module_source("vocab/request.py") == ROOT / "vocab" / "request.py"
    assert mutation.module_source("harness/machines/pool.py") == (
        ROOT / "harness" / "machines" / "pool.py"
    )


def test_a_score_round_trips_through_its_file(tmp_path: Path) -> None:
    score = Score(
        killed=18,
        total=20,
        counts={"killed": 18, "survived": 1, "timeout": 1, "total": 20},
        survivors=[
            Survivor("pagedkv.m.x_f__mutmut_1", "survived", "--- a\n+++ b", "same result"),
            Survivor("pagedkv.m.x_g__mutmut_2", "timeout", "--- a\n+++ b"),
        ],
        date="2026-01-01",
        seconds=60.0,
    )
    path = tmp_path / "score.json"
    write_score(score, path)
    assert read_score(path) == score
    assert (score.detected, score.score) == (19, 0.95)
    assert gate_problems(score, 0.95) == []
    assert gate_problems(score, 0.96) == ["19/20 detected (95.0%) < 96%"]


def test_the_staging_tree_has_the_layout_mutmut_expects(tmp_path: Path) -> None:
    staging = tmp_path / "mutation"
    mutation.build_staging(staging)
    package = staging / "src" / "pagedkv"
    for name in MUTATED_MODULES:
        assert (package / name).read_bytes() == mutation.module_source(name).read_bytes()
    # Every package lies where pyproject.toml's package-dir mapping installs it.
    for name, folder in mutation.package_folders().items():
        staged = staging / "src" / Path(*name.split("."))
        assert sorted(path.name for path in staged.glob("*.py")) == sorted(
            path.name for path in folder.glob("*.py")
        ), name
    for name in ("vocab/request.py", "events/index.py", "planning/plan.py", "spec/block_pool.py"):
        assert (package / name).is_file(), name
    assert (package / "harness" / "machines" / "pool.py").is_file()
    assert (package / "harness" / "client" / "manager.py").is_file()
    assert (package / "py.typed").is_file()
    assert not any(path.is_symlink() for path in staging.rglob("*"))  # mutmut writes into it
    for name in ("conftest.py", "manager_fixtures.py", *SELECTED_TESTS):
        assert (staging / "tests" / name).is_file(), name
    for name in mutation.PROOFS_MODULES:
        assert (staging / "proofs" / name).is_file(), name
    config = (staging / "pyproject.toml").read_text()
    only_mutate = ", ".join(f'"src/pagedkv/{name}"' for name in MUTATED_MODULES)
    assert 'source_paths = ["src/pagedkv"]' in config.splitlines()
    assert f"only_mutate = [{only_mutate}]" in config.splitlines()
    assert 'filterwarnings = ["error"]' in config.splitlines()


def test_a_rerun_merges_the_survivors_new_statuses_into_the_score() -> None:
    """`--rerun-survivors` (any staging tree, a fresh clone's too): a survivor that mutmut's
    results no longer list was killed, one listed keeps its new status, the counts follow, and
    every other mutant stays killed."""
    diff = "--- a\n+++ b"
    previous = Score(
        killed=16,
        total=20,
        counts={"killed": 16, "survived": 2, "no_tests": 1, "timeout": 1, "total": 20},
        survivors=[
            Survivor("pagedkv.m.x_f__mutmut_1", "survived", diff),
            Survivor("pagedkv.m.x_f__mutmut_2", "survived", diff),
            Survivor("pagedkv.m.x_g__mutmut_3", "no tests", diff),
            Survivor("pagedkv.m.x_g__mutmut_4", "timeout", diff),
        ],
        date="2026-01-01",
        seconds=60.0,
        sources_sha256="abc",
    )
    statuses = {
        "pagedkv.m.x_f__mutmut_2": "survived",
        "pagedkv.m.x_g__mutmut_4": "timeout",
        "pagedkv.m.x_h__mutmut_9": "not checked",  # not a survivor: a rerun never ran it
    }
    merged = mutation.merge_rerun(previous, statuses, 90.4)
    assert merged.counts == {
        "killed": 18,
        "survived": 1,
        "no_tests": 0,
        "timeout": 1,
        "total": 20,
    }
    assert (merged.killed, merged.total, merged.seconds) == (18, 20, 90)
    assert [(s.name, s.status) for s in merged.survivors] == [
        ("pagedkv.m.x_f__mutmut_2", "survived"),
        ("pagedkv.m.x_g__mutmut_4", "timeout"),
    ]
    assert merged.sources_sha256 == "abc"
    assert (merged.detected, gate_problems(merged, 0.95)) == (19, [])


def test_a_rerun_of_the_unargued_survivors_runs_those_and_keeps_the_argued_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--rerun-survivors --unargued-only` asks mutmut for the survivors no argument covers
    only; an argued survivor mutmut still lists keeps its status and its argument."""
    argued = next(iter(EQUIVALENT))
    diff = "--- a\n+++ b"
    previous = Score(
        killed=8,
        total=10,
        counts={"killed": 8, "survived": 2, "total": 10},
        survivors=[
            Survivor(argued, "survived", diff),
            Survivor("pagedkv.m.x_f__mutmut_1", "survived", diff),
        ],
        date="2026-01-01",
        seconds=60.0,
        sources_sha256=mutation.sources_sha256(),
    )
    path = tmp_path / "score.json"
    write_score(previous, path)
    (tmp_path / "mutants").mkdir()
    monkeypatch.setattr(mutation, "ROOT", tmp_path)  # no selected test to copy: none exist there
    monkeypatch.setattr(mutation, "TEST_HELPERS", ())
    monkeypatch.setattr(mutation, "SELECTED_TESTS", ())
    calls: list[list[str]] = []

    def fake_mutmut(args: list[str], staging: Path, *, timeout: float | None = None) -> str:
        calls.append(list(args))
        return f"    {argued}: survived\n" if args == ["results"] else ""

    monkeypatch.setattr(mutation, "_mutmut", fake_mutmut)
    merged = mutation.rerun_survivors(2, tmp_path, path, unargued_only=True)
    assert calls == [["run", "--max-children", "2", "pagedkv.m.x_f__mutmut_1"], ["results"]]
    assert [(s.name, s.status, s.equivalent) for s in merged.survivors] == [
        (argued, "survived", EQUIVALENT[argued])
    ]
    assert (merged.killed, merged.total) == (9, 10)


def test_a_stopped_run_carries_statuses_only_for_modules_unchanged_since_the_scored_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--finish-carrying REV`: an unchecked mutant of a module unchanged since REV takes REV's
    status (listed there: its status; not listed: killed); checked mutants keep this run's; an
    unchecked mutant of a changed module is refused."""
    previous = {
        "date": "2026-01-01",
        "modules": ["block.py", "free_queue.py"],
        "survivors": [{"name": "pagedkv.block.x_f__mutmut_2", "status": "survived"}],
    }
    results = [
        "    pagedkv.block.x_f__mutmut_1: not checked",
        "    pagedkv.block.x_f__mutmut_2: not checked",
        "    pagedkv.block.x_f__mutmut_3: survived",
        "    pagedkv.block_pool.x_g__mutmut_1: killed",
    ]

    def fake_git(*args: str) -> subprocess.CompletedProcess[str]:
        if args[0] == "show":
            return subprocess.CompletedProcess(args, 0, json.dumps(previous), "")
        if args[0] == "rev-parse":
            return subprocess.CompletedProcess(args, 0, "c0ffee\n", "")
        changed = not args[-1].endswith("impl/block.py")  # only block.py is unchanged
        return subprocess.CompletedProcess(args, int(changed), "", "")

    def fake_mutmut(args: list[str], staging: Path, *, timeout: float | None = None) -> str:
        if args[0] == "show":
            return f"# {args[1]}\n--- a\n+++ b"
        return "\n".join(results) + "\n"

    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(mutation, "_git", fake_git)
    monkeypatch.setattr(mutation, "_mutmut", fake_mutmut)
    score = mutation.finish_carrying("v1", tmp_path)
    assert [(s.name, s.status) for s in score.survivors] == [
        ("pagedkv.block.x_f__mutmut_2", "survived"),
        ("pagedkv.block.x_f__mutmut_3", "survived"),
    ]
    assert (score.killed, score.total, score.carried_from) == (2, 4, "c0ffee (2026-01-01)")
    assert list(score.carried) == ["block.py"]
    results.append("    pagedkv.free_queue.x_h__mutmut_1: not checked")  # free_queue.py changed
    with pytest.raises(RuntimeError, match=r"free_queue\.x_h__mutmut_1 was not checked"):
        mutation.finish_carrying("v1", tmp_path)


def test_a_survivor_left_out_of_a_rerun_keeps_its_status() -> None:
    """mutmut lists a mutant it never ran in the staging tree (a carried one) as "not checked":
    a survivor the rerun did not ask for keeps the status the score gave it."""
    diff = "--- a\n+++ b"
    previous = Score(
        killed=8,
        total=10,
        counts={"killed": 8, "survived": 2, "total": 10},
        survivors=[
            Survivor("pagedkv.m.x_f__mutmut_1", "survived", diff),
            Survivor("pagedkv.m.x_f__mutmut_2", "survived", diff),
        ],
        date="2026-01-01",
        seconds=60.0,
    )
    statuses = {"pagedkv.m.x_f__mutmut_2": "not checked"}
    merged = mutation.merge_rerun(previous, statuses, 61, rerun={"pagedkv.m.x_f__mutmut_1"})
    assert [(s.name, s.status) for s in merged.survivors] == [
        ("pagedkv.m.x_f__mutmut_2", "survived")
    ]
    assert merged.counts == {"killed": 9, "survived": 1, "total": 10}
