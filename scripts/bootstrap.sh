#!/usr/bin/env bash
# Set up .venv with nbddp (editable) and its test tools.
# torch is installed only when the venv cannot import it, pinned to 2.13.0
# (on a machine without CUDA wheels this is the CPU build); pyproject.toml
# itself accepts torch>=2.13 (the oldest release tested: scripts/torch_versions.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | { grep -v "^WARNING: Location" || true; }
.venv/bin/python -c "import nbddp, torch; print('nbddp', nbddp.__version__, 'torch', torch.__version__)"
