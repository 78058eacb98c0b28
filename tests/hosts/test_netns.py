"""Two real "hosts": torchrun nodes in network namespaces of their own, with their own
hostnames, attached to a notebook in the root namespace over a bridge.

Both namespaces share this filesystem, so a folder under tmp_path plays the NFS share
that ``nbddp.Workspace``, ``gather_objects(workspace=...)`` and ``Pool(workspace=...)``
are for.

Needs root and iproute2; skipped with the reason where namespaces cannot be made
(tests/netns.py makes them).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import collect, end_all, free_port, namespace_digests, wait_rejoined
from nbddp import CellFailed, Pool, PoolClosedError
from nbddp.notebook import remote, reports
from nbddp.pool.hosts_lost import HostsMissing
from nbddp.wire.tls import make_server_tls
from netns import NOTEBOOK_IP, kill_host, make_nodes, needs_netns, on_node
from tiers import slow

pytestmark = needs_netns


@pytest.fixture(scope="module")
def nodes():
    """[(namespace, hostname, ip)] of node-a to node-d, on a bridge to NOTEBOOK_IP."""
    with make_nodes() as made:
        yield made


class Torchruns(list):
    """The torchrun processes of an attached pool, one a node; :meth:`launch` starts the
    same command on a node (a replacement host too), with its node rank."""

    def __init__(self, folder, nnodes, per_node, master_ip, address, token_file) -> None:
        super().__init__()
        self.folder, self.logs = folder, []
        self.command = (
            f"{sys.executable} -m torch.distributed.run --nnodes {nnodes} "
            f"--nproc-per-node {per_node} --master-addr {master_ip} --master-port {free_port()} "
            f"-m nbddp.worker --connect {address} --token-file {token_file}"
        )

    def launch(self, node, node_rank: int) -> subprocess.Popen:
        torchrun = self.command.replace(" -m nbddp", f" --node-rank {node_rank} -m nbddp")
        self.logs.append(open(self.folder / f"{node[1]}.log", "ab"))  # noqa: SIM115
        self.append(
            subprocess.Popen(
                on_node(node, torchrun),
                env=dict(os.environ, GLOO_SOCKET_IFNAME="eth0"),  # PYTHONPATH too
                stdout=self.logs[-1],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        return self[-1]


@contextlib.contextmanager
def attached_pool(nodes, folder, *, per_node=1, tls=False, workspace=None):
    """A started Pool listening on the bridge, its ranks a torchrun node of ``per_node``
    ranks on each of ``nodes``: yields (pool, the torchrun processes). Logs, token file
    in ``folder``; at the end the pool is stopped, and the nodes killed if they linger."""
    token_file = folder / "token"
    server, pin = make_server_tls() if tls else (None, "")
    token = remote.read_or_create_token(str(token_file), pin)
    pool = Pool(
        len(nodes) * per_node,
        listen=(NOTEBOOK_IP, 0),
        token=token,
        tls=server,
        start_timeout=180,
        workspace=workspace,
    )
    procs = Torchruns(folder, len(nodes), per_node, nodes[0][2], pool.listen(), token_file)
    logs = procs.logs
    try:
        for node_rank, node in enumerate(nodes):
            procs.launch(node, node_rank)
        pool.start()
        yield pool, procs
    finally:
        pool.stop()
        deadline = time.monotonic() + 10  # the nodes' own exit, then a kill
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        end_all(procs)
        for log in logs:
            log.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tls", [False, pytest.param(True, marks=slow)], ids=["mac", "tls"])
def test_ranks_on_two_hosts_attach_reduce_and_stop(nodes, tmp_path, tls):
    with attached_pool(nodes[:2], tmp_path, tls=tls) as (pool, procs):
        assert [s.host for s in pool.status()] == ["node-a", "node-b"]
        assert pool.hosts == {0: "node-a", 1: "node-b"}
        modes = {r.link.conn.mode for r in pool.roster.ranks.values()}
        assert modes == {"tls" if tls else "mac"}
        code = (
            "import socket, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
            "dist.all_reduce(t)\n(socket.gethostname(), t.item())"
        )
        assert pool.execute(code) == [("node-a", 3.0), ("node-b", 3.0)]
        with pytest.raises(Exception, match=r"rank 1 \(node-b\): ValueError: far away"):
            pool.execute("if rank == 1:\n    raise ValueError('far away')")
        pool.stop()
        assert [p.wait(60) for p in procs] == [0, 0]


# ---------------------------------------------- a workspace the two hosts share (NFS)

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}

ON_RANKS = """
import os, socket, time
import torch.distributed as dist
from nbddp import Workspace, gather_objects, gather_tensors

