"""The relay's carrying: one host's ranks' traffic over one connection to the notebook.

What a relay is for and how it starts: :mod:`nbddp.hosts.relay`. Here, the loop that turns
per-rank traffic into per-host frames:

- down, a frame carries a message and the ranks it is for: a Run to the 8 ranks
  of a host is one write by the notebook, not 8;
- up, a frame carries what the host's ranks sent since the last frame: stream
  bytes, control messages, and Done messages grouped when they are equal (the
  8 ranks that ended a cell the same way are one item).

A rank's Done goes up after everything the rank wrote before it, on the one
connection, so the notebook has every byte a cell printed when it sees a relayed
rank's Done. Ranks behind a relay write no end markers into their streams: the
relay knows by the way Unix sockets and epoll work (see ``Relay._after_output``).
This module imports no torch (a relay is a small process).

Frames, lists of plain data (decoded with :func:`nbddp.wire.protocol.loads_plain`, which
runs nothing), in authenticated frames (:mod:`nbddp.wire.frames`) both ways::

    up    ("hello", rank, bytes)          a rank's Hello or StreamHello
          ("msg", rank, bytes)            any other control message
          ("done", ranks, bytes)          one Done for each of ``ranks``: their output is in
          ("out", rank, stream, bytes)    stream bytes
          ("gone", rank)                  the rank's control connection closed
    down  (ranks, cell, bytes)            one control message for each of ``ranks``; ``cell``
                                          when it is that cell's Run (else 0); bytes None:
                                          a big message follows, as it is; ranks ():
                                          a Refused for each rank, now and later
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import queue
import selectors
import socket
import sys
import threading
import time

from ..wire import protocol as P
from ..wire.frames import Channel
from ..wire.listener import Listener
from ..wire.streams import CHUNK, Stream

__all__ = ["Relay"]

# Done messages wait this long for the host's other ranks running the same cell, so that
# ranks ending together reach the notebook in one frame (the last one is never held)
LINGER = 0.002
POLL = 0.0002  # meanwhile, how often to look
# held ranks that have all gone (a host of one rank whose rank died): their holders fork
# new ones at once, so the relay waits this long for one before it ends (the re-form's limit)
RENEW_WAIT = 60.0


def _is_done(data: bytes) -> bool:
    """Whether a rank's message is its Done: a small one decoded once for the host's
    ranks, which end a cell with the same bytes (big ones, a value or a batch of
    metrics, are not kept)."""
    if len(data) > 4096:
        return isinstance(P.loads(data), P.Done)
    return _is_small_done(data)


@functools.lru_cache(maxsize=16)
def _is_small_done(data: bytes) -> bool:
    return isinstance(P.loads(data), P.Done)


class _Stream(Stream):
    """One rank's stdout or stderr, as the relay reads it: bytes, passed on as they are."""

    def __init__(self, conn: Channel, name: str) -> None:
        super().__init__(conn, name)
        os.set_blocking(self.fd, False)
        self.read_in = -1  # the round of the relay's loop it was last read in
        self.full = False  # that read filled its buffer: there may be more


