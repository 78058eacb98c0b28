"""The dashboard as HTML: what each rank is (:class:`RankView`) and how it reads, for
the live widget (the header and the rows) and for the static view of a finished cell
(the same, then the folded logs). Pure functions of the views: no widget here."""

from __future__ import annotations

import html
from collections import Counter, deque

from ..wire import protocol as P
from . import theme as T
from .fold import Group, rank_set
from .fold_shape import is_progress
from .progress_fold import slowest_bar, spread

__all__ = ["FAILED_STATES", "STATE_COLOURS", "RankView"]

STATE_COLOURS = T.STATE_HUES  # each state's hue (shown mixed with the theme's text)
FAILED_STATES = ("failed", "dead", "replaced", "missing")


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
        self.bar = ""  # its tqdm bar's position, ``45/100`` (the bar shows folded, in the log)
        self.waiting: tuple[str, float] | None = None  # (collective, since) while blocked in it
        self.ops = -1  # collectives it issued on the default group (-1: not known)
        self.ops_at = 0.0  # when that count was first seen
        self.ahead = -1  # the others' count, when this rank is behind them
        self.host = ""  # its host, once that host was lost (its state: missing)

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
        if self.state == "missing":  # its host was lost: it waits for a replacement host
            return f"missing (host {self.host} lost)" if self.host else "missing (host lost)"
        if self.state == "done":  # its count was sampled while it ran: it is behind no one
            return "done"
        return f"{self.state}{n and ', collective' + n}{behind}"

    def elapsed(self, now: float) -> float | None:
        return None if self.started is None else (self.ended or now) - self.started


Views = dict[int, RankView]


BEHIND_AFTER = 2.0  # a count below the others' and unchanged this long: behind


def mark_behind(views: Views, now: float) -> None:
    """The running ranks whose collective count has stayed below the others' for
    BEHIND_AFTER s are behind (a moment's difference is ranks sampled apart)."""
    running = [v for v in views.values() if v.state == "running" and v.ops >= 0]
    top = max((v.ops for v in running), default=-1)
    # the others must have been ahead that long too: a sample's replies arrive one by one,
    # and the first of a new round must not make the ranks not yet heard from look behind
    top_at = min((v.ops_at for v in running if v.ops == top), default=now)
    ahead_long = now - top_at >= BEHIND_AFTER
    for v in views.values():
        v.ahead = -1
    for v in running:
        if ahead_long and v.ops < top and now - v.ops_at >= BEHIND_AFTER:
            v.ahead = top


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
    folded = folded_progress_html(views)
    if len(views) <= rows:
        return folded + table_html(views, sorted(views), hosts, now, bars=not folded)
    shown = notable(views, now, rows)
    return summary_line(views, now) + folded + table_html(views, shown, hosts, now, bars=False)


def folded_progress_html(views: Views) -> str:
    """Every rank's ``nbddp.progress`` as one bar: the slowest rank's, with how far the
    others got ('' for fewer than two ranks with a bar)."""
    progress = {r: v.progress for r, v in views.items() if v.progress is not None}
    if len(progress) < 2:
        return ""
    rank, slow, fast = slowest_bar(progress)
    where = f"slowest: rank {rank}" + (f"; the others up to {fast}" if spread(progress) else "")
    if all(p.total and p.done >= p.total for p in progress.values()):
        where = "all done"  # (their totals may differ)
    return (
        f"<div class='nbddp-progress-all'>{progress_html(slow)} "
        f"<span style='color:#888'>({len(progress)} ranks; {where})</span>"
        "</div>"
    )


