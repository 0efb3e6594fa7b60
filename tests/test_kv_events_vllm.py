"""pagedkv's msgpack KV events, read by vLLM's own `KVEventBatch` structs.

For each release, `tests/vllm_kv_events.py` fetches its `vllm/distributed/kv_events.py` (one
member of the wheel, by range requests, cached in ~/.cache/pagedkv), runs in a process of its own
(the release is imported as `vllm`), and decodes batches that pagedkv's managers emitted in both
msgpack layouts: 0.33.0 (tagged maps, as every release since 0.24), 0.23.0 (the last release whose
events are arrays, the layout routers written against 0.9-0.23 decode by position) and 0.9.0 (the
first release with KV events: fewer fields, integer hashes only). Only an unreachable package index
with nothing cached skips, with the reason in the test report (`-ra`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")  # kv_events.py imports it

SCRIPT = Path(__file__).parent / "vllm_kv_events.py"
UNREACHABLE = 3


def decode_with(version: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), version],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if completed.returncode == UNREACHABLE:
        pytest.skip(f"vllm=={version}: the package index is unreachable and nothing is cached")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report: dict[str, Any] = json.loads(completed.stdout.splitlines()[-1])
    return report


def refused_every_batch(report: dict[str, Any]) -> bool:
    refusals = [m for m in report["mismatches"] if "vLLM's decoder refused it" in m]
    return report["batches"] == 0 and len(refusals) >= 5


def test_vllm_0_33_reads_the_map_layout_field_for_field_group_idx_included() -> None:
    report = decode_with("0.33.0")
    ours = report["map"]
    assert ours["mismatches"] == []
    assert not ours["array_like"] and ours["complete"]
    assert ours["batches"] == 10 and ours["events"] >= 20  # stores, removals, a reset
    assert ours["group_idx_seen"] == [0, 1]  # 0 written, as vLLM 0.33 writes it
    # The same msgpack items, in the same order, as vLLM's structs holding the same events.
    assert ours["same_items"] == ours["batches"]
    assert refused_every_batch(report["array"])  # not vacuous: the other layout is refused


def test_vllm_0_23_reads_the_array_layout_and_writes_the_same_bytes() -> None:
    report = decode_with("0.23.0")
    ours = report["array"]
    assert ours["mismatches"] == []
    assert ours["array_like"] and ours["complete"]
    assert ours["batches"] == 10 and ours["group_idx_seen"] == [0, 1]
    assert ours["same_bytes"] == ours["batches"]
    assert refused_every_batch(report["map"])


def test_vllm_0_9_reads_the_array_layout_skipping_the_fields_it_predates() -> None:
    report = decode_with("0.9.0")
    ours = report["array"]
    assert ours["mismatches"] == []
    assert ours["int_only"] and not ours["complete"]
    assert ours["block_stored_fields"] == [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
    ]
    assert ours["batches"] >= 4  # the builtin hash's batches (and a reset)
    assert ours["refuses_hash_bytes"] is True  # its list[int] takes no sha256 hash bytes
    assert refused_every_batch(report["map"])


def test_an_unreachable_index_with_nothing_cached_is_the_only_skip(tmp_path: Path) -> None:
    """The script tells an unreachable index (exit 3: the tests above skip, saying so) from a
    failure; nothing else makes them skip."""
    env = {
        **os.environ,
        "PAGEDKV_CACHE": str(tmp_path),  # nothing cached
        "PAGEDKV_PYPI_INDEX": "http://127.0.0.1:9/simple",  # nothing listens on port 9
    }
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "0.33.0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert completed.returncode == UNREACHABLE, completed.stdout + completed.stderr
    assert "cannot fetch vllm==0.33.0" in completed.stdout
