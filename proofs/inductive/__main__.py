"""`python -m proofs.inductive`: prove the pool's and the manager's invariants for every size.

    python -m proofs.inductive                  both systems; exit 0 when every obligation holds
    python -m proofs.inductive --verbose        every obligation, with its solver time
    python -m proofs.inductive --weaken NAME    the pool's invariant without conjunct NAME (a
                                                planted weakening): expect exit 1 and a printed
                                                counterexample to induction
    python -m proofs.inductive --list           the conjuncts' names

Exit status: 0 every obligation proved; 1 a counterexample to induction (replayed concretely);
2 an obligation z3 could not settle within its resource bound (no counterexample found either).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from proofs.inductive.manager_model import INVARIANTS as MANAGER_INVARIANTS
from proofs.inductive.manager_proof import MANAGER
from proofs.inductive.pool_model import INVARIANTS as POOL_INVARIANTS
from proofs.inductive.pool_proof import POOL, weakened
from proofs.inductive.prover import Report, prove, render


def run(weaken: str | None = None) -> list[Report]:
    """Both systems' reports (the pool's with `weaken` left out of its invariant)."""
    pool_invariant = POOL_INVARIANTS if weaken is None else weakened(weaken)
    return [prove(POOL, pool_invariant), prove(MANAGER, MANAGER_INVARIANTS)]


def exit_status(reports: Sequence[Report]) -> int:
    statuses = {outcome.status for report in reports for outcome in report.outcomes}
    if "refuted" in statuses:
        return 1
    return 2 if "unknown" in statuses else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weaken", metavar="NAME", help="leave this pool conjunct out")
    parser.add_argument("--verbose", action="store_true", help="every obligation")
    parser.add_argument("--list", action="store_true", help="the conjuncts' names")
    args = parser.parse_args(argv)
    if args.list:
        for title, names in (("pool", POOL_INVARIANTS), ("manager", MANAGER_INVARIANTS)):
            print(f"{title}:")
            for name in names:
                print(f"  {name}")
        return 0
    if args.weaken is not None and args.weaken not in POOL_INVARIANTS:
        parser.error(f"--weaken: no pool conjunct {args.weaken!r} (--list shows them)")
    start = time.process_time()
    reports = run(args.weaken)
    for report in reports:
        print(render(report, args.verbose))
    status = exit_status(reports)
    verdict = {0: "proved", 1: "REFUTED", 2: "NOT PROVED"}[status]
    print(f"{verdict}: {time.process_time() - start:.1f} CPU seconds in all")
    return status


if __name__ == "__main__":
    sys.exit(main())
