"""What a run did, step by step and in total."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """The state after one engine step.

    Attributes:
        step: the step's index.
        num_running: requests running after the step.
        num_waiting: requests waiting (arrived, not running) after the step.
        num_prefill_tokens: prompt (or recomputed) tokens computed in the step.
        num_decode_tokens: decode tokens computed in the step (one per decoding request).
        num_partial_prefills: prompt chunks that stopped short of the request's last token
            (chunked prefill: the budget ran out).
        pool_usage: fraction of the pool's blocks in use after the step (null block counted).
        prefix_hit_rate: hit tokens over tokens looked up at admission, so far.
        num_preemptions: preemptions so far.
        num_evictions: cached blocks evicted so far.
        num_finished: requests finished so far.
    """

    step: int
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_partial_prefills: int
    pool_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_evictions: int
    num_finished: int


@dataclass
class SchedulerStats:
    """Counts since the scheduler was made.

    Attributes:
        num_preemptions: requests preempted (each time counts).
        num_admissions: requests admitted, readmissions after preemption included.
        num_lookup_tokens: tokens of the requests admitted (what the prefix cache was asked).
        num_hit_tokens: of those, tokens served from the prefix cache.
        num_finished: requests finished.
    """

    num_preemptions: int = 0
    num_admissions: int = 0
    num_lookup_tokens: int = 0
    num_hit_tokens: int = 0
    num_finished: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over tokens looked up at admission; 0.0 before any admission."""
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0


@dataclass
class RunSummary(SchedulerStats):
    """Totals of a run: the scheduler's counts (it counts into this object) and the run's.

    Attributes:
        num_requests: requests completed.
        num_prompt_tokens: their prompt tokens.
        num_generated_tokens: tokens they generated.
        num_computed_tokens: tokens the model computed (prompts not hit in the cache,
            recomputes after preemption, decodes).
        num_steps: engine steps.
        seconds: wall-clock time of the run (the model and the engine, no dense check).
        cpu_seconds: the process's CPU time over the same span (all threads).
        stage_seconds: time in the executor, by stage ("kv_write", "attention").
        num_evictions: cached blocks evicted (`EvictionCounter`).
        peak_pool_usage: the highest `pool_usage` after any step.
        ttft_median, ttft_p90: time to first token over the requests, in seconds (wall clock,
            from arrival, queueing included); None without a request.
        tpot_median, tpot_p90: time per output token after the first, in seconds, over the
            requests that generated two tokens or more; None without one.
    """

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    num_evictions: int = 0
    peak_pool_usage: float = 0.0
    ttft_median: float | None = None
    ttft_p90: float | None = None
    tpot_median: float | None = None
    tpot_p90: float | None = None

    @property
    def generated_tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def computed_tokens_per_second(self) -> float:
        return self.num_computed_tokens / self.seconds if self.seconds else 0.0

    @property
    def attention_share(self) -> float:
        """Share of the run's time spent writing K/V and in attention."""
        executor = self.stage_seconds.get("kv_write", 0.0) + self.stage_seconds.get(
            "attention", 0.0
        )
        return executor / self.seconds if self.seconds else 0.0


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The `fraction` quantile of `values`, interpolated between the two nearest ranks (numpy's
    default, so the median of an even count is the mean of the middle two); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
