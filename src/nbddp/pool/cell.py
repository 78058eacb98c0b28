"""One cell on the pool: send it, turn what comes back into events, act on failures.

:meth:`nbddp.Pool.run` returns a :class:`Cell`, an iterator of events that
ends with a :class:`~nbddp.wire.protocol.CellEnd`. Each step waits on the hub for
items (or the supervisor's next deadline), hands each item to its handler
(a table keyed by the item's type, then by the message's type), and carries
out what the :class:`~nbddp.pool.supervisor.CellSupervisor` says is due: stack
samples, interrupts, an abort of the group, the last resort of stopping the
pool. What a failure costs is decided by :mod:`nbddp.pool.recovery` and carried out by the
pool (:class:`~nbddp.pool.repair.PoolRepair`): the cell hands it what happened.
"""

from __future__ import annotations

import gc
import inspect
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..wire import protocol as P
from ..wire import stacks as S
from . import keeping, rerun
from .deadlock import world_count
from .errors import root_causes
from .hub import Closed, Dones, Gone, Mark, Msg, Text
from .outcome import Outcome, failures_of
from .supervisor import CellSupervisor

__all__ = ["Cell", "Requests", "left_unread", "make_runs"]


@dataclass
class Requests:
    """Interrupt requests, from any thread: kept until the cell they are for acts."""

    pending: int | None = None  # the cell run() made; it has not ended yet
    active: int | None = None  # the cell running now
    request: tuple[int, float] | None = None  # (cell, when) the stop button was pressed
    reforming: bool = False  # a re-form waits for the ranks: an interrupt ends the wait
    cancel_wait: bool = False

    def ask(self, now: float) -> bool:
        """An interrupt for the current cell (or the wait after it); False: nothing runs."""
        if self.reforming:
            self.cancel_wait = True
            return True
        cell = self.active if self.active is not None else self.pending
        if cell is None:
            return False
        if self.request is None or self.request[0] != cell:
            self.request = (cell, now)
        return True

    def for_cell(self, cell: int) -> tuple[int, float] | None:
        return self.request if self.request is not None and self.request[0] == cell else None

    def ended(self, cell: int) -> None:
        self.active = None
        if self.pending == cell:
            self.pending = None
        if self.for_cell(cell) is not None:
            self.request = None  # the cell ended: it was answered


def make_runs(
    targets: list[int], shown: set[int], imports: str | Mapping[int, str] = "", **fields
) -> dict[int, P.Run]:
    """Each target's Run (``fields``, its imports: the same for all, or each rank's own,
    and whether it shows rich output): one message per kind, so each is pickled once
    for every rank that gets it."""
    runs: dict[tuple[bool, str], P.Run] = {}
    for_rank: dict[int, P.Run] = {}
    for r in targets:
        own = imports if isinstance(imports, str) else imports.get(r, "")
        key = (r in shown, own)
        if key not in runs:
            runs[key] = P.Run(display=key[0], imports=own, **fields)
        for_rank[r] = runs[key]
    return for_rank


def left_unread(end: P.CellEnd | None) -> str:
    """The note on a cell whose events were not read to its end, for the next cell."""
    how = "it had ended"
    if end is not None and end.interrupted:
        how = "it was interrupted" + (" (every rank's state kept)" if end.kept else "")
    if end is not None and end.errors:
        how += f", rank{'s' * (len(end.errors) > 1)} {', '.join(map(str, end.errors))} failed"
    return f"the previous cell's events were not read to its end: {how}; its output was dropped"


