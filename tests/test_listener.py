"""The listener (nbddp.listener): accept, authenticate, refuse and count; and that a crowd
of peers that never authenticate cannot keep a rank out.

Peers are played by hand on a Unix socket: ``nbddp.HS.connect`` with the right or a
wrong token, raw sockets that send garbage or nothing. Crowds (hundreds of idle
connections, a slowloris, a garbage sender) come from a process of their own
(tests/crowd.py), so that the descriptors this process holds are the listener's.
"""

from __future__ import annotations

import errno
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import collect, end_all, free_port, lone_worker_env, start, worker_cmd
from nbddp import Pool, remote, wire
from nbddp import handshake as HS
from nbddp import listener as L
from nbddp import protocol as P

TOKEN = b"the-pools-token"
WAIT = 30  # seconds a queue is waited on before the test fails (never reached when it passes)
WRONG_TOKEN = "it did not prove it holds the token (a wrong token?)"


def client(path: str, token: bytes = TOKEN) -> wire.Channel:
    """An authenticated connection to the listener (``HS.Refused`` for a wrong token)."""
    return HS.connect(path, "AF_UNIX", token, timeout=WAIT)


def hello(rank: int = 0) -> P.Hello:
    return P.Hello(rank, 2, rank, 2, 1000 + rank, "here", False)


