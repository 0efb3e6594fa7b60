"""vLLM 0.33.0's own `MambaManager` in mode "align" against pagedkv's spec, in a process of its
own (its KV cache modules are imported as the package `vllm`).

    python tests/vllm_033_mamba_align.py RETENTION EXAMPLES [LAYOUT [no-mask] [k=K]]

RETENTION is the engine's `prefix_cache_retention_interval` (`None` or a number of tokens).
vLLM's manager is built as its engine builds it (`pagedkv verify --against vllm==0.33.0`'s
adapter) for full-attention and Mamba groups in mode "align"; this script plays the scheduler
(`new_step_starts` first in every step, chunks cut by
`pagedkv.spec.single_type.mamba.mamba_chunk`). It runs the scenarios of
docs/design/mamba-align.md section 4 (4.1, 4.3, 5.2, and 4.2 with two speculative blocks) on
both and compares every answer, table and keyed block, then EXAMPLES random aligned workloads
of `tests/test_mamba_align.py` (derandomized) over the groups of LAYOUT (a key of its
`LAYOUTS`; by default one full-attention and one Mamba group), and prints one JSON line: the
scenarios that agreed, the workloads run, and the first divergence, if any. `k=K` gives each
Mamba group K speculative blocks, and the workloads lookahead slots and decode steps with
drafts. `no-mask` is the control: the spec's Mamba group then keys every state a step ended
on (as under dense retention), and the comparison must find it. Exit status: 0 agreement, 1 a
divergence, 2 a setup error, 3 the package index is unreachable and nothing is cached.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from hypothesis import Phase, given, settings
from test_mamba_align import OPS, Op, config, full, ids, mamba, run_workload
from vllm_campaign import UNREACHABLE, _unreachable

from pagedkv import KVCacheConfig, Request
from pagedkv.harness.comparison import quiet_refusal_warnings
from pagedkv.harness.protocol import ManagerConfig
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.vllm.against import Against, prepare
from pagedkv.spec.manager import SpecKVCacheManager
from pagedkv.spec.single_type.mamba import MambaAlignState


class VllmSide:
    """vLLM 0.33.0's manager through the harness adapter, with the calls the comparison
    needs: block ids in, block ids out, and `new_step_starts` (the scheduler's)."""

    def __init__(self, against: Against, kv_config: KVCacheConfig, max_model_len: int) -> None:
        semantics = against.adapter.semantics
        built = ManagerConfig(kv_config, max_model_len, True, "sha256", False, False, semantics)
        self.adapter: Any = against.manager_factory(built)
        self.block_pool = self.adapter.manager.block_pool
        self.junctions: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        hits, num_tokens = self.adapter.get_computed_blocks(request)
        self.junctions[request.request_id] = self.adapter.views(request).shared_prefix_boundary
        return hits, num_tokens

    def shared_prefix_boundary(self, request_id: str) -> int:
        return self.junctions.get(request_id, 0) or 0

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        return self.adapter.allocate_slots(*args, **kwargs)

    def free(self, request: Request) -> None:
        self.adapter.free(request)

    def free_block_hashes(self, request: Request) -> None:
        self.adapter.free_block_hashes(request)

    def reset_prefix_cache(self) -> bool:
        return bool(self.adapter.reset_prefix_cache())

    def evict_blocks(self, block_ids: list[int]) -> None:
        self.adapter.evict_blocks(block_ids)

    def new_step_starts(self) -> None:
        self.adapter.manager.new_step_starts()

    def check_invariants(self) -> None:
        self.adapter.check_invariants()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(
            [block.block_id for block in manager.req_to_blocks.get(request_id, [])]
            for manager in self.adapter.single_types
        )


def keyed(manager: Any) -> list[int]:
    if isinstance(manager, SpecKVCacheManager):
        return [i for i, key in enumerate(manager.pool.block_hash) if key is not None]
    return [block.block_id for block in manager.block_pool.blocks if block.block_hash is not None]


def tables(manager: Any, request_id: str) -> list[list[int]]:
    if isinstance(manager, SpecKVCacheManager):
        return [list(blocks) for blocks in manager.held(request_id) or ()]
    return [list(blocks) for blocks in manager.get_block_ids(request_id)]


def section_4_1(manager: Any) -> list[object]:
    """Chunks 0..96 and 96..100 of a 100-token prompt, then 14 decode steps."""
    log: list[object] = []
    request = Request("A", range(100))
    manager.new_step_starts()
    hits, _ = manager.get_computed_blocks(request)
    log.append(ids(manager.allocate_slots(request, 96, hits)))
    request.num_computed_tokens = 96
    manager.new_step_starts()
    log.append(ids(manager.allocate_slots(request, 4)))
    request.num_computed_tokens = 100
    log.append((tables(manager, "A"), keyed(manager)))
    for token in range(14):
        request.append_output_token_ids(1000 + token)
        manager.new_step_starts()
        log.append(ids(manager.allocate_slots(request, 1)))
        request.num_computed_tokens += 1
        log.append((tables(manager, "A"), keyed(manager)))
    return log


def section_4_3(manager: Any) -> list[object]:
    """A sibling's hit at 96: refused in the step that keyed it, adopted in the next."""
    log: list[object] = []
    first, sibling = Request("A", range(100)), Request("B", [*range(100), *range(500, 520)])
    manager.new_step_starts()
    hits, _ = manager.get_computed_blocks(first)
    log.append(ids(manager.allocate_slots(first, 96, hits)))
    first.num_computed_tokens = 96
    hits, num_tokens = manager.get_computed_blocks(sibling)
    log.append((ids(hits), num_tokens, ids(manager.allocate_slots(sibling, 16, hits))))
    manager.new_step_starts()
    log.append(ids(manager.allocate_slots(sibling, 16, hits)))
    sibling.num_computed_tokens = 112
    log.append((tables(manager, "B"), keyed(manager)))
    manager.new_step_starts()
    log.append(ids(manager.allocate_slots(sibling, 8)))
    log.append((tables(manager, "B"), keyed(manager)))
    manager.free(first)
    manager.free(sibling)
    log.append(keyed(manager))
    return log


def section_5_2(manager: Any) -> list[object]:
    """A junction at 144 cut short by the Mamba group, kept for the next sibling."""
    log: list[object] = []
    first = Request("A", range(200))
    manager.new_step_starts()
    hits, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 192, hits)
    first.num_computed_tokens = 192
    manager.new_step_starts()
    manager.allocate_slots(first, 8)
    first.num_computed_tokens = 200
    sibling = Request("B", [*range(150), *range(900, 950)])
    manager.new_step_starts()
    hits, num_tokens = manager.get_computed_blocks(sibling)
    log.append((ids(hits), num_tokens, manager.shared_prefix_boundary("B")))
    log.append(ids(manager.allocate_slots(sibling, 144, hits)))
    sibling.num_computed_tokens = 144
    log.append((tables(manager, "B"), keyed(manager)))
    third = Request("C", [*range(150), *range(700, 720)])
    manager.new_step_starts()
    hits, num_tokens = manager.get_computed_blocks(third)
    log.append((ids(hits), num_tokens))
    return log