def summary_line(views: Views, now: float) -> str:
    """Counts per state, the slowest ranks and the one furthest behind."""
    counts = Counter(v.state_text(now).split(" (")[0] for v in views.values())
    shown = " · ".join(
        f"<span style='color:{T.state_colour(s)};font-weight:bold'>{n} {esc(s)}</span>"
        for s, n in sorted(counts.items(), key=lambda sn: -sn[1])
    )
    slow = slowest(views, now, 3)
    slowest_ = ", ".join(f"rank {r} ({views[r].elapsed(now):.1f} s)" for r in slow)
    return (
        f"<div class='nbddp-counts'>{shown}"
        + (f" · slowest: {slowest_}" if slowest_ else "")
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


def table_html(
    views: Views, ranks: list[int], hosts: dict[int, str], now: float, bars: bool = True
) -> str:
    """The rows of ``ranks``; ``bars=False``: progress as counts (one folded bar above)."""
    return (
        "<table class='nbddp-ranks' style='border-collapse:collapse;font-size:90%'>"
        + "".join(_row_html(rank, views[rank], hosts.get(rank), now, bars) for rank in ranks)
        + "</table>"
    )


def _row_html(rank: int, view: RankView, host: str | None, now: float, bars: bool) -> str:
    shown = view.state_text(now)
    colour = T.state_colour(shown)
    style = f"background:{T.FAILED_ROW};" if view.state in FAILED_STATES else ""
    elapsed = view.elapsed(now)
    host_html = f" <span style='color:{T.MUTED}'>{esc(host)}</span>" if host else ""
    cell = "padding:1px 8px;text-align:left"  # (a front end's tables may align right)
    return (
        f"<tr class='nbddp-row nbddp-{view.state}' data-rank='{rank}' style='{style}'>"
        f"<td style='{cell}'>rank {rank}{host_html}</td>"
        f"<td style='{cell};color:{colour};font-weight:bold'>{esc(shown)}</td>"
        "<td style='padding:1px 8px;text-align:right'>"
        f"{'' if elapsed is None else f'{elapsed:.1f} s'}</td>"
        f"<td style='{cell}'>{progress_html(view.progress, bars) or _count_html(view.bar)}</td>"
        f"<td style='{cell};{T.CODE_FONT};max-width:60ch;"
        "overflow:hidden;text-overflow:ellipsis;white-space:nowrap'>"
        f"{esc(view.last[-300:])}</td></tr>"
    )


def _count_html(count: str) -> str:
    return f"<span class='nbddp-progress'>{esc(count)}</span>" if count else ""


def progress_html(p: P.RankProgress | None, bar: bool = True) -> str:
    if p is None:
        return ""
    if not bar:
        total = f"/{p.total}" if p.total else ""
        return f"<span class='nbddp-progress'>{p.done}{total}</span>"
    if p.total:
        pct = min(100.0, 100.0 * p.done / p.total)
        bar = (
            f"<span style='display:inline-block;width:90px;height:8px;background:{T.TRACK};"
            f"vertical-align:middle'><span class='nbddp-bar' style='display:block;"
            f"width:{pct:.0f}%;height:8px;background:{T.BAR}'></span></span> "
        )
        count = f"{p.done}/{p.total}"
    else:
        bar, count = "", f"{p.done}"
    desc = f"{esc(p.desc)} " if p.desc else ""
    return f"<span class='nbddp-progress'>{bar}{desc}{count}</span>"


def shown_stream(group: Group) -> str:
    """The stream a line is shown as: ``stderr`` (in an error's colour) for what a rank
    wrote to stderr but a tqdm bar, shown as ``progress`` (plain): a finished bar in red
    made a cell that went well look failed. Tracebacks and warnings stay ``stderr``."""
    if group.stream == "stderr" and is_progress(group.text):
        return "progress"
    return group.stream


def pane_html(lines: list[Group], dropped: int, shown: int, rank: int | None) -> str:
    """A static scrolling log: the last ``shown`` lines (every rank's, folded and labelled;
    or ``rank``'s own), a note of the rest."""
    hidden = dropped + max(0, len(lines) - shown)
    body = "".join(
        (
            f"<span style='color:{T.STDERR}'{title}>{esc(text)}</span>\n"
            if shown_stream(g) == "stderr"
            else (f"<span{title}>{esc(text)}</span>\n" if title else esc(text) + "\n")
        )
        for g in lines[-shown:]
        for text in [f"[{rank_set(g.ranks)}] {g.text}" if rank is None else g.line_of(rank)]
        for title in [_title(g.detail) if rank is None else ""]
    )
    note = (
        f"<div class='nbddp-dropped' style='color:{T.MUTED}'>"
        f"… {hidden} earlier lines not shown</div>"
        if hidden
        else ""
    )
    # opens at its top: its first line and the note of what came before in view
    return (
        "<div class='nbddp-pane' style='max-height:320px;overflow-y:auto'>"
        + note
        + f"<pre style='margin:0;white-space:pre-wrap;{T.CODE_FONT}'>"
        + body
        + "</pre></div>"
    )


def _title(detail: str) -> str:
    """A folded line's values, each rank's, shown when it is pointed at."""
    return f" class='nbddp-folded' title='{html.escape(detail, quote=True)}'" if detail else ""


def all_log_html(log: deque[Group], dropped: int, tail: int, failed: bool) -> str:
    """Every rank's folded log, closed when a rank failed (its own log opens instead)."""
    return (
        f"<details class='nbddp-log nbddp-log-all'{'' if failed else ' open'}>"
        f"<summary>all ranks log ({_lines(len(log) + dropped)})</summary>"
        + pane_html(list(log), dropped, tail, None)
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
            + pane_html(list(view.lines), dropped, tail * 3 if bad else tail, rank)
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
