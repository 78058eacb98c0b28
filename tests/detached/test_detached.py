"""Detached pools (issue 25) without IPython: ``nbddp.detached.client`` and ``Pool.connect``.

A detached pool's supervisor is a process of its own that holds the ranks; these tests
are its client, as a kernel is. Every pool lives under a ``$NBDDP_HOME`` in the test's
temp folder, never in ``~/.nbddp``, and each test checks (or its fixture does) that
what the pool ran and held is gone at the end: the supervisor, every process under it
(fork server, store, ranks) and its folders. Real pools over gloo; the pools of the
fault matrix are shared by the module (a detached start costs about 2.5 s here).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from test_failures import CASES, check_case

from helpers import DetachedFamily, collect, namespace_digests, wait_gone
from nbddp import Pool
from nbddp.dashboard.metric_store import CellMetrics
from nbddp.detached import client as detached_client
from nbddp.detached import kernels as detached_kernels
from nbddp.detached import messages
from nbddp.detached import proxy as detached_pool
from nbddp.pool import capture
from nbddp.pool.errors import CellFailed, CellInterrupted, NbddpError, PoolClosedError
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P
from nbddp.wire.frames import Channel
from tiers import sizes

SIZES = [2, 4, 8]
SUM = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
HEAD = "import torch.distributed as dist\nt = torch.ones(1)\n"
STATE = "(kept if 'kept' in globals() else None, rank)"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """``$NBDDP_HOME`` for the module: a temp folder (the real ``~/.nbddp`` is never used)."""
    path = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NBDDP_HOME", str(path))
        yield path
    pools = path / "pools"
    assert not pools.exists() or os.listdir(pools) == []


@pytest.fixture(autouse=True)
def _every_test_has_its_home(home):
    assert os.environ["NBDDP_HOME"] == str(home)


class Held:
    """A detached pool a fixture started: the client connected now (a test may connect
    anew and put its client here) and what the pool runs and holds."""

    def __init__(self, name: str, n: int, **options) -> None:
        self.name = name
        self.pool = detached_client.start(name, n, **options)
        self.family = DetachedFamily(name)


def stop_and_check(held: Held) -> None:
    """Stop the pool from its client (by name when that client was let go); nothing of
    it may be left."""
    held.family.record()
    try:
        if held.pool.closed:
            detached_client.stop(held.name)
        else:
            held.pool.stop()
        assert held.family.alive() == []
        assert held.family.folders_left() == []
    finally:
        if held.family.supervisor.pid in held.family.alive(timeout=0):  # (a check failed)
            with contextlib.suppress(NbddpError):
                detached_client.stop(held.name)
        held.family.clean()


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized(request, home):
    held = Held(f"s{request.param}", request.param, grace=1.0)
    yield held
    stop_and_check(held)


@pytest.fixture
def detached(sized):
    """The module's detached pool of this size, connected and healthy."""
    if sized.pool.closed:
        sized.pool = detached_client.connect(sized.name, force=True)
    pool = sized.pool
    if pool.needs_restart or not pool.started:
        pool.restart()
        sized.family.record()
    return sized


def two_ranks(test):
    """Run ``test`` on the module's 2-rank pool only."""
    return pytest.mark.parametrize("sized", [2], indirect=True, ids=["2ranks"])(test)