class Relay:
    """Carries one host's ranks' traffic over one connection to the notebook."""

    def __init__(self, up: Channel, listener: socket.socket, token: bytes) -> None:
        self.up, self.listener, self.token = up, listener, token
        self.selector = selectors.DefaultSelector()
        self.controls: dict[int, Channel] = {}
        self.streams: dict[int, dict[str, _Stream]] = {}
        self.ended: list[tuple[int, bytes]] = []  # (rank, its Done) read in this round
        self.round = 0
        self.items: list[tuple] = []  # the next frame up
        self.dones: dict[bytes, list[int]] = {}  # equal Done messages, the ranks that sent them
        self.seen = 0  # ranks that connected
        self.held = False  # they have holders: a new process comes for one that died
        self.empty_since: float | None = None  # when its last rank went (None: one is here)
        self.closing = False
        self.refusal: bytes | None = None  # the notebook turned this host's ranks away
        self.told: set[int] = set()  # ranks told so
        self.waiting: set[int] = set()  # ranks running a cell whose Done has not come
        self.dones_since: float | None = None  # when the oldest Done in ``dones`` came
        self._started: queue.SimpleQueue = queue.SimpleQueue()  # ranks sent a Run (down)
        self._accepted: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)

    # -- threads: accept (authenticate ranks), down (notebook -> ranks)

    def _accepted_peer(self, conn: Channel, hello: object, raw: bytes) -> None:
        self._accepted.put((conn, hello, raw))  # (from the listener's thread)
        self._wake()

    def _down_loop(self) -> None:
        while True:
            try:
                ranks, cell, data = P.loads_plain(self.up.recv_bytes())
                if data is None:  # a big message: it follows as it is
                    data = self.up.recv_bytes()
            except (EOFError, OSError):
                break  # the notebook went away: so do the relay and, then, its ranks
            if not ranks:  # for each of its ranks, now and later: the host is turned away
                self._refuse(data)
                continue
            if cell:
                self._started.put(ranks)  # before the Run: its Done cannot come first
            for rank in ranks:
                conn = self.controls.get(rank)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.send_bytes(data)
        self.closing = True
        self._wake()

    def _refuse(self, data: bytes) -> None:
        """The notebook takes none of this host's ranks: each is told why (by the loop, as
        it comes), and so is the host's log."""
        with contextlib.suppress(Exception):
            print(f"nbddp relay: {P.loads(data).reason}", file=sys.stderr, flush=True)
        self.refusal = bytes(data)
        self._wake()

    def _tell_refused(self) -> None:
        """Every rank connected and not yet told: the refusal (then each ends)."""
        for rank, conn in self.controls.items():
            if rank not in self.told:
                self.told.add(rank)
                with contextlib.suppress(OSError):
                    conn.send_bytes(self.refusal)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    # -- the loop: ranks -> notebook

    def serve(self, timeout: float) -> None:
        # its peers are this host's ranks, on a Unix socket in a 0700 folder: heard as the
        # notebook hears its own, every handshake from one selector, so that one slow peer
        # does not hold up the others
        accepting = Listener(self.listener, self.token, self._accepted_peer, name="relay")
        accepting.start()
        threading.Thread(target=self._down_loop, name="relay-down", daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while not self.closing:
                self.round += 1
                for key, _ in self.selector.select(LINGER if self.dones else 1.0):
                    while not self._started.empty():
                        self.waiting.update(self._started.get())
                    what = key.data
                    if what is None:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        self._take_accepted()
                    elif what[0] == "control":
                        self._control(what[1], key.fileobj)
                    else:
                        self._read(what[1], what[2])
                self._after_output()
                self._flush()
                if self.refusal is not None:
                    self._tell_refused()
                if self._every_rank_gone():
                    break
                if not self.seen and time.monotonic() > deadline:
                    break
                if self.dones and self.waiting:  # the host's ranks are ending a cell: let
                    time.sleep(POLL)  # their last words come together, not one wake-up each
        finally:
            self.closing = True
            accepting.close()
            for conn in list(self.controls.values()):
                conn.close()
            for streams in self.streams.values():
                for s in streams.values():
                    s.conn.close()
            self.up.close()

    def _every_rank_gone(self) -> bool:
        """Every rank that came has gone, and none of them is coming back: not held, or
        no holder's new process came within RENEW_WAIT s (the host's relay stays for it, so
        that the notebook tells a dead rank from a lost host, nbddp.pool.hosts_lost)."""
        if not self.seen or self.controls:
            self.empty_since = None
            return False
        if self.empty_since is None:
            self.empty_since = time.monotonic()
        return not self.held or time.monotonic() - self.empty_since > RENEW_WAIT

    def _take_accepted(self) -> None:
        while not self._accepted.empty():
            conn, hello, data = self._accepted.get()
            if isinstance(hello, P.Hello) and hello.rank not in self.controls:
                self.controls[hello.rank] = conn
                self.seen += 1
                self.held = self.held or hello.held
                self.selector.register(conn, selectors.EVENT_READ, ("control", hello.rank))
            elif isinstance(hello, P.StreamHello):
                s = _Stream(conn, hello.stream)
                self.streams.setdefault(hello.rank, {})[hello.stream] = s
                self.selector.register(s.fd, selectors.EVENT_READ, ("stream", hello.rank, s))
            else:
                conn.close()
                continue
            self.items.append(("hello", hello.rank, data))

    def _control(self, rank: int, conn: Channel) -> None:
        if conn.closed:  # the rank went earlier in this round
            return
        try:
            data = conn.recv_bytes(ready=True)
        except (EOFError, OSError):
            self._gone(rank)
            return
        try:
            done = _is_done(data)
        except Exception:  # not a message: this rank goes, the host's others stay
            self._gone(rank)
            return
        if done:  # it goes up after the rank's output
            self.waiting.discard(rank)
            self.ended.append((rank, data))
        else:
            self.items.append(("msg", rank, data))

    def _read(self, rank: int, s: _Stream) -> bool:
        """Take what ``s`` has; False when nothing was there."""
        if s.eof or s.conn.closed:  # its rank went earlier in this round
            return False
        s.read_in, s.full = self.round, False
        data = s.read_bytes()
        if data is None:
            return False
        if not data:
            s.eof = True
            self.selector.unregister(s.fd)
            s.conn.close()
            return False
        s.full = len(data) == CHUNK
        self.items.append(("out", rank, s.name, data))
        return True

    def _after_output(self) -> None:
        """Each Done read in this round goes up after everything its rank wrote before it.

        A worker behind a relay writes no end markers: on a Unix socket, a write is in the
        reader's queue when it returns, and epoll lists every socket with data at once. So
        when a Done is read, a stream of its rank that was not ready in the same round had
        nothing from before it, and one that was has given all of it once a read of it
        comes back short.
        """
        for rank, data in self.ended:
            for s in self.streams.get(rank, {}).values():
                while s.read_in == self.round and s.full and self._read(rank, s):
                    pass
            self._add_done(rank, data)
        self.ended.clear()

    def _add_done(self, rank: int, data: bytes) -> None:
        if not self.dones:
            self.dones_since = time.monotonic()
        self.dones.setdefault(bytes(data), []).append(rank)

    def _gone(self, rank: int) -> None:
        """The rank's control connection closed: its last output, its Done, then its end."""
        conn = self.controls.pop(rank)
        self.waiting.discard(rank)
        self.selector.unregister(conn)
        conn.close()
        for s in self.streams.pop(rank, {}).values():
            while not s.eof and self._read(rank, s):
                pass
            if not s.eof:
                self.selector.unregister(s.fd)
                s.conn.close()
        for i, (who, _) in enumerate(self.ended):  # a Done it sent in this round
            if who == rank:
                self._add_done(rank, self.ended.pop(i)[1])
                break
        self._emit_dones()
        self.items.append(("gone", rank))

    def _emit_dones(self) -> None:
        for data, ranks in self.dones.items():
            self.items.append(("done", tuple(ranks), data))
        self.dones.clear()

    def _flush(self) -> None:
        if self.dones and (not self.waiting or time.monotonic() - self.dones_since >= LINGER):
            self._emit_dones()
        if not self.items:
            return
        frame = pickle.dumps(self.items, protocol=pickle.HIGHEST_PROTOCOL)
        self.items = []
        try:
            self.up.send_bytes(frame)
        except OSError:
            self.closing = True
