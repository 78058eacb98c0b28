"""``nbddp.log_metrics``: the notebook's record of the points (metric_store), the charts
(charts), the rank-side call outside a worker, the sinks that show them, and real pools
at 2, 3, 4 and 8 ranks that must deliver every point of every rank exactly."""

from __future__ import annotations

import io
import itertools
import math
import random
import re
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from array import array

import numpy as np
import pytest
import torch

import nbddp
from helpers import frozen_charts, healthy
from nbddp.dashboard.charts import (
    COLOURS,
    LINES,
    OUTLIER,
    RIGHT,
    WIDTH,
    chart_svg,
    charts_html,
    outliers,
    summary_line,
    tick_label,
    ticks,
)
from nbddp.dashboard.metric_store import POINTS, CellMetrics, Line, MetricStore
from nbddp.dashboard.sinks import METRICS_EVERY, TextSink
from nbddp.dashboard.view import Dashboard
from nbddp.pool.drive import drive
from nbddp.rank import metrics as rank_metrics
from nbddp.wire import protocol as P

SVG = "{http://www.w3.org/2000/svg}"


def packed(steps, values) -> tuple[bytes, bytes]:
    return array("q", steps).tobytes(), array("d", values).tobytes()


def line_of(values, steps=None) -> Line:
    line = Line()
    line.extend(*packed(range(len(values)) if steps is None else steps, values))
    return line


# ---------------------------------------------------------------- Line: the downsampled view


def width_bound(n: int) -> int:
    """The widest a bucket may be for a view of about POINTS points of n."""
    return 4 * n // POINTS + 1


