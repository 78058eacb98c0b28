"""Fuzzing the listeners: the notebook's (an attached pool's, TCP, "mac" frames) and a
host relay's (a Unix socket, "plain" frames).

Peers are played by hand with raw sockets and ``nbddp.wire.frames``: random bytes, handshakes
cut short, a greeting sent back (a wrong MAGIC where the token's proof should be), a
wrong token, and, once authenticated, frames with bad lengths, bad MACs, wrong numbers,
cut short, claiming gigabytes, or carrying what is not a message; slow peers that send
a byte a second; hundreds of peers at once. Each must be refused (the listener closes
it and counts it) without holding up the others, without memory growing with what they
claim, and a good peer, and the pool's cells, still get through.

Bounded: a fixed seed, at most a few hundred peers a test, the handshake deadline
monkeypatched to about a second; the whole file takes well under a minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import random
import re
import secrets
import select
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from helpers import collect, lone_worker_env, worker_cmd
from nbddp import Pool
from nbddp.hosts import relay_carry
from nbddp.notebook import remote
from nbddp.wire import frames as wire
from nbddp.wire import handshake as HS
from nbddp.wire import listener as L
from nbddp.wire import protocol as P

SEED = 20240611
WAIT = 20.0  # s any one wait may take before the test fails (never reached when it passes)
DEADLINE = 1.0  # s: listener.HANDSHAKE_TIMEOUT in the tests of silent crowds
SLOW_DEADLINE = 2.5  # s: the same for peers that send a byte a second (more than a byte's
# wait, so that a deadline per byte, not for the whole handshake, would never cut them)
MB = 1 << 20
GB = 1 << 30


# ---------------------------------------------------------------- peers played by hand


class Target:
    """Where a listener listens: ``raw()`` gives a connected raw socket, ``channel()`` an
    authenticated connection (``HS.connect``)."""

    def __init__(self, address, family: str, token: bytes) -> None:
        self.address, self.family, self.token = address, family, token

    def raw(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX if self.family == "AF_UNIX" else socket.AF_INET)
        sock.settimeout(WAIT)
        sock.connect(self.address)
        return sock

    def channel(self, token: bytes | None = None) -> wire.Channel:
        return HS.connect(self.address, self.family, token or self.token, timeout=WAIT)


def header(ch: wire.Channel, length: int, seq: int | None = None) -> bytes:
    """A frame's header claiming ``length`` bytes, as ``ch`` would send it (its MAC made with
    the channel's key on TCP): only a peer that holds the token can make one."""
    head = wire.HEADER.pack(ch._sent if seq is None else seq, length)
    if ch._out_key and length > wire.SMALL:  # (a small frame's one MAC follows its payload)
        head += hmac.new(ch._out_key, head, hashlib.sha256).digest()[: wire.HEADER_TAG]
    return head


def send_raw(sock: socket.socket, data: bytes) -> None:
    """Send, blocking (a channel's socket is not); a peer may have closed already."""
    sock.setblocking(True)
    with contextlib.suppress(OSError):
        sock.sendall(data)


def end(sock: socket.socket) -> None:
    """Say no more (the listener may have closed the connection already)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the listener closed ``sock`` (what it said before is read and
    dropped); None if it still held it after ``timeout``."""
    start = time.monotonic()
    sock.setblocking(False)
    while True:
        left = start + timeout - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return None
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
        except BlockingIOError:
            continue


def count(lines: list[str]) -> int:
    """Refusals in folded lines ("... (12 times)")."""
    return sum(int(m.group(1)) if (m := re.search(r" \((\d+) times\)$", x)) else 1 for x in lines)


def wait_refusals(lis: L.Listener, n: int) -> list[str]:
    """The listener's refusals once it counted ``n`` (taken)."""
    deadline = time.monotonic() + WAIT
    while count(lis.refusals()) < n:
        assert time.monotonic() < deadline, lis.refusals()
        time.sleep(0.02)
    lines = lis.refusals(take=True)
    assert count(lines) == n, lines
    return lines


