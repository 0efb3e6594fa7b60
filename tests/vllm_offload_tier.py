"""vLLM 0.33.0's own CPU offload tier against pagedkv's spec, in a process of its own.

    python tests/vllm_offload_tier.py [NUM_SEEDS] [NUM_STEPS]

Fetches vLLM 0.33.0's `vllm/v1/kv_offload/` manager and policies (a few wheel members, by range
requests, cached in ~/.cache/pagedkv) with stand-ins for what they import but do not use
(`pagedkv.harness.vllm.offload_0_33`), imports them as `vllm`, and runs
`pagedkv.harness.offload_runs.run_pair` for each seed under each configuration below (both
policies; thresholds 1 and 2; a tracker small enough to forget keys): every answer and, after
every step, the whole state compared with the spec's. Prints one JSON line: every run's report
(calls made, the first divergence or null). Exit status: 0 the runs ran, 2 a setup error, 3 the
package index is unreachable and nothing is cached (the test skips, saying so).
"""

from __future__ import annotations

import json
import sys

from pagedkv.harness.offload_runs import run_pair
from pagedkv.harness.vllm.offload_0_33 import MEMBERS, STAND_INS, VERSION, VllmOffloadTier
from pagedkv.harness.vllm.wheel import FetchError, source_tree
from pagedkv.vocab.offload import OffloadTierConfig

UNREACHABLE = 3
SETUP_ERROR = 2
CONFIGS = (
    OffloadTierConfig(4, "lru"),
    OffloadTierConfig(4, "arc"),
    OffloadTierConfig(2, "lru"),
    OffloadTierConfig(3, "arc", store_threshold=2, max_tracker_size=4),
    OffloadTierConfig(5, "lru", store_threshold=2, max_tracker_size=3),
)


def main(argv: list[str]) -> int:
    num_seeds = int(argv[1]) if len(argv) > 1 else 5
    num_steps = int(argv[2]) if len(argv) > 2 else 400
    try:
        root = source_tree(VERSION, MEMBERS, STAND_INS)
    except FetchError as error:
        print(json.dumps({"unreachable": str(error)}))
        return UNREACHABLE
    try:
        VllmOffloadTier(root, CONFIGS[0])
    except Exception as error:  # any import failure is a setup error
        print(json.dumps({"setup_error": repr(error)}))
        return SETUP_ERROR
    runs = [
        run_pair(seed, config, lambda c: VllmOffloadTier(root, c), num_steps).as_dict()
        for config in CONFIGS
        for seed in range(num_seeds)
    ]
    print(json.dumps({"version": VERSION, "root": str(root), "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
