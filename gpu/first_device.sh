#!/usr/bin/env bash
# The first command to run on a lent device (about 5 minutes on an H200; it stops itself at
# 7.5 and this script kills it at 8):
#
#   bash gpu/first_device.sh OUT_DIR            # on the device: device tool `run`, timeout_s=540
#   bash gpu/first_device.sh OUT_DIR --dry-run  # anywhere: the same steps without a device
#
# Every result lands in OUT_DIR/first_device.jsonl the moment it is measured, so a timeout
# keeps every finished line (`python -m pagedkv.gpu.first_device` has the steps). It installs
# nothing itself: the package is a link tree of this repository laid out by pyproject.toml's
# package-dir mapping (gpu/link_tree.py), the kernel cache is fresh, and missing Python
# packages pinned in constraints.txt are installed by the prerequisites step (torch never).
# Exit status: that module's (0 passed, 1 a failure, 2 only a target missed, 124 timed out).
set -uo pipefail
out=${1:?usage: bash gpu/first_device.sh OUT_DIR [--dry-run]}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
[ -x "$repo/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$repo/.venv/bin/python"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
"$python" "$repo/gpu/link_tree.py" "$repo" "$tree" || exit 1
export PYTHONPATH="$tree:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PAGEDKV_KERNEL_CACHE="${PAGEDKV_FIRST_DEVICE_CACHE:-$tree/kernel-cache}"
export PYTHONUNBUFFERED=1
limit=${PAGEDKV_FIRST_DEVICE_TIMEOUT_S:-480}
cd "$repo"
timeout --kill-after=10 "$limit" "$python" -m pagedkv.gpu.first_device --out "$out" "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "first_device: stopped at ${limit} s; finished results: $out/first_device.jsonl" >&2
fi
exit "$status"
