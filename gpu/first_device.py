"""The first run on a lent device, in one command (`bash gpu/first_device.sh OUT_DIR`).

Steps, each timed and recorded in OUT_DIR/first_device.json (plus the check's own report):

1. cubins: compile every kernel source for the device's arch into a fresh cache, check each
   image (ELF extent, `cuobjdump`/`nvdisasm` where installed), load it with `cupy.RawModule`
   and look up every kernel in it;
2. device tests: `pytest -m gpu tests/test_gpu_device.py` (kernels against the reference);
3. check: `pagedkv.gpu.check` (copy rate, every variant, every decode cell checked then timed,
   the write kernel), its table in OUT_DIR/check.txt for gpu/README.md.

`--dry-run` runs the same steps without a device: cubins are compiled for sm_90 and checked
but not loaded, the device tests skip, and the check runs its dry run. Exit status: 1 if a step
failed, else 2 if the check missed a target, else 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.gpu.cubin_image import check_cubin, cuda_tool
from pagedkv.gpu.kernel_variants import KERNEL_SOURCES

DRY_RUN_ARCH = 90
CHECK_REPEATS = 20
DEVICE_TEST_TIMEOUT_S = 180


def load_cubins(dry_run: bool) -> dict[str, Any]:
    """Build every source for the device's arch in the (fresh) cache, check, load, look up."""
    from pagedkv.gpu.kernel_loader import cubin_path

    arch = DRY_RUN_ARCH
    cupy: Any = None
    if not dry_run:
        from pagedkv.gpu.kernel_loader import import_cupy

        cupy = import_cupy()
        arch = int(cupy.cuda.Device(0).compute_capability)
    tools = {name: cuda_tool(name) for name in ("cuobjdump", "nvdisasm")}
    modules = []
    for source in KERNEL_SOURCES:
        path, names = cubin_path(source, arch)
        image = path.read_bytes()
        check_cubin(image, str(path))
        for name, tool in tools.items():
            if tool is not None:
                flag = ["-elf"] if name == "cuobjdump" else []
                subprocess.run([str(tool), *flag, str(path)], capture_output=True, check=True)
        loaded = 0
        if cupy is not None:
            module = cupy.RawModule(path=str(path))
            for symbol in names.values():
                module.get_function(symbol)
                loaded += 1
        modules.append(
            {
                "source": source.file_name,
                "bytes": len(image),
                "kernels": len(names),
                "loaded": loaded,
            }
        )
    return {
        "arch": arch,
        "tools": {name: str(tool) if tool else None for name, tool in tools.items()},
        "modules": modules,
        "passed": True,
    }


def device_tests() -> dict[str, Any]:
    """pytest over the device tests (they skip without a device)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command.append("tests/test_gpu_device.py")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=DEVICE_TEST_TIMEOUT_S, check=False
    )
    lines = result.stdout.strip().splitlines()
    return {
        "command": " ".join(command[1:]),
        "summary": lines[-1] if lines else "",
        "output_tail": "\n".join(lines[-40:]),
        "passed": result.returncode == 0,
    }


def run_check(out: Path, dry_run: bool) -> dict[str, Any]:
    """`pagedkv.gpu.check` into `out`; its exit status decides the step."""
    from pagedkv.gpu import check

    argv = ["--out", str(out), "--repeats", str(CHECK_REPEATS)]
    status = check.main([*argv, "--dry-run"] if dry_run else argv)
    return {"exit_status": status, "passed": status != 1, "target_met": status == 0}


def _step(name: str, run: Callable[[], dict[str, Any]], steps: dict[str, Any]) -> None:
    started = time.perf_counter()
    try:
        result = run()
    except Exception:  # record it and go on: later steps may still tell something
        result = {"passed": False, "error": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - started, 1)
    steps[name] = result
    verdict = "ok" if result["passed"] else "FAILED"
    sys.stdout.write(f"== {name}: {verdict} ({result['seconds']} s)\n")
    if "error" in result:
        sys.stdout.write(result["error"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the steps; return the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv.gpu.first_device")
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--dry-run", action="store_true", help="no device")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    steps: dict[str, Any] = {}
    _step("cubins", lambda: load_cubins(args.dry_run), steps)
    _step("device tests", device_tests, steps)
    _step("check", lambda: run_check(args.out, args.dry_run), steps)
    (args.out / "first_device.json").write_text(json.dumps(steps, indent=2) + "\n")
    if not all(step["passed"] for step in steps.values()):
        return 1
    return 0 if steps["check"]["target_met"] else 2


if __name__ == "__main__":
    sys.exit(main())
