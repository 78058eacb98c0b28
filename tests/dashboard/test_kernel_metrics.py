"""``nbddp.log_metrics`` through a real Jupyter kernel: the frozen charts of a cell,
``%ddp metrics``, the --text summaries, and an iopub that does not grow with the calls."""

from __future__ import annotations

import ast
import xml.etree.ElementTree as ET

import pytest
from test_kernel import execute, one_usage_error

from helpers import frozen_charts, frozen_svgs

pytestmark = pytest.mark.kernel

SVG = "{http://www.w3.org/2000/svg}"

LOGGING = (
    "%%ddp -n 4\nimport nbddp\nfor i in range(500):\n"
    "    nbddp.log_metrics({'loss': rank * 1000.0 + i, 'acc': i / 500 + rank}, step=i)\n"
)

# the same loop, about 2.5 s long, with log_metrics or with a function that does nothing
MANY_CALLS = (
    "%%ddp\nimport nbddp, time\n"
    "log = nbddp.log_metrics if LOG else (lambda metrics, step: None)\n"
    "for i in range(100_000):\n    log({'loss': rank + 1 / (i + 1)}, step=i)\n"
    "    if i % 1000 == 0:\n        time.sleep(0.025)\n"
)


def value(kc, expr: str):
    """A Python literal the kernel prints."""
    r = execute(kc, f"print(repr({expr}))")
    assert r.error is None, r.error
    return ast.literal_eval(r.stdout.strip())


def metrics(kc, args: str, expr: str = "len(_m)"):
    """``expr`` of ``_m = %ddp metrics ARGS`` (a magic is a statement, not an expression)."""
    r = execute(kc, f"_m = %ddp metrics {args}")
    assert r.error is None, r.error
    assert r.stderr == "", r.stderr
    return value(kc, expr)


def svgs(html: str) -> dict[str, ET.Element]:
    """The frozen charts of a cell's static HTML (images of their SVG), parsed."""
    return {metric: ET.fromstring(svg) for metric, svg in frozen_svgs(html).items()}


def lines_by_metric(html: str) -> dict[str, int]:
    assert "<svg" not in html  # no inline SVG: a sanitizer strips it
    out = {}
    for metric, root in svgs(html).items():
        assert root.tag == SVG + "svg"
        assert root.get("data-metric") == metric
        out[metric] = sum(1 for e in root.iter(SVG + "polyline") if e.get("class") == "nbddp-line")
    return out


@pytest.mark.timeout(240)
def test_charts_freeze_with_the_cell_and_percent_ddp_metrics_returns_every_point(
    kernel,
):
    _km, kc = kernel
    assert execute(kc, "%load_ext nbddp").error is None
    count = value(kc, "get_ipython().execution_count")
    r = execute(kc, LOGGING, timeout=120)
    assert r.error is None, r.text
    label = f"In [{count + 1}]"
    # the cell's frozen output: static HTML with an image of its SVG per metric, a line per rank
    final = r.displays[-1]
    assert "application/vnd.jupyter.widget-view+json" not in final
    assert lines_by_metric(final["text/html"]) == {"loss": 4, "acc": 4}
    assert "<script" not in final["text/html"]
    loss = "[ranks 0-3] loss @ step 499: median 1999, min 499 (rank 0), max 3499 (rank 3)"
    assert loss in final["text/plain"].splitlines()
    alts = {metric: alt for metric, (alt, _svg) in frozen_charts(final["text/html"]).items()}
    assert alts["loss"] == loss  # each image's alt text: its summary line
    assert alts["acc"].startswith("[ranks 0-3] acc @ step 499: median ")

    # m = %ddp metrics: every point, as a DataFrame
    execute(kc, "m = %ddp metrics")
    assert value(kc, "type(m).__name__") == "DataFrame"
    assert value(kc, "list(m.columns)") == ["rank", "step", "name", "value", "run"]
    assert value(kc, "len(m)") == 4000
    assert value(kc, "sorted(set(m.run))") == [label]
    assert value(kc, "sorted(set(m['name']))") == ["acc", "loss"]
    loss = "m[m['name'] == 'loss'].sort_values(['rank', 'step'])"
    assert value(kc, f"{loss}['value'].tolist()") == [
        r * 1000.0 + i for r in range(4) for i in range(500)
    ]
    assert value(kc, f"{loss}['step'].tolist()") == list(range(500)) * 4
    assert metrics(kc, "loss", "(len(_m), set(_m['name']))") == (2000, {"loss"})
    assert metrics(kc, f"acc --run '{label}'", "(len(_m), set(_m['name']))") == (2000, {"acc"})
    assert metrics(kc, "acc --run nosuch") == 0

    # a name never logged: one line, naming what was
    said = one_usage_error(execute(kc, "%ddp metrics nosuch"))
    assert "nosuch" in said
    assert "acc, loss" in said

    # without pandas: a list of dicts with the same keys
    r = execute(
        kc,
        "import sys\n_pd = sys.modules.get('pandas')\nsys.modules['pandas'] = None\n"
        "try:\n    rows = %ddp metrics loss\nfinally:\n    sys.modules['pandas'] = _pd",
    )
    assert r.error is None, r.error
    assert value(kc, "type(rows).__name__") == "list"
    assert value(kc, "len(rows)") == 2000
    rows = value(kc, "rows[:2] + rows[-1:]")
    assert rows == [
        {"rank": 0, "step": 0, "name": "loss", "value": 0.0, "run": label},
        {"rank": 0, "step": 1, "name": "loss", "value": 1.0, "run": label},
        {"rank": 3, "step": 499, "name": "loss", "value": 3499.0, "run": label},
    ]

    # --clear forgets them all
    r = execute(kc, "%ddp metrics --clear")
    assert r.error is None, r.error
    assert r.text == ""
    assert metrics(kc, "") == 0
    assert one_usage_error(execute(kc, "%ddp metrics loss")).startswith("no metric 'loss'")

    # --text: a summary line per metric in the stream output
    r = execute(kc, LOGGING.replace("-n 4", "-n 4 --text"), timeout=120)
    assert r.error is None, r.text
    assert "[ranks 0-3] loss @ step 499: median 1999, min 499 (rank 0), max 3499 (rank 3)" in (
        r.stdout
    )
    assert "[ranks 0-3] acc @ step 499: median " in r.stdout
    assert "nbddp-chart" not in r.html  # no chart, image or inline
    # a named run is named in the summaries
    r = execute(
        kc,
        "%%ddp --text\nimport nbddp\nnbddp.log_metrics({'lr': 0.5 * (rank + 1)}, run='train')",
    )
    assert "[ranks 0-3] lr (train) @ step 0: median 1.25, min 0.5 (rank 0), max 2 (rank 3)" in (
        r.stdout
    )

    # iopub stays bounded: 100,000 calls a rank cost about no message more: the dashboard
    # renders on its own clock, the charts within those renders
    counts = {}
    for log in (False, True):
        r = execute(kc, MANY_CALLS.replace("LOG", str(log)), timeout=120)
        assert r.error is None, r.text
        counts.setdefault(log, []).append(r.iopub)
        if log:
            assert lines_by_metric(r.displays[-1]["text/html"]) == {"loss": 4}
    print(f"iopub messages: without log_metrics {counts[False]}, with {counts[True]}")
    # (a render per batch of points, about 40 in 2.5 s at 4 ranks, would be caught)
    assert counts[True][0] <= counts[False][0] + 12, counts
    assert metrics(kc, "loss") == 4 * 500 + 4 * 100_000  # the --text cell too
    assert execute(kc, "%ddp stop").error is None
