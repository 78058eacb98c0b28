"""Accept connections and have each peer prove it holds the pool's token.

One implementation for the notebook's listener and for a host relay's. One thread
accepts and runs every pending handshake from one selector, each a step machine
that never blocks (:class:`nbddp.wire.handshake.ServerHandshake`, then the peer's first
message read as it comes, :meth:`nbddp.wire.frames.Channel.recv_ready`), so a silent,
slow or garbage-sending peer costs one socket and a few microseconds a byte, and a
rank holding the token is through in one round trip whatever the others do.

Bounded: the whole handshake, the peer's first message included, must end within
HANDSHAKE_TIMEOUT seconds of its accept, however the peer paces its bytes; at most
MAX_PENDING connections that have not yet proven the token are held (one descriptor
each; one more for the moment between its accept and making room): the next one
closes the oldest of the address that holds the most, so a crowd from one address
makes room from itself, never from a rank of another host.
Nothing a peer sends is decoded before it proved the token. A peer that fails is
refused: the refusals are counted by reason and said in one folded line each
(:meth:`Listener.refusals`), however many there were.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from . import frames, handshake
from . import protocol as P
from .tls import Tls

__all__ = ["Listener", "bind_tcp", "bind_unix"]

HELLO_LIMIT = 1 << 16  # the first message after the handshake, at most
HANDSHAKE_TIMEOUT = handshake.HANDSHAKE_TIMEOUT  # s for the whole handshake and the first message
MAX_PENDING = 256  # connections that have not proven the token, held at once at most
ACCEPT_BURST = 64  # connections accepted at one wake-up at most (then the handshakes go on)
REASONS_KEPT = 32  # distinct refusal reasons remembered between two reports
_ACCEPT, _WAKE = object(), object()  # the selector's own keys


def bind_unix(path: str, backlog: int = 256) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(backlog)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), backlog=1024)


def _why(exc: BaseException) -> str:
    """A refusal's reason in words; a class this version lacks is another nbddp version."""
    if isinstance(exc, (AttributeError, ModuleNotFoundError, ImportError)):
        return (
            f"its first message names something this nbddp (protocol {P.PROTOCOL_VERSION}) "
            f"lacks ({type(exc).__name__}: {exc}): another nbddp version?"
        )
    if isinstance(exc, handshake.HandshakeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class _Peer:
    """A connection in its handshake: the steps so far, and until when it may take."""

    __slots__ = ("conn", "deadline", "events", "fd", "hs", "peer", "source", "timeout")

    def __init__(self, sock: socket.socket, peer, token: bytes, tls: Tls | None) -> None:
        self.fd, self.peer = sock.fileno(), peer
        self.source = peer[0] if isinstance(peer, tuple) and peer else ""
        self.timeout = HANDSHAKE_TIMEOUT
        self.deadline = time.monotonic() + self.timeout
        self.hs = handshake.ServerHandshake(sock, token, tls)
        self.conn: frames.Channel | None = None  # once it proved the token
        self.events = 0  # what the selector waits for on it

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        else:
            with contextlib.suppress(OSError):
                self.hs.sock.close()


class Listener:
    """Accepts on ``sock``; each authenticated peer goes to ``on_peer(channel, hello, raw)``,
    called in the listener's thread (it must not wait: the pool and the relay queue it).
    ``tls``: TCP peers speak TLS with this certificate (``%ddp attach --tls``)."""

    def __init__(
        self,
        sock: socket.socket,
        token: bytes,
        on_peer: Callable[[frames.Channel, object, bytes], None],
        *,
        name: str = "nbddp",
        tls: Tls | None = None,
    ) -> None:
        self.sock, self.token, self.on_peer, self.name = sock, token, on_peer, name
        self.tls = tls
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._open = True
        self._thread: threading.Thread | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = -1
        self._pending: dict[int, _Peer] = {}  # by descriptor
        self._deadlines: list[tuple[float, int, _Peer]] = []  # a heap (stale ones skipped)
        self._unproven: dict[str, OrderedDict[int, _Peer]] = {}  # by address, oldest first
        self._unproven_count = 0
        self._accepted = 0  # connections accepted so far (orders the heap's ties)

    def start(self) -> Listener:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.sock.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._selector.register(self.sock, selectors.EVENT_READ, _ACCEPT)
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-accept", daemon=True)
        self._thread.start()
        return self

    @property
    def open(self) -> bool:
        return self._open

    @property
    def running(self) -> bool:
        """Whether its thread still runs (it ends when the listener is closed)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Connections in their handshake now (each holds one descriptor)."""
        return len(self._pending)

    def close(self) -> None:
        """Stop accepting and drop the handshakes in flight; once this returns, the listener
        holds no descriptor (the refusals stay readable)."""
        self._open = False
        with contextlib.suppress(OSError):
            self.sock.close()
        with self._lock:  # (the thread closes the pipe under this lock: never a reused fd)
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"!")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def refusals(self, take: bool = False) -> list[str]:
        """The refusals (since the last ``take``), one line per reason and peer."""
        with self._lock:
            refused = self._refused
            if take:
                self._refused = Counter()
        return [line if n == 1 else f"{line} ({n} times)" for line, n in refused.items()]

    def refuse(self, peer, why: str) -> None:
        """Count a refused connection, its reason in words."""
        who = f" from {peer[0]}" if isinstance(peer, tuple) and peer else ""
        self.refuse_line(f"refused a connection{who}: {why}")

    def refuse_line(self, line: str) -> None:
        """Count a refusal said as ``line`` (the pool's own: a rank it turns away)."""
        with self._lock:
            if line in self._refused or len(self._refused) < REASONS_KEPT:
                self._refused[line] += 1
            else:
                self._refused["refused connections for other reasons too"] += 1

    # ------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            while self._open:
                self._round()
        finally:
            self._shut()

    def _round(self) -> None:
        """Wait for a socket or the next deadline; take every connection a step on."""
        assert self._selector is not None
        wait = None if not self._deadlines else self._deadlines[0][0] - time.monotonic()
        for key, _ in self._selector.select(None if wait is None else max(0.0, wait)):
            if key.data is _ACCEPT:
                self._accept_some()
            elif key.data is _WAKE:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif self._pending.get(key.fd) is key.data:
                self._advance(key.data)
        self._expire(time.monotonic())

    def _shut(self) -> None:
        """The listener closed: every handshake in flight ends, and the descriptors go."""
        for p in list(self._pending.values()):
            p.close()
        self._pending.clear()
        self._unproven.clear()
        self._deadlines.clear()
        if self._selector is not None:
            self._selector.close()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except (OSError, ValueError) as exc:
                if not self._open or self.sock.fileno() < 0:
                    return  # the listener was closed
                self.refuse((), f"accepting failed ({exc}); still listening")
                threading.Event().wait(0.05)  # EMFILE and the like: let it pass
                return
            self._begin(sock, peer)

    def _begin(self, sock: socket.socket, peer) -> None:
        """A new connection: room made for it, then its first step (the greeting)."""
        if self._unproven_count >= MAX_PENDING:
            self._make_room()
        try:
            p = _Peer(sock, peer, self.token, self.tls if sock.family != socket.AF_UNIX else None)
        except OSError as exc:  # (gone already)
            sock.close()
            self.refuse(peer, _why(exc))
            return
        self._pending[p.fd] = p
        self._unproven.setdefault(p.source, OrderedDict())[p.fd] = p
        self._unproven_count += 1
        self._accepted += 1
        heapq.heappush(self._deadlines, (p.deadline, self._accepted, p))
        self._advance(p)

    def _make_room(self) -> None:
        """Close the oldest connection not yet proven of the address that holds the most."""
        crowd = max(self._unproven.values(), key=len)
        oldest = next(iter(crowd.values()))
        self._drop(
            oldest,
            f"closed in its handshake to make room ({MAX_PENDING} connections had not "
            "proven the token yet; the oldest of the address holding the most goes)",
        )

    def _advance(self, p: _Peer) -> None:
        """Take ``p`` as far as its bytes allow: refused, handed over, or waiting."""
        try:
            if p.conn is None:
                wants = p.hs.step()
                if wants:
                    self._wait_for(p, wants)
                    return
                p.conn = p.hs.channel
                self._proven(p)
            raw = p.conn.recv_ready(HELLO_LIMIT)
            if raw is None:
                self._wait_for(p, selectors.EVENT_READ)
                return
            hello = P.loads(raw)
        except Exception as exc:  # anything a peer can make happen ends only this peer
            self._drop(p, _why(exc))
            return
        self._forget(p)
        try:
            self.on_peer(p.conn, hello, raw)
        except Exception as exc:  # (the pool's or relay's: it must not end the listener)
            p.conn.close()
            self.refuse(p.peer, _why(exc))

    def _wait_for(self, p: _Peer, events: int) -> None:
        assert self._selector is not None
        if not p.events:
            self._selector.register(p.fd, events, p)
        elif p.events != events:
            self._selector.modify(p.fd, events, p)
        p.events = events

    def _expire(self, now: float) -> None:
        """Refuse the connections whose deadline passed (stale heap entries are skipped)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, p = heapq.heappop(self._deadlines)
            if self._pending.get(p.fd) is not p:
                continue  # done or refused already
            if p.conn is None:
                self._drop(p, "it did not finish the handshake in time")
            else:
                self._drop(p, f"it did not say hello within {p.timeout:g} s")
        if len(self._deadlines) > 2 * len(self._pending) + 64:  # (mostly stale: kept small)
            self._deadlines = [e for e in self._deadlines if self._pending.get(e[2].fd) is e[2]]
            heapq.heapify(self._deadlines)

    def _proven(self, p: _Peer) -> None:
        """``p`` proved the token: out of the count of those that have not."""
        crowd = self._unproven.get(p.source)
        if crowd is not None and crowd.pop(p.fd, None) is not None:
            self._unproven_count -= 1
            if not crowd:
                del self._unproven[p.source]

    def _forget(self, p: _Peer) -> None:
        """``p`` is no longer in its handshake (handed over or refused)."""
        self._proven(p)
        self._pending.pop(p.fd, None)
        if p.events and self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(p.fd)
        p.events = 0

    def _drop(self, p: _Peer, why: str) -> None:
        self._forget(p)
        p.close()
        self.refuse(p.peer, why)
