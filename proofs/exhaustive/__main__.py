"""`python -m proofs.exhaustive`: the same as `python -m proofs.exhaustive`."""

import sys

from proofs.exhaustive.explore import main

sys.exit(main())