def check_view(values: list[float], line: Line) -> list[tuple[int, float]]:
    """What every view must be, whatever its bucketing (steps are the indices here)."""
    n = len(values)
    pts = line.points()
    wide = width_bound(n)
    assert len(pts) <= 1.1 * POINTS + wide, (n, len(pts))
    finite = [i for i, v in enumerate(values) if math.isfinite(v)]
    assert len(pts) >= min(len(finite), POINTS // 4), (n, len(pts))  # not a degenerate view
    steps = [s for s, _ in pts]
    assert steps == sorted(set(steps)), "in step order, no point twice"
    for s, v in pts:  # every point a real one (compared as bits: exactly that value)
        assert math.isfinite(v)
        assert array("d", [v]).tobytes() == array("d", [values[s]]).tobytes(), s
    if finite:
        low = min(finite, key=values.__getitem__)
        high = max(finite, key=values.__getitem__)
        shown = {v for _, v in pts}
        assert values[low] in shown, "the global min"
        assert values[high] in shown, "the global max"
        if math.isfinite(values[-1]):
            assert pts[-1] == (n - 1, values[-1]), "the newest point, exactly"
    # the envelope: a point left out lies between points shown near it (spikes stay)
    vals = np.asarray(values)
    kept = np.asarray(steps, dtype=np.int64)
    shown_vals = vals[kept]
    idx = np.asarray(finite, dtype=np.int64)
    idx = idx[~np.isin(idx, kept)]
    if len(idx):
        lo = np.searchsorted(kept, idx - wide + 1)
        hi = np.searchsorted(kept, idx + wide)
        span = int((hi - lo).max())
        assert span > 0
        window = lo[:, None] + np.arange(span)[None, :]
        inside = window < hi[:, None]
        window = np.minimum(window, len(kept) - 1)
        near_max = np.where(inside, shown_vals[window], -np.inf).max(axis=1)
        near_min = np.where(inside, shown_vals[window], np.inf).min(axis=1)
        assert (near_min <= vals[idx]).all()
        assert (vals[idx] <= near_max).all()
    return pts


@pytest.mark.parametrize("n", [10, 999, 1000, 5000, 123457])
def test_a_line_view_keeps_extremes_and_the_newest_point_of_random_values(n):
    rng = random.Random(n)
    values = [rng.gauss(0, 1) for _ in range(n)]
    spike = rng.randrange(n)
    values[spike] = 50.0  # one spike anywhere: it must show
    line = line_of(values)
    assert len(line) == n
    assert line.steps.tolist() == list(range(n))
    assert line.values.tolist() == values  # every point kept
    pts = check_view(values, line)
    assert (spike, 50.0) in pts
    assert not line.nonfinite
    assert line.last() == (n - 1, values[-1])
    if n <= POINTS // 2:
        assert pts == list(enumerate(values))  # few points: every one drawn


@pytest.mark.parametrize("n", [999, 5000, 123457])
def test_nonfinite_values_are_skipped_and_said(n):
    rng = random.Random(n + 1)
    values = [rng.uniform(-1, 1) for _ in range(n)]
    for i in rng.sample(range(n - 1), max(3, n // 100)):
        values[i] = rng.choice([math.nan, math.inf, -math.inf])
    whole = [math.nan] * (2 * width_bound(n))  # a run of NaN longer than any bucket
    start = n // 2
    values[start : start + len(whole)] = whole
    line = line_of(values)
    assert line.nonfinite
    check_view(values, line)
    assert line.last() == (n - 1, values[-1])


def test_a_line_whose_every_value_is_nan_draws_nothing():
    line = line_of([math.nan] * 3000)
    assert line.nonfinite
    assert line.points() == []
    assert line.last() is None


def test_the_newest_finite_point_is_drawn_when_nans_follow_it():
    values = [float(i % 7) for i in range(5000)]  # the newest finite: 4979 % 7 = 2
    values[-20:] = [math.nan] * 20
    line = line_of(values)
    assert line.last() == (4979, 2.0)
    legend = svg_text(parse(chart_svg(("In [1]", "loss"), {0: line})))
    assert summary_line(("In [1]", "loss"), {0: line}, "In [1]").endswith(": 2")
    assert "0: 2" in legend  # the legend says the latest value, as the summary does
    assert line.points()[-1] == (4979, 2.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_view_built_batch_by_batch_is_the_view_built_at_once(seed):
    rng = random.Random(seed)
    n = 60_000
    values = [rng.gauss(0, 1) for _ in range(n)]
    if seed == 3:  # NaNs too
        for i in rng.sample(range(n), 500):
            values[i] = math.nan
    batched = Line()
    at = 0
    while at < n:
        size = rng.choice([1, 2, 7, rng.randint(1, 3000)])
        batched.extend(*packed(range(at, min(n, at + size)), values[at : at + size]))
        at += size
        if rng.random() < 0.5:  # views drawn in between: the buckets grow as points come
            batched.view()
    once = line_of(values)
    assert batched.view() == once.view()
    assert batched.points() == once.points()
    assert batched.nonfinite == once.nonfinite == (seed == 3)
    check_view(values, batched)


def test_a_batch_with_more_steps_than_values_is_refused():
    line = Line()
    with pytest.raises(ValueError, match="as many steps as values"):
        line.extend(array("q", [0, 1]).tobytes(), array("d", [1.0]).tobytes())


# ---------------------------------------------------------------- MetricStore, CellMetrics


def filled_store() -> tuple[MetricStore, list[tuple]]:
    """A store fed in batches, keys and ranks out of order; and every point as rows
    (run, rank, step, name, value) in the order the store lists them."""
    rng = random.Random(5)
    store = MetricStore()
    fed: dict[tuple, dict[int, list]] = {}
    keys = [("In [3]", "loss"), ("train", "loss"), ("In [3]", "acc")]
    for _ in range(40):
        key = rng.choice(keys)
        rank = rng.choice([3, 0, 2, 1])
        points = fed.setdefault(key, {}).setdefault(rank, [])
        batch = [(len(points) + i, rng.uniform(-5, 5)) for i in range(rng.randint(1, 30))]
        points += batch
        store.add(rank, key, *packed([s for s, _ in batch], [v for _, v in batch]))
    rows = [
        (run, rank, step, name, value)
        for (run, name), ranks in fed.items()  # keys in the order they first came
        for rank in sorted(ranks)
        for step, value in ranks[rank]
    ]
    return store, rows


def test_columns_hold_every_point_exactly_and_filter_by_name_and_run():
    store, rows = filled_store()
    cols = store.columns()
    got = list(
        zip(cols["run"], cols["rank"], cols["step"], cols["name"], cols["value"], strict=True)
    )
    assert got == rows
    loss = store.columns(name="loss")
    assert set(loss["name"]) == {"loss"}
    assert len(loss["value"]) == sum(1 for r in rows if r[3] == "loss")
    train = store.columns(run="train")
    assert set(train["run"]) == {"train"}
    assert len(train["value"]) == sum(1 for r in rows if r[0] == "train")
    assert store.columns(name="acc", run="train") == {
        "run": [],
        "rank": [],
        "step": [],
        "name": [],
        "value": [],
    }
    assert store.names() == ["acc", "loss"]


def test_frame_is_a_dataframe_with_pandas_and_a_list_of_dicts_without(monkeypatch):
    pandas = pytest.importorskip("pandas")
    store, rows = filled_store()
    frame = store.frame()
    assert isinstance(frame, pandas.DataFrame)
    assert list(frame.columns) == ["rank", "step", "name", "value", "run"]
    assert list(frame.itertuples(index=False, name=None)) == [
        (rank, step, name, value, run) for run, rank, step, name, value in rows
    ]
    assert len(store.frame("acc")) == sum(1 for r in rows if r[3] == "acc")
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    plain = store.frame()
    assert plain == [
        {"rank": rank, "step": step, "name": name, "value": value, "run": run}
        for run, rank, step, name, value in rows
    ]
    store.clear()
    assert store.frame() == []
    assert store.names() == []


def test_cell_metrics_name_a_cells_own_run_by_its_label_and_keep_named_runs():
    store = MetricStore()
    cell = CellMetrics(store, "In [7]")
    assert not cell.dirty
    cell.add(P.RankMetrics(1, ((None, "loss", *packed([0, 1], [2.0, 1.0])),)))
    cell.add(
        P.RankMetrics(
            0,
            (
                ("train", "loss", *packed([5], [3.0])),
                (None, "loss", *packed([0], [4.0])),
                (None, "acc", *packed([0], [0.5])),
            ),
        )
    )
    assert cell.dirty
    assert cell.keys == [("In [7]", "loss"), ("train", "loss"), ("In [7]", "acc")]
    charts = dict(cell.charts())
    assert charts[("In [7]", "loss")][1].values.tolist() == [2.0, 1.0]
    assert charts[("In [7]", "loss")][0].values.tolist() == [4.0]
    assert charts[("train", "loss")][0].steps.tolist() == [5]
    later = CellMetrics(store, "In [8]")  # the next cell continues "train"
    later.add(P.RankMetrics(0, (("train", "loss", *packed([6], [2.5])),)))
    assert store.lines[("train", "loss")][0].steps.tolist() == [5, 6]
    assert later.keys == [("train", "loss")]


# ---------------------------------------------------------------- charts


def lines_for(ranks, n=300, far=None, far_by=100.0) -> dict[int, Line]:
    """Ranks with a loss that falls, near each other; ``far`` a rank far off."""
    rng = random.Random(len(ranks))
    out = {}
    for r in ranks:
        values = [1 / (i + 1) + 0.01 * rng.random() for i in range(n)]
        if r == far:
            values = [v + far_by for v in values]
        out[r] = line_of(values)
    return out


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == SVG + "svg"
    return root


def by_class(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == cls]


def svg_text(root: ET.Element) -> str:
    return " ".join("".join(e.itertext()) for e in root.iter(SVG + "text"))


@pytest.mark.parametrize("n", [1, 4, LINES])
def test_up_to_eight_ranks_draw_a_line_each(n):
    lines = lines_for(range(n))
    root = parse(chart_svg(("In [1]", "loss"), lines))
    drawn = by_class(root, "nbddp-line")
    assert len(drawn) == n
    assert [e.get("data-label") for e in drawn] == [f"rank {r}" for r in range(n)]
    assert all(len(e.get("points").split()) == 300 for e in drawn)
    assert not by_class(root, "nbddp-band")
    assert not by_class(root, "nbddp-median")
    text = svg_text(root)
    for r in range(n):  # the legend: each rank's latest value
        assert f"{r}: " in text
    assert root.get("data-metric") == "loss"


def test_sixteen_ranks_draw_a_band_a_median_and_the_outlying_rank_named():
    lines = lines_for(range(16), far=11)
    root = parse(chart_svg(("In [1]", "loss"), lines))
    assert not by_class(root, "nbddp-line")  # no line per rank
    assert len(by_class(root, "nbddp-band")) == 1
    assert root.find(f"{SVG}polygon").get("class") == "nbddp-band"
    assert len(by_class(root, "nbddp-median")) == 1
    far = by_class(root, "nbddp-outlier")
    assert [e.get("data-label") for e in far] == ["rank 11"]
    text = svg_text(root)
    assert "outlying: rank 11" in text
    assert "median of ranks 0-10,12-15" in text


def test_no_rank_is_drawn_red_red_is_an_outliers():
    for n in (2, LINES):
        root = parse(chart_svg(("In [1]", "loss"), lines_for(range(n))))
        strokes = [e.get("stroke").lower() for e in by_class(root, "nbddp-line")]
        assert len(set(strokes)) == n  # a colour each
        assert OUTLIER.lower() not in strokes
    assert OUTLIER.lower() not in [c.lower() for c in COLOURS]
    far = by_class(
        parse(chart_svg(("In [1]", "loss"), lines_for(range(16), far=11))), "nbddp-outlier"
    )
    assert [e.get("stroke") for e in far] == [OUTLIER]


@pytest.mark.parametrize(("ahead", "last"), [(1, 248), (8, 248), (15, 248), (16, 499)])
def test_the_band_and_median_reach_only_the_steps_every_rank_has_logged(ahead, last):
    """16 ranks, ``ahead`` of them at step 499, the others at 249 (a live cell): the band
    and the median (and so the x axis) end where every rank has come, not where the first
    ones are (there the median of the ranks ahead alone would dip, read as a sudden drop)."""
    lines = {
        r: line_of([1 / (i + 1) + 0.001 * (r % 4) for i in range(500 if r < ahead else 250)])
        for r in range(16)
    }
    root = parse(chart_svg(("In [1]", "loss"), lines))
    assert not by_class(root, "nbddp-outlier")
    texts = [e.text for e in root.iter(SVG + "text")]
    step = texts.index("step")
    assert texts[step - 2 : step] == ["0", str(last)]  # the x axis: first and last step
    for cls in ("nbddp-band", "nbddp-median"):
        right = max(float(p.split(",")[0]) for p in by_class(root, cls)[0].get("points").split())
        assert right == WIDTH - RIGHT  # the band and the median run to the axis' end


def test_sixteen_ranks_close_together_name_no_outlier():
    root = parse(chart_svg(("In [1]", "loss"), lines_for(range(16))))
    assert len(by_class(root, "nbddp-band")) == 1
    assert not by_class(root, "nbddp-outlier")
    assert "outlying" not in svg_text(root)


def test_outliers_by_hand():
    assert outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 100.0}) == [3]
    assert outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}) == []
    assert outliers({0: 1.0, 1: 1.0, 2: 100.0}) == [2]  # 3 ranks are enough
    assert outliers({0: 1.0, 1: 100.0}) == []  # fewer than 3 ranks: nothing stands out
    assert outliers({0: 5.0}) == []
    assert outliers({}) == []
    assert outliers({0: 1.0, 1: 1.1, 2: 0.9, 3: 1.05, 4: 0.95}) == []
    many = {r: 1.0 for r in range(16)} | {3: -50.0, 7: 80.0, 9: 20.0, 12: 30.0}
    assert outliers(many) == [7, 3, 12]  # the farthest first, at most 3
    assert outliers(many, most=1) == [7]


