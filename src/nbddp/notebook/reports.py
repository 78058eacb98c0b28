"""What ``%ddp status`` and ``%ddp stacks`` print."""

from __future__ import annotations

from ..dashboard.sinks import columns
from ..pool.hosts_lost import missing, missing_line
from ..pool.sizes import human
from ..wire import stacks as S
from .session import running

__all__ = ["counts_line", "stacks", "status"]

NO_POOL = "nbddp: no pool is running"


def status(pool) -> str:
    """One row per rank: pid, host, device, state, uptime, memory."""
    if not running(pool):
        return NO_POOL
    rows = [("rank", "pid", "host", "device", "state", "uptime", "rss")]
    for s in pool.status():
        rss = "-" if s.rss is None else f"{s.rss / 2**20:.0f} MiB"
        rows.append((str(s.rank), str(s.pid), s.host, s.device, s.state, f"{s.uptime:.0f} s", rss))
    return columns(rows) + _missing(pool) + _kept(pool)


def _kept(pool) -> str:
    """The line on ``--keep``'s last snapshot ('' without one)."""
    snap, names = getattr(pool, "snapshot", None), getattr(pool, "keep", ())
    if not names:
        return ""
    if snap is None:
        return f"\nnbddp: keeps {', '.join(names)}: no snapshot yet (one after each clean cell)"
    most = max(snap.nbytes.values(), default=0)
    return (
        f"\nnbddp: keeps {', '.join(n for n in names if n not in snap.missing)} as at the end "
        f"of {snap.label}: {human(most)} a rank at most, in shared memory ({snap.seconds:.2f} s)"
    )


def _missing(pool) -> str:
    """The line that says which ranks of which lost host are missing ('' when none)."""
    return f"\nnbddp: {missing_line(pool, refused=False)}" if missing(pool) else ""


def stacks(pool) -> str:
    """Every rank's current Python stack, grouped; and where the last stuck cell was (the
    present ranks', and a line for those of a lost host)."""
    if not running(pool):
        return NO_POOL
    now = pool.stacks(counts=True)
    busy = {rank: frames for rank, (frames, _) in now.items() if frames}
    silent = sorted(set(range(pool.world_size)) - set(now) - set(missing(pool)))
    if busy:
        lines = S.format_groups(busy)
    elif silent:
        lines = [f"nbddp: {S.rank_set(sorted(now))} {S.is_are(now)} idle"]
    else:
        lines = [f"nbddp: every rank is idle ({S.rank_set(sorted(now))})"]
    lines += counts_line({rank: n for rank, (_, n) in now.items()}, set(busy))
    if silent:  # (a death read here is the next cell's to mend: nbddp.pool.queries.ask)
        lines.append(
            f"nbddp: {S.rank_set(silent)} did not answer (a rank that died since the last "
            "cell is replaced by the next one, and the others keep their state)"
        )
    if pool.last_stacks:
        lines.append("where the ranks were when the last cell was interrupted or timed out:")
        lines += S.format_groups(pool.last_stacks)
        last = getattr(pool, "last_counts", {})  # (a detached pool's are not kept)
        lines += counts_line(last, set(last))
    return "\n".join(lines) + _missing(pool)


def counts_line(counts: dict[int, int], running: set[int]) -> list[str]:
    """``collectives issued on the default group: ranks 0, 1 #1208, rank 2 #1190
    (behind)`` (behind: a running rank below the highest count; an idle rank may just
    not have run a ``--ranks`` cell), or nothing when no count is known."""
    by: dict[int, list[int]] = {}
    for rank, n in sorted(counts.items()):
        if n >= 0:
            by.setdefault(n, []).append(rank)
    if not by:
        return []
    top = max(by)
    said = ", ".join(
        f"{S.rank_set(ranks)} #{n}{' (behind)' * (n < top and bool(running & set(ranks)))}"
        for n, ranks in sorted(by.items(), key=lambda nr: nr[1])
    )
    return [f"collectives issued on the default group: {said}"]
