"""The vLLM plugin without vLLM (`pagedkv.vllm_plugin`): what CI checks on every run.

- `register()` stays inert (imports no vLLM) unless PAGEDKV_VLLM is set, and refuses values it
  does not know; the entry point is registered.
- vLLM's `KVCacheConfig` (objects of vLLM's class names, read by attribute) translates to
  pagedkv's, and every out-of-domain feature is refused by name.
- Traces recorded inside vLLM 0.32.0's own engine (tests/vllm_traces/record.py: tiny Llama,
  tiny Gemma-3-style, shadow mode; the vLLM tier's Qwen3-Next smoke, a Mamba hybrid) replay on
  the implementation and the spec with no divergence, and a planted bug in the implementation
  (or vLLM 0.32.0's Mamba switch turned off) makes the replay diverge.
- The shadow manager itself, around a stand-in with vLLM's surface (pagedkv's façade over its
  implementation, mirrored to the spec): agreement, a planted divergence reported once with a
  trace that replays it offline, strict mode, a pagedkv failure that never reaches the caller,
  a call outside the domain.

The same plugin inside vLLM's engine: tests/test_vllm_engine.py (the vLLM tier).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from pagedkv.harness.verify import EXIT_SETUP
from pagedkv.harness.verify import main as verify_main
from pagedkv.manager import KVCacheManager
from pagedkv.vllm_plugin import register
from pagedkv.vllm_plugin.domain import (
    OutOfDomainError,
    config_refusals,
    manager_refusals,
    pagedkv_config,
)
from pagedkv.vllm_plugin.facade import PagedKVFacade
from pagedkv.vllm_plugin.recorder import Recorder
from pagedkv.vllm_plugin.replay import Replayer, build_manager, replay_trace
from pagedkv.vllm_plugin.report import Report
from pagedkv.vllm_plugin.settings import (
    PluginSettingError,
    Settings,
    UnsupportedReleaseError,
    release_semantics,
)
from pagedkv.vllm_plugin.shadow import ShadowKVCacheManager, ShadowStoppedError
from pagedkv.vllm_plugin.trace import (
    TRACE_FORMAT,
    TraceSink,
    config_from_json,
    config_to_json,
    read_trace,
)
from pagedkv.vocab.kv_cache_interface import MambaSpec as PagedMambaSpec
from pagedkv.vocab.kv_cache_interface import SlidingWindowSpec
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME, VLLM_0_32
from proofs.planted.catalog import VARIANTS_BY_NAME, planted

TRACES = Path(__file__).parent / "vllm_traces"
LLAMA_TRACE = TRACES / "llama-shadow.jsonl"
GEMMA_TRACE = TRACES / "gemma3-shadow.jsonl"
QWEN3_NEXT_TRACE = TRACES / "qwen3_next-shadow.jsonl"
"""The vLLM tier's smoke run of its tiny Qwen3-Next in strict shadow mode, traced
(`PAGEDKV_VLLM_TRACE`): a Mamba group in mode "align" beside full attention."""

# -- stand-ins for vLLM's objects, under vLLM's class names (the plugin reads by attribute) ---


def _vllm_class(name: str) -> type:
    return type(name, (), {"__init__": lambda self, **kw: self.__dict__.update(kw)})


FullAttentionSpec = _vllm_class("FullAttentionSpec")
SlidingWindowSpecV = _vllm_class("SlidingWindowSpec")
MambaSpec = _vllm_class("MambaSpec")
KVCacheGroupSpec = _vllm_class("KVCacheGroupSpec")
KVCacheConfig = _vllm_class("KVCacheConfig")

BLOCK = 16


def attention(kind: type = FullAttentionSpec, block_size: int = BLOCK, **extra: Any) -> Any:
    return kind(block_size=block_size, num_kv_heads=2, head_size=64, dtype="float16", **extra)


GDN_ATTN = type("MambaAttentionBackendEnum", (), {"name": "GDN_ATTN"})()
"""vLLM's backend enum member of a gated delta net, as the plugin reads it (by name)."""


