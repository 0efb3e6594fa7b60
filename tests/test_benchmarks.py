"""The benchmarks run (small sizes), and on the serving trace spec and impl decide the same.

Nothing here is timed: these check that the benchmark scripts work and that their replays,
which must end in the recorded state or take identical decisions, do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_manager
import bench_pool
from serving_trace import TraceConfig, make_trace


def test_the_trace_is_deterministic() -> None:
    first, second = (
        make_trace(TraceConfig(num_conversations=5)),
        make_trace(TraceConfig(num_conversations=5)),
    )
    assert [c.system_prompt for c in first] == [c.system_prompt for c in second]
    assert [len(c.turns) for c in first] == [len(c.turns) for c in second]


def test_manager_benchmark_spec_and_impl_take_the_same_decisions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_manager.main(["--conversations", "12", "--num-blocks", "160"]) == 0
    report = capsys.readouterr().out
    assert "same decisions" in report
    assert "preemptions" in report


def test_pool_benchmark_replays_end_in_the_recorded_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_pool.main(["--ops", "2000", "--runs", "1"]) == 0
    assert "1M / 1k per-call ratio" in capsys.readouterr().out


def test_the_vllm_benchmark_runs_against_pagedkv_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """Its machinery offline: pagedkv as the baseline, a small trace, no compiled build."""
    import bench_vllm

    argv = ["--quick", "--baseline", "pagedkv", "--conversations", "8", "--compiled-site", "-"]
    assert bench_vllm.main(argv) == 0
    report = capsys.readouterr().out
    assert "checked call by call: same blocks, same hits" in report
    assert "compiled build: not measured" in report
    assert "decode inside a block" in report
