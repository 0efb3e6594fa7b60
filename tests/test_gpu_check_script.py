"""The first-device script and `python -m pagedkv.gpu.check` run end to end on CPU (dry run).

`bash gpu/first_device.sh OUT --dry-run` is what a session with a device runs first, without
`--dry-run`: one run of it here covers its steps, its line-by-line results and the check's
dry-run report. Runs stopped mid-way (SIGTERM as the timeout sends it, and SIGKILL) must leave
every finished result on disk; missing prerequisites must stop the run before anything else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pagedkv.gpu import check, first_device
from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS, Report, correctness_cases, main
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    CHECKED_BLOCK_SIZES,
    HEAD_SIZES,
    KERNEL_SOURCES,
    MMA_DTYPES,
)
from pagedkv.gpu.link_tree import build
from pagedkv.gpu.result_log import read_results

REPO = Path(__file__).resolve().parent.parent
STEPS = ["prerequisites", "cubins", "occupancy", "device tests", "check"]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kernel cache for this module's runs (the script's own default is a fresh one)."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="module")
def dry_run_dir(tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("first-device")
    result = subprocess.run(
        ["bash", str(REPO / "gpu" / "first_device.sh"), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=os.environ
        | {"PYTHON": sys.executable, "PAGEDKV_FIRST_DEVICE_CACHE": str(kernel_cache)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (out / "stdout.txt").write_text(result.stdout)
    return out


def test_the_first_device_script_runs_every_step_dry(dry_run_dir: Path) -> None:
    steps = json.loads((dry_run_dir / "first_device.json").read_text())
    assert list(steps) == STEPS
    assert all(step["passed"] for step in steps.values())
    prerequisites = steps["prerequisites"]
    assert prerequisites["missing"] == [] and prerequisites["problems"] == []
    assert set(prerequisites["modules"]) == set(first_device.PREREQUISITES)
    cubins = steps["cubins"]
    assert cubins["arch"] == 90
    assert {m["source"] for m in cubins["modules"]} == {s.file_name for s in KERNEL_SOURCES}
    assert all(m["loaded"] == 0 for m in cubins["modules"]), "nothing loads without a device"
    assert cubins["tools"]["cuobjdump"] and cubins["tools"]["nvdisasm"]
    assert len(cubins["sass_per_key"]) == len(MMA_DTYPES) * len(HEAD_SIZES)
    assert all(row["cpu"] >= row["planned"] for row in steps["occupancy"]["kernels"])
    tests = steps["device tests"]
    assert 0 < tests["skipped"] < tests["tests"], "no device: all but the host-side tests skip"
    assert tests["failures"] == tests["errors"] == 0
    assert "--noconftest" in tests["command"] and "-W default" in tests["command"]
    assert steps["check"]["exit_status"] == 0


def test_the_dry_run_writes_each_result_as_it_is_measured(dry_run_dir: Path) -> None:
    records = read_results(dry_run_dir / "first_device.jsonl")
    times = [record["time"] for record in records]
    assert times == sorted(times), "one file, in the order things happened"
    order = [r["step"] for r in records if r.get("done")]
    assert order == STEPS
    assert records[0]["step"] == "start" and records[-1] == {
        **records[-1],
        "step": "end",
        "exit_status": 0,
    }
    kinds = [r.get("kind") for r in records if r["step"] == "check"]
    assert kinds.count("correctness") == len(correctness_cases(small=True)) // 2 + 18
    assert kinds.count("decode") == len(DECODE_BATCHES) * len(DECODE_CONTEXTS)
    first_check = next(i for i, r in enumerate(records) if r["step"] == "check")
    assert all(r["step"] != "check" for r in records[:first_check])
    assert sum(r["step"] == "sass" for r in records) == len(MMA_DTYPES) * len(HEAD_SIZES)
    shown = (dry_run_dir / "stdout.txt").read_text()
    assert shown.count('"step": "occupancy"') >= 15 and '"kind": "decode"' in shown


def _start_dry_run(out: Path, kernel_cache: Path) -> subprocess.Popen[bytes]:
    with (out / "output.txt").open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "pagedkv.gpu.first_device", "--out", str(out), "--dry-run"],
            cwd=REPO,
            env=os.environ | {"PAGEDKV_KERNEL_CACHE": str(kernel_cache)},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(path: Path, done_step: str, process: subprocess.Popen[bytes]) -> None:
    for _ in range(1200):
        if path.exists() and any(
            r.get("done") and r["step"] == done_step for r in read_results(path)
        ):
            return
        if process.poll() is not None:
            output = (path.parent / "output.txt").read_text()
            raise AssertionError(f"the run ended before {done_step}:\n{output}")
        time.sleep(0.1)
    raise AssertionError(f"no {done_step} within two minutes")


@pytest.mark.parametrize(
    ("sig", "after"), [(signal.SIGTERM, "occupancy"), (signal.SIGKILL, "cubins")]
)
def test_a_run_stopped_mid_way_keeps_every_finished_result(
    sig: signal.Signals, after: str, tmp_path: Path, kernel_cache: Path, dry_run_dir: Path
) -> None:
    """SIGTERM is what `timeout` sends (to the process group: the pytest child too); SIGKILL
    leaves no chance to clean up. Either way every line written is whole and stays."""
    process = _start_dry_run(tmp_path, kernel_cache)
    log = tmp_path / "first_device.jsonl"
    _wait_for(log, after, process)
    os.killpg(process.pid, sig)
    status = process.wait(timeout=120)
    records = read_results(log)  # every line parses: nothing torn
    finished = STEPS[: STEPS.index(after) + 1]
    assert [r["step"] for r in records if r.get("done")][: len(finished)] == finished
    assert all(
        step in json.loads((tmp_path / "first_device.json").read_text()) for step in finished
    )
    assert not any(r["step"] == "end" and r["exit_status"] == 0 for r in records)
    if sig == signal.SIGTERM:
        assert status == 124
        assert records[-1] == {**records[-1], "step": "end", "exit_status": 124}
    else:
        assert status == -signal.SIGKILL
        assert records[-1]["step"] != "end"


def test_a_missing_prerequisite_stops_the_run_before_any_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """cupy missing on the device: pip is asked for it (`_pip_install`: -c constraints.txt;
    here it fails, as it would without a network), then the run stops loudly; without this
    check the device tests would only skip."""
    real_import = first_device._import
    pip_calls: list[list[str]] = []

    def no_cupy(name: str) -> Any:
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name)

    def failing_pip(packages: list[str]) -> subprocess.CompletedProcess[str]:
        pip_calls.append(packages)
        command = [sys.executable, "-m", "pip", "install", *packages]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable")

    monkeypatch.setattr(first_device, "_import", no_cupy)
    monkeypatch.setattr(first_device, "_pip_install", failing_pip)
    assert first_device.main(["--out", str(tmp_path)]) == 1
    assert pip_calls == [["cupy-cuda13x"]], "the pinned name; torch is never installed"
    steps = json.loads((tmp_path / "first_device.json").read_text())
    assert list(steps) == ["prerequisites"], "nothing runs after a missing prerequisite"
    assert steps["prerequisites"]["problems"] == ["cupy is not importable"]
    records = read_results(tmp_path / "first_device.jsonl")
    assert records[-1] == {**records[-1], "step": "end", "exit_status": 1}
    assert "STOPPED, prerequisites missing" in capsys.readouterr().err


def test_pip_installs_with_the_repository_constraints(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    first_device._pip_install(["ml-dtypes", "pytest"])
    command = calls[0]
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert command[command.index("-c") + 1] == str(REPO / "constraints.txt")
    assert command[-2:] == ["ml-dtypes", "pytest"]


def test_on_this_machine_the_device_run_stops_because_the_tests_would_skip(tmp_path: Path) -> None:
    assert first_device.main(["--out", str(tmp_path)]) == 1
    steps = json.loads((tmp_path / "first_device.json").read_text())
    assert list(steps) == ["prerequisites"]
    assert steps["prerequisites"]["problems"] == [
        "torch or cupy sees no CUDA device: the device tests would skip"
    ]


def test_the_link_tree_follows_pyproject_package_dir(tmp_path: Path) -> None:
    """The repository's own mapping, then one with a new top-level folder (pagedkv.vocab),
    a subpackage inside impl, and a package mapped inside another one's folder."""
    names = build(REPO / "pyproject.toml", tmp_path / "tree")
    assert {"pagedkv", "pagedkv.gpu", "pagedkv.spec", "pagedkv.engine"} <= set(names)
    package = tmp_path / "tree" / "pagedkv"
    assert (package / "gpu" / "occupancy.py").resolve() == REPO / "gpu" / "occupancy.py"
    assert (package / "gpu" / "emulator").resolve() == REPO / "gpu" / "emulator"
    assert (package / "spec").resolve() == REPO / "spec"

    repo = tmp_path / "repo"
    for folder in ("impl/store", "vocab", "gpu/emulator", "kernels"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "__init__.py").write_text(f"WHERE = {folder!r}\n")
    (repo / "impl" / "__init__.py").write_text("WHERE = 'impl'\n")
    (repo / "pyproject.toml").write_text(
        "[tool.setuptools]\n"
        'package-dir = {"pagedkv" = "impl", "pagedkv.vocab" = "vocab", "pagedkv.gpu" = "gpu", '
        '"pagedkv.gpu.emulator" = "gpu/emulator", "pagedkv.gpu.kernels" = "kernels"}\n'
    )
    build(repo / "pyproject.toml", tmp_path / "other")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pagedkv, pagedkv.store, pagedkv.vocab, pagedkv.gpu.emulator, "
            "pagedkv.gpu.kernels as k; print(pagedkv.WHERE, pagedkv.store.WHERE, "
            "pagedkv.vocab.WHERE, pagedkv.gpu.emulator.WHERE, k.WHERE)",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path / "other")},
    )
    assert result.stdout.split() == ["impl", "impl/store", "vocab", "gpu/emulator", "kernels"], (
        result.stderr
    )
    assert not (repo / "gpu" / "kernels").exists(), "nothing written into the repository"


