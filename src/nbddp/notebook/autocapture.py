"""Automatic capture for ``%%ddp``: the names a cell reads that only the notebook has,
and the notebook's imports, replayed on the ranks (``--no-auto`` turns it off).

The notebook's side of it: what the notebook imported (from its run cells), which of
those imports each rank's namespace has run, what was shipped to which generation of
the pool; :mod:`nbddp.pool.capture` does the reading. An import goes to a rank once
per namespace (``Pool.namespaces``): after a death, a resize up or a host's rejoin,
the whole log goes to the new ranks only, and a survivor's bindings (``lr`` an import
bound, then the rank's own cell rebound) are never touched.
"""

from __future__ import annotations

from ..pool import capture
from ..pool.errors import CaptureError, NbddpError
from ..pool.shipped import Shipped
from ..wire.stacks import rank_set
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
        self.shipped = Shipped()
        self._told_theirs: set[str] = set()  # names said kept by the ranks (_keep_theirs)
        # rank -> (its namespace's number, how many of import_log that namespace ran)
        self._ran: dict[int, tuple[int | None, int]] = {}

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
        before = len(self.import_log)
        fresh = [
            stmt
            for stmt in capture.import_statements(self.shell.transform_cell(cell))
            if stmt not in self.import_log
        ]
        if failed:  # (replayed with the next cell to all: a rank may have failed first)
            self.import_log += [s for s in fresh if capture.names_imported([s]) <= _held(pool)]
            return
        self.import_log += fresh
        spaces = pool.namespaces
        for rank, (space, ran) in self._ran.items():
            if ran == before and spaces.get(rank) == space:  # it ran the cell's too
                self._ran[rank] = (space, len(self.import_log))

    def _replays(self, pool, ranks) -> tuple[dict[int, list[str]], set[int]]:
        """Each target's imports to run (those of the log its namespace has not run), and
        the targets whose namespace is new since the last cell that reached them."""
        spaces = pool.namespaces
        replays: dict[int, list[str]] = {}
        new: set[int] = set()
        for rank in range(pool.world_size) if ranks is None else ranks:
            space, ran = self._ran.get(rank, (None, 0))
            if space != spaces.get(rank):
                ran = 0
                new.add(rank)
            replays[rank] = self.import_log[ran:]
            self._ran[rank] = (spaces.get(rank), len(self.import_log))
        return replays, new

    def versions(self, pool, objects: dict[str, object], ranks) -> dict[str, int]:
        """The notebook's version of each object it ships (``--need``, push, automatic
        capture), for :meth:`nbddp.Pool.run`; sent to every rank: not shipped again."""
        for name, obj in objects.items():
            if ranks is None:
                self.shipped.sent(pool.generation, name, obj)
        return self.shipped.versions(objects)

    def ship(self, pool, cell: str, ranks, explicit, imports: str):
        """Names ``cell`` reads that only the notebook has (a shipment, and their
        versions), and the imports to run first (the notebook's not yet replayed to that
        rank's namespace, then ``imports``: one text for all, or each rank's); said in
        one line."""
        self.shipped.forget_unbound(self.shell.user_ns)  # (del'd or rebound: not held)
        objects, sizes, notes, auto = self._select(pool, cell, ranks, explicit)
        replays, new = self._replays(pool, ranks)
        said = [f"{n} ({capture.human(sizes[n])})" for n in objects]
        said += _replayed_words(replays, new)
        if said:
            say("shipped " + ", ".join(said) if objects else ", ".join(said))
        for note in notes:
            say(note)
        versions = self.versions(pool, objects, ranks)
        each = {
            r: "\n".join([*replay, imports] if imports else replay) for r, replay in replays.items()
        }
        texts = set(each.values())
        return auto, versions, (texts.pop() if len(texts) == 1 else each)

    def _select(self, pool, cell: str, ranks, explicit):
        """(objects, their sizes, notes, the packed shipment) for ``cell``."""
        code = self.shell.transform_cell(cell)  # what the ranks compile: magics made calls
        theirs = pool.shipped_on(ranks) - self.shipped.names()  # another kernel sent them
        told = self._keep_theirs(code, theirs, explicit)
        try:
            objects, sizes, notes = capture.select_auto(
                code,
                self.shell.user_ns,
                pool.names_on(ranks) | theirs,
                explicit,
                self.limit,
                capture.names_imported(self.import_log),
                lambda name, obj: self.shipped.unchanged(pool.generation, name, obj),
            )
            auto = capture.pack(objects, pool.shm_folder)
        except CaptureError as exc:
            return {}, {}, [*told, str(exc)], None
        return objects, sizes, told + notes, auto

    def _keep_theirs(self, code: str, theirs: frozenset[str], explicit) -> list[str]:
        """One line, once per name, for names the cell reads that the ranks hold from an
        earlier kernel (a detached pool) and this notebook binds too: the ranks keep
        theirs (a model they trained is not replaced by the notebook's fresh one)."""
        names = sorted(
            n
            for n in capture.names_read(code)
            if n in theirs and n in self.shell.user_ns and n not in explicit
        )
        names = [n for n in names if n not in self._told_theirs]
        self._told_theirs.update(names)
        if not names:
            return []
        listed = ", ".join(names)
        return [
            f"{listed}: the ranks keep their own (an earlier kernel sent "
            f"{'them' if len(names) > 1 else 'it'}), not this notebook's; "
            f"%ddp push {' '.join(names)} sends this notebook's"
        ]


def _imports(count: int) -> str:
    return f"{count} import{'s' * (count > 1)}"


def _replayed_words(replays: dict[int, list[str]], new: set[int]) -> list[str]:
    """``replayed 5 imports`` (the same to every target), else ``replayed 5 imports on
    rank 2 (new), 1 import on ranks 0, 1``: where each went, the new ranks named so."""
    by_count: dict[int, list[int]] = {}
    for rank, replay in sorted(replays.items()):
        by_count.setdefault(len(replay), []).append(rank)
    if set(by_count) == {0}:
        return []
    if len(by_count) == 1:
        return [f"replayed {_imports(next(iter(by_count)))}"]
    parts = [
        f"{_imports(count)} on {rank_set(ranks)}" + (" (new)" if set(ranks) <= new else "")
        for count, ranks in sorted(by_count.items(), reverse=True)
        if count
    ]
    return ["replayed " + ", ".join(parts)]
