"""Short seeded swarm campaigns, fast enough to face every mutant of the mutation run.

The CI campaigns (`test_swarm_ci_campaign.py`) are slow and left out of the mutation run; these
run the same engine for a few thousand steps per layer, with misuse and hostile calls, KV cache
events and both hash functions, on fixed seeds: a mutant that changes what any call returns,
refuses or leaves behind, in any layer, diverges from the spec here. The hybrid layer (2-4 KV
cache groups over one pool) is the only check of `KVCacheManager`'s several-group path against
the spec besides its scenario tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool
from pagedkv.harness.swarm import Layer, manager_layer, pool_layer, run_campaign

SEED = 2_025
STEPS = 1_000


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def _layer(name: str) -> Layer:
    if name == "pool":
        return pool_layer(pagedkv_pool)
    return manager_layer(pagedkv_manager, attention=name)


@pytest.mark.parametrize("name", ["pool", "full", "sliding", "hybrid"])
def test_a_short_campaign_finds_no_divergence(name: str) -> None:
    result = run_campaign(_layer(name), seed=SEED, max_steps=STEPS)
    assert result.failure is None, result.failure
    assert result.coverage.steps >= STEPS
