"""Putting pagedkv into vLLM's scheduler: one wrapper around `Scheduler.__init__` (which
`AsyncScheduler` inherits) that builds vLLM's manager as usual, then puts the shadow or the
façade in its place. Installed once per process (a marker on the wrapper), in every process
that loads vLLM's general plugins; only the engine core builds a scheduler.
"""

from __future__ import annotations

import atexit
import functools
import logging
from typing import Any

import pagedkv
from pagedkv.manager import KVCacheManager

from .domain import (
    OutOfDomainError,
    config_refusals,
    manager_refusals,
    pagedkv_config,
)
from .recorder import Recorder
from .replay import Replayer, build_manager
from .report import Report
from .settings import Mode, Settings, UnsupportedReleaseError, release_semantics
from .shadow import ShadowKVCacheManager, ShadowStoppedError
from .trace import TRACE_FORMAT, Event, TraceSink, config_to_json

logger = logging.getLogger("vllm.pagedkv")  # under vLLM's logger: its handler and format

_MARK = "_pagedkv_vllm_plugin"


def install(settings: Settings) -> bool:
    """Wrap vLLM's `Scheduler.__init__` for `settings.mode`; False when shadow mode stays
    off (an unknown vLLM release, logged).

    Raises:
        UnsupportedReleaseError: replace mode (or strict shadow) on a release it does not know.
    """
    import vllm

    version = str(vllm.__version__)
    try:
        semantics_name, _ = release_semantics(version)
    except UnsupportedReleaseError as error:
        if settings.mode is Mode.REPLACE or settings.strict:
            raise
        logger.warning("pagedkv shadow off: %s", error)
        return False
    from vllm.v1.core.sched import scheduler as scheduler_module

    scheduler_class = scheduler_module.Scheduler
    if getattr(scheduler_class.__init__, _MARK, False):
        return True
    original = scheduler_class.__init__

    @functools.wraps(original)
    def init_then_substitute(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_cache_manager = substitute(self, settings, version, semantics_name)

    original_shutdown = scheduler_class.shutdown

    @functools.wraps(original_shutdown)
    def shutdown_then_close(self: Any) -> None:
        original_shutdown(self)
        _close(self)

    setattr(init_then_substitute, _MARK, True)
    scheduler_class.__init__ = init_then_substitute
    scheduler_class.shutdown = shutdown_then_close
    _close_at_teardown()
    return True


def _close(scheduler: Any) -> None:
    """Close the shadow or the façade a scheduler holds (its summary and trace, final); a
    second call rewrites the same summary."""
    close = getattr(getattr(scheduler, "kv_cache_manager", None), "close", None)
    if close is not None:
        close()


def _close_at_teardown() -> None:
    """Close as the engine core starts its teardown, before it stops its workers: vLLM tears
    the model executor down first and shuts the scheduler down only after, so a worker that
    will not stop (killed after a grace period, or an error there) must not leave the summary
    unwritten. No scheduler call comes after `EngineCore.shutdown` begins."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # a release without it: the scheduler's shutdown still closes
        return
    original = EngineCore.shutdown
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def close_then_teardown(self: Any, *args: Any, **kwargs: Any) -> Any:
        _close(getattr(self, "scheduler", None))
        return original(self, *args, **kwargs)

    setattr(close_then_teardown, _MARK, True)
    EngineCore.shutdown = close_then_teardown


def substitute(scheduler: Any, settings: Settings, version: str, semantics_name: str) -> Any:
    """The manager the scheduler gets: the shadow or the façade around pagedkv's, or vLLM's
    own when shadow mode stays off.

    Raises:
        OutOfDomainError: replace mode (or strict shadow) with a configuration outside pagedkv's
            domain, every feature named.
    """
    vllm_manager = scheduler.kv_cache_manager
    vllm_config = scheduler.vllm_config
    replace = settings.mode is Mode.REPLACE
    refusals = list(config_refusals(vllm_config, replace=replace))
    refusals += manager_refusals(vllm_manager, replace=replace)
    config = None
    try:
        config = pagedkv_config(vllm_manager.kv_cache_config)
    except OutOfDomainError as error:
        refusals.append(error)
    labels = _labels(vllm_config)
    report = Report(
        settings.report_path,
        labels,
        mode=settings.mode.value,
        side=settings.side if not replace else "impl",
        semantics=semantics_name,
        vllm=version,
        pagedkv=pagedkv.__version__,
    )
    if refusals:
        message = "; ".join(str(error) for error in refusals)
        if replace or settings.strict:
            report.stop(f"refused at start: {message}")
            raise OutOfDomainError(
                ", ".join(error.feature for error in refusals),
                "; ".join(error.detail for error in refusals),
                replace=replace,
            )
        logger.warning("pagedkv shadow off: %s", message)
        report.stop(f"out of domain at start: {message}")
        return vllm_manager
    assert config is not None
    max_in_flight = getattr(vllm_config, "max_in_flight_tokens", None)
    header: Event = {
        "format": TRACE_FORMAT,
        "vllm": version,
        "pagedkv": pagedkv.__version__,
        "mode": settings.mode.value,
        "semantics": semantics_name,
        "config": config_to_json(config),
        "max_model_len": vllm_manager.max_model_len,
        "enable_caching": vllm_manager.enable_caching,
        "max_in_flight_tokens": max_in_flight,
    }
    # Replace mode keeps no trace in memory (nothing compares it); with PAGEDKV_VLLM_TRACE it
    # writes one as shadow mode does.
    keep = settings.trace_limit if not replace or settings.trace_dir else 0
    sink = TraceSink(header, settings.trace_dir, keep)
    recorder = Recorder(vllm_manager.max_model_len)
    if replace:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats

        from .facade import PagedKVFacade

        manager = build_manager(header, "impl")
        assert isinstance(manager, KVCacheManager)
        facade = PagedKVFacade(
            vllm_manager, manager, recorder, sink, KVCacheBlocks, PrefixCacheStats
        )
        report.write()
        atexit.register(facade.close)
        logger.info("pagedkv: vLLM %s's scheduler runs on pagedkv's KV cache manager", version)
        return facade
    header["check_every"] = settings.snapshot_every
    shadow = ShadowKVCacheManager(
        vllm_manager,
        Replayer(build_manager(header, settings.side)),
        recorder,
        sink,
        report,
        strict=settings.strict,
        snapshot_every=settings.snapshot_every,
    )
    report.write()
    atexit.register(shadow.close)
    logger.info(
        "pagedkv: vLLM %s's KV cache manager is shadowed by pagedkv's %s (%s semantics)",
        version,
        settings.side,
        semantics_name,
    )
    return shadow


def _labels(vllm_config: Any) -> dict[str, str]:
    model = vllm_config.model_config
    name = getattr(model, "served_model_name", None) or getattr(model, "model", "")
    if isinstance(name, list | tuple):
        name = name[0] if name else ""
    rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
    return {"model_name": str(name), "engine": str(rank)}


__all__ = ["ShadowStoppedError", "install", "substitute"]
