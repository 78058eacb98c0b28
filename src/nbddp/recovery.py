"""What the pool does when a cell goes wrong, least costly first, and what it says.

- A rank failed while others waited for it in a collective, or an interrupt
  left ranks blocked: the group was aborted on every rank; :func:`reform` has
  every rank join a new group and keep its namespace.
- Before a cell, :func:`ready_for_a_cell`: a pool that lost its state (or a rank
  that died between cells) is started anew, and the next cell says so.
- A rank died: :func:`rank_died` reports it (after everything it printed).
- Ranks that do not come back (a death broke the group for good, a rank stuck
  in C past the grace period): :func:`stop_pool` stops them all, and the next
  cell starts a new pool. Every note that says state was lost is made by
  :func:`state_lost`, so they all say it the same way.
"""

from __future__ import annotations

import signal
import time

from . import protocol as P
from . import stacks as S
from .errors import PoolClosedError, PoolStartError, RankDied
from .hub import Gone

__all__ = ["rank_died", "ready_for_a_cell", "reform", "state_lost", "stop_pool"]

REFORM_TIMEOUT = 60.0  # seconds the ranks have to join the re-formed group


def state_lost(what: str) -> str:
    """A note for the next cell: ``what`` happened, so the pool was stopped."""
    return f"{what}; the next cell starts a new one (the ranks' state is lost)"


def _were(ranks) -> str:
    return "were" if len(ranks) > 1 else "was"


def reform(pool, sup, out, quiet: bool = False):
    """Every rank joins a new group; namespaces stay. Fall back to stopping the pool."""
    t0 = time.monotonic()
    try:
        _form_again(pool, REFORM_TIMEOUT)
    except PoolStartError as exc:
        pool.lose()
        pool.notes.append(
            state_lost(f"re-forming the process group failed ({exc}): the pool was stopped")
        )
        return
    backlog, pool.roster.backlog = pool.roster.backlog, []
    yield from backlog
    if quiet:
        return
    stopped = [r for r in out.done if r not in sup.aborted_running]
    waits = sorted({w for r in sup.aborted_running if (w := sup.waiting_in(r))})
    how = f"waiting in {', '.join(waits)}" if waits else "maybe in a collective"
    what = (
        f"{S.rank_set(stopped)} had stopped while {S.rank_set(sup.aborted_running)} "
        f"still ran ({how})"
        if stopped
        else f"every rank still ran after the {sup.interrupted or 'failure'} ({how})"
    )
    pool.notes.append(
        f"{what}: the process group was aborted and re-formed in "
        f"{time.monotonic() - t0:.2f} s. "
        "Every rank kept its namespace; objects bound to the old group (DDP models, "
        "device meshes, subgroups) must be rebuilt"
        + (" (nbddp rebuilt `mesh` and `group`)" if pool.mesh or pool.groups else "")
    )


def _form_again(pool, timeout: float) -> None:
    """Every rank forms the group again (namespaces kept); PoolStartError if not all did
    within ``timeout``, or an interrupt ended the wait."""
    roster, requests = pool.roster, pool.requests
    roster.store_port = None
    roster.reforms += 1
    for r in roster.ranks.values():
        r.state = "starting"
        r.send(P.Reform(roster.reforms))
    requests.reforming, requests.cancel_wait = True, False
    try:
        pool.handshake(timeout, lambda: requests.cancel_wait)
    finally:
        requests.reforming = False


def rank_died(pool, sup, out, r):
    """One rank died: its group is broken, so the supervisor stops every other rank."""
    yield from pool.drain(r.rank)
    r.state, r.returncode = "dead", pool.exit_code(r)
    out.exits[r.rank] = exit_event = P.RankExit(r.rank, r.returncode, when=time.time())
    yield exit_event
    yield P.RankState(r.rank, "dead")
    sup.died(r.rank, time.monotonic())
    if r.returncode == -signal.SIGKILL:
        pool.notes.append(
            f"nothing in nbddp sent rank {r.rank} SIGKILL: the usual sender is the "
            "kernel's out-of-memory killer (see `dmesg`)"
        )


def _stop_note(pool, action) -> str:
    stuck = list(action.ranks)
    if action.reason == "death":
        return state_lost("the process group lost a member, so the pool was stopped")
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
    for o in others:
        yield from pool.drain(o.rank)
        if o.rank in action.ranks:
            out.exits[o.rank] = P.RankExit(o.rank, o.returncode, True, time.time())
            yield P.RankState(o.rank, "dead")
    pool.state = "lost"


def ready_for_a_cell(pool) -> None:
    """Start the pool anew if it lost its state (said in a note); refuse a stopped pool,
    or an attached one that lost a rank (torchrun started those ranks, not us)."""
    if pool.state == "closed" and not pool.roster.ranks:
        raise PoolClosedError("the pool was stopped; start it again")
    if pool.attached and (pool.needs_restart or not pool.started):
        raise PoolClosedError(
            "the attached pool lost a rank: start torchrun again and attach again"
        )
    items = pool.hub.pump(0) if pool.roster.ranks else []  # what came between cells
    pool.roster.keep_output(items)
    gone = [i.rank for i in items if type(i) is Gone]
    if gone or pool.needs_restart:
        why = ", ".join(RankDied(rank, pool.exit_code(pool.roster[rank])).summary for rank in gone)
        pool.lose()
        pool.notes.append(
            (f"{why} since the last cell; " if why else "")
            + "started a new pool: the ranks' state was lost"
        )
    if not pool.started:
        pool.start()
