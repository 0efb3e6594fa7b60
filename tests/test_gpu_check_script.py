"""`python -m pagedkv.gpu.check --dry-run` runs end to end on CPU and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.gpu.check import DECODE_BATCHES, DECODE_CONTEXTS, correctness_cases, main
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

    cells = {(row["batch"], row["context"]): row for row in payload["decode"]}
    assert set(cells) == {(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS}
    # GPU-NOTES: a Llama-3-8B layer at batch 64 x 4096 moves about 1.075 GB per call.
    assert abs(cells[(64, 4096)]["bytes"] / 1.075e9 - 1) < 0.002
    assert cells[(64, 4096)]["num_splits"] == 1, "512 CTAs already fill an H200"
    assert cells[(1, 32768)]["num_splits"] > 1, "8 CTAs would not"
    assert all(row["kernel_us"] is None for row in payload["decode"])
    assert payload["write"]["bytes"] == 2 * 2 * 65536 * 8 * 128 * 2 + 8 * 65536

    assert "correctness: 108/108 passed" in text
    assert "   64    4096" in text and "n/a" in text


def test_without_a_device_the_device_run_reports_the_error_and_fails(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 1
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["failures"] == ["run aborted"]
    assert "Error" in payload["error"]
    assert (tmp_path / "check.txt").read_text().count("ABORTED") == 1
