"""Time spent in named stages of the forward pass: CUDA events on a GPU, the wall clock on CPU.

On a GPU the host only enqueues work, so a host clock around a launch measures nothing: each
stage is bracketed by a pair of CUDA events, read once per step (`collect`, after the step's
own synchronization). On CPU the work runs in the call, and `time.perf_counter` is used.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch


class StageTimer:
    """Accumulates seconds per stage name over the whole run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        """Time the body as `stage`."""
        if self.device.type == "cuda":
            event: Any = torch.cuda.Event  # untyped in torch's stubs
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((stage, start, end))
            return
        began = time.perf_counter()
        yield
        self.seconds[stage] += time.perf_counter() - began

    def collect(self) -> None:
        """Add the GPU stages recorded so far (waits for their end events)."""
        for stage, start, end in self._pending:
            end.synchronize()
            self.seconds[stage] += start.elapsed_time(end) / 1e3
        self._pending.clear()
