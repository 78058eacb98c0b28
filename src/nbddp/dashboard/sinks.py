"""Sinks: where a cell's events are shown. A sink renders; it never steers the pool.

- :class:`Sink`: what every sink is: ``handle`` each event, ``close`` at the end.
- :class:`TextSink`: ``[rank N] line`` as lines arrive (terminal IPython,
  ``--text``), or nothing unless a rank fails (``--quiet``).
- the widget sink, :class:`nbddp.dashboard.view.Dashboard`, lives in its own module.

Every sink folds output through one :class:`nbddp.dashboard.fold.Folder`: a line several
ranks print shows once as ``[ranks 0-31] line``; ``fold=False`` shows every
rank's line. Rich output (``display`` and figures from the display ranks) goes
to the cell's output (:func:`show_rich`).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Protocol, TextIO

from ..wire import protocol as P
from ..wire.stacks import rank_set
from .charts import summary_line
from .fold import Folder, Group
from .html import RankView, mark_behind
from .metric_store import CellMetrics
from .progress_fold import ProgressLines, TqdmLines

__all__ = ["FOLD_WINDOW", "Sink", "TextSink", "columns", "show_rich"]

FOLD_WINDOW = 0.25  # seconds a line waits for the same line from the other ranks
METRICS_EVERY = 5.0  # seconds between two summaries of the cell's metrics (text)


class Sink(Protocol):
    def handle(self, event: object) -> None: ...

    def close(self, end: P.CellEnd | None) -> None: ...


def columns(rows: list[tuple[str, ...]]) -> str:
    """Rows of text as aligned columns (``%ddp status``, ``%ddp list``)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def show_rich(event: P.RankDisplay) -> None:
    """Put a rank's rich output in the cell's output area."""
    from IPython.display import display

    display(event.data, metadata=event.metadata, raw=True)


