"""Front ends where the live widget cannot render: the frozen dashboard alone.

A notebook whose 4 ranks log metrics is executed by nbclient (a real kernel) and saved.
Its cell output must read without widgets: text/html with the charts as SVG images
(``<img src='data:image/svg+xml;base64,...'>``, the summary line as alt text) and a
text/plain summary (not "Loading widget", not a model id). Then what nbviewer shows
(nbconvert's HTML exporter, the page opened in Chromium), and what JupyterLab and
Notebook 7 show when they open the saved notebook without running it (no live widget
model; the notebook is not trusted, so its HTML is sanitized: inline SVG would not
survive, images do). Last, JupyterLab without a widget manager running such a cell: the
static summary beside the widget view while it runs, the frozen one after.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.util import find_spec

import nbclient
import nbformat
import pytest

from helpers import (
    CHROMIUM,
    WIDGET_MANAGER,
    frozen_charts,
    ipc_kernel_manager,
    jupyter_server,
    open_notebook,
    python3_notebook,
    run_all_cells,
    svg_of,
)
from nbddp.dashboard.charts import HEIGHT, WIDTH
from tiers import slow

CELLS = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import math, nbddp\n"
    "for step in range(100):\n"
    "    loss = (1 + 0.1 * rank) * math.exp(-step / 30)\n"
    "    nbddp.log_metrics({'loss': loss, 'acc': 1 - loss / 2}, step=step)\n"
    "print(f'hello from rank {rank}')",
    "%ddp stop",
]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
METRICS = ("loss", "acc")
SVG = "{http://www.w3.org/2000/svg}"
RANK_LINES = [f"rank {r}" for r in range(4)]


def rank_lines(svg: str, metric: str) -> list[str]:
    """The labels of the line per rank of a chart's SVG (which must parse, as XML)."""
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg"
    assert root.get("data-metric") == metric
    return [
        e.get("data-label") for e in root.iter(SVG + "polyline") if e.get("class") == "nbddp-line"
    ]


def summaries(text: str) -> dict[str, str]:
    """metric -> its summary line in a cell's text/plain."""
    return {
        metric: line
        for line in text.splitlines()
        for metric in METRICS
        if line.startswith(f"[ranks 0-3] {metric} @ step ")
    }


DRAWN_JS = """async img => {
  try { await img.decode(); } catch (e) { return {error: String(e)}; }
  return {width: img.naturalWidth, height: img.naturalHeight, alt: img.alt,
          src: img.getAttribute('src')};
}"""


def drawn_charts(scope, count: int = len(METRICS)) -> list[dict]:
    """The chart images in ``scope`` (a playwright locator or page), each visible and
    drawn (decoded, naturalWidth > 0): its natural size, alt text, laid-out box and SVG."""
    from playwright.sync_api import expect

    images = scope.locator("img.nbddp-chart")
    expect(images).to_have_count(count)
    out = []
    for i in range(count):
        image = images.nth(i)
        expect(image).to_be_visible()
        drawn = image.evaluate(DRAWN_JS)
        assert "error" not in drawn, f"chart {i} not drawn: {drawn}"
        assert drawn["width"] > 0, drawn
        box = image.bounding_box()
        drawn["box"] = (round(box["width"]), round(box["height"]))
        drawn["svg"] = svg_of(drawn.pop("src"))
        out.append(drawn)
    return out


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook, executed by nbclient and saved: (path, its %%ddp cell's display output)."""
    tmp = tmp_path_factory.mktemp("static")
    nb = python3_notebook(CELLS)
    saved = os.environ.copy()
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    os.environ["IPYTHONDIR"] = str(tmp / "ipython")
    try:
        nbclient.NotebookClient(
            nb,
            km=ipc_kernel_manager(tmp),
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp)}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    path = tmp / "metrics.ipynb"
    nbformat.write(nb, path)
    shown = [o for o in nb.cells[1].outputs if o.output_type == "display_data"]
    assert len(shown) == 1, nb.cells[1].outputs
    return path, shown[0]


@pytest.mark.kernel
def test_the_saved_output_is_chart_images_and_a_readable_summary_not_a_widget(executed):
    path, output = executed
    data = output.data
    assert set(data) == {"text/plain", "text/html"}  # the widget view was replaced
    html = data["text/html"]
    assert "nbddp-summary" in html
    assert "<svg" not in html  # no inline SVG: a sanitizer strips it
    charts = frozen_charts(html)
    assert list(charts) == list(METRICS), html[:500]
    said = summaries(data["text/plain"])
    for metric, (alt, svg) in charts.items():
        assert rank_lines(svg, metric) == RANK_LINES
        assert alt == said[metric]  # the alt text: the chart's summary line
    assert "[0-3] hello from rank {0-3}" in html  # lines that differ in numbers fold
    for rank in range(4):
        assert f"hello from rank {rank}" in html
    text = data["text/plain"]
    assert text.startswith("nbddp: 4 ranks, done\n")
    for rank in range(4):
        assert f"  rank {rank}: done  hello from rank {rank}" in text
    assert re.search(r"\[ranks 0-3\] loss @ step 99: median \S+, min \S+ \(rank 0\)", text)
    assert re.search(r"\[ranks 0-3\] acc @ step 99: median", text)
    assert "Loading widget" not in text
    assert not re.search(r"[0-9a-f]{32}", text)  # no model id
    saved = nbformat.read(path, as_version=4)
    views = [
        o for c in saved.cells for o in c.get("outputs", []) if WIDGET_VIEW in o.get("data", {})
    ]
    assert views == []


