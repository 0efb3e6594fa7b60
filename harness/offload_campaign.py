"""`pagedkv verify --layer offload`: the CPU offload tier's own campaign.

Runs of `harness.offload_runs.run_pair` (a scheduler's calls on the spec's tier and on the tier
under test, answers compared at every call, whole states after every step), each with a
configuration drawn from its own seed: LRU or ARC, 1-8 chunks, a store threshold of 1 or (a
third of the runs) 2-3 with an offer tracker of 1-8 keys or the default. The run seeds and
lengths follow from the campaign seed, so `--seed S --steps N` replays a campaign exactly. The
tier under test is pagedkv's (`pagedkv.offload.OffloadTier`), or with `--against
vllm==0.33.0` vLLM 0.33.0's own `CPUOffloadingManager` and policies
(`harness.vllm.offload_0_33`). Coverage targets say what a campaign must have exercised.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.harness.offload_runs import RunReport, TierUnderTest, run_pair
from pagedkv.vocab.offload import OffloadTierConfig, PolicyName

DEFAULT_OFFLOAD_STEPS = 100_000
ENFORCED_FROM = 100_000
RUN_STEPS = (20, 2_000)

OFFLOAD_TARGETS: tuple[tuple[str, int, str], ...] = (
    ("prepare_store evicting", 4_000, "a store makes room by the policy's order"),
    ("prepare_store refused room", 2_500, "no evictable chunk: None, and nothing changes"),
    ("prepare_store with every key held already", 3_000, "held keys are not stored again"),
    ("complete_store failed", 2_000, "a failed store removes its chunks, metadata only"),
    ("prepare_load", 3_400, "a load pins ready chunks until complete_load"),
    ("lookup answered HIT_PENDING", 250, "a chunk whose store is pending is not loadable"),
    ("on_request_finished", 4_500, "recency: LRU re-ranks tail first, ARC promotes reuse"),
    ("reset_cache", 600, "a reset drops every chunk, pinned or not"),
    ("ARC target adapted (a ghost hit)", 1_100, "ARC's target moves on a B1 or B2 ghost hit"),
)
"""(counter, per 100,000 steps, why): about half the rates of `--seed 2025` against pagedkv's
tier (docs/verification.md); a campaign of fewer steps needs proportionally fewer."""


def draw_config(rng: random.Random) -> OffloadTierConfig:
    """A tier shape: LRU or ARC, 1-8 chunks, in a third of the runs an admission threshold."""
    policy: PolicyName = "arc" if rng.random() < 0.5 else "lru"
    num_chunks = rng.randint(1, 8)
    if rng.random() < 1 / 3:
        tracker = rng.choice((rng.randint(1, 8), 64_000))
        return OffloadTierConfig(num_chunks, policy, rng.randint(2, 3), tracker)
    return OffloadTierConfig(num_chunks, policy)


@dataclass
class OffloadCampaign:
    """A campaign's outcome: its runs, steps and call counts, and the first divergence."""

    seed: int
    runs: int = 0
    steps: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    failure: RunReport | None = None

    def required(self, per_100k: int) -> int:
        return math.ceil(per_100k * self.steps / 100_000)

    @property
    def enforced(self) -> bool:
        """Targets are enforced from 100,000 steps on, as the other campaigns' are."""
        return self.steps >= ENFORCED_FROM

    def unmet(self) -> list[str]:
        """The enforced targets not met (a campaign that diverged is judged by its
        divergence)."""
        if not self.enforced:
            return []
        return [
            name
            for name, per_100k, _ in OFFLOAD_TARGETS
            if self.counts[name] < self.required(per_100k)
        ]


def run_offload_campaign(
    seed: int, steps: int, tier: Callable[[OffloadTierConfig], TierUnderTest]
) -> OffloadCampaign:
    """Runs drawn from `seed` until `steps` steps ran or one diverged."""
    rng = random.Random(seed)
    campaign = OffloadCampaign(seed)
    while campaign.steps < steps and campaign.failure is None:
        run_seed = rng.getrandbits(63)
        run_rng = random.Random(run_seed)
        config = draw_config(run_rng)
        length = min(_log_uniform(run_rng, *RUN_STEPS), steps - campaign.steps)
        report = run_pair(run_seed, config, tier, length)
        campaign.runs += 1
        campaign.steps += report.num_steps
        campaign.counts.update(report.calls)
        if report.divergence is not None:
            campaign.failure = report
    return campaign


def format_offload_report(campaign: OffloadCampaign, name: str) -> list[str]:
    """The campaign as `pagedkv verify` prints it."""
    lines = [
        f"pagedkv verify — CPU offload tier: spec vs {name}",
        f"  campaign seed          {campaign.seed} (--seed {campaign.seed} reproduces it)",
        f"  steps                  {campaign.steps:,} in {campaign.runs:,} runs",
        f"  calls compared         {sum(_calls(campaign.counts).values()):,}",
    ]
    if campaign.failure is not None:
        failure = campaign.failure
        lines += [
            "  result                 DIVERGENCE",
            "",
            f"Failing run {failure.seed}: {failure.config}",
            f"  {failure.divergence}",
        ]
        return lines
    unmet = campaign.unmet()
    if not campaign.enforced:
        verdict = f"OK: no divergence (targets need >= {ENFORCED_FROM:,} steps)"
    elif unmet:
        verdict = f"OK: no divergence, but {len(unmet)} coverage targets UNMET"
    else:
        verdict = "OK: no divergence; every coverage target met"
    lines.append(f"  result                 {verdict}")
    for counter, per_100k, why in OFFLOAD_TARGETS:
        count, need = campaign.counts[counter], campaign.required(per_100k)
        state = "(not enforced)" if not campaign.enforced else "met" if count >= need else "UNMET"
        lines.append(f"  {counter:<45} {count:>9,}  >= {need:>7,}  {state}  ({why})")
    return lines


def _calls(counts: Counter[str]) -> Counter[str]:
    """The calls made (the counters that name a call), without the outcome counters."""
    names = {
        "lookup",
        "prepare_load",
        "complete_load",
        "touch",
        "prepare_store",
        "complete_store",
        "on_request_finished",
        "reset_cache",
        "take_events",
    }
    return Counter({name: count for name, count in counts.items() if name in names})


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))
