"""The dashboard's metric charts as inline SVG, and their one-line text summaries.

One chart per metric, step on the x axis. Up to ``LINES`` ranks draw a line each; a
larger pool draws the median of its ranks, a band from the lowest to the highest, and
the ranks that stand out (:func:`outlying`) as lines of their own, named. The same SVG
is the live widget's (inline) and the finished cell's (an ``<img>`` of it, which saved
notebooks, untrusted ones, nbviewer and GitHub show): no script, no external style.
"""

from __future__ import annotations

import base64
import itertools
import math
import statistics
from html import escape

from .fold import rank_set
from .metric_store import Key, Line
from .theme import CHART_IMAGE_FILTER, ink

__all__ = ["LINES", "chart_svg", "charts_html", "named", "outliers", "summary_line", "ticks"]

LINES = 8  # ranks drawn one line each; more draw a band
BAND_BUCKETS = 200  # x positions of the band
WIDTH, HEIGHT = 560, 210  # at most: a narrower cell shrinks the chart to its width
LEFT, RIGHT, TOP, BOTTOM = 60, 10, 22, 34  # (9 characters of a y label fit on the left)
LEGEND_ROW = 13  # pixels a further row of the legend adds
COLOURS = (  # matplotlib's tab10 without its red: red is a failed rank's, an outlier's
    "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
BAND, MEDIAN, OUTLIER = "#9ecae1", "#1f4e79", "#d62728"
MEDIAN_INK = ink(MEDIAN)  # darker on a light theme, lighter on a dark one (nbddp.dashboard.theme)
FAINT = "fill-opacity='0.75'"  # secondary text: the ink, fainter
# an image of the chart cannot see the page: dark ink, each label on a halo of paper
IMAGE_STYLE = (
    "<style>text{paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}</style>"
)


def _fmt(value: float) -> str:
    """A value for people: 4 significant digits, at most 9 characters (12.35k, 1.2e-05)."""
    size = abs(value)
    if value == 0 or 1e-3 <= size < 9999.5:
        return f"{value:.4g}"
    if 9999.5 <= size < 1e15:
        for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if size >= scale * 0.99995:
                return f"{value / scale:.4g}{suffix}"
    return f"{value:.2g}"


def ticks(low: float, high: float, most: int = 5) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten) from ``low`` to ``high``, both
    included, at most ``most`` and at least two where the range is wider than nothing:
    the y axis' labels, which never fall outside the data (no ``-0.04157`` under a loss
    that is never negative)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low] if math.isfinite(low) else []
    raw = (high - low) / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10, 20):
        step = factor * power
        first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
        if last - first + 1 <= most:
            break
    values = [round(k * step, 12) for k in range(first, last + 1)]
    return values if len(values) >= 2 else [low, high]


def tick_label(value: float, values: list[float]) -> str:
    """``value`` with as many decimals as its axis' step needs (0.25, 0.5, 0.75: two)."""
    step = min((b - a for a, b in itertools.pairwise(values)), default=0)
    if value == 0:
        return "0"
    if not step or abs(value) >= 1e4:
        return _fmt(value)  # 20k, 1.2e+06
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if round(step * 10**decimals, 6) % 1:  # 2.5 times a power of ten
        decimals += 1
    return f"{value:.{decimals}f}" if decimals <= 6 else _fmt(value)


def outliers(lasts: dict[int, float], most: int = 3) -> list[int]:
    """The ranks whose latest value is far from the others' (a modified z-score over 3.5,
    median and median absolute deviation: robust to the outliers themselves), the
    farthest first, at most ``most``."""
    if len(lasts) < 3:
        return []
    values = list(lasts.values())
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    floor = 1e-9 * max(abs(med), 1e-12)
    score = {r: 0.6745 * abs(v - med) / max(mad, floor) for r, v in lasts.items()}
    far = [r for r in sorted(score, key=score.get, reverse=True) if score[r] > 3.5]
    return far[:most]


class _Frame:
    """Data to pixels for one chart."""

    def __init__(self, xs: tuple[float, float], ys: tuple[float, float]) -> None:
        (self.x0, x1), (y0, y1) = xs, ys
        if y0 == y1:
            y0, y1 = y0 - max(abs(y0) * 0.05, 0.5), y1 + max(abs(y1) * 0.05, 0.5)
        self.low, self.high = y0, y1  # the data's range: the y labels stay inside it
        pad = (y1 - y0) * 0.04
        # (no padding below zero for values that are never negative)
        self.y0, self.y1 = (max(0.0, y0 - pad) if y0 >= 0 else y0 - pad), y1 + pad
        self.xspan = max(x1 - self.x0, 1)
        self.w, self.h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    @classmethod
    def around(cls, point_lists) -> _Frame:
        """The frame that holds every (step, value) of ``point_lists``."""
        every = [p for ps in point_lists for p in ps]
        steps = [s for s, _ in every]
        values = [v for _, v in every]
        return cls((min(steps), max(steps)), (min(values), max(values)))

    def x(self, step: float) -> float:
        return LEFT + (step - self.x0) / self.xspan * self.w

    def y(self, value: float) -> float:
        return TOP + (self.y1 - value) / (self.y1 - self.y0) * self.h

    def path(self, points) -> str:
        return " ".join(f"{self.x(s):.1f},{self.y(v):.1f}" for s, v in points)


