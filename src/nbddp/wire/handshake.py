"""The handshake of every nbddp connection: both sides prove the token (SHA-256).

The listening side is the *server*::

    S -> C   MAGIC, mode, nonce_s                     (in the clear)
             mode "tls": both sides wrap the socket in TLS here; the client
             pins the certificate's SHA-256 from its token file
    C -> S   nonce_c, HMAC(token, "client" | transcript)
    S -> C   OK, HMAC(token, "server" | transcript)   (or REFUSED, and it closes)

Both sides prove the token and neither reveals it; both nonces are fresh, so
a recorded handshake cannot be replayed. The client decides the mode it
accepts from its own knowledge (a TCP address must be "mac" or "tls"; a token
file that pins a certificate must be "tls"), so a changed mode byte can only
make the handshake fail, never downgrade it. What follows are frames
(:mod:`nbddp.wire.frames`), with keys derived from the token and both nonces.
``multiprocessing.connection``'s challenge (HMAC-MD5 on Python 3.11) is not used.

The server's side is :class:`ServerHandshake`, steps that never block: the
listener (:mod:`nbddp.wire.listener`) runs every pending handshake from one selector,
and :func:`server_handshake` runs one, waiting between steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import ssl
import time
from typing import TYPE_CHECKING

from .frames import TAG, Channel, ready

if TYPE_CHECKING:
    from .tls import Tls

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "HandshakeError",
    "Refused",
    "ServerHandshake",
    "client_handshake",
    "connect",
    "server_handshake",
]

MAGIC = b"nbddp-w1"
MODES = {b"p": "plain", b"m": "mac", b"t": "tls"}
NONCE = 32
OK, REFUSED = b"\x01", b"\x00"


class HandshakeError(ConnectionError):
    """The peer did not complete the handshake (wrong token, another protocol, too slow)."""


class Refused(HandshakeError):
    """The server refused this client's token."""


# ---------------------------------------------------------------- the handshake


def server_handshake(
    sock: socket.socket, token: bytes, timeout: float, tls: Tls | None = None
) -> Channel:
    """Authenticate the peer that connected on ``sock``; the whole handshake takes at most
    ``timeout`` seconds, however the peer paces its bytes. Raises HandshakeError."""
    deadline = time.monotonic() + timeout
    hs = ServerHandshake(sock, token, tls)
    try:
        while wants := hs.step():
            _wait(hs.sock, deadline, read=wants == READ)
        assert hs.channel is not None
        return hs.channel
    except BaseException:
        if hs.sock is not sock:  # the TLS socket took the socket over: the one to close
            hs.sock.close()
        raise


READ, WRITE = 1, 2  # what a step waits for (selectors.EVENT_READ, EVENT_WRITE)


class ServerHandshake:
    """The listening side's handshake, one step at a time, never blocking: the listener
    drives hundreds of them from one selector (:meth:`step` when the socket is ready),
    so a peer that is silent or slow holds nothing but its own socket. :attr:`sock` is
    the socket to wait on (once TLS wrapped it, the TLS socket)."""

    def __init__(self, sock: socket.socket, token: bytes, tls: Tls | None = None) -> None:
        self.sock, self.token, self.tls = sock, token, tls
        self.mode = b"p" if sock.family == socket.AF_UNIX else b"t" if tls else b"m"
        self.nonce_s = secrets.token_bytes(NONCE)
        self.channel: Channel | None = None  # once both sides proved the token
        self._out = memoryview(MAGIC + self.mode + self.nonce_s)
        self._in = bytearray()
        self._stage = "greet"
        sock.setblocking(False)

    def step(self) -> int:
        """Go on as far as the socket allows without waiting: READ or WRITE (what it waits
        for), or 0 once done (:attr:`channel`). HandshakeError if the peer failed it."""
        while self.channel is None:
            wants = self._flush() or self._next()
            if wants:
                return wants
        return 0

    def _next(self) -> int:
        """The stage after what was sent: 0 when there is more to do at once."""
        if self._stage == "greet":
            self._stage = "tls" if self.tls else "answer"
            if self.tls:
                self.sock = self.tls.context.wrap_socket(
                    self.sock, server_side=True, do_handshake_on_connect=False
                )
        elif self._stage == "tls":
            wants = _tls_step(self.sock)
            if wants:
                return wants
            self._stage = "answer"
        elif self._stage == "answer":
            return self._answer()
        else:  # our proof went out: done
            keys = _keys(self.token, self._transcript(), server=True)
            self.channel = Channel(self.sock, MODES[self.mode], keys)
        return 0

    def _answer(self) -> int:
        """Read the peer's nonce and proof; check it, then say OK with ours (or REFUSED)."""
        need = NONCE + TAG - len(self._in)
        if need:
            got = _recv_some(self.sock, need)
            if got is None:
                return READ
            self._in += got
            return 0
        transcript = self._transcript()
        proof = bytes(self._in[NONCE:])
        if not hmac.compare_digest(proof, _mac(self.token, b"client", transcript)):
            with contextlib.suppress(OSError, ssl.SSLError):
                self.sock.send(REFUSED)  # (best effort: a refused peer is not waited for)
            raise HandshakeError("it did not prove it holds the token (a wrong token?)")
        self._out = memoryview(OK + _mac(self.token, b"server", transcript))
        self._stage = "ok"
        return 0

    def _transcript(self) -> bytes:
        return MAGIC + self.mode + self.nonce_s + bytes(self._in[:NONCE])

    def _flush(self) -> int:
        """Send what is due: 0 once all of it went, else what the socket waits for."""
        while self._out:
            try:
                self._out = self._out[self.sock.send(self._out) :]
            except (BlockingIOError, ssl.SSLWantWriteError):
                return WRITE
            except ssl.SSLWantReadError:
                return READ
            except ssl.SSLError as exc:
                raise HandshakeError(f"TLS: {exc.reason or exc}") from None
        return 0


