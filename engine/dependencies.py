"""The engine's optional dependencies, checked before anything imports them."""

from __future__ import annotations

import importlib.util

from pagedkv.extras import MissingExtraError, missing_extra_message


class MissingDependencyError(MissingExtraError):
    """An optional dependency of the engine is not installed."""


def require(*modules: str, purpose: str = "pagedkv run", extra: str = "engine") -> None:
    """Check that every module in `modules` can be imported (without importing it).

    Raises:
        MissingDependencyError: names the missing ones and the extra that installs them.
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(missing_extra_message(purpose, missing, extra))