def test_a_metric_name_with_markup_is_escaped_and_the_svg_still_parses():
    name = "<script>alert('x')</script> \"q\" & co"
    for ranks in (range(2), range(12)):
        lines = lines_for(ranks)
        svg = chart_svg(("run<b>", name), lines)
        assert "<script" not in svg
        root = parse(svg)
        assert root.get("data-metric") == name
        assert name in svg_text(root)
        html = charts_html([(("run<b>", name), lines)], own="In [1]")
        assert "<script" not in html
        assert "<b>" not in html
        ET.fromstring(html)  # the whole div too
        # as a finished cell's images: the name and the alt text escaped, the SVG the same
        html = charts_html([(("run<b>", name), lines)], own="In [1]", images=True)
        assert "<script" not in html
        assert "<b>" not in html
        assert "<svg" not in html
        ET.fromstring(html)
        ((metric, (alt, image)),) = frozen_charts(html).items()
        assert metric == name
        assert alt == summary_line(("run<b>", name), lines, own="In [1]")
        assert name in alt
        assert image == chart_svg(("run<b>", name), lines, image=True)  # the same, as a document


def test_a_run_other_than_the_cells_own_is_named_in_the_title():
    lines = lines_for(range(2))
    own = charts_html([(("In [4]", "loss"), lines)], own="In [4]")
    other = charts_html([(("train", "loss"), lines)], own="In [4]")
    assert "(In [4])" not in own
    assert "(train)" in other
    assert charts_html([], own="In [4]") == ""


