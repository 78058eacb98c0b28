"""Sinks: where a cell's events are shown. A sink renders; it never steers the pool.

- :class:`Dashboard`: the live view of a cell in front ends with widgets: one
  anywidget per cell (a header, a row per rank or, for large pools, a summary
  with the rows that differ, and the folded log of every rank or of one).
  Updates are throttled and send only the parts that changed; when the cell
  ends the widget is replaced by static HTML and closed in the kernel.
- :class:`TextSink`: ``[rank N] line`` as lines arrive (terminal IPython,
  ``--text``), or nothing unless a rank fails (``--quiet``).

Both fold output (:mod:`nbddp.fold`): a line several ranks print shows once as
``[ranks 0-31] line``; ``fold=False`` shows every rank's line. Both show rich
output (``display`` and figures from the display ranks) in the cell's output,
below the dashboard.
"""

from __future__ import annotations

import contextlib
import html
import itertools
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Protocol, TextIO

from . import protocol as P
from .fold import Folder, Group, rank_set

__all__ = ["Dashboard", "Sink", "TextSink"]

STATE_COLOURS = {
    "queued": "#888888",
    "running": "#1f6fb4",
    "done": "#2a8a2a",
    "failed": "#c62828",
    "interrupted": "#d9822b",
    "freed": "#d9822b",
    "dead": "#7f0000",
    "waiting": "#b8860b",
    "debugging": "#6a1b9a",
}
FAILED_STATES = ("failed", "dead")
FOLD_WINDOW = 0.25  # seconds a line waits for the same line from the other ranks


class Sink(Protocol):
    def handle(self, event: object) -> None: ...

    def close(self, end: P.CellEnd | None) -> None: ...


class Lines:
    """Text chunks in, whole lines out; a carriage return rewrites the line so far."""

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str) -> list[str]:
        *lines, self.partial = (self.partial + text).split("\n")
        return [self.settle(line) for line in lines]

    @staticmethod
    def settle(line: str) -> str:
        if "\r" in line:  # a progress bar: its last state is the line
            stripped = line.rstrip("\r")
            line = stripped.rsplit("\r", 1)[-1]
        return line

    @property
    def current(self) -> str:
        """The unfinished line as it reads now (what a terminal would show)."""
        return self.settle(self.partial)

    def flush(self) -> list[str]:
        rest, self.partial = self.current, ""
        return [rest] if rest else []


def show_rich(event: P.RankDisplay) -> None:
    """Put a rank's rich output in the cell's output area."""
    from IPython.display import display

    display(event.data, metadata=event.metadata, raw=True)


class _Folding:
    """What both sinks share: each rank's partial lines, fed whole into a :class:`Folder`."""

    def __init__(self, ranks, fold: bool, window: float, clock) -> None:
        self.clock = clock
        self.folder = Folder(ranks, window=window if fold else 0)
        self._partial: dict[tuple[int, str], Lines] = {}

    def lines(self, rank: int, stream: str) -> Lines:
        key = (rank, stream)
        if key not in self._partial:
            self._partial[key] = Lines()
        return self._partial[key]

    def output(self, event: P.Output) -> list[Group]:
        lines = self.lines(event.rank, event.stream).feed(event.text)
        return self.folder.feed_lines(event.rank, event.stream, lines, self.clock())

    def _unfinished(self, rank: int) -> list[Group]:
        """The rank's unfinished lines, counted as lines from now on."""
        out = []
        for stream in ("stdout", "stderr"):
            out += self.folder.feed_lines(
                rank, stream, self.lines(rank, stream).flush(), self.clock()
            )
        return out

    def settle(self, rank: int) -> list[Group]:
        """``rank`` ended: its unfinished lines count as lines, and nothing waits for it."""
        return self._unfinished(rank) + self.folder.finish(rank, self.clock())

    def state(self, event: P.RankState) -> list[Group]:
        if event.state == "running":
            self.folder.expect(event.rank)
            return []
        return self.settle(event.rank)

    def result_lines(self, event: P.RankResult) -> list[Group]:
        out = self._unfinished(event.rank)  # what it printed before comes first
        shown = [
            f"{'Out: ' if i == 0 else '     '}{line}"
            for i, line in enumerate(event.value_repr.splitlines() or [""])
        ]
        return out + self.folder.feed_lines(event.rank, "stdout", shown, self.clock())

    def due(self) -> list[Group]:
        return self.folder.due(self.clock())

    def flush(self) -> list[Group]:
        out = []
        for rank in sorted({rank for rank, _ in self._partial}):
            out += self._unfinished(rank)
        return out + self.folder.flush()


