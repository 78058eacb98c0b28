"""The dashboard in a real browser: JupyterLab on loopback, headless Debian Chromium.

Skipped where /usr/bin/chromium, playwright or jupyterlab is missing; CI
installs all three (.ci/run). A screenshot is kept in artifacts/.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from helpers import free_port

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent.parent / "artifacts"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
    pytest.mark.skipif(
        shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None,
        reason="needs jupyterlab (pip install -e '.[browser]')",
    ),
]
playwright = pytest.importorskip("playwright.sync_api", reason="needs playwright")

CELLS = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import sys, time, torch.distributed as dist\n"
    "print(f'hello from rank {rank}')\n"
    "print(f'a warning on rank {rank}', file=sys.stderr)\n"
    "t = torch.ones(1)\n"
    "if rank == 2:\n"
    "    time.sleep(4)  # the live dashboard is looked at meanwhile\n"
    "    raise ValueError('rank two is unhappy')\n"
    "dist.all_reduce(t)",
]


# 16 ranks: the same lines fold into one, rank 7 fails before the collective
CELLS_16 = [
    "%load_ext nbddp",
    "%%ddp -n 16\n"
    "import time, torch.distributed as dist\n"
    "for epoch in range(3):\n"
    "    print(f'epoch {epoch} loss 0.25')\n"
    "t = torch.ones(1)\n"
    "if rank == 7:\n"
    "    time.sleep(4)  # the live dashboard is looked at meanwhile\n"
    "    raise ValueError('rank seven is unhappy')\n"
    "dist.all_reduce(t)",
]


@pytest.fixture
def lab(tmp_path, request):
    root = tmp_path / "root"
    root.mkdir()
    cells = getattr(request, "param", CELLS)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, root / "dash.ipynb")
    env = dict(os.environ)
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ):
        env[var] = str(tmp_path / sub)
    labconfig = tmp_path / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp_path / "lab.log", "wb")  # noqa: SIM115  (closed in the finally below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LanguageServerManager.autodetect=False",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer in 60 s"
                time.sleep(0.2)
        yield f"{base}/lab/tree/dash.ipynb?token={token}", tmp_path
    finally:
        proc.terminate()  # the server shuts its kernels (and so the pool) down
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


@pytest.fixture
def page(tmp_path):
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
    )
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--disable-gpu", "--disable-quic"], env=env
        )
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 1000})
        finally:
            browser.close()


def run_all(page, url: str):
    """Open the notebook, wait for its kernel, run every cell; the %%ddp cell's locator."""
    page.goto(url)
    playwright.expect(
        page.locator(".jp-StatusBar-TextItem", has_text="Python 3 (ipykernel) | Idle")
    ).to_be_visible(timeout=90_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page.locator(".jp-Notebook .jp-Cell").nth(1)


@pytest.mark.timeout(300)
def test_a_rank_of_four_failing_before_a_collective_ends_the_cell_with_its_row_red(lab, page):
    expect = playwright.expect
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        cell = run_all(page, url)
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        # while it runs: the live widget, a row per rank, every rank's lines in the first tab
        live = cell.locator(".nbddp-dashboard")
        expect(live).to_be_visible(timeout=120_000)
        expect(live.locator(".nbddp-row")).to_have_count(4)
        expect(live.locator(".nbddp-row.nbddp-running")).not_to_have_count(0)
        for rank in range(4):
            expect(live.locator(".nbddp-pane:visible")).to_contain_text(
                f"[{rank}] hello from rank {rank}"
            )
        page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
        expect(error).to_contain_text("rank 2: ValueError: rank two is unhappy", timeout=120_000)
        expect(error).to_contain_text(
            "ranks 0, 1, 3: freed from a collective (all_reduce) after rank 2 failed"
        )
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")  # it ended
        ranks = cell.locator(".nbddp-ranks")  # each row ends with the rank's last line
        for rank in range(4):
            expect(ranks).to_contain_text(f"rank {rank}")
        failed = cell.locator(".nbddp-row.nbddp-failed")
        expect(failed).to_have_count(1)
        assert failed.get_attribute("data-rank") == "2"
        background = failed.evaluate("e => getComputedStyle(e).backgroundColor")
        assert background == "rgb(253, 231, 231)"
        expect(cell.locator(".nbddp-row.nbddp-freed")).to_have_count(3)
        # the failed rank's pane is the one open, and shows its lines, stderr apart
        pane = cell.locator(".nbddp-pane:visible")
        expect(pane).to_contain_text("hello from rank 2")
        expect(pane.locator("span", has_text="a warning on rank 2")).to_have_css(
            "color", "rgb(183, 28, 28)"
        )
        assert "Loading widget" not in cell.locator(".jp-Cell-outputArea").inner_text()
        # the finished dashboard is frozen: static HTML, no widget view left
        expect(cell.locator(".nbddp-summary")).to_have_count(1)
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)
        # the "all ranks" log interleaves every rank, labelled
        everyone = cell.locator("details.nbddp-log-all")
        everyone.locator("summary").click()
        for rank in range(4):
            expect(everyone.locator(".nbddp-pane")).to_contain_text(
                f"[{rank}] hello from rank {rank}"
            )
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_16], indirect=True)
def test_sixteen_ranks_fold_their_lines_and_the_failed_rank_stands_out(lab, page):
    expect = playwright.expect
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        cell = run_all(page, url)
        live = cell.locator(".nbddp-dashboard.nbddp-live")
        expect(live).to_be_visible(timeout=120_000)
        # 48 lines from 16 ranks are three folded lines
        pane = live.locator(".nbddp-pane")
        for epoch in range(3):
            expect(pane).to_contain_text(f"[0-15] epoch {epoch} loss 0.25")
        expect(pane.locator(".nbddp-line")).to_have_count(3)
        # one rank's log, picked from the list
        live.locator("select.nbddp-choose").select_option("7")
        expect(pane).to_contain_text("epoch 2 loss 0.25")
        expect(pane).not_to_contain_text("[0-15]")
        page.screenshot(path=str(ARTIFACTS / "dashboard-16-live.png"), full_page=True)
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        expect(error).to_contain_text("rank 7: ValueError: rank seven is unhappy", timeout=120_000)
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        failed = cell.locator(".nbddp-row.nbddp-failed")
        expect(failed).to_have_count(1)
        assert failed.get_attribute("data-rank") == "7"
        expect(cell.locator(".nbddp-row.nbddp-freed")).to_have_count(15)
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)  # frozen
        everyone = cell.locator("details.nbddp-log-all")
        expect(everyone).to_contain_text("all ranks log (3 lines)")
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-16.png"), full_page=True)


