"""A relay per host (nbddp.hosts.relay): ranks attached from torchrun with several ranks on a
host reach the notebook through one connection per host.

Simulated ranks (tests/simranks.py) use nbddp's own relay as torchrun ranks do, two
hosts of 2, 3, 4 and 8 ranks; real torchrun ranks check collectives, failures,
interrupts and deaths through it at 2, 3, 4 and 8 ranks on one node.
"""

from __future__ import annotations

import os
import pickle
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import simranks
from helpers import collect, free_port, namespace_digests, wait_gone
from nbddp import Pool, PoolClosedError
from nbddp.hosts import relay
from nbddp.notebook import remote
from nbddp.pool.facade import raise_for_end
from nbddp.wire import frames as wire
from nbddp.wire import handshake as HS
from nbddp.wire import protocol as P
from tiers import sizes


def relay_folders(where: str) -> set[str]:
    prefix = f"nbddp-relay-{os.getuid()}-"
    return {f for f in os.listdir(where) if f.startswith(prefix)}


def test_a_relay_is_wanted_for_several_ranks_or_a_held_one_on_a_host_over_tcp():
    assert relay.wanted(True, {"LOCAL_WORLD_SIZE": "8"})
    assert not relay.wanted(True, {"LOCAL_WORLD_SIZE": "1"})
    assert not relay.wanted(True, {})
    assert not relay.wanted(False, {"LOCAL_WORLD_SIZE": "8"})  # a local pool: no hop
    assert not relay.wanted(True, {"LOCAL_WORLD_SIZE": "8", "NBDDP_RELAY": "0"})
    alone = {"LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "r"}  # a held rank alone
    assert relay.wanted(True, alone), "its relay tells its host's loss from its death"
    assert not relay.wanted(True, {**alone, "NBDDP_HOLD": "0"})
    assert not relay.wanted(True, {**alone, "NBDDP_RELAY": "0"})


def test_the_ranks_of_a_node_share_a_relay_and_other_nodes_and_runs_do_not():
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "GROUP_RANK": "0"}
    path = relay.socket_path("10.0.0.1:5000", b"t", env)
    assert path == relay.socket_path("10.0.0.1:5000", b"t", dict(env))
    assert path != relay.socket_path("10.0.0.1:5000", b"t", {**env, "GROUP_RANK": "1"})
    assert path != relay.socket_path("10.0.0.1:5000", b"t", {**env, "MASTER_PORT": "1"})
    assert path != relay.socket_path("10.0.0.1:5000", b"u", env)
    restarted = {**env, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert path != relay.socket_path("10.0.0.1:5000", b"t", restarted)
    assert len(path) < 100  # a Unix socket path must fit in 108 bytes


def channel_pair(token: bytes) -> tuple[wire.Channel, wire.Channel]:
    """Two ends of a Unix socket pair that made nbddp's handshake: (server's, client's)."""
    ours, theirs = socket.socketpair()
    made = {}
    t = threading.Thread(target=lambda: made.update(s=HS.server_handshake(ours, token, 10)))
    t.start()
    client = HS.client_handshake(theirs, token, 10)
    t.join()
    return made["s"], client


def test_a_done_goes_up_after_all_its_rank_wrote_before_it(tmp_path):
    """The relay in this process, a rank played by hand: 1 MB written in one call, then the
    Done at once (more than the socket and one read hold are still unread when the relay
    reads the Done): every byte reaches the notebook before the Done, ten times over."""
    path = str(tmp_path / "relay.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    token = secrets.token_bytes(32)
    notebook, up = channel_pair(token)
    serving = threading.Thread(target=relay.Relay(up, listener, token).serve, args=(30,))
    serving.start()
    control = HS.connect(path, "AF_UNIX", token)
    control.send_bytes(P.dumps(P.Hello(0, 1, 0, 1, os.getpid(), "here", False)))
    streams = {}
    for name in ("stdout", "stderr"):
        streams[name] = HS.connect(path, "AF_UNIX", token)
        streams[name].send_bytes(P.dumps(P.StreamHello(0, os.getpid(), name)))
        # after its hello a stream carries raw bytes, written as a worker writes its fd 1/2
        os.set_blocking(streams[name].fileno(), True)

    def frames(until):
        items = []
        while not any(until(i) for i in items):
            assert notebook.poll(10), items
            items += pickle.loads(notebook.recv_bytes())
        return items

    hellos = []
    while len(hellos) < 3:
        hellos += frames(lambda i: True)
    assert [i[0] for i in hellos] == ["hello"] * 3
    big = os.urandom(1 << 20)
    for cell in range(1, 11):
        notebook.send_bytes(pickle.dumps(((0,), cell, P.dumps(P.Run(cell, "")))))
        assert P.loads(control.recv_bytes()).cell == cell

        def rank(cell=cell):  # its last write returns once queued; the Done at once after
            os.write(streams["stdout"].fileno(), big)
            os.write(streams["stderr"].fileno(), b"last words\n")
            control.send_bytes(P.dumps(P.Done(cell, "ok")))

        playing = threading.Thread(target=rank)
        playing.start()
        items = frames(lambda i: i[0] == "done")
        playing.join()
        assert items[-1] == ("done", (0,), P.dumps(P.Done(cell, "ok")))
        got = {name: b"".join(i[3] for i in items if i[:3] == ("out", 0, name)) for name in streams}
        assert got == {"stdout": big, "stderr": b"last words\n"}
    control.close()
    assert frames(lambda i: i[0] == "gone") == [("gone", 0)]
    serving.join(10)
    assert not serving.is_alive()  # every rank has gone: the relay ends
    for conn in (notebook, *streams.values()):
        conn.close()


# ---------------------------------------------------------------- simulated hosts


@pytest.fixture
def hosts(monkeypatch):
    """``hosts(per_host)``: a pool of two simulated hosts, each behind nbddp's relay; the
    relays' folders in a temporary folder of the test's own (TMPDIR: others' relays, of a
    test run beside this one, are not counted), short enough for a socket's path."""
    where = tempfile.mkdtemp(prefix="nbr")
    monkeypatch.setenv("TMPDIR", where)
    monkeypatch.setattr(tempfile, "tempdir", where)  # (this process's relay.socket_path)
    started = []

    def _hosts(per_host: int) -> Pool:
        n = 2 * per_host
        token = secrets.token_bytes(16)
        pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=60)
        sims = simranks.start(pool.listen(), token, n, 2, per_host=per_host, relay=True)
        started.append((pool, sims))
        return pool.start()

    yield _hosts
    for pool, sims in started:
        relays = [r.pid for r in pool.hub.relays]
        pool.stop()
        for sim in sims:
            sim.wait(30)
        assert wait_gone(relays) == []  # a relay ends with its ranks
    assert relay_folders(where) == set()
    os.rmdir(where)


@pytest.mark.parametrize("per_host", sizes(2, 3, 4, 8, ids="{}"))
def test_every_line_of_every_rank_is_in_before_its_cell_ends(hosts, per_host):
    pool = hosts(per_host)
    assert len(pool.hub.relays) == 2  # one connection per host, not three per rank
    assert all(r.link.relay is not None for r in pool.roster.ranks.values())
    code = (  # 640 kB a rank: more than a socket holds, and than the relay reads at once
        "for i in range(8000):\n    print(rank, i, '.' * 72)\n"
        "import sys\nprint('err', rank, file=sys.stderr)\n"
        "if rank == world_size - 2:\n    raise ValueError(f'rank {rank} is unhappy')"
    )
    for _ in range(2):
        text, _, end = collect(pool.run(code))
        assert list(end.errors) == [2 * per_host - 2]
        assert end.errors[2 * per_host - 2].message == f"rank {2 * per_host - 2} is unhappy"
        for rank in range(2 * per_host):
            assert text[rank, "stdout"] == "".join(f"{rank} {i} {'.' * 72}\n" for i in range(8000))
            assert text[rank, "stderr"] == f"err {rank}\n"


@pytest.mark.parametrize("per_host", sizes(2, 3, 4, 8, ids="{}"))
def test_a_relay_that_dies_mid_cell_ends_the_cell_with_its_hosts_ranks(hosts, per_host):
    pool = hosts(per_host)
    victim = next(r for r in pool.hub.relays if r.host and min(r.ranks) == per_host)
    events = pool.run("import time\ntime.sleep(1.0 if rank < world_size // 2 else 3.0)")
    threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL)).start()
    _, _, end = collect(events)
    died = sorted(r for r, x in end.exits.items() if not x.stopped_by_pool)
    assert died == list(range(per_host, 2 * per_host))  # that host's ranks, the others stopped
    assert not end.errors
    with pytest.raises(PoolClosedError, match="lost a rank"):
        pool.run("x = 1")
    folder = os.path.dirname(
        relay.socket_path(pool.listen(), pool.token, {"GROUP_RANK": "1", "MASTER_PORT": "sim"})
    )
    subprocess.run(["rm", "-rf", folder], check=True)  # SIGKILL left it; the next run reuses it


