"""`python -m pagedkv.gpu.check --dry-run` runs end to end on CPU and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.gpu import check
from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS, Report, correctness_cases, main
from pagedkv.gpu.kernel_variants import ATTENTION_DTYPES, CHECKED_BLOCK_SIZES, HEAD_SIZES


def test_the_dry_run_writes_a_complete_report(tmp_path: Path) -> None:
    assert main(["--dry-run", "--out", str(tmp_path / "report")]) == 0
    payload = json.loads((tmp_path / "report" / "check.json").read_text())
    text = (tmp_path / "report" / "check.txt").read_text()

    assert payload["mode"] == "dry run"
    assert payload["failures"] == []
    names = {case["name"] for case in payload["correctness"]}
    assert names == {case.name for case in correctness_cases(small=True)}
    variants = {name.rsplit("/", 1)[0] for name in names}
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
