"""Runs a differential state machine for a budget of steps or seconds, and reports.

Hypothesis runs the machine in batches of examples with fresh random seeds until the budget is
spent; a divergence stops the campaign after hypothesis has shrunk it to a minimal sequence of
steps, which the report prints.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from hypothesis import HealthCheck, Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from pagedkv.harness.lockstep import CampaignStats


@dataclass(frozen=True)
class CampaignResult:
    """What a campaign did, and the shrunk failing sequence if it found a divergence."""

    stats: CampaignStats
    seconds: float
    failure: str | None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def steps_per_second(self) -> float:
        return self.stats.steps / self.seconds if self.seconds > 0 else 0.0


def campaign_settings(max_examples: int, steps_per_example: int) -> settings:
    """Random (not derandomized) generation and shrinking; no database, no explain phase."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps_per_example,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        report_multiple_bugs=False,
    )


def run_campaign(
    machine: type[RuleBasedStateMachine],
    stats: CampaignStats,
    *,
    max_steps: int,
    max_seconds: float | None,
    steps_per_example: int = 50,
) -> CampaignResult:
    """Run `machine` until `stats.steps >= max_steps` or `max_seconds` pass, or it fails.

    The budget is checked between batches of examples, each about a fifth of a second long, so
    the campaign may overrun it by one batch.
    """
    start = time.monotonic()
    batch = 10
    while stats.steps < max_steps:
        elapsed = time.monotonic() - start
        if max_seconds is not None and elapsed >= max_seconds:
            break
        report: list[object] = []
        batch_start, steps_before = time.monotonic(), stats.steps
        try:
            with with_reporter(report.append):
                run_state_machine_as_test(
                    machine, settings=campaign_settings(batch, steps_per_example)
                )
        except Exception as error:
            notes = getattr(error, "__notes__", [])
            lines = [*map(str, report), *notes, f"{type(error).__name__}: {error}"]
            return CampaignResult(stats, time.monotonic() - start, "\n".join(lines))
        # Next batch: ~0.2 s (short enough to respect the budget, long enough to amortize the
        # set-up), and no more examples than the remaining steps need.
        seconds_per_example = (time.monotonic() - batch_start) / batch
        steps_per_example_seen = max(stats.steps - steps_before, 1) / batch
        remaining_examples = (max_steps - stats.steps) / steps_per_example_seen + 1
        batch = int(max(1, min(500, 0.2 / max(seconds_per_example, 1e-6), remaining_examples)))
    return CampaignResult(stats, time.monotonic() - start, None)


class ProgressBar:
    """A one-line progress bar on a terminal; a line every 10% when output is not a terminal."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total = max(total_steps, 1)
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self.last_decile = -1

    def __call__(self, stats: CampaignStats) -> None:
        self.show(stats.steps, len(stats.state_keys))

    def show(self, steps: int, states: int, *, final: bool = False) -> None:
        """Draw the bar for `steps` steps and `states` distinct states; `final` ends the line."""
        fraction = min(steps / self.total, 1.0)
        rate = steps / max(time.monotonic() - self.start, 1e-9)
        total = f"{self.total:,}" if self.total < 10**15 else "?"
        text = f"{steps:>9,}/{total} steps  {rate:>7,.0f} steps/s  {states:,} states"
        if self.tty:
            filled = int(fraction * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {text}")
            self.stream.flush()
        elif int(fraction * 10) > self.last_decile or final:
            self.last_decile = int(fraction * 10)
            self.stream.write(f"[{fraction:4.0%}] {text}\n")
            self.stream.flush()
        if final and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def close(self, stats: CampaignStats) -> None:
        self.show(stats.steps, len(stats.state_keys), final=True)