@pytest.mark.parametrize("per_host", sizes(2, 3, 4, 8, ids="{}"))
def test_a_rank_that_dies_behind_a_relay_ends_the_cell_and_the_others_are_stopped(hosts, per_host):
    pool = hosts(per_host)
    gone = per_host + 1  # on the second host, beside ranks that stay
    _, _, end = collect(pool.run(f"if rank == {gone}:\n    leave()"))
    assert {r: x.stopped_by_pool for r, x in end.exits.items()}[gone] is False
    died = [r for r, x in end.exits.items() if not x.stopped_by_pool]
    assert died == [gone]
    with pytest.raises(PoolClosedError, match="lost a rank"):
        pool.run("x = 1")


def unix_sockets_at(path: str) -> int:
    """Sockets bound to ``path``: its listener and one per connection made to it (Linux
    lists a connection's server side, accepted or not, under the listener's path)."""
    with open("/proc/net/unix") as f:
        return sum(line.split()[-1] == path for line in f.readlines()[1:] if len(line.split()) == 8)


def test_hosts_that_start_before_the_notebook_listens_wait_for_it():
    token = secrets.token_bytes(16)
    port = free_port()
    address = f"127.0.0.1:{port}"
    sims = simranks.start(address, token, 8, 2, per_host=4, relay=True)
    sockets = [
        relay.socket_path(address, token, {"GROUP_RANK": str(h), "MASTER_PORT": "sim"})
        for h in (0, 1)
    ]
    # both relays are up and a rank of each host is connected to its relay (waiting for
    # it to reach the notebook), the notebook not yet: pytest-timeout bounds the wait
    while not all(unix_sockets_at(path) >= 2 for path in sockets):  # the listener, a rank
        assert all(sim.poll() is None for sim in sims), "a simulated host ended early"
        time.sleep(0.01)
    pool = Pool(8, listen=("127.0.0.1", port), token=token, start_timeout=60)
    try:
        pool.start()
        assert len(pool.hub.relays) == 2
        _, _, end = collect(pool.run("rank * 2", want_values=True))
        assert end.values == {}  # (simulated ranks send no values) but every rank ended:
        assert sorted(end.ranks) == list(range(8))
        assert not end.errors
    finally:
        pool.stop()
        for sim in sims:
            sim.wait(30)


