"""What the pool does when a cell goes wrong, least costly first, and what it says.

This module decides and words; it touches no process, connection or rank record. The
pool's repair part (:class:`~nbddp.pool.repair.PoolRepair`) gathers the facts
(:class:`Facts`, :class:`Death`), asks here, and carries the decision out
(:class:`Reform`, :class:`Replace`, :class:`Stop`, :class:`Restart`, :class:`Refuse`).

- A rank failed while others waited for it in a collective, or an interrupt
  left ranks blocked: the group was aborted on every rank; :class:`Reform` has
  every rank join a new group and keep its namespace.
- Before a cell, :func:`refusal` and :func:`between_cells`: a pool that lost its
  state (or a rank that died between cells) is started anew, and the next cell
  says so.
- A rank died: on a local pool :class:`Replace` has a new process take its place
  while every other rank keeps its namespace (the group's store is a process of its
  own, so even rank 0 can die). A rank that dies again and again stops the pool
  (``CRASH_LOOP`` deaths within ``CRASH_WINDOW`` s: :func:`count_death`);
  ``on_death="restart"`` stops it at once. An attached pool's rank is replaced by the
  process its holder on its host forks (nbddp.hosts.holder); a host whose relay ended
  is lost, and its ranks wait for a replacement host (nbddp.pool.hosts_lost); ranks without
  a holder, or of a lost host that held torchrun's store, cannot come back: the pool
  is stopped.
- Ranks stuck in C past the grace period: :class:`Stop` stops them alone, and they are
  replaced after the cell like the dead (the others keep their state); where they cannot
  be (attached, ``on_death="restart"``, every rank stuck), or a death broke the group for
  good, every rank is stopped and the next cell starts a new pool. Every note that says
  state was lost is made by :func:`state_lost` (nbddp.pool.stopnote), so they all say it
  the same way.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ..wire import protocol as P
from ..wire import stacks as S
from .deadlock import out_of_step
from .deathnote import killer_hint, replaced_note
from .errors import PoolStartError, RankDied
from .stopnote import state_lost, stop_note

__all__ = [
    "CrashLoop",
    "Dead",
    "Death",
    "Facts",
    "Reform",
    "Refuse",
    "Replace",
    "Restart",
    "Stop",
    "after_cell",
    "between_cells",
    "can_replace",
    "collectives_of",
    "count_death",
    "death_notes",
    "died_again",
    "failed_note",
    "reformed_note",
    "refusal",
    "replaced_notes",
    "state_lost",
    "stop",
]

REFORM_TIMEOUT = 60.0  # seconds the ranks have to join the re-formed group
# attached: seconds the new processes of dead ranks have to join: longer than a relay waits
# for its holders' (nbddp.hosts.relay_carry.RENEW_WAIT, 60 s) before it ends, so a host
# whose holders died too is found lost (its relay ended), not late
RENEW_TIMEOUT = 90.0
CRASH_LOOP = 3  # deaths of one rank within CRASH_WINDOW s: it is not replaced again
CRASH_WINDOW = 60.0


class CrashLoop(PoolStartError):
    """A rank died too often to be replaced again."""


# ------------------------------------------------------------ facts


@dataclass(frozen=True)
class Facts:
    """What the pool is, as far as a decision needs it."""

    world_size: int
    on_death: str  # "replace": a dead rank gets a new process; "restart": all
    attached: bool  # torchrun started the ranks
    renewable: bool  # attached: every rank's holder forks a new one that can reach us
    lost: bool  # the ranks' state is gone (the next cell starts a new pool)
    rebuilt: bool  # nbddp rebuilds `mesh` and `group` after a re-form
    grace: float
    store_lost: str = ""  # attached: a lost host held torchrun's store (nbddp.pool.hosts_lost)


@dataclass(frozen=True)
class Death:
    """A rank that went (between cells): how its process ended, and on which host."""

    rank: int
    code: int | None
    host: str = ""


@dataclass
class Dead:
    """What a replaced rank's first process held, and how its last process ended."""

    held: tuple[P.Held, ...]  # its names, kinds and sizes, as of its last finished cell
    code: int | None


# ------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Reform:
    """Every rank joins a new group; namespaces stay. ``what``: the note's first words
    (what happened); ``quiet``: no note (the cell itself destroyed the group)."""

    what: str = ""
    quiet: bool = False


