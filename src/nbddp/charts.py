"""The dashboard's metric charts as inline SVG, and their one-line text summaries.

One chart per metric, step on the x axis. Up to ``LINES`` ranks draw a line each; a
larger pool draws the median of its ranks, a band from the lowest to the highest, and
the ranks that stand out (:func:`outliers`) as lines of their own, named. The same SVG
is the live widget's and the finished cell's (saved notebooks, nbviewer and GitHub show
it): no script, no external style.
"""

from __future__ import annotations

import statistics
from html import escape

from .fold import rank_set
from .metric_store import Key, Line

__all__ = ["LINES", "chart_svg", "charts_html", "outliers", "summary_line"]

LINES = 8  # ranks drawn one line each; more draw a band
BAND_BUCKETS = 200  # x positions of the band
WIDTH, HEIGHT = 440, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 22, 34
COLOURS = (  # matplotlib's tab10
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
BAND, MEDIAN, OUTLIER = "#9ecae1", "#1f4e79", "#d62728"


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3g}"


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
        pad = (y1 - y0) * 0.04
        self.y0, self.y1 = y0 - pad, y1 + pad
        self.xspan = max(x1 - self.x0, 1)
        self.w, self.h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(self, step: float) -> float:
        return LEFT + (step - self.x0) / self.xspan * self.w

    def y(self, value: float) -> float:
        return TOP + (self.y1 - value) / (self.y1 - self.y0) * self.h

    def path(self, points) -> str:
        return " ".join(f"{self.x(s):.1f},{self.y(v):.1f}" for s, v in points)


def _band(lines: dict[int, list[tuple[int, float]]], x0: int, x1: int):
    """Per x bucket: (step, lowest, median, highest) of the ranks' mean there."""
    width = max((x1 - x0) / BAND_BUCKETS, 1e-12)
    sums: dict[int, dict[int, list[float]]] = {}
    for rank, points in lines.items():
        for step, value in points:
            b = min(int((step - x0) / width), BAND_BUCKETS - 1)
            sums.setdefault(b, {}).setdefault(rank, []).append(value)
    out = []
    for b in sorted(sums):
        means = sorted(sum(v) / len(v) for v in sums[b].values())
        out.append((x0 + (b + 0.5) * width, means[0], statistics.median(means), means[-1]))
    return out


def chart_svg(key: Key, lines: dict[int, Line], show_run: bool = True) -> str:
    """One metric's chart: a line per rank, or a band with the outliers named."""
    run, name = key
    points = {r: line.points() for r, line in sorted(lines.items())}
    points = {r: p for r, p in points.items() if p}
    title = escape(name) + (f" <tspan fill='#888'>({escape(run)})</tspan>" if show_run else "")
    head = (
        f"<svg class='nbddp-chart' data-metric='{escape(name, quote=True)}' "
        f"xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' style='font:11px sans-serif;background:#fff'>"
        f"<text x='{LEFT}' y='14' font-weight='bold'>{title}</text>"
    )
    if not points:
        empty = "no finite values yet"
        return head + f"<text x='{LEFT}' y='{HEIGHT // 2}' fill='#888'>{empty}</text></svg>"
    every = [p for ps in points.values() for p in ps]
    steps = [s for s, _ in every]
    values = [v for _, v in every]
    frame = _Frame((min(steps), max(steps)), (min(values), max(values)))
    parts = [head, _axes(frame)]
    lasts = {r: ps[-1][1] for r, ps in points.items()}
    legend: list[tuple[str, str]] = []
    if len(points) <= LINES:
        for i, (rank, ps) in enumerate(points.items()):
            colour = COLOURS[i % len(COLOURS)]
            parts.append(_polyline(frame, ps, colour, f"rank {rank}"))
            legend.append((colour, f"{rank}: {_fmt(ps[-1][1])}"))
    else:
        band = _band(points, frame.x0, frame.x0 + frame.xspan)
        upper = [(s, hi) for s, _lo, _m, hi in band]
        lower = [(s, lo) for s, lo, _m, _hi in reversed(band)]
        parts.append(
            f"<polygon class='nbddp-band' points='{frame.path(upper + lower)}' fill='{BAND}' "
            "fill-opacity='0.6' stroke='none'/>"
        )
        median = [(s, m) for s, _lo, m, _hi in band]
        parts.append(_polyline(frame, median, MEDIAN, "median", "nbddp-median"))
        far = outliers(lasts)
        for rank in far:
            parts.append(_polyline(frame, points[rank], OUTLIER, f"rank {rank}", "nbddp-outlier"))
        others = [r for r in points if r not in far]
        legend.append((MEDIAN, f"median of ranks {rank_set(others)}, band min-max"))
        if far:
            shown = ", ".join(f"{r} ({_fmt(lasts[r])})" for r in far)
            legend.append((OUTLIER, f"outlying: rank{'s' if len(far) > 1 else ''} {shown}"))
    parts.append(_legend(legend))
    parts.append("</svg>")
    return "".join(parts)


def _polyline(frame: _Frame, points, colour: str, label: str, cls: str = "nbddp-line") -> str:
    return (
        f"<polyline class='{cls}' data-label='{escape(label, quote=True)}' fill='none' "
        f"stroke='{colour}' stroke-width='1.3' points='{frame.path(points)}'>"
        f"<title>{escape(label)}</title></polyline>"
    )


def _axes(frame: _Frame) -> str:
    left, right = LEFT, WIDTH - RIGHT
    top, bottom = TOP, HEIGHT - BOTTOM
    x1 = frame.x0 + frame.xspan
    return (
        f"<rect x='{left}' y='{top}' width='{right - left}' height='{bottom - top}' "
        "fill='none' stroke='#ccc'/>"
        f"<text x='{left - 4}' y='{top + 8}' text-anchor='end'>{_fmt(frame.y1)}</text>"
        f"<text x='{left - 4}' y='{bottom}' text-anchor='end'>{_fmt(frame.y0)}</text>"
        f"<text x='{left}' y='{bottom + 13}'>{int(frame.x0)}</text>"
        f"<text x='{right}' y='{bottom + 13}' text-anchor='end'>{int(x1)}</text>"
        f"<text x='{(left + right) / 2:.0f}' y='{bottom + 13}' text-anchor='middle' "
        "fill='#888'>step</text>"
    )


def _legend(entries: list[tuple[str, str]]) -> str:
    out, x, y = [], LEFT, HEIGHT - 6
    for colour, text in entries:
        out.append(
            f"<rect x='{x}' y='{y - 8}' width='10' height='3' fill='{colour}'/>"
            f"<text x='{x + 13}' y='{y}'>{escape(text)}</text>"
        )
        x += 20 + 6 * len(text)
    return "".join(out)


def charts_html(charts: list[tuple[Key, dict[int, Line]]], own: str) -> str:
    """Every chart of a cell, side by side; a run other than the cell's ``own`` is named."""
    if not charts:
        return ""
    svgs = "".join(chart_svg(key, lines, show_run=key[0] != own) for key, lines in charts)
    return f"<div class='nbddp-charts' style='display:flex;flex-wrap:wrap;gap:6px'>{svgs}</div>"


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
    far = outliers(values)
    if far:
        text += f"; outlying: {', '.join(f'rank {r}' for r in far)}"
    return text
