"""A kernel's side of detached pools, by name: start one, connect to it, list them, stop one.

A pool lives in ``~/.nbddp/pools/NAME`` (:mod:`nbddp.detached.folder`): it is
alive exactly while its supervisor holds the folder's lock, whatever PID
namespace or host looks, and only a folder whose lock nobody holds is removed.
Once connected, the kernel speaks to the pool through a
:class:`~nbddp.detached.proxy.DetachedPool`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..pool import errors as E
from ..wire.handshake import connect as wire_connect
from ..wire.private import UnsafeFile, read_private
from . import folder as F
from . import messages as W
from .proxy import DetachedPool

__all__ = ["DetachedPool", "connect", "listing", "start", "stop"]


def _hello(
    name: str, *, force: bool = False, peek: bool = False, timeout: float = 10.0
) -> tuple[W.Link, object]:
    folder = W.folder_of(name)
    try:
        token = read_private(os.path.join(folder, "token"), "detached pool's token")
        channel = wire_connect(os.path.join(folder, W.SOCKET), "AF_UNIX", token, timeout=0)
        conn = W.Link(channel)
    except UnsafeFile as exc:
        raise E.PoolClosedError(str(exc)) from None
    except (OSError, EOFError):
        raise E.PoolClosedError(_unreachable(name)) from None
    try:
        conn.send(W.Hello(os.getpid(), force, peek))
        if not conn.poll(timeout):
            conn.close()
            raise E.PoolClosedError(f"the detached pool {name} did not answer in {timeout:g} s")
        return conn, conn.recv()
    except (EOFError, OSError):  # (its supervisor is ending: it takes no one now)
        conn.close()
        raise E.PoolClosedError(
            f"the detached pool {name} closed the connection: it is stopping"
        ) from None


def _unreachable(name: str) -> str:
    """Why ``name`` cannot be reached: there is none, or it lives where we cannot speak
    to it (another host sharing this home folder), or it is starting."""
    folder = W.folder_of(name)
    if not F.held(folder):
        return f"no detached pool named {name} (see %ddp list)"
    info = _info(folder)
    if not info:
        return f"the detached pool {name} is starting: try again in a moment"
    return (
        f"the detached pool {name} runs (on host {info.get('host', '?')}, pid "
        f"{info.get('pid', '?')}) but cannot be reached from here"
    )


def connect(name: str, force: bool = False) -> DetachedPool:
    """Connect to the detached pool ``name``: every rank's namespace as it was."""
    conn, answer = _hello(name, force=force)
    if isinstance(answer, W.Refused):
        conn.close()
        raise E.PoolClosedError(answer.reason)
    return DetachedPool(conn, answer)


def start(
    name: str,
    n: int,
    *,
    idle_timeout: float = W.IDLE_TIMEOUT,
    timeout: float = 120.0,
    send_deadline: float | None = None,
    attach: dict | None = None,
    watch: Callable[[str], None] | None = None,
    **options,
) -> DetachedPool:
    """Start the detached pool ``name`` of ``n`` ranks (``options`` as Pool's) and connect.
    ``send_deadline``: s the supervisor waits on a kernel that does not read before it
    drops that kernel (:data:`nbddp.detached.outbox.SEND_DEADLINE`). ``attach``: the
    ranks are started elsewhere and connect in (``{"token_file": .., "tls": ..}``; the
    supervisor listens on ``options["listen"]``); ``watch(folder)`` is called while it
    starts (it says how to start the ranks, and counts them). Interrupted (Ctrl-C), or
    if ``watch`` raises, the supervisor is ended and leaves nothing."""
    folder = W.folder_of(name)
    settings = {
        "pool": {"n": n, **{k: v for k, v in options.items() if v is not None}},
        "attach": attach,
        "idle_timeout": idle_timeout,
        "send_deadline": send_deadline,
        "sys_path": [p for p in sys.path if p],
        "cwd": os.getcwd(),
    }
    try:
        lock = F.make(W.pools_folder(), folder, {"options.json": json.dumps(settings).encode()})
    except F.Taken:
        raise E.NbddpError(
            f"a detached pool named {name} runs already (or is starting): %ddp connect {name}"
        ) from None
    try:
        with open(os.path.join(folder, "supervisor.log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nbddp.detached.server", folder, str(lock)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(lock,),  # the lock: the supervisor holds it from now on
                start_new_session=True,  # the kernel's interrupts and shutdown do not reach it
            )
    finally:
        F.release(lock)
    try:
        _wait_started(name, folder, proc, time.monotonic() + timeout, watch)
    except BaseException:  # Ctrl-C, or what ``watch`` could not do: nothing is left
        _end(proc, folder)
        raise
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it when it ends
    return connect(name)


def _wait_started(
    name: str, folder: str, proc: subprocess.Popen, deadline: float, watch=None
) -> None:
    while not os.path.exists(os.path.join(folder, "info.json")):
        if watch is not None:
            watch(folder)
        if proc.poll() is not None or time.monotonic() > deadline:
            why = _read(os.path.join(folder, "error.txt")).strip().splitlines()
            raise E.PoolStartError(
                f"the detached pool {name} did not start: {why[-1] if why else 'no answer'}"
            )
        time.sleep(0.02 if watch is None else 0.1)


def _end(proc: subprocess.Popen, folder: str) -> None:
    """A supervisor that did not start: asked to end (its pool's start cleans up after
    itself), killed if it does not within 10 s; its folder removed."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    F.remove_if_dead(folder)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _info(folder: str) -> dict:
    try:
        return json.loads(_read(os.path.join(folder, "info.json")) or "{}")
    except ValueError:
        return {}


def listing() -> list[dict]:
    """This user's detached pools, as each supervisor says; one that lives but does not
    answer here (another host, starting, busy) with ``"answer": False``. A pool's folder
    is removed only when no live supervisor holds it (what a killed one left)."""
    found = []
    try:
        names = sorted(os.listdir(W.pools_folder()))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            folder = W.folder_of(name)
        except ValueError:
            continue  # not a pool's folder
        if not F.held(folder):
            F.remove_if_dead(folder)
            continue
        try:
            conn, answer = _hello(name, peek=True, timeout=2.0)
        except (E.NbddpError, ValueError, OSError, EOFError):
            answer = None
        else:
            conn.close()
        if isinstance(answer, W.Reply):
            found.append({**answer.value, "answer": True})
        elif F.held(folder):
            info = _info(folder)
            found.append({"name": name, "answer": False, **{k: info.get(k) for k in INFO}})
    return found


INFO = ("pid", "host", "world_size", "started")


def stop(name: str) -> str | None:
    """End the detached pool ``name`` (taking it over from any kernel connected); what
    became of a cell that ran, in words, or None."""
    return connect(name, force=True).stop()
