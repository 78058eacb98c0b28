"""The root cause first, every time: a rank killed in the middle of a DDP step heads the
cell's error, whatever order its peers' transport errors (gloo's ``Read error ...
Connection reset by peer``) came in (issue 45, item 5).

A DDP backward's all_reduce runs in C++, so a survivor's error names no collective; and
its socket breaks as the killed process ends, before the notebook sees that end, so the
survivor's error is stamped first. Before the fix the survivors' error came first in 14
of 20 runs at 2 ranks, 16 at 3, 11 at 4 and 19 at 8 (2 busy cores). One pool per size
serves every run: the dead rank is replaced, the others keep
their state. ``-m slow`` runs 20 per size, as the issue asks.
"""

from __future__ import annotations

import re

import pytest

from helpers import collect
from nbddp import Pool
from nbddp.pool.errors import CellFailed, RankDied
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P
from nbddp.wire.stacks import rank_set
from tiers import sizes

SIZES = [2, 3, 4, 8]
KILLED = 1
STEP = (
    "import os, torch\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "kept = rank + 100\n"
    "model = DDP(torch.nn.Linear(8, 1))\n"
    "for step in range(100000):\n"
    f"    if rank == {KILLED} and step == 5:\n"
    "        os.kill(os.getpid(), 9)\n"
    "    model(torch.randn(4, 8)).sum().backward()\n"
)


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized_pool(request):
    with Pool(request.param, grace=1.0) as pool:
        yield pool


def _killed_mid_step(pool: Pool) -> None:
    """One run: rank 1 SIGKILLs itself in its sixth DDP step; the death heads the error,
    every other rank is named freed after it, with its state kept."""
    n = pool.world_size
    pool.roster.deaths.clear()  # each run's death is its own (3 in a minute stop the pool)
    _, seen, end = collect(pool.run(STEP, tick=0.05))
    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    message = str(failed.value)
    lines = message.splitlines()
    assert lines[0] == f"rank {KILLED} died (killed by SIGKILL)", message
    assert failed.value.failures == [RankDied(KILLED, -9, "", end.exits[KILLED].when)], message
    others = [r for r in range(n) if r != KILLED]
    assert sorted(f.rank for f in failed.value.consequences) == sorted(end.errors), message
    assert lines[1].startswith(f"{rank_set(sorted(end.errors))}: freed from a collective"), message
    assert lines[1].endswith(f" after rank {KILLED} died; state kept"), message
    assert all(P.RankState(r, "freed") in seen for r in end.errors), seen
    stuck = _stuck_in_gloo(end.notes)
    kept = [None if r == KILLED or r in stuck else 100 + r for r in range(n)]
    assert pool.execute("globals().get('kept')") == kept
    assert set(end.errors) <= set(others)


def _stuck_in_gloo(notes) -> set[int]:
    """The ranks the pool restarted as stuck in DDP's backward after the abort, each said
    in a note: gloo never fails a send queued on a connection it closes, and waits its
    30 min timeout (docs/failures.md: 1 run in about 100 at 8 ranks, 2 busy cores). Only
    that, exactly: a rank restarted anywhere else fails the test."""
    said = [n for n in notes if "stopped and given " in n]
    if not said:
        return set()
    (note,) = said
    seen = re.findall(r"rank (\d+) last seen at ([^;)]*)", note)
    assert seen, note
    assert all("backward" in where for _, where in seen), note
    return {int(r) for r, _ in seen}


def _runs(pool: Pool, runs: int) -> None:
    for _ in range(runs):
        _killed_mid_step(pool)
    check = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    assert pool.execute(check) == [float(pool.world_size)] * pool.world_size


@pytest.mark.timeout(240)
def test_a_death_mid_ddp_step_heads_the_error(sized_pool):
    _runs(sized_pool, 5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_death_mid_ddp_step_heads_the_error_20_times(sized_pool):
    _runs(sized_pool, 20)
