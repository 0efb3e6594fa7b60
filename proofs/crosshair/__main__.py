"""`python -m proofs.crosshair`: the same as `python -m proofs.crosshair`."""

import sys

from proofs.crosshair.runner import main

sys.exit(main())
