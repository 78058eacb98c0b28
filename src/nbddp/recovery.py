"""What the pool does when a cell goes wrong, least costly first, and what it says.

- A rank failed while others waited for it in a collective, or an interrupt
  left ranks blocked: the group was aborted on every rank; :func:`reform` has
  every rank join a new group and keep its namespace.
- Before a cell, :func:`ready_for_a_cell`: a pool that lost its state (or a rank
  that died between cells) is started anew, and the next cell says so.
- A rank died: :func:`rank_died` reports it (after everything it printed), and
  on a local pool :func:`replace` has a new process take its place while every
  other rank keeps its namespace (the group's store is a process of its own, so
  even rank 0 can die). A rank that dies again and again stops the pool
  (``CRASH_LOOP`` deaths within ``CRASH_WINDOW`` s); ``on_death="restart"`` stops
  it at once. An attached pool's rank is replaced by the process its holder on its
  host forks (nbddp.worker_holder); ranks without a holder, or behind a relay that
  ended, cannot come back: the pool is stopped.
- Ranks that do not come back (a death broke the group for good, a rank stuck
  in C past the grace period): :func:`stop_pool` stops them all, and the next
  cell starts a new pool. Every note that says state was lost is made by
  :func:`state_lost`, so they all say it the same way.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from . import healing, hosts_lost
from . import protocol as P
from . import stacks as S
from .deathnote import killer_hint, replaced_note
from .errors import PoolClosedError, PoolStartError, RankDied
from .gpus import pool_plan
from .hub import Gone
from .processes import rank_env
from .roster import TAKES_NONE, RankGone

__all__ = [
    "can_replace",
    "rank_died",
    "ready_for_a_cell",
    "reform",
    "replace",
    "state_lost",
    "stop_pool",
]

REFORM_TIMEOUT = 60.0  # seconds the ranks have to join the re-formed group
CRASH_LOOP = 3  # deaths of one rank within CRASH_WINDOW s: it is not replaced again
CRASH_WINDOW = 60.0
STALE = "objects bound to the old group (DDP models, device meshes, subgroups) must be rebuilt"


class CrashLoop(PoolStartError):
    """A rank died too often to be replaced again."""


@dataclass
class _Dead:
    """What a replaced rank's first process held, and how its last process ended."""

    held: tuple[P.Held, ...]  # its names, kinds and sizes, as of its last finished cell
    code: int | None


def state_lost(what: str) -> str:
    """A note for the next cell: ``what`` happened, so the pool was stopped."""
    return f"{what}; the next cell starts a new one (the ranks' state is lost)"


def _were(ranks) -> str:
    return "were" if len(ranks) > 1 else "was"


def can_replace(pool) -> bool:
    """A dead rank of this pool gets a new process (else the pool is stopped): a local
    pool's from its fork server, an attached one's from its holder on its host (every
    rank torchrun started is held: nbddp.worker_holder)."""
    if pool.on_death != "replace":
        return False
    # a rank whose host was lost comes back from a replacement host (nbddp.hosts_lost),
    # unless that host held torchrun's store
    held = all(r.renewable for r in pool.roster.ranks.values())
    return not pool.attached or (held and not hosts_lost.store_lost(pool))


def reform(pool, sup, out, quiet: bool = False, what: str = ""):
    """Every rank joins a new group; namespaces stay. Fall back to stopping the pool.
    ``what``: why, when no rank was aborted (the note's start)."""
    t0 = time.monotonic()
    had = yield from _formed_again(pool, [])
    if had is None:
        return
    if had:  # ranks died while the group formed: a new process took each one's place
        took, fresh = time.monotonic() - t0, _fresh(pool, had)
        healed = healing.heal(pool, sorted(had))  # --heal: before the next cell
        pool.notes += _replaced_notes(pool, had, took, fresh, healed, out.code)
        yield from _replaced_events(had)
        return
    if quiet:
        return
    if getattr(sup, "deadlock", None) is not None:  # (said first, by the error)
        what = "to end the deadlock"
    elif not what:
        what = _what_ran(sup, out)
    pool.notes.append(
        f"{what}: the process group was aborted and re-formed in "
        f"{time.monotonic() - t0:.2f} s. "
        f"Every rank kept its namespace; {STALE}" + _rebuilt(pool)
    )


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


