"""Checks beyond the example and property tests; `proofs/README.md` says what each establishes.

Not part of the installed package: run its commands from the repository root, e.g.
`python -m proofs.exhaustive` or `python -m proofs.z3_lemmas`.
"""