def mamba(block_size: int = BLOCK, mode: str = "align", **extra: Any) -> Any:
    """vLLM 0.32's `MambaSpec` of a gated-delta-net layer as its engine makes it: conv and
    recurrent states, float32, the page padded to the attention page of `attention()`."""
    fields = {
        "shapes": ((3, 64), (2, 16, 16)),
        "dtypes": ("torch.float32", "torch.float32"),
        "page_size_padded": 2 * block_size * 2 * 64 * 2,
        "mamba_type": GDN_ATTN,
        "mamba_cache_mode": mode,
        "num_speculative_blocks": 0,
        "num_prefill_checkpoint_blocks": 0,
        "prefill_checkpoint_alignment": None,
        "num_heads": 1,
        "tp_replicated": False,
        **extra,
    }
    return MambaSpec(block_size=block_size, **fields)


def vllm_config(*specs: Any, num_blocks: int = 24, **extra: Any) -> Any:
    groups = [
        KVCacheGroupSpec(layer_names=[f"layers.{index}"], kv_cache_spec=spec)
        for index, spec in enumerate(specs)
    ]
    fields = {"prefix_cache_retention_interval": 0, "hash_block_size": None, **extra}
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, **fields)


def engine_config(**changes: Any) -> Any:
    """A vLLM `VllmConfig` in pagedkv's domain, with `changes` ("scheduler.async_scheduling")."""
    parts: dict[str, dict[str, Any]] = {
        "scheduler": {"async_scheduling": False, "watermark": 0.0},
        "parallel": {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1},
        "model": {"is_encoder_decoder": False},
        "top": {"kv_transfer_config": None, "speculative_config": None, "kv_events_config": None},
    }
    for key, value in changes.items():
        part, _, name = key.rpartition(".")
        parts[part or "top"][name] = value
    namespace = _vllm_class("VllmConfig")
    return namespace(
        scheduler_config=namespace(**parts["scheduler"]),
        parallel_config=namespace(**parts["parallel"]),
        model_config=namespace(**parts["model"]),
        **parts["top"],
    )


@dataclass(eq=False)
class VllmRequest:
    """What the plugin reads of vLLM's `Request`."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finished: bool = False
    skip_reading_prefix_cache: bool = False
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class KVCacheBlocks:
    """vLLM's answer type, as the scheduler reads it."""

    blocks: tuple[Any, ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)


@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


def header_of(config: Any, mode: str = "shadow") -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT,
        "vllm": "0.32.0",
        "pagedkv": "test",
        "mode": mode,
        "semantics": "vllm-0.32",
        "config": config_to_json(pagedkv_config(config)),
        "max_model_len": 256,
        "enable_caching": True,
        "max_in_flight_tokens": 32,
        "check_every": 8,
    }


class VllmStandIn(PagedKVFacade):
    """pagedkv's implementation with vLLM 0.32's manager surface, including the state the
    shadow reads for its snapshots: the part of vLLM that shadow mode compares against."""

    def __init__(self, config: Any) -> None:
        header = header_of(config, "replace")
        manager = build_manager(header, "impl")
        assert isinstance(manager, KVCacheManager)
        vllm_manager = type(
            "VllmManager",
            (),
            {"kv_cache_config": config, "max_model_len": 256, "enable_caching": True},
        )()
        vllm_manager.log_stats = True
        sink = TraceSink(header, None, 1_000_000)
        recorder = Recorder(256)
        super().__init__(vllm_manager, manager, recorder, sink, KVCacheBlocks, PrefixCacheStats)
        self.coordinator = manager.coordinator

    @property
    def block_pool(self) -> Any:
        pool = self._manager.block_pool

        class Queue:
            @staticmethod
            def get_all_free_blocks() -> list[Any]:
                blocks = []
                block = pool.free_block_queue.free_list_head
                while block is not None:
                    blocks.append(block)
                    block = block.next_free_block
                return blocks

        return type("Pool", (), {"free_block_queue": Queue})()


# -- a scheduler loop, as vLLM 0.32's synchronous scheduler calls the manager ------------------


