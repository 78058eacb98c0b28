"""Helpers shared by the tests."""

from __future__ import annotations

import socket
import time

import psutil

from nbddp import protocol as P


def healthy(pool):
    """``pool`` ready for a test: restarted if a death or a stop left it so, no old notes."""
    if pool.needs_restart or not pool.started:
        pool.restart()
    pool.notes.clear()
    pool.roster.deaths.clear()  # a test's deaths are its own (3 in a minute stop the pool)
    return pool


def collect(events):
    """Run a cell's events to the end: (text by (rank, stream), all events, CellEnd)."""
    text: dict[tuple[int, str], str] = {}
    seen = []
    end = None
    for ev in events:
        seen.append(ev)
        if isinstance(ev, P.Output):
            text[ev.rank, ev.stream] = text.get((ev.rank, ev.stream), "") + ev.text
        if isinstance(ev, P.CellEnd):
            end = ev
    return text, seen, end


def wait_gone(pids, timeout=10.0, zombies=True):
    """Pids still alive after waiting up to ``timeout`` (zombies count as gone if ``zombies``)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                status = psutil.Process(pid).status()
                if not zombies or status != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
