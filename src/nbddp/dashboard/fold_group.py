"""One folded line: the ranks that printed it and each one's numbers (or bar), the
line as shown once it came out, and each rank's own line (a rank's row and log show
its own). The graph of waiting groups is :mod:`nbddp.dashboard.fold`'s."""

from __future__ import annotations

from .fold_shape import bar, bar_detail, detail, rank_set, render

__all__ = ["Group"]


class Group:
    """One line as shown: the ranks that printed it, in order of arrival, and each one's
    numbers (a bar: each one's line); ``text`` is the folded line once it came out."""

    __slots__ = (
        "at", "before", "born", "key", "low", "nexts", "npred", "nth", "order", "out", "ranks",
        "said", "seq", "stream", "tag", "text", "values",
    )  # fmt: skip

    def __init__(self, seq: int, key: str, stream: str, text: str, born: float, ranks=None) -> None:
        self.seq, self.key, self.stream, self.text, self.born = seq, key, stream, text, born
        self.ranks: list[int] = ranks if ranks is not None else []
        self.values: list = []  # per rank: its numbers, or its line (a bar)
        # the groups its ranks printed next (while it waits), each once: id -> group
        self.nexts: dict[int, Group] = {}
        self.npred = 0  # groups before it still waiting
        self.order = 0  # its step: above every group before it
        self.at = 0  # running ranks whose last line it is
        self.low = ranks[0] if ranks else 1 << 62  # its lowest rank
        self.out = False
        self.said: str | None = None  # its detail, once asked (a group out does not change)
        # a tqdm bar (nbddp.dashboard.fold_bars): its occurrence (the bars of its description
        # its first rank ended before it), the groups its ranks printed just before it
        # (seq; -1: none), and while it runs, its identity (a toggle in the dashboard)
        self.nth = 0
        self.before: set[int] | None = None
        self.tag = ""

    @property
    def label(self) -> str:
        """``rank 3`` or ``ranks 0-31``."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        return f"ranks {rank_set(self.ranks)}"

    @property
    def detail(self) -> str:
        """Each rank's numbers where they differ, the extremes named first; a bar: each
        rank's position ('' if none)."""
        if len(self.ranks) < 2 or not self.values:
            return ""
        if self.said is None or not self.out:
            if isinstance(self.values[0], str):
                self.said = bar_detail(self.values, self.ranks)
            else:
                self.said = detail(self.key, self.values, self.ranks)
        return self.said

    def each(self) -> list[tuple[int, str]]:
        """Every rank's own line, as it printed it."""
        return [(rank, self._own(i)) for i, rank in enumerate(self.ranks)]

    def _own(self, i: int) -> str:
        values = self.values[i] if self.values else ()
        if isinstance(values, str) or not values:
            return values or self.key
        pieces = self.key.split("\x00")
        line = [pieces[0]]
        for value, piece in zip(values, pieces[1:], strict=True):
            line += [value, piece]
        return "".join(line)

    def line_at(self, i: int) -> str:
        """The own line of the ``i``-th rank of ``ranks`` (a rank's row shows its own)."""
        return self.text if len(self.ranks) < 2 or not self.values else self._own(i)

    def line_of(self, rank: int) -> str:
        """``rank``'s own line (the folded line if it did not print this one)."""
        if len(self.ranks) < 2 or rank not in self.ranks:
            return self.text
        return self._own(self.ranks.index(rank))

    def settle_text(self) -> None:
        """The line as shown: the shape with the ranks' numbers, or the slowest bar."""
        if len(self.ranks) < 2 or not self.values:
            return
        if isinstance(self.values[0], str):
            self.text = bar(self.values, self.ranks)
        elif self.values[0]:
            self.text = render(self.key, self.values, self.ranks)
