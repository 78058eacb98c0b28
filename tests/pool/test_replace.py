"""A rank that dies is replaced, and the others keep their state (issue 24).

Real pools at world sizes 2, 3, 4 and 8 (gloo). Each death case checks that
the cell ends with the root cause first, that every survivor kept its state
(by value), that the new rank is new (and re-ran the cells without collectives: its own
state, test_rerun.py), and that a collective over all ranks
works in the next cell. The fault matrix (test_failures.py) covers deaths by
``os._exit``, SIGKILL from inside and SIGSEGV at every size; here: SIGKILL from
outside while the others wait in a collective, rank 0 (whose death would take
the group's store with it, were the store in rank 0), two ranks at once, a
death between cells, a death while the group re-forms, a death while the
notebook ships a large ``--need``, the same rank dying again and again, and
``%ddp copy`` healing the new rank.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
import torch

from helpers import collect, healthy, wait_gone
from nbddp import Pool
from nbddp.pool.errors import CaptureError, CellFailed
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P
from tiers import sizes

SIZES = [2, 3, 4, 8]
HAD = r"rank R: a new process took its place; it had (.*) \(gone\) and had imported (.*)"
SUM = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized_pool(request):
    with Pool(request.param, grace=1.0) as pool:
        yield pool


def _setup(pool):
    """Every rank holds state of its own: ``kept`` (by value) and a model."""
    healthy(pool)
    pool.roster.deaths.clear()  # this test's deaths are its own (3 in a minute stop the pool)
    pool.execute(
        "import torch.distributed as dist\nkept = rank + 100\n"
        "torch.manual_seed(rank)\nmodel = torch.nn.Linear(3, 2)"
    )
    return list(pool.pids)


def _message(end) -> str:
    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    return str(failed.value)


def _check_replaced(pool, end, dead: list[int], pids: list[int]) -> None:
    """Survivors kept their state and processes; the dead ones are new and fresh; all
    ranks are in one group again; the notes say what was lost."""
    n = pool.world_size
    state = pool.execute("(kept if 'kept' in globals() else None, rank, world_size)")
    # a new rank re-ran _setup's cell (no collective) by itself: its own kept, not a survivor's
    assert state == [(100 + r, r, n) for r in range(n)]
    for r in range(n):
        assert (pool.pids[r] == pids[r]) == (r not in dead), (r, pids, pool.pids)
    for r in dead:
        said = [m for n in end.notes if (m := re.fullmatch(HAD.replace("R", str(r)), n))]
        assert said, end.notes
        objects, imported = (set(said[0].group(i).split(", ")) for i in (1, 2))
        assert {"kept", "model"} <= objects, end.notes
        assert "dist" in imported, end.notes  # a module: imports are named apart
    assert not any("lost" in note for note in end.notes), end.notes
    assert pool.execute(SUM) == [float(n)] * n
    assert wait_gone([pids[r] for r in dead]) == []


def _when_ready(events, ranks: int, then):
    """Pass events on; call ``then`` once ``ranks`` ranks printed "ready" and 0.3 s passed."""
    ready, at = 0, None
    for event in events:
        if isinstance(event, P.Output):
            ready += event.text.count("ready")
            if ready >= ranks and at is None:
                at = time.monotonic() + 0.3
        if at is not None and time.monotonic() >= at:
            then()
            at = float("inf")
        yield event


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["middle", "rank 0", "two ranks"])
def test_sigkill_from_outside_while_the_others_wait_in_a_collective(sized_pool, who):
    pool = sized_pool
    n = pool.world_size
    dead = {"middle": [n - 2 if n > 2 else 1], "rank 0": [0], "two ranks": [0, n - 1]}[who]
    pids = _setup(pool)
    code = (
        "import time\nt = torch.ones(1)\nprint('ready', flush=True)\n"
        f"if rank in {dead}:\n    time.sleep(60)\ndist.all_reduce(t)"
    )

    def kill():
        for r in dead:
            os.kill(pids[r], signal.SIGKILL)

    _text, seen, end = collect(_when_ready(pool.run(code, tick=0.05), n, kill))
    message = _message(end)
    lines = message.splitlines()
    # the root cause first: the deaths, in one line (the same failure on several ranks)
    deaths = ("ranks " if len(dead) > 1 else "rank ") + ", ".join(map(str, dead))
    assert lines[0] == f"{deaths} died (killed by SIGKILL)", message
    others = [r for r in range(n) if r not in dead]
    if others:
        assert re.search(
            r": freed from a collective \(all_reduce\) after rank \d+ died; state kept$", lines[1]
        ), message
    for r in dead:
        assert P.RankState(r, "dead") in seen
        assert P.RankState(r, "replaced") in seen
    assert "formed again with the new rank" in message or "re-formed with the new rank" in message
    _check_replaced(pool, end, dead, pids)


def _killed_between_cells(pool) -> tuple[int, list[int]]:
    """The last rank SIGKILLed between cells, gone and its connections closed (nothing
    runs): (that rank, the pids before)."""
    bad = pool.world_size - 1
    pids = _setup(pool)
    os.kill(pids[bad], signal.SIGKILL)
    assert wait_gone([pids[bad]]) == []
    time.sleep(0.2)  # its connections close; nothing runs
    return bad, pids


@pytest.mark.timeout(120)
def test_a_death_between_cells_is_said_and_replaced_before_the_next(sized_pool):
    pool = sized_pool
    bad, pids = _killed_between_cells(pool)
    _, _, end = collect(pool.run("rank"))
    assert end.errors == {}
    assert end.exits == {}
    assert end.notes[0] == f"rank {bad} died (killed by SIGKILL) since the last cell", end.notes
    _check_replaced(pool, end, [bad], pids)


@pytest.mark.timeout(120)
def test_a_death_that_status_reads_first_is_still_replaced_and_the_others_keep_state(sized_pool):
    """``%ddp status`` between a death and the next cell reads the death (its Gone): the
    next cell still replaces only that rank (before, status marked the pool lost, and the
    next cell started every rank anew, every namespace lost)."""
    pool = sized_pool
    n = pool.world_size
    bad, pids = _killed_between_cells(pool)
    rows = pool.status(timeout=1.0)  # waits for its reply, and reads its end instead
    assert [row.rank for row in rows] == list(range(n))
    _, _, end = collect(pool.run("rank"))
    assert end.errors == {}
    assert end.notes[0] == f"rank {bad} died (killed by SIGKILL) since the last cell", end.notes
    _check_replaced(pool, end, [bad], pids)


@pytest.mark.timeout(120)
def test_a_death_while_the_group_re_forms_is_replaced_too(sized_pool):
    """Rank 1 fails, so the group is aborted and re-formed; rank R dies as the re-form
    begins, while the others wait for it in the new group's rendezvous: they are freed,
    a new process takes R's place, and every rank joins the next re-form."""
    pool = sized_pool
    n = pool.world_size
    bad = n - 1
    pids = _setup(pool)
    pool.execute(  # the rank's own keeper: it dies as it starts to re-form
        "import os, nbddp.rank.group as wg\n"
        f"if rank == {bad}:\n    wg.GroupKeeper.reform = lambda self, g: os._exit(5)"
    )
    _, _, end = collect(
        pool.run(
            "t = torch.ones(1)\nif rank == 0:\n    raise ValueError('first')\ndist.all_reduce(t)"
        )
    )
    assert _message(end).splitlines()[0] == "rank 0: ValueError: first"
    assert any(f"new rank {bad}" in note for note in end.notes), end.notes
    _check_replaced(pool, end, [bad], pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 8])