def test_a_chart_without_a_finite_value_says_so():
    root = parse(chart_svg(("In [1]", "loss"), {0: line_of([math.nan, math.inf])}))
    assert "no finite values yet" in svg_text(root)
    assert not by_class(root, "nbddp-line")


def test_summary_lines():
    lasts = {0: 0.5, 1: 0.25, 2: 0.75, 3: 0.5}
    lines = {r: line_of([9.0] * 499 + [v]) for r, v in lasts.items()}
    assert (
        summary_line(("In [2]", "loss"), lines, own="In [2]")
        == "[ranks 0-3] loss @ step 499: median 0.5, min 0.25 (rank 1), max 0.75 (rank 2)"
    )
    assert summary_line(("train", "loss"), lines, own="In [2]").startswith(
        "[ranks 0-3] loss (train) @ step 499: "
    )
    one = {2: line_of([1.0, 2.0, 0.125])}
    assert summary_line(("In [2]", "acc"), one, own="In [2]") == "[rank 2] acc @ step 2: 0.125"
    far = {r: line_of([1.0]) for r in range(6)} | {4: line_of([7.0])}
    assert summary_line(("In [2]", "x"), far, own="In [2]") == (
        "[ranks 0-5] x @ step 0: median 1, min 1 (rank 0), max 7 (rank 4); outlying: rank 4"
    )
    assert summary_line(("In [2]", "x"), {0: line_of([math.nan])}, own="In [2]") is None


