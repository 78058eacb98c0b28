"""A rank that took a dead one's place, or that a resize added, re-runs what it can.

A new rank starts with a fresh namespace; ``--heal`` copies named objects (a model,
its optimizer) from a survivor, but what earlier cells made on each rank of its own
(its data shard, a loss function, a helper) is not there, and the next cell would fail
on it. So the pool keeps a bounded :class:`History` of the cells that ran cleanly on
every rank (each one's code, imports, label, the names it binds and touches at the
top level, read with ``ast``), and after a replacement (:meth:`nbddp.pool.repair.PoolRepair.
_replaced`, after the heal) or a resize up (:mod:`nbddp.pool.resizing`), :func:`replay`
re-runs on the new ranks alone, in order, the cells that can be:

- a cell that issued no operation on any group on any rank (each rank's counts before
  and after it: ``Done.issued``, from :func:`nbddp.rank.seq.positions`); one that did
  needs every rank, and is never re-run on one;
- that used nothing the notebook sent (``--need``, automatic capture), ran no script and
  ran on every rank (not ``--ranks``);
- that touches no healed name at its top level (a re-run must never reset what
  ``--heal`` copied: ``model = Net()`` would), said in one line when skipped;
- that binds a name the new rank lacked, or touches one a re-run made again;
- whose names no later cell that cannot be re-run binds again (``model = Net()``, then
  ``model = DDP(model)``: the first alone would give the new rank a fresh model).

Each re-run's output is dropped, its errors said; the re-runs together take at most
:data:`BUDGET` s. The note says which cells ran and what they made; what a survivor has
that the new rank still lacks is said in one line with the command that mends it
(``%ddp copy``). A survivor's objects are never copied unasked: a rank's data is its own.
``Pool(rerun=False)`` turns it off.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from . import deathnote
from .drive import drive, own_cells
from .outcome import failures_of

__all__ = ["BUDGET", "Entry", "History", "record", "replay", "scan"]

KEPT = 256  # cells kept, the oldest forgotten first
MAX_CODE = 100_000  # a longer cell is kept without its code (not re-run)
BUDGET = 60.0  # seconds all the re-runs after one replacement may take
# what every rank's namespace holds from its start (rank.cell.make_namespace)
STARTING = frozenset({"display", "torch", "rank", "local_rank", "world_size", "device"})


@dataclass(frozen=True)
class Entry:
    """One cell that ran cleanly on every rank."""

    label: str  # ``In [5]`` (the notebook's), else ``cell 5`` (the pool's count)
    code: str
    imports: str  # run before it (the notebook's replayed imports, ``--imports``)
    binds: tuple[str, ...]  # names it binds at its top level, in order
    touches: frozenset[str]  # names it binds or reads at its top level (not in a def)
    why_not: str = ""  # why it is not re-run on a new rank ("": it can be)


class _Scan(ast.NodeVisitor):
    """The names a cell binds, and binds or reads, where its top level runs (a function's
    body runs when called: its defaults and decorators count, its body not)."""

    def __init__(self) -> None:
        self.binds: dict[str, None] = {}
        self.reads: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.reads.add(node.id)
        else:
            self.binds[node.id] = None

    def visit_FunctionDef(self, node) -> None:
        for expr in [*node.decorator_list, node.args, node.returns]:
            if expr is not None:
                self.visit(expr)
        self.binds[node.name] = None

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        with self._inner():  # its body's names are the class's
            self.generic_visit(node)
        self.binds[node.name] = None

    def _comprehension(self, node) -> None:
        with self._inner():  # its loop variables are its own
            self.generic_visit(node)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node) -> None:
        for alias in node.names:
            self.binds[alias.asname or alias.name.split(".")[0]] = None

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.binds[node.name] = None
        self.generic_visit(node)

    def visit_MatchAs(self, node) -> None:
        if node.name:
            self.binds[node.name] = None
        self.generic_visit(node)

    visit_MatchStar = visit_MatchAs

    @contextlib.contextmanager
    def _inner(self):
        binds = dict(self.binds)
        yield
        self.binds = binds


def scan(code: str) -> tuple[tuple[str, ...], frozenset[str]] | None:
    """(names ``code`` binds at its top level, in order; names it binds or reads there),
    or None when it is not Python."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    seen = _Scan()
    seen.visit(tree)
    binds = tuple(n for n in seen.binds if n != "*")
    return binds, frozenset(binds) | frozenset(seen.reads)