def seeded(seed, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))

def whose(t, n, base):
    '''The rank r whose seeded(base + r, n) t is, else None.'''
    return next((r for r in range(world_size) if torch.equal(t, seeded(base + r, n))), None)
"""


@pytest.fixture(scope="module")
def shared(nodes, tmp_path_factory):
    """(pool, workspace): two ranks on each host, attached with a workspace on the share."""
    folder = tmp_path_factory.mktemp("shared")
    ws = str(folder / "ws")  # made by the ranks
    with attached_pool(nodes[:2], folder, per_node=2, workspace=ws) as (pool, _):
        assert pool.hosts == HOSTS
        pool.execute(ON_RANKS)
        yield pool, ws


def entries(ws: str, prefix: str) -> list[str]:
    return sorted(e for e in os.listdir(ws) if e.startswith(prefix))


@slow
@pytest.mark.timeout(300)
def test_workspace_carries_weights_from_one_host_to_another(shared):
    pool, ws = shared
    code = f"""
space = Workspace({ws!r})
if socket.gethostname() == "node-a":
    space.write({{"rank": rank, "host": "node-a"}}, {{"w": seeded(rank, 300_000)}})
dist.barrier()
got = {{}}
if socket.gethostname() == "node-b":
    for r in range(world_size):
        config, weights = space.read(r)
        if weights is None:
            got[r] = (config, weights)
        else:
            w = weights["w"]
            got[r] = (config, whose(w, 300_000, 0), w.device.type)
got
"""
    values = pool.execute(code)
    assert values[:2] == [{}, {}], "node-a's ranks read nothing"
    expected = {
        0: ({"rank": 0, "host": "node-a"}, 0, "cpu"),
        1: ({"rank": 1, "host": "node-a"}, 1, "cpu"),
        2: (None, None),
        3: (None, None),
    }
    assert values[2] == expected, "rank 2 (node-b) reads node-a's weights, None for the rest"
    assert values[3] == expected, "rank 3 (node-b) reads node-a's weights, None for the rest"
    assert os.stat(ws).st_mode & 0o777 == 0o700, "the workspace folder is 0700"
    for r in (0, 1):
        mode = os.stat(os.path.join(ws, f"rank_{r}_state.pth")).st_mode & 0o777
        assert mode == 0o600, f"rank {r}'s state file is 0600, not {oct(mode)}"
    assert entries(ws, ".rank_") == [], "no temp file is left beside the state files"


@slow
@pytest.mark.timeout(300)
def test_gather_objects_through_the_workspace_and_the_group(shared):
    pool, ws = shared
    n = 400_000  # 1.6 MB a tensor: written as a file of its own
    code = f"""
mine = {{"config": {{"rank": rank, "host": socket.gethostname()}}, "w": seeded(10 + rank, {n})}}
def summary(got):
    return [(o["config"]["rank"], o["config"]["host"], whose(o["w"], {n}, 10)) for o in got]
def sources(got):
    return [whose(t, {n}, 10) for t in got]
