"""z3 lemmas (proofs/z3_lemmas.py): every lemma proved, every wrong variant refuted in Python."""

from __future__ import annotations

import pytest
import z3

from proofs import z3_lemmas
from proofs.z3_lemmas import (
    LEMMAS,
    WRONG_VARIANTS,
    Arithmetic,
    Claim,
    Lemma,
    check,
    floordiv_model_matches_python,
    formulas_match_code,
)


@pytest.mark.parametrize("lemma", LEMMAS, ids=lambda lemma: lemma.name)
def test_lemma_is_proved(lemma: Lemma) -> None:
    verdict = check(lemma)
    assert verdict.status == "proved", verdict.describe()
    assert lemma.statement, "every lemma states what it proves"


@pytest.mark.parametrize("variant", WRONG_VARIANTS, ids=lambda variant: variant.name)
def test_wrong_variant_is_refuted_by_a_counterexample_python_confirms(variant: Lemma) -> None:
    verdict = check(variant)
    assert verdict.status == "refuted", verdict.describe()
    assert verdict.counterexample
    assert verdict.replayed is False, verdict.describe()


def test_known_counterexamples_replay() -> None:
    """The replays are real Python: a = 1, b = 2 breaks `a // b` as a ceiling, and z3's `/`
    is not Python's `//` for a negative divisor."""
    by_name = {variant.name: variant for variant in WRONG_VARIANTS}
    cdiv_replay = by_name["wrong_cdiv_as_floordiv"].replay
    division_replay = by_name["wrong_z3_division_is_pythons"].replay
    assert cdiv_replay is not None and division_replay is not None
    assert cdiv_replay({"a": 1, "b": 2}) is False
    assert cdiv_replay({"a": 4, "b": 2}) is True
    assert division_replay({"a": 1, "b": -2}) is False  # Python -1, SMT-LIB 0
    assert division_replay({"a": 7, "b": 2}) is True


def test_floordiv_model_matches_python_on_a_grid() -> None:
    assert floordiv_model_matches_python() == []


def test_modelled_formulas_match_pagedkv_code() -> None:
    assert formulas_match_code() == []


def test_a_divisor_that_may_be_zero_makes_the_lemma_undefined() -> None:
    def unguarded(m: Arithmetic) -> Claim:
        a, b = z3.Ints("a b")
        return z3.BoolVal(True), m.floordiv(a, b) * b <= a + 1000

    verdict = check(Lemma("unguarded", "a // b without b != 0", unguarded))
    assert verdict.status == "undefined"
    assert not verdict.ok


def test_cli_prints_every_lemma_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert z3_lemmas.main([]) == 0
    out = capsys.readouterr().out
    for item in [*LEMMAS, *WRONG_VARIANTS]:
        assert item.name in out
    assert f"{len(LEMMAS)} of {len(LEMMAS)} proved" in out
    assert "FAIL" not in out
