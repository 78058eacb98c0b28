"""The dashboard as HTML: what each rank is (:class:`RankView`) and how it reads, for
the live widget (the header and the rows) and for the static view of a finished cell
(the same, then the folded logs). Pure functions of the views: no widget here."""

from __future__ import annotations

import html
from collections import Counter, deque

from . import protocol as P
from .fold import Group, rank_set

__all__ = ["FAILED_STATES", "STATE_COLOURS", "RankView"]

STATE_COLOURS = {
    "queued": "#888888",
    "running": "#1f6fb4",
    "done": "#2a8a2a",
    "failed": "#c62828",
    "interrupted": "#d9822b",
    "freed": "#d9822b",
    "dead": "#7f0000",
    "replaced": "#7f0000",  # dead, and a new process took its place
    "waiting": "#b8860b",
    "debugging": "#6a1b9a",
}
FAILED_STATES = ("failed", "dead", "replaced")


def _colour(state_text: str) -> str:
    """The colour of a state as shown: ``waiting in all_reduce (3 s)``, ``dead: new process``."""
    return STATE_COLOURS.get(state_text.split()[0].rstrip(":"), "#888888")


class RankView:
    """One rank as the dashboard shows it: state, times, progress and its own lines."""

    def __init__(self, keep: int) -> None:
        self.lines: deque[Group] = deque(maxlen=keep)  # the folded lines it printed
        self.count = 0
        self.state = "queued"
        self.started: float | None = None
        self.ended: float | None = None
        self.last = ""
        self.progress: P.RankProgress | None = None
        self.waiting: tuple[str, float] | None = None  # (collective, since) while blocked in it
        self.ops = -1  # collectives it issued on the default group (-1: not known)
        self.ops_at = 0.0  # when that count was first seen
        self.ahead = -1  # the others' count, when this rank is behind them

    def state_text(self, now: float) -> str:
        """``running``, ``waiting in all_reduce #12 (12 s)`` for a rank blocked in a
        collective, and ``behind: #10 of #12`` for a rank behind the others."""
        n = f" #{self.ops}" if self.ops >= 0 else ""
        behind = f", behind: #{self.ops} of #{self.ahead}" if self.ahead > self.ops >= 0 else ""
        if self.state == "running" and self.waiting is not None:
            op, since = self.waiting
            return f"waiting in {op}{n} ({now - since:.0f} s){behind}"
        if self.state == "replaced":
            return "dead: new process"
        return f"{self.state}{n and ', collective' + n}{behind}"

    def elapsed(self, now: float) -> float | None:
        return None if self.started is None else (self.ended or now) - self.started


Views = dict[int, RankView]


BEHIND_AFTER = 2.0  # a count below the others' and unchanged this long: behind


def mark_behind(views: Views, now: float) -> None:
    """The running ranks whose collective count has stayed below the others' for
    BEHIND_AFTER s are behind (a moment's difference is ranks sampled apart)."""
    counts = [v.ops for v in views.values() if v.state == "running" and v.ops >= 0]
    top = max(counts, default=-1)
    for v in views.values():
        stuck = v.state == "running" and 0 <= v.ops < top and now - v.ops_at >= BEHIND_AFTER
        v.ahead = top if stuck else -1


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def esc(text: str) -> str:
    return html.escape(text, quote=False)


def header_html(shown: int, world_size: int, facts: tuple[str, ...], elapsed: float) -> str:
    """``nbddp · 2 of 4 ranks · gloo · cpu · running · 1.5 s``; ``facts``: backend,
    devices and status."""
    backend, devices, status = facts
    parts = [
        f"<b>nbddp</b> · {shown} of {world_size} rank{'s' * (world_size > 1)}",
        esc(backend),
        esc(devices),
        f"<span class='nbddp-status'>{esc(status)}</span>",
        f"{elapsed:.1f} s",
    ]
    return "<div class='nbddp-header'>" + " · ".join(p for p in parts if p) + "</div>"


def rows_html(views: Views, hosts: dict[int, str], now: float, rows: int) -> str:
    """A row per rank; for more than ``rows`` ranks, the summary and the rows worth a look."""
    if len(views) <= rows:
        return table_html(views, sorted(views), hosts, now)
    return summary_line(views, now) + table_html(views, notable(views, now, rows), hosts, now)


def summary_line(views: Views, now: float) -> str:
    """Counts per state, the slowest ranks and the one furthest behind."""
    counts = Counter(v.state_text(now).split(" (")[0] for v in views.values())
    shown = " · ".join(
        f"<span style='color:{_colour(s)};font-weight:bold'>{n} {esc(s)}</span>"
        for s, n in sorted(counts.items(), key=lambda sn: -sn[1])
    )
    slow = slowest(views, now, 3)
    slowest_ = ", ".join(f"rank {r} ({views[r].elapsed(now):.1f} s)" for r in slow)
    progress = [(r, v.progress) for r, v in views.items() if v.progress is not None]
    behind = ""
    if progress:
        r, p = min(progress, key=lambda rp: (rp[1].done / (rp[1].total or 1), rp[0]))
        behind = f" · furthest behind: rank {r} {progress_html(p)}"
    return (
        f"<div class='nbddp-counts'>{shown}"
        + (f" · slowest: {slowest_}" if slowest_ else "")
        + behind
        + "</div>"
    )


def slowest(views: Views, now: float, n: int) -> list[int]:
    timed = [(v.elapsed(now), r) for r, v in views.items() if v.started is not None]
    return [r for _, r in sorted(timed, key=lambda er: (-er[0], er[1]))[:n]]