(
    summary(gather_objects(mine, ranks=[3, 0, 1], workspace={ws!r})),
    sources(gather_tensors(mine["w"], ranks=[3, 0, 1], workspace={ws!r})),
    summary(gather_objects(mine, ranks=[3, 0, 1])),
    sources(gather_tensors(mine["w"], ranks=[3, 0, 1])),
    int(os.environ["LOCAL_WORLD_SIZE"]),
)
"""
    values = pool.execute(code)
    assert [v[4] for v in values] == [2, 2, 2, 2], "two ranks a host: not all on one host"
    for r in (0, 1, 2):
        assert values[r][:4] == ([], [], [], []), f"rank {r} is not the first listed: []"
    objects, tensors, objects_by_group, tensors_by_group = values[3][:4]
    listed = [(3, "node-b", 3), (0, "node-a", 0), (1, "node-a", 1)]
    assert objects == listed, "gather_objects(workspace=): every listed rank's, in order"
    assert tensors == [3, 0, 1], "gather_tensors(workspace=): every listed rank's, in order"
    assert objects_by_group == listed, "gather_objects through the group: the same"
    assert tensors_by_group == [3, 0, 1], "gather_tensors through the group: the same"
    assert entries(ws, "gather-") == [], "the first rank removed the gather folders"


@slow
@pytest.mark.timeout(300)
def test_copy_goes_through_the_workspace_between_hosts(shared):
    pool, ws = shared
    n = 500_000  # 2 MB
    pool.execute("w = small = None")
    pool.execute(f"w = seeded(20, {n})\nsmall = torch.arange(4)", ranks=[0])
    done = pool.copy(["w"], 0, [3])
    assert done.via == f"through the workspace {ws}", "a big tensor goes through the workspace"
    assert (done.src, done.dst) == (0, (3,))
    assert done.nbytes >= 4 * n, f"{done.nbytes} bytes copied"
    digest = "__import__('hashlib').sha256(w.numpy().tobytes()).hexdigest()"
    values = pool.execute(f"(socket.gethostname(), {digest}, whose(w, {n}, 20))", ranks=[0, 3])
    source = values[0][1]
    assert values[3] == ("node-b", source, 0), "rank 3 (node-b) holds rank 0's w, unchanged"
    assert entries(ws, "copy-") == [], "the source removed its copy folder"
    maps = f"[x for x in open('/proc/self/maps') if {ws!r} in x]"
    assert pool.execute(maps, ranks=[3])[3] == [], "read into memory: NFS may not keep the file"
    small = pool.copy(["small"], 0, [2])
    assert small.via == "in the message", "nothing big: all in the message"
    assert pool.execute("small.tolist()", ranks=[2])[2] == [0, 1, 2, 3]
    assert entries(ws, "copy-") == []


@slow
@pytest.mark.timeout(300)
def test_a_reader_on_another_host_never_reads_a_partial_write(shared):
    """Rank 1 (node-a) rewrites its 4 MB state for 3 s while rank 2 (node-b) reads it."""
    pool, ws = shared
    n = 1 << 20
    os.makedirs(ws, mode=0o700, exist_ok=True)
    for name in ("rank_1_state.pth", ".rank_1_state.pth.0123456789ab"):  # an earlier run's
        path = os.path.join(ws, name)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(b"an earlier run's, cut short")
    code = f"""
space = Workspace({ws!r})  # rank 1's: its earlier files removed
dist.barrier()
result = space.read(1) if rank == 2 else None
dist.barrier()
if rank == 1:
    t0, writes = time.monotonic(), 0
    while time.monotonic() - t0 < 3.0:
        space.write({{"version": writes}}, {{"w": torch.full(({n},), float(writes))}})
        writes += 1
    space.write({{"done": True}}, {{}})
    result = writes
elif rank == 2:
    deadline, reads, versions, bad = time.monotonic() + 60, 0, set(), []
    while time.monotonic() < deadline:
        try:
            config, weights = space.read(1)
        except Exception as exc:
            bad.append(f"{{type(exc).__name__}}: {{exc}}".splitlines()[0][:200])
            continue
        if config is None:
            if weights is not None:
                bad.append("weights without a config")
            continue
        if config.get("done"):
            break
        w, v = weights["w"], config["version"]
        if w.shape != ({n},) or not bool((w == v).all()):
            bad.append(f"version {{v}}: {{w.shape}}, values {{w.unique()[:5].tolist()}}")
        reads += 1
        versions.add(v)
    else:
        bad.append("the writer's last state never came")
    result = (result, reads, len(versions), len(bad), bad[:3])
