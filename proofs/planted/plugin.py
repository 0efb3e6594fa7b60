"""A pytest plugin that plants the variant named by `PAGEDKV_PLANTED` for the whole session.

    PAGEDKV_PLANTED=free_to_head python -m pytest -p proofs.planted.plugin tests/test_block_pool.py

Loaded before any test module is collected, so every test that reaches impl (through a factory,
a class or a function it imports) runs the broken code; the spec is untouched. Without the
variable the plugin does nothing. Used by `proofs.planted.checkers.check_scenarios`.
"""

from __future__ import annotations

import os

import pytest

from proofs.planted.catalog import PLANT_ENV, VARIANTS_BY_NAME, plant_for_good


def pytest_configure(config: pytest.Config) -> None:
    """Plant the named variant, or refuse an unknown name."""
    name = os.environ.get(PLANT_ENV)
    if not name:
        return
    variant = VARIANTS_BY_NAME.get(name)
    if variant is None:
        raise pytest.UsageError(f"{PLANT_ENV}={name!r} names no variant of proofs.planted.catalog")
    plant_for_good(variant)