class History:
    """The cells that ran cleanly on every rank, the newest :data:`KEPT`."""

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque(maxlen=KEPT)
        self.paused = 0  # the pool's own cells (a copy, a re-run) run: not kept

    def clear(self) -> None:
        self.entries.clear()

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _why_not(run, issued: bool) -> str:
    if issued:
        return "issued collectives"
    if run.needs or run.auto:
        return "used objects the notebook sent"
    if len(run.code) > MAX_CODE:
        return "too long to keep"
    return ""


def ran_cleanly(pool, cell, end) -> bool:
    """``cell`` (:class:`nbddp.pool.cell.Cell`, ended with ``end``) is a user's cell that
    ran on every rank and ended well on each (what a re-run and a snapshot take)."""
    history = getattr(pool, "history", None)  # (a test's stand-in pool has none)
    runs, out = cell.runs, cell.out
    if history is None or history.paused or not runs or out is None:
        return False  # (the pool's own cells run paused)
    if sorted(runs) != list(range(pool.world_size)):
        return False  # ``--ranks``: the others did not run it
    if end.errors or end.exits or end.interrupted or end.freed or end.deadlock:
        return False
    return all((d := out.done.get(r)) is not None and d.status == "ok" for r in runs)


def record(pool, cell, end) -> None:
    """Keep ``cell`` if it ran cleanly on every rank (:func:`ran_cleanly`)."""
    if not ran_cleanly(pool, cell, end) or not pool.rerun:
        return
    runs, out = cell.runs, cell.out
    done = [out.done.get(r) for r in runs]
    run = runs[min(runs)]
    if run.script or run.post_mortem:
        return
    history = pool.history
    scanned = scan(run.code)
    if scanned is None:
        return
    why = _why_not(run, any(d.issued for d in done))
    code = "" if len(run.code) > MAX_CODE else run.code
    label = cell.label or f"cell {cell.cell}"
    history.entries.append(Entry(label, code, run.imports, *scanned, why))


@dataclass
class _Replay:
    """What the re-runs on one set of new ranks did."""

    ran: list[Entry]
    skipped: list[tuple[Entry, frozenset[str]]]  # (cell, the healed names it touches)
    failed: list[tuple[Entry, str]] = field(default_factory=list)  # the cells that failed, how


def replay(pool, new: list[int], healed=None) -> list[str]:
    """Re-run on ``new`` (ranks with fresh namespaces) the cells that can be, in order,
    after ``healed`` (:class:`nbddp.pool.deathnote.Healed`, or None); the notes."""
    history = pool.history
    if not pool.rerun or history.paused or not new or pool.needs_restart:
        return []
    table = pool.roster.ranks
    survivors = [r for r in sorted(table) if r not in new]  # (none: nothing to copy from)
    if not history.entries:
        return []
    # never touched again: what --heal copied, or copies from a survivor (a resize heals none)
    copied = frozenset(getattr(pool, "heal", ()) or ()) | frozenset(healed.names if healed else ())
    before = {r: table[r].names for r in new}
    with own_cells(pool), history.pause():  # (the re-runs' cells would take the notes)
        done = _run_all(pool, new, copied, before)
    return _said(pool, new, survivors[0] if survivors else None, done)


