"""`python -m proofs.planted`: the same as `python -m proofs.planted`."""

import sys

from proofs.planted.bugs import main

sys.exit(main())
