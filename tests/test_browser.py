"""The dashboard in a real browser: JupyterLab (and Notebook 7) on loopback, headless
Debian Chromium. Also the metric charts, live and frozen, and the README's picture
(scripts/screenshot.sh).

Skipped where /usr/bin/chromium, playwright or jupyterlab is missing; CI
installs all three (.ci/run). A screenshot is kept in artifacts/.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path

import nbformat
import pytest

from helpers import CHROMIUM, chromium, jupyter_server, open_notebook, run_all_cells, svg_of

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


def notebook_root(tmp_path, cells) -> Path:
    """A folder holding dash.ipynb with ``cells`` (and the python3 kernelspec: without it a
    "Select Kernel" dialog blocks the page and no kernel starts)."""
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, root / "dash.ipynb")
    return root


@pytest.fixture
def lab(tmp_path, request):
    """JupyterLab serving dash.ipynb (the cells: the test's parameter, else CELLS)."""
    root = notebook_root(tmp_path, getattr(request, "param", CELLS))
    with jupyter_server(tmp_path, root) as (base, token):
        yield f"{base}/lab/tree/dash.ipynb?token={token}", tmp_path


@pytest.fixture
def notebook7(tmp_path, request):
    """Notebook 7 (the ``notebook`` package) serving dash.ipynb."""
    root = notebook_root(tmp_path, request.param)
    with jupyter_server(tmp_path, root, app="notebook") as (base, token):
        yield f"{base}/notebooks/dash.ipynb?token={token}", tmp_path


@pytest.fixture
def browser(tmp_path):
    with chromium(tmp_path) as browser:
        yield browser


@pytest.fixture
def page(browser):
    return browser.new_page(viewport={"width": 1280, "height": 1000})


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


# -- live metric charts (nbddp.log_metrics)

METRICS = ("loss", "acc")


def metrics_cell(ranks: int, odd: int | None = None, pause: float = 0.014) -> str:
    """A cell whose ranks log ``loss`` and ``acc`` for 500 steps, ``pause`` seconds each
    (7 s: the live charts are looked at meanwhile); rank ``odd``'s loss is 5 times the
    others'."""
    loss = "base" if odd is None else f"base * (5 if rank == {odd} else 1)"
    return (
        f"%%ddp -n {ranks}\n"
        "import math, time, nbddp\n"
        "for step in range(500):\n"
        "    base = (1 + 0.02 * rank) * math.exp(-step / 150)"
        " + 0.01 * math.sin(step / 9 + rank)\n"
        f"    nbddp.log_metrics({{'loss': {loss}, 'acc': 1 - base / 2}}, step=step)\n"
        f"    time.sleep({pause})\n"
        "print('trained')"
    )


CELLS_METRICS = ["%load_ext nbddp", metrics_cell(4)]
CELLS_METRICS_16 = ["%load_ext nbddp", metrics_cell(16, odd=7, pause=0.016)]


def chart(scope, metric: str):
    """A live chart: inline SVG in the widget."""
    return scope.locator(f"svg.nbddp-chart[data-metric='{metric}']")


SVG = "{http://www.w3.org/2000/svg}"
DRAWN_JS = """async img => {
  try { await img.decode(); } catch (e) { return String(e); }
  return img.naturalWidth;
}"""


def frozen_chart(frozen, metric: str) -> tuple[object, ET.Element]:
    """A finished cell's chart: an ``<img>`` of its SVG (inline SVG would not survive the
    sanitizer of an untrusted notebook), visible and drawn. (Its locator, its SVG parsed.)"""
    image = frozen.locator(f"img.nbddp-chart[data-metric='{metric}']")
    playwright.expect(image).to_have_count(1)
    playwright.expect(image).to_be_visible()
    width = image.evaluate(DRAWN_JS)
    assert isinstance(width, int), f"the {metric} chart is not drawn: {width}"
    assert width > 0, f"the {metric} chart is not drawn: naturalWidth {width}"
    root = ET.fromstring(svg_of(image.get_attribute("src")))  # well-formed, or this raises
    assert root.tag == SVG + "svg"
    assert root.get("data-metric") == metric
    return image, root


def svg_class(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == cls]


def svg_texts(root: ET.Element) -> list[str]:
    return ["".join(e.itertext()) for e in root.iter(SVG + "text")]


def svg_points(element: ET.Element) -> int:
    return len(element.get("points").split())


def legend_values(root: ET.Element) -> dict[int, str]:
    """rank -> the value its legend entry says (``3: 0.04795``)."""
    return {
        int(m[1]): m[2] for text in svg_texts(root) if (m := re.fullmatch(r"(\d+): (\S+)", text))
    }


def logged(metric: str, rank: int, step: int = 499, odd: int | None = None) -> float:
    """The value metrics_cell's rank logs at ``step``."""
    base = (1 + 0.02 * rank) * math.exp(-step / 150) + 0.01 * math.sin(step / 9 + rank)
    if metric == "acc":
        return 1 - base / 2
    return base * (5 if rank == odd else 1)


def labels(lines) -> list[str]:
    return sorted(lines.evaluate_all("ls => ls.map(l => l.dataset.label)"))


def live_dashboard(cell):
    """The cell's live widget, once its charts are drawn while the cell runs."""
    live = cell.locator(".nbddp-dashboard.nbddp-live")
    playwright.expect(live.locator("svg.nbddp-chart")).to_have_count(2, timeout=120_000)
    playwright.expect(live.locator(".nbddp-status")).to_have_text("running")
    return live


def expect_redrawn_while_running(live, label: str) -> None:
    """The line ``label`` of the loss chart grows while the cell runs (redrawn each second)."""
    line = chart(live, "loss").locator(f"polyline[data-label='{label}']")
    before = line.get_attribute("points")
    playwright.expect(line).not_to_have_attribute("points", before, timeout=5_000)
    playwright.expect(live.locator(".nbddp-status")).to_have_text("running")


def frozen_dashboard(cell):
    """The cell's output once it ended: the frozen static HTML, no widget left."""
    expect = playwright.expect
    expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]", timeout=120_000)
    frozen = cell.locator(".jp-OutputArea-output[data-mime-type='text/html'] .nbddp-summary")
    expect(frozen).to_have_count(1)
    expect(cell.locator(".nbddp-live")).to_have_count(0)
    expect(cell.locator(".jupyter-widgets")).to_have_count(0)
    expect(frozen.locator("svg")).to_have_count(0)  # its charts are images: no inline SVG
    assert "Loading widget" not in cell.locator(".jp-Cell-outputArea").inner_text()
    return frozen


