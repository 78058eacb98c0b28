"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient)."""

from __future__ import annotations

import re
from pathlib import Path

import nbclient
import nbformat
import pytest

from helpers import ipc_kernel_manager
from tiers import slow

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
# notebooks for a framework need it installed: pip install -e ".[frameworks]" (.ci/run does)
REQUIRES = {
    "06-folded-output.ipynb": "tqdm",
    "10-accelerate.ipynb": "accelerate",
    "11-lightning.ipynb": "lightning",
    "12-transformers.ipynb": "transformers",
}

# what a notebook's outputs must show (regular expressions), besides running
SHOWS = {
    "06-folded-output.ipynb": [  # folded lines with their values, and folded bars
        r"\[ranks 0-3\] rank \{0-3\} epoch 1 loss \{[\d.]+\.\.[\d.]+, (max|min) rank \d\}",
        r"\[ranks 0-3\] eval: 100%\|.*\| 20/20",
        r"\[0-3\] eval: 100%\|.*\| 30/30",
        r"\[ranks 0-3\] epoch 1 finished",
    ],
}

pytestmark = pytest.mark.kernel


QUICKSTART = "01-quickstart.ipynb"  # the default run's notebook; the slow tier runs every one


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.name, marks=() if p.name == "01-quickstart.ipynb" else slow)
        for p in NOTEBOOKS
    ],
)
def test_notebook_runs_without_errors(path, tmp_path, monkeypatch):
    if path.name in REQUIRES:
        pytest.importorskip(REQUIRES[path.name], reason='needs pip install -e ".[frameworks]"')
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        km=ipc_kernel_manager(tmp_path),
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError on any untagged error
    code = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        expected = "raises-exception" in cell.metadata.get("tags", [])
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert bool(errors) == expected, cell.source
    outputs = [o for c in code for o in c.outputs]
    shown = "".join(o.get("text", "") + o.get("data", {}).get("text/html", "") for o in outputs)
    assert "rank 0" in shown
    assert "rank 1" in shown
    for pattern in SHOWS.get(path.name, []):
        assert re.search(pattern, shown), pattern


def test_saved_notebooks_carry_their_outputs_with_static_dashboards():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert sum(bool(c.outputs) for c in code) >= len(code) // 2, path.name
        ddp = [c for c in code if c.source.startswith("%%ddp") and "--text" not in c.source]
        for cell in ddp:  # readable without a kernel: the summary beside the widget
            bundles = [o.data for o in cell.outputs if o.output_type == "display_data"]
            assert any("nbddp-summary" in b.get("text/html", "") for b in bundles), cell.source
