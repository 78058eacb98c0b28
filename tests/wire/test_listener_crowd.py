"""A crowd of peers that never authenticate cannot keep a rank out of the listener
(nbddp.wire.listener): hundreds of idle connections, a slowloris and a garbage peer, from a
process of their own (tests/crowd.py) so that the descriptors this process holds are the
listener's; a cap on the connections that have not proven the token; TLS peers stuck in
TLS's own handshake. Then real attached ranks join past a crowd and a cell runs.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_listener import TOKEN, WAIT, Recording, _closed, hello, open_fds

from helpers import collect, end_all, free_port, lone_worker_env, start, worker_cmd
from nbddp import Pool
from nbddp.notebook import remote
from nbddp.wire import handshake as HS
from nbddp.wire import listener as L
from nbddp.wire import protocol as P

CROWD = Path(__file__).parents[1] / "crowd.py"


@pytest.fixture
def started():
    """Start a listener on ``sock`` (``started(sock, **kwargs)``); each is closed after."""
    made = []

    def start_one(sock, **kwargs):
        peers: queue.SimpleQueue = queue.SimpleQueue()
        lis = Recording(sock, TOKEN, lambda *a: peers.put(a), name="t-crowd", **kwargs).start()
        lis.peers = peers
        made.append(lis)
        return lis

    yield start_one
    for lis in made:
        lis.close()


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
        # the garbage peer is refused (maybe a moment after the good peer got through)
        deadline = time.monotonic() + WAIT
        while "it did not prove" not in (text := "\n".join(lis.refusals())):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "it did not prove it holds the token" in text
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
    try:  # (the crowd's two pipes to this process, and the connection accepted the moment
        # before the oldest is closed to make room for it: held too)
        assert wait_accepted(before, min(idle, L.MAX_PENDING)) <= L.MAX_PENDING + 3
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
    from nbddp.wire.tls import make_server_tls, pinned_client_tls

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