class TextSink:
    """Lines as ``[rank N] text`` (folded: ``[ranks 0-3] text``), live; the first ``head``
    folded lines as they come, then the last ``tail``; ``quiet`` holds them back unless a
    rank fails, and then shows the failed ranks' lines. Metrics (``log_metrics``) show as
    one line per metric every ``METRICS_EVERY`` seconds and at the end."""

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
        metrics: CellMetrics | None = None,
    ) -> None:
        self.quiet = quiet
        self.metrics = metrics if metrics is not None else CellMetrics()
        self._clock = clock
        self._metrics_said = clock()
        self.hosts = dict(hosts or {})
        self._fold = Folder((), window=window if fold else 0, clock=clock)
        self._bars = ProgressLines(fold, clock=clock)  # nbddp.progress, folded
        self._tqdm = TqdmLines(clock=clock)  # tqdm bars while they run, folded
        self._head = head
        self._out = stdout
        self._err = stderr
        self._shown = 0
        self._tail: deque[Group] = deque(maxlen=tail)
        self._dropped = 0
        # quiet: each rank's last lines, numbered in the order they came out
        self._held: dict[int, deque[tuple[int, Group]]] = {}
        self._came = 0
        self._views: dict[int, RankView] = {}  # state and collective count, for "behind"
        self._where: dict[int, str] = {}  # each rank's last place (nbddp.wire.stacks.summary)

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
            if not self.quiet:
                self._say_tqdm()
        elif isinstance(event, P.RankStates):
            for one in event.each():
                self.handle(one)
            if event.state == "missing" and not self.quiet:
                self._say_missing(event.ranks)
        elif isinstance(event, P.RankState):
            self._view(event.rank).state = event.state
            if event.state == "running":
                self._bars.ranks.add(event.rank)
            self._take(self._fold.state(event))
        elif isinstance(event, P.RankWhere):
            self._where_now(event)
        elif isinstance(event, P.RankResult) and event.value_repr is not None and not self.quiet:
            self._take(self._fold.result(event))
        elif isinstance(event, P.RankDisplay) and not self.quiet:
            self._take(self._fold.flush())  # the lines printed before it come first
            self._stream("stdout").flush()
            show_rich(event)
        elif isinstance(event, P.RankProgress) and not self.quiet:
            self._say_bar(self._bars.take(event))
        elif isinstance(event, P.RankDebug):  # pdb's session follows: what came before first
            self._take(self._fold.flush())
            self._stream("stdout").flush()
            self._stream("stderr").flush()
        else:
            if isinstance(event, P.RankMetrics):
                self.metrics.add(event)
            self._take(self._fold.due())
        if self.metrics.dirty and self._clock() - self._metrics_said >= METRICS_EVERY:
            self._say_metrics()

    def _view(self, rank: int) -> RankView:
        return self._views.setdefault(rank, RankView(0))

    def _where_now(self, event: P.RankWhere) -> None:
        """A rank's place and collective count; one line when a rank falls behind the
        others (the dashboard's rule, nbddp.dashboard.html.mark_behind), naming its count,
        the others' and the collective they wait in."""
        view, now = self._view(event.rank), self._clock()
        view.waiting = (event.waiting, event.since) if event.waiting else None
        if event.count != view.ops:
            view.ops, view.ops_at = event.count, now
        self._where[event.rank] = event.where
        was = {r: v.ahead for r, v in self._views.items()}
        mark_behind(self._views, now)
        for rank, v in sorted(self._views.items()):
            if v.ahead > -1 and was.get(rank) != v.ahead and not self.quiet:
                self._say_behind(rank, v, now)

    def _say_behind(self, rank: int, view: RankView, now: float) -> None:
        """``[nbddp] rank 2 behind: collective #1190 of #1208 (cell line 2: ...); ranks
        0, 1 waiting in all_reduce #1208 (4 s)``."""
        self._take(self._fold.flush())
        ahead = [r for r, v in self._views.items() if v.ops == view.ahead and v.waiting]
        said = f"[nbddp] rank {rank} behind: collective #{view.ops} of #{view.ahead}"
        said += f" ({self._where[rank]})" if self._where.get(rank) else ""
        if ahead:
            said += f"; {rank_set(sorted(ahead))} {self._views[ahead[0]].state_text(now)}"
        self._stream("stderr").write(said + "\n")

    def _say_missing(self, ranks: tuple[int, ...]) -> None:
        """``[nbddp] ranks 2, 3: missing (host node-b lost)``, a line for each lost host,
        after the lines printed before."""
        self._take(self._fold.flush())
        by_host: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            by_host.setdefault(self.hosts.get(rank, ""), []).append(rank)
        for host, on_it in by_host.items():
            view = self._view(on_it[0])
            view.host = host
            self._stream("stderr").write(f"[nbddp] {rank_set(on_it)}: {view.state_text(0)}\n")

    def _say_bar(self, line: str | None) -> None:
        """The folded bar of ``nbddp.progress``, after the lines printed before it."""
        if line is not None:
            self._take(self._fold.due())
            self._stream("stdout").write(line + "\n")

    def _say_tqdm(self) -> None:
        """The tqdm bars running now, folded, at nbddp.progress's pace (TqdmLines), after
        the lines printed before them; not counted in ``head``: a bar's end is."""
        bars = self._tqdm.take(self._fold.bars)
        if bars:
            self._take(self._fold.due())
        for group in bars:
            self._stream(group.stream).write(f"{self._tag(group)} {group.text}\n")

    def _say_metrics(self) -> None:
        """One line per metric the cell logged: where it stands now."""
        self._metrics_said = self._clock()
        self.metrics.dirty = False
        if self.quiet:
            return
        self._take(self._fold.flush())
        out = self._stream("stdout")
        for key, lines in self.metrics.charts():
            line = summary_line(key, lines, self.metrics.label)
            if line is not None:
                out.write(line + "\n")

    def _take(self, groups: list[Group]) -> None:
        for group in groups:
            if self.quiet:
                self._came += 1
                for rank in group.ranks:
                    self._held.setdefault(rank, deque(maxlen=self._head + self._tail.maxlen))
                    self._held[rank].append((self._came, group))
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
            shown = {i: g for r in sorted(failed) for i, g in self._held.get(r, ())}
            for _, group in sorted(shown.items(), key=lambda ig: ig[0]):
                mine = [r for r in group.ranks if r in failed]
                if len(mine) == 1:  # one failed rank: its own line, as it printed it
                    text = group.line_of(mine[0])
                    self._stream(group.stream).write(f"[rank {mine[0]}] {text}\n")
                else:
                    self._write(group)
        else:
            if self._dropped:
                self._stream("stderr").write(f"[nbddp] ... {self._dropped} lines not shown ...\n")
            for group in self._tail:
                self._write(group)
            self._tail.clear()
            for line in self._bars.rest():
                self._say_bar(line)
        if self.metrics.dirty:
            self._say_metrics()
        for out in (self._stream("stdout"), self._stream("stderr")):
            out.flush()
