"""A detached pool's supervisor: a :class:`~nbddp.pool.facade.Pool` in a process of its own.

``python -m nbddp.detached.server FOLDER LOCK_FD`` (started by
:func:`nbddp.detached.client.start`, in a session of its own, so the kernel's
shutdown and interrupts never reach it) runs the pool's core outside the kernel
and holds the ranks, and the lock on ``FOLDER/lock`` that says it lives
(:mod:`nbddp.detached.folder`; ``LOCK_FD`` is that lock, inherited). Kernels
connect to it one at a time over the Unix socket in FOLDER
(:mod:`nbddp.detached.kernels`); a cell keeps running when its kernel goes, and
what it printed meanwhile (bounded) and its end are given to the next kernel
that connects. The supervisor ends with ``stop`` (from a kernel, or SIGTERM),
or after ``idle_timeout`` seconds without a kernel, and leaves nothing: the
ranks, the store and the folder go with it. A cell running then is
interrupted, and its ranks are killed if they do not come back within the
grace period: a stop never waits for a cell to end. Its death is seen by its
ranks (their connections to it close, and they exit) and by a connected kernel.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pickle
import queue
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import traceback

import psutil

from ..pool import hosts_lost
from ..pool.facade import Pool
from ..wire import payload
from ..wire import protocol as P
from ..wire.listener import bind_unix
from ..wire.private import write_private
from ..wire.tls import pin_listener, server_credentials
from . import messages as W
from .kernels import Kernels
from .messages import IDLE_TIMEOUT
from .outbox import SEND_DEADLINE

__all__ = ["KILL_AFTER", "Supervisor", "main"]

KILL_AFTER = 10.0  # s past the grace period a stop waits for a cell before it kills all
CALLS = (
    "status", "stacks", "copy", "restart", "names_on", "shipped_on", "listing", "stop", "ready",
)  # fmt: skip


class Supervisor:
    """Serves one pool to one kernel at a time."""

    def __init__(self, folder: str, options: dict) -> None:
        self.folder, self.name = folder, os.path.basename(folder)
        self.pool = Pool(**self._pool_options(options))
        self.token_file = (options.get("attach") or {}).get("token_file")  # (attached pools)
        self.idle_timeout = float(options.get("idle_timeout", IDLE_TIMEOUT))
        self.kernels = Kernels(self, float(options.get("send_deadline") or SEND_DEADLINE))
        self.started_at = time.time()
        self.requests: queue.Queue = queue.Queue()
        self.pending: list = []  # what the cell gave since the supervisor last waited
        self.pool.hub.before_wait = self._flush
        self.running: int | None = None  # the request id of the cell that runs
        self.running_since: float | None = None
        # cells interrupted before they started (the kernel's Ctrl-C right after run())
        self._early: collections.deque = collections.deque(maxlen=16)
        self._early_lock = threading.Lock()
        self.quiet_since = time.monotonic()  # the last cell's end (a cell is not idleness)
        self.stopping: str | None = None  # why the pool stops (set from any thread)
        self.stopped_cell = ""  # what the stop did to a cell that ran
        self.stop_call: tuple | None = None  # (outbox, Call) a kernel waits on
        self.ended = False
        self._wake = threading.Event()  # the watch thread: look now

    def _pool_options(self, options: dict) -> dict:
        """The pool's options; an attached pool's (``%ddp attach --detached``) with its
        token, and its certificate made here: the key never leaves this process."""
        pool, attach = dict(options["pool"]), options.get("attach")
        if attach:
            pool["listen"] = tuple(pool["listen"])
            pool["token"], pool["tls"] = server_credentials(attach["token_file"], attach["tls"])
            pool["on_join"] = self._joined
        return pool

    def _joined(self, connected: int, world_size: int) -> None:
        """A rank of an attached pool joined: the kernel that waits counts it."""
        write_private(os.path.join(self.folder, W.JOINED), str(connected).encode())

    # ------------------------------------------------------------ life

    def _start(self) -> None:
        """Start the pool (an attached pool's listener first, its address said in the
        folder for the kernel to call the ranks to). A SIGTERM meanwhile (the kernel gave
        up: Ctrl-C, its --timeout) ends the start, which cleans up after itself."""
        signal.signal(signal.SIGTERM, _given_up)
        if self.pool.attached:
            address = self.pool.listen()
            pin_listener(self.token_file, self.pool.tls, address)
            write_private(os.path.join(self.folder, W.ADDRESS), address.encode())
        self.pool.start()

    def serve(self) -> None:
        self._start()
        token = secrets.token_hex(32).encode()
        write_private(os.path.join(self.folder, "token"), token)
        address = os.path.join(self.folder, W.SOCKET)
        listener = bind_unix(address, backlog=64)
        os.chmod(address, 0o600)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "world_size": self.pool.world_size,
            "started": time.time(),
        }
        write_private(os.path.join(self.folder, "info.json"), json.dumps(info).encode())
        threading.Thread(target=self.kernels.accept, args=(listener, token), daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.ask_stop("SIGTERM"))
        try:
            self._loop()
        finally:
            self.ended = True
            self.pool.stop()
            self._answer_stop()
            listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _loop(self) -> None:
        while True:
            try:
                outbox, msg = self.requests.get(timeout=1.0)
            except queue.Empty:
                outbox = msg = None
            if msg is not None:
                self._handle(outbox, msg)
            if self.stopping is not None and (self.stop_call or self.requests.empty()):
                return

    def ask_stop(self, why: str) -> None:
        """Stop the pool, a running cell too (from any thread, or a signal handler: the
        watch thread does the rest)."""
        if self.stopping is None:
            self.stopping = why
        self._wake.set()

    def _idle(self, now: float) -> float:
        """How long the pool has had no kernel and no cell: a training left running after
        its kernel crashed is work, not idleness (``%ddp stop NAME`` ends it at once)."""
        if self.running is not None:
            return 0.0
        return min(self.kernels.idle(now), now - self.quiet_since)

    def _watch(self) -> None:
        """Each second (or when woken): kernels that stopped reading, the idle timeout, and
        a stop: interrupt the cell at once, kill everything if it is not back in time."""
        asked: float | None = None
        while not self.ended:
            self._wake.wait(1.0)
            self._wake.clear()
            now = time.monotonic()
            self.kernels.check(now)
            if self.idle_timeout and self._idle(now) > self.idle_timeout:
                self.ask_stop(
                    f"no kernel connected and no cell running for {self.idle_timeout:g} s"
                )
            if self.stopping is None:
                continue
            if asked is None:
                asked = now
                self.requests.put((None, None))  # (the main loop: look now)
                if self.running is not None:
                    self.pool.interrupt()
            elif self.running is not None and now - asked > self.pool.grace + KILL_AFTER:
                self._kill()

    def _kill(self) -> None:
        """The last resort: the cell did not end after the interrupt, the grace period and
        KILL_AFTER s more. Every process under the supervisor is killed; nothing is left."""
        print(f"nbddp: stopping ({self.stopping}): the cell did not end: killing all", flush=True)
        me = psutil.Process()
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        for folder in (self.pool.procs.shm, self.pool.procs.dir, self.folder):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    # ------------------------------------------------------------ requests

    def state(self) -> W.PoolState:
        pool = self.pool
        return W.PoolState(
            self.name,
            pool.world_size,
            pool.started,
            pool.needs_restart,
            pool.hosts,
            pool.shm_folder,
            pool.generation,
            pool.devices,
            pool.pids,
            pool.backend_in_use,
            dict(pool.last_stacks),
            pool.grace,
            pool.attached,
            *hosts_lost.seen(pool),
            namespaces=pool.namespaces,
        )

    def _handle(self, outbox, msg: object) -> None:
        request = getattr(msg, "request", None)
        if self.stopping is not None and not (isinstance(msg, W.Call) and msg.method == "stop"):
            why = f"the detached pool {self.name} is stopping ({self.stopping})"
            self.kernels.reply(outbox, W.Failed("PoolClosedError", why, self.state(), request))
        elif isinstance(msg, W.RunCell):
            self._run(msg)
        elif isinstance(msg, W.Call) and msg.method == "stop":
            self.stop_call = (outbox, msg)  # answered once the pool is stopped
        elif isinstance(msg, W.Call) and msg.method in CALLS:
            self.kernels.reply(outbox, self._call(msg))

    def _call(self, msg: W.Call):
        try:
            own = getattr(self, f"_{msg.method}", None)
            if own is not None:
                value = own(*msg.args)
            else:
                value = getattr(self.pool, msg.method)(*msg.args, **msg.kwargs)
            if value is self.pool:  # (restart returns the pool: the kernel has its state)
                value = None
            reply = W.Reply(value, self.state(), msg.request)
            pickle.dumps(reply)  # (what cannot go is said, here)
        except Exception as exc:
            reply = W.Failed(type(exc).__name__, str(exc), self.state(), msg.request)
        return reply

    def _answer_stop(self) -> None:
        """The pool is stopped: tell the kernel that asked (what became of a cell)."""
        last = None
        if self.stop_call is not None:
            outbox, call = self.stop_call
            last = W.Reply(self.stopped_cell or None, self.state(), call.request)
            with self.kernels.lock:
                if self.kernels.client is not outbox:
                    last = None
        self.kernels.goodbye(last)

    def listing(self) -> dict:
        connected = self.kernels.connected()
        live = [r for r in self.pool.roster.ranks.values() if r.state != "dead"]
        rss = None if self.pool.attached else _rss(r.pid for r in live)  # (pids elsewhere)
        idle = self.kernels.idle(time.monotonic())
        return {
            "name": self.name,
            "world_size": self.pool.world_size,
            "alive": len(live),
            "running_since": self.running_since,
            "connected": connected,
            "idle_since": None if connected else time.time() - idle,
            "uptime": time.time() - self.started_at,
            "rss": rss,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    _listing = listing  # (the "listing" call)

    # ------------------------------------------------------------ cells

    def _flush(self) -> None:
        """What the cell gave, in one message (before the pool waits for more)."""
        if self.pending:
            batch, self.pending = W.Batch(tuple(self.pending)), []
            self.kernels.send(batch)

    def _run(self, msg: W.RunCell) -> None:
        kwargs, request = msg.kwargs, msg.request
        for key in ("needs", "auto"):
            if kwargs.get(key) is not None:
                kwargs[key] = payload.Shipment(*kwargs[key])
        kwargs["raw_values"] = kwargs.get("want_values", False)
        self.running_since = time.time()
        try:
            events = self.pool.run(**kwargs)  # (from here an interrupt holds for the cell)
            with self._early_lock:
                self.running = request
                early = request in self._early
            if self.stopping is not None or early:  # (asked before the cell could be)
                self.pool.interrupt()
            for event in events:
                if isinstance(event, P.CellEnd):
                    event = self._end(event)
                self.pending.append(W.Event(event, request))
            self.pending.append(W.Reply(None, self.state(), request))
        except Exception as exc:  # the cell could not start: the pool said why
            self.pending.append(W.Failed(type(exc).__name__, str(exc), self.state(), request))
        finally:
            self.running = self.running_since = None
            self.quiet_since = time.monotonic()
            self._flush()

    def interrupt(self, request: int | None) -> None:
        """The kernel's interrupt for its cell ``request`` (None: whatever runs): now, or
        as that cell starts, if it waits behind another request still."""
        with self._early_lock:
            now = request is None or request == self.running
            if not now:
                self._early.append(request)
        if now:
            self.pool.interrupt()

    def _end(self, end: P.CellEnd) -> P.CellEnd:
        """The cell's end, with the supervisor's notes (and a stop's, if one came)."""
        notes = self.kernels.take_notes()
        if self.stopping is not None:
            killed = self.pool.needs_restart
            self.stopped_cell = "its running cell was interrupted" + (
                ", and its ranks killed (they did not come back in time)" if killed else ""
            )
            notes.append(
                f"the detached pool {self.name} is stopping ({self.stopping}): "
                f"{self.stopped_cell.replace('its running cell', 'this cell')}; "
                "every rank's state goes with it"
            )
        return dataclasses.replace(end, notes=(*end.notes, *notes)) if notes else end


def _rss(pids) -> int:
    """The resident memory of these processes of this host, together."""
    rss = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            rss += psutil.Process(pid).memory_info().rss
    return rss


def _given_up(signum, _frame) -> None:
    raise SystemExit(f"the start was given up ({signal.Signals(signum).name})")


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    folder = args[0]
    if len(args) > 1:  # the lock that says this pool lives: held until the process ends
        os.set_inheritable(int(args[1]), False)
    with open(os.path.join(folder, "options.json")) as f:
        options = json.load(f)
    os.chdir(options.get("cwd") or folder)
    for path in reversed(options.get("sys_path", [])):  # what the kernel can import
        if path not in sys.path:
            sys.path.insert(1, path)
    try:
        Supervisor(folder, options).serve()
    except BaseException as exc:  # the last line: what the kernel says of it
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        text = f"{traceback.format_exc()}\n{said}\n"
        write_private(os.path.join(folder, "error.txt"), text.encode())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
