"""`pagedkv verify --against vllm==VERSION`: a vllm release's own code as the implementation.

`prepare("vllm==0.8.5")` fetches the release's KV cache modules (`vllm_wheel`), puts them on
`sys.path` as the `vllm` package, and returns pool and manager factories over its classes with
the semantics the spec must take to match it. `vllm==latest` (or `newest`, or a bare `vllm`)
asks the package index for the newest release. Releases without an adapter of their own are
refused; the newest release is tried with the adapter of the newest release tested here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.protocol import ManagerFactory, PoolFactory
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.vllm import v0_8_5, v0_32, v0_33
from pagedkv.harness.vllm.engine_0_33 import Loaded
from pagedkv.harness.vllm.wheel import (
    FetchError,
    newest_release,
    project_listing,
    release_key,
    source_tree,
)
from pagedkv.vocab.semantics import VLLM_0_8_5, VLLM_0_32, VLLM_0_33, Semantics

_AGAINST = re.compile(r"^vllm(==(?P<version>[\w.+-]+))?$")
LATEST_ALIASES = ("latest", "newest")


@dataclass(frozen=True)
class VllmAdapter:
    """What it takes to run one vllm release under the harness.

    Attributes:
        version: the release this adapter was written and tested for.
        semantics: the spec's semantics that the release conforms to.
        modules: the wheel members to fetch.
        stand_ins: our replacements for the rest of vllm, path -> source.
        load: builds the factories once the fetched tree is importable, from the semantics,
            the tree's folder and the user's `--vllm-setting`s.
        loggers: vllm's loggers to quiet (a refused reset logs a warning each time).
        domain: where the campaigns draw from: outside it the release differs from every
            semantics the spec has, for reasons docs/semantics.md lists (`load` may narrow it
            to the engine settings in force).
        hash_seeding: how both sides' hash chains are made to start alike, for the user.
    """

    version: str
    semantics: Semantics
    modules: tuple[str, ...]
    stand_ins: Mapping[str, str]
    load: Callable[[Semantics, Path, Sequence[str]], Loaded]
    loggers: tuple[str, ...] = ()
    domain: Domain = FULL_DOMAIN
    hash_seeding: str = ""


ADAPTERS: dict[str, VllmAdapter] = {
    v0_8_5.VERSION: VllmAdapter(
        v0_8_5.VERSION,
        VLLM_0_8_5,
        v0_8_5.MODULES,
        v0_8_5.STAND_INS,
        v0_8_5.load,
        v0_8_5.LOGGERS,
        v0_8_5.DOMAIN,
        v0_8_5.HASH_SEEDING,
    ),
    v0_32.VERSION: VllmAdapter(
        v0_32.VERSION,
        VLLM_0_32,
        v0_32.MODULES,
        v0_32.STAND_INS,
        v0_32.load,
        v0_32.LOGGERS,
        v0_32.DOMAIN,
        v0_32.HASH_SEEDING,
    ),
    v0_33.VERSION: VllmAdapter(
        v0_33.VERSION,
        VLLM_0_33,
        v0_33.MODULES,
        v0_33.STAND_INS,
        v0_33.load,
        v0_33.LOGGERS,
        v0_33.DOMAIN,
        v0_33.HASH_SEEDING,
    ),
}
NEWEST_TESTED = max(ADAPTERS, key=release_key)


@dataclass(frozen=True)
class Against:
    """A vllm release ready to be checked: its factories, semantics, the domain its campaigns
    draw from, and what to tell the user."""

    version: str
    adapter: VllmAdapter
    pool_factory: PoolFactory
    manager_factory: ManagerFactory
    domain: Domain
    notes: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"vllm {self.version}"


def parse_against(text: str) -> str:
    """The version in `vllm==VERSION` ("latest" for `vllm`, `vllm==latest`, `vllm==newest`).

    Raises:
        SetupError: not of that form.
    """
    match = _AGAINST.match(text.strip())
    if match is None:
        raise SetupError(f"--against takes vllm==VERSION or vllm==latest, got {text!r}")
    version = match.group("version") or "latest"
    return "latest" if version in LATEST_ALIASES else version


def prepare(text: str, settings: Sequence[str] = ()) -> Against:
    """Fetch the release named by `text`, import it, and build its factories, with the
    engine settings `settings` (`NAME=VALUE`s, `--vllm-setting`) over the release's defaults.

    Raises:
        SetupError: a malformed `text`, a release without an adapter, a failed fetch or import,
            a setting the release's adapter refuses, or vllm already imported from elsewhere in
            this process. The cause is chained.
    """
    version = parse_against(text)
    asked_latest = version == "latest"
    notes: list[str] = []
    listing = None
    if asked_latest:
        try:
            listing = project_listing()
            version = newest_release(listing)
        except FetchError as error:
            raise SetupError(f"cannot find the newest vllm release: {error}") from error
        notes.append(f"vllm==latest is {version} on the package index")
    adapter = ADAPTERS.get(version)
    if adapter is None:
        if not asked_latest:
            known = ", ".join(f"vllm=={v}" for v in sorted(ADAPTERS, key=release_key))
            raise SetupError(f"no adapter for vllm=={version}; adapters exist for {known}")
        adapter = ADAPTERS[NEWEST_TESTED]
        notes.append(
            f"vllm {version} is newer than {NEWEST_TESTED}, the newest release tested here: "
            f"trying {NEWEST_TESTED}'s adapter and semantics"
        )
    try:
        root = source_tree(version, adapter.modules, adapter.stand_ins, listing)
    except FetchError as error:
        raise SetupError(f"cannot fetch vllm=={version}: {error}") from error
    loaded = sys.modules.get("vllm")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(root)):
        raise SetupError(
            f"another vllm is already imported in this process ({loaded.__file__}); "
            "run the check in a fresh process"
        )
    sys.path.insert(0, str(root))
    try:
        built = adapter.load(adapter.semantics, root, tuple(settings))
    except SetupError:
        raise
    except Exception as error:
        raise SetupError(f"cannot import vllm {version}'s KV cache modules: {error!r}") from error
    notes.append(f"vllm {version}'s KV cache modules from {root}")
    notes.extend(built.notes)
    notes.append(f"hash chains: {adapter.hash_seeding} (PYTHONHASHSEED not needed)")
    if built.domain.describe():
        notes.append(f"checked on {built.domain.describe()} (docs/semantics.md says why)")
    return Against(
        version,
        adapter,
        built.pool_factory,
        built.manager_factory,
        built.domain,
        tuple(notes),
    )