def section_4_2(manager: Any) -> list[object]:
    """Speculative blocks (k = 2, two drafts, two lookahead slots): chunks 0..32, 32..96 and
    96..100, then decode with 1 + 2 tokens a step and the acceptances of `ACCEPTED`."""
    log: list[object] = []
    request = Request("A", range(100))
    for start, num_tokens in ((0, 32), (32, 64), (96, 4)):
        manager.new_step_starts()
        hits = manager.get_computed_blocks(request)[0] if start == 0 else None
        log.append(ids(manager.allocate_slots(request, num_tokens, hits, 2)))
        request.num_computed_tokens = start + num_tokens
        log.append((tables(manager, "A"), keyed(manager)))
    request.append_output_token_ids(999)
    for index, accepted in enumerate(ACCEPTED):
        drafts = [2000 + 2 * index, 2001 + 2 * index]
        request.spec_token_ids = list(drafts)
        manager.new_step_starts()
        log.append(ids(manager.allocate_slots(request, 3, None, 2)))
        request.spec_token_ids = []
        request.num_computed_tokens += 1 + accepted
        for token in [*drafts[:accepted], 3000 + index]:
            request.append_output_token_ids(token)
        log.append((tables(manager, "A"), keyed(manager)))
    return log


ACCEPTED = (2, 2, 2, 1, 0, 2, 2, 1, 2, 0, 2, 2)
"""The accepted drafts of section 4.2's decode steps (the note's run: 2, 2, 2, 1, 0, 2, ...)."""