# Every case connects, misbehaves and returns the socket the listener must close. Those
# after the handshake use the right token: what they send is read, never decoded unchecked.


def random_bytes(t: Target, rng: random.Random) -> socket.socket:
    sock = t.raw()
    send_raw(sock, rng.randbytes(rng.randrange(0, 400)))
    if rng.random() < 0.5:
        end(sock)  # and ended: else the listener refuses it on its bytes, or at the deadline
    return sock


def truncated_handshake(t: Target, rng: random.Random) -> socket.socket:
    """A real client's answer to the challenge, cut short, then the end."""
    sock = t.raw()
    greeting = b""
    while len(greeting) < len(HS.MAGIC) + 1 + HS.NONCE:
        greeting += sock.recv(64)
    mode, nonce_s = (
        greeting[len(HS.MAGIC) : len(HS.MAGIC) + 1],
        greeting[-HS.NONCE :],
    )
    nonce_c = secrets.token_bytes(HS.NONCE)
    proof = HS._mac(t.token, b"client", HS.MAGIC + mode + nonce_s + nonce_c)
    send_raw(sock, (nonce_c + proof)[: rng.randrange(0, HS.NONCE + wire.TAG)])
    end(sock)
    return sock


def wrong_magic(t: Target, rng: random.Random) -> socket.socket:
    """A greeting of its own (another version's MAGIC, or this one's) where its proof
    of the token should be."""
    sock = t.raw()
    magic = bytearray(HS.MAGIC)
    if rng.random() < 0.7:
        magic[rng.randrange(len(magic))] ^= 1 << rng.randrange(8)
    send_raw(sock, bytes(magic) + rng.choice([b"m", b"p", b"t"]) + rng.randbytes(55))
    return sock


def wrong_token(t: Target, rng: random.Random) -> socket.socket:
    sock = t.raw()
    with pytest.raises(HS.Refused):
        HS.client_handshake(sock, rng.randbytes(rng.randrange(1, 64)), WAIT)
    return sock


def _authenticated(t: Target) -> wire.Channel:
    ch = t.channel()
    ch.sock.setblocking(True)
    return ch


def claims_too_much(t: Target, rng: random.Random) -> socket.socket:
    """Its first frame claims more than a hello may be, up to 16 EiB: nothing sent."""
    ch = _authenticated(t)
    length = rng.choice([L.HELLO_LIMIT + 1, 4 * GB, 1 << 40, (1 << 64) - 1])
    send_raw(ch.sock, header(ch, length))
    return ch.sock


def random_header(t: Target, rng: random.Random) -> socket.socket:
    """A header (and its MAC on TCP) of random bytes, then random bytes."""
    ch = _authenticated(t)
    size = wire.HEADER.size + (wire.HEADER_TAG if ch._out_key else 0)
    send_raw(ch.sock, rng.randbytes(size + rng.randrange(0, 100)))
    return ch.sock


def out_of_order(t: Target, rng: random.Random) -> socket.socket:
    """A well-made frame with another number than the first's (a replay, reordered)."""
    ch = _authenticated(t)
    data = P.dumps(P.Hello(0, 1, 0, 1, 1, "fuzz", False))
    head = header(ch, len(data), seq=rng.randrange(1, 1 << 64))
    tag = hmac.new(ch._out_key, head + data, hashlib.sha256).digest() if ch._out_key else b""
    send_raw(ch.sock, head + data + tag)
    return ch.sock


def cut_short(t: Target, rng: random.Random) -> socket.socket:
    """A frame that claims more than comes, then the end."""
    ch = _authenticated(t)
    length = rng.randrange(1, L.HELLO_LIMIT)
    send_raw(ch.sock, header(ch, length) + rng.randbytes(rng.randrange(0, min(length, 200))))
    end(ch.sock)
    return ch.sock