@pytest.mark.kernel
def test_nbconvert_html_as_nbviewer_renders_it_holds_the_charts(executed, tmp_path, request):
    path, _ = executed
    subprocess.run(
        [
            sys.executable,
            "-m",
            "nbconvert",
            "--to",
            "html",
            str(path),
            "--output-dir",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=120,
        env=dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config")),
    )
    page = (tmp_path / "metrics.html").read_text()  # (re-serialized: "" quotes)
    assert not re.search(r"<svg[^>]*nbddp-chart", page)  # images, not inline SVG
    charts = frozen_charts(page)
    assert list(charts) == list(METRICS)
    said = summaries(executed[1].data["text/plain"])
    for metric, (alt, svg) in charts.items():
        assert rank_lines(svg, metric) == RANK_LINES
        assert alt == said[metric]
    assert f'<script type="{WIDGET_VIEW}">' not in page  # no widget view to embed
    assert "Loading widget" not in page
    if os.path.exists(CHROMIUM):  # and drawn by a browser
        from playwright.sync_api import expect

        tab = request.getfixturevalue("browser").new_page()
        try:
            # no network: the template's CDN scripts (require.js, MathJax) fail at once
            tab.route(re.compile(r"^https?://"), lambda route: route.abort())
            tab.goto((tmp_path / "metrics.html").as_uri(), wait_until="domcontentloaded")
            expect(tab.locator(".nbddp-summary")).to_have_count(1)
            for metric, drawn in zip(METRICS, drawn_charts(tab), strict=True):
                assert (drawn["width"], drawn["height"]) == (WIDTH, HEIGHT)
                assert drawn["box"] == (WIDTH, HEIGHT)
                assert drawn["alt"] == said[metric]
                assert rank_lines(drawn["svg"], metric) == RANK_LINES
            tab.screenshot(path=str(tmp_path / "nbconvert.png"), full_page=True)
        finally:
            tab.close()


@pytest.fixture(
    scope="module", params=["jupyterlab", pytest.param("notebook", marks=slow)], ids=["lab", "nb7"]
)
def saved_view(request, executed, browser, tmp_path_factory):
    """The saved notebook opened, not run, in JupyterLab or Notebook 7: its %%ddp cell's
    text/html output. No widget model exists; the notebook is not trusted."""
    app = request.param
    if find_spec(app) is None:
        pytest.skip(f"needs {app} (the browser extras)")
    tmp = tmp_path_factory.mktemp(f"saved-{app}")
    path, _ = executed
    root = tmp / "root"
    root.mkdir()
    (root / "metrics.ipynb").write_bytes(path.read_bytes())
    route = "lab/tree" if app == "jupyterlab" else "notebooks"
    with jupyter_server(tmp, root, app=app) as (base, token):
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            open_notebook(page, f"{base}/{route}/metrics.ipynb?token={token}")
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            yield page, cell.locator(".jp-OutputArea-output[data-mime-type='text/html']")
        finally:
            page.screenshot(path=str(tmp / "saved.png"), full_page=True)
            page.close()


@pytest.mark.e2e
def test_a_front_end_opening_the_saved_notebook_shows_the_frozen_dashboard(saved_view):
    from playwright.sync_api import expect

    page, html = saved_view
    expect(html).to_have_count(1)
    assert "jp-mod-trusted" not in (html.get_attribute("class") or "")  # sanitized
    expect(html.locator("tr")).to_have_count(4)  # a row per rank
    for rank in range(4):
        expect(html.locator("tr").nth(rank)).to_contain_text(f"rank {rank}")
    expect(html).to_contain_text("4 of 4 ranks")
    expect(html).to_contain_text("all ranks log (1 line)")
    # the logs in a monospace font, though the sanitizer drops the theme's code font
    font = html.locator(".nbddp-pane pre").first.evaluate("e => getComputedStyle(e).fontFamily")
    assert "mono" in font.lower(), font
    shown = page.locator(".jp-Notebook").inner_text()
    assert "Loading widget" not in shown
    assert "Error displaying widget" not in shown


@pytest.mark.e2e
def test_a_front_end_opening_the_saved_notebook_draws_the_frozen_charts(saved_view, executed):
    """The charts are images (inline SVG does not pass the sanitizer of an untrusted
    notebook): drawn, a line per rank, the summary line as alt text."""
    _, html = saved_view
    said = summaries(executed[1].data["text/plain"])
    for metric, drawn in zip(METRICS, drawn_charts(html), strict=True):
        assert (drawn["width"], drawn["height"]) == (WIDTH, HEIGHT)
        assert drawn["box"] == (WIDTH, HEIGHT)
        assert rank_lines(drawn["svg"], metric) == RANK_LINES
        assert drawn["alt"] == said[metric]
    assert html.locator("svg").count() == 0  # nothing inline that the sanitizer cut
    assert "steprank 0rank 1" not in html.inner_text()  # no chart shown as its bare text


# -- a front end without a widget manager: JupyterLab with ipywidgets' extension turned off

CELLS_RUNNING = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import math, time, nbddp\n"
    "for step in range(100):\n"
    "    loss = (1 + 0.1 * rank) * math.exp(-step / 30)\n"
    "    nbddp.log_metrics({'loss': loss, 'acc': 1 - loss / 2}, step=step)\n"
    "    time.sleep(0.06)  # 6 s: the output is looked at while it runs\n"
    "print(f'hello from rank {rank}')",
]

