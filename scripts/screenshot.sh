#!/usr/bin/env bash
# Retake the README's picture, docs/img/dashboard.png (or the path given): a real 4-rank
# dashboard in JupyterLab in headless Chromium (the folded log, the loss of every rank,
# rank 2 failed), cropped to the cell's output. Needs /usr/bin/chromium and the browser
# extras (pip install -e ".[test,browser]").
set -euo pipefail
cd "$(dirname "$0")/.."
export NBDDP_SCREENSHOT="${1:-docs/img/dashboard.png}"
timeout 900 .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/test_browser.py \
    -k test_screenshot_of_a_dashboard
