"""The pool's hands for recovery: it gathers the facts, asks, and carries the decision out.

:mod:`nbddp.pool.recovery` decides, from typed facts (:class:`~nbddp.pool.recovery.Facts`, who died
and how), what a failure costs: a re-formed group (:class:`~nbddp.pool.recovery.Reform`), new
processes for dead ranks (:class:`~nbddp.pool.recovery.Replace`), a stopped pool
(:class:`~nbddp.pool.recovery.Stop`, :class:`~nbddp.pool.recovery.Restart`,
:class:`~nbddp.pool.recovery.Refuse`), and words the notes. :class:`PoolRepair`, the part of
:class:`~nbddp.pool.facade.Pool` that owns the ranks' records, processes and connections with
:class:`~nbddp.pool.life.PoolLife`, is the only one that carries those decisions out:
the cell hands it what happened and takes back events. It needs what
:class:`~nbddp.pool.facade.Pool` sets up in its ``__init__``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..rank.gpus import pool_plan
from ..wire import protocol as P
from . import agreeing, healing, hosts_lost, rebinding, recovery
from .errors import PoolClosedError, PoolStartError
from .hub import Gone
from .processes import rank_env
from .recovery import Dead, Death, Facts, Reform, Refuse, Replace, Restart
from .roster import TAKES_NONE, Rank, RankGone

if TYPE_CHECKING:
    from .facade import Pool

__all__ = ["PoolRepair"]


class PoolRepair:
    """Carry out what :mod:`nbddp.pool.recovery` decides: before a cell, as a rank dies in one,
    after it, and at the supervisor's last resort."""

    def facts(self: Pool) -> Facts:
        """What recovery needs to know of this pool now."""
        # a rank whose host was lost comes back from a replacement host (nbddp.pool.hosts_lost),
        # unless that host held torchrun's store
        store_lost = hosts_lost.why_not(self) if self.attached else ""
        held = all(r.renewable for r in self.roster.ranks.values())
        renewable = not self.attached or (held and not store_lost)
        return Facts(
            world_size=self.world_size,
            on_death=self.on_death,
            attached=self.attached,
            renewable=renewable,
            lost=self.needs_restart,
            rebuilt=bool(self.mesh or self.groups),
            grace=self.grace,
            store_lost=store_lost,
        )

    def can_replace(self: Pool) -> bool:
        """A dead rank of this pool gets a new process (else the pool is stopped)."""
        return recovery.can_replace(self.facts())

    # ------------------------------------------------------------ before a cell

    def mend(self: Pool) -> None:
        """Start the pool anew if it lost its state (said in a note), replace a rank that
        died since the last cell; refuse a stopped pool (PoolClosedError)."""
        closed = self.state == "closed" and not self.roster.ranks
        # (an attached pool whose lost host's ranks are missing is refused by hosts_lost)
        started = self.started or bool(self.roster.missing)
        refused = recovery.refusal(self.facts(), closed, started)
        if refused is not None:
            self._refuse(refused)
        items = self._between_cells()
        self.roster.keep_output(items)
        # (a local rank's exit as its launcher saw it, too: its last message may be read,
        # its end of file not yet)
        gone = sorted({i.rank for i in items if type(i) is Gone} | set(self.hub.exits()))
        table = self.roster.ranks
        deaths = [Death(rank, self.exit_code(table[rank]), table[rank].host) for rank in gone]
        decision = recovery.between_cells(self.facts(), deaths, self.hub.closed)
        if type(decision) is Replace:
            for death in deaths:
                r = self.roster[death.rank]
                self.roster.backlog += self.drain(death.rank)
                r.state, r.returncode = "dead", death.code
            self.notes += decision.notes
            events = list(self._replace(decision))
            self.roster.backlog += [e for e in events if type(e) is P.Output]
        elif type(decision) is Refuse:
            self._refuse(decision)
        elif type(decision) is Restart:
            self.lose()
            self.notes.append(decision.note)
        back = hosts_lost.arrived(self) if self.attached else []  # (refused at once: missing)
        if back:
            events = list(self._replace(Replace(tuple(back))))
            self.roster.backlog += [e for e in events if type(e) is P.Output]
        if not self.started:
            self.start()

    def _refuse(self: Pool, decision: Refuse) -> None:
        if decision.stop:  # (the connections closed for a bad frame are said in it)
            self.hub.closed = []
            self.lose()
            self._take_no_rank()
        raise PoolClosedError(decision.message + self._turned_away(decision.turned_away))

    def _between_cells(self: Pool, rounds: int = 64) -> list:
        """What came between cells, read until nothing more is there (a rank's last message
        and its end of file may take two reads), ``rounds`` reads at most."""
        items: list = []
        for _ in range(rounds if self.roster.ranks else 0):
            more = self.hub.pump(0)
            if not more:
                break
            items += more
        return items

    def _turned_away(self: Pool, wanted: bool) -> str:
        """The workers turned away since the pool was stopped, in a few words (or nothing)."""
        lines = self.listener.refusals(take=True) if wanted and self.listener is not None else []
        return f" ({'; '.join(lines)})" if lines else ""

    def _take_no_rank(self: Pool) -> None:
        """An attached pool that lost a rank turns every worker that comes away at once, with
        the reason (torchrun's restarted workers waited for it forever)."""
        if self.attached:
            self.roster.closed_to = f"the pool lost a rank and was stopped, and {TAKES_NONE}"

    # ------------------------------------------------------------ in and after a cell

    def rank_died(self: Pool, sup, out, r):
        """One rank died, after everything it printed: its group is broken, so the
        supervisor frees the others (the pool replaces it after the cell), or stops them."""
        yield from self.drain(r.rank)
        r.state, r.returncode = "dead", self.exit_code(r)
        out.exits[r.rank] = exit_event = P.RankExit(r.rank, r.returncode, when=time.time())
        yield exit_event
        yield P.RankState(r.rank, "dead")
        facts = self.facts()
        sup.replace_dead = sup.replace_dead and recovery.can_replace(facts)  # (relay ended?)
        sup.died(r.rank, time.monotonic())
        self.notes += recovery.death_notes(facts, r.rank, r.returncode, out.code)

    def recover(self: Pool, sup, out):
        """After a cell: replace the ranks that died in it, or re-form its group."""
        died = sorted(r for r, x in out.exits.items() if not x.stopped_by_pool)
        stopped = sorted(r for r, x in out.exits.items() if x.stopped_by_pool)
        decision = recovery.after_cell(self.facts(), died, sup, out, stopped)
        if type(decision) is Replace:
            yield from self._replace(decision)
        elif type(decision) is Reform:
            yield from self._reform(decision, out.code)

    def stop_all(self: Pool, out, action):
        """The last resort: stop the ranks stuck past the grace period, and every other
        live rank unless the stuck ones alone can be given new processes after the cell
        (:func:`nbddp.pool.recovery.stop`); the next cell then starts a new pool."""
        live = self.roster.live()
        decision = recovery.stop(self.facts(), action, [o.rank for o in live])
        self.notes.append(decision.note)
        ended = [o for o in live if o.rank in decision.ranks or not decision.only]
        for o in ended:
            if not self.procs.kill(o.pid):
                o.send(P.Shutdown())
        self.reap(ended, time.monotonic() + 2.0)
        if not decision.only:
            self._take_no_rank()
        for o in ended:
            yield from self.drain(o.rank)
            if o.rank in decision.ranks:
                out.exits[o.rank] = P.RankExit(o.rank, o.returncode, True, time.time())
                yield P.RankState(o.rank, "dead")
        if not decision.only:
            self.state = "lost"

    # ------------------------------------------------------------ re-forms

    def _reform(self: Pool, decision: Reform, code: str):
        """Every rank joins a new group; namespaces stay. Fall back to stopping the pool."""
        t0 = time.monotonic()
        had = yield from self._formed_again([])
        if had is None:
            return
        if had:  # ranks died while the group formed: a new process took each one's place
            yield from self._replaced(had, t0, code)
        else:
            took = time.monotonic() - t0
            bound = rebinding.words(self.roster.ranks.values(), self.world_size)
            one = agreeing.one_model(self)  # (its copy's cells set self.notes)
            if not decision.quiet:
                self.notes.append(recovery.reformed_note(self.facts(), decision, took, bound))
            self.notes += one

    def _replace(self: Pool, decision: Replace):
        """New processes in place of the dead ranks, the group re-formed with all of them;
        every other rank keeps its namespace."""
        if self.attached and hosts_lost.defer(self, list(decision.ranks)):
            # a lost host's ranks: the re-form waits for a replacement host (said in rows)
            missing = tuple(n for n in decision.ranks if n in self.roster.missing)
            if missing:
                yield P.RankStates(missing, "missing")
            return
        t0 = time.monotonic()
        had = yield from self._formed_again(list(decision.ranks))
        if had is not None:
            yield from self._replaced(had, t0, decision.code, decision.stopped)

    def _replaced(self: Pool, had: dict[int, Dead], t0: float, code: str, stopped=()):
        """Say what the replaced ranks held (after ``--heal``'s copy, before the next cell)."""
        took, table = time.monotonic() - t0, self.roster.ranks
        fresh = {r: frozenset(h.name for h in table[r].held) | table[r].names for r in had}
        bound = rebinding.words(self.roster.ranks.values(), self.world_size, died=True)
        one = agreeing.one_model(self, sorted(had))  # (first: the heal copies from a survivor)
        healed, reran = healing.renew(self, sorted(had))  # (its cells set self.notes)
        facts = self.facts()
        self.notes += recovery.replaced_notes(facts, had, took, fresh, healed, code, bound, stopped)
        self.notes += one
        self.notes += reran
        for rank in sorted(had):
            yield P.RankState(rank, "replaced")

    def _formed_again(self: Pool, dead: list[int]):
        """Re-form the group, new processes in place of ``dead`` and of any rank that dies
        on the way; {rank: what it held} for the replaced ranks, or None when the pool had
        to be stopped (said in a note). Yields the output that came meanwhile."""
        try:
            had = self.form_again(dead)
        except hosts_lost.HostsLostInReform as exc:
            yield from self._missing_instead(exc.ranks)
            return None
        except PoolStartError as exc:
            self.lose()
            self._take_no_rank()
            self.notes.append(recovery.failed_note(exc))
            return None
        if had:
            self.generation += 1  # fresh namespaces: the imports are replayed to them
        backlog, self.roster.backlog = self.roster.backlog, []
        yield from backlog
        return had

    def _missing_instead(self: Pool, lost: dict[int, str]):
        """A re-form found a dead rank's host lost: its ranks are missing (said in a note and
        the rows), the others are freed from the re-form that waits for them and wait,
        without a group, for the replacement host (:func:`nbddp.pool.hosts_lost.arrived`)."""
        hosts_lost.defer(self, sorted(lost))
        for r in self.roster.ranks.values():
            if r.rank not in lost and r.state == "starting" and r.link.conn is not None:
                r.send(P.AbortGroup())
                r.state = "idle"
        yield P.RankStates(tuple(sorted(lost)), "missing")

    def form_again(
        self: Pool,
        dead: list[int],
        timeout: float = recovery.REFORM_TIMEOUT,
        new: tuple[int, ...] = (),
    ) -> dict[int, Dead]:
        """Every rank forms the group again (namespaces kept), a new process in place of
        each of ``dead`` and of each rank that dies meanwhile (then the survivors are freed
        from the re-form that waits for it, and every rank joins the next one).
        PoolStartError if not all joined within ``timeout``, or an interrupt ended the
        wait. ``new``: ranks a resize adds (their records hold no process yet), started
        fresh (nbddp.pool.resizing)."""
        roster, requests = self.roster, self.requests
        roster.store_port = None
        had: dict[int, Dead] = {}
        pending, fresh, again = sorted(dead), set(new), False
        chosen = pool_plan(self)  # a resize may change it: ranks that come to share a GPU
        backend = chosen.backend if chosen is not None else ""
        # attached: the dead processes' records (their relay): a host lost as its ranks died
        # ends the wait for their new processes (HostsLostInReform), which cannot come
        records: dict[int, Rank] = {}
        if self.attached:
            timeout = max(timeout, recovery.RENEW_TIMEOUT)

        def cancelled() -> bool:
            return requests.cancel_wait or bool(hosts_lost.vanished(roster, records))

        requests.reforming, requests.cancel_wait = True, False
        try:
            while True:
                self._count_dead(pending, had, again)
                restart = sorted(set(pending) | fresh)  # new ones have no state: start again
                if self.attached:
                    records.update((n, roster.ranks[n]) for n in restart if n in roster.ranks)
                self._reform_round(restart, backend, again)
                fresh, again = set(restart), True
                try:
                    self.handshake(timeout, cancelled)
                    return had
                except RankGone as gone:
                    if not self.can_replace():
                        raise
                    pending = [gone.rank]
                except PoolStartError:
                    lost = hosts_lost.vanished(roster, records)
                    if not lost:
                        raise
                    roster.ranks.update((n, records[n]) for n in lost)  # dead, on a lost host
                    if hosts_lost.store_lost(self):
                        raise PoolStartError(hosts_lost.why_not(self)) from None
                    raise hosts_lost.HostsLostInReform(lost) from None
        finally:
            requests.reforming = False
            roster.renewing = None

    def _count_dead(self: Pool, pending: list[int], had: dict[int, Dead], again: bool) -> None:
        """Each of ``pending`` died: counted (CrashLoop), said if it died as the group
        re-formed, and what it held kept for its note."""
        for rank in pending:
            r = self.roster[rank]
            code = r.returncode if r.returncode is not None else self.exit_code(r)
            if again:
                self.notes.append(recovery.died_again(rank, code))
            recovery.count_death(self.roster.deaths, rank, time.monotonic())
            had.setdefault(rank, Dead(r.held, code)).code = code

    def _reform_round(self: Pool, restart: list[int], backend: str, again: bool) -> None:
        """New processes for ``restart``; every other rank is asked to join the re-form
        (freed first from the one a death broke, ``again``)."""
        roster = self.roster
        if restart:
            self._end_processes([roster[rank] for rank in restart])
        roster.reforms += 1
        survivors = [r for r in roster.ranks.values() if r.rank not in restart]
        reform = P.Reform(roster.reforms, self.world_size, backend)
        roster.renewing = reform if self.attached else None
        for rank in restart:
            self._start_again(rank)
        if restart:
            self.hub.forget_sentinels()  # the dead ones' fd numbers may come back
        for r in survivors:
            r.state = "starting"
            if again:  # free those waiting in the re-form a death broke
                r.send(P.AbortGroup())
            r.send(reform)

    def _start_again(self: Pool, rank: int) -> None:
        """A new process for ``rank``: from the fork server (local), or the one its holder
        forked on its host (attached: it joins the re-form as it connects)."""
        roster = self.roster
        if self.attached:
            roster.renew(rank)
        else:
            env = rank_env(self, rank, roster.reforms)
            roster.add(rank, self.procs.start(rank, self.address, env))

    def _end_processes(self: Pool, ranks: list) -> None:
        """Kill what is left of ``ranks`` (dead, or new and not yet in); close their links."""
        live = [r for r in ranks if r.state != "dead"]
        for r in live:
            self.procs.kill(r.pid)
        self.reap(live, time.monotonic() + 2.0)
        for r in ranks:
            self.roster.forget(r.rank)