NO_WIDGETS_JS = """() => window.jupyterapp.listPlugins().filter(id => id.startsWith('WM'))"""


@slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None,
    reason="needs jupyterlab (pip install -e '.[browser]')",
)
def test_a_front_end_without_a_widget_manager_shows_the_static_summary_then_the_frozen_one(
    tmp_path, browser
):
    """The cell's output carries text/html beside the widget view: a front end that cannot
    draw the widget shows that while the cell runs (not "Loading widget...", not an error,
    not a model id), then the frozen summary with the charts drawn."""
    from playwright.sync_api import expect

    root = tmp_path / "root"
    root.mkdir()
    nb = python3_notebook(CELLS_RUNNING)
    nbformat.write(nb, root / "plain.ipynb")
    server = jupyter_server(tmp_path, root, disabled=(WIDGET_MANAGER,))
    with server as (base, token):
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            open_notebook(page, f"{base}/lab/tree/plain.ipynb?token={token}")
            # no widget manager in this JupyterLab: none of ipywidgets' plugins is there
            assert page.evaluate(NO_WIDGETS_JS.replace("WM", WIDGET_MANAGER)) == []
            run_all_cells(page)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            outputs = cell.locator(".jp-Cell-outputArea")
            html = cell.locator(".jp-OutputArea-output[data-mime-type='text/html']")
            summary = html.locator(".nbddp-summary")
            # while it runs: the static summary, the header and a row per rank
            expect(summary).to_be_visible(timeout=120_000)
            expect(cell.locator(".jp-InputArea-prompt")).to_contain_text("[*]")  # running
            expect(summary.locator(".nbddp-header")).to_contain_text("nbddp")
            expect(summary.locator(".nbddp-header")).to_contain_text("4 of 4 ranks")
            expect(summary.locator(".nbddp-status")).to_have_text("running")
            expect(summary.locator("tr.nbddp-row")).to_have_count(4)
            for rank in range(4):
                expect(summary.locator("tr.nbddp-row").nth(rank)).to_contain_text(f"rank {rank}")
            page.screenshot(path=str(tmp_path / "no-widgets-running.png"), full_page=True)
            shown = outputs.inner_text()
            assert "Loading widget" not in shown
            assert "Error displaying widget" not in shown
            assert "No renderer" not in shown
            assert not re.search(r"[0-9a-f]{32}", shown), shown  # no raw model id
            expect(cell.locator(".jupyter-widgets, .nbddp-live")).to_have_count(0)
            expect(html).to_have_count(1)
            assert "[*]" in cell.locator(".jp-InputArea-prompt").inner_text()  # still running
            # after: the frozen summary in its place, the charts drawn
            expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]", timeout=120_000)
            expect(summary.locator(".nbddp-status")).to_have_text("done")
            expect(html).to_have_count(1)  # updated in place
            expect(summary).to_contain_text("all ranks log (1 line)")
            expect(summary).to_contain_text("[0-3] hello from rank {0-3}")
            for metric, drawn in zip(METRICS, drawn_charts(summary), strict=True):
                assert (drawn["width"], drawn["height"]) == (WIDTH, HEIGHT)
                assert rank_lines(drawn["svg"], metric) == RANK_LINES
                assert drawn["alt"].startswith(f"[ranks 0-3] {metric} @ step 99: median ")
            stderr = "[data-mime-type='application/vnd.jupyter.stderr']"
            expect(cell.locator(stderr)).to_have_count(0)
            shown = outputs.inner_text()
            assert "Loading widget" not in shown
            assert "Error displaying widget" not in shown
            assert not re.search(r"[0-9a-f]{32}", shown), shown
        finally:
            page.screenshot(path=str(tmp_path / "no-widgets.png"), full_page=True)
            page.close()