# ---------------------------------------------------------------- log_metrics outside a worker


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: nbddp.log_metrics({"loss": "0.5"}), "'loss'"),
        (lambda: nbddp.log_metrics({"loss": torch.tensor([1.0, 2.0])}), "'loss'"),
        (lambda: nbddp.log_metrics({"acc": 1.0, "loss": None}), "'loss'"),
        (lambda: nbddp.log_metrics({"loss": b"1"}), "'loss'"),
        (lambda: nbddp.log_metrics({"loss": np.str_("0.5")}), "'loss'"),
        (lambda: nbddp.log_metrics([("loss", 1.0)]), "dict"),
        (lambda: nbddp.log_metrics(1.0), "dict"),
        (lambda: nbddp.log_metrics({"loss": 1.0}, step=1.5), "step"),
        (lambda: nbddp.log_metrics({"loss": 1.0}, step="3"), "step"),
        (lambda: nbddp.log_metrics({"loss": 1.0}, run=3), "run"),
    ],
    ids=[
        "str",
        "2-element-tensor",
        "None",
        "bytes",
        "numpy-str",
        "list",
        "float",
        "float-step",
        "str-step",
        "int-run",
    ],
)
def test_bad_input_raises_one_line_type_error_naming_what(call, says):
    with pytest.raises(TypeError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("log_metrics")
    assert says in message


@pytest.mark.parametrize(
    "value",
    [
        0.5,
        3,
        True,
        np.float64(0.25),
        np.float32(0.5),
        np.int64(2),
        torch.tensor(1.5),
        torch.tensor([2.5]),
        float("nan"),
    ],
    ids=repr,
)
def test_numbers_of_every_kind_are_accepted(value, monkeypatch):
    """Each kind is kept as the float it is, at the step given (or the next one), on a
    rank (its metrics sent as they are at the cell's end) as outside one (checked alike)."""
    nbddp.log_metrics({"loss": value}, step=3)  # outside a worker: checked, not kept
    sent: list = []
    monkeypatch.setattr(rank_metrics, "_send", sent.append)  # as a worker's attach() does
    nbddp.log_metrics({"loss": value}, step=3)
    nbddp.log_metrics({"loss": value}, step=np.int64(4), run="x")
    nbddp.log_metrics({"loss": value})
    rank_metrics.flush()
    (message,) = sent  # one Metrics message: the cell's end
    got = {
        (run, name): (list(array("q", steps)), list(array("d", values)))
        for run, name, steps, values in message.series
    }
    want = float(value)
    for run, steps in ((None, [3, 4]), ("x", [4])):
        kept_steps, kept = got.pop((run, "loss"))
        assert kept_steps == steps
        assert all(type(v) is float for v in kept)
        assert all(v == want or (math.isnan(v) and math.isnan(want)) for v in kept), kept
    assert got == {}


def test_a_name_that_is_not_a_str_is_refused_outside_a_worker_as_on_a_rank():
    with pytest.raises(TypeError, match="name"):
        nbddp.log_metrics({1: 2.0})


# ---------------------------------------------------------------- sinks


def metrics_event(rank: int, name: str, steps, values, run=None) -> P.RankMetrics:
    return P.RankMetrics(rank, ((run, name, *packed(steps, values)),))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def summary_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " @ step " in line]


def test_text_sink_says_each_metric_every_few_seconds_and_at_the_end():
    clock = Clock()
    out = io.StringIO()
    sink = TextSink(stdout=out, stderr=out, clock=clock, metrics=CellMetrics(label="In [1]"))
    for r in range(4):
        sink.handle(metrics_event(r, "loss", range(10), [r + 0.5] * 10))
        sink.handle(metrics_event(r, "acc", range(10), [r / 8] * 10))
    clock.t = METRICS_EVERY - 0.01
    sink.handle(P.Tick())
    assert out.getvalue() == ""  # not yet
    clock.t = METRICS_EVERY
    sink.handle(P.Tick())
    assert summary_lines(out.getvalue()) == [
        "[ranks 0-3] loss @ step 9: median 2, min 0.5 (rank 0), max 3.5 (rank 3)",
        "[ranks 0-3] acc @ step 9: median 0.1875, min 0 (rank 0), max 0.375 (rank 3)",
    ]
    clock.t += 1
    sink.handle(P.Tick())
    assert len(summary_lines(out.getvalue())) == 2  # nothing new came: nothing said
    for r in range(4):
        sink.handle(metrics_event(r, "loss", [10], [r + 0.25]))
    clock.t += METRICS_EVERY - 1.5
    sink.handle(P.Tick())
    assert len(summary_lines(out.getvalue())) == 2  # new points, but too soon
    sink.close(P.CellEnd(1, (0, 1, 2, 3)))
    said = summary_lines(out.getvalue())
    assert len(said) == 4  # the end says it once more, each metric once
    assert (
        said[2] == "[ranks 0-3] loss @ step 10: median 1.75, min 0.25 (rank 0), max 3.25 (rank 3)"
    )
    assert said[3] == said[1]


def test_text_sink_says_metrics_once_at_the_end_of_a_short_cell():
    out = io.StringIO()
    sink = TextSink(stdout=out, clock=Clock(), metrics=CellMetrics(label="In [1]"))
    sink.handle(P.Output(0, "stdout", "hello\n"))
    sink.handle(metrics_event(0, "loss", range(500), [1 / (i + 1) for i in range(500)]))
    sink.handle(metrics_event(0, "acc", [0], [0.5], run="train"))
    sink.close(P.CellEnd(1, (0,)))
    assert out.getvalue().splitlines() == [
        "[rank 0] hello",
        "[rank 0] loss @ step 499: 0.002",
        "[rank 0] acc (train) @ step 0: 0.5",
    ]


