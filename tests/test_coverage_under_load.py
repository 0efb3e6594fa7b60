"""A campaign's coverage depends on its seed and step count, never on CPU speed or load.

The issue's done-when: the CI campaign under `nice -n 19` beside a CPU hog gives the same
coverage. Here a shorter campaign of each layer runs in this process and again in a child at
`nice -n 19` (with another hash seed) while a busy loop competes for the CPU; the coverage
digests (counts, histogram, distinct states, steps, runs) must be equal. proofs/README.md
records the same comparison for the full CI campaign.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign

SEED = 2_025
MANAGER_STEPS = 2_000
POOL_STEPS = 1_500

CHILD = f"""
import logging
logging.disable(logging.WARNING)
from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign
manager = run_campaign(manager_layer(pagedkv_manager), seed={SEED}, max_steps={MANAGER_STEPS})
pool = run_campaign(pool_layer(pagedkv_pool), seed={SEED}, max_steps={POOL_STEPS})
print(manager.coverage.digest(), pool.coverage.digest())
"""

HOG = "while True: pass"


@pytest.mark.skipif(shutil.which("nice") is None, reason="needs nice(1)")
def test_coverage_is_the_same_at_lowest_priority_beside_a_cpu_hog() -> None:
    logging.disable(logging.WARNING)
    try:
        manager = run_campaign(manager_layer(pagedkv_manager), seed=SEED, max_steps=MANAGER_STEPS)
        pool = run_campaign(pool_layer(pagedkv_pool), seed=SEED, max_steps=POOL_STEPS)
    finally:
        logging.disable(logging.NOTSET)
    assert manager.failure is None and pool.failure is None
    expected = f"{manager.coverage.digest()} {pool.coverage.digest()}"

    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        env = {**os.environ, "PYTHONHASHSEED": "12345"}
        child = subprocess.run(
            ["nice", "-n", "19", sys.executable, "-c", CHILD],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            check=True,
        )
    finally:
        hog.kill()
        hog.wait()
    assert child.stdout.strip() == expected
