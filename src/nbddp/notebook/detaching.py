"""``%ddp start --detached``, ``connect``, ``list``, ``disconnect`` and ``stop NAME``: the
front end's side of detached pools (:mod:`nbddp.detached.client` speaks to them)."""

from __future__ import annotations

import time

from IPython.core.error import UsageError

from ..dashboard.sinks import columns
from ..detached import client, messages
from ..pool.errors import NbddpError
from .session import Session, default_world_size, say

__all__ = ["check_name", "connect", "disconnect", "start", "stop", "table"]


def check_name(name: str) -> None:
    """Refuse, before anything is let go, a name ``start`` cannot take: malformed, or a
    detached pool's that runs."""
    try:
        messages.folder_of(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if any(p["name"] == name for p in client.listing()):
        raise UsageError(f"a detached pool named {name} runs already: %ddp connect {name}")


def start(name: str, n: int | None, idle_timeout: float | None, options: dict):
    """Start the detached pool ``name`` and connect this kernel to it."""
    t0 = time.perf_counter()
    n = n or default_world_size()
    idle = messages.IDLE_TIMEOUT if idle_timeout is None else idle_timeout
    try:
        pool = client.start(name, n, idle_timeout=idle, **options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    say(
        f"started the detached pool {name} ({n} rank{'s' * (n > 1)}) in "
        f"{time.perf_counter() - t0:.1f} s: it outlives this kernel (`%ddp connect {name}` "
        f"from any of your kernels; it stops after {idle:g} s without one)"
    )
    return pool


def connect(name: str, force: bool):
    try:
        pool = client.connect(name, force)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ranks = f"{pool.world_size} rank{'s' * (pool.world_size > 1)}"
    say(
        f"connected to the detached pool {name} ({ranks})"
        + (": a cell ran meanwhile, here is how it went" if pool.resumed else "")
    )
    return pool


def disconnect(session: Session) -> None:
    pool = session.pool
    if pool is None or not getattr(pool, "detached", False):
        raise UsageError("no detached pool is connected (%ddp stop ends a pool of this kernel)")
    name = pool.name
    session.release()
    say(f"disconnected from the detached pool {name}: it runs on (`%ddp connect {name}`)")


def stop(name: str) -> None:
    try:
        said = client.stop(name)
    except (NbddpError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    say(f"stopped the detached pool {name}" + (f": {said}" if said else ""))


def table() -> str:
    pools = client.listing()
    if not pools:
        return "nbddp: no detached pool is running"
    rows = [("name", "ranks", "alive", "state", "kernel", "uptime", "rss")]
    now = time.time()
    for p in pools:
        if not p["answer"]:  # it lives (its lock is held) but does not answer here
            where = "starting" if p["pid"] is None else f"on host {p['host']}, pid {p['pid']}"
            ranks = "?" if p["world_size"] is None else str(p["world_size"])
            rows.append((p["name"], ranks, "?", f"not answering here ({where})", "?", "?", "?"))
            continue
        since = p["running_since"]
        state = "idle" if since is None else f"running {now - since:.0f} s"
        if p["connected"]:
            kernel = f"pid {p['connected']}"
        else:
            kernel = f"none for {now - p['idle_since']:.0f} s"
        uptime = f"{p['uptime']:.0f} s"
        rss = "elsewhere" if p["rss"] is None else f"{p['rss'] / 2**20:.0f} MiB"  # (attached)
        rows.append((p["name"], str(p["world_size"]), str(p["alive"]), state, kernel, uptime, rss))
    return columns(rows)
