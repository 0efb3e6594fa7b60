"""Inductive proofs with z3: the block pool's and the manager's invariants for every size.

`algebra.py` is the vocabulary the models are written in, with a plain-Python interpretation;
`symbolic.py` the z3 one. `pool_model.py` and `manager_model.py` are the transition systems and
their invariants; `pool_proof.py` and `manager_proof.py` their obligations and lemmas;
`prover.py` discharges them and replays counterexamples to induction; `pool_executable.py` runs
the pool model as a pool under test, `manager_executable.py` checks the manager model's
invariant on pagedkv's manager. `python -m proofs.inductive` runs both proofs; proofs/README.md
("Inductive proofs") says what is proved and what stays bounded.
"""