class Recording(L.Listener):
    """A listener whose refusals also go to a queue, to wait on them without sleeping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused_q: queue.SimpleQueue = queue.SimpleQueue()

    def refuse_line(self, line: str) -> None:
        super().refuse_line(line)
        self.refused_q.put(line)

    def next_refusal(self) -> str:
        return self.refused_q.get(timeout=WAIT)


class Flaky(socket.socket):
    """A listening socket whose next ``fail`` accepts fail as with too many open files."""

    fail = 0

    def accept(self):
        if self.fail:
            self.fail -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().accept()


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "pool.sock")


@pytest.fixture
def started(path):
    """Start a listener (``started(sock=None)``); each is closed and its thread joined."""
    made = []

    def start(sock=None, name="t-listen", **kwargs):
        peers: queue.SimpleQueue = queue.SimpleQueue()
        lis = Recording(
            sock or L.bind_unix(path), TOKEN, lambda *a: peers.put(a), name=name, **kwargs
        ).start()
        lis.peers = peers
        made.append(lis)
        return lis

    yield start
    for lis in made:
        lis.close()  # its thread ends within 0.5 s (test_close_... joins one)


def good_peer(path: str, msg: object = None):
    c = client(path)
    c.send_bytes(P.dumps(msg or hello()))
    return c


def test_a_good_peer_reaches_on_peer_with_its_hello_and_raw_bytes(started, path):
    lis = started()
    c = good_peer(path, hello(1))
    conn, got, raw = lis.peers.get(timeout=WAIT)
    assert got == hello(1)
    assert raw == P.dumps(hello(1))
    conn.send_bytes(b"reply")  # the connection is the peer's, authenticated both ways
    assert c.recv_bytes() == b"reply"
    assert lis.refusals() == []
    conn.close()
    c.close()


def test_a_wrong_token_is_refused(started, path):
    lis = started()
    with pytest.raises(HS.Refused):
        client(path, b"another token")
    assert lis.next_refusal() == f"refused a connection: {WRONG_TOKEN}"
    assert lis.peers.empty()
    assert lis.refusals() == [f"refused a connection: {WRONG_TOKEN}"]


def test_garbage_is_refused(started, path):
    lis = started()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        # as many bytes as the answer to the challenge (a nonce and a proof), all garbage
        s.sendall(b"garbage!" * ((HS.NONCE + wire.TAG) // 8))
        line = lis.next_refusal()
    assert line == f"refused a connection: {WRONG_TOKEN}"
    assert lis.peers.empty()


@pytest.mark.parametrize(
    ("first", "says"),
    [
        (b"not a pickle at all", "UnpicklingError"),
        (pickle.dumps({"a": "dict"}), "not a protocol message: dict"),
        (pickle.dumps(print), "UnpicklingError: a control message may not name builtins.print"),
        (pickle.dumps(os.system), f"may not name {os.system.__module__}.system"),
    ],
)
def test_an_authenticated_peer_whose_hello_is_not_a_message_is_refused(started, path, first, says):
    lis = started()
    c = client(path)
    c.send_bytes(first)
    assert says in lis.next_refusal()
    assert lis.peers.empty()
    c.close()


def test_a_silent_peer_does_not_delay_a_good_peer_after_it(started, path, monkeypatch):
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)  # the silent one would wait an hour
    lis = started()
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.recv(1)  # the listener is now waiting for its answer to the challenge
    c = good_peer(path, hello(1))
    assert lis.peers.get(timeout=WAIT)[1] == hello(1)
    assert lis.refusals() == []  # the silent one still waits
    silent.close()  # it goes: now it is refused (its unread greeting: reset, or ended)
    assert lis.next_refusal().startswith("refused a connection: ")
    assert lis.peers.empty()
    c.close()


def test_a_first_frame_over_the_hello_limit_is_refused_unread(started, path):
    lis = started()
    c = client(path)
    # a header claiming a terabyte, and no payload: refused on the header alone
    c.sock.sendall(wire.HEADER.pack(0, 1 << 40))
    assert lis.next_refusal() == (
        f"refused a connection: FrameError: a frame of {1 << 40:,} bytes is over the limit "
        f"of {L.HELLO_LIMIT:,}"
    )
    assert lis.peers.empty()
    c.close()


def test_past_the_cap_the_oldest_of_the_biggest_crowd_is_closed(started, monkeypatch):
    """At MAX_PENDING connections that have not proven the token, the next one closes the
    oldest of the address that holds the most: a crowd makes room from itself, and a
    connection of another address that came before it stays."""
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)  # the silent peers are waited for
    monkeypatch.setattr(L, "MAX_PENDING", 4)
    lis = started(L.bind_tcp("127.0.0.1", 0))
    port = lis.sock.getsockname()[1]

    def silent(source: str) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(source, 0))
        s.recv(1)  # its greeting came: the listener holds it in its handshake
        return s

    other = silent("127.0.0.3")  # the oldest of all, alone at its address
    crowd = [silent("127.0.0.2") for _ in range(3)]
    try:
        c = HS.connect(("127.0.0.1", port), "AF_INET", TOKEN, timeout=WAIT)  # the fifth
        c.send_bytes(P.dumps(hello(1)))
        assert lis.peers.get(timeout=WAIT)[1] == hello(1)
        assert lis.next_refusal() == (
            "refused a connection from 127.0.0.2: closed in its handshake to make room (4 "
            "connections had not proven the token yet; the oldest of the address holding "
            "the most goes)"
        )
        assert _closed(crowd[0])  # the oldest of the crowd
        assert lis.pending == 3  # the other address's, and the crowd's two youngest
        assert lis.refusals() == [
            "refused a connection from 127.0.0.2: closed in its handshake to make room (4 "
            "connections had not proven the token yet; the oldest of the address holding "
            "the most goes)"
        ]
        c.close()
    finally:
        for s in [other, *crowd]:
            s.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock`` (what it said before is read and dropped)."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


def _future_message(monkeypatch) -> bytes:
    """The pickle of a message class that ``nbddp.protocol`` of this version lacks."""

    class NoSuchMessage:
        pass

    NoSuchMessage.__module__ = "nbddp.protocol"
    NoSuchMessage.__qualname__ = "NoSuchMessage"
    monkeypatch.setattr(P, "NoSuchMessage", NoSuchMessage, raising=False)
    data = pickle.dumps(NoSuchMessage())
    monkeypatch.delattr(P, "NoSuchMessage")
    return data


def test_a_hello_naming_a_class_this_version_lacks_says_another_version(started, path, monkeypatch):
    data = _future_message(monkeypatch)
    assert b"NoSuchMessage" in data
    lis = started()
    c = client(path)
    c.send_bytes(data)
    line = lis.next_refusal()
    assert "another nbddp version" in line
    assert f"protocol {P.PROTOCOL_VERSION}" in line
    assert "NoSuchMessage" in line
    c.close()


def test_a_hundred_refusals_for_one_reason_are_one_line(started, path):
    lis = started()
    for _ in range(100):
        with pytest.raises(HS.Refused):
            client(path, b"wrong")
    lines = {lis.next_refusal() for _ in range(100)}
    assert len(lines) == 1
    assert lis.refusals() == [f"{lines.pop()} (100 times)"]


def test_distinct_reasons_are_capped():
    lis = L.Listener(socket.socket(socket.AF_UNIX), TOKEN, lambda *a: None)
    for i in range(L.REASONS_KEPT + 8):
        lis.refuse(("10.0.0.9", 4000 + i), f"reason {i}")
    lis.refuse(("10.0.0.9", 1), "reason 0")  # a reason already kept is still counted
    lines = lis.refusals()
    assert len(lines) == L.REASONS_KEPT + 1
    assert lines[0] == "refused a connection from 10.0.0.9: reason 0 (2 times)"
    assert lines[-1] == "refused connections for other reasons too (8 times)"
    lis.sock.close()


def test_taking_the_refusals_empties_them():
    lis = L.Listener(socket.socket(socket.AF_UNIX), TOKEN, lambda *a: None)
    lis.refuse_line("refused rank 9 of a world of 10: this pool waits for 2 ranks")
    assert lis.refusals(take=True) == [
        "refused rank 9 of a world of 10: this pool waits for 2 ranks"
    ]
    assert lis.refusals() == []
    assert lis.refusals(take=True) == []
    lis.sock.close()


def test_the_accept_loop_survives_a_failed_accept(started, path):
    sock = L.bind_unix(path)
    flaky = Flaky(fileno=sock.detach())
    flaky.fail = 1
    lis = started(flaky)
    c = good_peer(path, hello(1))  # its first accept fails; the next one takes it
    assert lis.peers.get(timeout=WAIT)[1] == hello(1)
    assert flaky.fail == 0
    (line,) = lis.refusals()
    assert "accepting failed" in line
    assert "still listening" in line
    c2 = good_peer(path, hello(0))  # and it goes on accepting
    assert lis.peers.get(timeout=WAIT)[1] == hello(0)
    c.close()
    c2.close()


def test_close_stops_accepting_and_leaves_no_thread(started, path):
    lis = started(name="t-closing")
    (accepting,) = [t for t in threading.enumerate() if t.name == "t-closing-accept"]
    assert lis.open
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.recv(1)  # in its handshake
    fds = open_fds()
    lis.close()
    assert not lis.open
    assert not lis.running  # once close returned: its thread ended
    assert lis.pending == 0
    assert _closed(silent)  # the handshake in flight was dropped
    assert open_fds() <= fds - 4  # its socket, the listening one, the selector, the wake pipe
    silent.close()
    accepting.join(WAIT)  # it sees the close within its 0.5 s select cycle
    assert not accepting.is_alive()
    with pytest.raises(ConnectionRefusedError):
        HS.connect(path, "AF_UNIX", TOKEN, timeout=0)  # (no retry: nothing listens)
    lis.refuse_line("still readable")
    assert lis.refusals() == ["still readable"]


# ---------------------------------------------------------------- crowds

CROWD = Path(__file__).with_name("crowd.py")


def open_fds() -> int:
    """Descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


