#!/usr/bin/env bash
# GPU check for the Triton path (docs/kernels.md). On a machine with an NVIDIA GPU and a CUDA
# build of torch, from anywhere:   benchmarks/gpu_check.sh [--json results.json]
#   1. the kernel tests (tests/kernels/triton_kernel_cases.py), compiled on the GPU, plus the
#      CUDA-graph decode test;
#   2. kernel timings (benchmarks/gpu_check.py): do_bench medians at chip-filling sizes,
#      achieved bandwidth against the measured device-to-device copy bandwidth;
#   3. `vlite bench throughput` on the default model, when this checkout has that command.
# Each part has its own time limit; the whole script stays under 5 minutes.
# Environment: PY (python, default .venv/bin/python), VLITE (default .venv/bin/vlite).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VLITE=${VLITE:-.venv/bin/vlite}
[ -x "$VLITE" ] || VLITE=vlite

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
export -n TRITON_INTERPRET 2>/dev/null; unset TRITON_INTERPRET  # compiled kernels, not the interpreter

status=0
echo "== 1/3 kernel tests on the GPU"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/triton_kernel_cases.py || { echo "kernel tests FAILED"; status=1; }

echo "== 2/3 kernel timings (triton.testing.do_bench, median)"
timeout 90 "$PY" benchmarks/gpu_check.py "$@" || { echo "timings FAILED (or accuracy check failed)"; status=1; }

echo "== 3/3 vlite bench throughput (default model)"
if "$VLITE" bench throughput --help >/dev/null 2>&1; then
    timeout 60 "$VLITE" bench throughput || { echo "vlite bench throughput FAILED"; status=1; }
else
    echo "skipped: this checkout has no 'vlite bench throughput' command"
fi
exit $status
