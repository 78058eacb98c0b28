"""nbddp.wire.frames on real sockets, a man in the middle of a real attached rank, token files.

The unit tests drive both ends of the wire on socket pairs, loopback TCP and TLS. The
man-in-the-middle tests put a TCP proxy between a real worker process and the notebook's
pool: it forwards the handshake as it is, then acts on whole frames (changes one, replays
one, injects one) and checks that the connection is closed with the reason said, the cell
ends, and nothing from the bad frame was decoded (its payload would create a file if it
were). The token-file tests check what :mod:`nbddp.wire.private` refuses and how it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import hmac
import os
import pickle
import re
import secrets
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from helpers import collect, end_all, lone_worker_env, start, worker_cmd
from nbddp import Pool
from nbddp.notebook import attaching, remote
from nbddp.pool.errors import CellFailed
from nbddp.pool.facade import raise_for_end
from nbddp.wire import frames as wire
from nbddp.wire import handshake as HS
from nbddp.wire import private
from nbddp.wire import protocol as P
from nbddp.wire import tls as T
from nbddp.wire.tls import make_server_tls

TOKEN = secrets.token_hex(32).encode()
HEAD = wire.HEADER.size  # a small frame's header (its one MAC comes after the payload)
MODES = ["plain", "mac", "tls"]


# ---------------------------------------------------------------- helpers


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(accepted, connected) on loopback TCP."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return accepted, client


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError(f"the peer closed after {len(buf)} of {n} bytes")
        buf += got
    return buf


@pytest.fixture(scope="module")
def server_tls():
    """A certificate for the module's TLS servers, and the fingerprint that pins it."""
    return make_server_tls()


