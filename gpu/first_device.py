"""The first run on a lent device, in one command (`bash gpu/first_device.sh OUT_DIR`).

A device session has one try and 8 minutes, so this run cannot lose what it measured: every
result is appended to OUT_DIR/first_device.jsonl the moment it exists (one JSON object per line,
fsynced: `result_log`), so a timeout, a crash or a kill keeps every finished line, and
OUT_DIR/first_device.json (the steps so far) is rewritten after each step. Steps, cheapest
first, the slowest last, under `--time-limit` seconds in all:

0. prerequisites: Python, numpy, torch (a CUDA build that sees the device), cupy (sees it
   too), ml_dtypes, pytest, the CUDA tools. A missing package pinned in the repository's
   constraints.txt is installed with `pip install -c constraints.txt` first; torch never is
   (the pin is the CPU build). Anything still missing stops the run here, loudly: the device
   tests would only skip.
1. cubins: every source compiled for the device's arch into the fresh kernel cache (in
   parallel), each image checked (ELF extent, `cuobjdump`, `nvdisasm`), loaded with
   `cupy.RawModule` and every kernel looked up; then the tensor-core decode loop's SASS
   instructions per key on that arch (`sass_count`).
2. occupancy: per attention kernel, CTAs per SM by CUDA's rules from its registers and shared
   memory (`occupancy`), the split policy's figure, and on a device the driver's own
   (`cuOccupancyMaxActiveBlocksPerMultiprocessor`, after the launcher's carveout and opt-in).
   Fails if the driver holds fewer CTAs than the split policy plans with.
3. device tests: `pytest tests/test_gpu_device.py --noconftest -W default` (a harmless warning
   from the device's torch or cupy is reported, not raised as pyproject's filterwarnings=error
   would); on a device, any skipped test fails the step.
4. check: `pagedkv.gpu.check` with its results appended to the same file as measured (copy
   rate, write bandwidth, every correctness case, then the decode table, slowest last) and the
   time left as its limit; its table goes to OUT_DIR/check.txt for gpu/README.md.

`--dry-run` runs the same steps without a device (cubins for sm_90, checked, not loaded; CPU
occupancy only; the device tests skip; the check's dry run) and installs nothing. Exit status:
1 if a step failed, else 2 if the check missed a target, else 0; 124 if stopped by SIGTERM
(the timeout), after writing what it had.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any
from xml.etree import ElementTree

from pagedkv.gpu.cubin_image import check_cubin, cuda_tool
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    ATTENTION_KERNELS,
    HEAD_SIZES,
    KERNEL_SOURCES,
    MMA_ATTENTION_SOURCE,
    MMA_DTYPES,
    KernelSource,
    attention_kernel_name,
    attention_source,
    attention_traits,
)
from pagedkv.gpu.result_log import Record, ResultLog

REPO = Path(__file__).resolve().parent.parent
DRY_RUN_ARCH = 90
CHECK_REPEATS = 20
TIME_LIMIT_S = 450.0
"""All steps together; gpu/first_device.sh kills the run at 480 s."""
PIP_TIMEOUT_S = 90
DEVICE_TEST_TIMEOUT_S = 180
RESERVE_S = 15.0
"""Kept back from each step's share of the time for the steps after it and the summary."""
PREREQUISITES: dict[str, str | None] = {
    "numpy": "numpy",
    "torch": None,
    "cupy": "cupy-cuda13x",
    "ml_dtypes": "ml-dtypes",
    "pytest": "pytest",
}
"""Module -> the package pinned in constraints.txt that pip may install (None: never here)."""


class Stopped(BaseException):
    """SIGTERM arrived (the timeout): stop, keep what was written."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Stopped


def _import(module: str) -> Any:
    """`importlib.import_module` (the prerequisite check's one way in, replaceable in tests)."""
    return importlib.import_module(module)


def _pip_install(packages: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """`pip install -c constraints.txt PACKAGES` with this interpreter, bounded in time.

    Raises:
        subprocess.TimeoutExpired: pip took longer than PIP_TIMEOUT_S.
    """
    constraints = str(REPO / "constraints.txt")
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "-c", constraints, *packages],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        check=False,
    )


def _module_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for module in PREREQUISITES:
        try:
            versions[module] = str(getattr(_import(module), "__version__", "?"))
        except Exception:  # an import error or a broken install: missing either way
            versions[module] = None
    return versions


