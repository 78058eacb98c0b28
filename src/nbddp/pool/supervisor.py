"""One cell's supervision as a state machine: rank phases, transitions, deadlines.

Pure: no processes, sockets or clocks of its own. The pool tells a
:class:`CellSupervisor` what happened, with the time it happened, and asks it
what to do now (:meth:`~CellSupervisor.due`) and how long it may wait for the
next event (:attr:`~CellSupervisor.deadline`). So every rule below is tested
with fake ranks and a fake clock (``tests/pool/test_supervisor.py``).

A rank of the cell::

    running --Done--> ending --both end markers--> ok | failed | interrupted
    running --its process ended-----------------> dead
    running --the pool stopped it---------------> stopped

The cell::

    a rank ends badly (error, interrupt, death) while others still run, at t
        -> their stacks are sampled every SAMPLE_FAST s
        -> the group is aborted on every rank (the whole group: no rule depends on
           which peer a blocked rank talks to) at t + abort_after, or as soon as
           every running rank has been seen waiting in a collective for SETTLE s
           (a rank seen there once may be finishing a collective the failed rank
           took part in: on a busy machine it is scheduled late, not blocked)
        -> ranks still waiting in a collective grace s after the abort did not come
           free (a group nbddp could not reach): stop the pool; so are ranks that stayed
           STUCK_AFTER s at one place in torch's own code (a DDP backward: its all_reduce
           runs in C++, with no torch.distributed frame), or answered nothing that long
           (C code that holds the GIL): long, as a big backward or the load of a big
           shipment legitimately stays there for seconds after an abort
    interrupt (stop button, Ctrl-C) or --timeout, at t
        -> stacks are taken (where each rank was), then SIGINT to the running ranks
        -> abort at t + grace/2, or sooner when a rank has ended and every
           running rank has waited SETTLE s in a collective
        -> at t + grace the ranks still running are stuck in C: stop the pool
    a rank dies
        -> with ``replace_dead`` (a local pool): abort the group at once (the others
           wait for a peer that will never come), then as after any abort; the pool
           has a new process take the dead rank's place after the cell
        -> else stop the other ranks at once: the group lost a member for good
    a long cell
        -> stacks every SAMPLE_EVERY s, so a sink can show "waiting in all_reduce (12 s)"
    a rank finished while others run (or --ranks left some out): samples every
        SUSPECT_EVERY s carry each group's count; a certain deadlock (nbddp.pool.deadlock)
        aborts the group at once, as after a failure
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire.stacks import Frame, collective, in_torch
from .deadlock import Deadlock, Seen, disagreeing, judge
from .phases import ENDED, FINAL, Phases

__all__ = ["Action", "CellSupervisor"]

SAMPLE_EVERY = 1.0  # stacks (and collective counts) of a long-running cell, for the dashboard
SAMPLE_FAST = 0.1  # stacks after a failure, to abort as soon as the others wait
SETTLE = 0.2  # seen waiting in the same collective this long after a failure: blocked
SUSPECT_EVERY = 0.25  # positions while some ranks have finished and others still run
DISAGREE_SETTLE = 0.3  # ranks in different collectives at one place this long: deadlocked
STUCK_AFTER = 30.0  # s after an abort: a rank still in torch's code, or silent, is stuck


@dataclass(frozen=True)
class Action:
    """What the pool must do now.

    ``stacks``: ask ``ranks`` where they are. ``interrupt``: SIGINT to ``ranks``.
    ``abort``: abort the group on every live rank (``ranks`` still ran).
    ``stop``: stop the pool; ``ranks`` are those it stops unfinished.
    """

    kind: str
    ranks: tuple[int, ...]
    reason: str = ""
    seen: tuple[tuple[Frame, ...], ...] = field(default=(), compare=False)  # a stop's: stacks
    seconds: float = field(default=0.0, compare=False)  # since the abort (each rank's stack)


@dataclass
class _Where:
    frames: tuple[Frame, ...]
    taken: float  # when the sample arrived
    since: float  # when this place was first seen


@dataclass
class CellSupervisor:
    cell: int
    targets: list[int]
    now: float
    abort_after: float = 1.0
    grace: float = 3.0
    timeout: float | None = None
    replace_dead: bool = False  # a dead rank gets a new process: free the others, keep them
    others: tuple[int, ...] = ()  # live ranks the cell does not run on (--ranks)
    world: int = 0  # the group's size (0: the targets')
    detect: bool = True  # look for deadlocks (NBDDP_DEADLOCKS=0: off, to measure what it costs)
    phase: dict[int, str] = field(init=False)
    first_failure: tuple[float, int] | None = field(init=False, default=None)
    interrupted: str | None = field(init=False, default=None)  # "interrupt" | "timeout"
    interrupt_at: float | None = field(init=False, default=None)
    aborted_at: float | None = field(init=False, default=None)
    aborted_running: tuple[int, ...] = field(init=False, default=())
    stopped: str | None = field(init=False, default=None)  # why the pool was stopped
    died_at: float | None = field(init=False, default=None)  # the first death
    where: dict[int, _Where] = field(init=False, default_factory=dict)
    stacks_at_interrupt: dict[int, tuple[Frame, ...]] = field(init=False, default_factory=dict)
    places_at_interrupt: dict[int, tuple] = field(init=False, default_factory=dict)  # counts
    status: dict[int, str] = field(init=False, default_factory=dict)  # from each Done
    seen: dict[int, Seen] = field(init=False, default_factory=dict)  # running ranks' places
    final: dict[int, tuple] = field(init=False, default_factory=dict)  # finished ranks' counts
    deadlock: Deadlock | None = field(init=False, default=None)
    suspect: bool = field(init=False, default=False)  # a rank finished, others run

    def __post_init__(self) -> None:
        self.phase, self.started = Phases(self.targets, "running"), self.now
        self.others = self.others if self.detect else ()
        self._every = SAMPLE_EVERY if self.detect else 2 * SAMPLE_EVERY
        self._next_sample = self.now + (SUSPECT_EVERY if self.others else self._every)
        self._pending: list[Action] = []
        self._news = False  # positions came since the last judgement
        self._past_grace = False  # the abort's grace period is over (asked at each sample)

    @property
    def triggered_at(self) -> float | None:
        """When the cell went wrong: the first failure or the interrupt."""
        times = [self.interrupt_at, self.first_failure and self.first_failure[0]]
        return min((t for t in times if t is not None), default=None)

    # ------------------------------------------------------------ what is

    @property
    def running(self) -> list[int]:
        """Ranks whose cell has not come back yet (no Done)."""
        return [r for r, p in self.phase.items() if p == "running"]

    @property
    def unfinished(self) -> set[int]:
        """Ranks the cell still waits for (no Done, or output still arriving)."""
        return {r for r, p in self.phase.items() if p not in ENDED}

    @property
    def finished(self) -> bool:
        return not self.phase.unfinished()

    def waiting_in(self, rank: int) -> str | None:
        """The collective ``rank`` was last seen waiting in, if any."""
        w = self.where.get(rank)
        return collective(w.frames) if w else None

    # ------------------------------------------------------------ what happened

    def done(self, rank: int, status: str, now: float) -> None:
        """The rank's Done arrived (``ok``, ``error`` or ``interrupted``)."""
        if self.phase.get(rank) != "running":
            return
        self.phase[rank] = "ending"
        self.status[rank] = status
        if status != "ok":
            self._failed(rank, now)
        self._suspect(now)

    def ended(self, rank: int) -> bool:
        """The rank's output is all in (both end markers after Done): it has finished.

        Returns True the first time, so the pool reports it once.
        """
        if self.phase.get(rank) != "ending":
            return False
        self.phase[rank] = self._final(rank)
        return True

    def ended_together(self, ranks, status: str, now: float) -> list[int]:
        """:meth:`done` and then :meth:`ended` for each of ``ranks`` at once (ranks behind a
        relay: their output is in when their Done comes). Returns the ranks that ended."""
        running = [r for r in ranks if self.phase.get(r) == "running"]
        self.phase.move(running, FINAL.get(status, "interrupted"))
        self.status.update(dict.fromkeys(running, status))
        if status != "ok":
            for rank in running:
                self._failed(rank, now)
        self._suspect(now)
        return running

    def _final(self, rank: int) -> str:
        return FINAL.get(self.status[rank], "interrupted")

    def died(self, rank: int, now: float) -> None:
        """The rank's process ended: the group is broken. The others are freed at once
        (``replace_dead``), or stopped."""
        if self.phase.get(rank) in ("dead", "stopped"):
            return
        if rank in self.phase:
            self.phase[rank] = "dead"
        self._failed(rank, now)
        if self.replace_dead:
            self.died_at = self.died_at or now
        elif self.stopped is None:
            self._stop("death", now)

    def stacks(self, rank: int, frames: tuple[Frame, ...], now: float) -> _Where | None:
        """A stack sample arrived; returns the rank's place when it moved (for a sink)."""
        if self.phase.get(rank) != "running" or not frames:
            return None
        if self.interrupt_at is not None and rank not in self.stacks_at_interrupt:
            self.stacks_at_interrupt[rank] = frames  # where it was, moved or not
        old = self.where.get(rank)
        key = tuple(f[:3] for f in frames)
        if old is not None and tuple(f[:3] for f in old.frames) == key:
            old.taken = now
            return None
        self.where[rank] = _Where(frames, now, now)
        return self.where[rank]

    def positions(self, rank: int, frames: tuple[Frame, ...], groups: tuple, now: float) -> None:
        """A sample's ``groups``: (the cell its counts are final after, or None; its
        nbddp.rank.seq positions; the group its torch.distributed call is on; that
        call's (elements, dtype), nbddp.rank.seq.call_shape)."""
        said = (*groups, None, None)[:4] if len(groups) >= 2 else (None, (), None, None)
        after, places, on, shape = said
        phase = self.phase.get(rank)
        if phase == "running":
            if self.interrupt_at is not None and places:  # (none while the group aborts)
                self.places_at_interrupt.setdefault(rank, places)
            old = self.seen.get(rank)
            same = old is not None and old.groups == places and old.frames == frames
            self.seen[rank] = Seen(frames, places, now, old.since if same else now, on, shape)
        elif after is not None and (after == self.cell or phase is None):
            self.final.setdefault(rank, places)  # finished here (or not in the cell): final
        self._news = True

    def _suspect(self, now: float) -> None:
        """A rank finished while others run: see at once whether they wait for it."""
        if self.detect and not self.suspect and self.phase.count["running"]:
            self.suspect = True
            self._next_sample = min(self._next_sample, now + SUSPECT_EVERY)

    def _judge(self, now: float) -> None:
        """Look for a certain deadlock, once per batch of new positions."""
        if not self._news or not self.detect or self.deadlock or self.first_failure:
            return
        self._news = False
        running = {r: self.seen[r] for r in self.running if r in self.seen}
        ended = [r for r in self.targets if self.phase[r] != "running"] + list(self.others)
        if self.interrupt_at or len(running) < len(self.running) or self.final.keys() < set(ended):
            return  # (every rank heard from: the message names all it concerns)
        why = dict.fromkeys(self.others, "did not run the cell")
        finished, world = {r: self.final[r] for r in ended}, self.world or len(self.targets)
        self.deadlock = judge(running, finished, world, why, now, DISAGREE_SETTLE)
        if self.deadlock is None and disagreeing(self.seen, self.running):  # sure if it stays
            self._next_sample = min(self._next_sample, now + DISAGREE_SETTLE)

    def _to_ask(self) -> tuple[int, ...]:
        """The ranks a sample asks: the running, and (suspecting) those whose final
        counts are not in yet."""
        if self.first_failure is not None or self.interrupt_at is not None:
            return tuple(self.running)  # (the failure's own path frees them)
        ask = self.running + [r for r in self.others if r not in self.final]
        if self.suspect:
            ask += [r for r in self.targets if self.phase[r] != "running" and r not in self.final]
        return tuple(ask)

    def _sample_every(self, now: float) -> float:
        fast = self.first_failure is not None or self.interrupt_at is not None
        fast = fast and (self.aborted_at is None or now < self.aborted_at + self.grace)
        if fast:
            return SAMPLE_FAST
        if self.suspect or (self.detect and disagreeing(self.seen, self.running)):
            return SUSPECT_EVERY
        return self._every

    def interrupt(self, reason: str, now: float) -> list[Action]:
        """The stop button, Ctrl-C, or the timeout: where they are, then SIGINT."""
        if self.interrupted is not None or self.finished:
            return []
        self.interrupted, self.interrupt_at = reason, now
        running = tuple(self.running)
        return [Action("stacks", running), Action("interrupt", running, reason)]

    # ------------------------------------------------------------ what to do

    def _failed(self, rank: int, now: float) -> None:
        if self.first_failure is None:
            self.first_failure = (now, rank)
            self._next_sample = now  # see at once whether the others wait for it

    def _stop(self, reason: str, now: float) -> None:
        after = now if self.aborted_at is None else self.aborted_at
        self.stopped, stuck = reason, tuple(sorted(self.running))
        for r in self.unfinished:  # a rank whose Done came keeps its outcome
            self.phase[r] = self._final(r) if self.phase[r] == "ending" else "stopped"
        seen = tuple(
            w.frames if (w := self.where.get(r)) and w.taken >= after else () for r in stuck
        )
        self._pending.append(Action("stop", stuck, reason, seen, now - after))

    def _abort_at(self, now: float) -> float | None:
        if self.aborted_at is not None or not self.phase.count["running"] or self.stopped:
            return None
        self._judge(now)
        if self.deadlock is not None:
            return now  # certain: nothing to wait for
        times = []
        if self.first_failure is not None:
            times.append(self.first_failure[0] + self.abort_after)
        if self.interrupt_at is not None:
            times.append(self.interrupt_at + self.grace / 2)
        if not times:
            return None
        if self.died_at is not None:
            return now  # a peer that will never come: nothing to wait for
        trigger = self.triggered_at
        some_ended = any(p != "running" for p in self.phase.values())
        if some_ended and all(self._blocked(r, trigger) for r in self.running):
            return now  # every rank left waits in a collective that cannot complete
        return min(times)

    def _still_blocked_after_abort(self, now: float) -> bool:
        if self.aborted_at is None or now < self.aborted_at + self.grace:
            return False  # (before the walk over the ranks: this is asked at every event)
        self._past_grace = True  # (from now on, the samples' own deadlines pace the checks)
        return any(self._stuck(r, now) for r in self.running)

    def _stuck(self, rank: int, now: float) -> bool:
        """After the abort's grace period: the abort did not free ``rank``."""
        after = self.aborted_at or 0.0
        if self._blocked(rank, after):
            return True  # still in the collective
        w = self.where.get(rank)
        if w is None or w.taken < after:
            return now >= after + STUCK_AFTER  # not one answer since: C holds the GIL
        return in_torch(w.frames) and w.taken - max(w.since, after) >= STUCK_AFTER

    def _blocked(self, rank: int, after: float) -> bool:
        """Seen since ``after``, waiting in the same collective for SETTLE s or more."""
        w = self.where.get(rank)
        return (
            w is not None
            and w.taken >= after
            and w.taken - w.since >= SETTLE
            and self.waiting_in(rank) is not None
        )

    def due(self, now: float) -> list[Action]:
        """Everything that must happen by ``now``, in order."""
        actions, self._pending = self._pending, []
        if self.stopped or self.finished:
            return actions
        if self.timeout is not None and now >= self.started + self.timeout:
            actions += self.interrupt("timeout", now)
        if self.interrupt_at is not None and now >= self.interrupt_at + self.grace:
            self._stop(self.interrupted or "interrupt", now)
            return actions + self._take_pending()
        if self._still_blocked_after_abort(now):
            self._stop("abort", now)
            return actions + self._take_pending()
        abort_at = self._abort_at(now)
        if abort_at is not None and now >= abort_at:
            self.aborted_at, self.aborted_running = now, tuple(self.running)
            actions.append(Action("abort", self.aborted_running))
        if now >= self._next_sample and self.phase.count["running"]:
            self._next_sample = now + self._sample_every(now)
            actions.append(Action("stacks", self._to_ask()))
        return actions

    def _take_pending(self) -> list[Action]:
        pending, self._pending = self._pending, []
        return pending

    @property
    def deadline(self) -> float | None:
        """The next time :meth:`due` has something to do (None: only events matter)."""
        if self.stopped or self.finished:
            return None
        times = [self._next_sample] if self.phase.count["running"] else []
        if self.timeout is not None and self.interrupt_at is None:
            times.append(self.started + self.timeout)
        if self.interrupt_at is not None:
            times.append(self.interrupt_at + self.grace)
        running = self.phase.count["running"]  # (asked at every event: no walk over the ranks)
        # (past the grace period the samples pace the checks: a deadline in the past
        # would be asked again at once, for ever)
        if (
            self.aborted_at is not None
            and running
            and self.interrupt_at is None
            and not self._past_grace
        ):
            times.append(self.aborted_at + self.grace)
        if self.aborted_at is None and running:
            if self.died_at is not None:
                times.append(self.died_at)
            if self.first_failure is not None:
                times.append(self.first_failure[0] + self.abort_after)
            if self.interrupt_at is not None:
                times.append(self.interrupt_at + self.grace / 2)
        return min(times) if times else None