def notable(views: Views, now: float, rows: int) -> list[int]:
    """Ranks that failed or were stopped, then ranks in a state fewer share, then the
    slowest: at most ``rows`` rows."""
    counts = Counter(v.state for v in views.values())
    usual = counts.most_common(1)[0][0]
    bad = [r for r, v in views.items() if v.state not in ("running", "done", "queued")]
    odd = [r for r, v in views.items() if v.state != usual and r not in bad]
    shown = list(dict.fromkeys([*sorted(bad), *sorted(odd), *slowest(views, now, 3)]))
    return sorted(shown[:rows])


def table_html(views: Views, ranks: list[int], hosts: dict[int, str], now: float) -> str:
    return (
        "<table class='nbddp-ranks' style='border-collapse:collapse;font-size:90%'>"
        + "".join(_row_html(rank, views[rank], hosts.get(rank), now) for rank in ranks)
        + "</table>"
    )


def _row_html(rank: int, view: RankView, host: str | None, now: float) -> str:
    shown = view.state_text(now)
    colour = _colour(shown)
    style = "background:#fde7e7;" if view.state in FAILED_STATES else ""
    elapsed = view.elapsed(now)
    host_html = f" <span style='color:#888'>{esc(host)}</span>" if host else ""
    return (
        f"<tr class='nbddp-row nbddp-{view.state}' data-rank='{rank}' style='{style}'>"
        f"<td style='padding:1px 8px'>rank {rank}{host_html}</td>"
        f"<td style='padding:1px 8px;color:{colour};font-weight:bold'>{shown}</td>"
        "<td style='padding:1px 8px;text-align:right'>"
        f"{'' if elapsed is None else f'{elapsed:.1f} s'}</td>"
        f"<td style='padding:1px 8px'>{progress_html(view.progress)}</td>"
        "<td style='padding:1px 8px;font-family:monospace;max-width:60ch;"
        "overflow:hidden;text-overflow:ellipsis;white-space:nowrap'>"
        f"{esc(view.last[-300:])}</td></tr>"
    )


def progress_html(p: P.RankProgress | None) -> str:
    if p is None:
        return ""
    if p.total:
        pct = min(100.0, 100.0 * p.done / p.total)
        bar = (
            "<span style='display:inline-block;width:90px;height:8px;background:#e4e4e4;"
            f"vertical-align:middle'><span class='nbddp-bar' style='display:block;"
            f"width:{pct:.0f}%;height:8px;background:#1f6fb4'></span></span> "
        )
        count = f"{p.done}/{p.total}"
    else:
        bar, count = "", f"{p.done}"
    desc = f"{esc(p.desc)} " if p.desc else ""
    return f"<span class='nbddp-progress'>{bar}{desc}{count}</span>"


def pane_html(lines: list[Group], dropped: int, shown: int, labelled: bool) -> str:
    """A static scrolling log: the last ``shown`` lines, a note of the rest."""
    hidden = dropped + max(0, len(lines) - shown)
    body = "".join(
        (
            f"<span style='color:#b71c1c'>{esc(text)}</span>\n"
            if g.stream == "stderr"
            else esc(text) + "\n"
        )
        for g in lines[-shown:]
        for text in [f"[{rank_set(g.ranks)}] {g.text}" if labelled else g.text]
    )
    note = (
        f"<div class='nbddp-dropped' style='color:#888'>… {hidden} earlier lines not shown</div>"
        if hidden
        else ""
    )
    # column-reverse keeps the scroll at the bottom: the tail is always visible
    return (
        "<div class='nbddp-pane' style='max-height:320px;overflow-y:auto;display:flex;"
        "flex-direction:column-reverse'><div>"
        + note
        + "<pre style='margin:0;white-space:pre-wrap'>"
        + body
        + "</pre></div></div>"
    )


def all_log_html(log: deque[Group], dropped: int, tail: int, failed: bool) -> str:
    """Every rank's folded log, closed when a rank failed (its own log opens instead)."""
    return (
        f"<details class='nbddp-log nbddp-log-all'{'' if failed else ' open'}>"
        f"<summary>all ranks log ({_lines(len(log) + dropped)})</summary>"
        + pane_html(list(log), dropped, tail, labelled=True)
        + "</details>"
    )


def own_logs_html(views: Views, ranks: list[int], tail: int) -> str:
    """Each of ``ranks``' own log (the last ``tail`` lines; a failed rank's open, longer)."""
    parts = []
    for rank in ranks:
        view = views[rank]
        if not view.lines:
            continue
        bad = view.state in FAILED_STATES
        dropped = view.count - len(view.lines)
        parts.append(
            f"<details class='nbddp-log' data-rank='{rank}'{' open' if bad else ''}>"
            f"<summary>rank {rank} log ({_lines(view.count)})</summary>"
            + pane_html(list(view.lines), dropped, tail * 3 if bad else tail, False)
            + "</details>"
        )
    return "".join(parts)


def summary_text(views: Views, title: str, now: float, rows: int) -> str:
    """The text summary: ``title``, then a line per rank (for more than ``rows`` ranks,
    the counts per state and a line per rank worth a look)."""
    lines = [title]
    if len(views) > rows:
        counts = Counter(v.state for v in views.values())
        lines.append("  " + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    for rank in sorted(views) if len(views) <= rows else notable(views, now, rows):
        view = views[rank]
        lines.append(f"  rank {rank}: {view.state_text(now)}  {view.last[:100]}")
    return "\n".join(lines)
