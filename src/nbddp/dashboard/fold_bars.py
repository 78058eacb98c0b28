"""tqdm bars in a cell's folded output (:class:`nbddp.dashboard.fold.Folder` asks it): which
ranks run a bar now, each bar's *occurrence* (a rank's second ``tqdm(desc="train")`` is
another bar than its first), the running bars drawn as one per occurrence, and how long a
finished bar waits for the other ranks' same bar, so it comes out as one line.

A finished bar waits (BAR_HOLD s at most from its first rank's end) while a running rank
that has not ended this occurrence is expected to end it, that is while:

- it runs the same bar now (its unfinished line is a bar of this description);
- it ran this bar before in the cell (an earlier occurrence): a bar every rank ran
  before is expected on every rank;
- it stands where the bar's ranks stood when they began it (its last line is the one
  they printed just before the bar, or none of them printed any), and that line came
  less than BAR_GRACE s ago: its bar's first frame may just not have been read yet.

A bar on some ranks only (``if rank == 0: tqdm(...)``) thus waits at most BAR_GRACE s
after the other ranks' last line (not at all once they print on), never BAR_HOLD; only a
bar that a rank ran before in the cell and skips this time waits BAR_HOLD for it.
The rule reads only the lines and the clock: the same reads give the same lines out.
"""

from __future__ import annotations

from .fold_group import Group
from .fold_shape import shape

__all__ = ["BAR_GRACE", "BAR_HOLD", "Bars"]

BAR_HOLD = 10.0  # seconds a finished bar waits, at most, for the same bar of other ranks
BAR_GRACE = 1.0  # seconds a rank at the bar's start is expected to show its bar within


class Bars:
    """The ranks' running bars and how many bars of each description each one finished."""

    def __init__(self) -> None:
        self.running: dict[tuple[int, str], str] = {}  # (rank, stream) -> its bar's key
        self._done: dict[tuple[int, str, str], int] = {}  # (rank, stream, key) -> bars ended

    def mark(self, rank: int, stream: str, current: str) -> None:
        """Note whether the rank's unfinished line is a tqdm bar, and which."""
        bar = shape(current) if "%|" in current else None
        if bar is not None and bar[1] is None:
            self.running[(rank, stream)] = bar[0]
        else:
            self.running.pop((rank, stream), None)

    def nth(self, rank: int, stream: str, key: str) -> int:
        """The occurrence of ``key`` the rank runs (or runs next): the bars it ended."""
        return self._done.get((rank, stream, key), 0)

    def _count(self, rank: int, stream: str, key: str) -> int:
        """The rank ended a bar of ``key``: its occurrence (the bars of ``key`` ended before)."""
        n = self._done.get((rank, stream, key), 0)
        self._done[(rank, stream, key)] = n + 1
        return n

    def ended_line(self, rank: int, stream: str, line: str) -> None:
        """A whole line that nothing folds (``--no-fold``): if a bar, count it."""
        bar = shape(line) if "%|" in line else None
        if bar is not None and bar[1] is None:
            self._count(rank, stream, bar[0])

    def ended(self, rank: int, stream: str, group: Group, prev: Group | None) -> None:
        """The rank's bar ended as a line of ``group`` (opened by it, or joined), printed
        after ``prev``: count the occurrence, and note where the rank began it."""
        n = self._count(rank, stream, group.key)
        if group.before is None:
            group.before, group.nth = set(), n
        group.before.add(-1 if prev is None else prev.seq)

    def waits(self, group: Group, last: dict[int, Group | None], when, now: float) -> bool:
        """Does the finished bar ``group`` wait for another rank's (module docstring)?
        ``last``: each running rank's last group; ``when``: when its last line came."""
        if group.before is None or now - group.born >= BAR_HOLD:
            return False
        mine = set(group.ranks)
        stream, key = group.stream, group.key
        for rank, at in last.items():
            if rank in mine:
                continue
            n = self._done.get((rank, stream, key), 0)
            if n > group.nth:  # it ended this one (in another group)
                continue
            if n or self.running.get((rank, stream)) == key:
                return True
            start = -1 if at is None else at.seq
            if start in group.before and now - when.get(rank, now) < BAR_GRACE:
                return True
        return False

    def live(self, current, waiting, fold: bool, now: float) -> list[Group]:
        """The bars running now, one per stream, description and occurrence (``fold``
        off: each rank's own), with the ranks whose same bar ended and waits to come
        out; ``current(rank, stream)``: the rank's unfinished line, ``waiting(stream,
        key)``: the waiting groups of a key."""
        found: dict[tuple[str, str, int, int], Group] = {}
        for (rank, stream), key in sorted(self.running.items()):
            n = self.nth(rank, stream, key)
            slot = (stream, key, n, -1 if fold else rank)
            if slot not in found:
                found[slot] = Group(-1, key, stream, "", now)
                found[slot].nth = n
                found[slot].tag = f"{stream} {n} {slot[3]} {key}"
            found[slot].ranks.append(rank)
            found[slot].values.append(current(rank, stream))
        for (stream, key, n, _), group in found.items():
            running = set(group.ranks)
            for ended in waiting(stream, key):
                if ended.nth != n:
                    continue
                for rank, line in zip(ended.ranks, ended.values, strict=True):
                    if rank not in running:
                        group.ranks.append(rank)
                        group.values.append(line)
        for group in found.values():
            each = sorted(zip(group.ranks, group.values, strict=True))
            group.ranks, group.values = [r for r, _ in each], [v for _, v in each]
            group.text = group.values[0]
            group.settle_text()
        return list(found.values())
