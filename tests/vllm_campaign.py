"""A short swarm campaign against a vllm release, run in a process of its own.

    python tests/vllm_campaign.py vllm==0.8.5 STEPS [SEMANTICS|-] [LAYER,...|-] [NAME=VALUE,...|-]
        [one-block-size]

Each vllm release is imported as the package `vllm`, so two releases cannot share a process:
the tests run this script once per release. It runs the block pool's and the manager's swarm
campaigns (seed 1, STEPS steps each, valid calls only, the release's domain) exactly as
`pagedkv verify --against` does, and prints one JSON line: per layer the steps, runs, distinct
states, outcome counts and the failure, if any (its first line and signature). SEMANTICS (a
`--semantics` name, or NAME~SWITCH: that semantics with one switch flipped) replaces the
release's own, to show that the campaign tells them apart; LAYER,... (pool, manager,
hybrid) runs only those layers; NAME=VALUE,... are `--vllm-setting`s (the report's notes name
the engine settings in force); `one-block-size` keeps the hybrid layer from drawing groups of
several block sizes even where the release's factory offers them. A release with a hybrid
coordinator (0.33.0) also runs the hybrid layer. Exit status: 0 no divergence, 1 a
divergence, 2 a setup error, 3 the package index is unreachable and nothing is cached (the test
skips, saying so).
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
from dataclasses import replace

from pagedkv.harness.comparison import quiet_refusal_warnings
from pagedkv.harness.divergence import signature_of
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.swarm import manager_layer, pool_layer, run_campaign
from pagedkv.harness.verify import SEMANTICS
from pagedkv.harness.vllm.against import prepare

UNREACHABLE = 3
SEED = 1


def _unreachable(error: BaseException) -> bool:
    """Whether the chain of causes ends in a network error (no route to the index)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, urllib.error.URLError | ConnectionError | TimeoutError):
            return True
        cause = cause.__cause__
    return False


def run(
    against: str,
    steps: int,
    semantics_name: str | None,
    only: str | None = None,
    settings: tuple[str, ...] = (),
    one_block_size: bool = False,
) -> tuple[int, dict[str, object]]:
    try:
        target = prepare(against, settings)
    except SetupError as error:
        status = UNREACHABLE if _unreachable(error) else 2
        return status, {"setup_error": f"{error} (cause: {error.__cause__!r})"}
    for name in target.adapter.loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    semantics = target.adapter.semantics
    if semantics_name is not None:
        name, _, flipped = semantics_name.partition("~")
        semantics = SEMANTICS[name]
        if flipped:
            semantics = replace(semantics, **{flipped: not getattr(semantics, flipped)})
    domain = target.domain
    layers = [
        pool_layer(target.pool_factory, semantics=semantics, misuse=False, domain=domain),
        manager_layer(target.manager_factory, semantics=semantics, misuse=False, domain=domain),
    ]
    if domain.max_groups > 1:  # the release has a hybrid coordinator
        layers.append(
            manager_layer(
                target.manager_factory,
                semantics=semantics,
                misuse=False,
                domain=domain,
                attention="hybrid",
                mixed_block_sizes=False if one_block_size else None,
            )
        )
    if only is not None:
        layers = [layer for layer in layers if layer.name in only.split(",")]
    report: dict[str, object] = {
        "version": target.version,
        "semantics": semantics.name,
        "notes": list(target.notes),
    }
    status = 0
    for layer in layers:
        with quiet_refusal_warnings():
            result = run_campaign(layer, seed=SEED, max_steps=steps)
        failure = None
        if result.failure is not None:
            error = result.failure.error
            failure = {
                "error": f"{type(error).__name__}: {error}".splitlines()[0],
                "text": str(error),
                "signature": list(signature_of(error)),
                "run": result.failure.run.seed,
            }
            status = 1
        coverage = result.coverage
        report[layer.name] = {
            "steps": coverage.steps,
            "runs": coverage.runs,
            "states": len(coverage.states),
            "outcomes": sorted(f"{op}: {kind}" for op, kind in coverage.outcomes),
            "counts": dict(coverage.counts),
            "failure": failure,
        }
    return status, report


if __name__ == "__main__":
    semantics_arg = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    only_arg = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    settings_arg = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 and sys.argv[5] != "-" else ()
    one_size = len(sys.argv) > 6 and sys.argv[6] == "one-block-size"
    status, report = run(
        sys.argv[1], int(sys.argv[2]), semantics_arg, only_arg, settings_arg, one_size
    )
    print(json.dumps(report))
    sys.exit(status)