def handshake(s, c, *, server_token=TOKEN, client_token=TOKEN, tls=None, pin="", timeout=5.0):
    """Run both sides of the handshake on (server socket, client socket): (server's result,
    client's result), each a Channel or the exception it raised."""
    got: dict[str, object] = {}

    def serve():
        try:
            got["server"] = HS.server_handshake(s, server_token, timeout, tls)
        except Exception as exc:
            got["server"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = HS.client_handshake(c, client_token, timeout, T.Tls(pin=pin) if pin else None)
    except Exception as exc:
        client = exc
        c.close()  # (as HS.connect does)
    thread.join(timeout + 5)
    assert not thread.is_alive()
    return got["server"], client


@contextlib.contextmanager
def channels(mode: str, server_tls=None):
    """(server Channel, client Channel) of ``mode``, authenticated; closed afterwards."""
    s, c = socket.socketpair() if mode == "plain" else tcp_pair()
    tls, pin = server_tls if mode == "tls" else (None, "")
    server, client = handshake(s, c, tls=tls, pin=pin)
    try:
        assert isinstance(server, wire.Channel), server
        assert isinstance(client, wire.Channel), client
        assert server.mode == client.mode == mode
        yield server, client
    finally:
        for ch in (server, client):
            if isinstance(ch, wire.Channel):
                ch.close()
        s.close()
        c.close()


@pytest.fixture(params=MODES)
def pair(request, server_tls):
    with channels(request.param, server_tls) as both:
        yield both


@contextlib.contextmanager
def in_the_middle(mode: str):
    """(sender, receiver, raw_from_sender, raw_to_receiver): a client Channel and a server
    Channel whose bytes pass through the test, which forwarded their handshake as it was.
    The test reads what ``sender`` sends at ``raw_from_sender`` and writes what
    ``receiver`` gets at ``raw_to_receiver``."""
    pairs = [socket.socketpair() if mode == "plain" else tcp_pair() for _ in range(2)]
    (c, c_raw), (s, s_raw) = pairs
    got: dict[str, object] = {}

    def side(name, fn, sock):
        try:
            got[name] = fn(sock, TOKEN, 5.0)
        except Exception as exc:
            got[name] = exc

    threads = [
        threading.Thread(target=side, args=("server", HS.server_handshake, s), daemon=True),
        threading.Thread(target=side, args=("client", HS.client_handshake, c), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        c_raw.sendall(recv_exact(s_raw, len(HS.MAGIC) + 1 + HS.NONCE))  # S -> C
        s_raw.sendall(recv_exact(c_raw, HS.NONCE + wire.TAG))  # C -> S
        c_raw.sendall(recv_exact(s_raw, 1 + wire.TAG))  # S -> C
        for t in threads:
            t.join(10)
        assert isinstance(got["server"], wire.Channel), got["server"]
        assert isinstance(got["client"], wire.Channel), got["client"]
        for raw in (c_raw, s_raw):
            raw.settimeout(10)
        yield got["client"], got["server"], c_raw, s_raw
    finally:
        for ch in got.values():
            if isinstance(ch, wire.Channel):
                ch.close()
        for a, b in pairs:
            a.close()
            b.close()


def read_frame(raw: socket.socket, mac: bool) -> bytes:
    """One whole frame as it travels, from a raw socket."""
    head = recv_exact(raw, wire.HEADER.size)
    _, length = wire.HEADER.unpack_from(head)
    if mac and length > wire.SMALL:  # a big frame's header has a MAC of its own
        head += recv_exact(raw, wire.HEADER_TAG)
    return head + recv_exact(raw, length + (wire.TAG if mac else 0))


def forged(seq: int, payload: bytes) -> bytes:
    """A frame of one's own: a well-formed header, random MACs (no key)."""
    header = wire.HEADER.pack(seq, len(payload))
    if len(payload) > wire.SMALL:
        header += os.urandom(wire.HEADER_TAG)
    return header + payload + os.urandom(wire.TAG)


def header_of(sender: wire.Channel, seq: int, length: int) -> bytes:
    """A header ``sender`` could send (its MAC made with its key, in "mac" mode)."""
    header = wire.HEADER.pack(seq, length)
    if sender.mode == "mac" and length > wire.SMALL:  # (a small frame's MAC follows it)
        header += hmac.new(sender._out_key, header, hashlib.sha256).digest()[: wire.HEADER_TAG]
    return header


class _Plant:
    """Unpickled, it creates ``path``: the proof that a payload was (not) decoded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def planting(path) -> bytes:
    return pickle.dumps(_Plant(str(path)))


def padded(payload: bytes, length: int) -> bytes:
    """``payload`` (a pickle) made ``length`` bytes long: pickle stops reading at its end."""
    assert len(payload) <= length, (len(payload), length)
    return payload + b"\0" * (length - len(payload))


# ---------------------------------------------------------------- round trips

SIZES = [0, 1, (1 << 16) + 1, 3 << 20]


@pytest.mark.timeout(60)
def test_frames_of_every_size_go_both_ways(pair):
    server, client = pair
    payloads = [os.urandom(n) for n in SIZES]
    for sender, receiver in ((client, server), (server, client)):
        failed: list[BaseException] = []

        def send(sender=sender, failed=failed):
            try:
                for p in payloads:
                    sender.send_bytes(p)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        got = [receiver.recv_bytes(timeout=20) for _ in payloads]
        thread.join(20)
        assert not failed
        assert [len(g) for g in got] == SIZES
        assert [bytes(g) for g in got] == payloads
        assert not receiver.poll(0.05)  # nothing else came


@pytest.mark.timeout(60)
def test_both_directions_at_once(pair):
    """Each side sends 3 MiB frames while the other does: neither waits on the other."""
    server, client = pair
    data = {"client": os.urandom(3 << 20), "server": os.urandom(3 << 20)}
    got: dict[str, list[bool]] = {}

    def send(me: wire.Channel, name: str) -> None:
        for _ in range(3):
            me.send_bytes(data[name])

    def receive(me: wire.Channel, peer: str) -> None:
        got[peer] = [me.recv_bytes(timeout=20) == data[peer] for _ in range(3)]

    threads = [
        threading.Thread(target=send, args=(client, "client"), daemon=True),
        threading.Thread(target=send, args=(server, "server"), daemon=True),
        threading.Thread(target=receive, args=(server, "client"), daemon=True),
        threading.Thread(target=receive, args=(client, "server"), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert got == {"client": [True] * 3, "server": [True] * 3}


# ---------------------------------------------------------------- the handshake


@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_token_is_refused_on_both_sides(mode, server_tls):
    s, c = socket.socketpair() if mode == "plain" else tcp_pair()
    tls, pin = server_tls if mode == "tls" else (None, "")
    with s, c:
        server, client = handshake(s, c, client_token=b"not-the-token", tls=tls, pin=pin)
    assert isinstance(server, HS.HandshakeError)
    assert "did not prove it holds the token" in str(server)
    assert isinstance(client, HS.Refused)


@pytest.mark.parametrize("mode", ["plain", "mac"])
def test_a_server_that_does_not_hold_the_token_is_not_believed(mode):
    """A fake notebook says OK without proving the token: the client gives up."""
    s, c = socket.socketpair() if mode == "plain" else tcp_pair()
    with s, c:
        s.sendall(HS.MAGIC + {"plain": b"p", "mac": b"m"}[mode] + os.urandom(HS.NONCE))
        s.settimeout(5)

        def fake():
            recv_exact(s, HS.NONCE + wire.TAG)
            s.sendall(HS.OK + os.urandom(wire.TAG))

        thread = threading.Thread(target=fake, daemon=True)
        thread.start()
        with pytest.raises(HS.HandshakeError, match="did not prove it holds the token"):
            HS.client_handshake(c, TOKEN, 5.0)
        thread.join(5)


@pytest.mark.parametrize(
    ("client_tls", "said", "why"),
    [
        (True, b"m", "does not use TLS"),  # a man in the middle turned "t" into "m"
        (True, b"p", "speaks mode"),
        (False, b"p", "speaks mode"),  # TCP without MACs: never
        (False, b"t", "uses TLS"),
        (False, b"x", "speaks mode"),
    ],
)
def test_a_changed_mode_byte_cannot_downgrade(client_tls, said, why):
    """The client decides the mode it accepts; it says nothing to a server that offers
    another (not even its nonce and proof)."""
    s, c = tcp_pair()
    with s, c:
        s.sendall(HS.MAGIC + said + os.urandom(HS.NONCE))
        tls = T.Tls(pin="ab" * 32) if client_tls else None
        with pytest.raises(HS.HandshakeError, match=why):
            HS.client_handshake(c, TOKEN, 5.0, tls)
        c.close()
        s.settimeout(5)
        assert s.recv(1024) == b""  # the client sent nothing at all


def test_a_unix_client_refuses_a_mac_or_tls_server():
    s, c = socket.socketpair()
    with s, c:
        s.sendall(HS.MAGIC + b"m" + os.urandom(HS.NONCE))
        with pytest.raises(HS.HandshakeError, match="not plain"):
            HS.client_handshake(c, TOKEN, 5.0)


def test_another_protocol_is_refused():
    s, c = tcp_pair()
    with s, c:
        s.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 64)
        with pytest.raises(HS.HandshakeError, match="does not speak this nbddp's protocol"):
            HS.client_handshake(c, TOKEN, 5.0)


def test_a_wrong_tls_pin_is_refused(server_tls):
    s, c = tcp_pair()
    with s, c:
        server, client = handshake(s, c, tls=server_tls[0], pin="00" * 32, timeout=3.0)
    assert isinstance(client, HS.HandshakeError)
    assert "is not the one the token file pins" in str(client)
    assert isinstance(server, HS.HandshakeError)  # the client said nothing more


def test_the_right_tls_pin_is_accepted_in_any_case(server_tls):
    s, c = tcp_pair()
    with s, c:
        server, client = handshake(s, c, tls=server_tls[0], pin=server_tls[1].upper())
    assert isinstance(client, wire.Channel)
    assert client.mode == "tls"
    assert isinstance(server, wire.Channel)
    client.close()
    server.close()


@pytest.mark.timeout(30)  # the client never speaks: only the handshake's deadline ends it
def test_a_silent_client_ends_the_handshake_in_time():
    s, c = tcp_pair()
    with s, c, pytest.raises(HS.HandshakeError, match="did not finish the handshake in time"):
        HS.server_handshake(s, TOKEN, 0.3)


# ---------------------------------------------------------------- bad frames


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.timeout(30)
def test_an_over_limit_frame_is_refused_before_its_payload(mode, server_tls, monkeypatch):
    """The header says 1 TiB and no payload follows: refused at once, nothing allocated
    nor waited for (a wait for the payload would outlast the test's timeout)."""
    monkeypatch.setattr(wire, "STALL", 600.0)
    with channels(mode, server_tls) as (server, client):
        client._write(header_of(client, 0, 1 << 40))
        with pytest.raises(wire.FrameError, match=r"1,099,511,627,776 bytes is over the limit"):
            server.recv_bytes(timeout=600)
        assert server.closed


@pytest.mark.parametrize("mode", ["plain", "mac"])
@pytest.mark.timeout(30)
def test_maxlength_and_max_frame_bound_a_frame(mode, monkeypatch):
    with channels(mode) as (server, client):
        client.send_bytes(b"x" * 10)
        assert server.recv_bytes(10, timeout=5) == b"x" * 10  # at the limit: fine
        client.send_bytes(b"x" * 11)
        with pytest.raises(wire.FrameError, match="a frame of 11 bytes is over the limit of 10"):
            server.recv_bytes(10, timeout=5)
        assert server.closed
    monkeypatch.setattr(wire, "MAX_FRAME", 100)
    with channels(mode) as (server, client):
        client.send_bytes(b"x" * 100)
        assert len(server.recv_bytes(timeout=5)) == 100
        client.send_bytes(b"x" * 101)
        with pytest.raises(wire.FrameError, match="101 bytes is over the limit of 100"):
            server.recv_bytes(timeout=5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["header", "payload"])
@pytest.mark.timeout(30)
def test_a_frame_stalled_midway_is_given_up_after_stall(mode, where, server_tls, monkeypatch):
    """Once a frame began, each byte must come within STALL s; the connection is then closed
    (TimeoutError, as recv_bytes documents)."""
    monkeypatch.setattr(wire, "STALL", 0.3)
    with channels(mode, server_tls) as (server, client):
        head = header_of(client, 0, 100)
        client._write(head[:5] if where == "header" else head + b"y" * 10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            server.recv_bytes()  # no timeout of its own: STALL bounds it (else the test's)
        assert time.monotonic() - t0 > 0.25  # not before STALL
        assert server.closed


@pytest.mark.parametrize("mode", MODES)
def test_recv_with_a_timeout_raises_when_nothing_comes(mode, server_tls):
    """Nothing began: TimeoutError, and the connection stays usable."""
    with channels(mode, server_tls) as (server, client):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            server.recv_bytes(timeout=0.2)
        assert time.monotonic() - t0 > 0.15  # not before the timeout
        assert not server.closed
        client.send_bytes(b"still here")
        assert server.recv_bytes(timeout=5) == b"still here"


@pytest.mark.parametrize("mode", ["plain", "mac"])
def test_a_connection_that_ends_midframe_is_a_frame_error(mode):
    with in_the_middle(mode) as (sender, receiver, raw_in, raw_out):
        sender.send_bytes(b"z" * 1000)
        raw_out.sendall(read_frame(raw_in, mode == "mac")[:-10])
        raw_out.shutdown(socket.SHUT_WR)
        with pytest.raises(wire.FrameError, match="ended in the middle of a frame"):
            receiver.recv_bytes(timeout=5)


# What a man in the middle does to the frames the sender sent ([frame 0, frame 1]), and
# what the receiver must say. Each forged payload would create a file if it were decoded.
def _flip_payload(frames, plant):
    f = bytearray(frames[0])
    f[HEAD + 3] ^= 0x01
    return [bytes(f)]


def _swap_payload(frames, plant):
    f = frames[0]
    return [f[:HEAD] + padded(plant, len(f) - HEAD - wire.TAG) + f[-wire.TAG :]]


def _change_length(frames, plant):
    # (the stream goes on: the next frame's bytes complete what the new length asks for)
    return [wire.HEADER.pack(0, len(plant)) + plant + frames[0][-wire.TAG :], frames[1]]


def _inject(frames, plant):
    return [forged(0, plant), *frames]


def _replay(frames, plant):
    return [frames[0], frames[0]]


def _reorder(frames, plant):
    return [frames[1], frames[0]]


def _reflect(frames, plant):
    """(frames the *receiver* sent, sent back to it: see the test)"""
    return frames


BAD = {
    "flip a payload byte": (
        _flip_payload,
        0,
        "failed its MAC check (changed or injected on the way)",
    ),
    "swap the payload": (_swap_payload, 0, "failed its MAC check (changed or injected"),
    "change the length": (_change_length, 0, "failed its MAC check (changed or injected"),
    "inject a frame": (_inject, 0, "failed its MAC check (changed or injected"),
    "replay a frame": (_replay, 1, "out of order (number 0, expected 1: replayed"),
    "reorder frames": (_reorder, 0, "out of order (number 1, expected 0"),
    "reflect a frame": (_reflect, 0, "failed its MAC check"),
}


@pytest.mark.parametrize("attack", list(BAD))
@pytest.mark.timeout(30)
def test_a_changed_injected_or_replayed_frame_closes_the_connection(attack, tmp_path):
    act, good, why = BAD[attack]
    marker = tmp_path / "decoded"
    plant = planting(marker)
    with in_the_middle("mac") as (sender, receiver, raw_in, raw_out):
        if attack == "reflect a frame":  # the receiver's own frame, back to it
            receiver.send_bytes(b"genuine " * 25)
            frames = [read_frame(raw_out, True)]
        else:
            sender.send_bytes(b"genuine " * 25)
            sender.send_bytes(b"second")
            frames = [read_frame(raw_in, True) for _ in range(2)]
        for part in act(frames, plant):
            raw_out.sendall(part)
        received = [receiver.recv_bytes(timeout=5) for _ in range(good)]
        with pytest.raises(wire.FrameError, match=re.escape(why)):
            pickle.loads(receiver.recv_bytes(timeout=5))
        assert receiver.closed
        with pytest.raises((EOFError, OSError)):
            receiver.recv_bytes(timeout=1)
    assert len(received) == good
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["replay a frame", "reorder frames"])
def test_plain_mode_still_numbers_its_frames(attack):
    act, good, why = BAD[attack]
    with in_the_middle("plain") as (sender, receiver, raw_in, raw_out):
        sender.send_bytes(b"first")
        sender.send_bytes(b"second")
        frames = [read_frame(raw_in, False) for _ in range(2)]
        for part in act(frames, b""):
            raw_out.sendall(part)
        for _ in range(good):
            receiver.recv_bytes(timeout=5)
        with pytest.raises(wire.FrameError, match=re.escape(why)):
            receiver.recv_bytes(timeout=5)


# ---------------------------------------------------------------- a man in the middle of a rank


@dataclasses.dataclass
class Frame:
    seq: int
    raw: bytes

    @property
    def payload(self) -> bytes:
        return self.raw[HEAD : -wire.TAG]


class Conn:
    """One TCP connection of the rank's, as the proxy sees it."""

    def __init__(self, rank_side: socket.socket, notebook_side: socket.socket) -> None:
        self.socks = (rank_side, notebook_side)
        self.kind: str | None = None  # "Hello" (control) or "StreamHello"
        self.frames: dict[str, list[Frame]] = {"up": [], "down": []}

    def shut(self) -> None:
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class Proxy:
    """A TCP proxy between ranks and the notebook that understands the wire: it forwards
    the handshake as it is (its sizes are fixed), then whole "mac" frames, each through
    ``act(proxy, conn, direction, frame)`` once armed ("up": rank -> notebook), which
    returns what to send instead (None: the frame as it is). It acts on the control
    connection, or on the connections whose first message is one of ``kinds``."""

    SIZES = {
        "up": [HS.NONCE + wire.TAG],
        "down": [len(HS.MAGIC) + 1 + HS.NONCE, 1 + wire.TAG],
    }

    def __init__(self, target: str, act, kinds=("Hello",)) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.act, self.kinds = act, kinds
        self.armed = threading.Event()
        self.acted = threading.Event()
        self.marker = ""  # the file a forged payload would create, were it decoded
        self.conns: list[Conn] = []
        self.errors: list[BaseException] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for conn in self.conns:
            conn.shut()
        for t in self.threads:
            t.join(10)
        for conn in self.conns:
            for s in conn.socks:
                s.close()
        assert not any(t.is_alive() for t in self.threads)

    def _accept(self) -> None:
        while True:
            try:
                rank_side, _ = self.listener.accept()
            except OSError:
                return
            notebook_side = socket.create_connection(self.target)
            conn = Conn(rank_side, notebook_side)
            self.conns.append(conn)
            for direction, src, dst in (
                ("up", rank_side, notebook_side),
                ("down", notebook_side, rank_side),
            ):
                t = threading.Thread(
                    target=self._pump, args=(conn, direction, src, dst), daemon=True
                )
                self.threads.append(t)
                t.start()

    def _pump(self, conn: Conn, direction: str, src, dst) -> None:
        try:
            for n in self.SIZES[direction]:
                dst.sendall(recv_exact(src, n))
            while True:
                head = recv_exact(src, HEAD)
                seq, length = wire.HEADER.unpack_from(head)
                frame = Frame(seq, head + recv_exact(src, length + wire.TAG))
                if conn.kind is None and direction == "up":
                    conn.kind = type(P.loads(frame.payload)).__name__
                out = None
                if self.armed.is_set() and conn.kind in self.kinds:
                    out = self.act(self, conn, direction, frame)
                    if out is not None:
                        self.armed.clear()
                        self.acted.set()
                conn.frames[direction].append(frame)
                for part in [frame.raw] if out is None else out:
                    dst.sendall(part)
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # the test's own mistake: said at the end
            self.errors.append(exc)
        finally:
            conn.shut()  # one side ended: so does the other, as a TCP connection would


def _message(conn: Conn, direction: str, frame: Frame, kind: type, want: str):
    if direction != want:
        return None
    msg = P.loads(frame.payload)  # (a genuine frame: the proxy decodes it to find its target)
    return msg if isinstance(msg, kind) else None


def _evil_done(done: P.Done, marker: str, length: int) -> bytes:
    """The same Done, its value a pickle that creates ``marker`` when the notebook loads
    it, made ``length`` bytes long."""
    return padded(P.dumps(dataclasses.replace(done, value=planting(marker))), length)


def mitm_flip_done(proxy, conn, direction, frame):
    if _message(conn, direction, frame, P.Done, "up") is None:
        return None
    raw = bytearray(frame.raw)
    raw[HEAD + len(frame.payload) // 2] ^= 0x01
    return [bytes(raw)]


def mitm_change_done(proxy, conn, direction, frame):
    done = _message(conn, direction, frame, P.Done, "up")
    if done is None:
        return None
    evil = _evil_done(done, proxy.marker, len(frame.payload))
    return [frame.raw[:HEAD] + evil + frame.raw[-wire.TAG :]]  # its own header and MACs


def mitm_inject_before_done(proxy, conn, direction, frame):
    done = _message(conn, direction, frame, P.Done, "up")
    if done is None:
        return None
    evil = P.dumps(dataclasses.replace(done, value=planting(proxy.marker)))
    return [forged(frame.seq, evil), frame.raw]  # the next number, a made-up MAC


def mitm_replay_before_done(proxy, conn, direction, frame):
    if _message(conn, direction, frame, P.Done, "up") is None:
        return None
    return [conn.frames["up"][0].raw, frame.raw]  # the rank's Hello, again


def mitm_change_run(proxy, conn, direction, frame):
    """notebook -> rank: the cell's Run, its code and its needs changed to create the
    marker on the rank."""
    run = _message(conn, direction, frame, P.Run, "down")
    if run is None:
        return None
    evil = dataclasses.replace(
        run, code=f"open({proxy.marker!r}, 'w').close()", needs=planting(proxy.marker)
    )
    return [frame.raw[:HEAD] + padded(P.dumps(evil), len(frame.payload)) + frame.raw[-wire.TAG :]]


MITM = {
    "flip a byte of the Done": (
        mitm_flip_done,
        "a frame failed its MAC check (changed or injected on",
    ),
    "change the Done": (mitm_change_done, "a frame failed its MAC check (changed or"),
    "inject a frame": (mitm_inject_before_done, "a frame failed its MAC check (changed or"),
    "replay the Hello": (mitm_replay_before_done, "a frame came out of order (number 0,"),
    "change the Run": (mitm_change_run, None),  # the rank closes: the notebook sees it go
}
# a long value and a long cell: a forged Done or Run fits in the genuine one's length
CODE = "'Q' * 4000  # " + "a long cell " * 200


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "nbddp" / "token"
    remote.read_or_create_token(str(path))
    return path


@contextlib.contextmanager
def attached_through(proxy: Proxy, pool: Pool, token_file, tmp_path):
    """A real worker process attached to ``pool`` through ``proxy``: its process."""
    log = open(tmp_path / "rank.log", "wb")  # noqa: SIM115
    proc = start(worker_cmd(proxy.address, token_file), log, lone_worker_env())
    try:
        pool.start()
        yield proc
    finally:
        pool.stop()
        proxy.close()
        end_all([proc])
        log.close()
    assert not proxy.errors


def attached_pool(token_file) -> Pool:
    return Pool(1, listen=("127.0.0.1", 0), token=token_file.read_bytes().strip(), start_timeout=60)


@pytest.mark.parametrize("attack", list(MITM))
@pytest.mark.timeout(180)
def test_a_man_in_the_middle_of_a_rank_is_found_out(attack, token_file, tmp_path):
    act, why = MITM[attack]
    pool = attached_pool(token_file)
    proxy = Proxy(pool.listen(), act)
    proxy.marker = str(tmp_path / "decoded")
    with attached_through(proxy, pool, token_file, tmp_path) as proc:
        # untouched, the proxy changes nothing
        _, _, end = collect(pool.run(CODE, want_values=True))
        assert end.values == {0: "Q" * 4000}
        assert not end.notes
        proxy.armed.set()
        t0 = time.monotonic()
        _, _, end = collect(pool.run(CODE, want_values=True))
        took = time.monotonic() - t0
        assert proxy.acted.is_set()
        assert not Path(proxy.marker).exists()  # nothing of the bad frame was decoded
        assert took < 30  # the cell ended, without waiting for a clock
        assert end.values == {}
        with pytest.raises(CellFailed, match=r"rank 0 died \(connection lost\)"):
            raise_for_end(end)
        if why is not None:  # the notebook closed the connection, and says why
            said = [n for n in end.notes if "rank 0's connection was closed" in n]
            assert len(said) == 1, end.notes
            assert why in said[0]
        assert proc.wait(30) == 1  # the rank lost its connection and ended
        assert not pool.take_notes()  # said once
        assert not Path(proxy.marker).exists()


def mitm_flip_stdout(proxy, conn, direction, frame):
    if direction != "up" or b"hello from the rank" not in frame.payload:
        return None
    raw = bytearray(frame.raw)
    raw[HEAD] ^= 0x01
    return [bytes(raw)]


@pytest.mark.timeout(120)
def test_a_changed_frame_on_a_ranks_stdout_is_said(token_file, tmp_path):
    """A rank's output is authenticated like its messages: a changed stdout frame ends the
    stream and the rank is treated as gone, with the reason in the notes."""
    pool = attached_pool(token_file)
    proxy = Proxy(pool.listen(), mitm_flip_stdout, kinds=("StreamHello",))
    with attached_through(proxy, pool, token_file, tmp_path):
        proxy.armed.set()
        t0 = time.monotonic()
        _, _, end = collect(pool.run("print('hello from the rank')\n7", want_values=True))
        assert time.monotonic() - t0 < 30
        assert proxy.acted.is_set()
        assert 0 in end.exits  # (its Done may have come first: the rank is gone all the same)
        notes = [*end.notes, *pool.take_notes()]
        said = [n for n in notes if "its stdout failed a check" in n]
        assert len(said) == 1, notes
        assert "frame failed its MAC check" in said[0]


def test_a_ranks_output_pump_never_blocks_once_its_connection_is_gone():
    """What a rank prints after its stdout connection closed is read and dropped: a print
    of 300 kB (more than a pipe holds) does not block the rank."""
    from nbddp.rank import control

    s, c = socket.socketpair()
    server = {}
    t = threading.Thread(target=lambda: server.setdefault("ch", HS.server_handshake(s, TOKEN, 5)))
    t.start()
    channel = HS.client_handshake(c, TOKEN, 5)
    t.join()
    server["ch"].close()
    read_end, write_end = os.pipe()
    pump = threading.Thread(target=control._Pump(read_end, channel).run, daemon=True)
    pump.start()
    writer = threading.Thread(target=os.write, args=(write_end, b"x" * 300_000), daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive(), "the rank's print blocked"
    os.write(write_end, b"y" * 300_000)  # and the next one too
    os.close(write_end)
    pump.join(10)
    assert not pump.is_alive()
    assert channel.closed


# ---------------------------------------------------------------- the token file


def test_a_token_file_others_can_read_is_refused_in_one_line(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    for mode in (0o644, 0o640, 0o604, 0o620, 0o602):
        path.chmod(mode)
        with pytest.raises(private.UnsafeFile) as caught:
            private.read_token_file(str(path))
        assert isinstance(caught.value, PermissionError)
        message = str(caught.value)
        assert "\n" not in message
        assert f"refusing the token file {path}: others can read it" in message
        assert f"chmod 600 {path}" in message
    path.chmod(0o600)
    assert private.read_token_file(str(path)).token == b"secret"
    path.chmod(0o400)
    assert private.read_token_file(str(path)).token == b"secret"


@pytest.mark.timeout(60)
def test_a_worker_refuses_a_token_file_others_can_read(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    path.chmod(0o644)
    out = subprocess.run(
        worker_cmd("127.0.0.1:1", path),
        env=lone_worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"nbddp.worker: refusing the token file {path}: others can read it (mode -rw-r--r--); "
        f"chmod 600 {path}"
    ]


def test_attach_refuses_a_token_file_others_can_read(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    path.chmod(0o644)
    args = argparse.Namespace(listen="127.0.0.1:0", tls=False, token_file=str(path), workspace=None)
    with pytest.raises(UsageError) as caught:
        attaching.prepare(args)
    assert "\n" not in str(caught.value)
    assert "others can read it" in str(caught.value)
    assert path.read_text() == "secret\n"  # left as it was
    path.chmod(0o600)
    assert attaching.prepare(args) == ("127.0.0.1", 0, b"secret", None)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_token_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(private.UnsafeFile, match="it belongs to uid 65534, not to this user"):
        private.read_token_file(str(path))
    with pytest.raises(private.UnsafeFile, match="belongs to uid 65534"):
        private.write_token_file(str(path), pin="ab" * 32)  # not rewritten either
    assert path.read_text() == "secret\n"


def test_a_symlinked_token_file_is_refused(tmp_path):
    real = tmp_path / "real"
    real.write_text("secret\n")
    real.chmod(0o600)
    link = tmp_path / "token"
    link.symlink_to(real)
    with pytest.raises(private.UnsafeFile, match="it is a symlink") as caught:
        private.read_token_file(str(link))
    assert "\n" not in str(caught.value)
    # nor written through: a planted link does not make the file it points at a token
    with pytest.raises(private.UnsafeFile, match="it is a symlink"):
        private.write_token_file(str(link), pin="ab" * 32)
    assert real.read_text() == "secret\n"
    assert link.is_symlink()


def test_a_fifo_as_token_file_is_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(private.UnsafeFile, match="not a regular file"):
        private.read_token_file(str(fifo))


def test_a_folder_as_token_file_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "token"
    folder.mkdir(mode=0o700)
    with pytest.raises(private.UnsafeFile, match="not a regular file"):
        private.read_token_file(str(folder))
    args = argparse.Namespace(
        listen="127.0.0.1:0", tls=False, token_file=str(folder), workspace=None
    )
    with pytest.raises(UsageError, match="not a regular file"):
        attaching.prepare(args)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_token_file_is_0600_in_a_0700_folder(tmp_path):
    path = tmp_path / "a" / "b" / "token"
    made = private.write_token_file(str(path))
    assert len(made.token) == 64
    assert made.pin == ""
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert path.read_bytes() == made.token + b"\n"
    assert os.listdir(path.parent) == ["token"]  # no temporary file left
    assert private.write_token_file(str(path)).token == made.token  # read, not made again


def test_missing_parents_of_the_token_folder_are_0700(tmp_path):
    path = tmp_path / "a" / "b" / "token"
    private.write_token_file(str(path))
    assert _mode(path.parent.parent) == 0o700


def test_an_existing_folder_is_not_loosened_nor_tightened(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o755)
    path = folder / "token"
    token = remote.read_or_create_token(str(path))
    assert _mode(folder) == 0o755
    assert _mode(path) == 0o600
    assert private.read_token_file(str(path)).token == token


def test_the_pin_line_is_added_and_removed_and_the_token_kept(tmp_path):
    path = tmp_path / "nbddp" / "token"
    token = remote.read_or_create_token(str(path))
    pin = "ab" * 32
    assert remote.read_or_create_token(str(path), pin) == token
    assert path.read_text().splitlines() == [token.decode(), f"tls-sha256 {pin}"]
    assert _mode(path) == 0o600
    held = private.read_token_file(str(path))
    assert (held.token, held.pin) == (token, pin)
    assert private.write_token_file(str(path)).pin == pin  # None: left as it is
    assert path.read_text().splitlines() == [token.decode(), f"tls-sha256 {pin}"]
    other = "cd" * 32
    assert private.write_token_file(str(path), other).pin == other  # a new pool's
    assert path.read_text().splitlines() == [token.decode(), f"tls-sha256 {other}"]
    held = private.write_token_file(str(path), "")
    assert (held.token, held.pin) == (token, "")
    assert path.read_text().splitlines() == [token.decode()]
    assert private.read_token_file(str(path)).pin == ""
    assert _mode(path) == 0o600
    assert sorted(os.listdir(path.parent)) == ["token"]


@pytest.mark.timeout(60)
def test_a_worker_reads_the_pin_and_refuses_another_notebook(tmp_path, server_tls):
    """A token file that pins a certificate: the worker speaks TLS and accepts only that
    notebook (here a server with another certificate)."""
    path = tmp_path / "token"
    private.write_token_file(str(path), pin="00" * 32)
    token = private.read_token_file(str(path)).token
    pool = Pool(1, listen=("127.0.0.1", 0), token=token, tls=server_tls[0], start_timeout=5)
    address = pool.listen()
    try:
        out = subprocess.run(
            worker_cmd(address, path, timeout=5),
            env=lone_worker_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        assert "is not the one the token file pins" in out.stderr
    finally:
        pool.stop()
