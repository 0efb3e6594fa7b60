"""The manager contracts, with the variant `PAGEDKV_PLANTED` names planted at import.

`crosshair check proofs.planted.crosshair_manager.contract_decode_step` in a process whose
environment names a variant checks the real `KVCacheManager.allocate_slots` with that mistake
in it: the contracts (`proofs.crosshair.manager_contracts`) call the public methods, so only
planting the variant in CrossHair's own process lets them see a method or call-site patch.
`proofs.planted.checkers.check_crosshair` sets the variable and plants the variant in its own
process too, so that a counterexample replays.
"""

from __future__ import annotations

import os

from proofs.crosshair.manager_contracts import (
    CONTRACTS,
    contract_admission_with_hits,
    contract_decode_step,
    contract_window_steps,
)
from proofs.planted.catalog import PLANT_ENV, VARIANTS_BY_NAME, plant_for_good

_planted = os.environ.get(PLANT_ENV)
if _planted:
    plant_for_good(VARIANTS_BY_NAME[_planted])

__all__ = [
    "CONTRACTS",
    "contract_admission_with_hits",
    "contract_decode_step",
    "contract_window_steps",
]