@dataclass(frozen=True)
class Replace:
    """New processes in place of ``ranks``, the group re-formed with all of them.
    ``code``: the cell's (which may have sent the SIGKILL); ``notes``: said first."""

    ranks: tuple[int, ...]
    code: str = ""
    notes: tuple[str, ...] = ()
    stopped: tuple[int, ...] = ()  # those the pool itself stopped (stuck): no killer to name


@dataclass(frozen=True)
class Stop:
    """Stop every live rank (``ranks``: those stuck, shown as stopped); ``note`` says why.
    ``only``: stop the stuck ranks alone, the others keep their namespaces and the pool
    gives the stuck ones new processes after the cell (:func:`after_cell`)."""

    note: str
    ranks: tuple[int, ...] = ()
    only: bool = False


@dataclass(frozen=True)
class Restart:
    """Between cells: the pool lost its state; start a new one (``note`` says why)."""

    note: str


@dataclass(frozen=True)
class Refuse:
    """No cell runs: PoolClosedError(``message``); ``stop``: the pool is stopped first;
    ``turned_away``: the workers turned away since are named after it."""

    message: str
    stop: bool = False
    turned_away: bool = False


# ------------------------------------------------------------ deciding


def can_replace(facts: Facts) -> bool:
    """A dead rank of this pool gets a new process (else the pool is stopped): a local
    pool's from its fork server, an attached one's from its holder on its host (every
    rank torchrun started is held: nbddp.hosts.holder)."""
    return facts.on_death == "replace" and (not facts.attached or facts.renewable)


def after_cell(
    facts: Facts, died: list[int], sup, out, stopped: list[int] = ()
) -> Reform | Replace | None:
    """After a cell's end: replace the ranks that ``died`` and those the pool ``stopped``
    (stuck, :func:`stop`), re-form a group that was aborted (or that the cell destroyed),
    or nothing."""
    if facts.lost:
        return None
    if died or stopped:
        return Replace(tuple(sorted({*died, *stopped})), out.code, stopped=tuple(stopped))
    if sup.aborted_at is not None:
        if getattr(sup, "deadlock", None) is not None:  # (said first, by the error)
            return Reform("to end the deadlock")
        return Reform(_what_ran(sup, out))
    if any(d.needs_group for d in out.done.values()):
        return Reform(quiet=True)
    # ranks that ended the cell at different places in a group (an interrupt landed on one
    # just after it issued a collective, on another just before): the collective left in
    # flight would pair with the next cell's first one (gloo: a size mismatch, SIGABRT)
    ended = {r: d.places for r, d in out.done.items() if d.places}
    if skew := out_of_step(ended, facts.world_size):
        return Reform(f"the ranks ended the cell out of step in {skew}")
    return None


def refusal(facts: Facts, closed: bool, started: bool) -> Refuse | None:
    """Before a cell: refuse a stopped pool, or an attached one that lost a rank
    (torchrun started those ranks, not us)."""
    if closed:
        return Refuse("the pool was stopped; start it again")
    if facts.attached and (facts.lost or not started):
        return Refuse(
            "the attached pool lost a rank: start torchrun again and attach again",
            turned_away=True,
        )
    return None


def between_cells(
    facts: Facts, gone: list[Death], closed: list[str]
) -> Replace | Refuse | Restart | None:
    """Ranks ``gone`` since the last cell (``closed``: connections closed for a bad
    frame): replace them, stop an attached pool (said at once, in one line: which rank,
    which host, why; never a wait for ranks that cannot come), or start anew."""
    if gone and can_replace(facts) and not facts.lost:
        said = tuple(f"{RankDied(d.rank, d.code).summary} since the last cell" for d in gone)
        return Replace(tuple(d.rank for d in gone), notes=said)
    if gone and facts.attached:
        died = ", ".join(RankDied(d.rank, d.code, d.host).summary for d in gone)
        closed = [*closed, facts.store_lost] if facts.store_lost else closed
        why = f" ({'; '.join(closed)})" if closed else ""
        return Refuse(
            f"{died} since the last cell{why}: the attached pool was stopped (the ranks' "
            "state is lost); start torchrun again and attach again",
            stop=True,
        )
    if gone or facts.lost:
        why = ", ".join(RankDied(d.rank, d.code).summary for d in gone)
        return Restart(
            (f"{why} since the last cell; " if why else "")
            + "started a new pool: the ranks' state was lost"
        )
    return None


