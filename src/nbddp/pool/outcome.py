"""What one cell's ranks gave back, and the one error that says how it failed."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from ..wire import payload
from ..wire import protocol as P
from ..wire.carriers import twin
from ..wire.stacks import CELL_PREFIX
from .errors import CellDeadlocked, CellFailed, CellInterrupted, RankDied, RankFailed
from .supervisor import CellSupervisor

__all__ = ["Outcome", "RawValue", "failures_of", "load_value", "owned_files", "raise_for_end"]

_NO_MARKS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RawValue:
    """A rank's ``--out`` value as it came (a detached pool's supervisor does not load the
    user's objects: the kernel does, with :func:`load_value`)."""

    data: bytes
    files: tuple[str, ...]


def load_value(rank: int, data: bytes, files) -> tuple[object, P.ErrorInfo | None]:
    """A rank's value, loaded here: (value, None), or (None, the rank's error) when this
    process cannot load it (a class only the ranks can import, a CUDA tensor without CUDA)."""
    try:
        return payload.loads(data), None
    except Exception as exc:  # whatever unpickling the user's object raises
        message = f"its value could not be loaded in the notebook: {exc}"
        name = type(exc).__name__
        return None, P.ErrorInfo(name, message, f"{name}: {message}\n", time.time())
    finally:
        payload.Shipment(b"", list(files)).remove()


def owned_files(files, folder: str | None) -> tuple[str, ...]:
    """The files a rank named that lie in the pool's own folder (or its twin on disk,
    where what did not fit in shared memory goes): the notebook removes those once
    loaded, and never a path elsewhere, whatever a rank's Done says."""
    if not folder:
        return ()
    ours = {folder, twin(folder)}
    return tuple(
        f for f in files if isinstance(f, str) and os.path.dirname(os.path.abspath(f)) in ours
    )


class Outcome:
    """What came back from one cell's ranks: output ends, results, errors, exits."""

    def __init__(
        self,
        cell: int,
        targets: list[int],
        marks: dict[int, set[str]],
        raw: bool = False,
        folder: str | None = None,
    ) -> None:
        self.raw = raw  # keep --out values as they came (RawValue)
        self.folder = folder  # the pool's shared-memory folder: values' files are only there
        self.cell = cell
        self.targets = targets
        # the end markers still to come, by rank: one per open stream (none behind a
        # relay: it reads them)
        self.marks = {r: marks.get(r) or _NO_MARKS for r in targets}
        self.done: dict[int, P.Done] = {}
        self.values: dict[int, object] = {}
        self.errors: dict[int, P.ErrorInfo] = {}
        self.exits: dict[int, P.RankExit] = {}
        self.code = ""  # the cell's source: a SIGKILL it sends itself is not the OOM killer's

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
        files = owned_files(done.files, self.folder)
        if self.raw:
            self.values[rank] = RawValue(done.value, files)
            return True
        value, error = load_value(rank, done.value, files)
        if error is not None:
            self.errors[rank] = error
            return False
        self.values[rank] = value
        return True

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
            sup.deadlock.message if sup.deadlock else "",
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


def named_cell(failure, cell: int, label: str):
    """``failure`` with its traceback's ``<ddp-cell-4>`` read as ``In [6]``."""
    if not isinstance(failure, RankFailed):
        return failure
    tb = failure.traceback.replace(f'"{CELL_PREFIX}cell-{cell}>"', f'"{label}"')
    return dataclasses.replace(failure, traceback=tb)


def raise_for_end(end: P.CellEnd, hosts: dict[int, str] | None = None, label: str = "") -> None:
    """Raise the one error that says how the cell failed, if it did: the root cause first.

    With ``hosts`` (a pool on several hosts), each rank is named with its host; with
    ``label`` (``In [6]``), tracebacks name the cell as the notebook does.
    """
    failures = failures_of(end, hosts)
    if label:
        failures = [named_cell(f, end.cell, label) for f in failures]
    if end.interrupted:
        raise CellInterrupted(end.interrupted, failures, list(end.notes), end.stacks)
    if end.deadlock:
        raise CellDeadlocked(end.deadlock, failures, list(end.notes), end.freed, end.kept)
    if failures:
        raise CellFailed(failures, list(end.notes), freed=end.freed, kept=end.kept)
