"""The run's figure: pool usage, prefix-cache hit rate and requests over engine steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedkv.engine.metrics import StepRecord


def plot_steps(steps: Sequence[StepRecord], path: str | Path, *, title: str) -> None:
    """Write a three-panel PNG (or any format matplotlib knows by the suffix) of `steps`.

    Top: pool usage, with a tick at each step that preempted. Middle: the cumulative prefix-cache
    hit rate, and evictions on a second axis. Bottom: running and waiting requests.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = [record.step for record in steps]
    figure = Figure(figsize=(9, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    usage, hits, requests = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title, fontsize=10)

    usage.plot(x, [100 * r.pool_usage for r in steps], color="tab:blue", lw=1.2)
    usage.set_ylabel("pool usage (%)")
    usage.set_ylim(0, 105)
    preempting = [
        record.step
        for previous, record in zip([None, *steps], steps, strict=False)
        if record.num_preemptions > (previous.num_preemptions if previous else 0)
    ]
    if preempting:
        usage.plot(
            preempting,
            [102] * len(preempting),
            "v",
            color="tab:red",
            ms=4,
            label=f"step with a preemption ({len(preempting)})",
        )
        usage.legend(loc="lower center", fontsize=8)

    hits.plot(x, [100 * r.prefix_hit_rate for r in steps], color="tab:green", lw=1.2)
    hits.set_ylabel("prefix-cache hit rate (%)", color="tab:green")
    hits.set_ylim(0, 100)
    evictions = hits.twinx()
    evictions.plot(x, [r.num_evictions for r in steps], color="tab:gray", lw=1, ls="--")
    evictions.set_ylabel("blocks evicted (cumulative)", color="tab:gray")

    requests.plot(x, [r.num_running for r in steps], color="tab:purple", lw=1.2, label="running")
    requests.plot(x, [r.num_waiting for r in steps], color="tab:orange", lw=1, label="waiting")
    requests.set_ylabel("requests")
    requests.set_xlabel("engine step")
    requests.legend(loc="upper right", fontsize=8)
    for axes in (usage, hits, requests):
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