class _Grid:
    """Each rank's mean in BAND_BUCKETS step buckets, from its downsampled view (numpy:
    64 ranks in a few ms): the band, and how far each rank runs from the others."""

    def __init__(self, lines: dict[int, Line]) -> None:
        import numpy as np

        views = []
        for line in lines.values():
            idx = np.asarray(line.view(), dtype=np.int64)
            steps = np.frombuffer(line.steps, dtype=np.int64)[idx]
            values = np.frombuffer(line.values, dtype=np.float64)[idx]  # copies: arrays grow
            finite = np.isfinite(values)
            views.append((steps[finite], values[finite]))
        self.ranks = list(lines)
        self.x0 = min(int(s.min()) for s, _ in views if len(s))
        self.x1 = max(int(s.max()) for s, _ in views if len(s))
        width = max((self.x1 - self.x0) / BAND_BUCKETS, 1e-12)
        grid = np.full((len(views), BAND_BUCKETS), np.nan)
        self.reached = []  # each rank's last bucket
        for row, (steps, values) in enumerate(views):
            bucket = np.minimum(((steps - self.x0) / width).astype(np.int64), BAND_BUCKETS - 1)
            self.reached.append(int(bucket.max()) if len(bucket) else -1)
            counts = np.bincount(bucket, minlength=BAND_BUCKETS)
            sums = np.bincount(bucket, weights=values, minlength=BAND_BUCKETS)
            seen = counts > 0
            grid[row, seen] = sums[seen] / counts[seen]
        cols = np.flatnonzero(np.isfinite(grid).any(axis=0))
        self.grid, self.cols = grid[:, cols], cols
        # each bucket at its centre, the first and the last at the steps logged
        self.xs = np.clip(self.x0 + (cols + 0.5) * width, self.x0, self.x1)
        if len(cols):
            self.xs[0], self.xs[-1] = max(self.x0, self.xs[0] - width / 2), self.x1

    def band(self, leave_out: list[int]) -> list[tuple[float, float, float, float]]:
        """(step, lowest, median, highest) of the ranks but ``leave_out``, bucket by bucket."""
        import numpy as np

        kept = [i for i, r in enumerate(self.ranks) if r not in leave_out]
        g = self.grid[kept]
        # only where every rank has come: live, the ranks ahead alone would make a median
        # that dips (or jumps) at the right edge, read as a sudden change of the metric
        cols = (self.cols <= min(self.reached[i] for i in kept)) & np.isfinite(g).any(axis=0)
        g, xs = g[:, cols], self.xs[cols]
        low, mid, high = np.nanmin(g, 0), np.nanmedian(g, 0), np.nanmax(g, 0)
        return list(zip(xs.tolist(), low.tolist(), mid.tolist(), high.tolist(), strict=True))

    def scores(self) -> dict[int, float]:
        """How far each rank runs from the others over the whole run: its modified z-score
        (median, median absolute deviation) in each bucket, at most 10, averaged."""
        import numpy as np

        g = self.grid
        with np.errstate(invalid="ignore", divide="ignore"):
            med = np.nanmedian(g, axis=0)
            mad = np.nanmedian(np.abs(g - med), axis=0)
            floor = 1e-9 * np.maximum(np.abs(med), 1e-12)
            z = np.minimum(0.6745 * np.abs(g - med) / np.maximum(mad, floor), 10.0)
            z[:, np.isfinite(g).sum(axis=0) < 3] = np.nan  # too few ranks there to tell
            score = np.nanmean(np.where(np.isfinite(z), z, 0.0), axis=1)
        return dict(zip(self.ranks, score.tolist(), strict=True))


def outlying(lines: dict[int, Line], lasts: dict[int, float], most: int = 3) -> list[int]:
    """The ranks that stand out: far from the others over the run (:meth:`_Grid.scores`
    over 3.5), or now (:func:`outliers` of their latest values); the farthest first."""
    if len(lasts) < 3:
        return []
    return _outlying(_Grid(lines), lasts, most)