def expect_a_line_per_rank(scope, ranks: int, timeout: float = 5_000) -> None:
    """The live charts: a line per rank and metric."""
    for metric in METRICS:
        lines = chart(scope, metric).locator("polyline.nbddp-line")
        playwright.expect(lines).to_have_count(ranks, timeout=timeout)
        assert labels(lines) == sorted(f"rank {r}" for r in range(ranks))


def expect_every_step(root: ET.Element, last: int = 499) -> None:
    """The x axis (of a frozen chart's SVG) runs from step 0 to the last step logged."""
    texts = svg_texts(root)
    assert texts.count(str(last)) == 1, texts
    assert texts[texts.index(str(last)) - 1] == "0", texts  # the axis' first step, then last


def metrics_test(page, ranks: int = 4) -> None:
    """The 4-rank metrics cell (CELLS_METRICS) in an open front end: a line per rank and
    metric, live, then frozen into the cell's HTML with every point."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
    live = live_dashboard(cell)
    expect_a_line_per_rank(live, ranks, timeout=60_000)
    expect_redrawn_while_running(live, "rank 0")
    page.screenshot(path=str(ARTIFACTS / "metrics-live.png"), full_page=True)
    frozen = frozen_dashboard(cell)
    playwright.expect(frozen.locator(".nbddp-status")).to_have_text("done")
    playwright.expect(frozen).to_contain_text("[0-3] trained")
    playwright.expect(frozen.locator("img.nbddp-chart")).to_have_count(len(METRICS))
    for metric in METRICS:
        image, root = frozen_chart(frozen, metric)
        lines = svg_class(root, "nbddp-line")
        assert sorted(e.get("data-label") for e in lines) == [f"rank {r}" for r in range(ranks)]
        assert [svg_points(e) for e in lines] == [500] * ranks  # every step
        expect_every_step(root)
        # the legend gives each rank's latest value
        assert legend_values(root) == {r: f"{logged(metric, r):.4g}" for r in range(ranks)}
        alt = image.get_attribute("alt")
        assert alt.startswith(f"[ranks 0-{ranks - 1}] {metric} @ step 499: median "), alt


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_METRICS], indirect=True)
def test_four_ranks_logging_two_metrics_draw_a_line_per_rank_live_then_frozen(lab, page):
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        run_all(page, url)
        metrics_test(page)
    finally:
        page.screenshot(path=str(ARTIFACTS / "metrics.png"), full_page=True)


@pytest.mark.timeout(300)
@pytest.mark.skipif(find_spec("notebook") is None, reason="needs notebook 7 (the browser extras)")
@pytest.mark.parametrize("notebook7", [CELLS_METRICS], indirect=True)
def test_notebook_7_draws_the_live_charts_and_keeps_them_frozen(notebook7, page):
    url, _ = notebook7
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        open_notebook(page, url)  # Notebook 7 has no status bar: its app says when idle
        assert page.evaluate("() => window.jupyterapp.name") == "Jupyter Notebook"
        playwright.expect(page.locator("#top-panel")).to_be_visible()  # not JupyterLab
        run_all_cells(page)
        metrics_test(page)
    finally:
        page.screenshot(path=str(ARTIFACTS / "metrics-notebook7.png"), full_page=True)


def expect_band_with_rank_7_outlying(scope, timeout: float = 5_000) -> None:
    """Beyond 8 ranks: a min-max band and the median for each metric, no line per rank;
    rank 7's loss (5 times the others') as a line of its own, named in the legend."""
    expect = playwright.expect
    loss, acc = chart(scope, "loss"), chart(scope, "acc")
    for svg in (loss, acc):
        expect(svg.locator("polygon.nbddp-band")).to_have_count(1, timeout=timeout)
        expect(svg.locator("polyline.nbddp-median")).to_have_count(1)
        expect(svg.locator("polyline.nbddp-line")).to_have_count(0)
    outlier = loss.locator("polyline.nbddp-outlier")
    expect(outlier).to_have_count(1, timeout=timeout)
    expect(outlier).to_have_attribute("data-label", "rank 7")
    expect(loss).to_contain_text("outlying: rank 7 (")
    expect(loss).to_contain_text("median of ranks 0-6,8-15")
    expect(acc.locator("polyline.nbddp-outlier")).to_have_count(0)  # acc: no rank stands out
    expect(acc).not_to_contain_text("outlying")
    expect(acc).to_contain_text("median of ranks 0-15")


def frozen_band_with_rank_7_outlying(frozen) -> None:
    """expect_band_with_rank_7_outlying, of the frozen charts (images of their SVG)."""
    (loss_image, loss), (acc_image, acc) = (frozen_chart(frozen, m) for m in METRICS)
    for root in (loss, acc):
        assert len(svg_class(root, "nbddp-band")) == 1
        assert len(svg_class(root, "nbddp-median")) == 1
        assert svg_class(root, "nbddp-line") == []
        expect_every_step(root)
    (outlier,) = svg_class(loss, "nbddp-outlier")
    assert outlier.get("data-label") == "rank 7"
    assert svg_points(outlier) == 500  # every step
    legend = svg_texts(loss)
    assert f"outlying: rank 7 ({logged('loss', 7, odd=7):.4g})" in legend, legend
    assert "median of ranks 0-6,8-15, band min-max" in legend
    assert svg_class(acc, "nbddp-outlier") == []  # acc: no rank stands out
    assert not [t for t in svg_texts(acc) if "outlying" in t]
    assert "median of ranks 0-15, band min-max" in svg_texts(acc)
    assert loss_image.get_attribute("alt").endswith("; outlying: rank 7")
    assert acc_image.get_attribute("alt").startswith("[ranks 0-15] acc @ step 499: median ")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_METRICS_16], indirect=True)
def test_sixteen_ranks_draw_a_band_and_a_median_and_name_the_outlying_rank(lab, page):
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        cell = run_all(page, url)
        live = live_dashboard(cell)
        expect_band_with_rank_7_outlying(live, timeout=60_000)
        expect_redrawn_while_running(live, "median")
        page.screenshot(path=str(ARTIFACTS / "metrics-16-live.png"), full_page=True)
        frozen = frozen_dashboard(cell)
        frozen_band_with_rank_7_outlying(frozen)
    finally:
        page.screenshot(path=str(ARTIFACTS / "metrics-16.png"), full_page=True)


# -- the charts' SVG as a browser lays it out (charts_html of made-up lines: no server)


def made_up_charts(ranks: int, odd=(), name: str = "loss", scale: float = 1.0):
    """charts_html's input: ``ranks`` lines of 500 steps, ``odd`` ranks 5 times higher."""
    from array import array

    from nbddp.metric_store import Line

    lines = {}
    for rank in range(ranks):
        factor = scale * (5 if rank in odd else 1)
        values = [
            factor * ((1 + 0.02 * rank) * math.exp(-s / 150) + 0.01 * math.sin(s / 9 + rank))
            for s in range(500)
        ]
        line = lines[rank] = Line()
        line.extend(array("q", range(500)).tobytes(), array("d", values).tobytes())
    return [(("In [3]", name), lines)]


