"""A detached pool's supervisor: a :class:`~nbddp.pool.Pool` in a process of its own.

``python -m nbddp.detached FOLDER`` (started by :func:`nbddp.detached_client.start`,
in a session of its own, so the kernel's shutdown and interrupts never reach
it) runs the pool's core outside the kernel and holds the ranks. Kernels
connect to it one at a time over the Unix socket in FOLDER (see
:mod:`nbddp.detached_wire`); a cell keeps running when its kernel goes, and
what it printed meanwhile (bounded) and its end are given to the next kernel
that connects. The supervisor ends with ``stop``, or after ``idle_timeout``
seconds without a kernel, and leaves nothing: the ranks, the store and the
folder go with it. Its death is seen by its ranks (their connections to it
close, and they exit) and by a connected kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import queue
import secrets
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import deque

import psutil

from . import detached_wire as W
from . import handshake, payload
from . import protocol as P
from .detached_wire import Link
from .listener import bind_unix
from .pool import Pool
from .private import write_private

__all__ = ["IDLE_TIMEOUT", "Supervisor", "main"]

IDLE_TIMEOUT = 3600.0  # s without a kernel before the pool stops itself (0: never)
BACKLOG = 10_000  # output events kept while no kernel is connected (the rest counted)
HELLO_TIMEOUT = 5.0  # s a connection has to say hello after it authenticated
CALLS = ("status", "stacks", "copy", "restart", "names_on", "listing", "stop", "ready")


class Supervisor:
    """Serves one pool to one kernel at a time."""

    def __init__(self, folder: str, options: dict) -> None:
        self.folder, self.name = folder, os.path.basename(folder)
        self.pool = Pool(**options["pool"])
        self.idle_timeout = float(options.get("idle_timeout", IDLE_TIMEOUT))
        self.started_at = time.time()
        self.lock = threading.Lock()  # the client, the backlog
        self.client: Link | None = None
        self.client_pid: int | None = None
        self.requests: queue.Queue = queue.Queue()
        self.backlog: deque = deque()
        self.pending: list = []  # what the cell gave since the supervisor last waited
        self.pool.hub.before_wait = self._flush
        self.dropped = 0  # output events dropped from the backlog
        self.outputs_kept = 0  # output events in the backlog
        self.unseen = False  # the backlog holds a cell no kernel has seen end
        self.running_since: float | None = None
        self.idle_since = time.monotonic()
        self.stopping = False

    # ------------------------------------------------------------ life

    def serve(self) -> None:
        self.pool.start()
        token = secrets.token_hex(32).encode()
        write_private(os.path.join(self.folder, "token"), token)
        address = os.path.join(self.folder, "sock")
        listener = bind_unix(address, backlog=16)
        os.chmod(address, 0o600)
        info = {"pid": os.getpid(), "world_size": self.pool.world_size, "started": time.time()}
        write_private(os.path.join(self.folder, "info.json"), json.dumps(info).encode())
        threading.Thread(target=self._accept, args=(listener, token), daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))  # cleanly
        try:
            while not self.stopping:
                try:
                    conn, msg = self.requests.get(timeout=1.0)
                except queue.Empty:
                    self._stop_if_idle()
                    continue
                self._handle(conn, msg)
        finally:
            self.pool.stop()
            listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _stop_if_idle(self) -> None:
        with self.lock:
            idle = self.client is None and time.monotonic() - self.idle_since
        if idle and self.idle_timeout and idle > self.idle_timeout:
            self.stopping = True

    # ------------------------------------------------------------ kernels

    def _accept(self, listener, token: bytes) -> None:
        """Kernels, one by one: the handshake and the hello within HELLO_TIMEOUT s."""
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if listener.fileno() < 0 or exc.errno is None:
                    return  # closed
                time.sleep(0.05)  # EMFILE and the like: let it pass
                continue
            try:
                conn = Link(handshake.server_handshake(sock, token, HELLO_TIMEOUT))
                hello = pickle.loads(conn.channel.recv_bytes(1 << 16, timeout=HELLO_TIMEOUT))
            except Exception:  # not the token, too slow, not a hello: nothing more from it
                sock.close()
                continue
            if not isinstance(hello, W.Hello) or hello.version != W.VERSION:
                conn.close()
                continue
            if hello.peek:
                with contextlib.suppress(OSError):
                    conn.send(W.Reply(self._listing(), self.state()))
                conn.close()
                continue
            self._welcome(conn, hello)

    def _welcome(self, conn: Link, hello: W.Hello) -> None:
        with self.lock:
            if self.client is not None and not hello.force:
                conn.send(
                    W.Refused(
                        f"the detached pool {self.name} is connected to another kernel (pid "
                        f"{self.client_pid}): `%ddp connect {self.name} --force` takes it over"
                    )
                )
                conn.close()
                return
            if self.client is not None:
                with contextlib.suppress(OSError):
                    self.client.send(W.TakenOver(hello.pid))
                self.client.close()
            backlog, self.backlog, self.outputs_kept = tuple(self.backlog), deque(), 0
            resumed, self.unseen = self.unseen or self.running_since is not None, False
            try:
                conn.send(W.Welcome(self.state(), resumed))
                if backlog:
                    conn.send(W.Batch(backlog))
            except OSError:
                return
            self.client, self.client_pid = conn, hello.pid
        threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Link) -> None:
        """The kernel's messages: interrupts and pdb lines at once, the rest in turn."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, W.Interrupt):
                self.pool.interrupt()
            elif isinstance(msg, W.DebugReply):
                self.pool.debug_reply(msg.prompt, msg.line)
            else:
                self.requests.put((conn, msg))
        with self.lock:
            if self.client is conn:
                self.client, self.idle_since = None, time.monotonic()

    def _send(self, item: object) -> None:
        """To the kernel; kept while none is connected (output bounded: the oldest goes)."""
        with self.lock:
            if self.client is not None:
                try:
                    self.client.send(item)
                    return
                except OSError:
                    self.client, self.idle_since = None, time.monotonic()
            items = item.items if isinstance(item, W.Batch) else (item,)
            self.backlog.extend(items)
            self.unseen = True
            self.outputs_kept += sum(_is_output(i) for i in items)
            if self.outputs_kept > BACKLOG * 1.25:  # (amortized: one pass drops many)
                self._drop_output()

    def _flush(self) -> None:
        """What the cell gave, in one message (before the pool waits for more)."""
        if self.pending:
            batch, self.pending = W.Batch(tuple(self.pending)), []
            self._send(batch)

    def _drop_output(self) -> None:
        drop = self.outputs_kept - BACKLOG
        kept: deque = deque()
        for item in self.backlog:
            if drop and _is_output(item):
                drop -= 1
                self.dropped += 1
            else:
                kept.append(item)
        self.backlog, self.outputs_kept = kept, BACKLOG

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
        )

    def _handle(self, conn: Link, msg: object) -> None:
        if isinstance(msg, W.RunCell):
            self._run(msg.kwargs)
            return
        if not isinstance(msg, W.Call) or msg.method not in CALLS:
            return
        try:
            own = getattr(self, f"_{msg.method}", None)
            if own is not None:
                value = own(*msg.args)
            else:
                value = getattr(self.pool, msg.method)(*msg.args, **msg.kwargs)
            if value is self.pool:  # (restart returns the pool: the kernel has its state)
                value = None
            reply = W.Reply(value, self.state())
        except Exception as exc:
            reply = W.Failed(type(exc).__name__, str(exc), self.state())
        if msg.method == "stop":
            self.stopping = True
        with self.lock, contextlib.suppress(OSError):
            if self.client is conn:
                try:
                    conn.send(reply)
                except (TypeError, AttributeError, pickle.PicklingError) as exc:
                    conn.send(W.Failed(type(exc).__name__, str(exc), self.state()))

    def _listing(self) -> dict:
        with self.lock:
            connected = self.client_pid if self.client is not None else None
        live = [r for r in self.pool.roster.ranks.values() if r.state != "dead"]
        rss = 0
        for r in live:
            with contextlib.suppress(psutil.Error):
                rss += psutil.Process(r.pid).memory_info().rss
        return {
            "name": self.name,
            "world_size": self.pool.world_size,
            "alive": len(live),
            "running_since": self.running_since,
            "connected": connected,
            "idle_since": None if connected else time.time() - (time.monotonic() - self.idle_since),
            "uptime": time.time() - self.started_at,
            "rss": rss,
            "pid": os.getpid(),
        }

    def _run(self, kwargs: dict) -> None:
        for key in ("needs", "auto"):
            if kwargs.get(key) is not None:
                kwargs[key] = payload.Shipment(*kwargs[key])
        kwargs["raw_values"] = kwargs.get("want_values", False)
        self.running_since = time.time()
        try:
            for event in self.pool.run(**kwargs):
                if isinstance(event, P.CellEnd) and self.dropped:
                    note = (
                        f"{self.dropped} lines the ranks printed while no kernel was "
                        f"connected were dropped (the last {BACKLOG} kept)"
                    )
                    event = dataclasses.replace(event, notes=(*event.notes, note))
                    self.dropped = 0
                self.pending.append(W.Event(event))
            self.pending.append(W.Reply(None, self.state()))
        except Exception as exc:  # the cell could not start: the pool said why
            self.pending.append(W.Failed(type(exc).__name__, str(exc), self.state()))
        finally:
            self.running_since = None
            self._flush()
            with self.lock:
                if self.client is None:  # its end waits for a kernel: idle from now
                    self.idle_since = time.monotonic()


def _is_output(item: object) -> bool:
    return isinstance(item, W.Event) and isinstance(item.event, P.Output)


def main(argv: list[str] | None = None) -> int:
    folder = (argv or sys.argv[1:])[0]
    with open(os.path.join(folder, "options.json")) as f:
        options = json.load(f)
    os.chdir(options.get("cwd") or folder)
    for path in reversed(options.get("sys_path", [])):  # what the kernel can import
        if path not in sys.path:
            sys.path.insert(1, path)
    try:
        Supervisor(folder, options).serve()
    except BaseException:
        write_private(os.path.join(folder, "error.txt"), traceback.format_exc().encode())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