CELLS_PDB = [
    "%load_ext nbddp",
    "%%ddp -n 3\nx = rank * 10\nif rank == 1:\n    breakpoint()\n    y = x + 1\n"
    "print('after', rank)",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_PDB], indirect=True)
def test_a_breakpoint_in_a_rank_asks_in_the_cells_input_box(lab, page):
    expect = playwright.expect
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        cell = run_all(page, url)
        box = cell.locator(".jp-Stdin-input")
        expect(box).to_be_visible(timeout=120_000)
        expect(cell.locator(".jp-Stdin-prompt")).to_contain_text("(Pdb rank 1)")
        expect(cell.locator(".nbddp-row.nbddp-debugging")).to_have_count(1)  # the dashboard
        expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("-> y = x + 1")
        box.fill("p x")
        box.press("Enter")
        outputs = cell.locator(".jp-Cell-outputArea")
        expect(outputs).to_contain_text("10")
        page.screenshot(path=str(ARTIFACTS / "debugger.png"), full_page=True)
        expect(cell.locator(".jp-Stdin-input")).to_have_count(2)  # the next line's box
        box = cell.locator(".jp-Stdin-input").last
        expect(box).to_be_visible()
        box.fill("c")
        box.press("Enter")
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]", timeout=60_000)
        expect(cell.locator(".nbddp-row.nbddp-done")).to_have_count(3)
        expect(cell.locator(".jp-Stdin-input")).to_have_count(2)  # two lines, no third box
    finally:
        page.screenshot(path=str(ARTIFACTS / "debugger-end.png"), full_page=True)


