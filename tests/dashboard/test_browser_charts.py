"""The metric charts (``nbddp.log_metrics``) in a real browser: JupyterLab and Notebook
7, live then frozen; 16 ranks' band, median and outlying rank; labels inside their
charts. Skipped as test_browser.py is.
"""

from __future__ import annotations

import math
from importlib.util import find_spec

import pytest

from browser_kit import (
    ARTIFACTS,
    CELLS_METRICS,
    CELLS_METRICS_16,
    METRICS,
    SKIPS,
    chart,
    expect_every_step,
    expect_redrawn_while_running,
    frozen_chart,
    frozen_dashboard,
    live_dashboard,
    logged,
    metrics_test,
    playwright,
    run_all,
    screenshot_after,
    svg_class,
    svg_points,
    svg_texts,
)
from helpers import open_notebook, run_all_cells
from tiers import slow

pytestmark = SKIPS


@slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_METRICS], indirect=True)
def test_four_ranks_logging_two_metrics_draw_a_line_per_rank_live_then_frozen(lab, page):
    url, _ = lab
    with screenshot_after(page, "metrics.png"):
        run_all(page, url)
        metrics_test(page)


@pytest.mark.timeout(300)
@pytest.mark.skipif(find_spec("notebook") is None, reason="needs notebook 7 (the browser extras)")
@pytest.mark.parametrize("notebook7", [CELLS_METRICS], indirect=True)
def test_notebook_7_draws_the_live_charts_and_keeps_them_frozen(notebook7, page):
    url, _ = notebook7
    with screenshot_after(page, "metrics-notebook7.png"):
        open_notebook(page, url)  # Notebook 7 has no status bar: its app says when idle
        assert page.evaluate("() => window.jupyterapp.name") == "Jupyter Notebook"
        playwright.expect(page.locator("#top-panel")).to_be_visible()  # not JupyterLab
        run_all_cells(page)
        metrics_test(page)


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


@slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_METRICS_16], indirect=True)
def test_sixteen_ranks_draw_a_band_and_a_median_and_name_the_outlying_rank(lab, page):
    url, _ = lab
    with screenshot_after(page, "metrics-16.png"):
        cell = run_all(page, url)
        live = live_dashboard(cell)
        expect_band_with_rank_7_outlying(live, timeout=60_000)
        expect_redrawn_while_running(live, "median")
        page.screenshot(path=str(ARTIFACTS / "metrics-16-live.png"), full_page=True)
        frozen = frozen_dashboard(cell)
        frozen_band_with_rank_7_outlying(frozen)
        # beyond 8 ranks the frozen view keeps the notable ranks' logs: rank 7's among them
        playwright.expect(frozen.locator("details.nbddp-log[data-rank='7']")).to_have_count(1)


# -- the charts' SVG as a browser lays it out (charts_html of made-up lines: no server)


def made_up_charts(ranks: int, odd=(), name: str = "loss", scale: float = 1.0):
    """charts_html's input: ``ranks`` lines of 500 steps, ``odd`` ranks 5 times higher."""
    from array import array

    from nbddp.dashboard.metric_store import Line

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
    from nbddp.dashboard.charts import charts_html

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


@pytest.mark.parametrize("room", [300, 1200])
def test_a_chart_fits_the_cells_width(browser, room):
    """Its full size where the cell has room, shrunk to the cell's width (text and all)
    where it has not: live (inline SVG) and frozen (an image) alike."""
    from nbddp.dashboard.charts import HEIGHT, WIDTH, charts_html

    page = browser.new_page()
    charts = made_up_charts(4)
    for images in (False, True):
        html = charts_html(charts, "In [3]", images=images)
        page.set_content(f"<body style='margin:0'><div style='width:{room}px'>{html}</div></body>")
        chart = page.locator(".nbddp-chart")
        playwright.expect(chart).to_be_visible()
        page.wait_for_function("() => [...document.images].every(i => i.complete)")
        box = chart.bounding_box()
        width = min(WIDTH, room)
        assert round(box["width"]) == width, (images, box)
        assert abs(box["height"] - HEIGHT * width / WIDTH) <= 1, (images, box)