def _rebuilt(pool) -> str:
    return " (nbddp rebuilt `mesh` and `group`)" if pool.mesh or pool.groups else ""


def replace(pool, dead: list[int], code: str = ""):
    """New processes in place of the ``dead`` ranks, the group re-formed with all of them;
    every other rank keeps its namespace. The notes say what the dead ranks held (``code``:
    the cell's, which may have sent a SIGKILL itself)."""
    if pool.attached and hosts_lost.defer(pool, dead):
        return  # a lost host's ranks: the re-form waits for a replacement host
    t0 = time.monotonic()
    had = yield from _formed_again(pool, dead)
    if had is not None:
        took, fresh = time.monotonic() - t0, _fresh(pool, had)
        healed = healing.heal(pool, sorted(had))  # --heal: before the next cell
        pool.notes += _replaced_notes(pool, had, took, fresh, healed, code)
        yield from _replaced_events(had)


def _replaced_events(had: dict):
    for rank in sorted(had):
        yield P.RankState(rank, "replaced")


def _fresh(pool, had: dict) -> dict[int, frozenset[str]]:
    """The names each new process started with (not lost with the dead one)."""
    table = pool.roster.ranks
    return {r: frozenset(h.name for h in table[r].held) | table[r].names for r in had}


def _replaced_notes(pool, had: dict, took: float, fresh: dict, healed, code: str = "") -> list[str]:
    notes = [line for r in sorted(had) for line in replaced_note(r, had[r].held, fresh[r], healed)]
    new = S.rank_set(sorted(had)).replace("rank", "new rank", 1)
    if len(had) < pool.world_size:
        notes.append(
            f"the process group was re-formed with the {new} in {took:.2f} s; every other "
            f"rank kept its namespace; {STALE}" + _rebuilt(pool)
        )
    else:
        notes.append(f"the process group was formed again with the {new} in {took:.2f} s")
    for rank, dead in sorted(had.items()):
        if dead.code == -signal.SIGKILL:
            notes += killer_hint(rank, code)
    return notes


def _formed_again(pool, dead: list[int]):
    """Re-form the group, new processes in place of ``dead`` and of any rank that dies on
    the way; {rank: what it held} for the replaced ranks, or None when the pool had
    to be stopped (said in a note). Yields the output that came meanwhile."""
    try:
        had = _form_again(pool, dead, REFORM_TIMEOUT)
    except CrashLoop as exc:
        pool.lose()
        _take_no_rank(pool)
        pool.notes.append(state_lost(f"{exc}: the pool was stopped"))
        return None
    except PoolStartError as exc:
        pool.lose()
        _take_no_rank(pool)
        pool.notes.append(
            state_lost(f"re-forming the process group failed ({exc}): the pool was stopped")
        )
        return None
    if had:
        pool.generation += 1  # fresh namespaces: the imports are replayed to them
    backlog, pool.roster.backlog = pool.roster.backlog, []
    yield from backlog
    return had


def _form_again(pool, dead: list[int], timeout: float, new: tuple[int, ...] = ()) -> dict:
    """Every rank forms the group again (namespaces kept), a new process in place of each
    of ``dead`` and of each rank that dies meanwhile (then the survivors are freed from
    the re-form that waits for it, and every rank joins the next one). PoolStartError if
    not all joined within ``timeout``, or an interrupt ended the wait. ``new``: ranks a
    resize adds (their records hold no process yet), started fresh (nbddp.resizing)."""
    roster, requests = pool.roster, pool.requests
    roster.store_port = None
    had: dict[int, _Dead] = {}
    pending, fresh, again = sorted(dead), set(new), False
    chosen = pool_plan(pool)  # a resize may change it: ranks that come to share a GPU
    backend = chosen.backend if chosen is not None else ""
    requests.reforming, requests.cancel_wait = True, False
    try:
        while True:
            for rank in pending:
                r = roster[rank]
                code = r.returncode if r.returncode is not None else pool.exit_code(r)
                if again:
                    pool.notes.append(f"{RankDied(rank, code).summary} as the group re-formed")
                _count_death(roster, rank)
                had.setdefault(rank, _Dead(r.held, code)).code = code
            restart = sorted(set(pending) | fresh)  # new ones have no state: start them again
            if restart:
                _end_processes(pool, [roster[rank] for rank in restart])
            roster.reforms += 1
            survivors = [r for r in roster.ranks.values() if r.rank not in restart]
            reform = P.Reform(roster.reforms, pool.world_size, backend)
            roster.renewing = reform if pool.attached else None
            for rank in restart:
                _start_again(pool, rank)
            if restart:
                pool.hub.forget_sentinels()  # the dead ones' fd numbers may come back
            for r in survivors:
                r.state = "starting"
                if again:  # free those waiting in the re-form a death broke
                    r.send(P.AbortGroup())
                r.send(reform)
            fresh, again = set(restart), True
            try:
                pool.handshake(timeout, lambda: requests.cancel_wait)
                return had
            except RankGone as gone:
                if not can_replace(pool):
                    raise
                pending = [gone.rank]
    finally:
        requests.reforming = False
        roster.renewing = None


