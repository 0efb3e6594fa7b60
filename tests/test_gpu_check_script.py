"""The first-device script and `python -m pagedkv.gpu.check` run end to end on CPU (dry run).

`bash gpu/first_device.sh OUT --dry-run` is what a session with a device runs first, without
`--dry-run`: one run of it here covers its steps and the check's dry-run report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.gpu import check
from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS, Report, correctness_cases, main
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    CHECKED_BLOCK_SIZES,
    HEAD_SIZES,
    KERNEL_SOURCES,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("first-device")
    result = subprocess.run(
        ["bash", str(REPO / "gpu" / "first_device.sh"), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=os.environ | {"PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_the_first_device_script_runs_every_step_dry(dry_run_dir: Path) -> None:
    steps = json.loads((dry_run_dir / "first_device.json").read_text())
    assert list(steps) == ["cubins", "device tests", "check"]
    assert all(step["passed"] for step in steps.values())
    cubins = steps["cubins"]
    assert cubins["arch"] == 90
    assert {m["source"] for m in cubins["modules"]} == {s.file_name for s in KERNEL_SOURCES}
    assert all(m["loaded"] == 0 for m in cubins["modules"]), "nothing loads without a device"
    assert cubins["tools"]["cuobjdump"] and cubins["tools"]["nvdisasm"]
    assert "skipped" in steps["device tests"]["summary"]
    assert steps["check"]["exit_status"] == 0


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
        def run(report: Report, repeats: int) -> None:
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