def peak_rss(proc: psutil.Process) -> int:
    """The most memory ``proc`` has held at once so far (Linux: VmHWM), in bytes."""
    with open(f"/proc/{proc.pid}/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    return int(kib) * 1024


def failure(end) -> CellFailed:
    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    return failed.value


# ---------------------------------------------------------------- reconnect


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sized", [2, 4], indirect=True, ids=["2ranks", "4ranks"])
def test_a_pool_connected_again_has_every_rank_state_by_value(detached):
    pool = detached.pool
    n = pool.world_size
    pool.execute(
        "import os\nkept = rank * 10 + 1\ntorch.manual_seed(rank)\nmodel = torch.nn.Linear(3, 2)"
    )
    state = "(kept, [round(w, 6) for w in model.weight.flatten().tolist()], os.getpid())"
    before = pool.execute(state)
    pids = list(pool.pids)
    assert [k for k, _, _ in before] == [r * 10 + 1 for r in range(n)]
    assert len({tuple(w) for _, w, _ in before}) == n  # each rank a model of its own
    assert [p for _, _, p in before] == pids

    name = detached.name
    pool.disconnect()
    with pytest.raises(PoolClosedError, match=f"disconnected from the detached pool {name}"):
        pool.execute("kept")
    again = detached.pool = Pool.connect(detached.name)
    assert again.resumed is False  # no cell ran meanwhile: the last one was read to its end
    assert again.world_size == n
    assert again.pids == pids
    assert again.execute(state) == before
    assert again.execute(SUM) == [float(n)] * n  # the group is whole


class OneCellSupervisor:
    """What :class:`~nbddp.detached.kernels.Kernels` asks of its supervisor, no pool behind."""

    name = "fake"
    running = None

    def __init__(self) -> None:
        self.requests: queue.Queue = queue.Queue()

    def state(self) -> messages.PoolState:
        return messages.PoolState(
            "fake", 1, True, False, {0: "here"}, None, 0, ["cpu"], [0], "gloo"
        )


def plug(kernels: detached_kernels.Kernels) -> tuple[detached_pool.DetachedPool, Channel]:
    """A kernel connected to ``kernels`` over a socket pair (no handshake): its pool, and
    the supervisor's end."""
    ours, theirs = socket.socketpair()
    server = Channel(ours, "plain", (b"", b""))
    with kernels.lock:
        kernels._take_over(messages.Link(server), os.getpid())
    conn = messages.Link(Channel(theirs, "plain", (b"", b"")))
    return detached_pool.DetachedPool(conn, conn.recv()), server


@pytest.mark.timeout(30)
def test_a_cell_read_to_its_end_is_not_offered_to_the_next_kernel(monkeypatch):
    """A message stays "being written" in the supervisor's outbox until its send returns;
    a kernel that read it and left in that moment by closing alone (read as a crash) had it
    offered again to the next kernel (about 1 time in 4 here). Made certain: the send of the
    cell's events returns only once the kernel is gone."""
    sup = OneCellSupervisor()
    kernels = detached_kernels.Kernels(sup)
    pool, server = plug(kernels)
    send = server.send_bytes

    def send_then_wait_for_the_kernel_to_leave(data: bytes) -> None:
        send(data)
        deadline = time.monotonic() + 5.0
        while kernels.connected() is not None and time.monotonic() < deadline:
            time.sleep(0.01)

    events = pool.run("1", want_values=True)
    _, run = sup.requests.get(timeout=5.0)
    monkeypatch.setattr(server, "send_bytes", send_then_wait_for_the_kernel_to_leave)
    end = P.CellEnd(cell=1, ranks=(0,), values={0: 1})
    cell = (
        messages.Event(end, run.request),
        messages.Reply(None, sup.state(), run.request),
    )
    kernels.send(messages.Batch(cell))
    assert [e for e in events if isinstance(e, P.CellEnd)] == [end]
    pool.disconnect()
    again, _ = plug(kernels)
    try:
        assert again.resumed is False
        assert len(kernels.backlog) == 0
    finally:
        again.disconnect()
        kernels.goodbye(None)


# ---------------------------------------------------------------- a cell runs on


TICKS = (
    "import time, nbddp\nfor i in range(5):\n    print('tick', i, flush=True)\n"
    "    nbddp.log_metrics({'tick': rank * 10.0 + i}, step=i)\n    time.sleep(0.2)\n"
    "torch.full((2**19,), float(rank))"  # 2 MB: the value comes back through shared memory
)


@pytest.mark.timeout(60)
@two_ranks
@pytest.mark.parametrize("when", ["while it runs", "after its end"])
def test_a_cell_left_running_by_its_client_resumes_on_connect(detached, when):
    pool = detached.pool
    n = pool.world_size
    shm = pool.shm_folder
    printed: set[int] = set()
    metrics = CellMetrics(label="c")
    for event in pool.run(TICKS, want_values=True):
        if isinstance(event, P.RankMetrics):
            metrics.add(event)
        if isinstance(event, P.Output):
            assert event.text == "tick 0\n"
            printed.add(event.rank)
        if printed == set(range(n)):
            break
    pool.disconnect()  # mid-cell: the ranks go on printing
    time.sleep(1.5 if when == "after its end" else 0.5)  # (ticks 1 and 2 while none listens)
    again = detached.pool = detached_client.connect(detached.name)
    assert again.resumed is True
    text, seen, end = collect(again.resume())
    assert isinstance(seen[-1], P.CellEnd), seen
    for event in seen:
        if isinstance(event, P.RankMetrics):
            metrics.add(event)
    # every point the ranks logged, once, whether its client was there or not
    lines = metrics.store.lines[("c", "tick")]
    assert {r: line.steps.tolist() for r, line in lines.items()} == {
        r: [0, 1, 2, 3, 4] for r in range(n)
    }
    assert {r: line.values.tolist() for r, line in lines.items()} == {
        r: [r * 10.0 + i for i in range(5)] for r in range(n)
    }
    assert end.errors == {}
    assert end.exits == {}
    for r in range(n):
        lines = text[r, "stdout"].splitlines()
        # what came after the first client left, in order, nothing twice, nothing lost
        assert len(lines) >= 4, text
        assert lines == [f"tick {i}" for i in range(5 - len(lines), 5)], text
        assert P.RankState(r, "done") in seen
    # --out: the values are loaded here, in the client, from the pool's shared memory
    for r in range(n):
        assert isinstance(end.values[r], torch.Tensor), end.values
        assert torch.equal(end.values[r], torch.full((2**19,), float(r)))
    assert os.listdir(shm) == []
    assert again.resumed is False
    assert list(again.resume()) == []  # said once
    assert again.execute("rank") == list(range(n))  # and the pool is free for the next cell


# ---------------------------------------------------------------- one client at a time


@pytest.mark.timeout(60)
@two_ranks
def test_a_second_connect_is_refused_and_force_takes_over(detached):
    first, name = detached.pool, detached.name
    n = first.world_size
    first.execute("mine = rank + 1")

    with pytest.raises(PoolClosedError) as refused:
        detached_client.connect(name)
    said = str(refused.value)
    assert "\n" not in said
    assert f"connected to another kernel (pid {os.getpid()})" in said
    assert f"`%ddp connect {name} --force` takes it over" in said
    assert first.execute("mine") == [r + 1 for r in range(n)]  # the refusal changed nothing

    second = detached.pool = detached_client.connect(name, force=True)
    with pytest.raises(PoolClosedError) as taken:
        first.execute("mine = 999")
    said = str(taken.value)
    assert "\n" not in said
    assert f"took the detached pool {name} over" in said
    with pytest.raises(PoolClosedError, match="took the detached pool"):
        first.execute("mine")  # and again, in the same words
    assert second.execute("mine") == [r + 1 for r in range(n)]  # the first's last cell never ran
    with pytest.raises(PoolClosedError, match="took the detached pool"):
        first.stop()  # a kernel that lost the pool cannot stop it, and is told why
    assert name in [p["name"] for p in detached_client.listing()]
    assert second.execute("mine") == [r + 1 for r in range(n)]


# ---------------------------------------------------------------- list and stop


@pytest.mark.timeout(60)
@two_ranks
def test_listing_shows_every_pool_and_stop_by_name_leaves_nothing(detached):
    lone = detached_client.start("lone", 1)
    family = DetachedFamily("lone")
    try:
        assert lone.execute("x = 1\nx") == [1]
        lone.disconnect()
        deadline = time.monotonic() + 5
        while True:  # the supervisor sees the client go at once, or nearly
            pools = {p["name"]: p for p in detached_client.listing()}
            if pools["lone"]["connected"] is None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sorted(pools) == ["lone", detached.name]
        mine, other = pools[detached.name], pools["lone"]
        assert (mine["world_size"], mine["alive"], mine["connected"]) == (2, 2, os.getpid())
        assert (other["world_size"], other["alive"], other["connected"]) == (1, 1, None)
        assert other["pid"] == family.supervisor.pid
        assert mine["pid"] == detached.family.supervisor.pid
        assert other["idle_since"] is not None
        assert mine["idle_since"] is None
        assert other["running_since"] is None

        family.record()
        # the supervisor, its fork server, the store and the rank
        assert len(family.pids) >= 4, family.pids
        assert family.supervisor.pid in family.pids
        detached_client.stop("lone")  # as `%ddp stop lone` from a kernel not connected to it
        assert family.alive() == []
        assert family.folders_left() == []
        assert [p["name"] for p in detached_client.listing()] == [detached.name]
    finally:
        family.clean()


@pytest.mark.timeout(60)
def test_a_pool_without_a_client_for_its_idle_timeout_stops_itself_and_leaves_nothing():
    pool = detached_client.start("idle", 2, idle_timeout=1.5)
    family = DetachedFamily("idle")
    try:
        time.sleep(2.6)  # connected: no idle time counts (the supervisor looks each second)
        assert pool.execute("rank") == [0, 1]
        family.record()
        pool.disconnect()
        t0 = time.monotonic()
        assert family.alive(timeout=30) == []
        took = time.monotonic() - t0
        assert took > 1.0, took  # (not before its time; how soon after is a benchmark's)
        assert family.folders_left() == []
        assert "idle" not in [p["name"] for p in detached_client.listing()]
    finally:
        family.clean()


@pytest.mark.timeout(60)
def test_a_supervisor_killed_takes_its_ranks_along_and_its_client_says_so_in_one_line():
    pool = detached_client.start("doomed", 2)
    family = DetachedFamily("doomed")
    try:
        assert pool.execute("kept = rank\nkept") == [0, 1]
        family.record()
        ranks = list(pool.pids)
        os.kill(family.supervisor.pid, signal.SIGKILL)
        assert wait_gone(ranks) == []  # the ranks see it and exit
        assert family.alive() == []  # and so does everything else under it
        with pytest.raises(PoolClosedError) as gone:
            pool.execute("kept")
        said = str(gone.value)
        assert "\n" not in said
        assert "the detached pool doomed is gone" in said
        with pytest.raises(PoolClosedError, match="is gone"):
            pool.execute("kept")
        # what the killed supervisor left in $NBDDP_HOME: %ddp list clears it
        assert "doomed" not in [p["name"] for p in detached_client.listing()]
        assert not os.path.exists(family.folder)
    finally:
        family.clean()  # (its temp and shared-memory folders: no process was left to remove them)


# ---------------------------------------------------------------- --need


@pytest.mark.timeout(60)
@two_ranks
def test_a_big_need_goes_through_the_pools_shared_memory_and_leaves_nothing_there(detached):
    pool = detached.pool
    n = pool.world_size
    shm = pool.shm_folder
    assert shm
    assert os.path.isdir(shm)
    big = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MB, exact in float32
    check = "(tuple(big.shape), str(big.dtype), big.double().sum().item(), big[12345].item())"
    want = ((16 * 2**20,), "torch.float32", float(16 * 2**20 * (16 * 2**20 - 1) // 2), 12345.0)
    peak = peak_rss(detached.family.supervisor)
    assert pool.execute(check, needs={"big": big}) == [want] * n
    assert os.listdir(shm) == []
    # the bytes went from here to the ranks: none passed through the supervisor
    assert peak_rss(detached.family.supervisor) - peak < 16 * 2**20

    # what the client sends: a small pickle, the bytes in the pool's shared-memory folder
    shipment = capture.pack({"big": big}, shm)
    assert len(shipment.data) < 2**16
    assert shipment.files
    assert all(os.path.dirname(f) == shm for f in shipment.files)
    assert sum(os.path.getsize(f) for f in shipment.files) >= 64 * 2**20
    assert pool.execute(check, needs=shipment) == [want] * n
    assert os.listdir(shm) == []


# ---------------------------------------------------------------- the fault matrix


@pytest.mark.timeout(120)
def test_a_raise_before_a_collective_frees_the_others_and_keeps_state(detached):
    pool = detached.pool
    n = pool.world_size
    bad = n - 2 if n > 2 else 0
    pool.execute("import torch.distributed as dist\nkept = rank + 100")
    pids = list(pool.pids)
    code = HEAD + f"if rank == {bad}:\n    raise ValueError('before')\ndist.all_reduce(t)"
    _text, seen, end = collect(pool.run(code))
    failed = failure(end)
    lines = str(failed).splitlines()
    assert lines[0] == f"rank {bad}: ValueError: before", lines
    freed = re.fullmatch(
        r"ranks? ([\d, -]+): freed from a collective \(all_reduce\) after (.*)", lines[1]
    )
    assert freed, lines
    assert freed.group(2) == f"rank {bad} failed; state kept", lines
    others = [r for r in range(n) if r != bad]
    assert sorted(f.rank for f in failed.consequences) == others
    assert P.RankState(bad, "failed") in seen
    assert all(P.RankState(r, "freed") in seen for r in others), seen
    assert pool.execute(STATE) == [(100 + r, r) for r in range(n)]
    assert pool.pids == pids
    assert pool.execute(SUM) == [float(n)] * n


@pytest.mark.timeout(120)
def test_a_rank_killed_is_replaced_and_the_survivors_keep_their_state(detached):
    pool = detached.pool
    n = pool.world_size
    bad = n - 2 if n > 2 else 0
    pool.execute("import torch.distributed as dist\nkept = rank + 100")
    pids, spaces = list(pool.pids), dict(pool.namespaces)
    code = (
        HEAD + f"import os, signal\nif rank == {bad}:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)"
    )
    _text, seen, end = collect(pool.run(code))
    detached.family.record()  # the new rank's process
    pool.ready()  # (its state, as of now: only the new rank's namespace is new)
    assert [r for r in range(n) if pool.namespaces[r] != spaces[r]] == [bad]
    failed = failure(end)
    lines = str(failed).splitlines()
    assert lines[0] == f"rank {bad} died (killed by SIGKILL)", lines
    assert re.fullmatch(
        rf"ranks? [\d, -]+: freed from a collective \(all_reduce\) after rank {bad} died; "
        "state kept",
        lines[1],
    ), lines
    assert P.RankState(bad, "dead") in seen
    assert P.RankState(bad, "replaced") in seen
    # (the new rank re-ran the cell that made `kept`: it issued no collective)
    assert pool.execute(STATE) == [(100 + r, r) for r in range(n)]
    assert any(note.startswith(f"rank {bad} re-ran ") for note in end.notes), end.notes
    assert [p for r, p in enumerate(pool.pids) if r != bad] == [
        p for r, p in enumerate(pids) if r != bad
    ]
    assert pool.pids[bad] != pids[bad]
    assert psutil.pid_exists(pool.pids[bad])
    assert wait_gone([pids[bad]]) == []
    assert pool.execute(SUM) == [float(n)] * n


@pytest.mark.timeout(120)
def test_an_endless_loop_is_interrupted_and_every_rank_keeps_its_state(detached):
    pool = detached.pool
    n = pool.world_size
    pool.execute("kept = rank + 100")
    pids = list(pool.pids)
    timer = threading.Timer(1.0, pool.interrupt)
    timer.start()
    try:
        # (--timeout: a lost interrupt fails in 20 s, as a timeout, not as a hang)
        cell = "print('ready', flush=True)\nwhile True:\n    pass"
        text, _seen, end = collect(pool.run(cell, timeout=20))
    finally:
        timer.cancel()
    assert all(text.get((r, "stdout")) == "ready\n" for r in range(n)), text
    failed = failure(end)
    assert isinstance(failed, CellInterrupted)
    message = str(failed)
    assert message.splitlines()[0] == "cell interrupted (KeyboardInterrupt)", message
    assert re.search(r"ranks? [\d, -]+: cell line [23]: (while True:|pass)", message), message
    assert pool.execute(STATE) == [(100 + r, r) for r in range(n)]
    assert pool.pids == pids
    assert pool.execute(SUM) == [float(n)] * n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_whole_fault_matrix_on_a_detached_pool(detached, case):
    """tests/pool/test_failures.py's cases, checked the same way, on a detached pool. A death
    case starts from a restarted pool: 3 deaths of one rank within a minute stop a pool (the
    rule is tested in test_replace.py), and this module's pools see many."""
    n = detached.pool.world_size
    if case.died:
        detached.pool.restart()
        detached.family.record()
    bad = n - 2 if n > 2 else 0
    check_case(detached.pool, case, bad)
    detached.family.record()  # a new rank's process, or a new pool's


@pytest.mark.timeout(60)
@two_ranks
def test_pdb_a_torchrun_script_copy_and_restart_work_on_a_detached_pool(detached, tmp_path):
    """breakpoint() asks the kernel (through the supervisor, both ways); %ddp run's script
    runs unchanged with its argv; %ddp copy copies between ranks."""
    from nbddp.pool.drive import drive

    pool = detached.pool
    asked = []

    def prompt(event):
        asked.append((event.rank, event.prompt))
        return "p rank * 100" if len(asked) == 1 else "c"

    end = drive(
        pool, pool.run("breakpoint()\ny = rank + 5\ny", want_values=True, ranks=[1]), prompt=prompt
    )
    assert asked == [(1, "(Pdb rank 1) "), (1, "(Pdb rank 1) ")]
    assert end.values == {1: 6}
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nz = len(sys.argv[1:]) * (int(os.environ['RANK']) + 1)\n")
    raise_for_end(drive(pool, pool.run_script(str(script), ["--lr", "0.1"], keep=True)))
    assert pool.execute("z") == [2, 4]
    done = pool.copy(["z"], 1, [0])
    assert done.dst == (0,)
    assert pool.execute("z") == [4, 4]
    before = list(pool.pids)
    assert pool.restart() is pool  # %ddp restart: new ranks, every rank's state gone
    detached.family.record()
    assert set(pool.pids).isdisjoint(before)
    assert pool.execute("'z' in globals()") == [False, False]


# ---------------------------------------------------------------- never another cell's answer


def running(name: str, timeout: float = 60.0) -> dict:
    """The pool's listing once a cell runs on it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in detached_client.listing() if p["name"] == name]
        if found and found[0].get("running_since") is not None:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no cell ran on {name} within {timeout} s")


OLD_CELL = (
    "import time\nw += 1\nprint('old', flush=True)\ntime.sleep(3)\nlate = rank * 3\n'FROM_OLD_CELL'"
)
CLIENT = "import sys\nfrom nbddp import Pool\nPool.connect(sys.argv[1]).execute(sys.argv[2])\n"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sized", sizes(*SIZES), indirect=True)
def test_a_client_killed_mid_cell_and_the_next_one_never_mixes_cells(detached):
    """A process using Pool.connect is SIGKILLed while its cell runs; a new one connects:
    each request gets its own answer, the old cell's end is kept for resume(), stop's
    call works, and every rank's namespace is what it was plus what the old cell did."""
    name, n = detached.name, detached.pool.world_size
    detached.pool.execute("import time\nkept = rank * 7 + 1\nw = torch.arange(3.0) + rank")
    before = namespace_digests(detached.pool)
    detached.pool.disconnect()
    child = subprocess.Popen([sys.executable, "-c", CLIENT, name, OLD_CELL])
    try:
        running(name)
    finally:
        child.kill()
        child.wait()

    again = detached.pool = Pool.connect(name)
    assert again.resumed is True
    assert again.execute("'NEW1'") == ["NEW1"] * n  # (the old cell ends first, kept)
    assert again.execute("'NEW2'") == ["NEW2"] * n
    assert [row.rank for row in again.status()] == list(range(n))  # a call: its own reply
    _text, seen, end = collect(again.resume())
    assert P.RankState(0, "done") in seen
    assert end.values == dict.fromkeys(range(n), "FROM_OLD_CELL")
    assert again.resumed is False
    assert list(again.resume()) == []

    after = namespace_digests(again)
    for r in range(n):  # what it was, plus what the old cell did: w changed, late bound
        assert sorted(after[r]) == sorted([*before[r], "late"])
        assert {k: v for k, v in after[r].items() if k not in ("w", "late")} == {
            k: v for k, v in before[r].items() if k != "w"
        }
    assert again.execute("(w.tolist(), late, kept)") == [
        ([r + 1.0, r + 2.0, r + 3.0], r * 3, r * 7 + 1) for r in range(n)
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sized", sizes(*SIZES), indirect=True)
def test_a_run_left_early_or_never_read_is_ended_before_the_next_request(detached):
    """Breaking out of run() mid-cell, and a run() whose events are never read (Ctrl-C
    between run and the sink): the next request gets its own answer, the cell left is
    interrupted (a note says so), and no rank's namespace changed."""
    pool, n = detached.pool, detached.pool.world_size
    pool.execute("kept = rank + 40")
    before = namespace_digests(pool)
    pids = list(pool.pids)
    for event in pool.run("import time\nprint('go', flush=True)\ntime.sleep(60)\nlate = 1"):
        if isinstance(event, P.Output):
            break  # the cell sleeps on
    _text, _seen, end = collect(pool.run("'next'", want_values=True))
    assert end.values == dict.fromkeys(range(n), "next")
    assert end.notes[0] == (
        "the previous cell's events were not read to its end: it was interrupted (every "
        "rank's state kept); its output was dropped"
    ), end.notes

    pool.run("print('never read', flush=True)")  # its events are never asked for
    _text, _seen, end = collect(pool.run("kept", want_values=True))
    assert end.values == {r: r + 40 for r in range(n)}
    assert end.notes[0].startswith("the previous cell's events were not read to its end: ")
    assert namespace_digests(pool) == before
    assert pool.pids == pids
    assert pool.execute(SUM) == [float(n)] * n


# ---------------------------------------------------------------- a kernel that stops reading


@pytest.mark.timeout(180)
def test_a_kernel_that_stops_reading_locks_no_one_out_and_is_dropped_with_a_note():
    """Kernel A runs a cell that prints ~10 MB and reads none of it: listing, a takeover
    and the next kernel's cells do not wait on it; A is dropped after the send deadline
    (said in the next cell's end), what it missed is kept, bounded, for the next kernel."""
    a = detached_client.start("deaf", 2, send_deadline=2.0)
    family = DetachedFamily("deaf")
    b = None
    try:
        a.execute("kept = rank + 3")
        before = namespace_digests(a)
        events = a.run("any(print('x' * 200) for _ in range(50_000))")  # never read
        running("deaf")
        deadline = time.monotonic() + 60
        while True:  # A is dropped: no kernel connected (so the idle timeout counts too)
            pools = {p["name"]: p for p in detached_client.listing()}
            assert "deaf" in pools  # listed all along (the lock A held kept it out)
            if pools["deaf"]["connected"] is None:
                break
            assert time.monotonic() < deadline, pools
            time.sleep(0.2)
        b = detached_client.connect("deaf")
        # what A's socket had not taken is kept for B
        assert b.resumed is True  # A's socket took ~200 KB of the 10 MB
        resumed = [e for e in b.resume() if isinstance(e, P.CellEnd)]
        assert all(end.errors == {} for end in resumed)
        _text, _seen, end = collect(b.run("kept", want_values=True))
        assert end.values == {0: 3, 1: 4}
        notes = [n for e in [*resumed, end] for n in e.notes]  # (the first end after the drop)
        assert any(
            f"the kernel pid {os.getpid()} did not read for 2 s and was disconnected" in note
            for note in notes
        ), notes
        assert namespace_digests(b) == before
        del events
        family.record()
        b.stop()
        assert family.alive() == []
        assert family.folders_left() == []
    finally:
        a.disconnect()
        if family.supervisor.pid in family.alive(timeout=0):
            with contextlib.suppress(NbddpError):
                detached_client.stop("deaf")
        family.clean()


@pytest.mark.timeout(120)
@two_ranks
def test_a_takeover_and_a_listing_do_not_wait_on_a_kernel_that_stops_reading(detached):
    """The same, taken over at once (--force): the new kernel gets the cell that ran."""
    name = detached.name
    before = namespace_digests(detached.pool)
    detached.pool.run("any(print('y' * 200) for _ in range(50_000))")  # never read
    running(name)
    assert name in [p["name"] for p in detached_client.listing()]
    again = detached.pool = detached_client.connect(name, force=True)
    assert again.resumed is True
    text, _seen, end = collect(again.resume())
    assert end.errors == {}
    assert text[0, "stdout"].endswith("y" * 200 + "\n")  # its last lines, kept
    assert namespace_digests(again) == before


# ---------------------------------------------------------------- liveness by lock


def list_elsewhere() -> list[dict]:
    """listing() from another PID namespace (where no pid of ours means anything)."""
    code = (
        "import json\nfrom nbddp.detached import client as detached_client\n"
        "print(json.dumps(detached_client.listing()))"
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sized", [2, 4], indirect=True, ids=["2ranks", "4ranks"])
def test_a_listing_from_another_pid_namespace_shows_a_live_pool_and_keeps_it(detached):
    pool, name = detached.pool, detached.name
    pool.execute("kept = rank + 11")
    before = namespace_digests(pool)
    seen = {p["name"]: p for p in list_elsewhere()}
    assert name in seen, seen
    assert seen[name]["world_size"] == pool.world_size
    assert os.path.exists(os.path.join(detached.family.folder, "token"))
    pool.disconnect()
    again = detached.pool = detached_client.connect(name)  # its folder is whole
    assert namespace_digests(again) == before


@pytest.mark.timeout(180)
def test_a_pool_starting_is_not_removed_by_a_second_start_nor_a_listing(monkeypatch):
    """While `racer` starts (its supervisor is slow to write info.json here), a second
    start of that name is refused and a listing shows it without removing it."""
    started: list = []
    real_wait = detached_client._wait_started
    gate = threading.Event()

    def slow_wait(*args):
        gate.wait(60)  # the folder is there, locked, and not started yet
        return real_wait(*args)

    monkeypatch.setattr(detached_client, "_wait_started", slow_wait)
    thread = threading.Thread(target=lambda: started.append(detached_client.start("racer", 1)))
    thread.start()
    folder = messages.folder_of("racer")
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "options.json")):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(NbddpError, match="runs already \\(or is starting\\)"):
            detached_client.start("racer", 1)
        assert "racer" in [p["name"] for p in detached_client.listing()]
        assert "racer" in [p["name"] for p in list_elsewhere()]
        assert os.path.exists(folder)
    finally:
        gate.set()
        thread.join(120)
        family = DetachedFamily("racer") if started else None
    try:
        assert started
        assert started[0].execute("rank") == [0]
        started[0].stop()
        assert family.alive() == []
        assert family.folders_left() == []
    finally:
        if family is not None:
            family.clean()


# ---------------------------------------------------------------- a stop while a cell runs

DEAF_CELL = (  # a cell that does not come back from an interrupt
    "import time\nprint('deaf', flush=True)\nwhile True:\n    try:\n        time.sleep(0.1)\n"
    "    except KeyboardInterrupt:\n        pass"
)


def first_output(events) -> None:
    for event in events:
        if isinstance(event, P.Output):
            return


@pytest.mark.timeout(120)
def test_sigterm_stops_a_pool_whose_cell_does_not_come_back_and_says_so():
    pool = detached_client.start("termed", 2, grace=1.0)
    family = DetachedFamily("termed")
    try:
        events = pool.run(DEAF_CELL)
        first_output(events)
        family.record()
        os.kill(family.supervisor.pid, signal.SIGTERM)
        end = next(e for e in events if isinstance(e, P.CellEnd))
        assert end.notes[-1] == (
            "the detached pool termed is stopping (SIGTERM): this cell was interrupted, and "
            "its ranks killed (they did not come back in time); every rank's state goes with it"
        ), end.notes
        assert family.alive(timeout=30) == []
        assert family.folders_left() == []
    finally:
        family.clean()


@pytest.mark.timeout(120)
def test_a_stop_by_name_does_not_wait_for_a_running_cell():
    pool = detached_client.start("busy", 2, grace=1.0, idle_timeout=2.0)
    family = DetachedFamily("busy")
    try:
        events = pool.run("import time\nprint('sleeping', flush=True)\ntime.sleep(300)")
        first_output(events)
        family.record()
        # from a kernel not connected to it: it takes over
        assert detached_client.stop("busy") == "its running cell was interrupted"
        assert family.alive(timeout=60) == []  # long before the cell's 300 s
        assert family.folders_left() == []
    finally:
        with contextlib.suppress(NbddpError):
            pool.disconnect()
        family.clean()


@pytest.mark.timeout(120)
def test_the_idle_timeout_lets_a_running_cell_finish_then_stops_the_pool():
    """A training left running after its kernel went is work, not idleness: the idle
    timeout counts from the cell's end, not from the kernel's departure."""
    pool = detached_client.start("train", 2, grace=1.0, idle_timeout=2.0)
    family = DetachedFamily("train")
    try:
        cell = "import time\nprint('training', flush=True)\ntime.sleep(6)\ndone_training = 1"
        first_output(pool.run(cell))
        family.record()
        t0 = time.monotonic()
        pool.disconnect()
        time.sleep(4.0)  # twice the idle timeout, the cell still running
        assert "train" in [p["name"] for p in detached_client.listing()]
        assert family.alive(timeout=0) != []
        assert family.alive(timeout=60) == []  # then it stops by itself
        assert time.monotonic() - t0 > 6.0  # not before the cell ended
        assert family.folders_left() == []
    finally:
        with contextlib.suppress(NbddpError):
            pool.disconnect()
        family.clean()


@pytest.mark.timeout(120)
@two_ranks
def test_interrupt_stuck_says_when_the_detached_pool_does_not_answer(detached, monkeypatch):
    """The supervisor is frozen (SIGSTOP): an interrupt goes unanswered, and once the
    grace period and STUCK_AFTER have passed the client says so (a front end may then
    raise KeyboardInterrupt); the cell is read to its end before the next request."""
    monkeypatch.setattr(detached_pool, "STUCK_AFTER", 1.0)
    pool = detached.pool
    events = pool.run("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    first_output(events)
    assert pool.interrupt_stuck() is False
    supervisor = detached.family.supervisor
    supervisor.suspend()
    try:
        pool.interrupt()
        assert pool.interrupt_stuck() is False  # not yet: the grace period runs
        deadline = time.monotonic() + 30
        while not pool.interrupt_stuck():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        supervisor.resume()
    _text, _seen, end = collect(pool.run("'after'", want_values=True))
    assert end.values == {0: "after", 1: "after"}
    assert "it was interrupted" in end.notes[0], end.notes
    assert pool.interrupt_stuck() is False


def test_slow_ranks_and_a_subgroup_are_never_taken_for_a_deadlock(detached):
    """A detached pool watches for deadlocks as a local one does: ranks waiting 1.5 s for
    a slow one, odd ranks finishing while the evens wait in a subgroup, no alarm; a
    skipped all_reduce ends by itself, named, namespaces kept (issue 37)."""
    from test_deadlock import SLOW, no_alarm

    pool = detached.pool
    _, _, end = collect(pool.run(SLOW))
    no_alarm(end)
    _, _, end = collect(pool.run("if rank != 1:\n    dist.all_reduce(torch.ones(2))"))
    assert end.deadlock.startswith("deadlock: "), end
    assert "rank 1 finished the cell" in end.deadlock
