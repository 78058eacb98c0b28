"""Accept connections and have each peer prove it holds the pool's token.

One implementation for the notebook's listener and for a host relay's. Every
peer is handled in a thread of its own, so a slow or silent peer never holds
up the others, and nothing it sends is unpickled before the HMAC challenge
succeeds. A peer that fails is refused: the refusals are counted by reason
and said in one folded line each (:meth:`Listener.refusals`), however
many there were.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from . import protocol as P

__all__ = ["Listener", "bind_tcp", "bind_unix"]

HELLO_LIMIT = 1 << 16  # the first message after the handshake, at most
READ_TIMEOUT = 5  # seconds each read of the handshake may take
REASONS_KEPT = 32  # distinct refusal reasons remembered between two reports


def bind_unix(path: str, backlog: int = 256) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(backlog)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), backlog=1024)


def _set_read_timeout(conn: Connection, seconds: int) -> None:
    s = socket.socket(fileno=os.dup(conn.fileno()))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))
    s.close()


def _why(exc: BaseException) -> str:
    """A refusal's reason in words; a class this version lacks is another nbddp version."""
    if isinstance(exc, (AttributeError, ModuleNotFoundError, ImportError)):
        return (
            f"its first message names something this nbddp (protocol {P.PROTOCOL_VERSION}) "
            f"lacks ({type(exc).__name__}: {exc}): another nbddp version?"
        )
    return f"{type(exc).__name__}: {exc}"


class Listener:
    """Accepts on ``sock``; each authenticated peer goes to ``on_peer(conn, hello, raw)``."""

    def __init__(
        self,
        sock: socket.socket,
        token: bytes,
        on_peer: Callable[[Connection, object, bytes], None],
        *,
        name: str = "nbddp",
    ) -> None:
        self.sock, self.token, self.on_peer, self.name = sock, token, on_peer, name
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._open = True

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
                ready, _, _ = select.select([self.sock], [], [], 0.5)
                if not ready:
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
            threading.Thread(
                target=self._authenticate, args=(sock, peer), name=f"{self.name}-auth", daemon=True
            ).start()

    def _authenticate(self, sock: socket.socket, peer) -> None:
        try:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", READ_TIMEOUT, 0)
            )
            if sock.family != socket.AF_UNIX:  # frames go out without Nagle's delay
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock.detach())
        except OSError as exc:
            sock.close()
            self.refuse(peer, _why(exc))
            return
        try:
            deliver_challenge(conn, self.token)
            answer_challenge(conn, self.token)
            raw = conn.recv_bytes(HELLO_LIMIT)
            hello = P.loads(raw)
            _set_read_timeout(conn, 0)
        except Exception as exc:  # anything a peer can make happen ends only this peer
            conn.close()
            self.refuse(peer, _why(exc))
            return
        self.on_peer(conn, hello, raw)
