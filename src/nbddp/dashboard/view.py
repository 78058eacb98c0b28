"""The widget sink: the live view of a cell in front ends with widgets.

One anywidget per cell (:mod:`nbddp.dashboard.widget`): a header, a row per rank
or, for large pools, a summary with the rows that differ, and the folded log of
every rank or of one (rendered by :mod:`nbddp.dashboard.html`). Updates are
throttled and send only the parts that changed; when the cell ends the widget is
replaced by static HTML and closed in the kernel.

Output folds through :class:`nbddp.dashboard.fold.Folder`, as in the text sink
(:mod:`nbddp.dashboard.sinks`, whose names are importable from here too): a line several
ranks print shows once as ``[ranks 0-31] line``; ``fold=False`` shows every
rank's line. Rich output (``display`` and figures from the display ranks) shows
in the cell's output, below the dashboard.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from ..wire import protocol as P
from . import html as H
from .charts import charts_html, named, summary_line
from .fold import Folder, Group, Lines, rank_set
from .fold_shape import bar_count
from .html import FAILED_STATES, STATE_COLOURS
from .metric_store import CellMetrics
from .sinks import FOLD_WINDOW, Sink, TextSink, show_rich
from .widget import flush_only_pending, new_widget

# the sinks' names as this module has always offered them, wherever they live now
__all__ = [
    "FAILED_STATES",
    "FOLD_WINDOW",
    "STATE_COLOURS",
    "Dashboard",
    "Lines",
    "Sink",
    "TextSink",
    "show_rich",
]


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
    CHART_INTERVAL = 1.0  # seconds at least between two drawings of the metric charts

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
        metrics: CellMetrics | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.metrics = metrics if metrics is not None else CellMetrics()
        self._charts_drawn = float("-inf")
        self.world_size = world_size
        self.backend, self.devices = backend, devices
        self.keep, self.interval, self.clock = keep, interval, clock
        self.hosts = dict(hosts or {})
        self.views = {r: H.RankView(keep) for r in self.ranks}
        self._fold = Folder(self.ranks, window=window if fold else 0, clock=clock)
        self.log: deque[Group] = deque(maxlen=keep)
        self.dropped = 0
        self._log_dirty = False
        self.started = clock()
        self.ended: float | None = None
        self.status = "running"
        self.notes: list[str] = []
        self._last_render = float("-inf")
        self.renders = 0
        self.widget = new_widget(ranks=self.ranks)
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

        with flush_only_pending():
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
            self._output(event, view)
        elif isinstance(event, P.RankState) and view is not None:
            self._state(event.rank, view, event)
        elif isinstance(event, P.RankResult) and view is not None:
            if event.value_repr is not None:
                self._take(self._fold.result(event))
        elif isinstance(event, P.RankProgress) and view is not None:
            view.progress = event
        elif isinstance(event, P.RankMetrics):
            self.metrics.add(event)
        elif isinstance(event, P.RankDisplay):
            show_rich(event)
        elif isinstance(event, P.RankWhere) and view is not None:
            view.waiting = (event.waiting, event.since) if event.waiting else None
            if event.count != view.ops:
                view.ops, view.ops_at = event.count, self.clock()
            H.mark_behind(self.views, self.clock())
        elif isinstance(event, P.RankDebug) and view is not None:
            view.state = "debugging"  # until its next state: shown now, pdb waits for a line
            self._render(force=True)
            return
        self._render()

    def _output(self, event: P.Output, view: H.RankView | None) -> None:
        if view is None:  # a rank outside the cell printed (a background thread)
            view = self.views[event.rank] = H.RankView(self.keep)
        self._take(self._fold.output(event))
        end = event.text.rfind("\n")
        if end >= 0:  # a bar that just ended: its row says so now, not once it folds
            count = bar_count(Lines.settle(event.text[:end].rsplit("\n", 1)[-1]))
            view.bar = count or view.bar
        current = self._fold.current(event.rank, event.stream)
        if current:
            self._own_line(view, current)

    @staticmethod
    def _own_line(view: H.RankView, line: str) -> None:
        """A rank's row shows its last line; a tqdm bar only as its position (the bar is
        drawn once, folded, in the log)."""
        count = bar_count(line)
        if count is None:
            view.last = line
        else:
            view.bar = count

    def _state(self, rank: int, view: H.RankView, event: P.RankState) -> None:
        now = self.clock()
        if event.state == "running" and view.started is None:
            view.started = now
        elif event.state != "running":
            view.ended, view.waiting = now, None
        self._take(self._fold.state(event))
        view.state = event.state
        if event.state == "missing":
            view.host = self.hosts.get(rank, "")
        if event.state in FAILED_STATES and self.widget.focus < 0:  # the first failure opens
            self.widget.focus = rank

    def _take(self, groups: list[Group]) -> None:
        for group in groups:
            if len(self.log) == self.log.maxlen:
                self.dropped += 1
            self.log.append(group)
            for i, rank in enumerate(group.ranks):
                view = self.views.get(rank)
                if view is not None:
                    view.lines.append(group)
                    view.count += 1
                    self._own_line(view, group.line_at(i))  # its own, not the folded one
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
            w.rows = H.rows_html(self.views, self.hosts, now, self.ROWS)
            if self._log_dirty:
                self._log_dirty = False
                start = max(0, len(self.log) - self.LIVE_LINES)
                w.lines = [
                    [rank_set(g.ranks), H.shown_stream(g), g.text, g.detail]
                    for g in itertools.islice(self.log, start, None)
                ]
                w.hidden = self.dropped + start
            w.bars = [  # the bars running now, one per description and occurrence (sent
                # when they change), each with its identity: its own toggle in the page
                [rank_set(g.ranks), "progress", g.text, g.detail, g.tag]
                for g in self._fold.bars()
            ]
            if self.metrics.dirty and (force or now - self._charts_drawn >= self.CHART_INTERVAL):
                self._charts_drawn, self.metrics.dirty = now, False
                w.charts = self.charts_html()

    def charts_html(self) -> str:
        return charts_html(self.metrics.charts(), self.metrics.label)

    def _header_html(self, now: float) -> str:
        facts = (self.backend, self.devices, self.status)
        elapsed = (self.ended or now) - self.started
        return H.header_html(len(self.ranks), self.world_size, facts, elapsed)

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
            with flush_only_pending():
                self._handle.update(self.frozen_bundle(), raw=True)
        self.widget.close()

    def summary_text(self) -> str:
        title = f"nbddp: {len(self.ranks)} ranks, {self.status}"
        text = H.summary_text(self.views, title, self.ended or self.clock(), self.ROWS)
        own = self.metrics.label
        said = [summary_line(key, lines, own) for key, lines in self.metrics.charts()]
        return "\n".join([text, *(line for line in said if line)])

    def summary_html(self, tail: int = 20, all_ranks: bool = False) -> str:
        """A static view for readers without a live kernel (saved notebooks, GitHub):
        the header, the rows, then the folded log of every rank (with ``all_ranks``; open
        when no rank failed) and each rank's own log (the last ``tail`` lines, a failed
        rank's open; beyond OWN_LOGS ranks, only the failed, odd and slowest ranks')."""
        now = self.ended or self.clock()
        parts = [self._header_html(now), H.rows_html(self.views, self.hosts, now, self.ROWS)]
        parts.append(charts_html(self.metrics.charts(), self.metrics.label, images=True))
        if all_ranks and self.log:
            failed = any(v.state in FAILED_STATES for v in self.views.values())
            parts.append(H.all_log_html(self.log, self.dropped, tail, failed))
        own = sorted(self.views)
        if len(self.views) > self.OWN_LOGS:  # and the ranks the charts name as outlying
            charted = [r for r in named(self.metrics.charts()) if r in self.views]
            own = sorted({*H.notable(self.views, now, self.ROWS), *charted})
        parts.append(H.own_logs_html(self.views, own, tail))
        return "<div class='nbddp-summary'>" + "".join(parts) + "</div>"
