"""Optional dependencies: a missing one is reported with the extra that installs it.

pagedkv imports nothing outside the standard library at import time; the features that need a
third-party package import it when first used, through `import_extra`, so that a user without it
reads `KVCacheMetrics needs prometheus_client, which is not installed: pip install
'pagedkv[metrics]'` instead of a bare `ModuleNotFoundError`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pagedkv.vocab.errors import PagedKVError


class MissingExtraError(PagedKVError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def missing_extra_message(purpose: str, modules: list[str], extra: str) -> str:
    """`"<purpose> needs <modules>, which is/are not installed: pip install 'pagedkv[<extra>]'"`."""
    verb = "is" if len(modules) == 1 else "are"
    return (
        f"{purpose} needs {', '.join(modules)}, which {verb} not installed: "
        f"pip install 'pagedkv[{extra}]'"
    )


def import_extra(module: str, *, extra: str, purpose: str) -> ModuleType:
    """Import `module`, which the `extra` extra installs, for `purpose` (a user-facing name).

    Raises:
        MissingExtraError: `module` (or the package it belongs to) is not installed. A module
            missing *inside* an installed package is not masked: that ModuleNotFoundError
            propagates as it is.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.partition(".")[0]
        if error.name is None or error.name.partition(".")[0] != top:
            raise
        raise MissingExtraError(missing_extra_message(purpose, [top], extra)) from None
