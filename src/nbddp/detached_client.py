"""A kernel's side of a detached pool: start one, connect to it, list them, stop one.

:class:`DetachedPool` stands for the pool in the kernel: it has what the front
end uses of a :class:`~nbddp.pool.Pool` (``run`` gives the same events, ``--out``
values are loaded here, ``interrupt`` and pdb answers go out at once), and
each reply brings the pool's state along. Big tensors still go through the
pool's shared-memory folder, written here and read by the ranks: nothing big
passes through the supervisor.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from . import capture
from . import detached_wire as W
from . import errors as E
from . import protocol as P
from .detached import IDLE_TIMEOUT
from .handshake import connect as wire_connect
from .outcome import RawValue, load_value
from .pool_calls import PoolCalls
from .private import UnsafeFile, read_private

__all__ = ["DetachedPool", "connect", "listing", "start", "stop"]

REPLY_TIMEOUT = 120.0  # s a call may take (a restart, a copy of a big model)


class DetachedPool(PoolCalls):
    """A detached pool, as this kernel sees it."""

    detached = True
    attached = False

    def __init__(self, conn: W.Link, welcome: W.Welcome) -> None:
        self.conn = conn
        self._state: W.PoolState = welcome.state
        self.resumed = welcome.resumed  # a cell ran meanwhile: resume() gives its events
        self._send_lock = threading.Lock()
        self.notes: list[str] = []
        self.closed = False
        self.why_closed = ""  # what ended this kernel's connection, for the next cell
        self.gone = False  # the supervisor ended (not a disconnect, not a takeover)
        self._inbox: list = []  # the rest of a Batch, in order (reversed: pop() is next)

    # -- what it is (as of the last reply)

    name = property(lambda self: self._state.name)
    world_size = property(lambda self: self._state.world_size)
    started = property(lambda self: self._state.started and not self.closed)
    needs_restart = property(lambda self: self._state.needs_restart)
    hosts = property(lambda self: self._state.hosts)
    shm_folder = property(lambda self: self._state.shm_folder)
    generation = property(lambda self: self._state.generation)
    devices = property(lambda self: self._state.devices)
    pids = property(lambda self: self._state.pids)
    backend_in_use = property(lambda self: self._state.backend)
    last_stacks = property(lambda self: self._state.last_stacks)

    def names_on(self, ranks=None) -> frozenset[str]:
        return self._call("names_on", ranks)

    def ready(self) -> None:
        self._call("ready")

    # -- the wire

    def _put(self, msg: object) -> None:
        if self.closed:
            raise E.PoolClosedError(
                self.why_closed or f"disconnected from the detached pool {self.name}"
            )
        with self._send_lock:
            try:
                self.conn.send(msg)
            except OSError:
                self._gone()

    def _get(self, timeout: float | None = None) -> object:
        if self._inbox:
            msg = self._inbox.pop()
        else:
            try:
                if timeout is not None and not self.conn.poll(timeout):
                    raise E.NbddpError(
                        f"the detached pool {self.name} did not answer in {timeout:g} s"
                    )
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._gone()
            if isinstance(msg, W.Batch):
                self._inbox = list(reversed(msg.items))
                return self._get()
        if isinstance(msg, W.TakenOver):
            self._close(
                f"another kernel (pid {msg.pid}) took the detached pool {self.name} over: "
                f"`%ddp connect {self.name} --force` takes it back"
            )
        if isinstance(msg, (W.Reply, W.Failed)):
            self._state = msg.state
        return msg

    def _gone(self):
        self.gone = True
        self._close(
            f"the detached pool {self.name} is gone (its supervisor ended): its ranks' state "
            "is lost"
        )

    def _close(self, why: str):
        self.closed, self.why_closed = True, why
        self.conn.close()
        raise E.PoolClosedError(why)

    def _call(self, method: str, *args, **kwargs):
        self._put(W.Call(method, args, kwargs))
        reply = self._get(REPLY_TIMEOUT)
        if isinstance(reply, W.Failed):
            cls = getattr(E, reply.exc_type, None) or getattr(builtins, reply.exc_type, None)
            raise (cls if isinstance(cls, type) else E.NbddpError)(reply.message)
        return reply.value

    # -- cells

    def run(self, code: str, **kwargs) -> Iterator[object]:
        for key in ("needs", "auto"):
            shipment = kwargs.get(key)
            if isinstance(shipment, dict):
                shipment = capture.pack(shipment, self.shm_folder)
            if shipment is not None:
                kwargs[key] = (shipment.data, shipment.files)
        self._put(W.RunCell({"code": code, **kwargs}))
        return self._events()

    def resume(self) -> Iterator[object]:
        """The events of a cell that ran while no kernel was connected (then nothing)."""
        if not self.resumed:
            return iter(())
        self.resumed = False
        return self._events()

    def _events(self) -> Iterator[object]:
        while True:
            msg = self._get()
            if isinstance(msg, W.Event):
                event = msg.event
                if isinstance(event, P.CellEnd):
                    event = _load_values(event)
                yield event
            elif isinstance(msg, W.Reply):
                return
            elif isinstance(msg, W.Failed):
                raise getattr(E, msg.exc_type, E.NbddpError)(msg.message)

    def interrupt(self) -> None:
        """From any thread, or a SIGINT handler that may have cut into a send of this
        thread's: sent by a thread of its own, once the wire is free."""
        if not self.closed:
            threading.Thread(target=self._put_quietly, args=(W.Interrupt(),)).start()

    def _put_quietly(self, msg: object) -> None:
        try:
            self._put(msg)
        except E.PoolClosedError:
            pass

    def interrupt_stuck(self) -> bool:
        return False  # the supervisor ends the cell itself

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None:
        self._put(W.DebugReply(prompt, line))

    # -- the pool

    def status(self, timeout: float = 2.0):
        return self._call("status", timeout)

    def stacks(self, timeout: float = 2.0):
        return self._call("stacks", timeout)

    def copy(self, names, src, dst=None):
        return self._call("copy", names, src, dst)

    def restart(self) -> DetachedPool:
        self._call("restart")
        return self

    def start(self) -> DetachedPool:
        return self

    def stop(self) -> None:
        """End the detached pool: its ranks, its store, its folder."""
        try:
            self._call("stop")
        except E.PoolClosedError:
            if not self.gone:  # taken over (or disconnected): it runs on, and that is said
                raise
        self.disconnect()

    def disconnect(self) -> None:
        """Leave the pool running; another kernel (or this one) may connect again."""
        self.closed = True
        self.conn.close()