class Crowd:
    """``idle`` connections that never speak, a slowloris and a garbage peer, from a
    process of their own, at ``port``; ended with :meth:`close`."""

    def __init__(self, port: int, idle: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CROWD), "127.0.0.1", str(port), str(idle)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout.readline().split() == ["ready", str(idle)]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(WAIT)
        finally:
            end_all([self.proc])


def wait_accepted(before: int, at_least: int) -> int:
    """Once the listener holds ``at_least`` descriptors more than ``before``: how many."""
    deadline = time.monotonic() + WAIT
    while open_fds() - before < at_least:
        assert time.monotonic() < deadline, open_fds() - before
        time.sleep(0.02)
    return open_fds() - before


@pytest.mark.parametrize("idle", [200, 1000])
def test_a_good_peer_gets_through_a_crowd_at_once(started, monkeypatch, idle):
    """200 or 1,000 silent connections, a slowloris and a garbage peer: a peer holding the
    token finishes its handshake within its own 5 s (it waited for a thread behind the
    silent ones before), and the listener holds at most MAX_PENDING of them."""
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)  # the crowd is waited for all along
    lis = started(L.bind_tcp("127.0.0.1", 0))
    port = lis.sock.getsockname()[1]
    before = open_fds()
    crowd = Crowd(port, idle)
    try:
        wait_accepted(before, min(idle, L.MAX_PENDING))
        c = HS.connect(("127.0.0.1", port), "AF_INET", TOKEN, timeout=WAIT)
        c.send_bytes(P.dumps(hello(1)))
        conn, got, _ = lis.peers.get(timeout=WAIT)
        assert got == hello(1)
        held = open_fds() - before
        assert held <= L.MAX_PENDING + 4, held  # (the good peer's ends, the crowd's pipes)
        text = "\n".join(lis.refusals())
        assert "it did not prove it holds the token" in text  # the garbage
        assert ("closed in its handshake to make room" in text) == (idle > L.MAX_PENDING)
        conn.close()
        c.close()
    finally:
        crowd.close()


