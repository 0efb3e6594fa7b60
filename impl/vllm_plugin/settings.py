"""What the plugin does, read once from the environment: the mode, the side shadowed, where
traces and the summary go, and the vLLM releases it knows.

    PAGEDKV_VLLM                off (default) | shadow | replace
    PAGEDKV_VLLM_STRICT         1: a shadow divergence or failure raises (CI); default 0
    PAGEDKV_VLLM_SIDE           impl (default) | spec: what shadow mode mirrors the calls to
    PAGEDKV_VLLM_TRACE          a directory: every engine core writes its call trace there
    PAGEDKV_VLLM_REPORT         a file: the JSON summary (calls, divergences), kept current
    PAGEDKV_VLLM_SNAPSHOT_EVERY compare whole states every this many mirrored calls (64)
    PAGEDKV_VLLM_TRACE_LIMIT    calls kept in memory for a replay when no trace directory is
                                set (1,000,000); past it a divergence has no replay
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.vocab.semantics import VLLM_0_32, Semantics

MODE_ENV = "PAGEDKV_VLLM"
STRICT_ENV = "PAGEDKV_VLLM_STRICT"
SIDE_ENV = "PAGEDKV_VLLM_SIDE"
TRACE_ENV = "PAGEDKV_VLLM_TRACE"
REPORT_ENV = "PAGEDKV_VLLM_REPORT"
SNAPSHOT_ENV = "PAGEDKV_VLLM_SNAPSHOT_EVERY"
TRACE_LIMIT_ENV = "PAGEDKV_VLLM_TRACE_LIMIT"

SUPPORTED_RELEASES: Mapping[str, tuple[str, Semantics]] = {"0.32": ("vllm-0.32", VLLM_0_32)}
"""vLLM release (major.minor) -> the pagedkv semantics its KV cache manager follows. Only
releases whose scheduler the plugin was run inside: vLLM 0.33's manager is verified
(`pagedkv verify --against vllm==0.33.0`) but its CPU build does not exist to run it."""


class Mode(enum.Enum):
    OFF = "off"
    SHADOW = "shadow"
    REPLACE = "replace"


class PluginSettingError(ValueError):
    """An environment variable of the plugin holds a value it does not know."""


@dataclass(frozen=True)
class Settings:
    mode: Mode
    strict: bool = False
    side: str = "impl"
    trace_dir: str | None = None
    report_path: str | None = None
    snapshot_every: int = 64
    trace_limit: int = 1_000_000

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """Raises PluginSettingError naming the variable and the values it takes."""
        raw = environ.get(MODE_ENV, "").strip().lower() or "off"
        try:
            mode = Mode(raw)
        except ValueError:
            raise PluginSettingError(
                f"{MODE_ENV}={raw!r}: expected one of off, shadow, replace"
            ) from None
        side = environ.get(SIDE_ENV, "").strip().lower() or "impl"
        if side not in ("impl", "spec"):
            raise PluginSettingError(f"{SIDE_ENV}={side!r}: expected impl or spec")
        return cls(
            mode=mode,
            strict=_flag(environ, STRICT_ENV),
            side=side,
            trace_dir=environ.get(TRACE_ENV) or None,
            report_path=environ.get(REPORT_ENV) or None,
            snapshot_every=_count(environ, SNAPSHOT_ENV, 64),
            trace_limit=_count(environ, TRACE_LIMIT_ENV, 1_000_000),
        )


def _flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise PluginSettingError(f"{name}={value!r}: expected 0 or 1")


def _count(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise PluginSettingError(f"{name}={value!r}: expected a positive integer")
    return int(value)


class UnsupportedReleaseError(RuntimeError):
    """The installed vLLM is a release the plugin was never run inside."""


def release_semantics(version: str) -> tuple[str, Semantics]:
    """The semantics of a vLLM version string ("0.32.0", "0.32.1+cpu", ...).

    Raises:
        UnsupportedReleaseError: naming the version and the releases supported.
    """
    parts = version.split(".")
    key = ".".join(parts[:2])
    try:
        return SUPPORTED_RELEASES[key]
    except KeyError:
        known = ", ".join(f"{release}.x" for release in SUPPORTED_RELEASES)
        raise UnsupportedReleaseError(
            f"pagedkv's vLLM plugin does not know vLLM {version}; it supports {known}. "
            f"Unset {MODE_ENV} to run vLLM without it."
        ) from None
