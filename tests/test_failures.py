"""The crash matrix: every way a rank can fail, through real workers (gloo).

Each case must end within its bound, name the rank and the cause, say whether
state was kept, and leave a pool on which the next cell works.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

import psutil
import pytest

from helpers import collect, wait_gone
from nbddp import Pool
from nbddp import protocol as P
from nbddp.errors import CellFailed
from nbddp.pool import raise_for_end

COLLECTIVE = "import torch.distributed as dist\n"


@dataclass
class Case:
    name: str
    code: str
    message: str  # regex the raised error's text must match
    state_kept: bool
    interrupt_after: float | None = None
    want_values: bool = False
    bound: float = 10.0
    output: tuple[int, str, str] | None = None  # (rank, stream, text) that must have arrived


CASES = [
    Case("raise", "if rank == 1:\n    raise ValueError('boom')", r"rank 1: ValueError: boom", True),
    Case(
        "sys.exit",
        "import sys\nif rank == 1:\n    sys.exit(3)\nimport time\ntime.sleep(30)",
        r"rank 1 died \(exit code 3\)",
        False,
    ),
    Case(
        "os._exit",
        "import os\nprint('bye', flush=True)\nif rank == 1:\n    os._exit(7)\n"
        "import time\ntime.sleep(30)",
        r"rank 1 died \(exit code 7\)",
        False,
        output=(1, "stdout", "bye\n"),
    ),
    Case(
        "SIGKILL",
        "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "import time\ntime.sleep(30)",
        r"rank 1 died \(killed by SIGKILL\)",
        False,
    ),
    Case(
        "SIGSEGV",
        "import ctypes\nif rank == 1:\n    ctypes.string_at(0)\nimport time\ntime.sleep(30)",
        r"rank 1 died \(killed by SIGSEGV\)",
        False,
        output=(1, "stderr", "Fatal Python error: Segmentation fault"),
    ),
    Case(
        "unpicklable result",
        "import threading\nthreading.Lock() if rank == 1 else rank",
        r"rank 1: PicklingError: the cell's value \(lock\) cannot be pickled",
        True,
        want_values=True,
    ),
    Case(
        "unprintable exception",
        "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n"
        "if rank == 0:\n    raise Odd()",
        r"rank 0: Odd: <str\(\) of the exception failed: RuntimeError: no>",
        True,
    ),
    Case(
        "failure before a collective",
        COLLECTIVE + "t = torch.ones(1)\nif rank == 1:\n    raise ValueError('before')\n"
        "dist.all_reduce(t)",
        r"^rank 1: ValueError: before\nrank 0: RuntimeError: .*Connection closed by peer",
        True,
    ),
    Case(
        "failure inside a collective loop",
        COLLECTIVE + "for step in range(1000):\n    t = torch.ones(1)\n"
        "    if rank == 0 and step == 50:\n        raise ValueError(f'step {step}')\n"
        "    dist.all_reduce(t)",
        r"^rank 0: ValueError: step 50\nrank 1: RuntimeError: .*Connection closed",
        True,
    ),
    Case(
        "death inside a collective",
        COLLECTIVE + "import os, time\nif rank == 1:\n    time.sleep(0.3)\n    os._exit(9)\n"
        "dist.barrier()",
        r"rank 1 died \(exit code 9\)",
        False,
    ),
    Case(
        "infinite loop + interrupt",
        "while True:\n    pass",
        r"cell interrupted",
        True,
        interrupt_after=0.5,
    ),
    Case(
        "time.sleep + interrupt",
        "import time\ntime.sleep(60)",
        r"cell interrupted",
        True,
        interrupt_after=0.5,
    ),
    Case(
        "deadlock in a collective + interrupt",
        COLLECTIVE + "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(60)",
        r"cell interrupted",
        True,
        interrupt_after=0.5,
    ),
    Case(
        "peer finished, rank waits in a collective + interrupt",
        COLLECTIVE + "if rank == 0:\n    dist.barrier()",
        r"cell interrupted",
        True,
        interrupt_after=0.5,
    ),
    Case(
        "stuck in C ignoring SIGINT + interrupt",
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)",
        r"cell interrupted\nranks 0, 1 did not stop within 3 s of the interrupt",
        False,
        interrupt_after=0.5,
    ),
]


@pytest.fixture(scope="module")
def matrix_pool():
    with Pool(2) as pool:
        yield pool


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crash_matrix(matrix_pool, case):
    pool = matrix_pool
    pool.execute("import torch.distributed as dist\nkept = rank + 100")
    if case.interrupt_after:
        threading.Timer(case.interrupt_after, pool.interrupt).start()
    t0 = time.monotonic()
    text, _, end = collect(pool.run(case.code, want_values=case.want_values))
    assert time.monotonic() - t0 < case.bound
    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    assert re.search(case.message, str(failed.value), re.S), str(failed.value)
    if case.output:
        rank, stream, expected = case.output
        assert expected in text.get((rank, stream), "")
    # the next cell works, with state kept or a new pool that says it was lost
    _, _, nxt = collect(pool.run("(kept if 'kept' in globals() else None, rank)", want_values=True))
    if case.state_kept:
        assert nxt.values == {0: (100, 0), 1: (101, 1)}, nxt
        assert not any("state" in n and "lost" in n for n in end.notes + nxt.notes)
    else:
        assert nxt.values == {0: (None, 0), 1: (None, 1)}
        assert any("state" in n and "lost" in n for n in end.notes + nxt.notes)
    check = COLLECTIVE + "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    assert pool.execute(check) == [2.0, 2.0]


def test_a_collective_failure_says_the_group_was_re_formed(matrix_pool):
    code = COLLECTIVE + "if rank == 1:\n    raise ValueError('x')\ndist.barrier()"
    _, _, end = collect(matrix_pool.run(code))
    (note,) = end.notes
    assert "rank 1 had stopped while rank 0 still ran" in note
    assert "re-formed" in note and "kept its namespace" in note and "DDP models" in note


def test_a_worker_whose_connection_drops_exits(matrix_pool):
    matrix_pool.execute("1")
    victim = matrix_pool._ranks[1]
    pid = victim.pid
    victim.conn.close()
    assert wait_gone([pid], zombies=False) == []
    matrix_pool.restart()


def test_the_interrupt_reaches_only_ranks_running_the_cell(matrix_pool):
    matrix_pool.execute("import time")
    threading.Timer(0.5, matrix_pool.interrupt).start()
    _, seen, end = collect(matrix_pool.run("time.sleep(60)", ranks=[1]))
    assert end.interrupted == "interrupt" and end.ranks == (1,)
    assert P.RankState(1, "interrupted") in seen
    assert matrix_pool.execute("rank") == [0, 1]


def test_soak_many_cells_leak_no_fds_threads_or_processes():
    """500 cells, some failing on a rank, a few leaving a peer in a collective."""
    me = psutil.Process()
    with Pool(2) as pool:
        pool.execute("import torch.distributed as dist")

        def snapshot():
            procs = [me, *(psutil.Process(p) for p in pool.pids)]
            return (
                [p.num_fds() for p in procs],
                [p.num_threads() for p in procs],
                len(me.children(recursive=True)),
            )

        def cells(n):
            for i in range(n):
                if i % 100 == 50:
                    code = COLLECTIVE + "if rank == 1:\n    raise ValueError()\ndist.barrier()"
                elif i % 10 == 3:
                    code = "1 / (rank - 1)"
                else:
                    code = f"x = {i} + rank\nprint(x)"
                collect(pool.run(code))

        cells(60)  # warm up: lazy imports, first re-form
        pids = list(pool.pids)
        before = snapshot()
        cells(500)
        after = snapshot()
        assert pool.pids == pids  # no restart was needed
        fds0, threads0, children0 = before
        fds1, threads1, children1 = after
        assert all(b <= a + 2 for a, b in zip(fds0, fds1, strict=True)), (fds0, fds1)
        assert threads1 == threads0 and children1 == children0, (before, after)
        assert os.getpid() == me.pid


def test_the_process_group_timeout_ends_a_collective_nobody_joins():
    with Pool(2, pg_timeout=2) as pool:
        pool.execute("import torch.distributed as dist\nkept = rank")
        t0 = time.monotonic()
        _, _, end = collect(pool.run("if rank == 0:\n    dist.barrier()"))
        assert 2 <= time.monotonic() - t0 < 10
        assert list(end.errors) == [0] and "Timed out" in end.errors[0].message
        assert pool.execute("kept") == [0, 1]


def test_a_sigkill_death_hints_at_the_oom_killer(matrix_pool):
    _, _, end = collect(matrix_pool.run("import os\nif rank == 0:\n    os.kill(os.getpid(), 9)"))
    assert any("out-of-memory killer" in note for note in end.notes)
