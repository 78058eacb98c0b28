"""Authenticated frames: what every nbddp connection carries after its handshake.

One implementation for the notebook, the ranks, the host relays and detached
pools (:mod:`nbddp.wire.handshake` makes a :class:`Channel` once the peer proved it
holds the token). On TCP nothing is decoded before its frame's MAC was checked.

Frames: ``seq`` (u64) and ``length`` (u64), then the payload. On TCP without
TLS ("mac" mode) the payload is followed by a 32-byte HMAC-SHA256 of header and
payload, with a key of that direction derived from the token and both nonces of
the handshake. A frame whose MAC is wrong (changed, injected) or whose sequence
number is not the next one (replayed, reordered) closes the connection with
:class:`FrameError`, and nothing of it is decoded. A frame of up to SMALL
(64 KiB) bytes is read whole, then checked: no more than that is ever held
unchecked. A bigger frame's header carries a 16-byte MAC of its own, checked
before anything is allocated for the payload, so only a peer that holds the key
can make the reader allocate, and then at most :data:`MAX_FRAME` bytes; its
payload is hashed piece by piece as it is sent and as it arrives.

Unix sockets skip the MACs ("plain" mode): they live in folders of mode 0700,
so only the user's own processes can reach them, and those could read the
token anyway. TLS ("tls" mode) skips them too: TLS authenticates each record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import select
import socket
import ssl
import struct
import threading
import time

__all__ = ["HEADER", "HEADER_TAG", "MAX_FRAME", "STALL", "TAG", "Channel", "FrameError"]

HEADER = struct.Struct("!QQ")  # sequence number, payload length
HEADER_TAG = 16  # bytes of the header's MAC kept
TAG = 32
MAX_FRAME = int(os.environ.get("NBDDP_MAX_FRAME", 1 << 34))  # 16 GiB: any one message
STALL = 30.0  # s a frame that began may go without a byte before the connection is given up
SMALL = 1 << 16  # frames up to this size go out in one write
PIECE = 1 << 20  # a big frame is hashed and sent in pieces of this size


class FrameError(ConnectionError):
    """A frame failed its check: the connection is closed, the reason says why."""


# ---------------------------------------------------------------- frames

try:  # OpenSSL's HMAC object itself: copy, update and digest without Python's wrapper
    from _hashlib import hmac_new as _hmac_new

    def _hmac_sha256(key: bytes):
        return _hmac_new(key, digestmod="sha256")

except ImportError:  # pragma: no cover - a Python without OpenSSL's hashlib

    def _hmac_sha256(key: bytes):
        return hmac.new(key, digestmod=hashlib.sha256)


def ready(fd, timeout: float | None, write: bool = False) -> bool:
    """Whether ``fd`` (or a socket) can be read (written) within ``timeout`` s (None: no
    limit). ``poll``, not ``select``: select fails for a descriptor numbered 1024 or more,
    which a notebook with hundreds of ranks (three connections each) reaches."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))


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
        self._partial = bytearray()  # what came of a frame read by recv_ready
        self._send_lock = threading.Lock()
        self._tls_lock = threading.Lock() if mode == "tls" else None
        self.closed = False
        self.fd = sock.fileno()
        # a plain or MAC'd socket blocks (a wait for the next frame is one recv; a bounded
        # wait tries MSG_DONTWAIT first); a TLS one does not (reads and writes share it)
        sock.setblocking(mode != "tls")
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
        return ready(self.fd, timeout)

    # -- sending

    def send_bytes(self, data) -> None:
        data = memoryview(data).cast("B")
        with self._send_lock:
            header = HEADER.pack(self._sent, len(data))
            trailer = b""
            if self._out_mac is not None:
                tag = self._out_mac.copy()  # (the keyed state, made once)
                tag.update(header)
                if len(data) <= SMALL:  # one MAC: the reader holds at most SMALL unchecked
                    tag.update(data)
                    trailer = tag.digest()
                else:  # the header's own MAC first: nothing is allocated for a forged one
                    header += tag.copy().digest()[:HEADER_TAG]
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
        if self._tls_lock is None:
            self.sock.sendall(data)
            return
        view = memoryview(data)
        while view:
            try:
                if self._tls_lock is None:
                    n = self.sock.send(view)
                else:
                    with self._tls_lock:
                        n = self.sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                ready(self.fd, STALL, write=True)
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
        head = self._read_exact(HEADER.size, deadline, ready)
        seq, length = HEADER.unpack_from(head)
        if mac is None:
            self._check(seq, length, limit)
            data = self._read_exact(length, deadline, True, midframe=True)
        elif length > SMALL:  # the header's MAC, then the payload hashed as it comes
            tag = mac.copy()
            tag.update(head)
            head_tag = self._read_exact(HEADER_TAG, deadline, True, midframe=True)
            if not hmac.compare_digest(tag.copy().digest()[:HEADER_TAG], head_tag):
                raise self._fail("a frame failed its MAC check (changed or injected on the way)")
            self._check(seq, length, limit)
            data = self._read_exact(length, deadline, True, midframe=True, hash_to=tag)
            if not hmac.compare_digest(tag.digest(), self._read_exact(TAG, deadline, True, True)):
                raise self._fail("a frame failed its MAC check (changed on the way)")
        else:  # the payload and its MAC in one read (at most SMALL bytes before the check)
            both = self._read_exact(length + TAG, deadline, True, midframe=True)
            tag = mac.copy()
            tag.update(head)
            with memoryview(both) as view:
                tag.update(view[:length])
                if not hmac.compare_digest(tag.digest(), view[length:]):
                    raise self._fail(
                        "a frame failed its MAC check (changed or injected on the way)"
                    )
            self._check(seq, length, limit)
            if type(both) is bytes:
                data = both[:length]
            else:
                del both[length:]  # (a bytearray: cut in place, not copied)
                data = both
        self._read += 1
        return bytes(data) if length <= 1 << 20 and type(data) is not bytes else data

    def recv_ready(self, limit: int) -> bytes | None:
        """The next frame's payload once all of it came, read without ever waiting: None
        while it has not (call again when the socket is readable; what came is kept).

        For the listener, which reads each new peer's first message among many peers in
        one thread. The checks of :meth:`recv_bytes`, in its order: a frame over ``limit``
        (at most SMALL) is refused on its header, a bad MAC or number once it is whole.
        """
        assert limit <= SMALL, "a first message is small: read whole, then checked"
        buf = self._partial
        while need := self._needs(buf, limit):
            try:
                if self._tls_lock is None:
                    got = self.sock.recv(need, socket.MSG_DONTWAIT)
                else:
                    with self._tls_lock:
                        got = self.sock.recv(need)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return None
            if not got:
                if buf:
                    raise self._fail("the connection ended in the middle of a frame")
                raise EOFError
            buf += got
        self._partial = bytearray()
        seq, length = HEADER.unpack_from(buf)
        payload = bytes(buf[HEADER.size : HEADER.size + length])
        if self._in_mac is not None:
            tag = self._in_mac.copy()
            tag.update(buf[: HEADER.size + length])
            if not hmac.compare_digest(tag.digest(), bytes(buf[HEADER.size + length :])):
                raise self._fail("a frame failed its MAC check (changed or injected on the way)")
            self._check(seq, length, limit)
        self._read += 1
        return payload

    def _needs(self, buf: bytearray, limit: int) -> int:
        """How many more bytes the frame that begins with ``buf`` needs before its check."""
        if len(buf) < HEADER.size:
            return HEADER.size - len(buf)
        seq, length = HEADER.unpack_from(buf)
        if self._in_mac is None:  # no MAC: the header is checked as it is
            self._check(seq, length, limit)
        elif length > SMALL:  # the header's own MAC, then the limit (never held: > SMALL)
            if len(buf) < HEADER.size + HEADER_TAG:
                return HEADER.size + HEADER_TAG - len(buf)
            tag = self._in_mac.copy()
            tag.update(buf[: HEADER.size])
            if not hmac.compare_digest(tag.digest()[:HEADER_TAG], bytes(buf[HEADER.size :])):
                raise self._fail("a frame failed its MAC check (changed or injected on the way)")
            self._check(seq, length, limit)
        else:  # read whole (at most SMALL unchecked), then checked
            return HEADER.size + length + TAG - len(buf)
        return HEADER.size + length - len(buf)

    def _check(self, seq: int, length: int, limit: int) -> None:
        """The frame is the next one, and not over the limit (its header authenticated)."""
        if seq != self._read:
            raise self._fail(
                f"a frame came out of order (number {seq}, expected {self._read}: "
                "replayed or reordered on the way)"
            )
        if length > limit:
            raise self._fail(f"a frame of {length:,} bytes is over the limit of {limit:,}")

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
        tls = self._tls_lock is not None
        unbounded = deadline is None and not bounded and not midframe
        if not tls and n <= SMALL:  # most frames: one read, no copy
            try:
                first = self.sock.recv(n, 0 if unbounded else socket.MSG_DONTWAIT)
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
                if tls:
                    with self._tls_lock:
                        k = self.sock.recv_into(view[got:], n - got)
                elif unbounded and not got:
                    k = self.sock.recv_into(view[got:], n - got)
                else:
                    k = self.sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
                else:
                    left = STALL if bounded or got or midframe else None
                if not ready(self.fd, left):
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