def _run_all(pool, new: list[int], copied: frozenset[str], before: dict) -> _Replay:
    table, done = pool.roster.ranks, _Replay([], [])
    remade: set[str] = set()  # names the re-runs made again
    broken: set[str] = set()  # names a re-run that failed binds: who uses them is not re-run
    imports: list[str] = []  # every kept cell's imports, run with the next re-run
    known = set(STARTING) | set(dir(builtins))  # what any new rank has, or the replay gives
    deadline = time.monotonic() + BUDGET
    entries = list(pool.history.entries)
    for i, entry in enumerate(entries):
        if entry.imports:
            imports.append(entry.imports)
            known |= set((scan(entry.imports) or ((), None))[0])
        if entry.why_not or set(entry.binds) & _bound_later(entries[i + 1 :]):
            continue  # (what a later cell that cannot be re-run binds again: `%ddp copy` it)
        reads = entry.touches - set(entry.binds)
        if entry.touches & broken or any(reads - known - remade - before[r] for r in new):
            broken |= set(entry.binds)  # (it uses what a failed re-run would have made, or
            continue  # what only a cell that cannot be re-run made: it would fail)
        if entry.touches & copied:
            done.skipped.append((entry, entry.touches & copied))
            continue
        lacks = any(set(entry.binds) - before[r] - STARTING for r in new)
        if not lacks and not entry.touches & remade:
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            done.failed.append((entry, f"the re-runs took over {BUDGET:g} s"))
            break
        events = pool.run(entry.code, ranks=new, imports="\n".join(imports), timeout=left)
        end = drive(pool, events)
        imports = []
        pool.notes += end.notes
        failures = failures_of(end, pool.hosts)
        gone = end.interrupted or pool.needs_restart or any(r not in table for r in new)
        if failures or gone:
            how = failures[0].summary if failures else "interrupted, or the pool was stopped"
            done.failed.append((entry, how.splitlines()[0] if how else "it failed"))
            if gone:
                break
            broken |= set(entry.binds)  # (a cell of its own may still run: the next ones)
            continue
        done.ran.append(entry)
        remade |= set(entry.binds)
    return done


def _bound_later(entries: list[Entry]) -> set[str]:
    """The names that cells which cannot be re-run bind again (``model = DDP(model)`` after
    ``model = Net()``): a re-run of the first would give the new rank a fresh object where
    the others hold one the later cells made (or trained), so it is left to `%ddp copy`."""
    return {name for e in entries if e.why_not for name in e.binds}


def _said(pool, new, src: int | None, done: _Replay) -> list[str]:
    table = pool.roster.ranks
    labels = [e.label for e in done.ran]
    made = [n for e in done.ran for n in e.binds]
    ranks = [r for r in new if r in table]
    now = {r: table[r].names for r in ranks}
    got = list(dict.fromkeys(n for n in made if all(n in now[r] for r in ranks)))
    notes = [deathnote.reran(ranks, labels, got)] if labels else []
    notes += [deathnote.not_reran(ranks, e.label, touched) for e, touched in done.skipped]
    for entry, how in done.failed:
        notes.append(deathnote.rerun_failed(ranks, entry.label, how))
    source = None if src is None else table.get(src)
    if source is None:
        return notes
    imports = {h.name for h in source.held if h.shipped or h.kind == "import"}  # (replayed)
    theirs = source.names - source.modules - STARTING - imports
    for rank in ranks:
        lacks = sorted(theirs - now[rank] - {"group", "mesh"})
        if lacks:
            skipped = {e.label: f"touches {', '.join(sorted(t))}" for e, t in done.skipped}
            notes.append(deathnote.still_lacks(rank, lacks, src, _made_by(pool, lacks, skipped)))
    return notes


def _made_by(pool, names: list[str], skipped: dict[str, str]) -> list[tuple[str, str]]:
    """The kept cells that last bound each of ``names`` (label, why it was not re-run)."""
    made: dict[str, str] = {}
    wanted = set(names)
    for entry in reversed(pool.history.entries):
        if wanted & set(entry.binds):
            made.setdefault(entry.label, entry.why_not or skipped.get(entry.label, ""))
            wanted -= set(entry.binds)
    return list(made.items())[::-1]
