"""Folded output: a line that several ranks print is shown once, with its rank set.

``[ranks 0-31] epoch 1 loss 0.25`` stands for 32 identical lines, and lines that
differ only in their numbers fold too (:mod:`nbddp.dashboard.fold_shape`: ``rank {0-31} loss
{0.25..0.31}``). Every rank's own lines keep their order, whatever order the ranks
print in.

The lines waiting to come out form a graph: a group (one shown line) comes after the
group each of its ranks printed before it. A rank's line joins the oldest waiting
group of its shape that it can join without breaking any rank's order (the group
does not come before the rank's previous line), else it opens a group. So a rank that
printed lines of its own still joins the shared line another rank opened first.

A group comes out when every group before it did and it is *settled*: every running
rank has printed it or a line after it, or ended, or ``window`` seconds have passed.
Of the groups that may come out, the one at the earliest step comes first, then the
lowest rank: the ranks' own lines of one step read in rank order.

:class:`Folder` takes a cell's events too (``output``, ``state``, ``result``): each
rank's text chunks become whole lines (:mod:`nbddp.dashboard.fold_lines`: a carriage return
rewrites the line so far), a rank that ends counts its unfinished line as a line, and
a result shows as ``Out:`` lines. Both sinks (the text sink and the dashboard) fold
through it.

tqdm bars fold live too: :meth:`Folder.bars` draws the ranks' unfinished bars of one
description and occurrence as one (the slowest rank's, with the spread), and a finished
bar waits while another rank is expected to end the same bar, so it comes out as one
line (:mod:`nbddp.dashboard.fold_bars`: which ranks are expected, and for how long).
"""

from __future__ import annotations

import bisect
import heapq
import time
from operator import attrgetter
from typing import TYPE_CHECKING

from .fold_bars import Bars
from .fold_group import Group
from .fold_lines import PARTIAL_MAX, Lines
from .fold_shape import rank_set, shape

if TYPE_CHECKING:
    from ..wire import protocol as P

__all__ = ["PARTIAL_MAX", "Folder", "Group", "Lines", "fold_key", "rank_set"]

_seq = attrgetter("seq")
SEARCH = 64  # waiting groups a join or a settle looks through, at most (beyond: no)


def fold_key(line: str) -> str:
    """What two ranks' lines must share to fold: the line with its numbers taken out
    (a bar: its description)."""
    return shape(line)[0]