# ---------------------------------------------------------------- text


class TextSink:
    """Lines as ``[rank N] text`` (folded: ``[ranks 0-3] text``), live; the first ``head``
    folded lines as they come, then the last ``tail``; ``quiet`` holds them back unless a
    rank fails, and then shows the failed ranks' lines."""

    def __init__(
        self,
        *,
        quiet: bool = False,
        fold: bool = True,
        head: int = 5000,
        tail: int = 1000,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        hosts: dict[int, str] | None = None,
        clock=time.monotonic,
        window: float = FOLD_WINDOW,
    ) -> None:
        self.quiet = quiet
        self.hosts = dict(hosts or {})
        self._fold = _Folding((), fold, window, clock)
        self._head = head
        self._out = stdout
        self._err = stderr
        self._shown = 0
        self._tail: deque[Group] = deque(maxlen=tail)
        self._dropped = 0
        self._held: dict[int, deque[Group]] = {}  # quiet: each rank's last lines

    def _tag(self, group: Group) -> str:
        if len(group.ranks) == 1 and group.ranks[0] in self.hosts:
            return f"[rank {group.ranks[0]}@{self.hosts[group.ranks[0]]}]"
        return f"[{group.label}]"

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def handle(self, event: object) -> None:
        if isinstance(event, P.Output):
            self._take(self._fold.output(event))
        elif isinstance(event, P.RankStates):
            for one in event.each():
                self.handle(one)
        elif isinstance(event, P.RankState):
            self._take(self._fold.state(event))
        elif isinstance(event, P.RankResult) and event.value_repr is not None and not self.quiet:
            self._take(self._fold.result_lines(event))
        elif isinstance(event, P.RankDisplay) and not self.quiet:
            self._take(self._fold.flush())  # the lines printed before it come first
            self._stream("stdout").flush()
            show_rich(event)
        elif isinstance(event, P.RankDebug):  # pdb's session follows: what came before first
            self._take(self._fold.flush())
            self._stream("stdout").flush()
            self._stream("stderr").flush()
        else:
            self._take(self._fold.due())

    def _take(self, groups: list[Group]) -> None:
        for group in groups:
            if self.quiet:
                for rank in group.ranks:
                    self._held.setdefault(rank, deque(maxlen=self._head + self._tail.maxlen))
                    self._held[rank].append(group)
            elif self._shown < self._head:
                self._shown += 1
                self._write(group)
            else:
                if len(self._tail) == self._tail.maxlen:
                    self._dropped += 1
                self._tail.append(group)

    def _write(self, group: Group) -> None:
        self._stream(group.stream).write(f"{self._tag(group)} {group.text}\n")

    def close(self, end: P.CellEnd | None) -> None:
        self._take(self._fold.flush())
        if self.quiet:
            failed = set() if end is None else set(end.errors) | set(end.exits)
            shown = {id(g): g for r in sorted(failed) for g in self._held.get(r, ())}
            for group in sorted(shown.values(), key=lambda g: g.seq):
                self._write(group)
        else:
            if self._dropped:
                self._stream("stderr").write(f"[nbddp] ... {self._dropped} lines not shown ...\n")
            for group in self._tail:
                self._write(group)
            self._tail.clear()
        for out in (self._stream("stdout"), self._stream("stderr")):
            out.flush()


# ---------------------------------------------------------------- the live dashboard