def test_quiet_text_sink_says_no_metric_line():
    clock = Clock()
    out = io.StringIO()
    sink = TextSink(quiet=True, stdout=out, stderr=out, clock=clock)
    sink.handle(metrics_event(0, "loss", range(10), [1.0] * 10))
    clock.t = 2 * METRICS_EVERY
    sink.handle(P.Tick())
    sink.handle(metrics_event(0, "loss", [10], [1.0]))
    sink.close(P.CellEnd(1, (0,), errors={0: P.ErrorInfo("E", "m", "tb")}))
    assert out.getvalue() == ""
    assert len(sink.metrics.store.lines[("this cell", "loss")][0]) == 11  # still recorded


def test_dashboard_draws_charts_at_most_every_chart_interval_and_freezes_them():
    clock = Clock()
    board = Dashboard(
        [0, 1, 2, 3],
        world_size=4,
        clock=clock,
        interval=0,
        metrics=CellMetrics(label="In [5]"),
    )
    assert board.widget.charts == ""
    for r in range(4):
        board.handle(metrics_event(r, "loss", range(100), [r + 1 / (i + 1) for i in range(100)]))
    assert board.widget.charts.count("nbddp-line") == 1  # drawn at once: rank 0's alone
    clock.t = Dashboard.CHART_INTERVAL / 2
    board.handle(P.Tick())
    assert board.widget.charts.count("nbddp-line") == 1  # not redrawn yet
    clock.t = Dashboard.CHART_INTERVAL
    board.handle(P.Tick())
    first = board.widget.charts
    root = parse(re.search(r"<svg.*?</svg>", first).group(0))
    assert len(by_class(root, "nbddp-line")) == 4
    clock.t = 1.5 * Dashboard.CHART_INTERVAL
    board.handle(metrics_event(0, "loss", [100], [9.0]))
    assert board.widget.charts == first  # not redrawn yet
    clock.t = 2 * Dashboard.CHART_INTERVAL
    board.handle(P.Tick())
    assert board.widget.charts != first
    assert "0: 9<" in board.widget.charts  # rank 0's new latest value in the legend
    board.handle(metrics_event(1, "acc", [0], [0.5]))
    board.close(P.CellEnd(1, (0, 1, 2, 3)))
    frozen = board.frozen_bundle()
    html = frozen["text/html"]
    # each chart an image of its SVG (inline SVG does not survive a sanitizer), none inline
    assert "<svg" not in html
    charts = frozen_charts(html)
    assert list(charts) == ["loss", "acc"]  # the acc that came last is in the frozen view
    roots = {metric: parse(svg) for metric, (_alt, svg) in charts.items()}
    assert [len(by_class(root, "nbddp-line")) for root in roots.values()] == [4, 1]
    assert [root.get("data-metric") for root in roots.values()] == ["loss", "acc"]
    assert "0: 9" in svg_text(roots["loss"])  # the last drawing, rank 0's 9 in the legend
    loss = (
        "[ranks 0-3] loss @ step 100: median 2.51, min 1.01 (rank 1), max 9 (rank 0); "
        "outlying: rank 0"
    )
    acc = "[rank 1] acc @ step 0: 0.5"
    assert [alt for alt, _svg in charts.values()] == [loss, acc]  # the alt: the summary line
    text = frozen["text/plain"].splitlines()
    assert loss in text
    assert acc in text


# ---------------------------------------------------------------- real pools


@pytest.fixture
def npool(pool_of_size):
    return healthy(pool_of_size)


class Recorder:
    """A sink around a TextSink that keeps every event with the time it came."""

    def __init__(self, inner: TextSink) -> None:
        self.inner = inner
        self.events: list[tuple[float, object]] = []

    def handle(self, event: object) -> None:
        self.events.append((time.monotonic(), event))
        self.inner.handle(event)

    def close(self, end) -> None:
        self.inner.close(end)


def run_cell(pool, code: str, label: str, store: MetricStore | None = None):
    metrics = CellMetrics(store, label)
    out = io.StringIO()
    recorder = Recorder(TextSink(metrics=metrics, stdout=out, stderr=out))
    end = drive(pool, pool.run(code), recorder)
    return end, metrics, recorder, out.getvalue()


def points_of(store: MetricStore, key) -> dict[int, tuple[list[int], list[float]]]:
    return {r: (line.steps.tolist(), line.values.tolist()) for r, line in store.lines[key].items()}


def test_every_point_of_every_rank_arrives_exactly_and_steps_restart_each_cell(npool):
    n = npool.world_size
    store = MetricStore()
    code = (
        "import nbddp\nfor i in range(500):\n"
        "    nbddp.log_metrics({'a': rank * 1000.0 + i, 'b': rank * 0.5 - i / 7}, step=2 * i)\n"
    )
    end, cell, _, out = run_cell(npool, code, "In [1]", store)
    assert not end.errors, end.errors
    assert cell.keys == [("In [1]", "a"), ("In [1]", "b")]
    steps = [2 * i for i in range(500)]
    assert points_of(store, ("In [1]", "a")) == {
        r: (steps, [r * 1000.0 + i for i in range(500)]) for r in range(n)
    }
    assert points_of(store, ("In [1]", "b")) == {
        r: (steps, [r * 0.5 - i / 7 for i in range(500)]) for r in range(n)
    }
    assert f"[ranks 0-{n - 1}] a @ step 998: median" in out
    # the next cell: steps left out number from 0 again; one given sets where they go on
    code = (
        "import nbddp\nfor i in range(500):\n    nbddp.log_metrics({'a': rank + i / 4})\n"
        "nbddp.log_metrics({'c': 1.0}, step=10)\nnbddp.log_metrics({'c': 2.0})\n"
    )
    end, cell, _, _ = run_cell(npool, code, "In [2]", store)
    assert not end.errors, end.errors
    assert cell.keys == [("In [2]", "a"), ("In [2]", "c")]
    assert points_of(store, ("In [2]", "a")) == {
        r: (list(range(500)), [r + i / 4 for i in range(500)]) for r in range(n)
    }
    assert points_of(store, ("In [2]", "c")) == {r: ([10, 11], [1.0, 2.0]) for r in range(n)}
    assert len(store.frame()) == n * (500 * 3 + 2)