def laid_out(page, charts):
    """Each ``<text>`` of the charts: (text, left, right, chart width, top, bottom, chart
    height), in the chart's units."""
    from nbddp.charts import charts_html

    page.set_content("<body style='margin:8px'>" + charts_html(charts, "In [3]") + "</body>")
    return page.evaluate(
        """() => [...document.querySelectorAll('svg.nbddp-chart')].flatMap(svg =>
            [...svg.querySelectorAll(':scope > text')].map(t => {
              const box = t.getBBox(), view = svg.viewBox.baseVal;
              return [t.textContent, box.x, box.x + box.width, view.width,
                      box.y, box.y + box.height, view.height];
            }))"""
    )


@pytest.mark.parametrize(
    ("ranks", "odd", "scale"),
    [
        pytest.param(4, (), 1.0, id="4-ranks"),
        pytest.param(8, (), 1.0, id="8-ranks"),  # a legend longer than the chart is wide
        pytest.param(6, (), 12345.0, id="6-ranks-big-values"),  # long y labels and legend
        pytest.param(16, (7,), 1.0, id="16-ranks-one-outlier"),
        pytest.param(16, (3, 7, 12), 1.0, id="16-ranks-three-outliers"),
    ],
)
def test_every_label_of_a_chart_is_inside_it(browser, ranks, odd, scale):
    page = browser.new_page()
    texts = laid_out(page, made_up_charts(ranks, odd, scale=scale))
    assert len(texts) >= 6  # title, 4 axis labels, "step", the legend
    outside = [
        (t, round(a), round(b), round(top), round(bottom))
        for t, a, b, w, top, bottom, h in texts
        if a < 0 or b > w or top < 0 or bottom > h
    ]
    assert not outside, f"drawn outside the chart: {outside}"


