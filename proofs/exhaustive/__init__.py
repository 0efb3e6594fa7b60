"""Exhaustive breadth-first search of every reachable state of tiny pools and managers, spec and
implementation in lock-step, with shortest failing traces (`python -m proofs.exhaustive`)."""