def _start_again(pool, rank: int) -> None:
    """A new process for ``rank``: from the fork server (local), or the one its holder
    forked on its host (attached: it joins the re-form as it connects)."""
    roster = pool.roster
    if pool.attached:
        roster.renew(rank)
    else:
        roster.add(rank, pool.procs.start(rank, pool.address, rank_env(pool, rank, roster.reforms)))


def _count_death(roster, rank: int) -> None:
    """Count a death of ``rank``; CrashLoop when it died too often to be replaced again."""
    now = time.monotonic()
    times = [t for t in roster.deaths.get(rank, []) if now - t < CRASH_WINDOW] + [now]
    roster.deaths[rank] = times
    if len(times) >= CRASH_LOOP:
        raise CrashLoop(
            f"rank {rank} died {len(times)} times within {CRASH_WINDOW:g} s, so it was "
            "not replaced again"
        )


def _end_processes(pool, ranks: list) -> None:
    """Kill what is left of ``ranks`` (dead, or new and not yet in) and close their links."""
    live = [r for r in ranks if r.state != "dead"]
    for r in live:
        pool.procs.kill(r.pid)
    pool.reap(live, time.monotonic() + 2.0)
    for r in ranks:
        pool.roster.forget(r.rank)


def rank_died(pool, sup, out, r):
    """One rank died, after everything it printed: its group is broken, so the supervisor
    frees the others (the pool replaces it after the cell), or stops them."""
    yield from pool.drain(r.rank)
    r.state, r.returncode = "dead", pool.exit_code(r)
    out.exits[r.rank] = exit_event = P.RankExit(r.rank, r.returncode, when=time.time())
    yield exit_event
    yield P.RankState(r.rank, "dead")
    sup.replace_dead = sup.replace_dead and can_replace(pool)  # (a host's relay ended?)
    sup.died(r.rank, time.monotonic())
    if r.returncode == -signal.SIGKILL and not can_replace(pool):
        pool.notes += killer_hint(r.rank, out.code)  # (else said after the replacement's)


def _stop_note(pool, action) -> str:
    stuck = list(action.ranks)
    if action.reason == "death" and pool.attached:
        why = hosts_lost.why_not(pool) or (
            "the process group lost a member that cannot come back (a rank without a "
            "holder, NBDDP_HOLD=0)"
        )
        return (
            f"{why}, so the pool was stopped: start torchrun again and attach again (the "
            "ranks' state is lost)"
        )
    if action.reason == "death":
        return state_lost(
            "the process group lost a member (on_death='restart'), so the pool was stopped"
        )
    if action.reason == "abort":
        return state_lost(
            f"{S.rank_set(stuck)} still ran {pool.grace:g} s after the process group was "
            "aborted (blocked in a collective the abort did not reach) and "
            f"{_were(stuck)} stopped with the rest of the pool"
        )
    return state_lost(
        f"{S.rank_set(stuck)} did not stop within {pool.grace:g} s of the "
        f"{action.reason} and {_were(stuck)} stopped with the rest of the pool"
    )