def test_a_band_charts_x_axis_spans_the_steps_logged(browser):
    page = browser.new_page()
    texts = [t for t, *_ in laid_out(page, made_up_charts(16))]  # no outlier: the band alone
    assert "0" in texts
    assert "499" in texts


# -- the README's picture (scripts/screenshot.sh): a real dashboard, all four things in view

CELLS_SHOWCASE = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import math, time, torch.distributed as dist, nbddp\n"
    "for step in range(300):\n"
    "    loss = (1 + 0.1 * rank) * math.exp(-step / 70) + 0.03 * math.sin(step / 5 + 2 * rank)\n"
    "    nbddp.log_metrics({'loss': loss + 0.05}, step=step)\n"
    "    if step % 100 == 99:\n"
    "        mean = torch.tensor([loss])\n"
    "        dist.all_reduce(mean)\n"
    "        print(f'epoch {step // 100}: mean loss {mean.item() / world_size:.4f}')\n"
    "    time.sleep(0.01)\n"
    "if rank == 2:\n"
    "    raise OSError(28, 'No space left on device', f'/ckpt/shard-{rank}.pt')\n"
    "print('checkpoint saved')",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_SHOWCASE], indirect=True)
def test_screenshot_of_a_dashboard_with_a_folded_log_a_chart_and_a_failed_rank(lab, browser):
    """NBDDP_SCREENSHOT=docs/img/dashboard.png writes the README's picture there; without
    it, to artifacts/. The cell's output once it ended: the rows (rank 2 red), the loss of
    every rank, the folded log opened, the error."""
    expect = playwright.expect
    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    target = Path(os.environ.get("NBDDP_SCREENSHOT") or ARTIFACTS / "dashboard-showcase.png")
    if not target.is_absolute():
        target = ARTIFACTS.parent / target
    page = browser.new_page(viewport={"width": 1000, "height": 1400}, device_scale_factor=2)
    try:
        cell = run_all(page, url)
        page.evaluate(
            "() => { window.jupyterapp.commands.execute('application:toggle-left-area'); }"
        )
        frozen = frozen_dashboard(cell)
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        expect(error).to_contain_text("rank 2: OSError: [Errno 28] No space left on device")
        # the rows: rank 2 failed, red, the others done
        expect(frozen.locator(".nbddp-row")).to_have_count(4)
        failed = frozen.locator(".nbddp-row.nbddp-failed")
        expect(failed).to_have_count(1)
        assert failed.get_attribute("data-rank") == "2"
        assert failed.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(253, 231, 231)"
        expect(frozen.locator(".nbddp-row.nbddp-done")).to_have_count(3)
        # the loss of every rank: drawn, a line each, none red (a failed rank's colour)
        loss, root = frozen_chart(frozen, "loss")
        lines = svg_class(root, "nbddp-line")
        assert [e.get("data-label") for e in lines] == [f"rank {r}" for r in range(4)]
        assert [svg_points(e) for e in lines] == [300] * 4
        assert "#d62728" not in [e.get("stroke").lower() for e in lines]
        # the folded log: closed when a rank failed; opened for the picture
        everyone = frozen.locator("details.nbddp-log-all")
        everyone.locator("summary").click()
        log = everyone.locator(".nbddp-pane")
        for epoch in range(3):
            expect(log).to_contain_text(f"[0-3] epoch {epoch}: mean loss")
        expect(log).to_contain_text("[0-1,3] checkpoint saved")
        expect(log).to_be_visible()
        own = frozen.locator("details.nbddp-log[data-rank='2']")  # open, as a failed rank's
        expect(own).to_have_attribute("open", "")
        own.locator("summary").click()  # closed: the error shows below anyway
        outputs = cell.locator(".jp-Cell-outputArea")
        for shown in (failed, loss, log, error):
            expect(shown).to_be_in_viewport()
        box = outputs.bounding_box()  # the outputs, not the empty prompt column left of them
        left = outputs.locator(".jp-OutputArea-output").first.bounding_box()["x"] - 8
        clip = {
            **box,
            "x": left,
            "width": box["x"] + box["width"] - left,
            "height": box["height"] + 8,
        }
        page.screenshot(path=str(target), clip=clip)
        print(f"screenshot: {target}")
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-showcase-page.png"), full_page=True)