def schedule(manager: Any, *, seed: int, num_requests: int = 24, chunk: int = 24) -> list[str]:
    """Admit, chunk, decode, preempt and finish requests with shared prefixes through
    `manager`'s vLLM surface, each step begun by `new_step_starts`; the ids of the requests that
    finished, in order. With `chunk` = `BLOCK` every prefill chunk ends on a block boundary or
    at the prompt's end, as vLLM cuts a Mamba hybrid's chunks in mode "align"."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(3)]
    waiting = [
        VllmRequest(
            f"r{index}",
            rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randint(1, 40))],
        )
        for index in range(num_requests)
    ]
    outputs = {request.request_id: rng.randint(1, 30) for request in waiting}
    running: list[VllmRequest] = []
    finished: list[str] = []
    for _ in range(2000):
        if not waiting and not running:
            return finished
        manager.new_step_starts()
        scheduled: dict[str, int] = {}
        for request in list(running):
            if request not in running:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
            while manager.allocate_slots(request, num_new) is None:
                victim = running.pop()
                manager.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                scheduled.pop(victim.request_id, None)
                waiting.insert(0, victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
        while waiting:
            request = waiting[0]
            hits, num_hit_tokens, _ = manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, chunk)
            answer = manager.allocate_slots(
                request, num_new, num_hit_tokens, hits, full_sequence_must_fit=True
            )
            if answer is None:
                break
            manager.record_prefix_cache_stats(request, num_hit_tokens)
            manager.get_blocks(request.request_id)
            waiting.pop(0)
            request.num_computed_tokens += num_hit_tokens
            running.append(request)
            scheduled[request.request_id] = num_new
        manager.take_new_block_ids()  # vLLM's scheduler drains it every step
        for request in list(running):
            request.num_computed_tokens += scheduled.get(request.request_id, 0)
            if request.num_computed_tokens == request.num_tokens:
                request.all_token_ids.append(rng.randrange(500))
                produced = request.num_tokens - len(request.prompt_token_ids)
                if produced >= outputs[request.request_id]:
                    request.finished = True
                    running.remove(request)
                    manager.free(request)
                    finished.append(request.request_id)
        if rng.random() < 0.01:
            manager.reset_prefix_cache()
    raise AssertionError("the scheduler loop did not drain")


def shadow_around(
    vllm_manager: Any, config: Any, tmp_path: Path, *, side: str = "spec", strict: bool = False
) -> ShadowKVCacheManager:
    header = header_of(config)
    report = Report(str(tmp_path / "report.json"), {"model_name": "test", "engine": "0"})
    return ShadowKVCacheManager(
        vllm_manager,
        Replayer(build_manager(header, side)),
        Recorder(256),
        TraceSink(header, None, 1_000_000),
        report,
        strict=strict,
        snapshot_every=8,
    )


ONE_GROUP = vllm_config(attention())
TWO_GROUPS = vllm_config(attention(SlidingWindowSpecV, sliding_window=32), attention())
MAMBA_HYBRID = vllm_config(attention(), mamba(), needs_kv_cache_zeroing=True)

# -- register() and settings ---------------------------------------------------------------


def test_entry_point_is_registered() -> None:
    names = {entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert "pagedkv.vllm_plugin:register" in names


def test_register_is_inert_without_the_variable() -> None:
    code = (
        "import os, sys; os.environ.pop('PAGEDKV_VLLM', None)\n"
        "from pagedkv.vllm_plugin import register; register()\n"
        "assert 'vllm' not in sys.modules, 'register() imported vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PAGEDKV_VLLM", "on"),
        ("PAGEDKV_VLLM_STRICT", "yes"),
        ("PAGEDKV_VLLM_SIDE", "vllm"),
        ("PAGEDKV_VLLM_SNAPSHOT_EVERY", "0"),
    ],
)
def test_settings_refuse_unknown_values(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv("PAGEDKV_VLLM", "shadow")
    monkeypatch.setenv(variable, value)
    with pytest.raises(PluginSettingError, match=variable):
        register()


def test_settings_read_every_variable() -> None:
    settings = Settings.from_environ(
        {
            "PAGEDKV_VLLM": "Replace",
            "PAGEDKV_VLLM_STRICT": "1",
            "PAGEDKV_VLLM_SIDE": "spec",
            "PAGEDKV_VLLM_TRACE": "/tmp/t",
            "PAGEDKV_VLLM_REPORT": "/tmp/r.json",
            "PAGEDKV_VLLM_SNAPSHOT_EVERY": "5",
        }
    )
    assert (settings.mode.value, settings.strict, settings.side) == ("replace", True, "spec")
    assert (settings.trace_dir, settings.report_path, settings.snapshot_every) == (
        "/tmp/t",
        "/tmp/r.json",
        5,
    )


def test_only_known_releases() -> None:
    assert release_semantics("0.32.1+cpu")[0] == "vllm-0.32"
    with pytest.raises(UnsupportedReleaseError, match=r"vLLM 0\.33\.0.*supports 0\.32\.x"):
        release_semantics("0.33.0")


# -- the domain ----------------------------------------------------------------------------


def test_config_translation_keeps_groups_blocks_and_retention() -> None:
    config = pagedkv_config(TWO_GROUPS)
    assert config.num_blocks == 24
    window, full = (group.kv_cache_spec for group in config.kv_cache_groups)
    assert isinstance(window, SlidingWindowSpec) and window.sliding_window == 32
    assert type(full).__name__ == "FullAttentionSpec" and full.block_size == BLOCK
    assert config.prefix_cache_retention_interval == 0
    # Without a window group the interval means nothing: dense, as vLLM's coordinator acts.
    assert pagedkv_config(ONE_GROUP).prefix_cache_retention_interval is None
    assert config_from_json(config_to_json(config)) == config


def test_mamba_translation_keeps_the_state_and_its_mode() -> None:
    """vLLM's gated-delta-net spec becomes pagedkv's: the state's shapes and dtypes (torch's
    names without the module), the padded page, the backend by name, mode "align"; the
    retention interval acts (a Mamba group in "align" keeps only some states), and the config
    survives a trace's JSON."""
    config = pagedkv_config(MAMBA_HYBRID)
    full, state = (group.kv_cache_spec for group in config.kv_cache_groups)
    assert isinstance(state, PagedMambaSpec)
    assert (state.block_size, state.shapes, state.dtypes) == (
        BLOCK,
        ((3, 64), (2, 16, 16)),
        ("float32", "float32"),
    )
    assert (state.mamba_type, state.mamba_cache_mode) == ("gdn_attn", "align")
    assert state.page_size_bytes == full.page_size_bytes == 8192
    assert config.prefix_cache_retention_interval == 0
    assert config_from_json(config_to_json(config)) == config
    none = pagedkv_config(vllm_config(mamba(block_size=256, mode="none")))
    assert none.prefix_cache_retention_interval is None
    assert none.kv_cache_groups[0].kv_cache_spec.mamba_cache_mode == "none"


