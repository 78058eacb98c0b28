"""The notebook's record of ``nbddp.log_metrics``: every point of every rank, kept.

A line is one rank's points of one metric in one run (:class:`Line`): all of them, as
arrays (16 bytes a point, for ``%ddp metrics``), and a downsampled view for charts that
grows as points arrive: about ``POINTS`` points, each bucket's lowest and highest value
(spikes stay visible), and the newest points exactly. A run is a name the ranks gave
(``run="train"``: every cell that logs it continues its charts) or, for a cell's own
metrics, the cell's label (``In [7]``). :class:`CellMetrics` is one cell's view: the
runs and metrics the cell touched, in the order they came.
"""

from __future__ import annotations

import bisect
import math
from array import array

from ..wire import protocol as P

__all__ = ["POINTS", "CellMetrics", "Line", "MetricStore"]

POINTS = 1000  # about this many points per line in a chart

Key = tuple[str, str]  # (run, metric name)


class Line:
    """One rank's points of one metric: all kept, and a view of about POINTS for charts."""

    __slots__ = ("_buckets", "_done", "_kept", "_width", "nonfinite", "steps", "values")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")
        self._buckets: list[tuple[int, int]] = []  # (index of the low, of the high) each
        self._kept: list[int] = []  # the buckets' indices, in order
        self._width = 1  # points per bucket
        self._done = 0  # points the buckets cover
        self.nonfinite = False  # a NaN or an infinity came: charts skip those points

    def __len__(self) -> int:
        return len(self.values)

    def extend(self, steps: bytes, values: bytes) -> None:
        new = array("d")
        new.frombytes(values)
        if not self.nonfinite and not all(map(math.isfinite, new)):
            self.nonfinite = True
        step_array = array("q")
        step_array.frombytes(steps)
        if len(step_array) != len(new):
            raise ValueError("a metrics batch has as many steps as values")
        self.steps.extend(step_array)
        self.values.extend(new)

    def last(self) -> tuple[int, float] | None:
        """The newest finite point."""
        i = self._newest_finite()
        return None if i is None else (self.steps[i], self.values[i])

    def _newest_finite(self) -> int | None:
        for i in range(len(self.values) - 1, -1, -1):
            if math.isfinite(self.values[i]):
                return i
        return None

    def view(self) -> list[int]:
        """The indices of about POINTS points in order: each bucket's low and high, then
        the newest points as they are (the latest always exactly); NaNs included."""
        self._advance()
        keep = self._kept + list(range(self._done, len(self.values)))
        if self.nonfinite:  # the newest finite point, though NaNs came after it
            newest = self._newest_finite()
            if newest is not None and newest < self._done and newest not in self._kept:
                bisect.insort(keep, newest)
        return keep

    def points(self) -> list[tuple[int, float]]:
        """The finite points of :meth:`view`, as (step, value)."""
        steps, values = self.steps, self.values
        return [(steps[i], values[i]) for i in self.view() if math.isfinite(values[i])]

    def _advance(self) -> None:
        """Bucket what came since: wide enough first (a backlog is bucketed once, not
        merged again and again), then each bucket's low and high at once (numpy)."""
        while (len(self._buckets) + (len(self.values) - self._done) // self._width) * 2 > POINTS:
            self._merge()
        width, start = self._width, self._done
        count = (len(self.values) - start) // width
        if count == 0:
            return
        import numpy as np

        stop = start + count * width  # (a copy: the array must stay free to grow)
        chunk = np.frombuffer(self.values[start:stop], dtype=np.float64).reshape(count, width)
        if self.nonfinite:
            finite = np.isfinite(chunk)
            low = np.where(finite, chunk, np.inf).argmin(axis=1)
            high = np.where(finite, chunk, -np.inf).argmax(axis=1)
        else:
            low, high = chunk.argmin(axis=1), chunk.argmax(axis=1)
        base = start + np.arange(count) * width
        buckets = list(zip((base + low).tolist(), (base + high).tolist(), strict=True))
        self._buckets.extend(buckets)
        self._kept.extend(i for bucket in buckets for i in _ordered(bucket))
        self._done = stop

    def _merge(self) -> None:
        """Twice as wide buckets: each the lowest and highest of two."""
        values, old, merged = self.values, self._buckets, []
        for i in range(0, len(old) - 1, 2):
            candidates = old[i] + old[i + 1]
            finite = [j for j in candidates if math.isfinite(values[j])] or [candidates[0]]
            merged.append(
                (min(finite, key=values.__getitem__), max(finite, key=values.__getitem__))
            )
        if len(old) % 2:  # an odd bucket out: its points go back to the newest
            self._done -= self._width
        self._buckets, self._width = merged, self._width * 2
        self._kept = [i for bucket in merged for i in _ordered(bucket)]


def _ordered(bucket: tuple[int, int]) -> tuple[int, ...]:
    low, high = bucket
    return (low,) if low == high else (min(low, high), max(low, high))


class MetricStore:
    """Every rank's points of every metric in every run, for the notebook's lifetime."""

    def __init__(self) -> None:
        self.lines: dict[Key, dict[int, Line]] = {}

    def add(self, rank: int, key: Key, steps: bytes, values: bytes) -> None:
        ranks = self.lines.setdefault(key, {})
        line = ranks.get(rank)
        if line is None:
            line = ranks[rank] = Line()
        line.extend(steps, values)

    def clear(self) -> None:
        self.lines.clear()

    def names(self) -> list[str]:
        return sorted({name for _run, name in self.lines})

    def columns(self, name: str | None = None, run: str | None = None) -> dict[str, list]:
        """The points as columns run, rank, step, name, value (in the order they came)."""
        cols: dict[str, list] = {"run": [], "rank": [], "step": [], "name": [], "value": []}
        for (r, n), ranks in self.lines.items():
            if (name is not None and n != name) or (run is not None and r != run):
                continue
            for rank in sorted(ranks):
                line = ranks[rank]
                count = len(line)
                cols["run"] += [r] * count
                cols["rank"] += [rank] * count
                cols["step"] += line.steps.tolist()
                cols["name"] += [n] * count
                cols["value"] += line.values.tolist()
        return cols

    def frame(self, name: str | None = None, run: str | None = None):
        """A pandas DataFrame (rank, step, name, value, run) when pandas is installed, else
        a list of dicts with those keys."""
        cols = self.columns(name, run)
        order = ("rank", "step", "name", "value", "run")
        try:
            import pandas
        except ImportError:
            rows = zip(*(cols[c] for c in order), strict=True)
            return [dict(zip(order, row, strict=True)) for row in rows]
        return pandas.DataFrame({c: cols[c] for c in order})


class CellMetrics:
    """One cell's metrics: it records into the store and remembers what the cell touched."""

    def __init__(self, store: MetricStore | None = None, label: str = "this cell") -> None:
        self.store = store if store is not None else MetricStore()
        self.label = label
        self.keys: list[Key] = []  # (run, name) in the order they first came
        self.dirty = False

    def add(self, event: P.RankMetrics) -> None:
        for run, name, steps, values in event.series:
            key = (run if run is not None else self.label, name)
            self.store.add(event.rank, key, steps, values)
            if key not in self.keys:
                self.keys.append(key)
        self.dirty = True

    def charts(self) -> list[tuple[Key, dict[int, Line]]]:
        return [(key, self.store.lines[key]) for key in self.keys]
