"""A replaced rank, or one a resize added, re-runs what it can (issue 45, item 6).

Real pools at 3 and 8 ranks (gloo), ``heal=["model", "opt"]``. Cells without a
collective made each rank's own data shard, loss function and training step; a cell
built the DDP model (collectives); a cell rebuilt the optimizer (no collective, but it
touches healed names). A rank killed between cells, then one killed in a collective:
each new rank re-runs the first cells alone, and only those, so the next training cell
runs on every rank, the new rank's shard is its own (not a survivor's), the healed model
is not reset, and the notes say what ran, what did not and what still lacks.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from helpers import collect, healthy, wait_gone
from nbddp import Pool
from nbddp.pool.rerun import scan
from nbddp.wire import protocol as P

SIZES = [3, 8]

DATA = (  # In [1]: each rank's own shard (no collective)
    "Xr = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))\n"
    "yr = Xr.sum(1, keepdim=True)\nloss_fn = torch.nn.MSELoss()"
)
STEP = """
def step():
    opt.zero_grad()
    loss = loss_fn(model(Xr), yr)
    loss.backward()
    opt.step()
    return loss.item()
"""  # In [2]: no collective (its body runs when called)
MODEL = (  # In [3]: DDP's constructor broadcasts: collectives
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\nmodel = DDP(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)"
)
OPT = "opt = torch.optim.SGD(model.parameters(), lr=0.05)"  # In [4]: touches healed names
COUNT = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"  # In [5]
SENT = "lr2 = lr * 2"  # In [6]: it reads what the notebook sent (not re-run)
TRAIN = "(step(), Xr.tolist(), [p.detach().sum().item() for p in model.parameters()])"


@pytest.fixture(scope="module", params=SIZES, ids=[f"{n}ranks" for n in SIZES])
def rerun_pool(request):
    with Pool(request.param, grace=1.0, heal=["model", "opt"]) as pool:
        yield pool


def _setup(pool) -> None:
    healthy(pool)
    pool.history.clear()  # (an earlier test's cells)
    for i, code in enumerate([DATA, STEP, MODEL, OPT, COUNT], 1):
        pool.execute(code, label=f"In [{i}]")
    pool.execute(SENT, needs={"lr": 0.1}, versions={"lr": 1}, label="In [6]")
    pool.execute(TRAIN, label="In [7]")


def _trains(pool, replaced: set[int]) -> None:
    """The next training cell runs on every rank; each holds its own shard; the model
    stays the same on every rank (the healed one was not reset)."""
    n = pool.world_size
    out = pool.execute(TRAIN)
    for r, (_loss, xr, _weights) in enumerate(out):
        mine = torch.randn(8, 4, generator=torch.Generator().manual_seed(r))
        assert torch.equal(torch.tensor(xr), mine), f"rank {r} holds another rank's shard"
    assert len({tuple(w) for _, _, w in out}) == 1, out
    assert pool.execute("'t' in globals()") == [r not in replaced for r in range(n)]


def _notes_ok(notes, rank: int) -> None:
    assert f"rank {rank} re-ran In [1], In [2]: Xr, yr, loss_fn, step" in notes, notes
    skipped = f"rank {rank} did not re-run In [4]: it touches model, opt, which --heal names"
    assert any(n.startswith(skipped) for n in notes), notes
    lacks = [n for n in notes if n.startswith(f"rank {rank} still lacks")]
    assert len(lacks) == 1, notes
    assert re.search(r"\bt\b", lacks[0]), notes  # In [5]: collectives
    assert re.search(r"not re-run: In \[5\] \(issued collectives\)", lacks[0]), lacks
    assert not re.search(r"\bDDP\b", lacks[0]), lacks  # an import: the replay brings it
    assert "lr2" in lacks[0], lacks
    assert "In [6] (used objects the notebook sent)" in lacks[0], lacks
    assert re.search(rf"`%ddp copy .*\bt\b.* --from 0 --to {rank}`$", lacks[0]), lacks
    assert not any("In [3]" in n and "re-ran" in n for n in notes), notes


def _when_ready(events, ranks: int, then):
    """Pass events on; call ``then`` once ``ranks`` ranks printed "ready"."""
    ready = 0
    for event in events:
        if isinstance(event, P.Output):
            ready += event.text.count("ready")
            if ready == ranks:
                ready += 1
                then()
        yield event


@pytest.mark.timeout(300)
def test_a_new_rank_re_runs_the_cells_without_collectives_and_trains(rerun_pool):
    pool = rerun_pool
    n = pool.world_size
    _setup(pool)
    # between cells: rank 1 killed
    pid = pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    _, _, end = collect(pool.run("rank"))
    assert not end.errors, end.errors
    _notes_ok(end.notes, 1)
    _trains(pool, {1})
    # in a collective: the last rank killed as the others wait for it
    last, pids = n - 1, list(pool.pids)
    code = (
        "import time\nu = torch.ones(1)\nprint('ready', flush=True)\n"
        f"if rank == {last}:\n    time.sleep(60)\ndist.all_reduce(u)"
    )
    _, seen, end = collect(_when_ready(pool.run(code), n, lambda: os.kill(pids[last], 9)))
    assert P.RankState(last, "replaced") in seen
    _notes_ok(end.notes, last)
    _trains(pool, {1, last})
    assert wait_gone([pids[last]]) == []


@pytest.mark.at_sizes(SIZES[0], fixture="rerun_pool")  # once, at the smallest size
@pytest.mark.timeout(300)
def test_a_resize_up_re_runs_them_on_the_new_rank(rerun_pool):
    pool = rerun_pool
    n = pool.world_size
    _setup(pool)
    line = pool.resize(n + 1).line()
    try:
        assert f"rank {n}: model, opt healed from rank 0" in line, line  # (--heal)
        notes = pool.take_notes()
        assert f"rank {n} re-ran In [1], In [2]: Xr, yr, loss_fn, step" in notes, notes
        lacks = [x for x in notes if x.startswith(f"rank {n} still lacks")]
        assert lacks, notes
        assert not re.search(r"\bmodel\b|\bopt\b", lacks[0]), notes  # healed, not re-run
        xr = pool.execute("Xr.tolist()", ranks=[n])[n]
        mine = torch.randn(8, 4, generator=torch.Generator().manual_seed(n))
        assert torch.equal(torch.tensor(xr), mine)
    finally:
        t0 = time.monotonic()
        pool.resize(n)
        assert time.monotonic() - t0 < 60


def test_the_names_a_cell_binds_and_touches_where_its_top_level_runs():
    binds, touches = scan(
        "import numpy as np\nfrom os import path as p\ndef f(a=lr):\n    return model(a)\n"
        "class K:\n    z = 1\nys = [q for q in Xr]\nfor w in opt.param_groups: pass\nXr[0] = 1"
    )
    assert binds == ("np", "p", "f", "K", "ys", "w")
    assert {"lr", "Xr", "opt"} <= touches
    assert "model" not in touches
    assert "z" not in touches


@pytest.mark.at_sizes(SIZES[0], fixture="rerun_pool")  # once, at the smallest size
@pytest.mark.timeout(180)
def test_a_cell_whose_names_a_later_collective_cell_binds_again_is_not_re_run(rerun_pool):
    """``net = Linear(...)``, then ``net = DDP(net)`` (collectives): re-running the first
    alone would give the new rank a fresh plain model where the others hold a DDP one."""
    pool = rerun_pool
    healthy(pool)
    pool.history.clear()
    pool.execute("net = torch.nn.Linear(4, 1)\nmine = rank", label="In [1]")
    wrap = "from torch.nn.parallel import DistributedDataParallel as DDP\nnet = DDP(net)"
    pool.execute(wrap, label="In [2]")
    pid = pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    _, _, end = collect(pool.run("rank"))
    assert not any("re-ran In [1]" in note for note in end.notes), end.notes
    lacks = [note for note in end.notes if note.startswith("rank 1 still lacks")]
    assert lacks, end.notes
    assert re.search(r"\bmine\b", lacks[0]), lacks
    assert re.search(r"\bnet\b", lacks[0]), lacks
    assert pool.execute("'net' in globals()", ranks=[1]) == [None, False, None]


@pytest.mark.at_sizes(SIZES[0], fixture="rerun_pool")  # once, at the smallest size
@pytest.mark.timeout(180)
def test_a_cell_that_reads_what_only_a_collective_cell_made_is_skipped_and_the_rest_run(
    rerun_pool,
):
    """``u = t.sum()`` needs ``t``, which a collective cell made: the new rank cannot run
    it alone (it would fail), so it is skipped, and the cells after it that do not need it
    still run; a cell whose re-run fails (what it reads is hidden from the scan) does not
    stop the others either."""
    pool = rerun_pool
    healthy(pool)
    pool.history.clear()
    pool.execute(COUNT, label="In [1]")  # t: collectives
    pool.execute("u = t.sum()", label="In [2]")  # reads t: not alone
    pool.execute("import os\nv = int(os.environ['RANK']) * 2", label="In [3]")
    pool.execute("w = globals()['t'].sum()", label="In [4]")  # a read no scan sees: fails
    pool.execute("z = rank + 7", label="In [5]")
    pid = pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    _, _, end = collect(pool.run("rank"))
    assert "rank 1 re-ran In [3], In [5]: os, v, z" in end.notes, end.notes
    assert any(n.startswith("rank 1: re-running In [4] failed (") for n in end.notes), end.notes
    assert pool.execute("(v, z, 'u' in globals())", ranks=[1])[1] == (2, 8, False)
