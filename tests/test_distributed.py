"""unify_num_blocks across 2 real processes (gloo backend, CPU): min num_blocks, same error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.vocab.errors import KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

# Each rank builds its own config, calls unify_num_blocks, and prints one JSON line: the
# result, or the error it raised. Rank r has NUM_BLOCKS[r] blocks; with MISMATCH, rank 1 keeps
# its cache in float32 while rank 0 keeps it in float16.
WORKER = """
import datetime, json, sys
import torch.distributed as dist
from pagedkv.planning.distributed import unify_num_blocks
from pagedkv.vocab.errors import KVCacheConfigError
from pagedkv.vocab.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec,
)

rank, store, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
NUM_BLOCKS = [7, 5]
dist.init_process_group(
    "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=60),
)
try:
    dtype = "float32" if scenario == "mismatch" and rank == 1 else "float16"
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype=dtype)
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=4
    )
    specs = [("w", window), ("f", full)] if rank == 0 else [("f", full), ("w", window)]
    n = NUM_BLOCKS[rank]
    config = KVCacheConfig(
        n,
        {name: KVCacheTensor(spec.page_size_bytes * n) for name, spec in specs},
        [KVCacheGroupSpec([name], spec) for name, spec in specs],
    )
    try:
        unified = unify_num_blocks(config)
    except KVCacheConfigError as error:
        print(json.dumps({"rank": rank, "error": str(error)}))
    else:
        print(json.dumps({
            "rank": rank,
            "num_blocks": unified.num_blocks,
            "groups": [list(g.layer_names) for g in unified.kv_cache_groups],
            "tensor_sizes": {name: t.size for name, t in unified.tensors.items()},
            "given_num_blocks": config.num_blocks,
        }))
finally:
    dist.destroy_process_group()
"""


def run_two_ranks(tmp_path: Path, scenario: str) -> list[dict[str, object]]:
    """Start ranks 0 and 1, wait for both (timeout), and return their JSON lines by rank."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = tmp_path / "store"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(store), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    results = []
    try:
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=180)
            assert process.returncode == 0, f"rank {rank} failed:\n{stderr}"
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


@pytest.mark.slow
def test_both_ranks_end_with_the_minimum(tmp_path: Path) -> None:
    rank0, rank1 = run_two_ranks(tmp_path, "same")
    assert rank0["num_blocks"] == rank1["num_blocks"] == 5
    # groups sorted by type id on both ranks: "full_attention_4_32" < "sliding_window_4_4_32"
    assert rank0["groups"] == rank1["groups"] == [["f"], ["w"]]
    # each rank keeps its own tensors (rank 0's hold 7 pages of 32 bytes) and its given config
    assert rank0["tensor_sizes"] == {"w": 7 * 32, "f": 7 * 32}
    assert rank1["tensor_sizes"] == {"f": 5 * 32, "w": 5 * 32}
    assert (rank0["given_num_blocks"], rank1["given_num_blocks"]) == (7, 5)


@pytest.mark.slow
def test_a_mismatched_spec_fails_on_both_ranks_with_the_same_clear_error(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_two_ranks(tmp_path, "mismatch")
    assert rank0["error"] == rank1["error"]
    message = str(rank0["error"])
    assert message.startswith(
        "KV cache specs differ between workers in group 0: worker 0 layer 'f' has "
        "FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype='float16'"
    )
    assert "worker 1 layer 'f' has FullAttentionSpec(" in message
    assert "dtype='float32'" in message


def test_unify_num_blocks_needs_a_process_group() -> None:
    import torch.distributed as dist

    from pagedkv.planning.distributed import unify_num_blocks

    assert not dist.is_initialized()
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float16")
    config = KVCacheConfig(1, {"a": KVCacheTensor(32)}, [KVCacheGroupSpec(["a"], spec)])
    with pytest.raises(KVCacheConfigError, match=r"initialized torch\.distributed process group"):
        unify_num_blocks(config)