class _RankView:
    def __init__(self, keep: int) -> None:
        self.lines: deque[Group] = deque(maxlen=keep)  # the folded lines it printed
        self.count = 0
        self.state = "queued"
        self.started: float | None = None
        self.ended: float | None = None
        self.last = ""
        self.progress: P.RankProgress | None = None
        self.waiting: tuple[str, float] | None = None  # (collective, since) while blocked in it

    def state_text(self, now: float) -> str:
        """``running``, or ``waiting in all_reduce (12 s)`` for a rank blocked in a collective."""
        if self.state == "running" and self.waiting is not None:
            op, since = self.waiting
            return f"waiting in {op} ({now - since:.0f} s)"
        return self.state

    def elapsed(self, now: float) -> float | None:
        return None if self.started is None else (self.ended or now) - self.started


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


_WIDGET_CLASS = None
_LAYOUT = None


def _widget(**state):
    """One anywidget (one comm) per cell; every dashboard shares a single layout model."""
    global _WIDGET_CLASS, _LAYOUT
    if _WIDGET_CLASS is None:
        import anywidget
        import ipywidgets
        import traitlets as t

        class DashboardWidget(anywidget.AnyWidget):
            # declared on the class, not added per instance as AnyWidget.__init__ does
            # (add_traits makes a class for every widget: 1.7 ms a cell, measured)
            _esm = t.Unicode(Path(__file__).with_name("dashboard.js").read_text()).tag(sync=True)
            _anywidget_id = t.Unicode("nbddp.dashboard.DashboardWidget").tag(sync=True)
            ranks = t.List(t.Int()).tag(sync=True)
            header = t.Unicode().tag(sync=True)
            rows = t.Unicode().tag(sync=True)
            lines = t.List().tag(sync=True)  # [rank set, stream, text], the live tail
            hidden = t.Int().tag(sync=True)  # lines before that tail
            focus = t.Int(-1).tag(sync=True)  # the rank whose log opens (the first failure)

            def __init__(self, **kwargs) -> None:
                if _in_colab():
                    from google.colab import output

                    output.enable_custom_widget_manager()
                ipywidgets.DOMWidget.__init__(self, **kwargs)

        _WIDGET_CLASS, _LAYOUT = DashboardWidget, ipywidgets.Layout()
    return _WIDGET_CLASS(layout=_LAYOUT, **state)


@contextlib.contextmanager
def _flush_only_pending():
    """Display without waiting on the kernel's output thread when nothing is printed.

    ipykernel flushes stdout and stderr before every display message (so printed
    text stays before it), and each flush waits for its I/O thread: about 0.7 ms a
    stream on this machine, 3 ms a cell. A stream with no write pending since its
    last flush has nothing to put first, so only streams with pending output are
    flushed here.
    """
    from IPython import get_ipython

    pub = getattr(get_ipython(), "display_pub", None)
    if pub is None or "_flush_streams" not in type(pub).__dict__:
        yield
        return

    def flush_pending() -> None:
        for stream in (sys.stdout, sys.stderr):
            if getattr(stream, "_flush_pending", True):
                stream.flush()

    pub._flush_streams = flush_pending
    try:
        yield
    finally:
        del pub._flush_streams


def _in_colab() -> bool:
    return "google.colab" in sys.modules


