"""What ``%ddp status`` and ``%ddp stacks`` print."""

from __future__ import annotations

from . import stacks as S
from .hosts_lost import missing_line
from .sinks import columns

__all__ = ["stacks", "status"]

NO_POOL = "nbddp: no pool is running"


def status(pool) -> str:
    """One row per rank: pid, host, device, state, uptime, memory."""
    missing = getattr(getattr(pool, "roster", None), "missing", None)
    if pool is None or not (pool.started or missing):
        return NO_POOL
    rows = [("rank", "pid", "host", "device", "state", "uptime", "rss")]
    for s in pool.status():
        rss = "-" if s.rss is None else f"{s.rss / 2**20:.0f} MiB"
        rows.append((str(s.rank), str(s.pid), s.host, s.device, s.state, f"{s.uptime:.0f} s", rss))
    table = columns(rows)
    return table + f"\nnbddp: {missing_line(pool)}" if missing else table


def stacks(pool) -> str:
    """Every rank's current Python stack, grouped; and where the last stuck cell was."""
    if pool is None or not pool.started:
        return NO_POOL
    now = pool.stacks()
    busy = {rank: frames for rank, frames in now.items() if frames}
    lines = (
        S.format_groups(busy)
        if busy
        else [f"nbddp: every rank is idle ({S.rank_set(sorted(now))})"]
    )
    if pool.last_stacks:
        lines.append("where the ranks were when the last cell was interrupted or timed out:")
        lines += S.format_groups(pool.last_stacks)
    return "\n".join(lines)
