"""The Folder before issue 38 (commit 461c31c), the baseline of bench_fold.py: kept as it was.

``[ranks 0-31] epoch 1 loss 0.25`` stands for 32 identical lines. Lines that
differ per rank stay apart, and every rank's own lines keep their order.

A line waits in a group until it is *settled*: every rank of the cell has
printed a later line, or ended, or ``window`` seconds have passed. Groups come
out in the order they were opened, so a settled group behind an unsettled one
waits for it (at most ``window``). A rank's line joins the oldest open group
with the same text that it has not passed yet; otherwise it opens a group.

tqdm bars fold on what they show (description, percentage, count), not on
their timings; the folded line is the last rank's (the slowest) bar.

:class:`Folder` takes a cell's events too (``output``, ``state``, ``result``): each
rank's text chunks become whole lines (:class:`Lines`: a carriage return rewrites
the line so far), a rank that ends counts its unfinished line as a line, and a
result shows as ``Out:`` lines. Both sinks (the text sink and the dashboard) fold
through it.
"""

from __future__ import annotations

import re
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import protocol as P

__all__ = ["Folder", "Group", "Lines", "rank_set"]

# tqdm's default layout: "desc: 100%|█████| 10/10 [00:01<00:00,  9.81it/s]"
_TQDM = re.compile(r"^(.*?\d+%\|.*\|\s*\S+/\S+)\s+\[[^\]]*\]\s*$")


_NEVER = 1 << 62  # no live rank: every group is settled


def fold_key(line: str) -> str:
    """What two ranks' lines must share to fold: the text, or a bar without its timings."""
    m = _TQDM.match(line)
    return m.group(1) if m else line


def rank_set(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


class Group:
    """One line as shown: its text and the ranks that printed it, in order of arrival."""

    __slots__ = ("born", "key", "ranks", "seq", "stream", "text")

    def __init__(self, seq: int, key: str, stream: str, text: str, born: float, ranks=None) -> None:
        self.seq, self.key, self.stream, self.text, self.born = seq, key, stream, text, born
        self.ranks: list[int] = ranks if ranks is not None else []

    @property
    def label(self) -> str:
        """``rank 3`` or ``ranks 0-31``."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        return f"ranks {rank_set(self.ranks)}"


PARTIAL_MAX = 1 << 14  # characters of an unfinished line kept (its end), at most


class Lines:
    """Text chunks in, whole lines out; a carriage return rewrites the line so far.

    The unfinished line keeps only what follows its last carriage return (a
    progress bar's last state) and at most PARTIAL_MAX characters of its end, so
    a bar updated 100,000 times in one line costs each update the same.
    """

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str) -> list[str]:
        *lines, rest = (self.partial + text).split("\n")
        cut = rest.rstrip("\r").rfind("\r")  # ("a\r" stays: a "\n" may follow it)
        if cut >= 0:
            rest = rest[cut + 1 :]
        if len(rest) > PARTIAL_MAX:
            rest = "…" + rest[-PARTIAL_MAX:]
        self.partial = rest
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
        self._seq = 0
        self._open: deque[Group] = deque()
        self._by_key: dict[tuple[str, str], list[Group]] = {}
        # the newest group each rank joined (-1: none yet; None: the rank ended), how many
        # ranks are at each group, and the oldest of those: groups up to it are settled
        self._last: dict[int, int | None] = {}
        self._at: dict[int, int] = {}
        self._low = _NEVER
        for rank in ranks:
            self.expect(rank)

    # -- events

    def output(self, event: P.Output) -> list[Group]:
        """Text a rank printed: its whole lines go in, the rest waits for its newline."""
        key = (event.rank, event.stream)
        lines = self._partial.get(key)
        if lines is None:
            lines = self._partial[key] = Lines()
        return self.feed_lines(event.rank, event.stream, lines.feed(event.text), self.clock())

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
                out += self.feed_lines(rank, stream, lines.flush(), self.clock())
        return out

    # -- lines

    def feed(self, rank: int, stream: str, line: str, now: float) -> list[Group]:
        """A whole line from ``rank``; returns the groups now ready, in order."""
        return self.feed_lines(rank, stream, [line], now)

    def feed_lines(self, rank: int, stream: str, lines: list[str], now: float) -> list[Group]:
        """Whole lines from ``rank``, in order (what one read brought); the groups ready."""
        if self.window <= 0:
            return [Group(-1, line, stream, line, now, [rank]) for line in lines]
        if not lines:
            return []
        start = self._last.get(rank)
        if start is None:  # a rank outside the cell, or printing after its end
            self.expect(rank)
            start = self._last[rank]
        # the hot path of every printed line: kept flat, about 1.5 us a line
        by_key, opened, seq, last = self._by_key, self._open, self._seq, start
        for line in lines:
            key = (stream, fold_key(line) if "%|" in line else line)
            group = None
            same = by_key.get(key)
            if same is not None:
                for g in same:
                    if g.seq > last:
                        group = g
                        break
            if group is None:
                group = Group(seq, key[1], stream, line, now)
                seq += 1
                opened.append(group)
                if same is None:
                    by_key[key] = [group]
                else:
                    same.append(group)
            group.ranks.append(rank)
            group.text = line  # a bar shows its last (slowest) rank's state
            last = group.seq
        self._seq = seq
        self._leave(start)  # the rank moved from group ``start`` to ``last``
        self._enter(rank, last)
        head = opened[0]
        if head.seq <= self._low or now - head.born >= self.window:
            return self.due(now)
        return []

    def expect(self, rank: int) -> None:
        """``rank`` runs from now on: lines opened from here wait for it (or the window)."""
        if self._last.get(rank) is None:
            self._enter(rank, self._seq - 1)

    def finish(self, rank: int, now: float | None = None) -> list[Group]:
        """``rank`` prints no more in this cell: its unfinished lines count as lines, and
        groups waiting only for it can go."""
        out = self._unfinished(rank)
        if self._last.get(rank) is not None:
            self._leave(self._last[rank])
            self._last[rank] = None
        return out + self.due(now)

    def due(self, now: float | None = None) -> list[Group]:
        """The groups ready now: settled, or older than the window, from the oldest."""
        if now is None:
            now = self.clock()
        out = []
        while self._open:
            head = self._open[0]
            if head.seq > self._low and now - head.born < self.window:
                break
            out.append(self._pop())
        return out

    def flush(self) -> list[Group]:
        """Every group still open, then each rank's unfinished line as a line of its own
        (the cell ended, or what came before must show now)."""
        out = []
        for rank in sorted({rank for rank, _ in self._partial}):
            out += self._unfinished(rank)
        return out + [self._pop() for _ in range(len(self._open))]

    @property
    def pending(self) -> int:
        return len(self._open)

    def _pop(self) -> Group:
        group = self._open.popleft()
        key = (group.stream, group.key)
        same = self._by_key[key]
        if len(same) == 1:
            del self._by_key[key]
        else:
            same.remove(group)
        return group

    def _enter(self, rank: int, seq: int) -> None:
        self._last[rank] = seq
        self._at[seq] = self._at.get(seq, 0) + 1
        self._low = min(self._low, seq)

    def _leave(self, seq: int) -> None:
        self._at[seq] -= 1
        if not self._at[seq]:
            del self._at[seq]
            if seq == self._low:
                self._raise_low()

    def _raise_low(self) -> None:
        """The oldest rank moved on: the next oldest, scanning up (once over a cell)."""
        if not self._at:
            self._low = _NEVER
            return
        while self._low not in self._at:
            self._low += 1
