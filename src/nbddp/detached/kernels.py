"""A detached pool's kernels: who is connected, what each is sent, what waits for the next.

One kernel at a time is the pool's client (a second is refused, ``--force`` takes
over); what the pool gives while none is connected (or what a kernel did not
read) is kept, bounded, for the next one. Nothing here waits on a kernel while
holding a lock another thread needs: each connection is greeted by a thread of
its own (a connection that stalls its handshake delays no one), and each kernel
is written by its own :class:`~nbddp.detached.outbox.Outbox` (a kernel that stops
reading is dropped after a bound, with a note, and what it missed is kept).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import time

from ..pool.sizes import human
from ..wire import handshake
from ..wire import protocol as P
from . import messages as W
from .messages import Link
from .outbox import SEND_DEADLINE, Outbox

__all__ = ["HELLO_TIMEOUT", "Kernels"]

HELLO_TIMEOUT = 5.0  # s a connection has to authenticate, then to say hello
GREETING = 64  # connections greeted at once (more wait in the listener's backlog)


class Kernels:
    """The kernel connected to supervisor ``sup`` (a :class:`~nbddp.detached.server.Supervisor`:
    its ``requests``, ``pool``, ``running``, ``state()``, ``listing()``, ``ask_stop()``,
    ``interrupt()``)."""

    def __init__(self, sup, deadline: float = SEND_DEADLINE) -> None:
        self.sup, self.deadline = sup, deadline
        self.lock = threading.Lock()  # the client, the backlog, the notes: held briefly
        self.client: Outbox | None = None
        self.client_pid: int | None = None
        self.leaving: list[Outbox] = []  # taken over: sending their last words
        self.backlog = W.Backlog()
        self.notes: list[str] = []  # for the next cell's end
        self.idle_since = time.monotonic()
        self.prompts = 0  # the client's rank pdb prompts not answered yet (it waits on us)
        self._greeting = threading.BoundedSemaphore(GREETING)

    # ------------------------------------------------------------ arriving

    def accept(self, listener, token: bytes) -> None:
        """Accept connections until the listener closes; each greeted by a thread."""
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if listener.fileno() < 0 or exc.errno is None:
                    return  # closed
                time.sleep(0.05)  # EMFILE and the like: let it pass
                continue
            self._greeting.acquire()
            threading.Thread(target=self._greet, args=(sock, token), daemon=True).start()

    def _greet(self, sock, token: bytes) -> None:
        try:
            try:
                conn = Link(handshake.server_handshake(sock, token, HELLO_TIMEOUT))
                data = conn.channel.recv_bytes(1 << 16, timeout=HELLO_TIMEOUT)
                hello = pickle.loads(data)
            except Exception:  # not the token, too slow, not a hello: nothing more from it
                sock.close()
                return
            if not isinstance(hello, W.Hello) or hello.version != W.VERSION:
                conn.close()
            elif hello.peek:
                _last_word(conn, W.Reply(self.sup.listing(), self.sup.state()))
            else:
                self._welcome(conn, hello)
        finally:
            self._greeting.release()

    def _welcome(self, conn: Link, hello: W.Hello) -> None:
        name = self.sup.name
        with self.lock:
            if self.client is not None and not hello.force:
                refused = W.Refused(
                    f"the detached pool {name} is connected to another kernel (pid "
                    f"{self.client_pid}): `%ddp connect {name} --force` takes it over"
                )
            else:
                refused = None
                self._take_over(conn, hello.pid)
        if refused is not None:
            _last_word(conn, refused)

    def _take_over(self, conn: Link, pid: int) -> None:
        """``conn`` is the client now: what the last one did not read, then the backlog."""
        old = self.client
        if old is not None:
            self.backlog.extend(old.take(), front=True)
            old.close(W.TakenOver(pid))
            self.leaving.append(old)
        items = self.backlog.take()
        resumed = self.sup.running
        if resumed is None:
            cells = [i.request for i in items if isinstance(i, W.Event)]
            resumed = cells[-1] if cells else None
        outbox = Outbox(conn, self._lost, self.deadline)
        outbox.put(W.Welcome(self.sup.state(), resumed), *([W.Batch(items)] if items else []))
        self.client, self.client_pid, self.prompts = outbox, pid, _prompts(items)
        threading.Thread(target=self._read, args=(outbox, pid), daemon=True).start()

    # ------------------------------------------------------------ reading

    def _read(self, outbox: Outbox, pid: int) -> None:
        """The kernel's messages: interrupts and pdb lines at once, the rest in turn."""
        sup = self.sup
        while True:
            try:
                msg = outbox.conn.recv()
            except Exception:  # (EOF, a reset, a frame cut off by a drop)
                break
            if isinstance(msg, W.Unread):  # (after its Leave) what it did not read
                with self.lock:
                    self.backlog.extend(msg.items, front=True)
                outbox.conn.close()
                break
            if self.client is not outbox:
                break  # taken over: nothing more from it is done
            if isinstance(msg, W.Leave):
                with self.lock:
                    self.client, self.idle_since = None, time.monotonic()
                    self.backlog.extend(outbox.take(current=False), front=True)
                    outbox.close(W.Bye(), hang_up=False)  # (its Unread comes next)
                    self.leaving.append(outbox)
            elif isinstance(msg, W.Interrupt):
                sup.interrupt(msg.request)
            elif isinstance(msg, W.DebugReply):
                with self.lock:
                    self.prompts = max(0, self.prompts - 1)
                sup.pool.debug_reply(msg.prompt, msg.line)
            else:
                if isinstance(msg, W.Call) and msg.method == "stop":
                    sup.ask_stop(f"`%ddp stop` from the kernel pid {pid}")  # not after the cell
                sup.requests.put((outbox, msg))
        self._drop(outbox, outbox.why)  # it left (or was cut off)

    def _lost(self, outbox: Outbox, why: str) -> None:
        """The outbox's connection failed (or the kernel stopped reading)."""
        with self.lock:
            if outbox in self.leaving:
                self.leaving.remove(outbox)
        self._drop(outbox, why)

    def _drop(self, outbox: Outbox, why: str) -> None:
        """``outbox``'s kernel is gone (its reader or its writer saw it first): what it
        did not receive waits for the next one; if it was cut off (``why``), a note says so."""
        with self.lock:
            if self.client is not outbox:
                return
            self.client, self.idle_since = None, time.monotonic()
            self.backlog.extend(outbox.take(), front=True)
            outbox.close()
            if not why:
                return
            note = (
                f"the kernel pid {self.client_pid} {why} and was disconnected from the "
                f"detached pool {self.sup.name}: what it had not read is kept for the next kernel"
            )
            self.notes.append(note)
        print(f"nbddp: {note}", file=sys.stderr, flush=True)  # (the supervisor's log)

    # ------------------------------------------------------------ sending

    def send(self, item: object) -> None:
        """To the kernel connected (never waits), else kept for the next one.

        A kernel at a rank's pdb prompt reads nothing until the user answers: it is sent
        no Ticks meanwhile (they would fill its socket for nothing), and is never cut off
        for not reading (:meth:`check`)."""
        with self.lock:
            if self.client is None:
                self.backlog.extend((item,))
                return
            self.prompts += _prompts([item])
            if self.prompts and isinstance(item, W.Batch):
                item = W.Batch(tuple(i for i in item.items if not W.is_tick(i)))
            if not isinstance(item, W.Batch) or item.items:
                self.client.put(item)

    def reply(self, outbox: Outbox, item: object) -> None:
        """To the kernel that asked, if it is still the one connected."""
        with self.lock:
            if self.client is outbox:
                outbox.put(item)

    def check(self, now: float) -> None:
        """Drop a kernel whose send has waited past the deadline."""
        with self.lock:
            self.leaving = [o for o in self.leaving if not o.ended]
            waits = self.client is None or self.prompts  # (at a prompt: the user, not it)
            outboxes = [*self.leaving, *([] if waits else [self.client])]
        for outbox in outboxes:
            outbox.check(now)

    def idle(self, now: float) -> float:
        """How long no kernel has been connected (0: one is)."""
        with self.lock:
            return 0.0 if self.client is not None else now - self.idle_since

    def connected(self) -> int | None:
        with self.lock:
            return self.client_pid if self.client is not None else None

    def take_notes(self) -> list[str]:
        """Notes for the next cell's end: kernels dropped, output dropped while none read."""
        with self.lock:
            notes, self.notes = self.notes, []
            if self.backlog.dropped:
                notes.append(
                    f"while no kernel read them, {self.backlog.said_dropped()} were dropped "
                    f"(the last {self.backlog.limit:,}, {human(self.backlog.max_bytes)} at "
                    "most, are kept)"
                )
                self.backlog.dropped.clear()
        return notes

    def goodbye(self, last: object | None, timeout: float = 2.0) -> None:
        """The supervisor ends: send ``last`` (a stop's reply) and what is queued, briefly."""
        with self.lock:
            client, self.client = self.client, None
        if client is not None:
            client.close(last)
            client.join(timeout)


def _prompts(items) -> int:
    """The rank pdb prompts in ``items`` (Batches opened)."""
    return sum(isinstance(i, W.Event) and isinstance(i.event, P.RankDebug) for i in W.flat(items))


def _last_word(conn: Link, msg: object) -> None:
    """Send ``msg`` and close (a refusal, a peek's answer): never waits long."""
    with contextlib.suppress(OSError):
        conn.channel.sock.settimeout(HELLO_TIMEOUT)
        conn.send(msg)
    conn.close()
