"""A derandomized conformance campaign against a vllm release, run in a process of its own.

    python tests/vllm_campaign.py vllm==0.8.5 EXAMPLES [SEMANTICS]

Each vllm release is imported as the package `vllm`, so two releases cannot share a process:
the tests run this script once per release. It prints one JSON line: per campaign (block pool,
manager with full attention, manager with a sliding window) the steps, runs, distinct states,
outcome counts and the failure, if any. SEMANTICS (a name of `SEMANTICS_BY_NAME`, or
NAME~SWITCH: that semantics with one switch flipped) replaces the release's own, to show that
the campaign tells them apart. Exit status: 0 no divergence,
1 a divergence, 2 a setup error, 3 the package index is unreachable and nothing is cached
(the test skips, saying so).
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
from dataclasses import replace

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from pagedkv.harness.lockstep import CampaignStats
from pagedkv.harness.manager_machine import make_manager_machine
from pagedkv.harness.pool_machine import make_pool_machine
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.vllm_against import prepare
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME

UNREACHABLE = 3


def _unreachable(error: BaseException) -> bool:
    """Whether the chain of causes ends in a network error (no route to the index)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, urllib.error.URLError | ConnectionError | TimeoutError):
            return True
        cause = cause.__cause__
    return False


def run(against: str, examples: int, semantics_name: str | None) -> tuple[int, dict[str, object]]:
    try:
        target = prepare(against)
    except SetupError as error:
        status = UNREACHABLE if _unreachable(error) else 2
        return status, {"setup_error": f"{error} (cause: {error.__cause__!r})"}
    for name in ("pagedkv", *target.adapter.loggers):  # a warning per refused reset
        logging.getLogger(name).setLevel(logging.ERROR)
    semantics = target.adapter.semantics
    if semantics_name is not None:
        name, _, flipped = semantics_name.partition("~")
        semantics = SEMANTICS_BY_NAME[name]
        if flipped:
            semantics = replace(semantics, **{flipped: not getattr(semantics, flipped)})
    campaigns: list[tuple[str, type[RuleBasedStateMachine], CampaignStats]] = []
    stats = CampaignStats()
    domain = target.adapter.domain
    pool_machine = make_pool_machine(
        target.pool_factory, semantics=semantics, misuse=False, stats=stats, domain=domain
    )
    campaigns.append(("pool", pool_machine, stats))
    for sliding in (False, True):
        stats = CampaignStats()
        machine = make_manager_machine(
            target.manager_factory,
            sliding_window=sliding,
            semantics=semantics,
            misuse=False,
            stats=stats,
            domain=domain,
        )
        campaigns.append(("sliding" if sliding else "full", machine, stats))
    report: dict[str, object] = {"version": target.version, "semantics": semantics.name}
    status = 0
    for name, machine, stats in campaigns:
        failure = None
        try:
            run_state_machine_as_test(
                machine,
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=50,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    # A control run (another semantics) only has to fail: no shrinking.
                    phases=(Phase.generate,) if semantics_name else (Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck),
                ),
            )
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            status = 1
        report[name] = {
            "steps": stats.steps,
            "runs": stats.examples,
            "states": len(stats.state_keys),
            "outcomes": sorted(f"{op}: {kind}" for op, kind in stats.outcomes),
            "failure": failure,
        }
    return status, report


if __name__ == "__main__":
    status, report = run(sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or [None])[0])
    print(json.dumps(report))
    sys.exit(status)