# ---------------------------------------------------------------- torchrun through relays


@pytest.fixture(scope="module", params=sizes(2, 3, 4, 8, ids="{}"))
def node(request, tmp_path_factory):
    """One torchrun node of N ranks attached to a pool: its ranks share one relay."""
    n = request.param
    tmp = tmp_path_factory.mktemp(f"node{n}")
    token_file = tmp / "token"
    remote.read_or_create_token(str(token_file))
    token = token_file.read_bytes().strip()
    pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=180, abort_after=0.5)
    address = pool.listen()
    log = open(tmp / "node.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += ["-m", "nbddp.worker", "--connect", address, "--token-file", str(token_file)]
    # a new process that finds no relay gives up after 3 s, not 10 (the killed-relay test
    # waits for torchrun to end); one that finds it connects at once
    env = dict(os.environ, OMP_NUM_THREADS="1", NBDDP_RENEWED_CONNECT="3")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        pool.start()
        yield pool, proc
    finally:
        relays = [r.pid for r in pool.hub.relays]
        pool.stop()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        assert wait_gone(relays) == []


def test_torchrun_ranks_go_through_one_relay_and_reduce(node):
    pool, _ = node
    n = pool.world_size
    assert len(pool.hub.relays) == 1
    assert sorted(pool.hub.relays[0].ranks) == list(range(n))
    code = (
        "import os, torch.distributed as dist\n"
        "t = torch.ones(1) * rank\ndist.all_reduce(t)\n"
        "os.write(1, f'C-level {rank}\\n'.encode())\nprint('python', rank)\n"
        "(t.item(), blob == bytes(range(256)) * 4096)"
    )
    blob = bytes(range(256)) * 4096  # 1 MB: a Run bigger than a frame follows its frame
    text, _, end = collect(pool.run(code, needs={"blob": blob}, want_values=True))
    raise_for_end(end)
    assert end.values == {r: (float(sum(range(n))), True) for r in range(n)}
    for rank in range(n):
        assert text[rank, "stdout"] == f"C-level {rank}\npython {rank}\n"


def test_a_rank_failing_mid_collective_frees_the_others_through_the_relay(node):
    pool, _ = node
    n = pool.world_size
    code = (
        "import torch.distributed as dist\n"
        f"if rank == {n - 1}:\n    raise ValueError('the last rank is unhappy')\n"
        "t = torch.ones(1)\ndist.all_reduce(t)"
    )
    _, _, end = collect(pool.run(code))
    assert next(iter(end.errors)) == n - 1
    assert end.errors[n - 1].message == "the last rank is unhappy"
    assert any("re-formed" in note for note in end.notes)
    assert pool.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [float(n)] * n


def test_an_interrupt_reaches_every_rank_through_the_relay(node):
    pool, _ = node
    events = pool.run("import time\nfor _ in range(600):\n    time.sleep(0.1)")
    threading.Timer(0.5, pool.interrupt).start()
    _, _, end = collect(events)
    assert end.interrupted == "interrupt"
    assert pool.execute("rank") == list(range(pool.world_size))  # state kept, no restart


HOLDERS = "__import__('os').getppid()"  # each rank's holder: the process torchrun started


def test_a_rank_that_dies_behind_the_relay_is_replaced_on_its_host(node):
    """A rank torchrun started dies (mid-collective, then SIGKILL between cells): its holder
    forks a new one on its host, the group is re-formed with it, every other rank (on the
    same host) keeps its namespace, and torchrun tears nothing down. (Before: the pool was
    stopped, every rank's state lost, and torchrun ended.)"""
    pool, proc = node
    n = pool.world_size
    pool.execute("import os, time\nimport torch.distributed as dist\ny = rank * 10")
    holders, before = pool.execute(HOLDERS), namespace_digests(pool)
    code = "if rank == 1:\n    time.sleep(0.2)\n    os._exit(7)\n"
    code += "_t = torch.ones(1)\ndist.all_reduce(_t)"
    _, _, end = collect(pool.run(code))
    assert 1 in end.exits
    assert not end.exits[1].stopped_by_pool
    said = " ".join(end.notes)
    assert "rank 1: a new process took its place; it had " in said
    assert " y (gone)" in said
    again = 0 if n > 2 else 1  # (at 2, rank 1 again: rank 0 stays, to copy from)
    pid = pool.roster[again].pid
    os.kill(pid, signal.SIGKILL)  # (rank 0 too: torchrun's agent holds the store)
    assert wait_gone([pid]) == []
    assert select.select([pool.hub.relays[0].conn.fileno()], [], [], 10)[0]  # between cells
    code = "_t = torch.ones(1)\ntorch.distributed.all_reduce(_t)\n_t.item()"  # (new: no dist)
    _, _, end = collect(pool.run(code, want_values=True))
    assert f"rank {again} died (connection lost) since the last cell" in end.notes
    assert f"rank {again}: a new process took its place" in " ".join(end.notes)
    assert end.values == dict.fromkeys(range(n), float(n))
    assert pool.execute(HOLDERS) == holders  # each new process is its holder's: on its host
    source = 2 if n > 2 else 0
    pool.copy(["y"], source, sorted({1, again}))
    after = namespace_digests(pool)
    kept = [r for r in range(n) if r not in (1, again)]
    assert [after[r] for r in kept] == [before[r] for r in kept]
    assert after[again]["y"] == after[1]["y"] == before[source]["y"]  # %ddp copy
    assert proc.poll() is None  # torchrun's workers all live on


@pytest.mark.timeout(120)  # (less than the 180 s a re-form would wait for new processes)
def test_a_killed_relay_stops_the_pool_at_once_and_torchrun_ends(node):
    """The node's relay is gone: its ranks cannot come back through it, so the pool is
    stopped at once, not after waiting for new processes that cannot reach it."""
    pool, proc = node
    relay_pid = pool.hub.relays[0].pid
    events = pool.run("import time\ntime.sleep(30)")
    threading.Timer(0.5, os.kill, (relay_pid, signal.SIGKILL)).start()
    _, _, end = collect(events)  # at once, not after a wait for new processes
    assert sorted(end.exits) == list(range(pool.world_size))
    assert any("the pool was stopped" in n for n in end.notes), end.notes
    with pytest.raises(PoolClosedError, match="start torchrun again and attach again"):
        pool.run("1")
    assert proc.wait(60) != 0  # the holders' new processes found no relay: torchrun ended
