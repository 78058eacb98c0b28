"""The dashboard follows the front end's theme: JupyterLab light and dark, Notebook 7 dark,
and nbconvert's HTML light and dark. A cell with a failed rank, stderr lines and a chart;
in each, the contrast (WCAG 2) of the rows' states, the failed row's text on its tint and
the stderr lines, measured from the page's computed styles: at least 4.5:1 (AA).

One JupyterLab server and one browser for the module (and a Notebook 7 server for its
test). Screenshots in artifacts/; ``NBDDP_SCREENSHOTS=docs/img`` writes the docs' too.
Skipped as test_browser.py is.
"""

from __future__ import annotations

import os
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from browser_kit import ARTIFACTS, SKIPS, notebook_root, playwright, readable
from helpers import jupyter_server, open_notebook, run_all_cells, svg_of
from nbddp.dashboard.charts import WIDTH
from tiers import slow

pytestmark = [*SKIPS, slow]  # (the default run reads the dashboard in test_browser*)

CELLS = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import sys, time, nbddp\n"
    "for step in range(60):\n"
    "    nbddp.log_metrics({'loss': 1 / (1 + 0.1 * step + rank)}, step=step)\n"
    "print(f'hello from rank {rank}')\n"
    "for i in range(40):\n"
    "    print(f'line {i}')  # a log longer than its box\n"
    "print(f'a warning on rank {rank}', file=sys.stderr)\n"
    "print('train: 100%|##########| 10/10 [00:01<00:00,  9.81it/s]', file=sys.stderr)\n"
    "time.sleep(4)  # the live dashboard is looked at meanwhile\n"
    "if rank == 2:\n"
    "    raise ValueError('rank two is unhappy')",
]
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
expect = playwright.expect


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, token, notebook folder)."""
    tmp = tmp_path_factory.mktemp("theme")
    root = notebook_root(tmp, CELLS)
    with jupyter_server(tmp, root) as (base, token):
        yield base, token, root


@pytest.fixture(scope="module")
def tab(server, browser):
    """One page on JupyterLab's notebook for the module's tests, in order."""
    base, token, _ = server
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    open_notebook(page, f"{base}/lab/tree/dash.ipynb?token={token}")
    yield page
    page.close()


def set_theme(page, theme: str) -> None:
    page.evaluate(
        "t => { window.jupyterapp.commands.execute('apputils:change-theme', {theme: t}); }",
        THEMES[theme],
    )
    light = "true" if theme == "light" else "false"
    expect(page.locator(f"body[data-jp-theme-light='{light}']")).to_have_count(1, timeout=30_000)
    expect(page.locator(f"body[data-jp-theme-name='{THEMES[theme]}']")).to_have_count(1)


def check_live(cell, where: str) -> None:
    """While the cell runs: a running row, a stderr line and the chart's labels, readable;
    the chart on the theme's background."""
    live = cell.locator(".nbddp-dashboard.nbddp-live")
    expect(live.locator(".nbddp-row.nbddp-running")).to_have_count(4, timeout=120_000)
    stderr = live.locator(".nbddp-line.nbddp-stderr").first
    expect(stderr).to_contain_text("a warning on rank", timeout=30_000)
    expect(live.locator("svg.nbddp-chart")).to_have_count(1, timeout=30_000)
    running = live.locator(".nbddp-row.nbddp-running").first
    readable(running.locator("td").nth(0), f"{where}: a running row's rank")
    readable(running.locator("td").nth(1), f"{where}: `running`")
    readable(stderr, f"{where}: a stderr line in the live log")
    plain_bar(live, where)
    readable(live.locator("svg.nbddp-chart text").first, f"{where}: the live chart's title")
    chart_bg = live.locator("svg.nbddp-chart").evaluate("e => getComputedStyle(e).backgroundColor")
    assert chart_bg == "rgba(0, 0, 0, 0)", f"{where}: the chart paints its own background"
    # its size: its full size where the cell has room, else the cell's width
    room = live.bounding_box()["width"]
    width = live.locator("svg.nbddp-chart").bounding_box()["width"]
    assert round(width) == min(WIDTH, round(room)), f"{where}: a chart {width} wide in {room}"


BAR_COLOURS_JS = """pre => [getComputedStyle(pre).color, ...[...pre.querySelectorAll('span')]
  .filter(s => s.textContent.includes('train: 100%')).map(s => getComputedStyle(s).color)]"""


def plain_bar(log, where: str) -> None:
    """A tqdm bar (on stderr) in ``log`` has the log's own colour, not stderr's red."""
    pre = log.locator(".nbddp-pane pre").first  # the lines (live: the running bars below)
    expect(pre).to_contain_text("train: 100%|##########| 10/10")
    own, *bars = pre.evaluate(BAR_COLOURS_JS)
    assert all(c == own for c in bars), f"{where}: a tqdm bar shown as an error: {own} {bars}"