class Dashboard:
    """One cell's live view: a single widget with a header, the ranks and the folded log.

    ``interval`` seconds at least between two renders; a render sends only the
    parts that changed, in one message. Pools of more than ``ROWS`` ranks show
    counts per state, the slowest ranks and the rows that differ from the rest.
    """

    LIVE_LINES = 400  # folded lines the live log holds
    FROZEN_LINES = 1000  # lines each log of a finished cell's static view keeps
    ROWS = 16  # larger pools show a summary instead of a row per rank
    OWN_LOGS = 8  # larger pools keep only the notable ranks' own logs when frozen

    def __init__(
        self,
        ranks: list[int],
        *,
        world_size: int,
        backend: str = "",
        devices: str = "",
        keep: int = 3000,
        interval: float = 0.3,
        clock=time.monotonic,
        hosts: dict[int, str] | None = None,
        fold: bool = True,
        window: float = FOLD_WINDOW,
    ) -> None:
        self.ranks = list(ranks)
        self.world_size = world_size
        self.backend, self.devices = backend, devices
        self.keep, self.interval, self.clock = keep, interval, clock
        self.hosts = dict(hosts or {})
        self.views = {r: _RankView(keep) for r in self.ranks}
        self._fold = _Folding(self.ranks, fold, window, clock)
        self.log: deque[Group] = deque(maxlen=keep)
        self.dropped = 0
        self._log_dirty = False
        self.started = clock()
        self.ended: float | None = None
        self.status = "running"
        self.notes: list[str] = []
        self._last_render = float("-inf")
        self.renders = 0
        self.widget = _widget(ranks=self.ranks)
        self._handle = None
        self._render(force=True)

    # -- display in the notebook

    def bundle(self) -> dict:
        """What the cell output holds while it runs: the live widget, with a static
        summary beside it (for front ends without widgets)."""
        return {
            "text/plain": self.summary_text(),
            "text/html": self.summary_html(),
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self.widget.model_id,
            },
        }

    def show(self) -> Dashboard:
        from IPython.display import display

        with _flush_only_pending():
            self._handle = display(self.bundle(), raw=True, display_id=True)
        return self

    # -- events

    def handle(self, event: object) -> None:
        if isinstance(event, P.RankStates):  # many ranks, one render
            for one in event.each():
                if one.rank in self.views:
                    self._state(one.rank, self.views[one.rank], one)
            self._render()
            return
        view = self.views.get(getattr(event, "rank", None))
        if isinstance(event, P.Output):
            if view is None:  # a rank outside the cell printed (a background thread)
                view = self.views[event.rank] = _RankView(self.keep)
            self._take(self._fold.output(event))
            current = self._fold.lines(event.rank, event.stream).current
            if current:
                view.last = current
        elif isinstance(event, P.RankState) and view is not None:
            self._state(event.rank, view, event)
        elif isinstance(event, P.RankResult) and view is not None:
            if event.value_repr is not None:
                self._take(self._fold.result_lines(event))
        elif isinstance(event, P.RankProgress) and view is not None:
            view.progress = event
        elif isinstance(event, P.RankDisplay):
            show_rich(event)
        elif isinstance(event, P.RankWhere) and view is not None:
            view.waiting = (event.waiting, event.since) if event.waiting else None
        elif isinstance(event, P.RankDebug) and view is not None:
            view.state = "debugging"  # until its next state: shown now, pdb waits for a line
            self._render(force=True)
            return
        self._render()

    def _state(self, rank: int, view: _RankView, event: P.RankState) -> None:
        now = self.clock()
        if event.state == "running" and view.started is None:
            view.started = now
        elif event.state != "running":
            view.ended, view.waiting = now, None
        self._take(self._fold.state(event))
        view.state = event.state
        if event.state in FAILED_STATES and self.widget.focus < 0:  # the first failure's log opens
            self.widget.focus = rank

    def _take(self, groups: list[Group]) -> None:
        for group in groups:
            if len(self.log) == self.log.maxlen:
                self.dropped += 1
            self.log.append(group)
            for rank in group.ranks:
                view = self.views.get(rank)
                if view is not None:
                    view.lines.append(group)
                    view.count += 1
                    view.last = group.text
            self._log_dirty = True

    # -- rendering

    def _render(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_render < self.interval:
            return
        self._last_render = now
        self.renders += 1
        self._take(self._fold.due())
        w = self.widget
        with w.hold_sync():  # one message with the parts that changed
            w.header = self._header_html(now)
            w.rows = self._rows_html(now)
            if self._log_dirty:
                self._log_dirty = False
                start = max(0, len(self.log) - self.LIVE_LINES)
                w.lines = [
                    [rank_set(g.ranks), g.stream, g.text]
                    for g in itertools.islice(self.log, start, None)
                ]
                w.hidden = self.dropped + start

    def _header_html(self, now: float) -> str:
        elapsed = (self.ended or now) - self.started
        parts = [
            f"<b>nbddp</b> · {len(self.ranks)} of {self.world_size} rank"
            f"{'s' * (self.world_size > 1)}",
            _esc(self.backend),
            _esc(self.devices),
            f"<span class='nbddp-status'>{_esc(self.status)}</span>",
            f"{elapsed:.1f} s",
        ]
        return "<div class='nbddp-header'>" + " · ".join(p for p in parts if p) + "</div>"

    def _rows_html(self, now: float) -> str:
        """A row per rank; for large pools, the summary and the rows worth a look."""
        if len(self.views) <= self.ROWS:
            return self._table_html(sorted(self.views), now)
        return self._summary_line(now) + self._table_html(self._notable(now), now)

    def _summary_line(self, now: float) -> str:
        counts = Counter(v.state_text(now).split(" (")[0] for v in self.views.values())
        shown = " · ".join(
            f"<span style='color:{STATE_COLOURS.get(s.split()[0], '#888888')};font-weight:bold'>"
            f"{n} {_esc(s)}</span>"
            for s, n in sorted(counts.items(), key=lambda sn: -sn[1])
        )
        slow = self._slowest(now, 3)
        slowest = ", ".join(f"rank {r} ({self.views[r].elapsed(now):.1f} s)" for r in slow)
        progress = [(r, v.progress) for r, v in self.views.items() if v.progress is not None]
        behind = ""
        if progress:
            r, p = min(progress, key=lambda rp: (rp[1].done / (rp[1].total or 1), rp[0]))
            behind = f" · furthest behind: rank {r} {self._progress_html(p)}"
        return (
            f"<div class='nbddp-counts'>{shown}"
            + (f" · slowest: {slowest}" if slowest else "")
            + behind
            + "</div>"
        )

    def _slowest(self, now: float, n: int) -> list[int]:
        timed = [(v.elapsed(now), r) for r, v in self.views.items() if v.started is not None]
        return [r for _, r in sorted(timed, key=lambda er: (-er[0], er[1]))[:n]]

    def _notable(self, now: float) -> list[int]:
        """Ranks that failed or were stopped, then ranks in a state fewer share, then the
        slowest: at most ``ROWS`` rows."""
        counts = Counter(v.state for v in self.views.values())
        usual = counts.most_common(1)[0][0]
        bad = [r for r, v in self.views.items() if v.state not in ("running", "done", "queued")]
        odd = [r for r, v in self.views.items() if v.state != usual and r not in bad]
        rows = list(dict.fromkeys([*sorted(bad), *sorted(odd), *self._slowest(now, 3)]))
        return sorted(rows[: self.ROWS])

    def _table_html(self, ranks: list[int], now: float) -> str:
        rows = []
        for rank in ranks:
            view = self.views[rank]
            shown = view.state_text(now)
            colour = STATE_COLOURS.get(shown.split()[0], "#888888")
            failed = view.state in FAILED_STATES
            style = "background:#fde7e7;" if failed else ""
            elapsed = view.elapsed(now)
            rows.append(
                f"<tr class='nbddp-row nbddp-{view.state}' data-rank='{rank}' style='{style}'>"
                f"<td style='padding:1px 8px'>rank {rank}{self._host(rank)}</td>"
                f"<td style='padding:1px 8px;color:{colour};font-weight:bold'>{shown}</td>"
                "<td style='padding:1px 8px;text-align:right'>"
                f"{'' if elapsed is None else f'{elapsed:.1f} s'}</td>"
                f"<td style='padding:1px 8px'>{self._progress_html(view.progress)}</td>"
                "<td style='padding:1px 8px;font-family:monospace;max-width:60ch;"
                "overflow:hidden;text-overflow:ellipsis;white-space:nowrap'>"
                f"{_esc(view.last[-300:])}</td></tr>"
            )
        return (
            "<table class='nbddp-ranks' style='border-collapse:collapse;font-size:90%'>"
            + "".join(rows)
            + "</table>"
        )

    def _host(self, rank: int) -> str:
        host = self.hosts.get(rank)
        return f" <span style='color:#888'>{_esc(host)}</span>" if host else ""

    @staticmethod
    def _progress_html(p: P.RankProgress | None) -> str:
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
        desc = f"{_esc(p.desc)} " if p.desc else ""
        return f"<span class='nbddp-progress'>{bar}{desc}{count}</span>"

    @staticmethod
    def _pane_html(lines: list[Group], dropped: int, shown: int, labelled: bool) -> str:
        """A static scrolling log: the last ``shown`` lines, a note of the rest."""
        hidden = dropped + max(0, len(lines) - shown)
        lines = lines[-shown:]
        body = "".join(
            (
                f"<span style='color:#b71c1c'>{_esc(text)}</span>\n"
                if g.stream == "stderr"
                else _esc(text) + "\n"
            )
            for g in lines
            for text in [f"[{rank_set(g.ranks)}] {g.text}" if labelled else g.text]
        )
        note = (
            f"<div class='nbddp-dropped' style='color:#888'>… {hidden} earlier lines "
            "not shown</div>"
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

    # -- the end

    def close(self, end: P.CellEnd | None) -> None:
        self.ended = self.clock()
        self._take(self._fold.flush())
        if end is None:
            self.status = "stopped"
        elif end.interrupted:
            self.status = "timed out" if end.interrupted == "timeout" else "interrupted"
        elif end.errors or end.exits:
            self.status = "failed"
        else:
            self.status = "done"
        self.notes = list(end.notes) if end else []
        if self._handle is None:  # not shown: the widget is all there is to read
            self._render(force=True)
        self.freeze()  # shown: its static rendering replaces it, no last widget update

    def frozen_bundle(self) -> dict:
        """A finished cell's output: static HTML and text, no widget state."""
        return {
            "text/plain": self.summary_text(),
            "text/html": self.summary_html(self.FROZEN_LINES, all_ranks=True),
        }

    def freeze(self) -> None:
        """Replace the live widget by its static rendering and close it in the kernel:
        nothing accumulates across cells, in the kernel, in the front ends or in the
        saved notebook."""
        if self._handle is not None:
            with _flush_only_pending():
                self._handle.update(self.frozen_bundle(), raw=True)
        self.widget.close()

    def summary_text(self) -> str:
        now = self.ended or self.clock()
        lines = [f"nbddp: {len(self.ranks)} ranks, {self.status}"]
        if len(self.views) > self.ROWS:
            counts = Counter(v.state for v in self.views.values())
            lines.append("  " + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
        for rank in sorted(self.views) if len(self.views) <= self.ROWS else self._notable(now):
            view = self.views[rank]
            lines.append(f"  rank {rank}: {view.state}  {view.last[:100]}")
        return "\n".join(lines)

    def summary_html(self, tail: int = 20, all_ranks: bool = False) -> str:
        """A static view for readers without a live kernel (saved notebooks, GitHub):
        the header, the rows, then the folded log of every rank (with ``all_ranks``; open
        when no rank failed) and each rank's own log (the last ``tail`` lines, a failed
        rank's open; beyond OWN_LOGS ranks, only the failed, odd and slowest ranks')."""
        now = self.ended or self.clock()
        parts = [self._header_html(now), self._rows_html(now)]
        failed = any(v.state in FAILED_STATES for v in self.views.values())
        if all_ranks and self.log:
            parts.append(
                f"<details class='nbddp-log nbddp-log-all'{'' if failed else ' open'}>"
                f"<summary>all ranks log ({len(self.log) + self.dropped} lines)</summary>"
                + self._pane_html(list(self.log), self.dropped, tail, labelled=True)
                + "</details>"
            )
        own = sorted(self.views) if len(self.views) <= self.OWN_LOGS else self._notable(now)
        for rank in own:
            view = self.views[rank]
            if not view.lines:
                continue
            bad = view.state in FAILED_STATES
            dropped = view.count - len(view.lines)
            parts.append(
                f"<details class='nbddp-log' data-rank='{rank}'{' open' if bad else ''}>"
                f"<summary>rank {rank} log ({view.count} lines)</summary>"
                + self._pane_html(list(view.lines), dropped, tail * 3 if bad else tail, False)
                + "</details>"
            )
        return "<div class='nbddp-summary'>" + "".join(parts) + "</div>"
