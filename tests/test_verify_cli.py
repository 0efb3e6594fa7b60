"""`pagedkv verify`: the default campaign passes, and broken pools fail with a shrunk sequence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main

TESTS_DIR = Path(__file__).parent


def _steps(report: str) -> int:
    match = re.search(r"steps\s+([\d,]+) in", report)
    assert match, report
    return int(match.group(1).replace(",", ""))


@pytest.mark.slow
def test_default_run_checks_both_layers_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--quiet"]) == 0
    report = capsys.readouterr().out
    campaigns = report.split("pagedkv verify — ")[1:]
    assert [c.splitlines()[0].split(":")[0] for c in campaigns] == [
        "block pool",
        "KV cache manager, full attention",
        "KV cache manager, sliding window",
    ]
    assert all("OK: no divergence" in campaign for campaign in campaigns)
    assert _steps(campaigns[0]) >= 20_000
    assert all(_steps(campaign) >= 10_000 for campaign in campaigns[1:])
    assert re.search(r"distinct states seen\s+[1-9]", report)
    assert re.search(r"invariant checks run\s+[1-9]", report)


@pytest.mark.parametrize(
    ("factory", "attention"),
    [
        ("forward_free", "full"),
        ("no_last_block_rule", "full"),
        ("window_off_by_one", "sliding"),
    ],
)
def test_broken_manager_fails_with_shrunk_sequence(
    factory: str, attention: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "verify",
            "--quiet",
            "--layer",
            "manager",
            "--attention",
            attention,
            "--manager-impl",
            f"broken_managers:{factory}",
            "--steps",
            "100000",
        ]
    )
    report = capsys.readouterr().out
    assert status == 1
    sequence = report.split("Shrunk failing sequence:", 1)[1]
    assert "state.setup(" in sequence
    steps = re.findall(r"^state\.(?!spec_and_impl_agree|setup|teardown)(\w+)\(", sequence, re.M)
    assert 1 <= len(steps) <= 15, steps


def test_vllm_conformance_run_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--quiet", "--semantics", "vllm-0.8.5", "--steps", "2000"]) == 0
    report = capsys.readouterr().out
    assert "vllm-0.8.5 (valid calls only)" in report


@pytest.mark.parametrize(
    ("factory", "rules", "evidence"),
    [
        ("free_to_head", {"free_blocks", "free_everything", "finish"}, ("free_order: spec",)),
        (
            "touch_keeps_queued",
            {"touch", "hit_sequence", "admit"},
            ("free_order: spec", "the one under test"),
        ),
        (
            "eviction_keeps_hash",
            {"get_new_blocks", "admit"},
            ("block_hash: spec", "the one under test"),
        ),
    ],
)
def test_broken_pool_fails_with_shrunk_sequence(
    factory: str, rules: set[str], evidence: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """The campaign is random, so the exact sequence varies; what it must show does not."""
    status = main(["verify", "--quiet", "--impl", f"broken_pools:{factory}", "--steps", "200000"])
    report = capsys.readouterr().out
    assert status == 1
    assert "DIVERGENCE" in report
    sequence = report.split("Shrunk failing sequence:", 1)[1]
    assert "state.setup(" in sequence
    steps = re.findall(r"^state\.(?!spec_and_impl_agree|setup|teardown)(\w+)\(", sequence, re.M)
    assert 1 <= len(steps) <= 12, steps  # shrunk: a handful of steps, not the whole random run
    assert set(steps) & rules, steps  # a step that can expose this bug is in it
    assert any(text in sequence for text in evidence)  # it names what diverged


def test_console_script_reports_divergence_with_nonzero_exit() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent)])}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "verify",
            "--impl",
            "broken_pools:free_to_head",
            "--steps",
            "50000",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "Shrunk failing sequence" in completed.stdout
    assert "free_order: spec" in completed.stdout  # the diff names the diverging observable
    assert "steps" in completed.stderr  # the progress bar


def test_unloadable_impl_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--impl", "no_such_module:factory"]) == 2
    assert main(["verify", "--impl", "not-a-target"]) == 2
    assert main(["verify", "--manager-impl", "no_such_module:factory"]) == 2
    assert "cannot load the implementation" in capsys.readouterr().err
