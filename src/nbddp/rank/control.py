"""A rank's control channel to the notebook (or to its host's relay).

:class:`Control` sends messages under a lock (any thread) and runs the receiver
thread: each incoming message goes to the handler registered for its type,
called on the receiver thread; a message with no handler is queued for the main
thread (:attr:`Control.inbox`). When the notebook is gone, the rank ends.
The rank's stdout and stderr are connections of their own (:func:`connect_streams`).
"""

from __future__ import annotations

import ctypes
import io
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable

from ..wire import frames, handshake
from ..wire import protocol as P
from ..wire.frames import Channel
from ..wire.tls import Tls

__all__ = [
    "Control",
    "connect",
    "connect_streams",
    "flush_streams",
    "parse_address",
    "write_marker",
]

Handler = Callable[[object], None]
_libc = ctypes.CDLL(None)


def parse_address(address: str) -> tuple[str | tuple[str, int], str]:
    """``/path/sock`` or ``unix:/path`` -> AF_UNIX; ``host:port`` -> AF_INET."""
    if address.startswith("unix:"):
        return address[5:], "AF_UNIX"
    if "/" in address:
        return address, "AF_UNIX"
    host, _, port = address.rpartition(":")
    return (host or "127.0.0.1", int(port)), "AF_INET"


def connect(address: str, token: bytes, timeout: float = 60.0, tls: Tls | None = None) -> Channel:
    """Connect and authenticate, retrying until the listener is up or ``timeout`` passes
    (``tls``: for a TCP address of a pool attached with --tls)."""
    addr, family = parse_address(address)
    tls = tls if family == "AF_INET" else None
    return handshake.connect(addr, family, token, timeout=timeout, tls=tls)


class Control:
    """The control connection: :meth:`send` from any thread, handlers on the receiver's."""

    def __init__(self, conn: Channel, exit: Callable[[int], None]) -> None:
        self.conn = conn
        self.inbox: queue.Queue = queue.Queue()  # messages for the main thread
        self._exit = exit  # ends the process (the notebook went away)
        self._send_lock = threading.Lock()
        self._handlers: dict[type, Handler] = {}

    def send(self, msg: object) -> None:
        data = P.dumps(msg)
        with self._send_lock:
            self.conn.send_bytes(data)

    def handle(self, handlers: dict[type, Handler]) -> None:
        """Handle these message types on the receiver thread (the rest go to the inbox)."""
        self._handlers.update(handlers)

    def start(self) -> None:
        threading.Thread(target=self._receive_loop, name="nbddp-receiver", daemon=True).start()

    def _receive_loop(self) -> None:
        try:
            while True:
                self.dispatch(self._receive())
        except BaseException:
            traceback.print_exc()
            self._exit(1)

    def _receive(self) -> object:
        try:
            return P.loads(self.conn.recv_bytes())
        except frames.FrameError as exc:  # said where the notebook may still read it
            print(
                f"nbddp.worker: the connection to the notebook failed a check: {exc}",
                file=sys.__stderr__ or sys.stderr,
            )
            self._exit(1)
            raise
        except (EOFError, OSError):
            self._exit(1)  # the notebook went away
            raise

    def dispatch(self, msg: object) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.inbox.put(msg)
        else:
            handler(msg)


class _LineWriter(io.TextIOWrapper):
    """stdout/stderr over a raw fd: flushed at every newline and every explicit flush."""

    def __init__(self, fd: int, name: str) -> None:
        raw = io.FileIO(fd, "w", closefd=False)
        super().__init__(
            io.BufferedWriter(raw),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )
        self.mode = "w"
        self._name = name

    @property
    def name(self) -> str:  # what print(sys.stdout) and loggers show
        return self._name


def connect_streams(address: str, token: bytes, rank: int, tls: Tls | None = None) -> None:
    """Make fds 1 and 2 connections to the notebook: C and C++ output reaches it too.

    On a Unix socket the fd is the socket itself: bytes go as they are written. On TCP
    every byte must travel in an authenticated frame, so the fd is a pipe and a thread
    sends what comes out of it, in frames (:class:`_Pump`).
    """
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        conn = connect(address, token, timeout=10, tls=tls)
        conn.send_bytes(P.dumps(P.StreamHello(rank, os.getpid(), stream)))
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        if conn.mode == "plain":
            os.set_blocking(conn.fileno(), True)  # a print waits for the reader, as on a pipe
            os.dup2(conn.fileno(), fd)
            conn.close()
            continue
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        _PUMPS[fd] = pump = _Pump(read_end, conn)
        threading.Thread(target=pump.run, name=f"nbddp-{stream}", daemon=True).start()
    sys.stdout = _LineWriter(1, "<stdout>")
    sys.stderr = _LineWriter(2, "<stderr>")


class _Pump:
    """What a rank writes to one of its output pipes, in frames to the notebook; once the
    connection is gone, read and dropped (a print never blocks the rank). A cell's end
    marker goes from the rank's own thread, right after what the pipe held (no wait for
    the pump thread to wake)."""

    def __init__(self, fd: int, conn: Channel) -> None:
        self.fd, self.conn = fd, conn
        self.lock = threading.Lock()  # a read of the pipe and its sending, in order
        os.set_blocking(fd, False)

    def run(self) -> None:
        while self._move(wait=True):
            pass
        self.conn.close()

    def _move(self, wait: bool) -> bool:
        """Send what the pipe holds now (``wait``: once it holds something); False at its end."""
        if wait:
            frames.ready(self.fd, None)
        with self.lock:
            while True:
                try:
                    data = os.read(self.fd, 1 << 16)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not data:
                    return False
                self._send(data)

    def _send(self, data: bytes) -> None:
        if not self.conn.closed:
            try:
                self.conn.send_bytes(data)
            except OSError:
                self.conn.close()

    def mark(self, marker: bytes) -> bool:
        """The end marker, after everything written before it; False: the stream is gone."""
        if not self._move(wait=False) or self.conn.closed:
            return False
        with self.lock:
            self._send(marker)
        return not self.conn.closed


_PUMPS: dict[int, _Pump] = {}  # fd 1 and 2 on TCP: their pumps


def write_marker(fd: int, marker: bytes) -> None:
    """Write a cell's end marker on ``fd`` (through its pump on TCP); OSError: it is closed."""
    pump = _PUMPS.get(fd)
    if pump is not None and pump.mark(marker):
        return
    os.write(fd, marker)


def flush_streams() -> None:
    """Flush Python's and C's buffers of stdout and stderr."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    _libc.fflush(None)
