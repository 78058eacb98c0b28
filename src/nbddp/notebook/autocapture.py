"""Automatic capture for ``%%ddp``: the names a cell reads that only the notebook has,
and the notebook's imports, replayed on the ranks (``--no-auto`` turns it off).

The notebook's side of it: what the notebook imported (from its run cells), what was
shipped to which generation of the pool; :mod:`nbddp.pool.capture` does the reading.
"""

from __future__ import annotations

from ..pool import capture
from ..pool.errors import CaptureError, NbddpError
from .session import say

__all__ = ["AutoCapture"]


def _held(pool) -> frozenset[str]:
    """The names any rank of ``pool`` has (none, if it cannot say: it was stopped)."""
    try:
        return frozenset().union(*(pool.names_on([r]) for r in range(pool.world_size)))
    except NbddpError:
        return frozenset()


class AutoCapture:
    """The state automatic capture keeps across a notebook's cells."""

    def __init__(self, shell) -> None:
        self.shell = shell
        self.on = True
        self.limit = 100 * 2**20  # the largest object shipped without --need
        # the notebook's import statements, and those of %%ddp cells that ran on every
        # rank, in order: replayed to ranks with a fresh namespace
        self.import_log: list[str] = []
        self.shipped = capture.Shipped()
        self._replayed = (-1, 0)  # (pool generation, imports replayed to all its ranks)

    def record_imports(self, result) -> None:
        """After each notebook cell (IPython's post_run_cell): the imports it ran."""
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        if result.error_in_exec is not None or result.error_before_exec is not None:
            return
        if raw.lstrip().startswith("%%"):  # %%ddp cells (and other cell magics) are not ours
            return
        for stmt in capture.import_statements(self.shell.transform_cell(raw)):
            if stmt not in self.import_log:
                self.import_log.append(stmt)

    def record_cell_imports(self, pool, cell: str, failed: bool = False) -> None:
        """A ``%%ddp`` cell ran on every rank: its imports join the log, so that a rank
        with a fresh namespace (one that took a dead rank's place) gets them too. Of a
        cell that ``failed``, the imports that ran: those whose names a rank now has."""
        generation, done = self._replayed
        fresh = [
            stmt
            for stmt in capture.import_statements(self.shell.transform_cell(cell))
            if stmt not in self.import_log
        ]
        if failed:  # (replayed with the next cell to all: a rank may have failed first)
            self.import_log += [s for s in fresh if capture.names_imported([s]) <= _held(pool)]
            return
        self.import_log += fresh
        if (generation, done) == (pool.generation, len(self.import_log) - len(fresh)):
            self._replayed = (generation, len(self.import_log))  # every rank has run them

    def versions(self, pool, objects: dict[str, object], ranks) -> dict[str, int]:
        """The notebook's version of each object it ships (``--need``, push, automatic
        capture), for :meth:`nbddp.Pool.run`; sent to every rank: not shipped again."""
        for name, obj in objects.items():
            if ranks is None:
                self.shipped.sent(pool.generation, name, obj)
        return self.shipped.versions(objects)

    def ship(self, pool, cell: str, ranks, explicit, imports: str):
        """Names ``cell`` reads that only the notebook has (a shipment, and their
        versions), and the imports to run first (the notebook's not yet replayed, then
        ``imports``); said in one line."""
        objects, sizes, notes, auto = self._select(pool, cell, ranks, explicit)
        generation, done = self._replayed
        replay = self.import_log[done if generation == pool.generation else 0 :]
        if ranks is None:
            self._replayed = (pool.generation, len(self.import_log))
        said = [f"{n} ({capture.human(sizes[n])})" for n in objects]
        if replay:
            said.append(f"replayed {len(replay)} import{'s' * (len(replay) > 1)}")
        if said:
            say("shipped " + ", ".join(said) if objects else ", ".join(said))
        for note in notes:
            say(note)
        versions = self.versions(pool, objects, ranks)
        return auto, versions, "\n".join([*replay, imports] if imports else replay)

    def _select(self, pool, cell: str, ranks, explicit):
        """(objects, their sizes, notes, the packed shipment) for ``cell``."""
        try:
            objects, sizes, notes = capture.select_auto(
                self.shell.transform_cell(cell),  # what the ranks compile: magics made calls
                self.shell.user_ns,
                pool.names_on(ranks),
                explicit,
                self.limit,
                capture.names_imported(self.import_log),
                lambda name, obj: self.shipped.unchanged(pool.generation, name, obj),
            )
            auto = capture.pack(objects, pool.shm_folder)
        except CaptureError as exc:
            return {}, {}, [str(exc)], None
        return objects, sizes, notes, auto
