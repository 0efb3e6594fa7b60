"""The compiled build refuses ill-typed arguments exactly as the pure build does, or says why not.

mypyc checks the declared type of every argument of a compiled function when it is called, and
the type of every value it reads into a typed variable, raising a bare TypeError before the body
runs. Until public arguments are validated as `object` (issue 12), a compiled build therefore
answers some ill-typed calls differently from the pure one: `DIFFERS_TODAY` lists each such case
with the reason, as a strict xfail, so the list shrinks as validation lands. Runs on the compiled
build (`./dev test` does), comparing with the pure sources run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from refusal_cases import CASES, Outcome, outcome

import pagedkv

ROOT = Path(__file__).resolve().parent.parent

_ACCEPTED = (
    "the pure build accepts it and goes on (issue 12 will refuse it); mypyc raises a bare "
    "TypeError at the call"
)
_TYPED_BEFORE = (
    "the pure build raises its typed error; mypyc's bare TypeError at the call comes before "
    "the check"
)
_OTHER_BARE = "both raise a bare error, of different classes (AttributeError vs TypeError)"
_NOT_ATOMIC = (
    "the pure build touches the hits before it fails (issue 12); mypyc refuses first, atomically"
)

DIFFERS_TODAY: dict[str, str] = {
    "allocate_slots: num_tokens float": _ACCEPTED,
    "allocate_slots: num_tokens NaN": _ACCEPTED,
    "allocate_slots with hits: num_tokens float": _NOT_ATOMIC,
    "allocate_slots with hits: num_tokens NaN": _ACCEPTED,
    "allocate_slots: num_computed_tokens float": _ACCEPTED,
    "get_num_common_prefix_blocks: float": _ACCEPTED,
    "get_num_common_prefix_blocks: None": _ACCEPTED,
    "KVCacheManager: max_model_len float": _ACCEPTED,
    "KVCacheManager: max_model_len NaN": _ACCEPTED,
    "KVCacheManager: caching_hash_algo None": _TYPED_BEFORE,
    "KVCacheManager: debug_invariants float": _ACCEPTED,
    "BlockPool: num_gpu_blocks float": _TYPED_BEFORE,
    "BlockPool: num_gpu_blocks NaN": _TYPED_BEFORE,
    "BlockPool: num_gpu_blocks None": _TYPED_BEFORE,
    "BlockPool: num_gpu_blocks str": _TYPED_BEFORE,
    "touch: block ids instead of blocks": _OTHER_BARE,
    "free_blocks: a None among blocks": _OTHER_BARE,
    "get_cached_block: None": _ACCEPTED,
    "cache_full_blocks: num_full_blocks NaN": _TYPED_BEFORE,
    "free queue: remove None": _OTHER_BARE,
    "free queue: append an int": _OTHER_BARE,
    "KVCacheBlock: block_id float": _ACCEPTED,
    "KVCacheBlock: block_id None": _ACCEPTED,
    "hash_block_tokens: parent hash float": _ACCEPTED,
    "get_hash_fn: None": _TYPED_BEFORE,
}

on_compiled_build = pytest.mark.skipif(
    not pagedkv.COMPILED,
    reason="compares the compiled build with the pure one (./dev test runs it on the compiled one)",
)


def test_every_documented_difference_is_a_case() -> None:
    assert set(DIFFERS_TODAY) <= set(CASES)


@pytest.fixture(scope="module")
def pure_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """The cases run on the pure sources: a link tree of this checkout, in a subprocess."""
    package = tmp_path_factory.mktemp("pure") / "pagedkv"
    package.mkdir()
    for source in (ROOT / "impl").iterdir():
        (package / source.name).symlink_to(source)
    for folder in ("spec", "harness", "gpu"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    script = ROOT / "tests" / "refusal_cases.py"
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    )
    report = json.loads(run.stdout)
    assert report["compiled"] is False, "the link tree must run the pure sources"
    outcomes: dict[str, Outcome] = report["outcomes"]
    return outcomes


@on_compiled_build
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=DIFFERS_TODAY[name]))
        if name in DIFFERS_TODAY
        else name
        for name in CASES
    ],
)
def test_the_compiled_build_answers_as_the_pure_one(
    case: str, pure_outcomes: dict[str, Outcome]
) -> None:
    assert outcome(case) == pure_outcomes[case]