def test_a_death_while_the_notebook_ships_a_large_need(n):
    """Rank 1 is killed the moment the cell is sent: while the ranks load the 64 MB (or,
    on a fast day, just after; it then sleeps until killed)."""
    big = torch.ones(64 * 2**20 // 4)
    with Pool(n, grace=1.0) as pool:
        pids = _setup(pool)
        bad = 1
        code = (
            "s = big.sum().item()\nimport time\nif rank == 1:\n    time.sleep(60)\n"
            "dist.all_reduce(torch.ones(1))"
        )

        def kill_at_start(events):
            for event in events:
                if isinstance(event, P.RankStates):
                    os.kill(pids[bad], signal.SIGKILL)
                yield event

        _, _, end = collect(kill_at_start(pool.run(code, needs={"big": big})))
        assert _message(end).splitlines()[0] == f"rank {bad} died (killed by SIGKILL)"
        assert os.listdir(pool.procs.shm) == []  # every receiver loaded it, or died: removed
        assert pool.execute("'big' in globals()") == [r != bad for r in range(n)]
        _check_replaced(pool, end, [bad], pids)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_again_and_again_stops_the_pool_saying_why():
    with Pool(3, grace=1.0) as pool:
        pool.execute("x = rank")
        ends = []
        for _ in range(3):
            _, _, end = collect(pool.run("import os\nif rank == 1:\n    os._exit(3)"))
            ends.append(end)
        assert any("a new process took its place" in n for n in ends[1].notes)
        last = " ".join(ends[2].notes)
        assert "rank 1 died 3 times within 60 s, so it was not replaced again" in last, last
        assert "the ranks' state is lost" in last
        assert pool.needs_restart
        assert pool.execute("'x' in globals()") == [False] * 3  # a new pool


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_on_death_restart_stops_the_whole_pool_as_before(n):
    with Pool(n, grace=1.0, on_death="restart") as pool:
        pids = _setup(pool)
        _, seen, end = collect(
            pool.run("import os\nif rank == 1:\n    os._exit(7)\ndist.barrier()")
        )
        assert _message(end).splitlines()[0] == "rank 1 died (exit code 7)"
        assert any("the ranks' state is lost" in note for note in end.notes), end.notes
        assert P.RankState(1, "replaced") not in seen
        assert pool.execute("'kept' in globals()") == [False] * n
        assert set(pool.pids).isdisjoint(pids)


@pytest.mark.timeout(120)
def test_copy_heals_the_new_rank_from_a_survivor(sized_pool):
    pool = sized_pool
    n = pool.world_size
    bad = n - 1
    pids = _setup(pool)
    pool.execute("opt = torch.optim.SGD(model.parameters(), lr=0.1)")
    _, _, _end = collect(pool.run(f"import os\nif rank == {bad}:\n    os._exit(1)"))
    assert pool.pids[bad] != pids[bad]
    # the new rank re-ran the cells without collectives: a model of its own (seeded by rank)
    sums = "sum(p.sum().item() for p in model.parameters())"
    assert len(set(pool.execute(sums))) == n
    done = pool.copy(["model", "opt"], 0)  # to every other rank
    assert done.dst == tuple(range(1, n))
    sums = pool.execute(
        "sum(p.sum().item() for p in model.parameters()), opt.param_groups[0]['params'][0] is "
        "next(model.parameters())"
    )
    assert len({s for s, _ in sums}) == 1, sums  # every rank's parameters are rank 0's
    assert all(same for _, same in sums)  # the optimizer holds the copied model's parameters
    # each rank has its own copy: a step on one leaves the others alone
    pool.execute("with torch.no_grad():\n    next(model.parameters()).add_(1)", ranks=[1])
    after = pool.execute("sum(p.sum().item() for p in model.parameters())")
    assert after[0] == sums[0][0]
    assert after[1] != sums[0][0]
    healthy(pool)


@pytest.mark.timeout(120)
def test_copy_through_shared_memory_lands_on_each_ranks_device(pool):
    pool.execute("import torch\nw = torch.arange(2**20, dtype=torch.float32) * (rank + 1)")
    done = pool.copy(["w"], 1, [0])
    assert done.via == "through shared memory"
    assert done.nbytes >= 4 * 2**20
    assert pool.execute("(w.device.type, w[3].item())") == [("cpu", 6.0), ("cpu", 6.0)]
    assert os.listdir(pool.procs.shm) == []


def test_copy_refuses_what_is_bound_to_the_group_in_one_line(pool):
    pool.execute(
        "import torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(torch.nn.Linear(2, 2))\nboth = {'m': model}\npg = dist.group.WORLD"
    )
    with pytest.raises(CaptureError) as err:
        pool.copy(["both"], 0)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "rank 0: cannot copy 'both': it holds a DistributedDataParallel wrapper"
    ), message
    with pytest.raises(CaptureError, match=r"cannot copy 'pg': it is a ProcessGroup"):
        pool.copy(["pg"], 0)
    with pytest.raises(CaptureError, match=r"rank 0: name 'nothing' is not defined"):
        pool.copy(["nothing"], 0)
    with pytest.raises(CaptureError, match="rank 1 is the source"):
        pool.copy(["model"], 1, [1])
    assert pool.copy(["model"], 0).rewrapped == ("model",)  # a DDP wrapper: wrapped again
    pool.execute("net = model.module")
    assert pool.copy(["net"], 0).dst == (1,)
    assert pool.execute("type(net).__name__") == ["Linear", "Linear"]


def test_stop_leaves_no_process_and_no_shared_memory_after_replacements():
    pool = Pool(3, grace=1.0).start()
    store = pool.procs.store[0]
    first = list(pool.pids)
    collect(pool.run("import os\nif rank == 0:\n    os._exit(1)"))
    shm, folder = pool.procs.shm, pool.procs.dir
    everything = first + list(pool.pids) + [store]
    assert psutil.pid_exists(store)  # the store outlived rank 0
    pool.stop()
    assert wait_gone(everything) == []
    assert not os.path.exists(shm)
    assert not os.path.exists(folder)