def named(charts: list[tuple[Key, dict[int, Line]]]) -> list[int]:
    """The ranks the charts name as outlying (beyond LINES ranks, lines of their own): a
    finished cell offers their logs."""
    out: list[int] = []
    for _key, lines in charts:
        lasts = {r: p[1] for r, line in lines.items() if (p := line.last()) is not None}
        if len(lasts) > LINES:
            far = outlying({r: lines[r] for r in lasts}, lasts)
            out += [r for r in far if r not in out]
    return out


def _outlying(grid: _Grid, lasts: dict[int, float], most: int = 3) -> list[int]:
    scores = grid.scores()
    now = outliers(lasts, most=len(lasts))
    far = [r for r in scores if scores[r] > 3.5 or r in now]
    return sorted(far, key=lambda r: -scores[r])[:most]


def chart_svg(key: Key, lines: dict[int, Line], show_run: bool = True, image: bool = False) -> str:
    """One metric's chart: a line per rank, or a band with the outliers named. Its ink is
    the page's text colour, on the page's background; ``image``: an SVG document of its
    own (it cannot see the page), dark ink on transparent paper, labels on halos."""
    run, name = key
    lasts = {r: p[1] for r, line in sorted(lines.items()) if (p := line.last()) is not None}
    if not lasts:
        body, legend = (
            f"<text x='{LEFT}' y='{HEIGHT // 2}' {FAINT}>no finite values yet</text>",
            [],
        )
    elif len(lasts) <= LINES:
        body, legend = _lines({r: lines[r].points() for r in lasts})
    else:
        body, legend = _band_body({r: lines[r] for r in lasts}, lasts)
    keys, rows = _legend(legend)
    height = HEIGHT + LEGEND_ROW * (rows - 1)
    title = escape(name) + (f" <tspan {FAINT}>({escape(run)})</tspan>" if show_run else "")
    return (
        f"<svg class='nbddp-chart' data-metric='{escape(name, quote=True)}' "
        f"xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' fill='currentColor' "
        f"style='font:11px sans-serif;max-width:100%;height:auto"
        f"{';color:#1a1a1a' if image else ''}'>"
        f"{IMAGE_STYLE if image else ''}"
        f"<text x='{LEFT}' y='14' font-weight='bold'>{title}</text>{body}{keys}</svg>"
    )


Legend = list[tuple[str, str]]  # (colour, text) each


def _lines(points: dict[int, list[tuple[int, float]]]) -> tuple[str, Legend]:
    frame = _Frame.around(points.values())
    parts, legend = [_axes(frame)], []
    for i, (rank, ps) in enumerate(points.items()):
        colour = COLOURS[i % len(COLOURS)]
        parts.append(_polyline(frame, ps, colour, f"rank {rank}"))
        legend.append((colour, f"{rank}: {_fmt(ps[-1][1])}"))
    return "".join(parts), legend


def _band_body(lines: dict[int, Line], lasts: dict[int, float]) -> tuple[str, Legend]:
    grid = _Grid(lines)
    far = _outlying(grid, lasts)
    band = grid.band(leave_out=far)  # the others': the outliers are lines of their own
    far_points = {r: lines[r].points() for r in far}
    edges = [[(s, lo), (s, hi)] for s, lo, _m, hi in band]
    frame = _Frame.around([*edges, *far_points.values()])
    upper = [(s, hi) for s, _lo, _m, hi in band]
    lower = [(s, lo) for s, lo, _m, _hi in reversed(band)]
    parts = [
        _axes(frame),
        f"<polygon class='nbddp-band' points='{frame.path(upper + lower)}' fill='{BAND}' "
        "fill-opacity='0.45' stroke='none'/>",
        _polyline(frame, [(s, m) for s, _lo, m, _hi in band], MEDIAN, "median", "nbddp-median"),
    ]
    for rank in far:
        parts.append(_polyline(frame, far_points[rank], OUTLIER, f"rank {rank}", "nbddp-outlier"))
    others = [r for r in lines if r not in far]
    legend = [(MEDIAN_INK, f"median of ranks {rank_set(others)}, band min-max")]
    if far:
        shown = ", ".join(f"{r} ({_fmt(lasts[r])})" for r in far)
        legend.append((OUTLIER, f"outlying: rank{'s' if len(far) > 1 else ''} {shown}"))
    return "".join(parts), legend


def _polyline(frame: _Frame, points, colour: str, label: str, cls: str = "nbddp-line") -> str:
    # the median's colour follows the theme (where color-mix is known; else the attribute's)
    paint = f"style='stroke:{MEDIAN_INK}' " if colour == MEDIAN else ""
    return (
        f"<polyline class='{cls}' {paint}data-label='{escape(label, quote=True)}' fill='none' "
        f"stroke='{colour}' stroke-width='1.3' points='{frame.path(points)}'>"
        f"<title>{escape(label)}</title></polyline>"
    )


