"""The engine's optional dependencies, checked before anything imports them."""

from __future__ import annotations

import importlib.util

from pagedkv.vocab.errors import PagedKVError

INSTALL_HINT = "pip install 'pagedkv[engine]'"


class MissingDependencyError(PagedKVError, ImportError):
    """An optional dependency of the engine is not installed."""


def require(*modules: str, purpose: str = "pagedkv run") -> None:
    """Check that every module in `modules` can be imported (without importing it).

    Raises:
        MissingDependencyError: names the missing ones and the install command.
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"{purpose} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: {INSTALL_HINT}"
        )