def stop(facts: Facts, action, live: list[int]) -> Stop:
    """The supervisor's last resort (``action``: a ``stop``, its reason and ranks stuck in
    C past the grace period; ``live``: every live rank). On a local pool that replaces
    its dead, only the stuck ranks are stopped when some rank is not stuck: they get new
    processes, the others keep their state (as a death costs). Else every rank is."""
    only = (
        action.reason != "death"
        and can_replace(facts)
        and not facts.attached
        and not facts.lost
        and bool(set(live) - set(action.ranks))
    )
    return Stop(stop_note(facts, action, only), tuple(action.ranks), only)


def count_death(deaths: dict[int, list[float]], rank: int, now: float) -> None:
    """Count a death of ``rank`` at ``now`` in ``deaths`` (each rank's, within the
    window); CrashLoop when it died too often to be replaced again."""
    times = [t for t in deaths.get(rank, []) if now - t < CRASH_WINDOW] + [now]
    deaths[rank] = times
    if len(times) >= CRASH_LOOP:
        raise CrashLoop(
            f"rank {rank} died {len(times)} times within {CRASH_WINDOW:g} s, so it was "
            "not replaced again"
        )


# ------------------------------------------------------------ words


def collectives_of(sup, out) -> list[str]:
    """The collectives the ranks still running were in: where their stacks were seen, or
    what their errors came out of (the failure message names the same calls)."""
    running = sup.aborted_running
    seen = {w for r in running if (w := sup.waiting_in(r))}
    seen |= {e.collective for r, e in out.errors.items() if r in running and e.collective}
    return sorted(seen)


def _what_ran(sup, out) -> str:
    """``rank 1 had stopped while ranks 0, 2 still ran (waiting in all_reduce)``."""
    stopped = [r for r in out.done if r not in sup.aborted_running]
    waits = collectives_of(sup, out)
    how = f"waiting in {', '.join(waits)}" if waits else "in a collective"
    return (
        f"{S.rank_set(stopped)} had stopped while {S.rank_set(sup.aborted_running)} "
        f"still ran ({how})"
        if stopped
        else f"every rank still ran after the {sup.interrupted or 'failure'} ({how})"
    )


def _rebuilt(facts: Facts) -> str:
    return " (nbddp rebuilt `mesh` and `group`)" if facts.rebuilt else ""


def _bound(bound: str) -> str:
    """The re-bound objects, and those left on the old group (nbddp.pool.rebinding)."""
    return f"; {bound}" if bound else ""


def reformed_note(facts: Facts, decision: Reform, took: float, bound: str = "") -> str:
    """The group was aborted and re-formed in ``took`` s, namespaces kept; ``bound``: what
    was bound to the new group again, and what could not be."""
    return (
        f"{decision.what}: the process group was aborted and re-formed in {took:.2f} s. "
        "Every rank kept its namespace" + _bound(bound) + _rebuilt(facts)
    )


def replaced_notes(
    facts: Facts,
    had: dict[int, Dead],
    took: float,
    fresh: dict,
    healed,
    code: str = "",
    bound: str = "",
    stopped=(),
) -> list[str]:
    """What each replaced rank held (``fresh``: the names its new process started with),
    the re-form (``bound``: what it bound again), and who may have sent a SIGKILL
    (``code``: the cell's; not for those the pool ``stopped`` itself)."""
    notes = [line for r in sorted(had) for line in replaced_note(r, had[r].held, fresh[r], healed)]
    stopped = set(stopped)
    new = S.rank_set(sorted(had)).replace("rank", "new rank", 1)
    if len(had) < facts.world_size:
        notes.append(
            f"the process group was re-formed with the {new} in {took:.2f} s; every other "
            "rank kept its namespace" + _bound(bound) + _rebuilt(facts)
        )
    else:
        notes.append(f"the process group was formed again with the {new} in {took:.2f} s")
    for rank, dead in sorted(had.items()):
        if dead.code == -signal.SIGKILL and rank not in stopped:
            notes += killer_hint(rank, code)
    return notes


def failed_note(exc: PoolStartError) -> str:
    """A re-form that failed (a crash loop, ranks that did not join): the pool stopped."""
    if isinstance(exc, CrashLoop):
        return state_lost(f"{exc}: the pool was stopped")
    return state_lost(f"re-forming the process group failed ({exc}): the pool was stopped")


def died_again(rank: int, code: int | None) -> str:
    return f"{RankDied(rank, code).summary} as the group re-formed"


def death_notes(facts: Facts, rank: int, code: int | None, cell_code: str) -> list[str]:
    """Said when ``rank`` died in a cell: who may have killed it, unless its replacement's
    notes say so later."""
    if code == -signal.SIGKILL and not can_replace(facts):
        return killer_hint(rank, cell_code)
    return []
