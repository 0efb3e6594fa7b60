"""What the plugin tells its users: a log line per event that matters, a JSON summary
(`PAGEDKV_VLLM_REPORT`), and Prometheus counters when `prometheus_client` is installed.

The counters live in the engine-core process. vLLM's API server serves them only in its
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, which prometheus_client then writes to);
otherwise read the JSON summary. Names follow pagedkv's exporter (`pagedkv_` prefix) with
vLLM's two labels, `model_name` and `engine`:

    pagedkv_vllm_shadow_calls_total{call}             calls mirrored to pagedkv
    pagedkv_vllm_shadow_divergences_total{call,kind}  answers that differed, pagedkv failures
    pagedkv_vllm_shadow_active                        1 while calls are mirrored, else 0
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections import Counter
from typing import Any

logger = logging.getLogger("pagedkv.vllm_plugin")

WRITE_EVERY_S = 2.0  # the summary file is rewritten at most this often between events


class Report:
    """The running summary of one engine core's plugin."""

    def __init__(self, path: str | None, labels: dict[str, str], **static: Any) -> None:
        self.path = path
        self.labels = labels
        self.summary: dict[str, Any] = {
            **static,
            "pid": os.getpid(),
            "active": True,
            "off_reason": None,
            "calls": {},
            "mirrored_calls": 0,
            "snapshots": 0,
            "unmirrored": {},
            "divergences": [],
            "failures": [],
        }
        self._calls: Counter[str] = Counter()
        self._unmirrored: Counter[str] = Counter()
        self._written = 0.0
        self._prometheus = _Prometheus.create(labels)
        if self._prometheus is not None:
            self._prometheus.active(True)

    def count(self, call: str) -> None:
        self._calls[call] += 1
        self.summary["mirrored_calls"] += 1
        if call == "snapshot":
            self.summary["snapshots"] += 1
        if self._prometheus is not None:
            self._prometheus.call(call)
        if self.path is not None and time.monotonic() - self._written > WRITE_EVERY_S:
            self.write()

    def unmirrored(self, name: str) -> None:
        self._unmirrored[name] += 1

    def stop(self, reason: str) -> None:
        self.summary["active"] = False
        self.summary["off_reason"] = reason
        if self._prometheus is not None:
            self._prometheus.active(False)
        self.write()

    def divergence(self, call: str, kind: str, message: str, trace: str | None) -> None:
        entry = {"call": call, "kind": kind, "message": message, "trace": trace}
        target = "failures" if kind == "failure" else "divergences"
        self.summary[target].append(entry)
        if self._prometheus is not None:
            self._prometheus.divergence(call, kind)
        replay = (
            f"replay it: pagedkv verify --replay-trace {trace}"
            if trace
            else "no replay: the trace outgrew PAGEDKV_VLLM_TRACE_LIMIT (set PAGEDKV_VLLM_TRACE)"
        )
        what = "pagedkv failed" if kind == "failure" else "pagedkv diverged from vLLM"
        logger.error("pagedkv shadow: %s at %s; %s", what, message, replay)
        self.write()

    def write(self) -> None:
        self.summary["calls"] = dict(self._calls)
        self.summary["unmirrored"] = dict(self._unmirrored)
        self._written = time.monotonic()
        if self.path is None:
            return
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(self.summary, out, indent=1)
        os.replace(temporary, self.path)


class _Prometheus:
    """The three series, in prometheus_client's default registry."""

    def __init__(self, prom: Any, names: list[str]) -> None:
        self._labels: dict[str, str] = {}
        self._calls = prom.Counter(
            "pagedkv_vllm_shadow_calls",
            "vLLM KV cache manager calls mirrored to pagedkv.",
            [*names, "call"],
        )
        self._divergences = prom.Counter(
            "pagedkv_vllm_shadow_divergences",
            "pagedkv answers that differed from vLLM's, and pagedkv failures.",
            [*names, "call", "kind"],
        )
        self._active = prom.Gauge(
            "pagedkv_vllm_shadow_active",
            "1 while vLLM's calls are mirrored to pagedkv, else 0.",
            names,
            multiprocess_mode="liveall",
        )

    @classmethod
    def create(cls, labels: dict[str, str]) -> _Prometheus | None:
        """The series for `labels`, registered once per process (a process may build several
        schedulers: each gets its own label values); None without prometheus_client."""
        global _SERIES  # noqa: PLW0603
        try:
            import prometheus_client
        except ImportError:
            return None
        if _SERIES is None:
            _SERIES = cls(prometheus_client, list(labels))
        return _SERIES.labelled(labels)

    def labelled(self, labels: dict[str, str]) -> _Prometheus:
        series = copy.copy(self)
        series._labels = labels
        return series

    def call(self, call: str) -> None:
        self._calls.labels(**self._labels, call=call).inc()

    def divergence(self, call: str, kind: str) -> None:
        self._divergences.labels(**self._labels, call=call, kind=kind).inc()

    def active(self, on: bool) -> None:
        self._active.labels(**self._labels).set(1 if on else 0)


_SERIES: _Prometheus | None = None
