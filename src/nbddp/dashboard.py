"""Sinks: where a cell's events are shown. A sink renders; it never steers the pool.

- :class:`Dashboard`: the ipywidgets view of a cell (front ends with widgets):
  a header, one row per rank (state, elapsed, progress, last line), and tabs
  with every rank's log interleaved and each rank's own. Updates are
  throttled; logs are bounded; the saved notebook keeps a static summary.
- :class:`TextSink`: ``[rank N] line`` as lines arrive (terminal IPython,
  ``--text``), or nothing unless a rank fails (``--quiet``).

Both show rich output (``display`` and figures from the display ranks) in the
cell's output, below the dashboard.
"""

from __future__ import annotations

import html
import sys
import time
from collections import deque
from typing import Protocol, TextIO

from . import protocol as P

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
}
FAILED_STATES = ("failed", "dead")


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


# ---------------------------------------------------------------- text


class _RankLog:
    """One rank's lines in one cell: the first ``head`` shown live, then a bounded tail."""

    def __init__(self, head: int, tail: int) -> None:
        self.lines = {"stdout": Lines(), "stderr": Lines()}
        self.shown = 0
        self.head = head
        self.tail: deque[tuple[str, str]] = deque(maxlen=tail)
        self.total = 0


class TextSink:
    """Lines as ``[rank N] text``, live; bounded; ``quiet`` holds them back unless a rank fails."""

    def __init__(
        self,
        *,
        quiet: bool = False,
        head: int = 5000,
        tail: int = 1000,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        hosts: dict[int, str] | None = None,
    ) -> None:
        self.quiet = quiet
        self._tags = {r: f"[rank {r}@{h}]" for r, h in (hosts or {}).items()}
        self._head, self._tail = (0, head + tail) if quiet else (head, tail)
        self._out = stdout
        self._err = stderr
        self._logs: dict[int, _RankLog] = {}

    def _tag(self, rank: int) -> str:
        return self._tags.get(rank) or f"[rank {rank}]"

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def _log(self, rank: int) -> _RankLog:
        if rank not in self._logs:
            self._logs[rank] = _RankLog(self._head, self._tail)
        return self._logs[rank]

    def handle(self, event: object) -> None:
        if isinstance(event, P.Output):
            log = self._log(event.rank)
            for line in log.lines[event.stream].feed(event.text):
                self._line(event.rank, log, event.stream, line)
        elif isinstance(event, P.RankResult) and event.value_repr is not None and not self.quiet:
            self._flush_partial(event.rank)
            lines = event.value_repr.splitlines() or [""]
            self._stream("stdout").write(
                "".join(
                    f"{self._tag(event.rank)} {'Out: ' if i == 0 else '     '}{line}\n"
                    for i, line in enumerate(lines)
                )
            )
        elif isinstance(event, P.RankDisplay) and not self.quiet:
            self._stream("stdout").flush()
            show_rich(event)

    def _line(self, rank: int, log: _RankLog, stream: str, line: str) -> None:
        log.total += 1
        if log.shown < log.head:
            log.shown += 1
            self._stream(stream).write(f"{self._tag(rank)} {line}\n")
        else:
            log.tail.append((stream, line))

    def _flush_partial(self, rank: int) -> None:
        log = self._log(rank)
        for stream, lines in log.lines.items():
            for line in lines.flush():
                self._line(rank, log, stream, line)

    def close(self, end: P.CellEnd | None) -> None:
        failed = set() if end is None else set(end.errors) | set(end.exits)
        for rank in sorted(self._logs):
            self._flush_partial(rank)
            log = self._logs[rank]
            if self.quiet and rank not in failed:
                continue
            dropped = log.total - log.shown - len(log.tail)
            if dropped:
                self._stream("stderr").write(
                    f"{self._tag(rank)} ... {dropped} lines not shown ...\n"
                )
            for stream, line in log.tail:
                self._stream(stream).write(f"{self._tag(rank)} {line}\n")
            log.tail.clear()
        for out in (self._stream("stdout"), self._stream("stderr")):
            out.flush()


# ---------------------------------------------------------------- widgets


class _RankView:
    def __init__(self, keep: int) -> None:
        self.lines = {"stdout": Lines(), "stderr": Lines()}
        self.log: deque[tuple[str, str]] = deque(maxlen=keep)
        self.dropped = 0
        self.state = "queued"
        self.started: float | None = None
        self.ended: float | None = None
        self.last = ""
        self.progress: P.RankProgress | None = None
        self.result: str | None = None
        self.pane_dirty = False
        self.waiting: tuple[str, float] | None = None  # (collective, since) while blocked in it

    def state_text(self, now: float) -> str:
        """``running``, or ``waiting in all_reduce (12 s)`` for a rank blocked in a collective."""
        if self.state == "running" and self.waiting is not None:
            op, since = self.waiting
            return f"waiting in {op} ({now - since:.0f} s)"
        return self.state


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