def test_a_named_run_goes_on_across_cells(npool):
    n = npool.world_size
    run = f"train-{uuid.uuid4().hex[:6]}"
    store = MetricStore()
    code = (
        "import nbddp\nfor i in range(500):\n"
        f"    nbddp.log_metrics({{'x': rank * 1000.0 + OFFSET + i}}, run={run!r})\n"
    )
    end, first, _, out = run_cell(npool, code.replace("OFFSET", "0"), "In [1]", store)
    assert not end.errors, end.errors
    assert first.keys == [(run, "x")]
    assert f"x ({run}) @ step 499" in out  # another run than the cell's own: named
    # a cell between that logs its own run does not move the named run's steps
    run_cell(npool, "import nbddp\nnbddp.log_metrics({'x': -1.0})", "In [2]", store)
    end, second, _, _ = run_cell(npool, code.replace("OFFSET", "500"), "In [3]", store)
    assert not end.errors, end.errors
    assert second.keys == [(run, "x")]
    assert points_of(store, (run, "x")) == {
        r: (list(range(1000)), [r * 1000.0 + i for i in range(1000)]) for r in range(n)
    }
    assert points_of(store, ("In [2]", "x")) == {r: ([0], [-1.0]) for r in range(n)}


def test_a_rank_that_raises_after_logging_keeps_its_points_and_the_others(npool):
    n = npool.world_size
    code = (
        "import nbddp\nfor i in range(50):\n"
        "    nbddp.log_metrics({'f': rank * 1000.0 + i}, step=i)\n"
        "if rank == 1:\n    raise ValueError('boom')\n"
    )
    end, cell, _, _ = run_cell(npool, code, "In [1]")
    assert set(end.errors) == {1}
    assert end.errors[1].exc_type == "ValueError"
    assert points_of(cell.store, ("In [1]", "f")) == {
        r: (list(range(50)), [r * 1000.0 + i for i in range(50)]) for r in range(n)
    }


def test_a_bad_value_on_a_rank_fails_its_cell_with_the_type_error(npool):
    code = "import nbddp\nnbddp.log_metrics({'ok': 1.0}, step=0)\nnbddp.log_metrics({1: 2.0})"
    end, _, _, _ = run_cell(npool, code, "In [1]")
    assert set(end.errors) == set(range(npool.world_size))
    assert {e.exc_type for e in end.errors.values()} == {"TypeError"}
    assert "name" in end.errors[0].message


def test_points_arrive_in_a_few_batches_while_a_long_cell_runs(npool):
    n = npool.world_size
    code = (
        "import nbddp, time\nt0 = time.monotonic()\ni = 0\n"
        "while time.monotonic() - t0 < 1.5:\n"
        "    nbddp.log_metrics({'live': float(i)})\n    i += 1\n    time.sleep(0.002)\n"
    )
    end, cell, recorder, _ = run_cell(npool, code, "In [1]")
    assert not end.errors, end.errors
    done_at: dict[int, float] = {}
    batches: dict[int, list[float]] = {r: [] for r in range(n)}
    ended = None
    for t, event in recorder.events:
        states = event.each() if isinstance(event, P.RankStates) else [event]
        for one in states:
            if isinstance(one, P.RankState) and one.state == "done":
                done_at.setdefault(one.rank, t)
        if isinstance(event, P.RankMetrics):
            assert event.rank not in done_at, "every point comes before the rank's Done"
            batches[event.rank].append(t)
        if isinstance(event, P.CellEnd):
            ended = t
    calls = {r: len(line) for r, line in cell.store.lines[("In [1]", "live")].items()}
    assert set(calls) == set(range(n))
    for r in range(n):
        assert cell.store.lines[("In [1]", "live")][r].values.tolist() == [
            float(i) for i in range(calls[r])
        ]
        # sent while the cell ran, in more than one batch, but far fewer than the calls
        assert 3 <= len(batches[r]) <= 1.5 / 0.25 + 6, (r, len(batches[r]))
        assert len(batches[r]) * 10 < calls[r], (r, len(batches[r]), calls[r])
    assert min(t for ts in batches.values() for t in ts) < ended - 0.5