def _load_values(end: P.CellEnd) -> P.CellEnd:
    values, errors = dict(end.values), dict(end.errors)
    for rank, value in end.values.items():
        if isinstance(value, RawValue):
            values[rank], error = load_value(rank, value.data, value.files)
            if error is not None:
                errors[rank] = error
    return dataclasses.replace(end, values=values, errors=errors)


# ---------------------------------------------------------------- by name


def _hello(
    name: str, *, force: bool = False, peek: bool = False, timeout: float = 10.0
) -> tuple[W.Link, object]:
    folder = W.folder_of(name)
    try:
        token = read_private(os.path.join(folder, "token"), "detached pool's token")
        channel = wire_connect(os.path.join(folder, "sock"), "AF_UNIX", token, timeout=0)
        conn = W.Link(channel)
    except UnsafeFile as exc:
        raise E.PoolClosedError(str(exc)) from None
    except (OSError, EOFError):
        raise E.PoolClosedError(f"no detached pool named {name} (see %ddp list)") from None
    conn.send(W.Hello(os.getpid(), force, peek))
    if not conn.poll(timeout):
        conn.close()
        raise E.PoolClosedError(f"the detached pool {name} did not answer")
    return conn, conn.recv()


def connect(name: str, force: bool = False) -> DetachedPool:
    """Connect to the detached pool ``name``: every rank's namespace as it was."""
    conn, answer = _hello(name, force=force)
    if isinstance(answer, W.Refused):
        conn.close()
        raise E.PoolClosedError(answer.reason)
    return DetachedPool(conn, answer)


def start(
    name: str, n: int, *, idle_timeout: float = IDLE_TIMEOUT, timeout: float = 120.0, **options
) -> DetachedPool:
    """Start the detached pool ``name`` of ``n`` ranks (``options`` as Pool's) and connect."""
    folder = W.folder_of(name)
    os.makedirs(W.pools_folder(), mode=0o700, exist_ok=True)
    if os.path.exists(folder):
        if _alive(name):
            raise E.NbddpError(f"a detached pool named {name} runs already: %ddp connect {name}")
        shutil.rmtree(folder, ignore_errors=True)  # what a pool that died left
    os.mkdir(folder, 0o700)
    settings = {
        "pool": {"n": n, **{k: v for k, v in options.items() if v is not None}},
        "idle_timeout": idle_timeout,
        "sys_path": [p for p in sys.path if p],
        "cwd": os.getcwd(),
    }
    with open(os.path.join(folder, "options.json"), "w") as f:
        json.dump(settings, f)
    with open(os.path.join(folder, "supervisor.log"), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbddp.detached", folder],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # the kernel's interrupts and shutdown do not reach it
        )
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(folder, "info.json")):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = _read(os.path.join(folder, "error.txt")).strip().splitlines()
            proc.kill()
            shutil.rmtree(folder, ignore_errors=True)
            raise E.PoolStartError(
                f"the detached pool {name} did not start: {why[-1] if why else 'no answer'}"
            )
        time.sleep(0.02)
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it when it ends
    return connect(name)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _alive(name: str) -> bool:
    try:
        info = json.loads(_read(os.path.join(W.folder_of(name), "info.json")) or "{}")
        os.kill(info["pid"], 0)
        return True
    except (KeyError, ProcessLookupError, PermissionError, ValueError):
        return False


def listing() -> list[dict]:
    """This user's detached pools on this machine, as each supervisor says."""
    found = []
    try:
        names = sorted(os.listdir(W.pools_folder()))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            started = os.path.exists(os.path.join(W.folder_of(name), "info.json"))
        except ValueError:
            continue  # not a pool's folder
        if started and not _alive(name):  # its supervisor was killed: what it left
            shutil.rmtree(W.folder_of(name), ignore_errors=True)
            continue
        try:
            conn, answer = _hello(name, peek=True, timeout=2.0)
        except (E.NbddpError, ValueError, OSError, EOFError):
            continue
        conn.close()
        if isinstance(answer, W.Reply):
            found.append(answer.value)
    return found


def stop(name: str) -> None:
    """End the detached pool ``name`` (taking it over from any kernel connected)."""
    connect(name, force=True).stop()
