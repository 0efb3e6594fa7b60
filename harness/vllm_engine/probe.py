"""A probe inside vLLM's engine core: what its scheduler did and the CPU time it took.

vLLM loads every `vllm.general_plugins` entry point in each of its processes, the engine core
included, before it builds the scheduler. pagedkv registers this module there as
`pagedkv-probe`; `register()` does nothing unless `PAGEDKV_VLLM_PROBE` names a file. Then it wraps
two methods of vLLM's `Scheduler` class (nothing else of vLLM changes, and the wrappers only read):

- `schedule`: its thread CPU time; after it, the prefill chunks it scheduled that leave a prompt
  unfinished (a request whose computed tokens are still short of its prompt: a chunked
  prefill), and the class of the scheduler's KV cache manager (vLLM's own, or the plugin's);
- `update_from_output`: its thread CPU time.

The summary (steps, CPU seconds of each, chunked prefill steps and requests, the manager's
class) is written as JSON to that file at most every `WRITE_EVERY_S` seconds, whenever the last
unfinished request finishes (so it is whole before `LLM.generate` returns), when the engine
core starts its teardown (`EngineCore.shutdown`, which stops the workers first) and when the
scheduler shuts down (last). The engine core is one thread on the scheduler's path, so thread
CPU time is the scheduler's own, whatever the model's threads do beside it.

Standard library only at import time: vLLM is imported by `register()`, in vLLM's processes.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

PROBE_ENV = "PAGEDKV_VLLM_PROBE"
"""The file the probe writes its summary to; unset, the probe does nothing."""

WRITE_EVERY_S = 1.0


@dataclass
class ProbeSummary:
    """What the probe saw in one engine core (one JSON object)."""

    pid: int = 0
    manager_class: str = ""
    steps: int = 0
    schedule_cpu_s: float = 0.0
    update_cpu_s: float = 0.0
    chunked_prefill_steps: int = 0
    chunked_prefill_chunks: int = 0
    chunked_requests: list[str] = field(default_factory=list)
    teardown_started: bool = False
    """The engine core began its teardown (`EngineCore.shutdown`): no scheduler call follows,
    and the plugin's summary is final."""
    shut_down: bool = False
    """The scheduler was shut down, after vLLM stopped its workers."""


class _Probe:
    def __init__(self, path: str) -> None:
        self.path = path
        self.summary = ProbeSummary(pid=os.getpid())
        self.chunked: set[str] = set()
        self.written = 0.0

    def after_schedule(self, scheduler: Any, output: Any, cpu_s: float) -> None:
        summary = self.summary
        summary.steps += 1
        summary.schedule_cpu_s += cpu_s
        if not summary.manager_class:
            manager = type(scheduler.kv_cache_manager)
            summary.manager_class = f"{manager.__module__}.{manager.__qualname__}"
        chunks = 0
        for request_id in output.num_scheduled_tokens:
            request = scheduler.requests.get(request_id)
            # The scheduler has advanced num_computed_tokens by what it scheduled.
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                chunks += 1
                self.chunked.add(request_id)
        summary.chunked_prefill_chunks += chunks
        summary.chunked_prefill_steps += chunks > 0

    def after_update(self, scheduler: Any, cpu_s: float) -> None:
        self.summary.update_cpu_s += cpu_s
        # Written when the last request finishes, so the file is whole before generate returns.
        idle = not scheduler.has_unfinished_requests()
        if idle or time.monotonic() - self.written > WRITE_EVERY_S:
            self.write()

    def write(self) -> None:
        self.summary.chunked_requests = sorted(self.chunked)
        self.written = time.monotonic()
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(asdict(self.summary), out, indent=1)
        os.replace(temporary, self.path)


def register() -> None:
    """vLLM's plugin hook: install the probe if `PAGEDKV_VLLM_PROBE` is set, else nothing."""
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "__pagedkv_probe__", False):
        return  # registered twice in one process
    probe = _Probe(path)
    schedule: Callable[..., Any] = Scheduler.schedule
    update: Callable[..., Any] = Scheduler.update_from_output
    shutdown: Callable[..., Any] = Scheduler.shutdown

    @functools.wraps(schedule)
    def timed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        output = schedule(self, *args, **kwargs)
        probe.after_schedule(self, output, time.thread_time() - start)
        return output

    @functools.wraps(update)
    def timed_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        result = update(self, *args, **kwargs)
        probe.after_update(self, time.thread_time() - start)
        return result

    @functools.wraps(shutdown)
    def final_shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe.summary.shut_down = True
        probe.write()
        return shutdown(self, *args, **kwargs)

    timed_schedule.__pagedkv_probe__ = True  # type: ignore[attr-defined]
    Scheduler.schedule = timed_schedule
    Scheduler.update_from_output = timed_update
    Scheduler.shutdown = final_shutdown

    from vllm.v1.engine.core import EngineCore

    teardown: Callable[..., Any] = EngineCore.shutdown

    @functools.wraps(teardown)
    def noted_teardown(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe.summary.teardown_started = True
        probe.write()
        return teardown(self, *args, **kwargs)

    EngineCore.shutdown = noted_teardown
