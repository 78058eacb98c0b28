"""Questions to the ranks between cells: how each is (``%ddp status``), where each is
(``%ddp stacks``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..wire import protocol as P
from . import hosts_lost
from .deadlock import world_count
from .hub import Gone, Msg

__all__ = ["RankStatus", "stacks", "status"]


@dataclass(frozen=True)
class RankStatus:
    rank: int
    pid: int
    host: str
    device: str
    state: str
    uptime: float
    rss: int | None


def ask(pool, msg: object, reply: type, timeout: float) -> dict[int, object]:
    """Send ``msg`` to every live rank between cells; their replies of type ``reply``."""
    live = [r for r in pool.roster.live() if r.send(msg)]
    replies: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(replies) < len(live) and time.monotonic() < deadline:
        items = pool.hub.pump(max(0.0, deadline - time.monotonic()))
        for item in items:
            kind = type(item)
            if kind is Msg and isinstance(item.msg, reply):
                replies[item.rank] = item.msg
            elif kind is Gone and not hosts_lost.take_gone(pool, item.rank):
                # a death is the next cell's to mend (a rank replaced, the others kept):
                # held for it, never decided here
                pool.hub.held.append(item)
        pool.roster.keep_output(items)
    return replies


def status(pool, timeout: float = 2.0) -> list[RankStatus]:
    """One row per rank: pid, host, device, state, uptime, resident memory."""
    replies = ask(pool, P.Query(), P.StatusReply, timeout)
    now = time.monotonic()
    return [
        RankStatus(
            r.rank,
            r.pid,
            r.host,
            r.device,
            _state(pool, r, replies),
            now - r.started,
            replies[r.rank].rss if r.rank in replies else None,
        )
        for r in pool.roster.ranks.values()
    ]


def _state(pool, r, replies: dict) -> str:
    if r.rank in pool.roster.missing:
        return "missing"  # its host was lost (nbddp.pool.hosts_lost)
    return r.state if r.state == "dead" or r.rank in replies else "unresponsive"


def stacks(pool, timeout: float = 2.0, counts: bool = False) -> dict[int, tuple]:
    """Where each rank's main thread is now (between cells: empty, they are idle); with
    ``counts``, (frames, operations issued on the default group, -1: unknown) each."""
    replies = ask(pool, P.StackQuery(), P.Stacks, timeout)
    if counts:
        return {r: (m.frames, world_count(m.groups)) for r, m in sorted(replies.items())}
    return {rank: reply.frames for rank, reply in sorted(replies.items())}