def test_a_rank_that_logs_100_000_points_sends_them_all(npool):
    n = npool.world_size
    code = (
        "import nbddp\nfor i in range(100_000):\n"
        "    nbddp.log_metrics({'big': rank * 1e6 + i * 0.5}, step=i)\n"
    )
    end, cell, _, _ = run_cell(npool, code, "In [1]")
    assert not end.errors, end.errors
    lines = cell.store.lines[("In [1]", "big")]
    assert set(lines) == set(range(n))
    want_steps = np.arange(100_000, dtype=np.int64)
    for r, line in lines.items():
        assert len(line) == 100_000
        assert np.array_equal(np.frombuffer(line.steps, dtype=np.int64), want_steps)
        assert np.array_equal(
            np.frombuffer(line.values, dtype=np.float64), r * 1e6 + want_steps * 0.5
        )
        assert len(line.points()) <= 1.1 * POINTS + width_bound(100_000)


def test_a_rank_off_early_in_the_run_is_named_though_it_has_caught_up():
    """Outliers over the whole run, not only now: rank 7 starts at five times the loss of
    the others and ends among them; the band is the others', rank 7 a line of its own."""
    store = MetricStore()
    for r in range(16):
        values = [math.exp(-i / 100) * (5 if r == 7 else 1) + (r % 4) * 0.01 for i in range(500)]
        store.add(r, ("c", "loss"), array("q", range(500)).tobytes(), array("d", values).tobytes())
    root = ET.fromstring(chart_svg(("c", "loss"), store.lines[("c", "loss")]))
    labels = [el.get("data-label") for el in root.iter(f"{SVG}polyline")]
    assert labels == ["median", "rank 7"]
    assert "outlying: rank 7" in ET.tostring(root, encoding="unicode")
    band = root.find(f"{SVG}polygon").get("points").split()
    tops = [float(p.split(",")[1]) for p in band]
    outlier = root.findall(f"{SVG}polyline")[1].get("points").split()
    assert min(tops) > float(outlier[0].split(",")[1]) + 50  # the band stays far below it


@pytest.mark.parametrize(
    ("low", "high"),
    [(0.06505, 1.036), (1.523, 2.712), (0.0, 1.0), (-3.0, 7.0), (12345.0, 98765.0),
     (0.001, 0.0013), (0.3, 0.31), (-0.5, -0.2), (1e-6, 4e-6), (0.0, 2.7e9)],
)  # fmt: skip
def test_y_ticks_are_round_values_inside_the_datas_range(low, high):
    values = ticks(low, high)
    assert 2 <= len(values) <= 5, values
    assert all(low - 1e-12 <= v <= high + 1e-12 for v in values), values  # never outside
    step = values[1] - values[0]
    assert all(math.isclose(b - a, step, rel_tol=1e-6) for a, b in itertools.pairwise(values))
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5)), step
    assert all(math.isclose(v / step, round(v / step), abs_tol=1e-6) for v in values)
    labels = [tick_label(v, values) for v in values]
    assert len(set(labels)) == len(labels), labels  # each says its value
    assert all(len(label) <= 9 for label in labels), labels  # they fit left of the axis


def test_a_loss_that_is_never_negative_has_no_negative_label():
    """The y labels are round values within the data (the padded edges were -0.04157)."""
    lines = {r: line_of([1 / (i + 1) for i in range(300)]) for r in range(4)}
    root = parse(chart_svg(("In [1]", "loss"), lines))
    labels = [e.text for e in by_class(root, "nbddp-tick") if e.tag == SVG + "text"]
    assert labels == ["0.2", "0.4", "0.6", "0.8", "1.0"]
    assert not [e.text for e in root.iter(SVG + "text") if e.text and e.text.startswith("-")]


def test_a_finished_16_rank_cell_offers_the_log_of_the_rank_its_chart_names():
    """Beyond OWN_LOGS ranks a frozen cell keeps only the notable ranks' own logs: the
    slowest (here 13, 14 and 15) and rank 7, the outlier its loss chart names."""
    clock = Clock()
    ranks = list(range(16))
    board = Dashboard(ranks, world_size=16, clock=clock, metrics=CellMetrics(label="In [5]"))
    for r in ranks:
        board.handle(P.RankState(r, "running"))
    for r in ranks:
        board.handle(P.Output(r, "stdout", f"rank {r} says hello\n"))
        scale = 5 if r == 7 else 1
        board.handle(metrics_event(r, "loss", range(50), [scale / (i + 1) for i in range(50)]))
    clock.t = 3.0
    for r in ranks:
        if r % 4:
            clock.t += 0.1  # the later ranks end later
        board.handle(P.RankState(r, "done"))
    board.close(P.CellEnd(1, tuple(ranks)))
    html = board.frozen_bundle()["text/html"]
    offered = [int(r) for r in re.findall(r"<details class='nbddp-log' data-rank='(\d+)'", html)]
    assert 7 in offered, offered
    assert "outlying: rank 7" in board.summary_text()
