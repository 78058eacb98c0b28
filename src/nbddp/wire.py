"""Every nbddp connection: a SHA-256 handshake, then authenticated frames.

One implementation for the notebook, the ranks, the host relays and detached
pools. Nothing a peer sends is decoded before it proved it holds the token, and
on TCP nothing after that is decoded before its frame's MAC was checked.

The handshake (the listening side is the *server*)::

    S -> C   MAGIC, mode, nonce_s                     (in the clear)
             mode "tls": both sides wrap the socket in TLS here; the client
             pins the certificate's SHA-256 from its token file
    C -> S   nonce_c, HMAC(token, "client" | transcript)
    S -> C   OK, HMAC(token, "server" | transcript)   (or REFUSED, and it closes)

Both sides prove the token and neither reveals it; both nonces are fresh, so
a recorded handshake cannot be replayed. The client decides the mode it
accepts from its own knowledge (a TCP address must be "mac" or "tls"; a token
file that pins a certificate must be "tls"), so a changed mode byte can only
make the handshake fail, never downgrade it.

Frames: ``seq`` (u64) and ``length`` (u64), then the payload. On TCP without
TLS ("mac" mode) the header is followed by a 16-byte MAC of the header and the
payload by a 32-byte MAC of header and payload, each HMAC-SHA256 with a key of
that direction derived from the token and both nonces. A frame whose MAC is
wrong (changed, injected) or whose sequence number is not the next one
(replayed, reordered) closes the connection with :class:`FrameError`, before
its payload is read further or decoded. The header's own MAC is checked before
anything is allocated for the payload, so only a peer that holds the key can
make the reader allocate, and then at most :data:`MAX_FRAME` bytes.

Unix sockets skip the MACs ("plain" mode): they live in folders of mode 0700,
so only the user's own processes can reach them, and those could read the
token anyway. TLS ("tls" mode) skips them too: TLS authenticates each record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time

__all__ = [
    "MAX_FRAME",
    "Channel",
    "FrameError",
    "HandshakeError",
    "Refused",
    "Tls",
    "client_handshake",
    "connect",
    "server_handshake",
]

MAGIC = b"nbddp-w1"
MODES = {b"p": "plain", b"m": "mac", b"t": "tls"}
NONCE = 32
OK, REFUSED = b"\x01", b"\x00"
HEADER = struct.Struct("!QQ")  # sequence number, payload length
HEADER_TAG = 16  # bytes of the header's MAC kept
TAG = 32
MAX_FRAME = int(os.environ.get("NBDDP_MAX_FRAME", 1 << 34))  # 16 GiB: any one message
STALL = 30.0  # s a frame that began may go without a byte before the connection is given up
SMALL = 1 << 16  # frames up to this size go out in one write
PIECE = 1 << 20  # a big frame is hashed and sent in pieces of this size


class HandshakeError(ConnectionError):
    """The peer did not complete the handshake (wrong token, another protocol, too slow)."""


class Refused(HandshakeError):
    """The server refused this client's token."""


class FrameError(ConnectionError):
    """A frame failed its check: the connection is closed, the reason says why."""


class Tls:
    """What TLS needs on one side: the server's certificate and key (PEM), or the client's
    pinned SHA-256 of the server's certificate (hex)."""

    def __init__(self, *, cert: bytes = b"", key: bytes = b"", pin: str = "") -> None:
        self.pin = pin.lower()
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if cert else ssl.PROTOCOL_TLS_CLIENT)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert:
            _load_pem(self.context, cert, key)
        else:  # trust is the pin, checked after the handshake; no CA, no host name
            self.context.check_hostname = False
            self.context.verify_mode = ssl.CERT_NONE


def _load_pem(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl loads certificates only from files: a private folder, removed at once."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nbddp-tls-") as folder:  # mode 0700
        paths = []
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        context.load_cert_chain(*paths)


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
    r, w, _ = select.select([sock] if read else [], [] if read else [sock], [], left)
    if not r and not w:
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


# ---------------------------------------------------------------- frames

try:  # OpenSSL's HMAC object itself: copy, update and digest without Python's wrapper
    from _hashlib import hmac_new as _hmac_new

    def _hmac_sha256(key: bytes):
        return _hmac_new(key, digestmod="sha256")

except ImportError:  # pragma: no cover - a Python without OpenSSL's hashlib

    def _hmac_sha256(key: bytes):
        return hmac.new(key, digestmod=hashlib.sha256)