result
"""
    values = pool.execute(code)
    writes = values[1]
    first, reads, versions, n_bad, bad = values[2]
    assert first == (None, None), "a new Workspace removes its rank's state of an earlier run"
    assert writes >= 2, f"rank 1 wrote {writes} times"
    assert n_bad == 0, f"{n_bad} of rank 2's reads were partial or broken, such as {bad}"
    assert reads >= 20, f"only {reads} reads while rank 1 wrote {writes} times"
    assert versions >= 2, f"rank 2 read {versions} version(s) of {writes}"
    assert entries(ws, ".rank_1_") == [], "no temp file is left, not even the earlier run's"


# each rank's host and holder (the process torchrun started)
HOLDERS = "(__import__('socket').gethostname(), __import__('os').getppid())"


@slow
@pytest.mark.timeout(300)
def test_a_killed_rank_is_replaced_on_its_host_and_every_other_rank_keeps_its_state(shared):
    """SIGKILL rank 3 (node-b): its holder on node-b forks a new rank 3 there, the group is
    re-formed across both hosts, and ranks 0-2 (rank 2 on node-b too) keep their namespaces;
    a copy through the workspace brings the new rank what it lost."""
    pool, _ = shared
    pool.execute("w = seeded(30 + rank, 1000)")
    holders, before = pool.execute(HOLDERS), namespace_digests(pool)
    pid = pool.roster[3].pid
    os.kill(pid, signal.SIGKILL)  # (a pid of node-b's namespace: the mount ns is shared)
    _, _, end = collect(pool.run("time.sleep(0.2)\nrank"))
    assert 3 in end.exits
    said = " ".join(end.notes)
    assert "rank 3: a new process took its place" in said, said
    assert "every other rank kept its namespace" in said
    assert pool.execute(HOLDERS) == holders  # on node-b, under the same holder
    after = namespace_digests(pool)
    assert after[:3] == before[:3]
    pool.copy(["w"], 2, [3])
    assert namespace_digests(pool, ranks=[3])[3]["w"] == before[2]["w"]
    code = "_t = torch.ones(1)\ntorch.distributed.all_reduce(_t)\n_t.item()"  # (new: no dist)
    assert pool.execute(code) == [4.0] * 4


# ---------------------------------------------- a whole host lost, and a replacement host


def missing_rows(pool, deadline: float) -> list:
    """``%ddp status``'s rows of missing ranks, once the notebook saw a host go."""
    while True:
        rows = [s for s in pool.status() if s.state == "missing"]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def refusal(pool, deadline: float) -> str:
    """What a cell is refused with, once the notebook saw a host go."""
    while time.monotonic() < deadline:
        try:
            pool.execute("1")
        except (PoolClosedError, CellFailed) as exc:  # (a cell that ran as the host went)
            return str(exc)
        time.sleep(0.1)
    return "no cell was refused"