class Cell:
    """The events of one cell, as it runs (an iterator: iterate it once)."""

    def __init__(
        self, pool, cell: int, runs: dict[int, P.Run], timeout, tick, shipments, raw=False
    ) -> None:
        self.pool, self.cell, self.runs, self.raw = pool, cell, runs, raw
        self.timeout, self.tick, self.shipments = timeout, tick, shipments
        self.sup: CellSupervisor | None = None
        self.out: Outcome | None = None
        self.generation = getattr(pool, "generation", 0)  # (a restart since: ranks gone)
        self.dropped = False  # finish() let it go: a close is no consumer giving up
        self.outer: Cell | None = None  # the cell this one runs inside (a heal's copy)
        self.label = ""  # In [N] (nbddp.pool.rerun keeps the cells a new rank can re-run)
        self._counts: dict[int, int] = {}  # each rank's last collective count shown
        self._events = self._run()

    @property
    def running(self) -> bool:
        """Its events are being made now: a cell run from inside it is nested, not next."""
        return inspect.getgeneratorstate(self._events) == inspect.GEN_RUNNING

    def __iter__(self):
        return self._events  # (the generator itself: no call of ours per event)

    def __next__(self) -> object:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def finish(self) -> None:
        """Its consumer left it before its end (a loop left early, Ctrl-C before its
        events were shown): interrupt it if it still runs, read it to its end here (its
        events dropped, a rank's pdb closed), and say so with the next cell. A cell that
        never started is dropped: it never ran."""
        pool, state = self.pool, inspect.getgeneratorstate(self._events)
        if state == inspect.GEN_CLOSED:
            return
        gone = self.generation != pool.generation or not pool.started  # (stopped since)
        if state == inspect.GEN_CREATED or gone:
            self.dropped = True
            self._events.close()
            for shipment in self.shipments:
                shipment.remove()
            pool.requests.ended(self.cell)
            if state == inspect.GEN_CREATED:
                pool.notes.append("the previous cell's events were never read: it did not run")
            return
        if self.sup is None or not self.sup.finished:
            pool.interrupt()
        end = None
        for event in self._events:
            if isinstance(event, P.RankDebug):
                pool.debug_reply(event, None)
            elif isinstance(event, P.CellEnd):
                end = event
        pool.notes.append(left_unread(end))

    # ------------------------------------------------------------ the cell's life

    def _run(self):
        pool = self.pool
        notes = pool.take_notes()
        backlog, pool.roster.backlog = pool.roster.backlog, []
        yield from backlog
        targets = sorted(self.runs)
        self.sup = CellSupervisor(
            self.cell,
            targets,
            time.monotonic(),
            abort_after=pool.abort_after,
            grace=pool.grace,
            timeout=self.timeout,
            replace_dead=pool.can_replace(),
            others=tuple(r.rank for r in pool.roster.live() if r.rank not in self.runs),
            world=pool.world_size,
            detect=os.environ.get("NBDDP_DEADLOCKS", "1") != "0",
        )
        table = pool.roster.ranks
        # a relay forwards a rank's Done after all it printed: no end markers to wait for
        marks = {r: table[r].link.open_streams() for r in targets if not table[r].link.relay}
        self.out = Outcome(self.cell, targets, marks, self.raw, self.pool.shm_folder)
        self.out.code = next(iter(self.runs.values())).code if self.runs else ""
        pool.requests.active = self.cell
        yield from self._supervised(targets)
        yield from self._after(notes)

    def _supervised(self, targets: list[int]):
        pool, sup = self.pool, self.sup
        # while a cell runs, the notebook does little but read the ranks' output, and the
        # collector's full passes over the kernel's heap (torch and all) cost more than the
        # reading: 400,000 lines took 3.7 s of notebook CPU, 1.5 s with the heap frozen
        froze = gc.get_freeze_count() == 0  # a freeze of the user's own is left alone
        if froze:
            gc.freeze()
        try:
            self._send_runs(targets)
            yield P.RankStates(tuple(targets), "running")
            while not sup.finished:
                yield from self._step()
        finally:
            if froze:
                gc.unfreeze()
            pool.requests.ended(self.cell)
            for shipment in self.shipments:  # every rank has loaded them by now
                shipment.remove()
            if not sup.finished and not self.dropped:  # the consumer gave up on us (close):
                pool.lose()  # leave nothing running

    def _send_runs(self, targets: list[int]) -> None:
        by_message: dict[int, list[int]] = {}  # one pickle per message, one write per relay
        for rank in targets:
            by_message.setdefault(id(self.runs[rank]), []).append(rank)
        table = self.pool.roster.ranks
        for some in by_message.values():
            for rank in some:
                table[rank].state = "running"
            self.pool.hub.deliver(some, P.dumps(self.runs[some[0]]), self.cell)

    def _after(self, notes: list[str]):
        pool, sup, out = self.pool, self.sup, self.out
        yield from pool.recover(sup, out)  # replace the dead, re-form the group
        if sup.stacks_at_interrupt:
            pool.last_stacks = dict(sup.stacks_at_interrupt)
            places = sup.places_at_interrupt.items()
            pool.last_counts = {r: world_count((None, g)) for r, g in places}
        end = out.end(sup, notes + pool.take_notes(), kept=not pool.needs_restart)
        rerun.record(pool, self, end)
        if getattr(pool, "keep", ()) and rerun.ran_cleanly(pool, self, end):  # --keep
            keeping.take(pool, self.label or f"cell {self.cell}")
            end = replace(end, notes=(*end.notes, *pool.take_notes()))  # (said now)
        if not end.interrupted:  # a rank a peer's failure broke shows as freed, not red
            _, consequences = root_causes(failures_of(end))
            for f in consequences:
                if f.rank not in end.freed:
                    yield P.RankState(f.rank, "freed")
        if getattr(pool, "last_cell", None) is self:  # read to its end (values not held)
            pool.last_cell = self.outer  # (the cell this one ran inside, if any)
        yield end

    # ------------------------------------------------------------ one step

    def _step(self):
        """Wait for what comes next (or the supervisor's next deadline) and handle it."""
        sup = self.sup
        yield from self._act()
        if sup.finished:
            return
        now = time.monotonic()
        tick_at = None if self.tick is None else now + self.tick
        limits = [t for t in (sup.deadline, tick_at) if t is not None]
        try:
            items = self.pool.hub.pump(max(0.0, min(limits) - now) if limits else None)
        except KeyboardInterrupt:
            self.pool.interrupt()
            return
        if not items and tick_at is not None and time.monotonic() >= tick_at:
            yield P.Tick()
        for item in items:
            yield from self._ITEMS[type(item)](self, item)
        yield from self._act()

    def _act(self):
        """Carry out what the supervisor says is due (and an interrupt asked for)."""
        sup, pool = self.sup, self.pool
        now = time.monotonic()
        actions = []
        if pool.requests.for_cell(sup.cell) is not None and sup.interrupted is None:
            actions += sup.interrupt("interrupt", now)
        for action in actions + sup.due(now):
            if action.kind == "stacks":
                pool.send(action.ranks, P.StackQuery())
            elif action.kind == "interrupt":
                pool.send(action.ranks, P.Interrupt(sup.cell))
            elif action.kind == "abort":
                live = [r.rank for r in pool.roster.live() if r.state != "starting"]
                pool.send(live, P.AbortGroup(sup.cell))
            elif action.kind == "stop":
                yield from pool.stop_all(self.out, action)

    # ------------------------------------------------------------ items

    def _text(self, item: Text):
        yield P.Output(item.rank, item.stream, item.text)

    def _mark(self, item: Mark):
        if item.cell == self.sup.cell:
            yield from self._marked(item.rank, item.stream)

    def _closed(self, item: Closed):
        """A stream ended (the cell closed it: ``os.close(1)``, ``os.dup2(2, 1)``): no
        end marker can come on it any more."""
        yield from self._marked(item.rank, item.stream)

    def _marked(self, rank: int, stream: str):
        marks = self.out.marks.get(rank)
        if marks and stream in marks:
            marks.discard(stream)
            yield from self._maybe_finish(rank)

    def _gone(self, item: Gone):
        r = self.pool.roster[item.rank]
        if r.state != "dead":
            yield from self.pool.rank_died(self.sup, self.out, r)

    def _msg(self, item: Msg):
        handler = self._MESSAGES.get(type(item.msg))
        if handler is not None:
            yield from handler(self, item.rank, item.msg)

    def _dones_item(self, item: Dones):
        yield from self._dones(item.ranks, item.msg)

    _ITEMS = {Text: _text, Mark: _mark, Closed: _closed, Gone: _gone, Msg: _msg, Dones: _dones_item}

    # ------------------------------------------------------------ messages

    def _done(self, rank: int, msg: P.Done):
        yield from self._dones((rank,), msg)

    def _stacks(self, rank: int, msg: P.Stacks):
        sup, now = self.sup, time.monotonic()
        sup.positions(rank, msg.frames, msg.groups, now)
        place, count = sup.stacks(rank, msg.frames, now), world_count(msg.groups)
        if place is None and count == self._counts.get(rank, count):
            return  # (neither moved: nothing new to show)
        self._counts[rank] = count
        place = place or sup.where.get(rank)
        if place is not None and sup.phase.get(rank) == "running":
            summary = S.summary(place.frames)
            yield P.RankWhere(rank, summary, sup.waiting_in(rank), place.since, count)

    def _store_port(self, _rank: int, msg: P.StorePort):
        self.pool.roster.set_store_port(msg.port)  # a script formed the group again
        return ()

    def _display(self, rank: int, msg: P.Display):
        yield P.RankDisplay(rank, msg.data, msg.metadata)

    def _progress(self, rank: int, msg: P.Progress):
        yield P.RankProgress(rank, msg.done, msg.total, msg.desc)

    def _metrics(self, rank: int, msg: P.Metrics):
        yield P.RankMetrics(rank, msg.series)

    def _debug(self, rank: int, msg: P.DebugPrompt):
        yield P.RankDebug(rank, msg.output, msg.prompt, msg.seq)

    _MESSAGES = {
        P.Done: _done,
        P.Stacks: _stacks,
        P.StorePort: _store_port,
        P.Display: _display,
        P.Progress: _progress,
        P.Metrics: _metrics,
        P.DebugPrompt: _debug,
    }

    # ------------------------------------------------------------ ends

    def _dones(self, ranks: tuple[int, ...], msg: P.Done) -> list:
        """The same Done from each of ``ranks`` (one rank, or a relay's group of them); the
        events it makes (a list: at scale, a thousand events a cell pass through here)."""
        sup, out = self.sup, self.out
        if msg.cell != sup.cell:
            return []
        names = None if msg.names is None else frozenset(msg.names)
        modules = frozenset(msg.modules or ())
        table = self.pool.roster.ranks
        for rank in ranks:
            r = table[rank]
            r.state = "idle"
            if names is not None:
                r.names, r.modules = names, modules
            if msg.held is not None:
                r.held = msg.held
        out.done.update(dict.fromkeys(ranks, msg))
        now = time.monotonic()
        if any(out.marks[rank] for rank in ranks):  # direct: finished by its end markers
            events = []
            for rank in ranks:
                sup.done(rank, msg.status, now)
                events += self._maybe_finish(rank)
            return events
        # the output is in (behind a relay, or no stream open): a group in one step
        finished = sup.ended_together(ranks, msg.status, now)
        if msg.status == "ok" and msg.value is None and msg.value_repr is None:
            return [P.RankStates(tuple(finished), "done")] if finished else []  # as finish
        return [event for rank in finished for event in self._finish(rank)]

    def _maybe_finish(self, rank: int) -> list:
        out = self.out
        if rank in out.done and not out.marks[rank] and self.sup.ended(rank):
            return self._finish(rank)
        return []

    def _finish(self, rank: int) -> list:
        done = self.out.done[rank]
        if done.error is not None and self.pool.logs is not None:
            self.pool.logs.error(rank, self.pool.roster[rank].pid, done.error)
        return self.out.finish(rank)