SCENARIOS: dict[str, Callable[[Any], list[object]]] = {
    "4.1": section_4_1,
    "4.3": section_4_3,
    "5.2": section_5_2,
}
SPECULATIVE_SCENARIOS: dict[str, Callable[[Any], list[object]]] = {"4.2": section_4_2}
"""Scenarios of a Mamba group with two speculative blocks (`num_speculative_blocks=2`)."""


def main(
    retention: int | None, examples: int, layout: str, speculative: int = 0
) -> tuple[int, dict[str, object]]:
    setting = f"prefix_cache_retention_interval={retention}"
    try:
        against = prepare("vllm==0.33.0", (setting,))
    except SetupError as error:
        status = UNREACHABLE if _unreachable(error) else 2
        return status, {"setup_error": f"{error} (cause: {error.__cause__!r})"}
    for name in against.adapter.loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    semantics = against.adapter.semantics
    report: dict[str, object] = {
        "retention": retention,
        "layout": layout,
        "speculative": speculative,
        "scenarios": {},
        "failure": None,
    }
    agreed: dict[str, bool] = {}
    for name, scenario in SCENARIOS.items():
        kv_config = config(60, retention=retention)
        spec = SpecKVCacheManager(kv_config, 400, semantics=semantics)
        agreed[name] = scenario(spec) == scenario(VllmSide(against, kv_config, 400))
    for name, scenario in SPECULATIVE_SCENARIOS.items():
        kv_config = config(60, full(), mamba(num_speculative_blocks=2), retention=retention)
        spec = SpecKVCacheManager(kv_config, 400, semantics=semantics)
        ours, theirs = scenario(spec), scenario(VllmSide(against, kv_config, 400))
        agreed[name] = ours == theirs
        if ours != theirs:
            report[f"{name} spec"], report[f"{name} vllm"] = ours, theirs
    report["scenarios"] = agreed

    def build(kv_config: KVCacheConfig, max_model_len: int) -> list[Any]:
        return [
            SpecKVCacheManager(kv_config, max_model_len, semantics=semantics),
            VllmSide(against, kv_config, max_model_len),
        ]

    runs = 0

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
    )
    @given(OPS)
    def workloads(ops: list[Op]) -> None:
        nonlocal runs
        runs += 1
        run_workload(ops, retention, build, layout, speculative)

    try:
        with quiet_refusal_warnings():  # refused resets warn, on both sides
            workloads()
    except AssertionError as error:
        report["failure"] = f"{type(error).__name__}: {error}"
    report["workloads"] = runs
    status = 0 if all(agreed.values()) and report["failure"] is None else 1
    return status, report


if __name__ == "__main__":
    interval = None if sys.argv[1] == "None" else int(sys.argv[1])
    chosen = sys.argv[3] if len(sys.argv) > 3 else "full attention, Mamba"
    if "no-mask" in sys.argv[4:]:
        MambaAlignState.retained = lambda self, request, junction, positions: None  # type: ignore[method-assign]
    drafts = next((int(arg[2:]) for arg in sys.argv[4:] if arg.startswith("k=")), 0)
    exit_status, answer = main(interval, int(sys.argv[2]), chosen, drafts)
    print(json.dumps(answer))
    sys.exit(exit_status)
