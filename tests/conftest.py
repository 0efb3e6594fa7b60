"""Hypothesis profiles and the full tier.

Tests marked `full` run only with `--full` (`./dev test --full`): the whole planted-bug table,
the longer campaigns. The default run (`./dev test`, CI) has every kind of check at gate size.

Hypothesis profiles: `./dev test` (and so CI) loads `ci`; set HYPOTHESIS_PROFILE to choose.

- ci: derandomized (the same examples every run: no flaky CI), no database, no explain phase.
- dev: random, for local runs.
- nightly: long random runs (5,000 examples of up to 100 steps per state machine).
- mutation: derandomized, few examples, no shrinking: fast enough to run once per mutant.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    database=None,
    print_blob=True,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    **_COMMON,
)
settings.register_profile("dev", max_examples=100, **_COMMON)
settings.register_profile(
    "nightly", max_examples=5_000, stateful_step_count=100, database=None, **_COMMON
)
settings.register_profile(
    "mutation",
    max_examples=30,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    **_COMMON,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", help="also run the tests marked full (the full tier)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="the full tier: ./dev test --full")
    for item in items:
        # The marker, not `item.keywords`: a parameter id "full" (full attention) is a keyword too.
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


@pytest.fixture
def no_local_constants(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hypothesis draws about one primitive value in twenty from the constants of the local
    modules loaded so far (`hypothesis.internal.conjecture.providers`, hypothesis 6.170.17,
    pinned in constraints.txt). Which modules a pytest-xdist worker has loaded depends on the
    tests it ran before (vLLM's fetched modules are local files too), so a derandomized test
    ran other examples in the full run than alone, and a bounded catch could be missed. Under
    this fixture the test draws from hypothesis's global constants only: the same examples
    wherever it runs, as the `ci` profile promises."""
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    providers.CONSTANTS_CACHE.cache.clear()  # permitted constants, cached from the old pool
    monkeypatch.setattr(providers, "_get_local_constants", Constants)
    yield
    providers.CONSTANTS_CACHE.cache.clear()