def direct_ranks(address: str, token_file, n: int, log) -> list[subprocess.Popen]:
    """``n`` real ranks started by hand, each its own host (no relay): three TCP
    connections each to the notebook, each through the handshake."""
    master = free_port()
    procs = []
    for rank in range(n):
        env = lone_worker_env(n, rank)
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(master))
        procs.append(start(worker_cmd(address, token_file), log, env))
    return procs


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "idle"), [(2, 200), (4, 1000)])
def test_real_ranks_attach_past_a_crowd_and_a_cell_runs(tmp_path, monkeypatch, ranks, idle):
    """An attached pool's TCP listener under a crowd (idle connections, a slowloris, a
    garbage peer): its real ranks attach, a cell with a collective runs, and the notebook's
    descriptors stay bounded (before, the ranks gave up after 5 s: "did not finish the
    handshake in time", and each waiting peer held a descriptor, up to 4,096)."""
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)  # the crowd is waited for all along
    token_file = tmp_path / "token"
    remote.read_or_create_token(str(token_file))
    token = token_file.read_bytes().strip()
    pool = Pool(ranks, listen=("127.0.0.1", 0), token=token, start_timeout=90)
    address = pool.listen()
    log = open(tmp_path / "ranks.log", "wb")  # noqa: SIM115
    before = open_fds()
    crowd = Crowd(int(address.rsplit(":", 1)[1]), idle)
    procs: list[subprocess.Popen] = []
    try:  # (the crowd's two pipes to this process: held too)
        assert wait_accepted(before, min(idle, L.MAX_PENDING)) <= L.MAX_PENDING + 2
        procs = direct_ranks(address, token_file, ranks, log)
        pool.start()
        code = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        _, _, end = collect(pool.run(code, want_values=True))
        assert end.values == dict.fromkeys(range(ranks), float(ranks))
        held = open_fds() - before  # the crowd's, the ranks' three connections, the hub's
        assert held <= L.MAX_PENDING + 3 * ranks + 16, held
        # the crowd's refusals, said with the cell (the garbage, the room made)
        notes = "\n".join(end.notes)
        assert "refused a connection from 127.0.0.1: it did not prove it holds the token" in notes
        assert ("closed in its handshake to make room" in notes) == (idle > L.MAX_PENDING)
    finally:
        crowd.close()
        pool.stop()
        end_all(procs)
        log.close()


def test_tls_peers_stuck_in_their_handshake_do_not_delay_a_good_one(started, monkeypatch):
    """With --tls, peers that stop inside TLS's own handshake (a ClientHello cut short, or
    none) wait in the same selector: a good TLS peer is heard while they wait."""
    from nbddp.tls import make_server_tls, pinned_client_tls

    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)
    server, pin = make_server_tls()
    lis = started(L.bind_tcp("127.0.0.1", 0), tls=server)
    address = ("127.0.0.1", lis.sock.getsockname()[1])
    stuck = []
    for i in range(40):
        s = socket.create_connection(address, timeout=WAIT)
        s.recv(len(HS.MAGIC) + 1 + HS.NONCE)  # the greeting, in the clear: TLS is next
        if i % 2:
            s.sendall(b"\x16\x03\x01\x02\x00\x01")  # a TLS record's header, then nothing
        stuck.append(s)
    try:
        c = HS.connect(address, "AF_INET", TOKEN, timeout=WAIT, tls=pinned_client_tls(pin))
        c.send_bytes(P.dumps(hello(1)))
        conn, got, _ = lis.peers.get(timeout=WAIT)
        assert got == hello(1)
        assert conn.mode == "tls"
        assert lis.pending == 40
        assert lis.refusals() == []
        conn.close()
        c.close()
    finally:
        for s in stuck:
            s.close()
