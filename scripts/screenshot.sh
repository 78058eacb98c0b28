#!/usr/bin/env bash
# Retake the README's picture, docs/img/dashboard.png, and docs/img/folded-bar.png: a real
# 4-rank training cell in JupyterLab in headless Chromium (the folded log with each rank's
# loss, a folded tqdm bar live, the loss of every rank), cropped to the cell's output.
# Needs /usr/bin/chromium and the browser extras (pip install -e ".[test,browser]").
set -euo pipefail
cd "$(dirname "$0")/.."
export NBDDP_SCREENSHOT=1
timeout 900 .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/dashboard/test_browser.py \
    -k test_a_training_cell_shows_one_folded_bar