class Dashboard:
    """One cell's live view: header, a row per rank, tabs with every log.

    ``interval`` seconds at least between two renders (each render sends the
    header, the rank table, the interleaved log and at most one rank's log:
    a bounded number of widget messages per second at any world size).
    """

    LIVE_LINES = 400  # lines a pane shows while the cell runs
    FROZEN_LINES = 1000  # lines each log of a finished cell's static view keeps

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
    ) -> None:
        import ipywidgets as w

        self.ranks = list(ranks)
        self.world_size = world_size
        self.backend, self.devices = backend, devices
        self.keep, self.interval, self.clock = keep, interval, clock
        self.hosts = dict(hosts or {})
        self.views = {r: _RankView(keep) for r in self.ranks}
        self.all: deque[tuple[int, str, str]] = deque(maxlen=keep)
        self.all_dropped = 0
        self.all_dirty = False
        self.started = clock()
        self.ended: float | None = None
        self.status = "running"
        self.notes: list[str] = []
        self._last_render = float("-inf")
        self._next_pane = 0
        self.renders = 0

        # one layout and one style model shared by every HTML part: each model is a
        # comm opened with the cell and closed when it ends, so fewer is cheaper
        first = w.HTML()
        look = {"layout": first.layout, "style": first.style}
        self.header = first
        self.table = w.HTML(**look)
        self.panes = [w.HTML(**look) for _ in range(len(self.ranks) + 1)]
        self.tabs = w.Tab(children=self.panes)
        self.tabs.titles = ("all ranks", *(f"rank {r}" for r in self.ranks))
        self.widget = w.VBox([self.header, self.table, self.tabs])
        self.widget.add_class("nbddp-dashboard")
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

        self._handle = display(self.bundle(), raw=True, display_id=True)
        return self

    # -- events

    def handle(self, event: object) -> None:
        if isinstance(event, P.Output):
            self._output(event)
        elif isinstance(event, P.RankState):
            view = self.views.get(event.rank)
            if view is not None:
                self._state(event.rank, view, event.state)
        elif isinstance(event, P.RankResult):
            view = self.views.get(event.rank)
            if view is not None and event.value_repr is not None:
                view.result = event.value_repr
                self._add(event.rank, view, "stdout", f"Out: {event.value_repr}")
        elif isinstance(event, P.RankProgress):
            view = self.views.get(event.rank)
            if view is not None:
                view.progress = event
        elif isinstance(event, P.RankDisplay):
            show_rich(event)
        elif isinstance(event, P.RankWhere):
            view = self.views.get(event.rank)
            if view is not None:
                view.waiting = (event.waiting, event.since) if event.waiting else None
        self._render()

    def _state(self, rank: int, view: _RankView, state: str) -> None:
        now = self.clock()
        if state == "running" and view.started is None:
            view.started = now
        elif state != "running":
            view.ended, view.waiting = now, None
            for stream, lines in view.lines.items():
                for line in lines.flush():
                    self._add(rank, view, stream, line)
        first_failure = state in FAILED_STATES and not any(
            v.state in FAILED_STATES for v in self.views.values()
        )
        view.state = state
        if first_failure:  # its pane opens
            self.tabs.selected_index = self.ranks.index(rank) + 1

    def _output(self, event: P.Output) -> None:
        view = self.views.get(event.rank)
        if view is None:  # a rank outside the cell printed (a background thread)
            view = self.views[event.rank] = _RankView(self.keep)
        for line in view.lines[event.stream].feed(event.text):
            self._add(event.rank, view, event.stream, line)
        current = view.lines[event.stream].current
        if current:
            view.last = current

    def _add(self, rank: int, view: _RankView, stream: str, line: str) -> None:
        if len(view.log) == view.log.maxlen:
            view.dropped += 1
        view.log.append((stream, line))
        if len(self.all) == self.all.maxlen:
            self.all_dropped += 1
        self.all.append((rank, stream, line))
        view.last = line
        view.pane_dirty = self.all_dirty = True

    # -- rendering

    def _render(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_render < self.interval:
            return
        self._last_render = now
        self.renders += 1
        self.header.value = self._header_html(now)
        self.table.value = self._table_html(now)
        live = None if force else self.LIVE_LINES
        if self.all_dirty or force:
            self.all_dirty = False
            self.panes[0].value = self._pane_html(
                [(f"[{r}] ", s, t) for r, s, t in self.all], self.all_dropped, live
            )
        n = len(self.ranks)
        # one rank's pane per render, taken round robin, so every pane keeps up
        order = [(self._next_pane + i) % n for i in range(n)]
        dirty = [i for i in order if self.views[self.ranks[i]].pane_dirty]
        for i in dirty if force else dirty[:1]:
            view = self.views[self.ranks[i]]
            view.pane_dirty = False
            self.panes[i + 1].value = self._pane_html(
                [("", s, t) for s, t in view.log], view.dropped, live
            )
            self._next_pane = (i + 1) % n

    def _elapsed(self, view: _RankView, now: float) -> str:
        if view.started is None:
            return ""
        return f"{(view.ended or now) - view.started:.1f} s"

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

    def _table_html(self, now: float) -> str:
        rows = []
        for rank in sorted(self.views):
            view = self.views[rank]
            shown = view.state_text(now)
            colour = STATE_COLOURS.get(shown.split()[0], "#888888")
            failed = view.state in FAILED_STATES
            style = "background:#fde7e7;" if failed else ""
            rows.append(
                f"<tr class='nbddp-row nbddp-{view.state}' data-rank='{rank}' style='{style}'>"
                f"<td style='padding:1px 8px'>rank {rank}{self._host(rank)}</td>"
                f"<td style='padding:1px 8px;color:{colour};font-weight:bold'>{shown}</td>"
                f"<td style='padding:1px 8px;text-align:right'>{self._elapsed(view, now)}</td>"
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

    def _pane_html(
        self,
        lines: list[tuple[str, str, str]],
        dropped: int,
        shown: int | None,
        live: bool = True,
    ) -> str:
        """A scrolling log: the last ``shown`` lines (None: all kept), a note of the rest."""
        hidden = dropped
        if shown is not None and len(lines) > shown:
            hidden += len(lines) - shown
            lines = lines[-shown:]
        body = "".join(
            f"<span style='color:#b71c1c'>{_esc(p + t)}</span>\n"
            if s == "stderr"
            else _esc(p + t) + "\n"
            for p, s, t in lines
        )
        note = ""
        if hidden:
            note = (
                f"<div class='nbddp-dropped' style='color:#888'>… {hidden} earlier lines "
                f"not shown{' (more show when the cell ends)' if live and shown else ''}"
                "</div>"
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
        for rank, view in self.views.items():
            for stream, lines in view.lines.items():
                for line in lines.flush():
                    self._add(rank, view, stream, line)
        if end is None:
            self.status = "stopped"
        elif end.interrupted:
            self.status = "timed out" if end.interrupted == "timeout" else "interrupted"
        elif end.errors or end.exits:
            self.status = "failed"
        else:
            self.status = "done"
        self.notes = list(end.notes) if end else []
        if self._handle is None:  # not shown: the widgets are all there is to read
            self._render(force=True)
        self.freeze()  # shown: its static rendering replaces it, no last widget update

    def frozen_bundle(self) -> dict:
        """A finished cell's output: static HTML and text, no widget state."""
        return {
            "text/plain": self.summary_text(),
            "text/html": self.summary_html(self.FROZEN_LINES, all_ranks=True),
        }

    def freeze(self) -> None:
        """Replace the live widget by its static rendering and close every widget of
        it in the kernel: nothing accumulates across cells, in the kernel, in the
        front ends or in the saved notebook."""
        if self._handle is not None:
            self._handle.update(self.frozen_bundle(), raw=True)
        models = {}
        for widget in [self.widget, self.tabs, self.header, self.table, *self.panes]:
            for part in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None:
                    models[id(part)] = part
        for model in models.values():
            model.close()

    def summary_text(self) -> str:
        lines = [f"nbddp: {len(self.ranks)} ranks, {self.status}"]
        for rank in sorted(self.views):
            view = self.views[rank]
            lines.append(f"  rank {rank}: {view.state}  {view.last[:100]}")
        return "\n".join(lines)

    def summary_html(self, tail: int = 20, all_ranks: bool = False) -> str:
        """A static view for readers without a live kernel (saved notebooks, GitHub):
        the header, the rows, then each rank's log (the last ``tail`` lines, a failed
        rank's open) and, with ``all_ranks``, every rank's lines interleaved (open when
        no rank failed, as the live view's first tab)."""
        now = self.ended or self.clock()
        parts = [self._header_html(now), self._table_html(now)]
        failed = any(v.state in FAILED_STATES for v in self.views.values())
        if all_ranks and self.all:
            lines = [(f"[{r}] ", s, t) for r, s, t in self.all]
            parts.append(
                f"<details class='nbddp-log nbddp-log-all'{'' if failed else ' open'}>"
                f"<summary>all ranks log ({len(self.all) + self.all_dropped} lines)</summary>"
                + self._pane_html(lines, self.all_dropped, tail, live=False)
                + "</details>"
            )
        for rank in sorted(self.views):
            view = self.views[rank]
            if not view.log:
                continue
            bad = view.state in FAILED_STATES
            lines = [("", s, t) for s, t in view.log]
            parts.append(
                f"<details class='nbddp-log' data-rank='{rank}'{' open' if bad else ''}>"
                f"<summary>rank {rank} log ({len(view.log) + view.dropped} lines)</summary>"
                + self._pane_html(lines, view.dropped, tail * 3 if bad else tail, live=False)
                + "</details>"
            )
        return "<div class='nbddp-summary'>" + "".join(parts) + "</div>"
