"""What pagedkv's vLLM plugin costs on vLLM's own engine: paired runs on the tiny local models.

    ./dev bench vllm_engine [--models llama gemma3] [--rounds 3] [--requests 200]

For each model and each plugin mode (shadow, replace), `--rounds` rounds; a round is one engine
run of mode off and one of the mode, in fresh processes (`python -m
pagedkv.harness.vllm_engine.run` in `.venv-vllm`), the order alternating from round to round so
that drifts in machine load fall on both. Every ratio is taken within a round and its median
over rounds reported:

- tokens per second: generated tokens per wall second of `LLM.generate` (engine start-up is not
  counted), mode over off: below 1, the mode is slower;
- scheduler CPU per step: the thread CPU time of vLLM's `Scheduler.schedule` and
  `Scheduler.update_from_output` in the engine core, over the scheduler's steps, measured by the
  probe (`pagedkv.harness.vllm_engine.probe`, which wraps just those two methods). Every call
  the scheduler makes on its KV cache manager happens inside them, so in replace mode this is
  pagedkv's manager against vLLM's own, and in shadow mode vLLM's manager plus the mirroring.

Each run also checks what it measured: both runs of a round generate the same tokens (replace
and shadow must not change any), and shadow mode reports no divergence.

Nothing here imports vLLM: the runs are subprocesses of `--python` (default `.venv-vllm`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.harness.vllm_engine.run import compare_outputs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@dataclass
class Round:
    """One round's two runs, reduced to what is compared."""

    first: str
    off_tokens_per_s: float
    mode_tokens_per_s: float
    off_sched_us_per_step: float
    mode_sched_us_per_step: float
    off_steps: int
    mode_steps: int

    @property
    def tokens_ratio(self) -> float:
        return self.mode_tokens_per_s / self.off_tokens_per_s

    @property
    def sched_ratio(self) -> float:
        return self.mode_sched_us_per_step / self.off_sched_us_per_step


@dataclass
class Comparison:
    """Off against one mode on one model, over rounds."""

    model: str
    mode: str
    rounds: list[Round] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(float(getattr(r, name)) for r in self.rounds)


def scheduler_us_per_step(result: dict[str, Any]) -> float:
    """Thread CPU microseconds of the scheduler's two methods per step (the probe's)."""
    probe = result["probe"]
    cpu_s = float(probe["schedule_cpu_s"]) + float(probe["update_cpu_s"])
    return 1e6 * cpu_s / int(probe["steps"])


def engine_run(
    python: Path, model: str, mode: str, requests: int, out: Path, models_dir: Path
) -> dict[str, Any]:
    """One run of the runner in a fresh process; its JSON."""
    command = [
        str(python),
        "-m",
        "pagedkv.harness.vllm_engine.run",
        f"--model={model}",
        f"--mode={mode}",
        f"--requests={requests}",
        f"--models-dir={models_dir}",
        f"--out={out}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def check_round(off: dict[str, Any], other: dict[str, Any]) -> None:
    """Both runs generated the same tokens; a shadow run reported no divergence."""
    comparison = compare_outputs(off["outputs"], other["outputs"])
    if not comparison.equal:
        raise AssertionError(f"{other['model']} {other['mode']}: {comparison.detail}")
    plugin = other.get("plugin") or {}
    if other["mode"] == "shadow" and (plugin.get("divergences") or plugin.get("failures")):
        raise AssertionError(f"{other['model']} shadow diverged: {plugin}")
    if other["mode"] != "off" and not other["probe"]["manager_class"].startswith("pagedkv."):
        raise AssertionError(f"{other['mode']}: the plugin did not take the scheduler's manager")


def measure(
    python: Path,
    models: Sequence[str],
    modes: Sequence[str],
    rounds: int,
    requests: int,
    models_dir: Path,
) -> list[Comparison]:
    """Every (model, mode) comparison, `rounds` rounds each (see the module's docstring)."""
    comparisons: list[Comparison] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-engine-") as scratch:
        for model in models:
            for mode in modes:
                comparison = Comparison(model, mode)
                for index in range(rounds):
                    order = ("off", mode) if index % 2 == 0 else (mode, "off")
                    results = {
                        which: engine_run(
                            python,
                            model,
                            which,
                            requests,
                            Path(scratch) / f"{which}.json",
                            models_dir,
                        )
                        for which in order
                    }
                    off, other = results["off"], results[mode]
                    check_round(off, other)
                    comparison.rounds.append(
                        Round(
                            first=order[0],
                            off_tokens_per_s=off["tokens_per_s"],
                            mode_tokens_per_s=other["tokens_per_s"],
                            off_sched_us_per_step=scheduler_us_per_step(off),
                            mode_sched_us_per_step=scheduler_us_per_step(other),
                            off_steps=off["probe"]["steps"],
                            mode_steps=other["probe"]["steps"],
                        )
                    )
                    print(
                        f"  {model} {mode} round {index + 1}: tokens/s off "
                        f"{off['tokens_per_s']:.0f}, {mode} {other['tokens_per_s']:.0f}; "
                        f"scheduler CPU/step off {scheduler_us_per_step(off):.0f} us, "
                        f"{mode} {scheduler_us_per_step(other):.0f} us",
                        flush=True,
                    )
                comparisons.append(comparison)
    return comparisons


def report(comparisons: Sequence[Comparison], rounds: int, requests: int) -> str:
    lines = [
        f"vLLM engine cost of the plugin: {requests} requests a run, {rounds} paired rounds, "
        "medians of per-round ratios (mode / off)",
        f"{'model':8} {'mode':8} {'tokens/s':>9} {'ratio':>6}  "
        f"{'sched us/step':>13} {'off':>6} {'ratio':>6}  steps",
    ]
    for c in comparisons:
        lines.append(
            f"{c.model:8} {c.mode:8} {c.median('mode_tokens_per_s'):9.0f} "
            f"{c.median('tokens_ratio'):6.3f}  {c.median('mode_sched_us_per_step'):13.0f} "
            f"{c.median('off_sched_us_per_step'):6.0f} {c.median('sched_ratio'):6.2f}  "
            f"{c.rounds[0].mode_steps}"
        )
    lines.append("every round: the same tokens in both runs; shadow: no divergence")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", type=Path, default=DEFAULT_PYTHON, help="with vLLM")
    parser.add_argument("--models", nargs="+", default=["llama", "gemma3"])
    parser.add_argument("--modes", nargs="+", default=["shadow", "replace"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--models-dir", type=Path, default=ROOT / "build" / "vllm-models")
    parser.add_argument("--out", type=Path, help="also write the rounds as JSON")
    args = parser.parse_args(argv)
    if not args.python.exists():
        print(f"no {args.python}: ./dev setup --vllm makes it", file=sys.stderr)
        return 2
    started = time.perf_counter()
    comparisons = measure(
        args.python, args.models, args.modes, args.rounds, args.requests, args.models_dir
    )
    print(report(comparisons, args.rounds, args.requests))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(c) for c in comparisons], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
