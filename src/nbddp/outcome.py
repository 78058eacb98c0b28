"""What one cell's ranks gave back, and the one error that says how it failed."""

from __future__ import annotations

import time

from . import payload
from . import protocol as P
from .errors import CellFailed, CellInterrupted, RankDied, RankFailed
from .supervisor import CellSupervisor

__all__ = ["Outcome", "failures_of", "raise_for_end"]

_NO_MARKS: frozenset[str] = frozenset()


class Outcome:
    """What came back from one cell's ranks: output ends, results, errors, exits."""

    def __init__(self, cell: int, targets: list[int], marks: dict[int, set[str]]) -> None:
        self.cell = cell
        self.targets = targets
        # the end markers still to come, by rank: one per open stream (none behind a
        # relay: it reads them)
        self.marks = {r: marks.get(r) or _NO_MARKS for r in targets}
        self.done: dict[int, P.Done] = {}
        self.values: dict[int, object] = {}
        self.errors: dict[int, P.ErrorInfo] = {}
        self.exits: dict[int, P.RankExit] = {}

    def finish(self, rank: int) -> list:
        """The rank's outcome is complete: its events."""
        done = self.done[rank]
        if done.status == "error":
            self.errors[rank] = done.error
            return [P.RankState(rank, "freed" if done.freed else "failed")]
        if done.status == "ok" and done.value is not None and not self._load(rank, done):
            return [P.RankState(rank, "failed")]
        events: list = []
        if done.value_repr is not None:
            events.append(P.RankResult(rank, done.value_repr))
        events.append(P.RankState(rank, "done" if done.status == "ok" else "interrupted"))
        return events

    def _load(self, rank: int, done: P.Done) -> bool:
        """The rank's ``--out`` value, here; a value the notebook cannot load (a class
        only the ranks can import, a CUDA tensor on a notebook without CUDA) is that
        rank's error, and the pool goes on."""
        try:
            self.values[rank] = payload.loads(done.value)
            return True
        except Exception as exc:  # whatever unpickling the user's object raises
            self.errors[rank] = P.ErrorInfo(
                type(exc).__name__,
                f"its value could not be loaded in the notebook: {exc}",
                f"{type(exc).__name__}: its value could not be loaded in the notebook: {exc}\n",
                time.time(),
            )
            return False
        finally:
            payload.Shipment(b"", list(done.files)).remove()

    def end(self, sup: CellSupervisor, notes: list[str], kept: bool = True) -> P.CellEnd:
        """The cell's end; ``kept``: every live rank kept its namespace."""
        for rank, done in self.done.items():  # a rank stopped before its output was all in
            if done.status == "error" and rank not in self.errors:
                self.errors[rank] = done.error
        return P.CellEnd(
            self.cell,
            tuple(self.targets),
            self.values,
            self.errors,
            self.exits,
            sup.interrupted,
            tuple(notes),
            dict(sup.stacks_at_interrupt),
            tuple(sorted(r for r, d in self.done.items() if d.freed)),
            {r: d.profile for r, d in self.done.items() if d.profile is not None},
            kept,
        )


def failures_of(end: P.CellEnd, hosts: dict[int, str] | None = None) -> list:
    """Every rank's error and unexpected exit in a cell's end, as error objects."""
    host = (hosts or {}).get
    failures: list = [RankFailed.from_info(r, e, host(r, "")) for r, e in end.errors.items()]
    failures += [
        RankDied(r, x.returncode, host(r, ""), x.when)
        for r, x in end.exits.items()
        if not x.stopped_by_pool
    ]
    return failures


def raise_for_end(end: P.CellEnd, hosts: dict[int, str] | None = None) -> None:
    """Raise the one error that says how the cell failed, if it did: the root cause first.

    With ``hosts`` (a pool on several hosts), each rank is named with its host.
    """
    failures = failures_of(end, hosts)
    if end.interrupted:
        raise CellInterrupted(end.interrupted, failures, list(end.notes), end.stacks)
    if failures:
        raise CellFailed(failures, list(end.notes), freed=end.freed, kept=end.kept)
