"""The modules the compiled build compiles with mypyc, and which of them this process runs compiled.

`setup.py` compiles `MYPYC_MODULES` when a wheel is built with a C compiler at hand; editable
(development) installs never do. `compiled_modules()` asks the import system how each module was
loaded, so a build that fell back to pure Python can never claim to be compiled.
"""

from __future__ import annotations

import importlib
from importlib.machinery import ExtensionFileLoader

MYPYC_MODULES: tuple[str, ...] = (
    "pagedkv.block",
    "pagedkv.block_counts",
    "pagedkv.block_hash",
    "pagedkv.block_pool",
    "pagedkv.free_queue",
    "pagedkv.kv_cache_coordinator",
    "pagedkv.manager",
    "pagedkv.single_type.base",
    "pagedkv.single_type.chunked_local",
    "pagedkv.single_type.full_attention",
    "pagedkv.single_type.mamba",
    "pagedkv.single_type.sliding_window",
)
"""The hot modules, by measurement (`./dev bench vllm`). `pagedkv.vocab.request` stays
interpreted: a compiled `Request` cannot be copied (`copy.copy` raises TypeError) and refuses
ill-typed field assignments with a bare TypeError, which the harness and hostile-input tests rely
on."""


def compiled_modules() -> tuple[str, ...]:
    """The modules of `MYPYC_MODULES` loaded from extension modules (mypyc output), in order."""
    compiled = []
    for name in MYPYC_MODULES:
        spec = importlib.import_module(name).__spec__
        if spec is not None and isinstance(spec.loader, ExtensionFileLoader):
            compiled.append(name)
    return tuple(compiled)
