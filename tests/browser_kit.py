"""What the browser tests share: the notebook they open, running it, and reading the
dashboard's charts (live inline SVG, frozen images). Importing it skips the importing
module where playwright is missing; ``SKIPS`` are the other marks every browser test
module carries."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from helpers import CHROMIUM, python3_notebook, svg_of

ARTIFACTS = Path(__file__).parent.parent / "artifacts"

SKIPS = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
    pytest.mark.skipif(
        shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None,
        reason="needs jupyterlab (pip install -e '.[browser]')",
    ),
]
playwright = pytest.importorskip("playwright.sync_api", reason="needs playwright")


def end_sessions(base: str, token: str, timeout: float = 60) -> None:
    """Shut down every session of a Jupyter server (its kernels, and so their pools), and
    wait until it holds no kernel: the next test on the same server starts clean."""
    import json
    import urllib.request

    def call(path: str, method: str = "GET"):
        req = urllib.request.Request(f"{base}/api/{path}?token={token}", method=method)
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    for session in call("sessions"):
        call(f"sessions/{session['id']}", "DELETE")
    deadline = time.monotonic() + timeout
    while kernels := call("kernels"):
        assert time.monotonic() < deadline, f"kernels still running: {kernels}"
        time.sleep(0.1)


def notebook_root(tmp_path, cells) -> Path:
    """A folder holding dash.ipynb with ``cells`` (and the python3 kernelspec: without it a
    "Select Kernel" dialog blocks the page and no kernel starts)."""
    root = tmp_path / "root"
    root.mkdir()
    nbformat.write(python3_notebook(cells), root / "dash.ipynb")
    return root


@contextlib.contextmanager
def screenshot_after(page, name: str):
    """The whole page in artifacts/NAME once the block ends, passed or failed."""
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        yield
    finally:
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def run_all(page, url: str):
    """Open the notebook, wait for its kernel, run every cell; the %%ddp cell's locator."""
    page.goto(url)
    playwright.expect(
        page.locator(".jp-StatusBar-TextItem", has_text="Python 3 (ipykernel) | Idle")
    ).to_be_visible(timeout=90_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page.locator(".jp-Notebook .jp-Cell").nth(1)


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


# -- contrast as the page draws it (WCAG 2: relative luminance, alpha composited)

CONTRAST_JS = """el => {
  if (!el.isConnected) return null;  // a live row redrawn meanwhile: ask again
  const ctx = document.createElement('canvas').getContext('2d', {willReadFrequently: true});
  const rgba = css => {  // any CSS colour (rgb(), color(srgb ..), color-mix) as drawn
    ctx.clearRect(0, 0, 1, 1);
    ctx.fillStyle = css;
    ctx.fillRect(0, 0, 1, 1);
    const d = ctx.getImageData(0, 0, 1, 1).data;
    return [d[0], d[1], d[2], d[3] / 255];
  };
  const over = (top, under) => [0, 1, 2].map(i => top[i] * top[3] + under[i] * (1 - top[3]))
    .concat([1]);
  const layers = [];
  for (let e = el; e; e = e.parentElement) {
    const bg = rgba(getComputedStyle(e).backgroundColor);
    if (bg[3] > 0) layers.push(bg);
    if (bg[3] >= 1) break;
  }
  let bg = [255, 255, 255, 1];  // the canvas under everything
  for (const layer of layers.reverse()) bg = over(layer, bg);
  const style = getComputedStyle(el);
  const ink = rgba(el instanceof SVGElement ? style.fill : style.color);
  const fg = over([ink[0], ink[1], ink[2], ink[3] * Number(style.opacity)], bg);
  const lum = c => {
    const [r, g, b] = c.slice(0, 3).map(v => v / 255)
      .map(v => (v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4));
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
  return {ratio: (hi + 0.05) / (lo + 0.05), fg: fg.map(Math.round), bg: bg.map(Math.round),
          text: el.textContent.slice(0, 40)};
}"""


def contrast(locator) -> dict:
    """The WCAG contrast of an element's text against what is drawn under it (its and its
    ancestors' backgrounds, composited): {ratio, fg, bg, text}. (The live widget redraws
    its rows: an element gone before it was read is read again.)"""
    deadline = time.monotonic() + 10
    while (seen := locator.evaluate(CONTRAST_JS)) is None:
        assert time.monotonic() < deadline, f"{locator} kept being redrawn"
    return seen


def readable(locator, what: str, floor: float = 4.5) -> float:
    """Assert the element's text meets WCAG AA (4.5:1); its ratio."""
    seen = contrast(locator)
    assert seen["ratio"] >= floor, f"{what}: contrast {seen['ratio']:.2f} < {floor}: {seen}"
    print(f"{what}: {seen['ratio']:.2f}:1 ({seen['fg']} on {seen['bg']})")
    return seen["ratio"]