def not_a_message(t: Target, rng: random.Random) -> socket.socket:
    """A well-made frame whose payload is random bytes, or a pickle that would run code."""
    ch = _authenticated(t)
    payload = rng.choice(
        [
            rng.randbytes(rng.randrange(0, 300)),
            pickle.dumps(os.system),
            pickle.dumps({"a": "dict"}),
            b"\x80\x05" + rng.randbytes(rng.randrange(0, 300)),  # a pickle's start, then noise
        ]
    )
    ch.send_bytes(payload)
    return ch.sock


CASES = [
    random_bytes,
    truncated_handshake,
    wrong_magic,
    wrong_token,
    claims_too_much,
    random_header,
    out_of_order,
    cut_short,
    not_a_message,
]


def barrage(t: Target, lis: L.Listener, n: int, monkeypatch, workers: int = 16) -> list[str]:
    """``n`` peers of every kind, ``workers`` at once: each is closed by the listener,
    and each counted once. Returns the listener's refusals (taken)."""
    # peers that stop short and stay are refused at the deadline: a short one
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 2 * DEADLINE)
    rng = random.Random(SEED)
    plan = [(CASES[i % len(CASES)], random.Random(rng.random())) for i in range(n)]

    def one(case) -> tuple[str, float | None]:
        make, r = case
        sock = make(t, r)
        try:
            return make.__name__, closed_within(sock, WAIT)
        finally:
            sock.close()

    with ThreadPoolExecutor(workers) as ex:
        held = [name for name, took in ex.map(one, plan) if took is None]
    assert held == [], f"peers the listener did not close: {held}"
    return wait_refusals(lis, n)


def assert_says_why(lines: list[str]) -> None:
    """The refusals of a barrage: folded, and each kind said in words."""
    text = "\n".join(lines)
    assert "it did not prove it holds the token (a wrong token?)" in text
    assert "FrameError: a frame of " in text
    assert "is over the limit of 65,536" in text
    assert "FrameError: a frame came out of order" in text
    assert "UnpicklingError" in text
    assert len(lines) <= L.REASONS_KEPT + 1  # folded: not one line per peer


class Peak:
    """How much this process's resident memory rose, at its peak, since this was made: the
    kernel's high-water mark (VmHWM), reset here, so that a buffer allocated and freed in
    between counts too. Where it cannot be reset, the resident memory now, less before."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to what is resident now
            self.resettable = True
        except OSError:
            self.resettable = False
        self.before = psutil.Process().memory_info().rss

    def rose(self) -> int:
        if self.resettable:
            with open("/proc/self/status") as f:
                hwm = re.search(r"VmHWM:\s+(\d+) kB", f.read())
            if hwm:
                return int(hwm.group(1)) * 1024 - self.before
        return psutil.Process().memory_info().rss - self.before


def listener_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]


def assert_ended(lis: L.Listener) -> None:
    """A closed listener's thread has ended and it holds no connection."""
    assert not lis.running
    assert lis.pending == 0


def slow_peer(t: Target, authenticated: bool) -> tuple[float | None, int]:
    """A peer that sends one byte a second (its answer to the challenge, or, holding the
    token, its hello): (seconds until the listener closed it, bytes it had sent)."""
    start = time.monotonic()
    if authenticated:
        ch = t.channel()
        sock = ch.sock
        data = header(ch, 100) + bytes(100 + (wire.TAG if ch._out_key else 0))
    else:
        sock = t.raw()
        data = secrets.token_bytes(HS.NONCE + wire.TAG)
    try:
        sent = 0
        for byte in data[: int(2 * SLOW_DEADLINE) + 3]:  # (bounded: the listener cuts it first)
            send_raw(sock, bytes([byte]))
            sent += 1
            if closed_within(sock, 1.0) is not None:
                return time.monotonic() - start, sent
        return None, sent
    finally:
        sock.close()