def test_mamba_features_of_vllms_manager_are_refused_by_name() -> None:
    coordinator = type("Coordinator", (), {"enable_partial_hash_hits": True})()
    partial = type("Manager", (), {"coordinator": coordinator})()
    checkpoint = type("Manager", (), {"mamba_shared_prefix_checkpoint": True})()
    assert [e.feature for e in manager_refusals(partial, replace=True)] == ["partial hash hits"]
    assert [e.feature for e in manager_refusals(checkpoint, replace=False)] == [
        "the Mamba shared-prefix checkpoint"
    ]
    plain = type("Manager", (), {"coordinator": object()})()
    assert list(manager_refusals(plain, replace=True)) == []


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (vllm_config(attention(), mamba(num_speculative_blocks=2)), "speculative state blocks"),
        (
            vllm_config(attention(), mamba(num_prefill_checkpoint_blocks=1)),
            "prefill checkpoint blocks",
        ),
        (
            vllm_config(attention(), mamba(prefill_checkpoint_alignment=BLOCK)),
            "prefill checkpoint alignment",
        ),
        (vllm_config(attention(), mamba(mode="all")), "mamba_cache_mode 'all'"),
        # Prefix caching off: vLLM sizes a Mamba block to max_model_len ("none").
        (vllm_config(attention(), mamba(block_size=256, mode="none")), "several block sizes"),
        (vllm_config(attention(), mamba(), mamba(block_size=32)), "several block sizes"),
        (
            vllm_config(attention(), type("CrossAttentionSpec", (), {"block_size": BLOCK})()),
            "CrossAttentionSpec layers",
        ),
        (vllm_config(attention(), attention(block_size=32)), "several block sizes"),
        (vllm_config(attention(), hash_block_size=8), "hash block size"),
        (
            vllm_config(attention(SlidingWindowSpecV, sliding_window=32, extra_retained_tokens=4)),
            "SlidingWindowSpec layers",
        ),
    ],
)
def test_configs_outside_the_domain_are_refused_by_name(config: Any, feature: str) -> None:
    with pytest.raises(OutOfDomainError, match=feature) as caught:
        pagedkv_config(config)
    assert "PAGEDKV_VLLM=shadow" in str(caught.value)