def _device_info() -> dict[str, Any]:
    """What torch and cupy see (both must see the device for the device tests to run); the
    device's description is best effort: an error there is recorded, it decides nothing."""
    import cupy
    import torch

    info: dict[str, Any] = {
        "torch_cuda": torch.version.cuda,
        "torch_sees_device": torch.cuda.is_available(),
        "cupy_sees_device": bool(cupy.is_available()),
    }
    if info["torch_sees_device"] and info["cupy_sees_device"]:
        try:
            device = cupy.cuda.Device(0)
            info |= {
                "name": torch.cuda.get_device_name(0),
                "compute_capability": device.compute_capability,
                "sms": device.attributes["MultiProcessorCount"],
                "shared_per_sm": device.attributes["MaxSharedMemoryPerMultiprocessor"],
                "reserved_shared_per_cta": device.attributes.get("ReservedSharedMemoryPerBlock"),
                "driver": cupy.cuda.runtime.driverGetVersion(),
                "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            }
        except Exception as error:  # description only: record it, decide nothing on it
            info["description_error"] = repr(error)
    return info


def prerequisites(dry_run: bool, record: Record) -> dict[str, Any]:
    """Check (and on a device, install from constraints.txt) what the later steps need."""
    versions = _module_versions()
    missing = [module for module, version in versions.items() if version is None]
    installable = [PREREQUISITES[m] for m in missing if PREREQUISITES[m] is not None]
    result: dict[str, Any] = {"python": sys.version.split()[0], "modules": versions}
    if installable and not dry_run:
        packages = [str(package) for package in installable]
        try:
            pip = _pip_install(packages)
            result["pip"] = {
                "installed": packages,
                "command": " ".join(pip.args[1:]),
                "exit_status": pip.returncode,
                "output_tail": (pip.stdout + pip.stderr)[-2000:],
            }
        except subprocess.TimeoutExpired:
            result["pip"] = {"installed": packages, "exit_status": None, "timed_out": True}
        importlib.invalidate_caches()
        versions = result["modules"] = _module_versions()
        missing = [module for module, version in versions.items() if version is None]
    elif installable:
        result["would_install"] = installable
    result["missing"] = missing
    result["tools"] = {name: str(cuda_tool(name)) for name in ("cuobjdump", "nvdisasm")}
    problems = [f"{module} is not importable" for module in missing]
    problems += [f"{name} not found" for name, path in result["tools"].items() if path == "None"]
    if not missing:
        result["device"] = _device_info()
        if not dry_run and not (
            result["device"]["torch_sees_device"] and result["device"]["cupy_sees_device"]
        ):
            problems.append("torch or cupy sees no CUDA device: the device tests would skip")
    result["problems"] = problems
    result["passed"] = not problems
    record({"step": "prerequisites", **result})
    return result


def _arch(dry_run: bool) -> int:
    if dry_run:
        return DRY_RUN_ARCH
    import cupy

    return int(cupy.cuda.Device(0).compute_capability)


def cubins(dry_run: bool, record: Record) -> dict[str, Any]:
    """Build every source for the device's arch (in parallel), check, load, look up; then the
    decode loop's SASS instructions per key."""
    from pagedkv.gpu.kernel_loader import cubin_path
    from pagedkv.gpu.sass_count import disassemble, hot_loop, instructions_per_key

    arch = _arch(dry_run)
    tools = {name: cuda_tool(name) for name in ("cuobjdump", "nvdisasm")}

    def build(source: KernelSource) -> tuple[KernelSource, Path, dict[str, str], float]:
        started = time.monotonic()
        path, names = cubin_path(source, arch)
        return source, path, names, time.monotonic() - started

    modules = []
    with ThreadPoolExecutor(max_workers=len(KERNEL_SOURCES)) as pool:
        built = list(pool.map(build, KERNEL_SOURCES))
    for source, path, names, seconds in built:
        image = path.read_bytes()
        check_cubin(image, str(path))
        for name, tool in tools.items():
            if tool is not None:
                flag = ["-elf"] if name == "cuobjdump" else []
                subprocess.run([str(tool), *flag, str(path)], capture_output=True, check=True)
        loaded = 0
        if not dry_run:
            import cupy

            module = cupy.RawModule(path=str(path))
            for symbol in names.values():
                module.get_function(symbol)
                loaded += 1
        entry = {
            "source": source.file_name,
            "bytes": len(image),
            "kernels": len(names),
            "loaded": loaded,
            "compile_s": round(seconds, 1),
            "path": str(path),
        }
        modules.append(entry)
        record({"step": "cubins", **entry})
    _, mma_path, names, _ = next(item for item in built if item[0] is MMA_ATTENTION_SOURCE)
    functions = disassemble(mma_path)
    sass = {}
    for dtype in MMA_DTYPES:
        for head in HEAD_SIZES:
            traits = attention_traits(dtype, head, "mma")
            loop = hot_loop(functions[names[attention_kernel_name(dtype, head, "mma")]])
            tiles = loop.count("BAR") // 2
            per_key = instructions_per_key(loop, traits.threads // 32, tiles * traits.tile_tokens)
            sass[f"{dtype}/D{head}"] = round(per_key, 1)
            record(
                {
                    "step": "sass",
                    "arch": arch,
                    "kernel": f"mma/{dtype}/D{head}",
                    "loop_instructions": len(loop),
                    "tiles": tiles,
                    "per_key": round(per_key, 1),
                }
            )
    return {
        "arch": arch,
        "modules": modules,
        "sass_per_key": sass,
        "tools": {name: str(tool) if tool else None for name, tool in tools.items()},
        "passed": True,
    }


def occupancy(dry_run: bool, record: Record) -> dict[str, Any]:
    """CTAs per SM of every attention kernel: CUDA's rules on the CPU, the plan's, the driver's."""
    from pagedkv.gpu.attention_plan import H200
    from pagedkv.gpu.kernel_loader import cubin_path
    from pagedkv.gpu.launch import MAX_SHARED_CARVEOUT, OPT_IN_SHARED_BYTES
    from pagedkv.gpu.occupancy import SM80, SM90, ctas_per_sm
    from pagedkv.gpu.ptxas_usage import cubin_resources

    arch = _arch(dry_run)
    sm = SM90 if arch >= 90 else SM80
    limits = H200
    cupy: Any = None
    if not dry_run:
        from pagedkv.gpu.attention import device_limits
        from pagedkv.gpu.kernel_loader import import_cupy

        cupy = import_cupy()
        limits = device_limits(0)
    rows, short = [], []
    for kernel in ATTENTION_KERNELS:
        source = attention_source(kernel)
        path, names = cubin_path(source, arch)
        resources = cubin_resources(path, arch)
        module = cupy.RawModule(path=str(path)) if cupy is not None else None
        for dtype in ATTENTION_DTYPES:
            if kernel == "mma" and dtype not in MMA_DTYPES:
                continue
            for head in HEAD_SIZES:
                traits = attention_traits(dtype, head, kernel)
                symbol = names[attention_kernel_name(dtype, head, kernel)]
                registers, static = resources[symbol]
                cpu = ctas_per_sm(sm, traits.threads, registers, traits.smem_bytes, static)
                planned = limits.resident_ctas(traits.smem_bytes, traits.min_ctas_per_sm)
                row: dict[str, Any] = {
                    "kernel": f"{kernel}/{dtype}/D{head}",
                    "registers": registers,
                    "static_shared": static,
                    "dynamic_shared": traits.smem_bytes,
                    "launch_bound": traits.min_ctas_per_sm,
                    "planned": planned,
                    "cpu": cpu.ctas,
                    "cpu_limited_by": cpu.limited_by,
                    "device": None,
                }
                if module is not None:
                    try:
                        function = module.get_function(symbol)
                        function.preferred_shared_memory_carveout = MAX_SHARED_CARVEOUT
                        if traits.smem_bytes > OPT_IN_SHARED_BYTES:
                            function.max_dynamic_shared_size_bytes = traits.smem_bytes
                        row["device"] = int(
                            cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                                function.kernel.ptr, traits.threads, traits.smem_bytes
                            )
                        )
                        row["device_registers"] = int(function.num_regs)
                        row["device_static_shared"] = int(function.shared_size_bytes)
                    except Exception as error:  # record it; the other kernels still count
                        row["device_error"] = repr(error)
                    if row["device"] is None or row["device"] < planned:
                        short.append(row["kernel"])
                elif cpu.ctas < planned:
                    short.append(row["kernel"])
                rows.append(row)
                record({"step": "occupancy", "arch": arch, **row})
    return {"arch": arch, "kernels": rows, "fewer_than_planned": short, "passed": not short}


def device_tests(dry_run: bool, out: Path, timeout: float) -> dict[str, Any]:
    """pytest over tests/test_gpu_device.py; on a device no test may skip."""
    junit = out / "device_tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--noconftest",
        "-W",
        "default",
        f"--junitxml={junit}",
        "tests/test_gpu_device.py",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        root = ElementTree.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            counts = {key: int(suite.get(key, 0)) for key in counts}
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    warnings = re.search(r"(\d+) warnings?", summary)
    skips_fail = not dry_run and counts["skipped"] > 0
    return {
        "command": " ".join(command[1:]),
        **counts,
        "warnings": int(warnings.group(1)) if warnings else 0,
        "summary": summary,
        "output_tail": "\n".join(lines[-40:]) + result.stderr[-2000:],
        "passed": result.returncode == 0 and counts["tests"] > 0 and not skips_fail,
        "note": "skips fail on a device" if not dry_run else "no device: the tests skip",
    }


def run_check(out: Path, dry_run: bool, log: Path, time_limit: float) -> dict[str, Any]:
    """`pagedkv.gpu.check` into `out`, its results appended to `log` as measured."""
    from pagedkv.gpu import check

    argv = [
        "--out",
        str(out),
        "--repeats",
        str(CHECK_REPEATS),
        "--jsonl",
        str(log),
        "--time-limit",
        f"{max(time_limit, 0.0):.0f}",
    ]
    status = check.main([*argv, "--dry-run"] if dry_run else argv)
    return {"exit_status": status, "passed": status != 1, "target_met": status == 0}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the steps; return the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv.gpu.first_device")
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--dry-run", action="store_true", help="no device")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds in all")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = ResultLog(out / "first_device.jsonl")
    deadline = time.monotonic() + args.time_limit
    steps: dict[str, Any] = {}
    summary = out / "first_device.json"

    def save() -> None:
        temporary = summary.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(steps, indent=2, default=str) + "\n")
        os.replace(temporary, summary)

    def step(name: str, run: Callable[[], dict[str, Any]]) -> bool:
        started = time.monotonic()
        try:
            result = run()
        except Exception:  # record it and go on: later steps may still tell something
            result = {"passed": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.monotonic() - started, 1)
        steps[name] = result
        save()  # first: a step the log shows done is then always in the summary, even if killed
        log(
            {
                "step": name,
                "done": True,
                "passed": result["passed"],
                "seconds": result["seconds"],
                **({"error": result["error"]} if "error" in result else {}),
            }
        )
        sys.stdout.write(
            f"== {name}: {'ok' if result['passed'] else 'FAILED'} ({result['seconds']} s)\n"
        )
        return bool(result["passed"])

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    log(
        {
            "step": "start",
            "mode": "dry run" if args.dry_run else "device",
            "time_limit_s": args.time_limit,
            "argv": sys.argv,
        }
    )
    try:
        if not step("prerequisites", lambda: prerequisites(args.dry_run, log)):
            problems = steps["prerequisites"].get("problems") or [steps["prerequisites"]]
            sys.stderr.write("first_device: STOPPED, prerequisites missing:\n")
            sys.stderr.writelines(f"  - {problem}\n" for problem in problems)
            log({"step": "end", "exit_status": 1, "reason": "prerequisites missing"})
            return 1
        step("cubins", lambda: cubins(args.dry_run, log))
        step("occupancy", lambda: occupancy(args.dry_run, log))
        left = deadline - time.monotonic()
        step(
            "device tests",
            lambda: device_tests(
                args.dry_run, out, min(DEVICE_TEST_TIMEOUT_S, max(left - 2 * RESERVE_S, 1.0))
            ),
        )
        left = deadline - time.monotonic() - RESERVE_S
        step("check", lambda: run_check(out, args.dry_run, log.path, left))
    except Stopped:
        log({"step": "end", "exit_status": 124, "reason": "SIGTERM (the timeout)"})
        save()
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
    status = (
        1
        if not all(s["passed"] for s in steps.values())
        else (0 if steps["check"].get("target_met") else 2)
    )
    log({"step": "end", "exit_status": status})
    return status


if __name__ == "__main__":
    sys.exit(main())