def slow_peers_are_cut_at_the_deadline(t: Target, lis: L.Listener, monkeypatch) -> list[str]:
    """Two slow peers before the handshake, two holding the token (slow with their hello):
    each refused about SLOW_DEADLINE s after it connected (its deadline runs from its
    accept), however often its bytes come. Returns the refusals."""
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", SLOW_DEADLINE)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda a: slow_peer(t, a), [False] * 2 + [True] * 2))
    for took, sent in got:
        assert took is not None, got  # never cut: a deadline per byte, or none
        assert took >= 0.9 * SLOW_DEADLINE, got  # not before its deadline
        assert sent <= SLOW_DEADLINE + 2, got  # a byte a second: cut at the deadline
    lines = wait_refusals(lis, 4)
    assert any(
        line.endswith("it did not finish the handshake in time (2 times)") for line in lines
    ), lines
    assert any(
        line.endswith(f"it did not say hello within {SLOW_DEADLINE:g} s (2 times)")
        for line in lines
    ), lines
    return lines


def silent_crowd(t: Target, lis: L.Listener, n: int, good, monkeypatch) -> None:
    """``n`` peers that connect and say nothing, at once: ``good()`` (a good peer, started
    while they wait) gets through before any of them is refused, the listener still uses
    its one thread, and each of them is refused at the deadline."""
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3 * DEADLINE)
    threads = len(listener_threads(lis.name))
    crowd = [t.raw() for _ in range(n)]
    try:
        assert all(s.recv(1) for s in crowd)  # each greeted: each is in its handshake
        result: list = []
        peer = threading.Thread(target=lambda: result.append(good()))
        peer.start()
        most = threads
        while peer.is_alive():
            most = max(most, len(listener_threads(lis.name)))
            peer.join(0.01)
        assert result == [True], "the good peer did not get through"
        assert lis.refusals() == []  # through while the crowd still waited (not behind it)
        assert most == threads, most  # no thread per peer
        assert [s for s in crowd if closed_within(s, WAIT) is None] == []
    finally:
        for s in crowd:
            s.close()
    lines = wait_refusals(lis, n)
    assert all(
        line.split(": ", 1)[1].startswith("it did not finish the handshake in time")
        for line in lines
    ), lines


# ---------------------------------------------------------------- the notebook's listener


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """An attached pool of one rank, a real worker started by hand over TCP:
    (pool, a Target for its listener)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    token_file = tmp / "token"
    remote.read_or_create_token(str(token_file))  # (mode 0600: the worker checks)
    token = token_file.read_bytes().strip()
    pool = Pool(1, listen=("127.0.0.1", 0), token=token, start_timeout=60)
    address = pool.listen()
    host, port = address.rsplit(":", 1)
    log = open(tmp / "worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        worker_cmd(address, token_file),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=lone_worker_env(),
        start_new_session=True,
    )
    try:
        pool.start()
        yield pool, Target((host, int(port)), "AF_INET", token)
    finally:
        pool.stop()
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        assert_ended(pool.listener)


def cell(pool: Pool) -> list[str]:
    """A cell runs on the rank and gives its value; returns the cell's notes."""
    _, _, end = collect(pool.run("1 + 1", want_values=True))
    assert end.values == {0: 2}
    assert not end.errors
    return list(end.notes)


@pytest.fixture
def pool_and_target(lone):
    pool, target = lone
    cell(pool)
    pool.listener.refusals(take=True)
    return pool, target


def test_a_barrage_of_bad_peers_is_refused_and_the_pool_works_on(pool_and_target, monkeypatch):
    pool, t = pool_and_target
    peak = Peak()
    lines = barrage(t, pool.listener, 270, monkeypatch)  # 30 of each kind, 16 at once
    grew = peak.rose()
    assert_says_why(lines)
    assert all(
        line.startswith("refused a connection from 127.0.0.1: ")
        or line.startswith("refused connections for other reasons too")
        for line in lines
    )
    assert cell(pool) == []  # (the refusals were taken above)
    # a tenth of the peers claimed 4 GiB to 16 EiB each: none of it was allocated
    assert grew < 50 * MB, grew