IN_ALL_REDUCE = """
for _ in range(600):
    torch.distributed.all_reduce(torch.ones(1))
    __import__("time").sleep(0.05)
"""
REDUCE = "_t = torch.ones(1) * (rank + 1)\ntorch.distributed.all_reduce(_t)\n_t.item()"


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("hosts", "per_host", "in_a_cell"),
    [  # the default run: 3 hosts, in a collective; the slow tier: the others
        pytest.param(2, 2, False, marks=slow),
        (3, 2, True),
        pytest.param(2, 4, False, marks=slow),
    ],
    ids=["2x2-between-cells", "3x2-in-all_reduce", "2x4-between-cells"],
)
def test_a_lost_host_rejoins_from_a_replacement_host(nodes, tmp_path, hosts, per_host, in_a_cell):
    """SIGKILL every process of node-b (its torchrun, holders, ranks, relay), between cells
    or while every rank is in all_reduce: the others keep their state and wait, status and
    a cell say which ranks and host are missing at once; the same torchrun command on a
    replacement host brings them back, fresh, and the group works at full size; a copy
    heals them."""
    world, lost = hosts * per_host, list(range(per_host, 2 * per_host))
    kept = [r for r in range(world) if r not in lost]
    with attached_pool(nodes[:hosts], tmp_path, per_node=per_host) as (pool, procs):
        pool.execute("w = torch.full((1000,), float(rank))")
        before = namespace_digests(pool)
        if in_a_cell:
            events = pool.run(IN_ALL_REDUCE)
            threading.Timer(1.0, kill_host, (nodes[1][0],)).start()
            _, _, end = collect(events)
            assert sorted(end.exits) == lost, end.exits
            pool.notes[:0] = end.notes  # (said with the cell: checked below with the rest)
        else:
            kill_host(nodes[1][0])
        procs[1].wait(30)
        rows = missing_rows(pool, time.monotonic() + 60)
        assert [(s.rank, s.host) for s in rows] == [(r, "node-b") for r in lost], rows
        shown = reports.status(pool)  # %ddp status
        assert shown.count(" missing ") == per_host, shown
        assert "of host node-b are missing" in shown.splitlines()[-1], shown
        said = " ".join(pool.take_notes())
        assert "host node-b" in said, said
        assert "every other rank keeps its namespace" in said, said
        with pytest.raises(HostsMissing, match=r"ranks? .* of host node-b (is|are) missing"):
            pool.execute("w = None")  # refused at once: nothing runs
        procs.launch(nodes[hosts], 1)  # the same command, node rank 1, on another host
        wait_rejoined(pool, 180, "the replacement host's ranks never came")
        _, _, end = collect(pool.run("1"))
        said = " ".join(end.notes)
        assert f"rejoined from {nodes[hosts][1]}" in said, said
        assert "every other rank kept its namespace" in said, said
        assert [pool.execute(HOLDERS)[r][0] for r in lost] == [nodes[hosts][1]] * per_host
        after = namespace_digests(pool)
        assert [after[r] for r in kept] == [before[r] for r in kept]
        own = pool.execute("w[0].item()", ranks=list(lost))  # (re-ran w's cell)
        assert [own[r] for r in lost] == [float(r) for r in lost], "their own w"
        pool.copy(["w"], 0, lost)
        healed = pool.execute("w[0].item()", ranks=lost)
        assert [healed[r] for r in lost] == [0.0] * per_host, "rank 0's w on the new ranks"
        assert pool.execute(REDUCE) == [world * (world + 1) / 2] * world


@slow
@pytest.mark.timeout(300)
def test_a_killed_relay_makes_its_hosts_ranks_missing_and_they_rejoin_on_that_host(nodes, tmp_path):
    """2 hosts x 2: only node-b's relay SIGKILLed (its ranks' one way to the notebook): its
    ranks are missing at once, every other rank keeps its namespace; the host's holders
    find no relay and end, so does its torchrun; the same command on the same host brings
    them back, fresh."""
    with attached_pool(nodes[:2], tmp_path, per_node=2) as (pool, procs):
        pool.execute("w = torch.full((1000,), float(rank))")
        before = namespace_digests(pool)
        relay = next(r for r in pool.hub.relays if r.host == "node-b")
        os.kill(relay.pid, signal.SIGKILL)
        rows = missing_rows(pool, time.monotonic() + 30)
        assert [(s.rank, s.host) for s in rows] == [(2, "node-b"), (3, "node-b")], rows
        with pytest.raises(HostsMissing, match=r"ranks 2, 3 of host node-b are missing"):
            pool.execute("w = None")
        assert procs[1].wait(90) is not None, "node-b's torchrun ends with its holders"
        procs.launch(nodes[1], 1)
        wait_rejoined(pool, 180, "node-b's new ranks never came")
        _, _, end = collect(pool.run("1"))
        assert "rejoined from node-b" in " ".join(end.notes), end.notes
        after = namespace_digests(pool)
        assert [after[r] for r in (0, 1)] == [before[r] for r in (0, 1)]
        own = pool.execute("w[0].item()", ranks=list((2, 3)))  # (re-ran w's cell)
        assert [own[r] for r in (2, 3)] == [float(r) for r in (2, 3)], "their own w"
        assert pool.execute(REDUCE) == [10.0] * 4