def check_frozen(frozen, where: str, dark: bool) -> None:
    """The finished cell: rank 2's failed row, the done rows, the failed rank's stderr
    lines, readable; the chart image inverted on a dark theme, on its background."""
    failed = frozen.locator(".nbddp-row.nbddp-failed")
    expect(failed).to_have_count(1)
    assert failed.get_attribute("data-rank") == "2"
    readable(failed.locator("td").nth(0), f"{where}: the failed row's rank")
    readable(failed.locator("td").nth(1), f"{where}: `failed` on its row")
    readable(failed.locator("td").nth(4), f"{where}: the failed row's last line")
    done = frozen.locator(".nbddp-row.nbddp-done")
    expect(done).to_have_count(3)
    readable(done.first.locator("td").nth(1), f"{where}: `done`")
    own = frozen.locator("details.nbddp-log[data-rank='2']")
    expect(own).to_have_attribute("open", "")
    readable(own.locator("pre span", has_text="a warning on rank 2"), f"{where}: a stderr line")
    readable(own.locator("summary"), f"{where}: a log's summary")
    plain_bar(own, where)
    # the log opens at its top (it opened scrolled to its end, its first lines cut)
    pane = own.locator(".nbddp-pane")
    scroll = pane.evaluate("e => [e.scrollTop, e.scrollHeight > e.clientHeight]")
    assert scroll == [0, True], f"{where}: the log's box opens scrolled: {scroll}"
    # the rank labels align left, as the live ones (a front end's tables align right)
    align = failed.locator("td").nth(0).evaluate("e => getComputedStyle(e).textAlign")
    assert align == "left", f"{where}: the frozen rank labels align {align}"
    image = frozen.locator("img.nbddp-chart")
    expect(image).to_have_count(1)
    assert "background" not in svg_of(image.get_attribute("src"))  # transparent paper
    drawn = image.evaluate("e => getComputedStyle(e).filter")
    inverted = "invert(1) hue-rotate(180deg)"
    assert (drawn == inverted) if dark else (drawn in ("none", "invert(0) hue-rotate(0deg)")), (
        f"{where}: the chart image's filter: {drawn}"
    )


def screenshot(page, cell, name: str) -> None:
    """The cell's outputs, into artifacts/ (and NBDDP_SCREENSHOTS, e.g. docs/img)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    cell.locator(".jp-Cell-outputArea").screenshot(path=str(path))
    target = os.environ.get("NBDDP_SCREENSHOTS")
    if target:
        folder = Path(target)
        folder = folder if folder.is_absolute() else ARTIFACTS.parent / folder
        shutil.copy(path, folder / name)


def run_and_check(page, where: str, dark: bool):
    """Run the notebook; check the live then the frozen dashboard; the frozen one."""
    run_all_cells(page)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
    check_live(cell, where)
    error = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    expect(error).to_contain_text("rank 2: ValueError: rank two is unhappy", timeout=120_000)
    expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]", timeout=60_000)
    frozen = cell.locator(".nbddp-summary")
    expect(frozen).to_have_count(1)
    expect(cell.locator(".nbddp-live")).to_have_count(0)
    check_frozen(frozen, where, dark)
    return cell


@pytest.mark.timeout(300)
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_jupyterlab_every_state_reads_at_wcag_aa_live_and_frozen(tab, theme):
    set_theme(tab, theme)
    cell = run_and_check(tab, f"JupyterLab {theme}", dark=theme == "dark")
    screenshot(tab, cell, f"theme-lab-{theme}.png")


def saved(page, root: Path) -> Path:
    """The notebook saved by the page, with the frozen dashboard in it."""
    page.evaluate("() => { window.jupyterapp.commands.execute('docmanager:save'); }")
    path = root / "dash.ipynb"
    expect(page.locator(".jp-mod-dirty")).to_have_count(0, timeout=30_000)
    assert "nbddp-summary" in path.read_text()
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_nbconvert_html_reads_at_wcag_aa(tab, server, browser, theme, tmp_path):
    from nbconvert import HTMLExporter

    if not tab.locator(".nbddp-summary").count():
        run_and_check(tab, "JupyterLab", dark=False)
    body, _ = HTMLExporter(template_name="lab", theme=theme).from_filename(saved(tab, server[2]))
    (tmp_path / "dash.html").write_text(body)
    page = browser.new_page()
    try:
        page.route(re.compile(r"^https?://"), lambda route: route.abort())  # no network
        page.goto((tmp_path / "dash.html").as_uri(), wait_until="domcontentloaded")
        frozen = page.locator(".nbddp-summary")
        expect(frozen).to_have_count(1)
        check_frozen(frozen, f"nbconvert {theme}", dark=theme == "dark")
        pre = frozen.locator("details.nbddp-log[data-rank='2'] pre")
        font = pre.evaluate("e => getComputedStyle(e).fontFamily")
        assert "mono" in font.lower(), f"the log's font: {font}"
        page.screenshot(path=str(ARTIFACTS / f"theme-nbconvert-{theme}.png"), full_page=True)
    finally:
        page.close()


@pytest.mark.timeout(300)
@pytest.mark.skipif(find_spec("notebook") is None, reason="needs notebook 7 (the browser extras)")
def test_notebook_7_dark_reads_at_wcag_aa_live_and_frozen(server, browser, tmp_path):
    _, _, root = server
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    with jupyter_server(tmp_path, root, app="notebook") as (base, token):
        try:
            open_notebook(page, f"{base}/notebooks/dash.ipynb?token={token}")
            assert page.evaluate("() => window.jupyterapp.name") == "Jupyter Notebook"
            set_theme(page, "dark")
            cell = run_and_check(page, "Notebook 7 dark", dark=True)
            screenshot(page, cell, "theme-notebook7-dark.png")
        finally:
            page.close()
