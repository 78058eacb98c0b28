"""Detached pools (issue 25) without IPython: ``nbddp.detached_client`` and ``Pool.connect``.

A detached pool's supervisor is a process of its own that holds the ranks; these tests
are its client, as a kernel is. Every pool lives under a ``$NBDDP_HOME`` in the test's
temp folder, never in ``~/.nbddp``, and each test checks (or its fixture does) that
what the pool ran and held is gone at the end: the supervisor, every process under it
(fork server, store, ranks) and its folders. Real pools over gloo; the pools of the
fault matrix are shared by the module (a detached start costs about 2.5 s here).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import psutil
import pytest
import torch

from helpers import DetachedFamily, collect, wait_gone
from nbddp import Pool, capture, detached_client
from nbddp import protocol as P
from nbddp.errors import CellFailed, CellInterrupted, NbddpError, PoolClosedError
from nbddp.metric_store import CellMetrics
from nbddp.pool import raise_for_end
from test_failures import CASES, check_case

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


@pytest.fixture(scope="module", params=SIZES, ids=[f"{n}ranks" for n in SIZES])
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
    assert again.resumed is False  # no cell ran meanwhile
    assert again.world_size == n
    assert again.pids == pids
    assert again.execute(state) == before
    assert again.execute(SUM) == [float(n)] * n  # the group is whole


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
    pids = list(pool.pids)
    code = (
        HEAD + f"import os, signal\nif rank == {bad}:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)"
    )
    _text, seen, end = collect(pool.run(code))
    detached.family.record()  # the new rank's process
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
    assert pool.execute(STATE) == [(None if r == bad else 100 + r, r) for r in range(n)]
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
    """tests/test_failures.py's cases, checked the same way, on a detached pool. A death
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
    from nbddp.drive import drive

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
