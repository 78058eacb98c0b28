"""``nbddp.progress`` of many ranks as one bar: the slowest rank's position, named, and
how far the others got. The dashboard draws it (:mod:`nbddp.dashboard.html`); the text
sink says it as a line (:class:`ProgressLines`) when the slowest rank's whole percent
moved, at most every ``every`` seconds (the first ``every`` seconds after the bar began,
when every rank has said where it is), and once at the end: a plain-text stream gets a
few lines a bar, not one per step. tqdm bars (:class:`TqdmLines`) are said by the same
rule while they run; their end is the finished bar's folded line in the log."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..wire import protocol as P
from .fold_shape import bar_percent, rank_set

if TYPE_CHECKING:
    from collections.abc import Callable

    from .fold_group import Group

__all__ = ["ProgressLines", "TqdmLines", "slowest_bar", "spread"]

EVERY = 1.0  # seconds at least between two lines of one bar (text)


def slowest_bar(progress: dict[int, P.RankProgress]) -> tuple[int, P.RankProgress, int]:
    """``(rank, its progress, the furthest count)``: the slowest rank (the lowest share
    done; ties: the lowest rank) and where the fastest is."""
    rank = min(progress, key=lambda r: (progress[r].done / (progress[r].total or 1), r))
    return rank, progress[rank], max(p.done for p in progress.values())


def progress_text(progress: dict[int, P.RankProgress]) -> str:
    """``[ranks 0-3] train 45/100 (45%)  (slowest: rank 2; the others up to 80)``."""
    rank, slow, fast = slowest_bar(progress)
    ranks = sorted(progress)
    label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_set(ranks)}"
    desc = f"{slow.desc} " if slow.desc else ""
    count = f"{slow.done}/{slow.total} ({_percent(slow)}%)" if slow.total else f"{slow.done}"
    named = f"  (slowest: rank {rank}; the others up to {fast})" if spread(progress) else ""
    return f"[{label}] {desc}{count}{named}"


def spread(progress: dict[int, P.RankProgress]) -> bool:
    """Are the ranks at different places? (Every rank at its end: not, whatever its total.)"""
    if all(p.total and p.done >= p.total for p in progress.values()):
        return False
    return len({p.done for p in progress.values()}) > 1


def _percent(p: P.RankProgress) -> int:
    return min(100, int(100 * p.done / p.total)) if p.total else 0


class ProgressLines:
    """The text sink's bars: each rank's last position; ``take`` returns the line to say
    now, if any (``fold=False``: each rank's bar apart)."""

    def __init__(self, fold: bool = True, every: float = EVERY, clock=time.monotonic) -> None:
        self.fold, self.every, self.clock = fold, every, clock
        self._bars: dict[int, dict[int, P.RankProgress]] = {}  # bar (-1: the folded one)
        self._said: dict[int, tuple[float, int]] = {}  # bar -> (when, the state it said)
        self.ranks: set[int] = set()  # the ranks the cell runs (the sink adds them)

    def take(self, event: P.RankProgress) -> str | None:
        """A rank's new position; the bar's line if it moved a whole percent (a count with
        no total: moved at all) and the last line is ``every`` seconds old, or it ended."""
        bar, now = -1 if self.fold else event.rank, self.clock()
        self.ranks.add(event.rank)
        self._bars.setdefault(bar, {})[event.rank] = event
        when, said = self._said.setdefault(bar, (now, -1))  # the first: once the others came
        state = self._state(bar)
        done = len(self._bars[bar]) >= len(self.ranks) and all(
            p.total and p.done >= p.total for p in self._bars[bar].values()
        )  # every rank's bar at its end (of those the cell runs, once all are known)
        if state == said or (now - when < self.every and not done):
            return None
        self._said[bar] = (now, state)
        return progress_text(self._bars[bar])

    def _state(self, bar: int) -> int:
        """What a new line needs changed: the slowest rank's whole percent (its count,
        with no total)."""
        slow = slowest_bar(self._bars[bar])[1]
        return _percent(slow) if slow.total else slow.done

    def rest(self) -> list[str]:
        """The lines not said yet (the end: each bar where it stopped)."""
        out = []
        for bar, progress in self._bars.items():
            state = self._state(bar)
            if self._said.get(bar, (0.0, -1))[1] != state:
                self._said[bar] = (self.clock(), state)
                out.append(progress_text(progress))
        return out


class TqdmLines:
    """The text sink's tqdm bars while they run (``bars``: the folded bars running now,
    :meth:`nbddp.dashboard.fold.Folder.bars`): a bar's line when its slowest rank's whole
    percent moved and ``every`` seconds passed since its last line (the first: ``every``
    seconds after the bar was first seen); none at 100%, where the finished bar comes
    out as a line of the log. A bar with no total: only that line."""

    def __init__(self, every: float = EVERY, clock=time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._said: dict[str, tuple[float, int]] = {}  # bar (its tag) -> (when, percent)
        self._looked = float("-inf")

    def take(self, bars: Callable[[], list[Group]]) -> list[Group]:
        """The bars to say now; ``bars`` is read at most four times an ``every``."""
        now = self.clock()
        if now - self._looked < self.every / 4:
            return []
        self._looked, out = now, []
        for group in bars():
            shares = [bar_percent(line) for line in group.values]
            if None in shares or min(shares) >= 100:
                continue
            when, said = self._said.setdefault(group.tag, (now, -1))
            if min(shares) != said and now - when >= self.every:
                self._said[group.tag] = (now, min(shares))
                out.append(group)
        return out
