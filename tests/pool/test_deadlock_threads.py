"""Never a false alarm from collectives a thread issues (issue 47, item 1).

A cell's thread keeps issuing after the cell has ended on its rank
(``torch.distributed.checkpoint.async_save``, a metrics thread's all_reduce), so a
finished rank's backend count is not final. Before the fix, a peer whose own thread was
one operation ahead looked like a rank left behind: ``CellDeadlocked``, the group aborted,
the checkpoint failed on every rank. Only the main thread's operations are compared now
(nbddp.rank.seq). Each case has one rank 2 s slower than the others, so the others
finish while their threads still issue.
"""

from __future__ import annotations

import random

import pytest
from test_deadlock import _soak_cell

from helpers import collect, healthy
from nbddp.pool.facade import raise_for_end

SLOW = 2.0  # the last rank's lag: the others finish the cell while their threads run

THREAD = f"""
import threading, time, torch, torch.distributed as dist
_bg_group = dist.new_group(list(range(world_size)))
_bg_sums = []
def _bg():
    t = torch.ones(1)
    for _ in range(40):  # about 4 s: past the cell's end on every rank
        t.fill_(1.0)
        dist.all_reduce(t, group=_bg_group)
        _bg_sums.append(t.item())
        time.sleep(0.1)
_bg_thread = threading.Thread(target=_bg)
_bg_thread.start()
if rank == world_size - 1:  # the others finish at once: their threads issue on
    time.sleep({SLOW})
"""

ASYNC_SAVE = f"""
import time, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
_sd = {{"w": torch.arange(8.0), "b": torch.ones(3)}}
_ckpt_group = dist.new_group(backend="gloo")  # its thread's collectives: a group of their own
_saving = dcp.async_save(_sd, checkpoint_id=CKPT, process_group=_ckpt_group)
if rank == world_size - 1:  # the others finish at once: their threads issue on
    time.sleep({SLOW})
"""

LOAD = """
_saving.result()  # raises if the checkpoint failed on this rank
_back = {"w": torch.zeros(8), "b": torch.zeros(3)}
dcp.load(_back, checkpoint_id=CKPT, process_group=_ckpt_group)
bool(torch.equal(_back["w"], torch.arange(8.0)) and torch.equal(_back["b"], torch.ones(3)))
"""


def _no_alarm(end) -> None:
    raise_for_end(end)
    assert not end.deadlock, end.deadlock
    assert not end.notes, end.notes


@pytest.mark.timeout(120)
def test_a_thread_all_reducing_past_the_cells_end_is_never_taken_for_a_deadlock(pool_of_size):
    pool = healthy(pool_of_size)
    n = pool.world_size
    _, _, end = collect(pool.run(THREAD))
    _no_alarm(end)
    sums = pool.execute("_bg_thread.join(60)\n_bg_sums")
    assert sums == [[float(n)] * 40] * n  # every all_reduce of the thread's completed


@pytest.mark.timeout(120)
def test_dcp_async_save_with_a_slow_rank_is_never_taken_for_a_deadlock(pool_of_size, tmp_path):
    pool = healthy(pool_of_size)
    pool.execute(f"CKPT = {str(tmp_path / 'ckpt')!r}")
    _, _, end = collect(pool.run(ASYNC_SAVE))
    _no_alarm(end)
    assert pool.execute(LOAD) == [True] * pool.world_size


# collectives from elsewhere than a plain call on the main thread, a rank {SLOW} s late
LATE = f"if rank == world_size - 1:\n    time.sleep({SLOW})\n"
ELSEWHERE = {
    "a DDP comm hook": """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
_m = DDP(torch.nn.Linear(4, 1))
_m.register_comm_hook(None, default_hooks.allreduce_hook)
for _ in range(3):
    _m(torch.randn(2, 4)).sum().backward()
""",
    "functional collectives (what torch.compile issues)": """
import torch.distributed._functional_collectives as funcol
_y = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
_y = float(funcol.wait_tensor(_y)[0]) if hasattr(funcol, "wait_tensor") else float(_y[0])
assert _y == world_size, _y
""",
    "a metrics thread logging an all_reduced loss": """
import threading
_metrics_group = dist.new_group(list(range(world_size)))
def _log_mean():
    for step in range(20):
        loss = torch.tensor([float(step + rank)])
        dist.all_reduce(loss, group=_metrics_group)
        time.sleep(0.05)
_metrics = threading.Thread(target=_log_mean, daemon=True)
_metrics.start()
""",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(ELSEWHERE))
def test_collectives_from_hooks_functional_calls_and_threads_raise_no_alarm(pool_of_size, case):
    pool = healthy(pool_of_size)
    head = "import time, torch, torch.distributed as dist\n"
    _, _, end = collect(pool.run(head + ELSEWHERE[case] + LATE))
    _no_alarm(end)
    if "_metrics" in ELSEWHERE[case]:
        assert pool.execute("_metrics.join(60)\n_metrics.is_alive()") == [False] * pool.world_size


SOAK_THREAD = """
import threading, time, torch, torch.distributed as dist
_soak_group = dist.new_group(list(range(world_size)))
_soak_stop = threading.Event()
_soak_ops = [0]
def _soak_bg():  # a collective every 10 ms until told to stop, on every rank alike
    t, go = torch.ones(1), torch.ones(1)
    while True:
        go.fill_(0.0 if _soak_stop.is_set() else 1.0)
        dist.all_reduce(go, op=dist.ReduceOp.MIN, group=_soak_group)  # stop together
        if not go.item():
            return
        dist.all_reduce(t.fill_(1.0), group=_soak_group)
        _soak_ops[0] += 1
        time.sleep(0.01)
_soak = threading.Thread(target=_soak_bg, daemon=True)
_soak.start()
"""


def _soak(pool, cells: int) -> None:
    pool = healthy(pool)
    pool.execute(SOAK_THREAD)
    rng = random.Random(47)
    for i in range(cells):
        code = _soak_cell(rng, pool.world_size)
        if i % 3 == 0:  # a rank 0.35 s behind the others: they are sampled as finished
            code += f"if rank == {i % pool.world_size}:\n    time.sleep(0.35)\n"
        _, _, end = collect(pool.run(code))
        raise_for_end(end)
        assert not end.deadlock, (i, code, end.deadlock)
        assert not end.notes, (i, code, end.notes)
    stopped = pool.execute("_soak_stop.set()\n_soak.join(60)\n(_soak.is_alive(), _soak_ops[0])")
    assert all(not alive and ops > 0 for alive, ops in stopped), stopped
    assert len({ops for _, ops in stopped}) == 1, stopped  # every rank's thread in step


@pytest.mark.at_sizes(3)
def test_a_soak_of_mixed_cells_beside_background_collectives_never_aborts(pool_of_size):
    """60 cells here, at 3 ranks; the slow tier runs the issue's 500."""
    _soak(pool_of_size, 60)


@pytest.mark.slow
@pytest.mark.at_sizes(3)
@pytest.mark.timeout(900)
def test_a_500_cell_soak_beside_background_collectives_never_aborts(pool_of_size):
    _soak(pool_of_size, 500)