@pytest.mark.parametrize(
    ("change", "feature"),
    [
        ({"kv_transfer_config": object()}, "KV connectors"),
        ({"scheduler.async_scheduling": True}, "asynchronous scheduling"),
        ({"parallel.pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"parallel.decode_context_parallel_size": 2}, "context parallelism"),
        ({"model.is_encoder_decoder": True}, "encoder-decoder"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"scheduler.watermark": 0.01}, "watermark"),
    ],
)
def test_engine_features_outside_the_domain(change: dict[str, Any], feature: str) -> None:
    assert list(config_refusals(engine_config(), replace=True)) == []
    refusals = list(config_refusals(engine_config(**change), replace=True))
    assert [feature in error.feature for error in refusals] == [True]


def test_kv_events_are_refused_by_replace_only() -> None:
    events = type("KVEventsConfig", (), {"enable_kv_cache_events": True})()
    config = engine_config(kv_events_config=events)
    assert [error.feature for error in config_refusals(config, replace=True)] == ["KV cache events"]
    assert list(config_refusals(config, replace=False)) == []


# -- traces recorded inside vLLM's engine --------------------------------------------------


@pytest.mark.parametrize("trace", [LLAMA_TRACE, GEMMA_TRACE], ids=lambda path: path.stem)
@pytest.mark.parametrize("side", ["impl", "spec"])
def test_engine_traces_replay_without_divergence(trace: Path, side: str) -> None:
    result = replay_trace(str(trace), side)
    assert (result.divergence, result.failure, result.recorded) == (None, None, [])
    _, calls = read_trace(str(trace))
    lines = list(calls)
    assert result.calls == len(lines) > 500
    counts = {call: sum(line["call"] == call for line in lines) for call in ("free", "reset")}
    assert counts["free"] >= 40 and counts["reset"] == 2
    new = [line["new"] for line in lines if "new" in line]
    assert any(identity["salt"] for identity in new) and any(i["logprobs"] for i in new)


@pytest.mark.parametrize("side", ["impl", "spec"])
def test_the_mamba_engine_trace_replays_without_divergence(side: str) -> None:
    """vLLM 0.32.0's engine on a Mamba hybrid: every step mirrored, Mamba states hit, requests
    preempted (freed unfinished), and pagedkv answers every call as vLLM did."""
    result = replay_trace(str(QWEN3_NEXT_TRACE), side)
    assert (result.divergence, result.failure, result.recorded) == (None, None, [])
    _, calls = read_trace(str(QWEN3_NEXT_TRACE))
    lines = list(calls)
    assert result.calls == len(lines) > 500
    assert sum(line["call"] == "step" for line in lines) > 50
    assert any(line["call"] == "zero" and line["vllm"] for line in lines)  # blocks to zero
    assert any(line["call"] == "lookup" and line["vllm"]["tokens"] for line in lines)
    assert any(line["call"] == "free" and not line["finished"] for line in lines)


def test_the_mamba_engine_trace_needs_vllm_0_32s_remarked_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `mamba_remarks_keyed_boundary`, pagedkv admits a hit that vLLM 0.32.0 defers:
    the state was keyed a step earlier, and re-registered by the step that moved past it."""
    semantics = dataclasses.replace(VLLM_0_32, mamba_remarks_keyed_boundary=False)
    monkeypatch.setitem(SEMANTICS_BY_NAME, "vllm-0.32", semantics)
    for side in ("impl", "spec"):
        result = replay_trace(str(QWEN3_NEXT_TRACE), side)
        assert result.divergence is not None, side
        assert (result.divergence.what, result.divergence.vllm) == ("new blocks", None)


def test_the_mamba_engine_trace_pins_the_blocks_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM zeroes the new attention blocks of a Mamba model, not its state blocks: a replayer
    that would hand over the Mamba group's new blocks too parts from vLLM's recorded answer."""
    original = Replayer.__init__

    def every_group(self: Replayer, manager: Any) -> None:
        original(self, manager)
        self._to_zero = {index: [] for index in range(len(self._specs()))}

    monkeypatch.setattr(Replayer, "__init__", every_group)
    result = replay_trace(str(QWEN3_NEXT_TRACE), "impl")
    assert result.divergence is not None and result.divergence.what == "blocks to zero"


@pytest.mark.parametrize(
    ("trace", "variant", "what"),
    [
        (LLAMA_TRACE, "forward_free", "free queue order"),
        (LLAMA_TRACE, "touch_keeps_queued", "usage"),
        (LLAMA_TRACE, "required_floor", "new blocks"),
        (LLAMA_TRACE, "no_last_block_rule", "hit tokens"),
        (LLAMA_TRACE, "salt_ignored", "hit tokens"),
        (GEMMA_TRACE, "hybrid_free_last_group_first", "new blocks"),
        (GEMMA_TRACE, "window_off_by_one", "new blocks"),
        (GEMMA_TRACE, "window_blocks_floor", "new blocks"),
        (GEMMA_TRACE, "no_last_block_rule", "shared-prefix boundary"),
    ],
)
def test_a_planted_bug_diverges_from_the_engine_trace(trace: Path, variant: str, what: str) -> None:
    with planted(VARIANTS_BY_NAME[variant]):
        result = replay_trace(str(trace), "impl")
    assert result.divergence is not None, f"{variant} went unnoticed"
    assert result.divergence.what == what


def test_verify_replays_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert verify_main(["--replay-trace", str(LLAMA_TRACE)]) == 0
    out = capsys.readouterr().out
    assert out.count("no divergence") == 2 and "vLLM 0.32.0, shadow mode" in out
    with planted(VARIANTS_BY_NAME["forward_free"]):
        assert verify_main(["--replay-trace", str(LLAMA_TRACE), "--trace-side", "impl"]) == 1
    assert "DIVERGENCE at call #" in capsys.readouterr().out
    not_a_trace = tmp_path / "x.jsonl"
    not_a_trace.write_text('{"format": "other"}\n')
    assert verify_main(["--replay-trace", str(not_a_trace)]) == EXIT_SETUP


# -- the shadow manager --------------------------------------------------------------------


@pytest.mark.parametrize("config", [ONE_GROUP, TWO_GROUPS], ids=["one group", "two groups"])
@pytest.mark.parametrize("side", ["impl", "spec"])
def test_shadow_agrees_and_changes_no_answer(config: Any, side: str, tmp_path: Path) -> None:
    alone = schedule(VllmStandIn(config), seed=7)
    shadow = shadow_around(VllmStandIn(config), config, tmp_path, side=side, strict=True)
    assert schedule(shadow, seed=7) == alone
    shadow.close()
    summary = json.loads((tmp_path / "report.json").read_text())
    assert shadow.active and summary["active"] and summary["divergences"] == []
    calls = summary["calls"]
    assert calls["lookup"] >= 24 and calls["free"] >= 24 and calls["snapshot"] > 10
    assert summary["unmirrored"]["record_prefix_cache_stats"] >= 24


@pytest.mark.parametrize("side", ["impl", "spec"])
def test_shadow_mirrors_a_mamba_hybrid(side: str, tmp_path: Path) -> None:
    """A full-attention group beside a gated-delta-net group in mode "align": every scheduler
    step is mirrored (`new_step_starts`), the answers and snapshots agree, and the prefix
    cache hit Mamba states."""
    alone = schedule(VllmStandIn(MAMBA_HYBRID), seed=7, chunk=BLOCK)
    vllm = VllmStandIn(MAMBA_HYBRID)
    shadow = shadow_around(vllm, MAMBA_HYBRID, tmp_path, side=side, strict=True)
    assert schedule(shadow, seed=7, chunk=BLOCK) == alone
    shadow.close()
    summary = json.loads((tmp_path / "report.json").read_text())
    assert shadow.active and summary["divergences"] == [] and summary["failures"] == []
    calls = summary["calls"]
    assert calls["step"] > 50 and calls["snapshot"] > 10 and calls["zero"] == calls["step"]
    stats = vllm.make_prefix_cache_stats()
    assert stats.hits > 0


def test_shadow_reports_a_planted_mamba_divergence(tmp_path: Path) -> None:
    """vLLM's stand-in adopts a hit on a Mamba state keyed in the same step (the planted
    `mamba_align_no_same_step_refusal`); the spec, told of every step, refuses it: a divergence
    whose trace replays offline."""
    vllm = VllmStandIn(MAMBA_HYBRID)
    shadow = shadow_around(vllm, MAMBA_HYBRID, tmp_path, side="spec")
    with planted(VARIANTS_BY_NAME["mamba_align_no_same_step_refusal"]):
        schedule(shadow, seed=7, chunk=BLOCK)
        summary = json.loads((tmp_path / "report.json").read_text())
        (divergence,) = summary["divergences"]
        replayed = replay_trace(divergence["trace"], "spec")
        assert str(replayed.divergence) == divergence["message"]
        assert replay_trace(divergence["trace"], "impl").divergence is None
    assert not shadow.active
    assert replay_trace(divergence["trace"], "impl").divergence is not None


def test_shadow_reports_a_planted_divergence_with_its_replay(tmp_path: Path) -> None:
    config = TWO_GROUPS
    vllm = VllmStandIn(config)  # "vLLM" is pagedkv's implementation with a bug planted
    shadow = shadow_around(vllm, config, tmp_path, side="spec")
    with planted(VARIANTS_BY_NAME["hybrid_free_last_group_first"]):
        finished = schedule(shadow, seed=3)
        assert len(finished) == 24  # vLLM's answers served the loop to the end
        assert not shadow.active
        summary = json.loads((tmp_path / "report.json").read_text())
        assert summary["active"] is False and len(summary["divergences"]) == 1
        divergence = summary["divergences"][0]
        assert divergence["message"].startswith("call #")
        # Offline, the spec parts from the recorded answers at the same call ...
        result = replay_trace(divergence["trace"], "spec")
        assert result.divergence is not None and str(result.divergence) == divergence["message"]
        assert result.recorded == [divergence["message"]]
        # ... and the implementation with the same bug reproduces every recorded answer.
        assert replay_trace(divergence["trace"], "impl").divergence is None
    assert replay_trace(divergence["trace"], "impl").divergence is not None


def test_strict_shadow_raises_at_the_divergence(tmp_path: Path) -> None:
    shadow = shadow_around(VllmStandIn(ONE_GROUP), ONE_GROUP, tmp_path, strict=True)
    with (
        planted(VARIANTS_BY_NAME["forward_free"]),
        pytest.raises(ShadowStoppedError, match=r"stopped at call #\d+"),
    ):
        schedule(shadow, seed=5)


def test_a_pagedkv_failure_never_reaches_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shadow = shadow_around(VllmStandIn(ONE_GROUP), ONE_GROUP, tmp_path, side="impl")
    manager = shadow._replayer.manager

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pagedkv broke")

    monkeypatch.setattr(manager, "allocate_slots", broken)
    assert len(schedule(shadow, seed=1)) == 24
    summary = json.loads((tmp_path / "report.json").read_text())
    assert summary["divergences"] == [] and len(summary["failures"]) == 1
    assert "RuntimeError: pagedkv broke" in summary["failures"][0]["message"]
    assert summary["off_reason"].startswith("failure:")


def test_a_call_outside_the_domain_stops_mirroring(tmp_path: Path) -> None:
    vllm = VllmStandIn(ONE_GROUP)
    vllm.pop_blocks_for_free = lambda request: []
    shadow = shadow_around(vllm, ONE_GROUP, tmp_path)
    request = VllmRequest("a", list(range(40)))
    shadow.get_computed_blocks(request)
    assert shadow.pop_blocks_for_free(request) == []  # vLLM's answer, served
    summary = json.loads((tmp_path / "report.json").read_text())
    assert not shadow.active
    assert (
        summary["off_reason"] == "out of domain: pop_blocks_for_free (pagedkv mirrors no such call)"
    )
    with pytest.raises(ShadowStoppedError, match="external"):
        served = VllmStandIn(ONE_GROUP)
        served.allocate_slots = lambda *args, **kwargs: None  # vLLM serves what pagedkv lacks
        strict = shadow_around(served, ONE_GROUP, tmp_path, strict=True)
        strict.allocate_slots(request, 8, num_external_computed_tokens=16)


# -- the façade ----------------------------------------------------------------------------


def test_facade_answers_in_vllms_shapes() -> None:
    facade = VllmStandIn(TWO_GROUPS)
    request = VllmRequest("a", list(range(70)))
    hits, num_tokens, boundary = facade.get_computed_blocks(request)
    assert hits is facade.empty_kv_cache_blocks and (num_tokens, boundary) == (0, 0)
    new = facade.allocate_slots(request, 70, 0, hits, full_sequence_must_fit=True)
    assert isinstance(new, KVCacheBlocks) and [len(ids) for ids in new.get_block_ids()] == [5, 5]
    assert facade.get_blocks("a").get_block_ids() == facade.get_block_ids("a")
    request.num_computed_tokens = 70
    assert facade.estimate_cached_tokens(request) == 64  # four full blocks, hashed
    assert (facade.take_events(), facade.take_new_block_ids()) == ([], [])
    assert facade.take_kv_cache_block_copies() == ([], [])
    assert facade.get_num_common_prefix_blocks("a") == [0, 0]
    facade.record_prefix_cache_stats(request, 0)
    stats = facade.make_prefix_cache_stats()
    assert (stats.requests, stats.queries) == (1, 70)
    assert facade.make_prefix_cache_stats().requests == 0
    with pytest.raises(OutOfDomainError, match="num_external_computed_tokens"):
        facade.allocate_slots(request, 1, num_external_computed_tokens=32)
    assert not hasattr(facade, "get_computed_blocks_for_connector")
    request.finished = True
    facade.free(request)
    assert facade.usage == 0.0 and facade.reset_prefix_cache()
    assert facade.make_prefix_cache_stats().reset


def test_facade_hands_vllms_workers_the_attention_blocks_to_zero() -> None:
    """With a Mamba group vLLM's `KVCacheConfig` needs new blocks zeroed: the façade hands
    over each new attention block once (the Mamba group's state blocks are not zeroed), and a
    replace run's steps go through its trace."""
    facade = VllmStandIn(MAMBA_HYBRID)
    facade.new_step_starts()
    request = VllmRequest("a", list(range(40)))
    new = facade.allocate_slots(request, BLOCK, full_sequence_must_fit=True)
    attention_ids, state_ids = new.get_block_ids()
    assert len(attention_ids) == len(state_ids) == 1
    assert facade.take_new_block_ids() == attention_ids
    assert facade.take_new_block_ids() == []
    request.num_computed_tokens = BLOCK
    facade.new_step_starts()
    second = facade.allocate_slots(request, BLOCK)
    assert facade.take_new_block_ids() == second.get_block_ids()[0] != []
    calls = [json.loads(line)["call"] for line in facade._sink._lines]
    assert calls.count("step") == 2
    plain = VllmStandIn(TWO_GROUPS)  # no zeroing without a Mamba group
    plain.allocate_slots(VllmRequest("b", list(range(40))), 40)
    assert plain.take_new_block_ids() == []


def test_shadow_counts_in_prometheus(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.REGISTRY
    labels = {"model_name": "test", "engine": "0"}

    def total(name: str) -> float:
        return sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    divergences = total("pagedkv_vllm_shadow_divergences_total")
    calls = total("pagedkv_vllm_shadow_calls_total")
    shadow = shadow_around(VllmStandIn(ONE_GROUP), ONE_GROUP, tmp_path, side="spec")
    assert registry.get_sample_value("pagedkv_vllm_shadow_active", labels) == 1
    with planted(VARIANTS_BY_NAME["forward_free"]):
        schedule(shadow, seed=5)
    summary = json.loads((tmp_path / "report.json").read_text())
    assert total("pagedkv_vllm_shadow_calls_total") == calls + summary["mirrored_calls"]
    assert total("pagedkv_vllm_shadow_divergences_total") == divergences + 1
    (divergence,) = summary["divergences"]
    by_kind = {"call": divergence["call"], "kind": divergence["kind"], **labels}
    assert registry.get_sample_value("pagedkv_vllm_shadow_divergences_total", by_kind) >= 1
    assert registry.get_sample_value("pagedkv_vllm_shadow_active", labels) == 0
