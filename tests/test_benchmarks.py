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


def test_the_vllm_engine_benchmark_checks_and_reports_its_rounds() -> None:
    """Its arithmetic and checks on made-up runs (the runs themselves need .venv-vllm)."""
    import bench_vllm_engine as bench

    def result(mode: str, outputs: list[list[int]], manager: str) -> dict[str, object]:
        probe = {"schedule_cpu_s": 0.2, "update_cpu_s": 0.1, "steps": 100, "manager_class": manager}
        return {"model": "llama", "mode": mode, "outputs": outputs, "probe": probe, "plugin": {}}

    off = result("off", [[1, 2], [3]], "vllm.v1.core.kv_cache_manager.KVCacheManager")
    bench.check_round(off, result("replace", [[1, 2], [3]], "pagedkv.vllm_plugin.facade.X"))
    with pytest.raises(AssertionError, match="request 1 differs at output token 0"):
        bench.check_round(off, result("replace", [[1, 2], [4]], "pagedkv.vllm_plugin.facade.X"))
    with pytest.raises(AssertionError, match="did not take the scheduler's manager"):
        bench.check_round(off, result("shadow", [[1, 2], [3]], "vllm.KVCacheManager"))
    assert bench.scheduler_us_per_step(off) == pytest.approx(3000.0)
    comparison = bench.Comparison("llama", "replace")
    for first, tokens in (("off", 900.0), ("replace", 1100.0), ("off", 1000.0)):
        comparison.rounds.append(bench.Round(first, 1000.0, tokens, 30.0, 27.0, 100, 100))
    assert comparison.median("tokens_ratio") == pytest.approx(1.0)
    assert comparison.median("sched_ratio") == pytest.approx(0.9)
    assert "llama    replace       1000  1.000" in bench.report([comparison], 3, 200)
