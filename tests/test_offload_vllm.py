"""pagedkv's CPU offload tier spec against vLLM 0.33.0's own `CPUOffloadingManager`.

`tests/vllm_offload_tier.py` fetches the release's `vllm/v1/kv_offload/` manager and LRU/ARC
policies (a few wheel members, cached in ~/.cache/pagedkv), runs in a process of its own (the
release is imported as `vllm`), and drives them beside the spec with the seeded runs of
`pagedkv.harness.offload_runs`: every answer, and the whole state after every step. Only an
unreachable package index with nothing cached skips, with the reason in the test report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedkv.harness.offload_runs import run_pair
from pagedkv.offload import OffloadKey, OffloadTier, OffloadTierConfig
from pagedkv.offload.lru import LRUPolicy

SCRIPT = Path(__file__).parent / "vllm_offload_tier.py"
UNREACHABLE = 3


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


def test_vllm_0_33s_tier_answers_and_holds_what_the_spec_does() -> None:
    completed = run_script("4", "300")
    if completed.returncode == UNREACHABLE:
        pytest.skip("vllm==0.33.0: the package index is unreachable and nothing is cached")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report: dict[str, Any] = json.loads(completed.stdout.splitlines()[-1])
    runs = report["runs"]
    assert len(runs) == 4 * 5
    assert [run["divergence"] for run in runs] == [None] * len(runs)
    assert all(run["steps"] == 300 for run in runs)
    total = {
        name: sum(run["calls"].get(name, 0) for run in runs)
        for name in ("prepare_store evicting", "prepare_store refused room", "prepare_load")
    }
    assert min(total.values()) >= 50, total  # not vacuous: evictions, refusals and loads ran
    for policy in ("lru", "arc"):
        evicting = [r for r in runs if r["policy"] == policy and r["store_threshold"] == 1]
        assert sum(r["calls"].get("prepare_store evicting", 0) for r in evicting) >= 20


class ReversedVictimsLRU(LRUPolicy):
    """A planted bug: the right victims, evicted (announced, their chunks freed) in reverse."""

    def evict(self, n: int, protected: Any) -> list[OffloadKey] | None:
        chosen = super().evict(n, protected)
        return None if chosen is None else chosen[::-1]


class ReversedVictimsTier(OffloadTier):
    def __init__(self, config: OffloadTierConfig) -> None:
        super().__init__(config)
        self.policy = ReversedVictimsLRU(config.num_chunks, self.refs)


def test_the_runs_catch_an_eviction_order_bug() -> None:
    reports = [
        run_pair(seed, OffloadTierConfig(4, "lru"), ReversedVictimsTier, 300) for seed in range(4)
    ]
    diverged = [report.divergence for report in reports if report.divergence]
    assert diverged and all("prepare_store" in d for d in diverged)


def test_an_unreachable_index_with_nothing_cached_is_the_only_skip(tmp_path: Path) -> None:
    env = dict(os.environ, PAGEDKV_CACHE=str(tmp_path), PAGEDKV_PYPI_INDEX="http://127.0.0.1:9")
    completed = run_script("1", "10", env=env)
    assert completed.returncode == UNREACHABLE, completed.stdout + completed.stderr
    assert "unreachable" in json.loads(completed.stdout.splitlines()[-1])
