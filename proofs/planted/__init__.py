"""Planted bugs: realistic mistakes planted into impl, each run against every checker, each of
which must be caught by at least two (`python -m proofs.planted`; table in `planted-bugs.md`)."""
