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
(:mod:`nbddp.wire`), with keys derived from the token and both nonces.
``multiprocessing.connection``'s challenge (HMAC-MD5 on Python 3.11) is not used.
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

from .wire import TAG, Channel, ready

if TYPE_CHECKING:
    from .tls import Tls

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "HandshakeError",
    "Refused",
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
    mode = b"p" if sock.family == socket.AF_UNIX else b"t" if tls else b"m"
    nonce_s = secrets.token_bytes(NONCE)
    sock.setblocking(False)
    _send_all(sock, MAGIC + mode + nonce_s, deadline)
    if tls:  # (the TLS socket takes the socket over: it is the one to close on failure)
        sock = tls.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            return _server_proof(_wrap(sock, deadline), token, mode, nonce_s, deadline)
        except BaseException:
            sock.close()
            raise
    return _server_proof(sock, token, mode, nonce_s, deadline)


def _server_proof(sock, token: bytes, mode: bytes, nonce_s: bytes, deadline: float) -> Channel:
    answer = _recv_exact(sock, NONCE + TAG, deadline)
    nonce_c, proof = answer[:NONCE], answer[NONCE:]
    transcript = MAGIC + mode + nonce_s + nonce_c
    if not hmac.compare_digest(proof, _mac(token, b"client", transcript)):
        with contextlib.suppress(OSError, HandshakeError):
            _send_all(sock, REFUSED, deadline)
        raise HandshakeError("it did not prove it holds the token (a wrong token?)")
    _send_all(sock, OK + _mac(token, b"server", transcript), deadline)
    return Channel(sock, MODES[mode], _keys(token, transcript, server=True))


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
    while True:
        try:
            sock.do_handshake()
            return sock
        except ssl.SSLWantReadError:
            _wait(sock, deadline, read=True)
        except ssl.SSLWantWriteError:
            _wait(sock, deadline, read=False)
        except ssl.SSLError as exc:
            raise HandshakeError(f"TLS: {exc.reason or exc}") from None


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