class Folder:
    """A cell's output in, folded groups out, in order.

    Lines in with ``feed``/``feed_lines``, or events in with ``output``, ``state``
    and ``result``; groups come out of each, and of ``due`` and ``flush``.
    ``ranks`` are the ranks expected to print; ``window`` seconds bound how long
    a line waits for the same line from other ranks. ``window=0`` folds nothing
    (``--no-fold``): every line comes out as it arrives. ``clock`` dates the
    lines that events bring.
    """

    def __init__(self, ranks, *, window: float = 0.25, clock=time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._partial: dict[tuple[int, str], Lines] = {}  # each rank's unfinished lines
        self._bars = Bars()  # the ranks' tqdm bars
        self._seq = 0
        self._open = 0  # groups waiting
        self._ready: list[tuple[int, int, int, Group]] = []  # heap: groups with none before
        self._by_key: dict[tuple[str, str], list[Group]] = {}
        self._last: dict[int, Group | None] = {}  # running ranks: the group each joined last
        self._when: dict[int, float] = {}  # when each rank's last line came (or it began)
        # (rank, stream, shape): the seq of the rank's last group of that shape; no group
        # at or before it can take the rank again (it comes before the rank's last line)
        self._floor: dict[tuple[int, str, str], int] = {}
        for rank in ranks:
            self.expect(rank)

    # -- events

    def output(self, event: P.Output) -> list[Group]:
        """Text a rank printed: its whole lines go in, the rest waits for its newline."""
        key = (event.rank, event.stream)
        lines = self._partial.get(key)
        if lines is None:
            lines = self._partial[key] = Lines()
        whole = lines.feed(event.text)
        self._bars.mark(event.rank, event.stream, lines.current)
        return self.feed_lines(event.rank, event.stream, whole, self.clock())

    def bars(self) -> list[Group]:
        """The bars running now, one per stream, description and occurrence: every rank's
        unfinished bar, with the finished ones still waiting to come out, folded into the
        slowest rank's bar and the spread (``--no-fold``: each rank's own)."""
        return self._bars.live(
            self.current, lambda stream, key: self._by_key.get((stream, key), ()),
            self.window > 0, self.clock(),
        )  # fmt: skip

    def current(self, rank: int, stream: str) -> str:
        """``rank``'s unfinished line on ``stream`` as it reads now."""
        lines = self._partial.get((rank, stream))
        return "" if lines is None else lines.current

    def state(self, event: P.RankState) -> list[Group]:
        """A rank started (lines wait for it) or ended (nothing waits for it)."""
        if event.state == "running":
            self.expect(event.rank)
            return []
        return self.finish(event.rank)

    def result(self, event: P.RankResult) -> list[Group]:
        """A rank's value of the cell's last expression, as ``Out:`` lines."""
        out = self._unfinished(event.rank)  # what it printed before comes first
        shown = [
            f"{'Out: ' if i == 0 else '     '}{line}"
            for i, line in enumerate(event.value_repr.splitlines() or [""])
        ]
        return out + self.feed_lines(event.rank, "stdout", shown, self.clock())

    def _unfinished(self, rank: int) -> list[Group]:
        """The rank's unfinished lines, counted as lines from now on."""
        out = []
        for stream in ("stdout", "stderr"):
            lines = self._partial.get((rank, stream))
            if lines is not None:
                self._bars.running.pop((rank, stream), None)
                out += self.feed_lines(rank, stream, lines.flush(), self.clock())
        return out

    # -- lines

    def feed(self, rank: int, stream: str, line: str, now: float) -> list[Group]:
        """A whole line from ``rank``; returns the groups now ready, in order."""
        return self.feed_lines(rank, stream, [line], now)

    def feed_lines(self, rank: int, stream: str, lines: list[str], now: float) -> list[Group]:
        """Whole lines from ``rank``, in order (what one read brought); the groups ready."""
        if self.window <= 0:
            for line in lines:
                self._bars.ended_line(rank, stream, line)
            return [Group(-1, line, stream, line, now, [rank]) for line in lines]
        if not lines:
            return []
        if rank not in self._last:  # a rank outside the cell, or printing after its end
            self.expect(rank)
        prev = self._last[rank]
        self._when[rank] = now
        for line in lines:
            key, values = shape(line)
            floor = self._floor.get((rank, stream, key), -1)
            group = self._joinable(self._by_key.get((stream, key)), prev, floor)
            if group is None:
                group = self._opened(rank, stream, key, line, now, prev)
            elif prev is not None and not prev.out:
                self._after(prev, group)
            elif rank < group.low:  # it comes out earlier now
                group.low = rank
                heapq.heappush(self._ready, (group.order, rank, group.seq, group))
            if rank < group.low:
                group.low = rank
            self._floor[(rank, stream, key)] = group.seq
            group.ranks.append(rank)
            group.values.append(line if values is None else values)
            if values is None:
                self._bars.ended(rank, stream, group, prev)
            if prev is not None:
                prev.at -= 1
            group.at += 1
            prev = group
        self._last[rank] = prev
        return self.due(now)

    def _joinable(self, same: list[Group] | None, prev: Group | None, floor: int) -> Group | None:
        """The oldest waiting group of a shape that a rank whose last group is ``prev``
        can join: one that does not come before ``prev`` (nor is it). Groups up to
        ``floor`` (the rank's last of this shape) are skipped unread: a rank printing
        thousands of like lines at once costs a search each, not one per line before."""
        if not same:
            return None
        for i in range(bisect.bisect_right(same, floor, key=_seq), len(same)):
            group = same[i]
            if prev is None or prev.out:
                return group
            if group is not prev and not self._reaches(group, prev):
                return group
        return None

    def _reaches(self, start: Group, goal: Group) -> bool:
        """Does ``goal`` come after ``start``? Steps only rise along the graph, so the
        search stays below ``goal``'s step; past SEARCH groups, say yes (do not join)."""
        if start.order >= goal.order:
            return False
        stack, seen = [start], {id(start)}
        while stack:
            for group in stack.pop().nexts.values():
                if group is goal:
                    return True
                if group.order < goal.order and id(group) not in seen:
                    if len(seen) > SEARCH:
                        return True
                    seen.add(id(group))
                    stack.append(group)
        return False

    def _opened(
        self, rank: int, stream: str, key: str, line: str, now: float, prev: Group | None
    ) -> Group:
        group = Group(self._seq, key, stream, line, now)
        group.low = rank
        self._seq += 1
        self._open += 1
        self._by_key.setdefault((stream, key), []).append(group)
        if prev is not None:  # a step after the rank's last (out or not: steps stay put)
            group.order = prev.order + 1
        if prev is not None and not prev.out:
            prev.nexts[id(group)] = group
            group.npred = 1
        else:
            heapq.heappush(self._ready, (group.order, rank, group.seq, group))
        return group

    def _after(self, prev: Group, group: Group) -> None:
        """``group`` comes after ``prev`` from now on: steps raised where they must be."""
        if id(group) in prev.nexts:  # another rank went the same way: nothing new
            return
        prev.nexts[id(group)] = group
        group.npred += 1
        stack = [(group, prev.order + 1)]
        while stack:
            g, order = stack.pop()
            if g.order < order:
                g.order = order
                stack.extend((n, order + 1) for n in g.nexts.values())

    def expect(self, rank: int) -> None:
        """``rank`` runs from now on: lines wait for it (or the window)."""
        if rank not in self._last:
            self._last[rank] = None
            self._when.setdefault(rank, self.clock())

    def finish(self, rank: int, now: float | None = None) -> list[Group]:
        """``rank`` prints no more in this cell: its unfinished lines count as lines, and
        groups waiting only for it can go."""
        out = self._unfinished(rank)
        if rank in self._last:
            last = self._last.pop(rank)
            if last is not None:
                last.at -= 1
        return out + self.due(now)

    def due(self, now: float | None = None) -> list[Group]:
        """The groups ready now: settled, or older than the window, earliest step first."""
        if now is None:
            now = self.clock()
        out = []
        while True:
            group = self._head()
            if group is None or (now - group.born < self.window and not self._settled(group)):
                return out
            if self._bars.waits(group, self._last, self._when, now):
                return out
            out.append(self._pop())

    def flush(self) -> list[Group]:
        """Every group still open, then each rank's unfinished line as a line of its own
        (the cell ended, or what came before must show now)."""
        out = []
        for rank in sorted({rank for rank, _ in self._partial}):
            out += self._unfinished(rank)
        while self._head() is not None:
            out.append(self._pop())
        return out

    @property
    def pending(self) -> int:
        return self._open

    def _head(self) -> Group | None:
        """The group to come out next (none before it waits), or None."""
        ready = self._ready
        while ready:
            order, low, _, group = ready[0]
            if group.out or group.npred:
                heapq.heappop(ready)  # joined since: it waits for another group now
            elif (order, low) != (group.order, group.low):
                heapq.heapreplace(ready, (group.order, group.low, group.seq, group))
            else:
                return group
        return None

    def _settled(self, group: Group) -> bool:
        """Has every running rank printed ``group`` or a line after it? (Past SEARCH
        groups: not yet; the window lets it go.)"""
        need = len(self._last)
        if group.at >= need:  # every running rank's last line (the usual shared line)
            return True
        stack, seen, count = [group], {id(group)}, 0
        while stack:
            g = stack.pop()
            count += g.at
            if count >= need:
                return True
            for n in g.nexts.values():
                if id(n) not in seen:
                    if len(seen) > SEARCH:
                        return False
                    seen.add(id(n))
                    stack.append(n)
        return count >= need

    def _pop(self) -> Group:
        group = heapq.heappop(self._ready)[3]
        group.out = True
        self._open -= 1
        same = self._by_key[(group.stream, group.key)]
        if len(same) == 1:
            del self._by_key[(group.stream, group.key)]
        else:
            same.remove(group)
        for n in group.nexts.values():
            n.npred -= 1
            if not n.npred:
                heapq.heappush(self._ready, (n.order, n.low, n.seq, n))
        group.nexts = {}
        group.settle_text()
        return group