def test_oversized_frames_after_the_hello_allocate_nothing(pool_and_target, monkeypatch):
    """Peers that hold the token and pass as a host's relay, then claim 8 GiB frames (under
    the built-in MAX_FRAME, over the one set here): each connection is closed on the
    header alone, the notebook's memory stays put, the cells go on."""
    pool, t = pool_and_target
    monkeypatch.setattr(wire, "MAX_FRAME", 1 * MB)
    peak = Peak()
    relays = []
    for i in range(24):  # 192 GiB claimed in all
        ch = t.channel()
        ch.send_bytes(P.dumps(P.RelayHello(f"fuzz{i}", 1000 + i)))
        send_raw(ch.sock, header(ch, 8 * GB))
        relays.append(ch)
    notes: list[str] = []
    for _ in range(10):  # each is read once the pool's hub takes it in (in a cell)
        notes += cell(pool)
        if sum("relay was closed" in n for n in notes) == len(relays):
            break
    closed = sorted(n for n in notes if "relay was closed" in n)
    assert closed == sorted(
        f"the connection of host fuzz{i}'s relay was closed: what it sent failed a check: "
        f"a frame of {8 * GB:,} bytes is over the limit of {MB:,}"
        for i in range(24)
    )
    assert [closed_within(ch.sock, WAIT) is not None for ch in relays] == [True] * 24
    for ch in relays:
        ch.close()
    assert peak.rose() < 50 * MB, peak.rose()
    assert cell(pool) == []


def test_a_peer_sending_a_byte_a_second_is_cut_at_the_whole_handshake_deadline(
    pool_and_target, monkeypatch
):
    pool, t = pool_and_target
    slow_peers_are_cut_at_the_deadline(t, pool.listener, monkeypatch)
    cell(pool)


def test_hundreds_of_peers_at_once_and_a_good_one_still_gets_through(pool_and_target, monkeypatch):
    pool, t = pool_and_target
    peak = Peak()
    # 200 garbage peers, before and after the handshake, 64 at once
    barrage(t, pool.listener, 200, monkeypatch, workers=64)

    def good() -> bool:
        """A peer that holds the token and passes as a host's relay: the pool's hub
        takes it in (seen in the next cell)."""
        ch = t.channel()
        ch.send_bytes(P.dumps(P.RelayHello("good-host", 4242)))
        good.ch = ch
        return True

    # 96 silent peers: a good peer does not wait behind them
    silent_crowd(t, pool.listener, 96, good, monkeypatch)
    cell(pool)
    assert [r.host for r in pool.hub.relays if not r.conn.closed] == ["good-host"]
    good.ch.send_bytes(pickle.dumps([]))  # a relay's (empty) frame: it stays
    cell(pool)
    assert [r.host for r in pool.hub.relays if not r.conn.closed] == ["good-host"]
    good.ch.close()
    cell(pool)
    assert [r.host for r in pool.hub.relays if not r.conn.closed] == []
    assert peak.rose() < 50 * MB, peak.rose()


# ---------------------------------------------------------------- a host relay's listener


