"""Check vLLM's own BlockPool and KVCacheManager against pagedkv's spec (on demand).

docs/semantics.md claims that pagedkv's spec, under `VLLM_0_8_5` semantics, is vLLM 0.8.5's
behaviour. This puts the claim to the test with vLLM's code itself: `pagedkv verify --against`
fetches the release's KV cache modules from PyPI (nothing of vLLM is committed here), runs them
with stand-ins for the rest of vllm, and drives them in lock-step with the spec: valid calls
only, no cache salts. CI runs a short derandomized form (`tests/test_vllm_conformance.py`).

    .venv/bin/python -m proofs.vllm_conformance [--steps N] [--against vllm==VERSION]

Exit status: 0 no divergence, 1 a divergence (with the shrunk sequence), 2 a setup error
(vLLM could not be fetched or loaded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedkv.cli import main as pagedkv_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps per campaign")
    parser.add_argument("--against", default="vllm==0.8.5", help="vllm==VERSION or vllm==latest")
    args = parser.parse_args(argv)
    return pagedkv_main(
        ["verify", "--quiet", "--against", args.against, "--steps", str(args.steps)]
    )


if __name__ == "__main__":
    sys.exit(main())