def _tls_step(sock: ssl.SSLSocket) -> int:
    """One go at TLS's own handshake: 0 once done, else what it waits for."""
    try:
        sock.do_handshake()
        return 0
    except ssl.SSLWantReadError:
        return READ
    except ssl.SSLWantWriteError:
        return WRITE
    except ssl.SSLError as exc:
        raise HandshakeError(f"TLS: {exc.reason or exc}") from None


def _recv_some(sock: socket.socket, n: int) -> bytes | None:
    """Up to ``n`` bytes that came (None: none yet); HandshakeError at the connection's end."""
    try:
        got = sock.recv(n)
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return None
    except ssl.SSLError as exc:
        raise HandshakeError(f"TLS: {exc.reason or exc}") from None
    if not got:
        raise HandshakeError("it closed the connection during the handshake")
    return got


def client_handshake(
    sock: socket.socket, token: bytes, timeout: float, tls: Tls | None = None
) -> Channel:
    """Authenticate to the server on ``sock`` and make it prove the token too."""
    deadline = time.monotonic() + timeout
    sock.setblocking(False)
    head = _recv_exact(sock, len(MAGIC) + 1 + NONCE, deadline)
    if head[: len(MAGIC)] != MAGIC:
        raise HandshakeError("the peer does not speak this nbddp's protocol")
    mode, nonce_s = head[len(MAGIC) : len(MAGIC) + 1], head[len(MAGIC) + 1 :]
    expected = b"t" if tls else b"p" if sock.family == socket.AF_UNIX else b"m"
    if mode != expected:
        raise HandshakeError(_mode_mismatch(mode, expected))
    if not tls:
        return _client_proof(sock, token, mode, nonce_s, deadline)
    sock = tls.context.wrap_socket(sock, do_handshake_on_connect=False)
    try:  # (the TLS socket took the socket over: it is the one to close on failure)
        _wrap(sock, deadline)
        seen = hashlib.sha256(sock.getpeercert(binary_form=True) or b"").hexdigest()
        if not hmac.compare_digest(seen, tls.pin):
            raise HandshakeError(
                f"the notebook's certificate (sha256 {seen[:16]}...) is not the one the token "
                f"file pins ({tls.pin[:16]}...): not the notebook, or a token file of another pool"
            )
        return _client_proof(sock, token, mode, nonce_s, deadline)
    except BaseException:
        sock.close()
        raise


def _mode_mismatch(mode: bytes, expected: bytes) -> str:
    if mode == b"t" and expected == b"m":
        return (
            "the notebook uses TLS (attach --tls) but this token file pins no certificate: "
            "a token file read before that attach?"
        )
    if mode == b"m" and expected == b"t":
        return (
            "the notebook does not use TLS but this token file pins a certificate: "
            "the token file of another pool?"
        )
    return f"the notebook speaks mode {mode!r}, not {MODES.get(expected)}"


def _client_proof(sock, token: bytes, mode: bytes, nonce_s: bytes, deadline: float) -> Channel:
    nonce_c = secrets.token_bytes(NONCE)
    transcript = MAGIC + mode + nonce_s + nonce_c
    _send_all(sock, nonce_c + _mac(token, b"client", transcript), deadline)
    if _recv_exact(sock, 1, deadline) != OK:
        raise Refused("the notebook refused this token")
    proof = _recv_exact(sock, TAG, deadline)
    if not hmac.compare_digest(proof, _mac(token, b"server", transcript)):
        raise HandshakeError("the notebook did not prove it holds the token")
    return Channel(sock, MODES[mode], _keys(token, transcript, server=False))


def _mac(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(key, label + data, hashlib.sha256).digest()


def _keys(token: bytes, transcript: bytes, server: bool) -> tuple[bytes, bytes]:
    """(the key of what this side sends, the key of what it receives)."""
    root = _mac(token, b"keys", transcript)
    up, down = _mac(root, b"up", b""), _mac(root, b"down", b"")  # client -> server, back
    return (down, up) if server else (up, down)


def _wrap(sock: ssl.SSLSocket, deadline: float) -> ssl.SSLSocket:
    """TLS's own handshake, waiting as it must until ``deadline``."""
    while wants := _tls_step(sock):
        _wait(sock, deadline, read=wants == READ)
    return sock


def _wait(sock: socket.socket, deadline: float | None, read: bool) -> None:
    """Wait until ``sock`` can be read (written); HandshakeError past ``deadline``."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise HandshakeError("it did not finish the handshake in time")
    if not ready(sock, left, write=not read):
        raise HandshakeError("it did not finish the handshake in time")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except (BlockingIOError, ssl.SSLWantReadError):
            _wait(sock, deadline, read=True)
            continue
        if not k:
            raise HandshakeError("it closed the connection during the handshake")
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except (BlockingIOError, ssl.SSLWantWriteError):
            _wait(sock, deadline, read=False)


# ---------------------------------------------------------------- connecting

HANDSHAKE_TIMEOUT = 5.0  # s the whole handshake may take, on either side


def connect(
    address, family: str, token: bytes, *, timeout: float = 60.0, tls: Tls | None = None
) -> Channel:
    """Connect to ``address`` (a path for AF_UNIX, ``(host, port)`` for AF_INET) and
    authenticate, retrying while nothing listens there yet, for up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX if family == "AF_UNIX" else socket.AF_INET)
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect(address)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        except BaseException:
            sock.close()
            raise
    try:
        return client_handshake(sock, token, HANDSHAKE_TIMEOUT, tls)
    except BaseException:
        sock.close()
        raise