class Host:
    """nbddp's relay in this process (as tests/hosts/test_relay.py runs it), its notebook end
    played by hand, and rank 0 of the host connected through it."""

    def __init__(self, folder) -> None:
        self.token = secrets.token_bytes(32)
        self.path = str(folder / "relay.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(256)  # (as relay.start)
        self.notebook, up = self.channel_pair()
        self.relay = relay_carry.Relay(up, sock, self.token)
        self.serving = threading.Thread(target=self.relay.serve, args=(WAIT,))
        self.serving.start()
        self.target = Target(self.path, "AF_UNIX", self.token)
        self.ranks: dict[int, wire.Channel] = {}
        self.listener: L.Listener | None = None  # the relay's (set by the fixture)
        self.join(0)

    def channel_pair(self) -> tuple[wire.Channel, wire.Channel]:
        a, b = socket.socketpair()
        made = {}
        t = threading.Thread(target=lambda: made.update(s=HS.server_handshake(a, self.token, 10)))
        t.start()
        theirs = HS.client_handshake(b, self.token, 10)
        t.join()
        return made["s"], theirs

    def up(self, until) -> list[tuple]:
        """Frames up to the notebook until an item ``until`` accepts; their items."""
        items: list[tuple] = []
        while not any(until(i) for i in items):
            assert self.notebook.poll(WAIT), items
            items += P.loads_plain(self.notebook.recv_bytes())
        return items

    def join(self, rank: int) -> bool:
        """A good rank of this host connects (its control connection): the relay passes
        its hello up."""
        conn = self.target.channel()
        conn.send_bytes(P.dumps(P.Hello(rank, 8, rank, 8, os.getpid(), "here", False)))
        self.ranks[rank] = conn
        assert self.up(lambda i: i[:2] == ("hello", rank))[-1][:2] == ("hello", rank)
        return True

    def cell(self, number: int) -> None:
        """A Run to every rank that joined (one frame down); each answers Done, and the
        relay passes them up (ranks that end together grouped in one item)."""
        run = P.dumps(P.Run(number, ""))
        self.notebook.send_bytes(pickle.dumps((tuple(self.ranks), number, run)))
        for conn in self.ranks.values():
            assert conn.poll(WAIT)
            assert P.loads(conn.recv_bytes()).cell == number
            conn.send_bytes(P.dumps(P.Done(number, "ok")))
        done: list[int] = []  # (ranks that end together may come in one item or several)
        while sorted(done) != sorted(self.ranks):
            for item in self.up(lambda i: i[0] == "done"):
                if item[0] == "done":
                    assert item[2] == P.dumps(P.Done(number, "ok")), item
                    done += item[1]

    def close(self) -> None:
        self.notebook.close()  # the relay ends with the notebook's connection
        self.serving.join(WAIT)
        assert not self.serving.is_alive()
        for conn in self.ranks.values():
            conn.close()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A relay in this process and rank 0 of its host; its listener kept to read its
    refusals. Ended with the test, its threads too."""
    listeners: list[L.Listener] = []

    class Seen(L.Listener):  # the relay's listener, kept to read its refusals
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            listeners.append(self)

    monkeypatch.setattr(relay_carry, "Listener", Seen)
    h = Host(tmp_path)
    (h.listener,) = listeners
    assert h.listener.name == "relay"
    h.listener.refusals(take=True)
    yield h
    h.close()
    assert_ended(h.listener)


def test_a_barrage_at_a_relay_is_refused_and_its_ranks_go_on(host, monkeypatch):
    peak = Peak()
    host.cell(1)
    lines = barrage(host.target, host.listener, 180, monkeypatch, workers=8)
    grew = peak.rose()
    assert_says_why(lines)
    assert host.join(1)  # a good rank still gets through
    host.cell(2)
    assert grew < 50 * MB, grew


def test_a_relays_slow_peers_are_cut_at_the_whole_handshake_deadline(host, monkeypatch):
    slow_peers_are_cut_at_the_deadline(host.target, host.listener, monkeypatch)
    host.cell(1)


def test_slow_hellos_are_one_refusal_line(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", DEADLINE)
    path = str(tmp_path / "s.sock")
    lis = L.Listener(L.bind_unix(path), b"token", lambda *a: None, name="fold").start()
    try:
        t = Target(path, "AF_UNIX", b"token")
        with ThreadPoolExecutor(3) as ex:  # (they hold the token; their hello is slow)
            assert all(took for took, _ in ex.map(lambda _: slow_peer(t, True), range(3)))
        lines = wait_refusals(lis, 3)
    finally:
        lis.close()
    assert len(lines) == 1, lines
    assert lines[0].endswith(" (3 times)")


def test_hundreds_of_peers_at_once_at_a_relay_and_a_good_rank_gets_through(host, monkeypatch):
    barrage(host.target, host.listener, 200, monkeypatch, workers=64)
    silent_crowd(host.target, host.listener, 96, lambda: host.join(1), monkeypatch)
    host.cell(1)


def test_a_ranks_oversized_frame_closes_it_alone_and_allocates_nothing(host, monkeypatch):
    """A rank that holds the token, past its hello, claims 8 GiB frames (under the built-in
    MAX_FRAME, over the one set here): the relay drops that rank on the header alone."""
    monkeypatch.setattr(wire, "MAX_FRAME", 1 * MB)
    peak = Peak()
    for rank in range(1, 9):  # 64 GiB claimed in all
        host.join(rank)
        conn = host.ranks.pop(rank)
        send_raw(conn.sock, header(conn, 8 * GB))
        assert host.up(lambda i, rank=rank: i == ("gone", rank))[-1] == ("gone", rank)
        assert closed_within(conn.sock, WAIT) is not None
        conn.close()
    assert peak.rose() < 50 * MB, peak.rose()
    host.cell(1)  # rank 0 goes on


@pytest.mark.parametrize(
    "payload",
    [b"not a pickle", pickle.dumps(os.system), pickle.dumps({"a": "dict"})],
    ids=["garbage", "a-function", "a-dict"],
)
def test_a_rank_sending_what_is_not_a_message_is_dropped_alone(host, payload):
    """Past its hello, a rank sends what is not a message: that rank is dropped (as the
    notebook's hub drops such a rank), the relay and its other ranks go on."""
    host.join(1)
    host.ranks[1].send_bytes(payload)
    deadline = time.monotonic() + WAIT
    while not host.notebook.poll(0.05):
        assert host.serving.is_alive(), "the relay ended: every rank of its host is lost"
        assert time.monotonic() < deadline
    assert host.up(lambda i: i == ("gone", 1))[-1] == ("gone", 1)
    assert host.serving.is_alive()
    host.ranks.pop(1).close()
    host.cell(1)


# ---------------------------------------------------------------- the ranks' side


def fake_server(greeting: bytes) -> tuple[socket.socket, threading.Thread]:
    """A TCP server that says ``greeting`` to the one client it accepts and waits."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(greeting)
                conn.settimeout(3 * DEADLINE)
                with contextlib.suppress(OSError):
                    while conn.recv(4096):
                        pass

    t = threading.Thread(target=serve)
    t.start()
    return srv, t


@pytest.mark.parametrize(
    ("greeting", "says"),
    [
        (b"nbddp-w0m" + bytes(32), "does not speak this nbddp's protocol"),
        (b"GET / HTTP/1.1\r\n" * 4, "does not speak this nbddp's protocol"),
        (HS.MAGIC + b"p" + bytes(32), "speaks mode"),
        (HS.MAGIC + b"t" + bytes(32), "uses TLS"),
        (HS.MAGIC + b"m" + bytes(20), "in time"),  # cut short, then silence
        (HS.MAGIC + b"m" + bytes(32) + HS.REFUSED, "refused this token"),
        (HS.MAGIC + b"m" + bytes(32) + HS.OK + bytes(32), "did not prove it holds"),
    ],
)
def test_a_rank_that_reaches_something_else_fails_its_handshake_in_time(greeting, says):
    srv, t = fake_server(greeting)
    try:
        with (  # (a handshake without its deadline would outlast the test's timeout)
            pytest.raises(HS.HandshakeError, match=re.escape(says)),
            socket.create_connection(srv.getsockname()) as sock,
        ):
            HS.client_handshake(sock, b"the token", DEADLINE)
    finally:
        t.join(WAIT)
