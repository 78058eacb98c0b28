#!/usr/bin/env bash
# Regenerate the example notebooks and execute them in place, saving their outputs.
# With names (scripts/run_notebooks.sh 05-failures.ipynb), only those.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python notebooks/make_notebooks.py "$@"
.venv/bin/python - "$@" <<'PY'
import sys
from pathlib import Path

import nbclient
import nbformat

here = str(Path.cwd()) + "/"
names = sys.argv[1:]
for path in sorted(Path("notebooks").glob("*.ipynb")):
    if names and path.name not in names:
        continue
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}
    ).execute()
    # finished dashboards are frozen to HTML: nbclient still records the closed
    # widgets' state, which no output refers to (JupyterLab saves live ones only)
    views = [
        o for c in nb.cells for o in c.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    if not views:
        nb.metadata.pop("widgets", None)
    # saved outputs name files relative to the checkout, not to this machine
    text = nbformat.writes(nb).replace(here, "")
    path.write_text(text)
    print("executed", path)
PY
