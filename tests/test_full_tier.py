"""The full tier (`./dev test --full`, `pytest --full`; nightly): each kind of check the gate runs
at gate size, here at full size.

- the whole planted-bug table: every checker on every variant, at least two catching each (the
  gate runs only the CI campaign on each), and no step-bounded checker misses a variant the
  committed table says it catches;
- `pagedkv verify --seed 2025` at its default size on every layer (the gate runs fewer steps);
- the exhaustive search's `nightly` scope (the gate searches the `ci` scope).

docs/development.md gives the tier's time on the 2-core development machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from proofs.exhaustive.explore import MANAGER_SCOPES, POOL_SCOPES, explore_manager, explore_pool
from proofs.exhaustive.manager_world import ManagerSearchConfig
from proofs.exhaustive.pool_world import PoolSearchConfig
from proofs.planted.bugs import MIN_CATCHES, TABLE_PATH, catches, problems, read_table, run_all
from proofs.planted.catalog import VARIANTS
from proofs.planted.checkers import CHECKERS

pytestmark = pytest.mark.full

TIME_BOUNDED = frozenset({"crosshair"})
"""Checkers bounded by seconds, not steps: on a loaded machine they may find less than the
committed table records, so only the step-bounded checkers must keep every recorded catch."""

FULL_TABLE_TIMEOUT = 3_600.0
"""Seconds a variant's worker may take with every checker (the slowest took about 600 s on a
loaded 2-core machine)."""


def test_the_whole_planted_table_keeps_every_recorded_catch() -> None:
    results = run_all(
        [variant.name for variant in VARIANTS],
        jobs=os.cpu_count() or 2,
        timeout=FULL_TABLE_TIMEOUT,
    )
    recorded = read_table(TABLE_PATH)
    assert problems(results) == []
    lost = [
        f"{name}: {checker} caught it in the committed table, now {verdict.status}"
        for name, verdicts in results.items()
        for checker, verdict, was in zip(CHECKERS, verdicts, recorded[name], strict=True)
        if checker not in TIME_BOUNDED and was == "caught" and verdict.status != "caught"
    ]
    assert lost == []
    assert all(catches(verdicts) >= MIN_CATCHES for verdicts in results.values())


def test_verify_at_its_default_size_meets_every_target_on_every_layer() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "verify", "--seed", "2025", "--jobs", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.count("OK: no divergence; every coverage target met") == 3, done.stdout


@pytest.mark.parametrize("config", POOL_SCOPES["nightly"], ids=lambda config: config.name)
def test_nightly_pool_configuration_has_no_divergence(config: PoolSearchConfig) -> None:
    result = explore_pool(pagedkv_pool, config)
    assert result.ok, result.failure.render() if result.failure else result.summary()
    assert result.states > 1


@pytest.mark.parametrize("config", MANAGER_SCOPES["nightly"], ids=lambda config: config.name)
def test_nightly_manager_configuration_has_no_divergence(config: ManagerSearchConfig) -> None:
    result = explore_manager(pagedkv_manager, config)
    assert result.ok, result.failure.render() if result.failure else result.summary()
    assert result.states > 1