def test_the_dry_run_writes_a_complete_report(dry_run_dir: Path) -> None:
    payload = json.loads((dry_run_dir / "check.json").read_text())
    text = (dry_run_dir / "check.txt").read_text()

    assert payload["mode"] == "dry run"
    assert payload["failures"] == []
    names = {case["name"] for case in payload["correctness"]}
    assert names == {case.name for case in correctness_cases(small=True) if case.default_kernel}
    variants = {name.split("/", 1)[1].rsplit("/", 1)[0] for name in names}
    assert len(variants) == len(ATTENTION_DTYPES) * len(HEAD_SIZES) * len(CHECKED_BLOCK_SIZES)
    assert all(case["passed"] and case["finite"] for case in payload["correctness"])
    assert all(case["max_error_over_bound"] <= 1 for case in payload["correctness"])

    cells = {(row["batch"], row["context"]): row for row in payload["decode"]}
    assert set(cells) == {(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS}
    # GPU-NOTES: a Llama-3-8B layer at batch 64 x 4096 moves about 1.075 GB per call.
    assert abs(cells[(64, 4096)]["bytes"] / 1.075e9 - 1) < 0.002
    assert cells[(64, 4096)]["num_splits"] == 1, "512 CTAs already fill an H200"
    assert cells[(1, 32768)]["num_splits"] > 1, "8 CTAs would not"
    assert all(row["kernel_us"] is None and row["correct"] is None for row in payload["decode"])
    assert cells[(8, 4096)]["ctas"] == 512, "one wave of the H200's 528 slots"
    assert payload["write"]["bytes"] == 2 * 2 * 65536 * 8 * 128 * 2 + 8 * 65536

    assert "correctness: 108/108 passed" in text
    assert "   64    4096" in text and "n/a" in text


def test_without_a_device_the_device_run_reports_the_error_and_fails(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 1
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["failures"] == ["run aborted"]
    assert "Error" in payload["error"]
    assert (tmp_path / "check.txt").read_text().count("ABORTED") == 1


def _row(batch: int, context: int, pct: float | None, correct: bool | None) -> dict[str, object]:
    return {"batch": batch, "context": context, "pct_of_copy": pct, "correct": correct}


def test_a_missed_target_exits_2_and_a_wrong_cell_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run(rows: list[dict[str, object]]) -> object:
        def run(report: Report, repeats: int, *args: object) -> None:
            report.decode = rows

        return run

    monkeypatch.setattr(check, "format_report", lambda report: "")
    cases = [
        ([_row(64, 4096, 85.0, True)], 0),
        ([_row(64, 4096, 79.9, True)], 2),
        ([_row(64, 4096, 85.0, True), _row(1, 512, 10.0, False)], 1),
        ([_row(64, 4096, 50.0, False)], 1),
    ]
    for rows, status in cases:
        monkeypatch.setattr(check, "device_run", fake_run(rows))
        assert main(["--out", str(tmp_path)]) == status, rows
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["failures"] == ["decode 64x4096"]
    assert payload["missed_targets"] == ["decode 64x4096 at 50.0% of the copy rate, target 80%"]