def _axes(frame: _Frame) -> str:
    left, right = LEFT, WIDTH - RIGHT
    top, bottom = TOP, HEIGHT - BOTTOM
    x1 = frame.x0 + frame.xspan
    return (
        f"<rect x='{left}' y='{top}' width='{right - left}' height='{bottom - top}' "
        "fill='none' stroke='currentColor' stroke-opacity='0.3'/>"
        + _y_ticks(frame)
        + f"<text x='{left}' y='{bottom + 13}'>{int(frame.x0)}</text>"
        f"<text x='{right}' y='{bottom + 13}' text-anchor='end'>{int(x1)}</text>"
        f"<text x='{(left + right) / 2:.0f}' y='{bottom + 13}' text-anchor='middle' "
        f"{FAINT}>step</text>"
    )


def _y_ticks(frame: _Frame) -> str:
    """The y axis' labels at round values inside the data's range, each with a faint rule."""
    values = ticks(frame.low, frame.high)
    parts = []
    for value in values:
        y = frame.y(value)
        parts.append(
            f"<line class='nbddp-tick' x1='{LEFT}' x2='{WIDTH - RIGHT}' y1='{y:.1f}' "
            f"y2='{y:.1f}' stroke='currentColor' stroke-opacity='0.12'/>"
            f"<text class='nbddp-tick' x='{LEFT - 4}' y='{y + 4:.1f}' text-anchor='end'>"
            f"{tick_label(value, values)}</text>"
        )
    return "".join(parts)


def _legend(entries: Legend) -> tuple[str, int]:
    """The legend under the axes, wrapped to rows as wide as the chart: (svg, rows)."""
    out, x, y, rows = [], LEFT, HEIGHT - 6, 1
    for colour, text in entries:
        width = 20 + 6 * len(text)  # (about 6 px a character at 11 px)
        if x > LEFT and x + width > WIDTH:
            x, y, rows = LEFT, y + LEGEND_ROW, rows + 1
        out.append(
            f"<rect x='{x}' y='{y - 8}' width='10' height='3' style='fill:{colour}'/>"
            f"<text x='{x + 13}' y='{y}'>{escape(text)}</text>"
        )
        x += width
    return "".join(out), rows


def charts_html(charts: list[tuple[Key, dict[int, Line]]], own: str, images: bool = False) -> str:
    """Every chart of a cell, side by side; a run other than the cell's ``own`` is named.

    ``images``: each chart an ``<img>`` of its SVG (a data URI, its summary line as the
    alt text), for a finished cell's static HTML. Front ends sanitize the HTML of an
    untrusted notebook (one run by nbclient or received from someone), and inline SVG
    does not survive that; an image does, and GitHub and nbconvert draw it too."""
    if not charts:
        return ""
    parts = []
    for key, lines in charts:
        svg = chart_svg(key, lines, show_run=key[0] != own, image=images)
        if images:
            alt = summary_line(key, lines, own) or key[1]
            svg = (
                f"<img class='nbddp-chart' data-metric='{escape(key[1], quote=True)}' "
                f"style='max-width:100%;height:auto;filter:{CHART_IMAGE_FILTER}' "
                f"alt='{escape(alt, quote=True)}' "
                f"src='data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()}'/>"
            )
        parts.append(svg)
    style = "display:flex;flex-wrap:wrap;gap:6px"
    return f"<div class='nbddp-charts' style='{style}'>{''.join(parts)}</div>"


def summary_line(key: Key, lines: dict[int, Line], own: str) -> str | None:
    """One folded line for a metric: the latest step, the median, the lowest and the
    highest rank (``[ranks 0-3] loss @ step 499: median 0.51, min 0.49 (rank 2), ...``)."""
    lasts = {r: p for r, line in sorted(lines.items()) if (p := line.last()) is not None}
    if not lasts:
        return None
    run, name = key
    step = max(s for s, _ in lasts.values())
    values = {r: v for r, (_s, v) in lasts.items()}
    label = name if run == own else f"{name} ({run})"
    who = f"{'rank' if len(values) == 1 else 'ranks'} {rank_set(list(values))}"
    head = f"[{who}] {label} @ step {step}"
    if len(values) == 1:
        return f"{head}: {_fmt(next(iter(values.values())))}"
    low = min(values, key=values.get)
    high = max(values, key=values.get)
    text = (
        f"{head}: median {_fmt(statistics.median(values.values()))}, "
        f"min {_fmt(values[low])} (rank {low}), max {_fmt(values[high])} (rank {high})"
    )
    far = outlying({r: lines[r] for r in values}, values)
    if far:
        text += f"; outlying: {', '.join(f'rank {r}' for r in far)}"
    return text
