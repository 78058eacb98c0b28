"""Accept connections and have each peer prove it holds the pool's token.

One implementation for the notebook's listener and for a host relay's. Every
peer is heard by one of a few threads (at most AUTH_THREADS handshakes in flight,
threads reused; at most WAITING more accepted and waiting for a thread, the
rest refused at once), so a slow or silent peer never holds up the others. The
whole handshake, the peer's first message included, must end within
HANDSHAKE_TIMEOUT seconds however the peer paces its bytes, and nothing it sends
is decoded before it proved it holds the token (:mod:`nbddp.handshake`). A peer
that fails is refused: the refusals are counted by reason and said in one folded
line each (:meth:`Listener.refusals`), however many there were.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from . import handshake, wire
from . import protocol as P
from .tls import Tls

__all__ = ["Listener", "bind_tcp", "bind_unix"]

HELLO_LIMIT = 1 << 16  # the first message after the handshake, at most
HANDSHAKE_TIMEOUT = handshake.HANDSHAKE_TIMEOUT  # s for the whole handshake and the first message
WAITING = 4096  # peers accepted and waiting for an authenticating thread, at most
REASONS_KEPT = 32  # distinct refusal reasons remembered between two reports
AUTH_THREADS = 32  # handshakes in flight at most; the threads are kept while there is work
IDLE_EXIT = 2.0  # seconds an authenticating thread waits for more work before it ends


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


class Listener:
    """Accepts on ``sock``; each authenticated peer goes to ``on_peer(channel, hello, raw)``.
    ``tls``: TCP peers speak TLS with this certificate (``%ddp attach --tls``)."""

    def __init__(
        self,
        sock: socket.socket,
        token: bytes,
        on_peer: Callable[[wire.Channel, object, bytes], None],
        *,
        name: str = "nbddp",
        threads: int = AUTH_THREADS,
        tls: Tls | None = None,
    ) -> None:
        self.sock, self.token, self.on_peer, self.name = sock, token, on_peer, name
        self.tls = tls
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._open = True
        self._peers: queue.SimpleQueue = queue.SimpleQueue()  # accepted, not yet heard
        self._idle = 0  # authenticating threads waiting for a peer
        self._queued = 0  # peers accepted and not yet taken by a thread
        self._threads = 0
        self._most = threads  # 0: each peer heard in the accepting thread, one by one

    def start(self) -> Listener:
        threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True).start()
        return self

    @property
    def open(self) -> bool:
        return self._open

    def close(self) -> None:
        """Stop accepting (the refusals stay readable)."""
        self._open = False
        with contextlib.suppress(OSError):
            self.sock.close()

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

    def _accept_loop(self) -> None:
        while self._open:
            try:
                if not wire.ready(self.sock, 0.5):
                    continue
                sock, peer = self.sock.accept()
            except (InterruptedError, BlockingIOError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if not self._open or exc.errno is None or self.sock.fileno() < 0:
                    return  # the listener was closed
                self.refuse((), f"accepting failed ({exc}); still listening")
                threading.Event().wait(0.05)  # EMFILE and the like: let it pass
                continue
            except ValueError:  # the listener was closed
                return
            self._hand_over(sock, peer)

    def _hand_over(self, sock: socket.socket, peer) -> None:
        """To an authenticating thread: an idle one, else a new one (up to AUTH_THREADS;
        beyond, the peer waits its turn). Threads are reused: at a thousand ranks
        attaching at once, a thread per connection cost a third more time to attach."""
        if not self._most:
            self._authenticate(sock, peer)
            return
        with self._lock:
            if self._queued >= WAITING:
                full = True
            else:
                full = False
                self._queued += 1
                self._peers.put((sock, peer))
        if full:
            sock.close()
            self.refuse(peer, f"{WAITING} connections were waiting for their handshake")
            return
        with self._lock:
            if self._queued <= self._idle or self._threads >= self._most:
                return  # an idle thread takes it (or the peer waits its turn)
            self._threads += 1
        threading.Thread(target=self._auth_loop, name=f"{self.name}-auth", daemon=True).start()

    def _auth_loop(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                sock, peer = self._peers.get(timeout=IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    self._threads -= 1
                return
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            self._authenticate(sock, peer)

    def _authenticate(self, sock: socket.socket, peer) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        try:
            tls = self.tls if sock.family != socket.AF_UNIX else None
            conn = handshake.server_handshake(sock, self.token, HANDSHAKE_TIMEOUT, tls)
        except Exception as exc:  # anything a peer can make happen ends only this peer
            sock.close()
            self.refuse(peer, _why(exc))
            return
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise handshake.HandshakeError("it did not finish the handshake in time")
            raw = conn.recv_bytes(HELLO_LIMIT, timeout=left)
            hello = P.loads(raw)
        except TimeoutError:
            conn.close()
            self.refuse(peer, f"it did not say hello within {HANDSHAKE_TIMEOUT:g} s")
            return
        except Exception as exc:
            conn.close()
            self.refuse(peer, _why(exc))
            return
        self.on_peer(conn, hello, raw)