@slow
@pytest.mark.timeout(300)
def test_a_host_killed_ranks_first_is_missing_not_waited_for(nodes, tmp_path):
    """2 hosts x 4: node-b's torchrun, holders and ranks SIGKILLed, then its relay a second
    into the next cell's repair, which read the ranks' ends first (plain deaths, a re-form
    waiting for their holders' new processes): the relay's end makes them missing at once
    (before: a 60 s wait, then the pool stopped with every rank's state). The same
    command on a replacement host brings them back; the others kept their namespaces."""
    with attached_pool(nodes[:2], tmp_path, per_node=4) as (pool, procs):
        pool.execute("w = torch.full((1000,), float(rank))")
        before = namespace_digests(pool)
        relay = next(r for r in pool.hub.relays if r.host == "node-b")
        kill_host(nodes[1][0], spare=(relay.pid,))
        procs[1].wait(30)
        # the relay told the notebook its ranks ended: there is something to read from it
        assert select.select([relay.conn.fileno()], [], [], 30)[0], "the relay said nothing"
        threading.Timer(1.0, os.kill, (relay.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(HostsMissing, match=r"ranks 4-7 of host node-b are missing"):
            pool.execute("w = None")
        assert time.monotonic() - t0 < 20, "missing once the relay ended, not after 60 s"
        procs.launch(nodes[2], 1)
        wait_rejoined(pool, 180, "the replacement host's ranks never came")
        after = namespace_digests(pool)
        assert [after[r] for r in range(4)] == [before[r] for r in range(4)]
        assert pool.execute(REDUCE) == [36.0] * 8


@slow
@pytest.mark.timeout(300)
def test_a_lost_host_that_held_torchruns_store_stops_the_pool_and_says_why(nodes, tmp_path):
    """node-a held torchrun's store (node rank 0): the others cannot meet again."""
    with attached_pool(nodes[:2], tmp_path, per_node=2) as (pool, procs):
        kill_host(nodes[0][0])
        procs[0].wait(30)
        said = refusal(pool, time.monotonic() + 60)
        assert "host node-a (ranks 0, 1) was lost with torchrun's store" in said, said
        assert "start torchrun again and attach again" in said, said


@slow
@pytest.mark.timeout(300)
def test_a_host_of_one_rank_is_replaced_on_it_and_when_lost_waits_and_rejoins(nodes, tmp_path):
    """2 hosts x 1 rank: the rank alone on node-b SIGKILLed is replaced there (its relay waits
    for its holder's new process); then node-b lost whole (rank, holder, relay, torchrun) is
    named and missing at once, not a 60 s wait that stopped the pool (before: a host of one
    rank had no relay, so its loss looked like its rank's death), and a replacement host
    brings it back while rank 0 keeps its namespace."""
    with attached_pool(nodes[:2], tmp_path) as (pool, procs):
        assert len(pool.hub.relays) == 2, "a held rank alone on its host has a relay too"
        pool.execute("w = torch.full((1000,), float(rank))")
        holders, before = pool.execute(HOLDERS), namespace_digests(pool)
        os.kill(pool.roster[1].pid, signal.SIGKILL)
        _, _, end = collect(pool.run("1"))
        said = " ".join(end.notes)
        assert "rank 1: a new process took its place" in said, said
        assert pool.execute(HOLDERS) == holders, "on node-b, under the same holder"
        kill_host(nodes[1][0])
        procs[1].wait(30)
        t0 = time.monotonic()
        rows = missing_rows(pool, t0 + 30)
        assert [(s.rank, s.host) for s in rows] == [(1, "node-b")], rows
        with pytest.raises(HostsMissing, match=r"rank 1 of host node-b is missing"):
            pool.execute("w = None")
        assert time.monotonic() - t0 < 30, "at once, not after the re-form's 60 s"
        procs.launch(nodes[2], 1)
        wait_rejoined(pool, 180, "the replacement host's rank never came")
        assert pool.execute(HOLDERS)[1][0] == nodes[2][1]
        assert namespace_digests(pool)[0] == before[0], "rank 0 kept its namespace"
        assert pool.execute(REDUCE) == [3.0, 3.0]
