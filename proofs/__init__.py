"""Checks beyond the example and property tests: exhaustive state search and z3 lemmas.

Not part of the installed package: run from the repository root (`python -m proofs.exhaustive`,
`python -m proofs.z3_lemmas`). See `proofs/README.md` for what each check establishes.
"""
