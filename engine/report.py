"""The text report of `pagedkv run`: one aligned line per measure."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.dense_check import DenseCheck
from pagedkv.engine.metrics import RunSummary


@dataclass(frozen=True)
class RunDescription:
    """What ran: the model, where, with which executor, on which workload; `threads`: torch's
    CPU threads (None: not on CPU); the KV cache groups of a hybrid model (None for one group)."""

    model: str
    device: str
    executor: str
    workload: str
    threads: int | None = None
    kv_cache_groups: str | None = None
    retention: str | None = None


def retention_text(interval: int | None) -> str:
    """Which full blocks a sliding-window group caches, in words (`--prefix-cache-retention-
    interval`)."""
    if interval is None:
        return "dense: every full block of a sliding-window group is cached"
    if interval == 0:
        return (
            "0: a window group caches only each prompt's replay-boundary run (vLLM 0.33's default)"
        )
    return (
        f"{interval}: a window group caches its replay-boundary runs and one per {interval} tokens"
    )


def _line(name: str, value: str) -> str:
    return f"  {name:<22} {value}"


def format_report(
    description: RunDescription,
    config: EngineConfig,
    summary: RunSummary,
    *,
    num_preempted_requests: int,
    check: DenseCheck | None,
) -> str:
    """The report, one measure per line (wall-clock times, as the run measured them)."""
    stages = summary.stage_seconds
    pool_tokens = config.num_usable_blocks * config.block_size
    lines = [
        f"pagedkv run — {description.workload}",
        _line("model", description.model),
        _line("executor", _executor_text(description)),
        _line(
            "pool",
            f"{config.num_blocks:,} blocks x {config.block_size} tokens ({pool_tokens:,} tokens "
            f"usable), {config.max_num_batched_tokens:,} tokens/step, "
            f"{config.max_num_seqs} sequences",
        ),
    ]
    if description.kv_cache_groups is not None:
        lines.append(
            _line(
                "KV cache groups",
                f"{description.kv_cache_groups}; every group's blocks from the one pool",
            )
        )
    if description.retention is not None:
        lines.append(_line("prefix retention", description.retention))
    lines += [
        _line("steps", f"{summary.num_steps:,}"),
        _line(
            "tokens",
            f"{summary.num_prompt_tokens:,} prompt, {summary.num_generated_tokens:,} generated, "
            f"{summary.num_computed_tokens:,} computed by the model",
        ),
        _line(
            "throughput",
            f"{summary.generated_tokens_per_second:,.1f} generated tokens/s, "
            f"{summary.computed_tokens_per_second:,.1f} computed tokens/s "
            f"({summary.seconds:.2f} s wall clock, {summary.cpu_seconds:.2f} s CPU)",
        ),
        _line("latency", _latency_text(summary)),
        _line(
            "attention share",
            f"{100 * summary.attention_share:.1f}% of the time (K/V writes "
            f"{stages.get('kv_write', 0.0):.2f} s, attention {stages.get('attention', 0.0):.2f} s)",
        ),
        _line(
            "prefix-cache hits",
            f"{100 * summary.prefix_hit_rate:.1f}% ({summary.num_hit_tokens:,} of "
            f"{summary.num_lookup_tokens:,} tokens looked up at admission)",
        ),
        _line(
            "preemptions",
            f"{summary.num_preemptions:,} ({num_preempted_requests} "
            f"{'request' if num_preempted_requests == 1 else 'requests'} recomputed)",
        ),
        _line("evictions", f"{summary.num_evictions:,} cached blocks reused for new content"),
        _line("peak pool usage", f"{100 * summary.peak_pool_usage:.1f}%"),
    ]
    if check is not None:
        lines.append(_line("dense check", _check_line(check)))
    return "\n".join(lines)


def _executor_text(description: RunDescription) -> str:
    text = f"{description.executor} on {description.device}"
    if description.threads is not None:
        text += f", {description.threads} torch thread{'' if description.threads == 1 else 's'}"
    return text


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def _latency_text(summary: RunSummary) -> str:
    """TTFT and TPOT, median and p90 over the requests (wall clock)."""
    return (
        f"TTFT median {_seconds(summary.ttft_median)}, p90 {_seconds(summary.ttft_p90)}; "
        f"TPOT median {_seconds(summary.tpot_median)}, p90 {_seconds(summary.tpot_p90)} "
        f"(wall clock; TTFT from arrival, queueing included)"
    )


def _check_line(check: DenseCheck) -> str:
    total = len(check.comparisons)
    bound = (
        f"max |logit diff| {check.max_logit_diff:.1e} <= {check.atol:.1e} (transformers' own "
        f"generate vs forward: {check.noise_floor:.1e})"
    )
    if check.passed:
        return (
            f"OK: {total} of {total} requests equal transformers' generate token for token "
            f"({check.num_tokens:,} tokens), {bound}"
        )
    failures = check.failures
    first = failures[0]
    where = first.first_mismatch
    detail = (
        f"first at {first.request_id!r} output token {where}: engine "
        f"{list(first.engine_tokens[where : where + 3])}, dense "
        f"{list(first.dense_tokens[where : where + 3])}"
        if where is not None
        else f"{first.request_id!r}: logits differ by {first.max_logit_diff:.1e}"
    )
    return f"FAILED: {len(failures)} of {total} requests differ; {detail}; {bound}"