def stop_pool(pool, sup, out, action):
    """The last resort: stop every live rank; the next cell starts a new pool."""
    pool.notes.append(_stop_note(pool, action))
    others = pool.roster.live()
    for o in others:
        if not pool.procs.kill(o.pid):
            o.send(P.Shutdown())
    pool.reap(others, time.monotonic() + 2.0)
    _take_no_rank(pool)
    for o in others:
        yield from pool.drain(o.rank)
        if o.rank in action.ranks:
            out.exits[o.rank] = P.RankExit(o.rank, o.returncode, True, time.time())
            yield P.RankState(o.rank, "dead")
    pool.state = "lost"


def _between_cells(pool, rounds: int = 64) -> list:
    """What came between cells, read until nothing more is there (a rank's last message
    and its end of file may take two reads), ``rounds`` reads at most."""
    items: list = []
    for _ in range(rounds if pool.roster.ranks else 0):
        more = pool.hub.pump(0)
        if not more:
            break
        items += more
    return items


def _attached_lost(pool, gone: list[int]) -> None:
    """Ranks torchrun started went between cells (died, or their connection was closed for
    a bad frame): said at once, in one line (which rank, which host, why), and the pool is
    stopped; never a wait for ranks that cannot come."""
    table = pool.roster.ranks
    died = ", ".join(
        RankDied(rank, pool.exit_code(table[rank]), table[rank].host).summary for rank in gone
    )
    closed, pool.hub.closed = pool.hub.closed, []
    closed += [w for w in [hosts_lost.why_not(pool)] if w]
    why = f" ({'; '.join(closed)})" if closed else ""
    pool.lose()
    _take_no_rank(pool)
    raise PoolClosedError(
        f"{died} since the last cell{why}: the attached pool was stopped (the ranks' state is "
        "lost); start torchrun again and attach again"
    )


def _take_no_rank(pool) -> None:
    """An attached pool that lost a rank turns every worker that comes away at once, with
    the reason (torchrun's restarted workers waited for it forever)."""
    if pool.attached:
        pool.roster.closed_to = f"the pool lost a rank and was stopped, and {TAKES_NONE}"


def _turned_away(pool) -> str:
    """The workers turned away since the pool was stopped, in a few words (or nothing)."""
    lines = pool.listener.refusals(take=True) if pool.listener is not None else []
    return f" ({'; '.join(lines)})" if lines else ""


def ready_for_a_cell(pool) -> None:
    """Start the pool anew if it lost its state (said in a note); refuse a stopped pool,
    or an attached one that lost a rank (torchrun started those ranks, not us)."""
    if pool.state == "closed" and not pool.roster.ranks:
        raise PoolClosedError("the pool was stopped; start it again")
    if pool.attached and (pool.needs_restart or not (pool.started or pool.roster.missing)):
        raise PoolClosedError(
            "the attached pool lost a rank: start torchrun again and attach again"
            + _turned_away(pool)
        )
    items = _between_cells(pool)
    pool.roster.keep_output(items)
    # (a local rank's exit as its launcher saw it, too: its last message may be read,
    # its end of file not yet)
    gone = sorted({i.rank for i in items if type(i) is Gone} | set(pool.hub.exits()))
    if gone and can_replace(pool) and not pool.needs_restart:
        for rank in gone:
            r = pool.roster[rank]
            pool.roster.backlog += pool.drain(rank)
            r.state, r.returncode = "dead", pool.exit_code(r)
            pool.notes.append(f"{RankDied(rank, r.returncode).summary} since the last cell")
        events = list(replace(pool, gone))
        pool.roster.backlog += [e for e in events if type(e) is P.Output]
    elif gone and pool.attached:
        _attached_lost(pool, gone)
    elif gone or pool.needs_restart:
        why = ", ".join(RankDied(rank, pool.exit_code(pool.roster[rank])).summary for rank in gone)
        pool.lose()
        pool.notes.append(
            (f"{why} since the last cell; " if why else "")
            + "started a new pool: the ranks' state was lost"
        )
    back = hosts_lost.arrived(pool) if pool.attached else []  # (refused at once: missing)
    if back:
        events = list(replace(pool, back))
        pool.roster.backlog += [e for e in events if type(e) is P.Output]
    if not pool.started:
        pool.start()