# rank 2 of 4 kills itself while the others wait for it in all_reduce; the cell after it
CELLS_REPLACED = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import os, signal, time, torch.distributed as dist\n"
    "kept = rank * 10\n"
    "t = torch.ones(1)\n"
    "print(f'ready on rank {rank}')\n"
    "if rank == 2:\n"
    "    time.sleep(2)  # the others wait in all_reduce meanwhile\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "dist.all_reduce(t)",
    "%%ddp\n"
    "import torch.distributed as dist\n"
    "t = torch.ones(1) * (rank + 1)\n"
    "dist.all_reduce(t)\n"
    "print(f'sum {t.item():g}')\n"
    "print(f\"kept {globals().get('kept')}\")",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_REPLACED], indirect=True)
def test_a_rank_of_four_killed_in_a_collective_is_replaced_and_the_next_cell_runs(lab, page):
    expect = playwright.expect
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        cell = run_all(page, url)  # "Run all" stops at the cell's error
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        expect(error).to_contain_text("rank 2 died (killed by SIGKILL)", timeout=120_000)
        expect(error).to_contain_text(
            "ranks 0, 1, 3: freed from a collective (all_reduce) after rank 2 died; state kept"
        )
        expect(error).to_contain_text("rank 2: a new process took its place; it had ")
        expect(error).to_contain_text("the process group was re-formed with the new rank 2")
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        # the dashboard: rank 2's row red and saying it has a new process, the others freed
        dead = cell.locator(".nbddp-row.nbddp-replaced")
        expect(dead).to_have_count(1)
        assert dead.get_attribute("data-rank") == "2"
        expect(dead).to_contain_text("dead: new process")
        assert dead.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(253, 231, 231)"
        freed = cell.locator(".nbddp-row.nbddp-freed")
        expect(freed).to_have_count(3)
        assert sorted(freed.nth(i).get_attribute("data-rank") for i in range(3)) == ["0", "1", "3"]
        for i in range(3):
            expect(freed.nth(i)).to_contain_text("freed")
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)  # frozen
        # the next cell, run by hand: all 4 ranks, the survivors' state kept
        cells = page.locator(".jp-Notebook .jp-Cell")
        after = cells.nth(2)
        after.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Enter")  # run it, add no cell below
        expect(after.locator(".nbddp-row.nbddp-done")).to_have_count(4, timeout=60_000)
        expect(after.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        expect(after.locator(".jupyter-widgets")).to_have_count(0)
        log = after.locator("details.nbddp-log-all .nbddp-pane")
        expect(log).to_contain_text("[0-3] sum 10")
        for rank, kept in enumerate(["0", "10", "None", "30"]):
            expect(log).to_contain_text(f"[{rank}] kept {kept}")
        stderr = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        expect(after.locator(stderr)).to_have_count(0)  # no error, no note of lost state
        # the picture (docs/img/replaced-rank.png): the notebook alone, both cells whole
        page.evaluate(
            "() => { window.jupyterapp.commands.execute('application:toggle-left-area'); }"
        )
        expect(page.locator(".jp-DirListing")).to_be_hidden()
        page.set_viewport_size({"width": 1100, "height": 1500})
        panel = page.locator(".jp-NotebookPanel").bounding_box()
        first, last = cells.nth(0).bounding_box(), after.bounding_box()
        top, bottom = first["y"] - 10, last["y"] + last["height"] + 10
        clip = {"x": panel["x"], "y": top, "width": panel["width"], "height": bottom - top}
        page.screenshot(path=str(ARTIFACTS / "replaced-rank-notebook.png"), clip=clip)
    finally:
        page.screenshot(path=str(ARTIFACTS / "replaced-rank.png"), full_page=True)
