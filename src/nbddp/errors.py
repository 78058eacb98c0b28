"""The errors nbddp raises in the notebook.

::

    NbddpError
     +-- PoolStartError      the ranks could not be started (names the rank and why)
     +-- PoolClosedError     the pool was stopped and cannot run cells
     +-- CaptureError        a --need / --imports / push name cannot be shipped
                             (raised before any rank runs)
     +-- CellFailed          a cell failed on one or more ranks; .failures lists them, first first
          +-- CellInterrupted    the cell was interrupted (stop button, Ctrl-C, --timeout)

    RankFailed and RankDied are the per-rank failures that CellFailed carries.

Rank errors travel as data (type name, message, formatted traceback), never as
pickled exception objects, and render in IPython through ``_render_traceback_``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from .protocol import ErrorInfo

__all__ = [
    "CaptureError",
    "CellFailed",
    "CellInterrupted",
    "NbddpError",
    "PoolClosedError",
    "PoolStartError",
    "RankDied",
    "RankFailed",
    "describe_exit",
    "rank_label",
]


class NbddpError(Exception):
    """Base class of every error nbddp raises."""


class PoolStartError(NbddpError):
    """The pool's ranks could not be started."""


class PoolClosedError(NbddpError):
    """The pool was stopped."""


class CaptureError(NbddpError):
    """A name could not be shipped to the ranks; nothing ran."""


def describe_exit(returncode: int | None) -> str:
    """``exit code 7`` / ``killed by SIGKILL`` / ``connection lost``."""
    if returncode is None:
        return "connection lost"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def rank_label(rank: int, host: str = "") -> str:
    """``rank 3``, or ``rank 3 (node-b)`` when the pool spans several hosts."""
    return f"rank {rank} ({host})" if host else f"rank {rank}"


@dataclass(frozen=True)
class RankFailed:
    """One rank's exception, as data."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    host: str = ""  # set when the pool spans several hosts

    @classmethod
    def from_info(cls, rank: int, info: ErrorInfo, host: str = "") -> RankFailed:
        return cls(rank, info.exc_type, info.message, info.traceback, host)

    @property
    def summary(self) -> str:
        return f"{rank_label(self.rank, self.host)}: {self.exc_type}: {self.message}".rstrip(": ")

    def render(self) -> list[str]:
        head = f"--- {rank_label(self.rank, self.host)} ---"
        return [head, *self.traceback.rstrip("\n").splitlines()]


@dataclass(frozen=True)
class RankDied:
    """A rank's process ended during the cell."""

    rank: int
    returncode: int | None
    host: str = ""

    @property
    def summary(self) -> str:
        return f"{rank_label(self.rank, self.host)} died ({describe_exit(self.returncode)})"

    def render(self) -> list[str]:
        return [f"--- {rank_label(self.rank, self.host)} ---", self.summary]


class CellFailed(NbddpError):
    """A cell failed on one or more ranks: one error naming every failed rank."""

    def __init__(self, failures: list[RankFailed | RankDied], notes: list[str] | None = None):
        self.failures = list(failures)
        self.notes = list(notes or [])
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [f.summary for f in self.failures] or ["the cell failed"]
        return "\n".join(lines + self.notes)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a Python traceback: each rank's own."""
        out: list[str] = []
        for failure in self.failures:
            out += failure.render()
        out += ["", f"{type(self).__name__}: {self.failures[0].summary if self.failures else ''}"]
        out += [f.summary for f in self.failures[1:]]
        out += self.notes
        return out


class CellInterrupted(CellFailed):
    """The cell was interrupted on the ranks (stop button, Ctrl-C or --timeout)."""

    def __init__(self, reason: str, failures=None, notes=None):
        self.reason = reason
        super().__init__(failures or [], notes)

    def _message(self) -> str:
        head = "cell timed out" if self.reason == "timeout" else "cell interrupted"
        return "\n".join([head, *self.notes])

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self._message()}"]
