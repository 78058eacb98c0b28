"""What a detached pool's supervisor sends one kernel: queued, and sent by a thread of its own.

The supervisor never writes to a kernel's socket itself: it puts what it has in
that kernel's :class:`Outbox` (a list; no wait) and a writer thread sends it. A
kernel that stops reading (suspended, stuck in a long computation, its socket
full) therefore blocks only its own writer: the cell goes on, other kernels can
list, connect and take over, and the idle timeout still counts. A send that has
not finished within ``deadline`` seconds ends that kernel's connection
(:meth:`Outbox.check`, called each second by the supervisor's watch thread):
what it had not received goes back to the supervisor, kept for the next kernel.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from .messages import Link

__all__ = ["SEND_DEADLINE", "Outbox"]

SEND_DEADLINE = 10.0  # s one message to a kernel may take before that kernel is dropped


class Outbox:
    """One kernel's connection, written by a thread of its own.

    ``lost(outbox, why)`` is called once, from the writer thread, when the connection
    ends for any reason other than :meth:`close` (``why``: a line); what the kernel did
    not fully receive is still in the outbox then, for :meth:`take` (the message being
    written included).
    """

    def __init__(
        self,
        conn: Link,
        lost: Callable[[Outbox, str], None],
        deadline: float = SEND_DEADLINE,
    ) -> None:
        self.conn, self.lost, self.deadline = conn, lost, deadline
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._current: object | None = None  # being written
        self._busy_since: float | None = None
        self._closing = False  # send what is queued, then close
        self._hang_up = True  # close the connection once all is sent
        self._ended = False
        self._why = ""  # why check() cut it off
        self._thread = threading.Thread(target=self._write, daemon=True, name="nbddp-outbox")
        self._thread.start()

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def why(self) -> str:
        """Why :meth:`check` cut it off ("" if it did not)."""
        return self._why

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for what is queued to go (after :meth:`close`)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._shut()

    def put(self, *items: object) -> None:
        """Queue ``items`` (never waits)."""
        with self._cond:
            self._queue.extend(items)
            self._cond.notify()

    def take(self, current: bool = True) -> list:
        """What it has not sent, taken away; with ``current``, the message being written
        too (it may yet arrive whole: for a kernel that will read no more)."""
        with self._cond:
            unsent = list(self._queue)
            if current and self._current is not None:
                unsent.insert(0, self._current)
                self._current = None
            self._queue.clear()
            return unsent

    def close(self, last: object | None = None, hang_up: bool = True) -> None:
        """Send ``last`` (if any) after what is queued, then close the connection (unless
        not ``hang_up``: its reader still reads); never waits."""
        with self._cond:
            if last is not None:
                self._queue.append(last)
            self._closing, self._hang_up = True, hang_up
            self._cond.notify()

    def check(self, now: float) -> None:
        """Cut the connection off if one message has taken more than ``deadline`` s."""
        since = self._busy_since
        if since is not None and now - since > self.deadline and not self._ended:
            self._why = f"did not read for {self.deadline:g} s"
            self._shut()

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.channel.sock.shutdown(socket.SHUT_RDWR)  # ends a send that waits

    def _next(self) -> object | None:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None  # closing, and all was sent
            self._current = self._queue.popleft()
            return self._current

    def _write(self) -> None:
        while True:
            item = self._next()
            if item is None:
                break
            try:
                data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # it cannot be pickled: said in the log, not sent
                print(f"nbddp: not sent to the kernel: {exc!r}", file=sys.stderr, flush=True)
                data = None
            if data is not None:
                self._busy_since = time.monotonic()  # (the write, not the pickling, counts)
                try:
                    self.conn.channel.send_bytes(data)
                except (OSError, ValueError) as exc:  # (ValueError: a closed socket)
                    self._end(self._why or f"its connection failed ({exc})")
                    return
            with self._cond:
                self._current, self._busy_since = None, None
        self._ended = True
        if self._hang_up:
            self.conn.close()

    def _end(self, why: str) -> None:
        self._ended = True
        self.conn.close()
        self.lost(self, why)  # (what was not sent stays here: taken by whoever drops it)
