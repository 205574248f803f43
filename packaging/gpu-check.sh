#!/usr/bin/env bash
# The GPU check (issue 32): from a clean copy of the repository on a GPU machine without
# network, install llmlocal offline, build its native extension, run the CUDA tests and the
# Triton kernels compiled, build a random-weight model of Qwen2.5-1.5B's shape there, and run
# plan, a memory measurement and bench decode / batch / spec on CUDA. A table comes last;
# the full log and the figures go to $OUT if set (gpu-check.log, gpu-check.json).
#
#   bash packaging/make-gpu-wheelhouse.sh     # first, where PyPI is reachable: packaging/wheelhouse/
#   bash packaging/gpu-check.sh               # on the GPU machine, the wheelhouse taken along
#   bash packaging/gpu-check.sh --dry-run     # anywhere: the same steps on the CPU, tiny shapes,
#                                             # nothing installed (what CI runs; the default without CUDA)
#
# It installs into the environment of $PYTHON (default python3, on the GPU machines the one
# that holds torch). The whole check ends within --deadline seconds (default 470); every step
# has its own cap too, and one that fails or hangs is reported while the rest go on. Other
# options: `python3 packaging/gpu_check.py --help`. Exit status: 0 when no step failed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}

if ! command -v "$python" >/dev/null 2>&1; then
  echo "gpu-check: '$python' is not on PATH: set PYTHON to the interpreter that holds torch." >&2
  exit 2
fi
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  echo "gpu-check: '$python' cannot import torch: set PYTHON to the interpreter that holds it." >&2
  exit 2
fi

cd "$repo"
exec "$python" "$repo/packaging/gpu_check.py" --repo "$repo" --python "$(command -v "$python")" "$@"
