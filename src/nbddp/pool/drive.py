"""One cell's events, driven to the end: the one loop the magics, ``nbddp.ranch`` and
``Pool.execute`` share.

Each event goes to a sink (the dashboard, ``[rank N]`` lines, or nothing); a rank's
pdb asks ``prompt`` for a line, or has its session closed when there is no prompt;
Ctrl-C asks the pool to interrupt the cell and driving goes on until the cell ends.
Whatever happens, the sink is closed. No IPython here (the pool core uses it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Protocol

from ..wire import protocol as P
from .errors import CellInterrupted
from .sigint import interrupts_cell

__all__ = ["Sink", "drive", "own_cells"]


class Sink(Protocol):
    """Where a cell's events are shown."""

    def handle(self, event: object) -> None: ...

    def close(self, end: P.CellEnd | None) -> None: ...


class _Debugged(Protocol):  # what the driver needs of a pool
    def interrupt(self) -> None: ...

    def interrupt_stuck(self) -> bool: ...

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None: ...


Prompt = Callable[[P.RankDebug], "str | None"]


def drive(
    pool: _Debugged,
    events: Iterable[object],
    sink: Sink | None = None,
    *,
    prompt: Prompt | None = None,
    shown: Callable[[object], bool] | None = None,
) -> P.CellEnd:
    """Drive ``events`` (a cell's, from ``pool.run``) to their ``CellEnd`` and return it.

    Every event goes to ``sink`` (the ones ``shown`` accepts, when given). A
    ``RankDebug`` is answered with ``prompt(event)``: a line, or None to end that rank's
    pdb session for the rest of the cell (no prompt: ended at once). A KeyboardInterrupt
    (here or in ``prompt``) becomes ``pool.interrupt()`` and driving goes on; in the main
    thread, SIGINT asks for the interrupt without raising at all (:mod:`nbddp.pool.sigint`).
    The sink is closed whatever happens; a cell that ends without a ``CellEnd`` (its pool was
    stopped under it) raises :class:`~nbddp.CellInterrupted`.
    """
    events = iter(events)
    ends: list[P.CellEnd] = []
    try:
        with interrupts_cell(pool):
            _drive(pool, events, sink, prompt, shown, ends)
    finally:
        if sink is not None:
            sink.close(ends[-1] if ends else None)
    if not ends:
        raise CellInterrupted("interrupt", notes=["the pool was stopped"])
    return ends[-1]


def _drive(pool, events, sink, prompt, shown, ends: list) -> None:
    closed: set[int] = set()  # ranks whose pdb session was ended
    while True:
        try:
            for event in events:
                if isinstance(event, P.CellEnd):
                    ends.append(event)
                if sink is not None and (shown is None or shown(event)):
                    sink.handle(event)
                if isinstance(event, P.RankDebug):
                    _answer(pool, event, prompt, closed)
            return
        except KeyboardInterrupt:
            pool.interrupt()


def _answer(pool: _Debugged, event: P.RankDebug, prompt: Prompt | None, closed: set[int]):
    """Answer a rank's pdb with ``prompt``'s line; None (or Ctrl-C) ends its session."""
    if prompt is None or event.rank in closed:
        pool.debug_reply(event, None)
        return
    try:
        line = prompt(event)
    except KeyboardInterrupt:
        closed.add(event.rank)
        pool.debug_reply(event, None)
        raise
    if line is None:
        closed.add(event.rank)
    pool.debug_reply(event, line)


@contextlib.contextmanager
def own_cells(pool):
    """The pool's own cells between the user's (a heal's copy, a new rank's re-runs, threads
    set in place): the notes and the output that wait for the user's next cell stay its
    own, said first; what these cells leave in ``pool.notes`` follows them."""
    notes, pool.notes = pool.notes, []
    backlog, pool.roster.backlog = pool.roster.backlog, []
    try:
        yield
    finally:
        pool.notes = notes + pool.notes
        pool.roster.backlog = backlog + pool.roster.backlog