class Channel:
    """An authenticated connection: whole frames in and out (``send_bytes`` from any thread,
    ``recv_bytes`` from one). EOFError at the peer's end, FrameError for a bad frame."""

    def __init__(self, sock: socket.socket, mode: str, keys: tuple[bytes, bytes]) -> None:
        self.sock, self.mode = sock, mode
        self._out_key = keys[0] if mode == "mac" else b""  # (tests forge frames with it)
        self._out_mac = self._in_mac = None  # keyed HMAC states, copied for each frame
        if mode == "mac":
            self._out_mac, self._in_mac = (_hmac_sha256(k) for k in keys)
        self._sent = self._read = 0  # sequence numbers
        self._send_lock = threading.Lock()
        self._tls_lock = threading.Lock() if mode == "tls" else None
        self.closed = False
        self.fd = sock.fileno()
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:  # frames go out one by one: no Nagle delays
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    def pending(self) -> bool:
        """Bytes already decrypted and buffered: readable though a select would not say so."""
        return self.mode == "tls" and self.sock.pending() > 0

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self.pending():
            return True
        r, _, _ = select.select([self.fd], [], [], timeout)
        return bool(r)

    # -- sending

    def send_bytes(self, data) -> None:
        data = memoryview(data).cast("B")
        with self._send_lock:
            header = HEADER.pack(self._sent, len(data))
            trailer = b""
            if self._out_mac is not None:
                tag = self._out_mac.copy()  # (the keyed state, made once)
                tag.update(header)
                header += tag.copy().digest()[:HEADER_TAG]
                if len(data) <= SMALL:
                    tag.update(data)
                    trailer = tag.digest()
                else:
                    trailer = None  # (computed as it is sent)
            self._sent += 1
            if len(data) <= SMALL:
                self._write(b"".join((header, data, trailer)))
            elif trailer is not None:
                self._write(header)
                self._write(data)
            else:  # hashed piece by piece as it goes: the peer checks while it reads
                self._write(header)
                for start in range(0, len(data), PIECE):
                    piece = data[start : start + PIECE]
                    tag.update(piece)
                    self._write(piece)
                self._write(tag.digest())

    def _write(self, data) -> None:
        view = memoryview(data)
        while view:
            try:
                if self._tls_lock is None:
                    n = self.sock.send(view)
                else:
                    with self._tls_lock:
                        n = self.sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                select.select([], [self.fd], [], STALL)
                continue
            view = view[n:]

    # -- receiving

    def recv_bytes(
        self, maxlength: int | None = None, *, timeout: float | None = None, ready: bool = False
    ):
        """The next frame's payload (bytes; a bytearray above 1 MiB, not copied again).

        Waits for a frame without limit; ``ready`` (a select said the connection is
        readable): no longer than STALL s for it. Once a frame began, each of its
        bytes must come within STALL s. ``timeout``: the whole frame within that many
        seconds. TimeoutError when a wait runs out; the connection is then closed if a
        frame had begun.
        """
        limit = MAX_FRAME if maxlength is None else maxlength
        deadline = None if timeout is None else time.monotonic() + timeout
        mac = self._in_mac
        head = self._read_exact(HEADER.size + (HEADER_TAG if mac else 0), deadline, ready)
        seq, length = HEADER.unpack_from(head)
        if mac is not None:
            tag = mac.copy()
            tag.update(head[: HEADER.size])
            if not hmac.compare_digest(tag.copy().digest()[:HEADER_TAG], head[HEADER.size :]):
                raise self._fail("a frame failed its MAC check (changed or injected on the way)")
        if seq != self._read:
            raise self._fail(
                f"a frame came out of order (number {seq}, expected {self._read}: "
                "replayed or reordered on the way)"
            )
        if length > limit:
            raise self._fail(f"a frame of {length:,} bytes is over the limit of {limit:,}")
        if mac is None:
            data = self._read_exact(length, deadline, True, midframe=True)
        elif length > SMALL:  # hashed piece by piece as it comes, then its MAC
            data = self._read_exact(length, deadline, True, midframe=True, hash_to=tag)
            if not hmac.compare_digest(tag.digest(), self._read_exact(TAG, deadline, True, True)):
                raise self._fail("a frame failed its MAC check (changed on the way)")
        else:  # the payload and its MAC in one read
            both = self._read_exact(length + TAG, deadline, True, midframe=True)
            with memoryview(both) as view:
                tag.update(view[:length])
                if not hmac.compare_digest(tag.digest(), view[length:]):
                    raise self._fail("a frame failed its MAC check (changed on the way)")
            if type(both) is bytes:
                data = both[:length]
            else:
                del both[length:]  # (a bytearray: cut in place, not copied)
                data = both
        self._read += 1
        return bytes(data) if length <= 1 << 20 and type(data) is not bytes else data

    def _fail(self, why: str) -> FrameError:
        self.close()
        return FrameError(why)

    def _read_exact(
        self,
        n: int,
        deadline: float | None,
        bounded: bool,
        midframe: bool = False,
        hash_to=None,
    ) -> bytes | bytearray:
        """``n`` bytes; a wait is bounded by ``deadline``, else (``bounded``, or once some
        bytes came) by STALL, else not at all. ``hash_to``: an HMAC that takes each piece as
        it comes (a big frame is checked while it arrives, not after)."""
        if self._tls_lock is None and n <= SMALL:  # most frames: one read, no copy
            try:
                first = self.sock.recv(n)
            except BlockingIOError:
                first = None
            except OSError:
                if self.closed:
                    raise EOFError from None
                raise
            if first is not None:
                if len(first) == n:
                    return first
                if not first:
                    if midframe and n:
                        raise self._fail("the connection ended in the middle of a frame")
                    raise EOFError
        else:
            first = None
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        if first:
            got = len(first)
            view[:got] = first
        while got < n:
            try:
                if self._tls_lock is None:
                    k = self.sock.recv_into(view[got:], n - got)
                else:
                    with self._tls_lock:
                        k = self.sock.recv_into(view[got:], n - got)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
                else:
                    left = STALL if bounded or got else None
                if not select.select([self.fd], [], [], left)[0]:
                    if midframe or got:
                        self.close()
                    raise TimeoutError(f"no byte came for {left:g} s") from None
                continue
            except OSError:
                if self.closed:
                    raise EOFError from None
                raise
            if not k:
                if got or midframe:
                    raise self._fail("the connection ended in the middle of a frame")
                raise EOFError
            if hash_to is not None:
                hash_to.update(view[got : got + k])
            got += k
        view.release()
        return buf


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
