"""The CPU offload tier's campaign (`pagedkv verify --layer offload`): reproducible, it meets its
targets on pagedkv's tier, and it catches a tier that breaks the contract."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from pagedkv.cli import main
from pagedkv.harness.offload_campaign import (
    OFFLOAD_TARGETS,
    format_offload_report,
    run_offload_campaign,
)
from pagedkv.offload import OffloadTier
from pagedkv.vocab.offload import OffloadKey, OffloadRequest


class FailedStoresKept(OffloadTier):
    """A tier that keeps the chunks of a failed store, as if it had succeeded (they hold no
    KV: a later load would read garbage)."""

    def complete_store(
        self, keys: Collection[OffloadKey], request: OffloadRequest, success: bool = True
    ) -> None:
        super().complete_store(keys, request, True)


def test_the_same_seed_runs_the_same_campaign() -> None:
    first = run_offload_campaign(7, 3_000, OffloadTier)
    second = run_offload_campaign(7, 3_000, OffloadTier)
    assert first.failure is None and first.steps == 3_000
    assert (first.runs, first.counts) == (second.runs, second.counts)
    assert run_offload_campaign(8, 3_000, OffloadTier).counts != first.counts


def test_the_ci_campaign_meets_every_target() -> None:
    campaign = run_offload_campaign(2025, 100_000, OffloadTier)
    assert campaign.failure is None
    assert campaign.enforced and campaign.unmet() == []
    report = "\n".join(format_offload_report(campaign, "pagedkv.offload"))
    assert "every coverage target met" in report
    for counter, _, _ in OFFLOAD_TARGETS:
        assert counter in report


def test_a_tier_that_keeps_failed_stores_is_caught() -> None:
    campaign = run_offload_campaign(1, 20_000, FailedStoresKept)
    assert campaign.failure is not None
    assert campaign.failure.divergence is not None
    report = "\n".join(format_offload_report(campaign, "FailedStoresKept"))
    assert "DIVERGENCE" in report and f"Failing run {campaign.failure.seed}" in report


def test_the_cli_runs_the_offload_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--layer", "offload", "--steps", "4000", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "pagedkv verify — CPU offload tier: spec vs pagedkv.offload" in out
    assert "steps                  4,000 in" in out
    assert "Replay it: pagedkv verify --layer offload --seed 3 --steps 4000" in out


def test_the_cli_refuses_a_release_without_an_offload_adapter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--layer", "offload", "--against", "vllm==0.8.5"]) == 2
    assert "checked against vllm==0.33.0 only" in capsys.readouterr().err
