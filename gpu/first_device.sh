#!/usr/bin/env bash
# The first command to run on a lent device (about 4-6 minutes on an H200; stop after 8):
#
#   bash gpu/first_device.sh OUT_DIR            # on the device: cubins, device tests, check
#   bash gpu/first_device.sh OUT_DIR --dry-run  # anywhere: the same steps without a device
#
# It needs no install: the package is laid out as a link tree of the repository's folders (the
# package-dir mapping of pyproject.toml), the kernel cache is fresh, and the image's python3
# (torch, cupy, pytest, numpy, ml-dtypes) runs `python -m pagedkv.gpu.first_device`.
# Exit status: that module's (0 everything passed, 1 a failure, 2 only a target missed).
set -uo pipefail
out=${1:?usage: bash gpu/first_device.sh OUT_DIR [--dry-run]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d)
mkdir -p "$tree/pagedkv"
for entry in "$repo"/impl/*; do ln -s "$entry" "$tree/pagedkv/"; done
ln -s "$repo/spec" "$tree/pagedkv/spec"
ln -s "$repo/gpu" "$tree/pagedkv/gpu"
ln -s "$repo/harness" "$tree/pagedkv/harness"
export PYTHONPATH="$tree:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PAGEDKV_KERNEL_CACHE="$tree/kernel-cache"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
[ -x "$repo/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$repo/.venv/bin/python"
cd "$repo"
timeout 480 "$python" -m pagedkv.gpu.first_device --out "$out" "$@"
status=$?
rm -rf "$tree"
exit $status
