#!/usr/bin/env bash
# One command for a machine with a GPU (issue 36): the GPU tier (pytest -m cuda) and the GPU
# benchmarks, in at most 8 minutes on one GPU (each part has a time limit: 270 + 150 + 45 s);
# a summary table, and JSON in $OUT (if set) else benchmarks/results/gpu-check/.
#
#   bash scripts/gpu_check.sh            # PYTHON=python3 by default
#
# Packages the machine lacks travel as wheels in .whl/ (docs/contributing.md says how to
# fetch them); they are installed in /tmp/site first. Exits 2 when something is missing,
# else pytest's status (0: every GPU test passed or was skipped for a reason it names).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RESULTS="${OUT:-benchmarks/results/gpu-check}"
mkdir -p "$RESULTS"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_check: the wheels in .whl/ did not install"; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' || exit 2
import importlib.util, sys
need = ["torch", "numpy", "IPython", "ipykernel", "ipywidgets", "anywidget", "cloudpickle",
        "psutil", "cryptography", "jupyter_client", "pytest", "pytest_timeout"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} "
             "(carry them as wheels in .whl/: docs/contributing.md)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU is visible here")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0)}")
EOF

start=$(date +%s)
# the GPU tier: every test marked cuda (the 2+-GPU ones skip on one GPU, saying so)
timeout 270 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 240 \
    --junitxml="$RESULTS/gpu-tier.xml" \
    tests/pool/test_cuda.py tests/pool/test_cuda_shared.py tests/pool/test_cuda_kernel.py tests/notebook/test_api.py \
    2>&1 | tee "$RESULTS/gpu-tier.log"
tier=${PIPESTATUS[0]}

# the benchmarks: a DDP step in the pool vs torchrun (NCCL at 1 rank, gloo sharing the GPU at
# 2 and 4), and the trivial-cell round trip at 1, 2 and 4 ranks
timeout 150 "$PY" benchmarks/bench_step.py --device cuda --ranks 1 2 4 --steps 50 --repeat 3 \
    --json "$RESULTS/gpu-step.json" 2>&1 | tee "$RESULTS/gpu-step.log"
step=${PIPESTATUS[0]}
timeout 45 "$PY" benchmarks/bench_core.py --ranks 1 2 4 --repeat 100 --round-trip-only \
    --json "$RESULTS/gpu-round-trip.json" 2>&1 | tee "$RESULTS/gpu-round-trip.log"
trip=${PIPESTATUS[0]}

"$PY" benchmarks/gpu_summary.py "$RESULTS" --seconds $(( $(date +%s) - start )) \
    --status tier="$tier" step="$step" round_trip="$trip"
exit "$tier"
