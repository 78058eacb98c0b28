"""``%%ddp --profile``: every rank's time in collectives and top operations, the slowest
rank marked, with torch's profiler and with cProfile, at 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers import collect
from nbddp import Pool
from nbddp.pool.facade import raise_for_end
from nbddp.rank import profiling
from nbddp.wire import protocol as P
from tiers import sizes

SIZES = [2, 3, 4]

# the last rank works (matrix products, or a Python loop), then every rank all-reduces:
# the others wait for it inside the collective
SLOW_LAST = (
    "import torch, torch.distributed as dist\n"
    "def spin():\n"
    "    s = 0\n"
    "    for i in range(300_000):\n"
    "        s += i\n"
    "    return s\n"
    "if rank == world_size - 1:\n"
    "    a = torch.randn(300, 300)\n"
    "    for _ in range(40):\n"
    "        a = (a @ a).tanh()\n"
    "    for _ in range(3):\n"
    "        spin()\n"
    "t = torch.ones(4)\n"
    "dist.all_reduce(t)\n"
    "t.sum().item()"
)


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized_pool(request):
    with Pool(request.param) as pool:
        # torch's profiler starts in about a second the first time on each rank, in its own
        # time: started once here, so the cells below compare the ranks' work
        collect(pool.run("x = 1", profile="torch"))
        yield pool


@pytest.mark.parametrize("kind", ["torch", "python"])
def test_the_rank_the_others_wait_for_is_marked_slowest(sized_pool, kind):
    n = sized_pool.world_size
    _, _, end = collect(sized_pool.run(SLOW_LAST, profile=kind, want_values=True))
    raise_for_end(end)
    assert end.values == {r: 4.0 * n for r in range(n)}  # the cell's value is kept
    assert sorted(end.profiles) == list(range(n))
    slow = end.profiles[n - 1]
    assert all(p.kind == kind for p in end.profiles.values())
    outside = {r: p.wall - p.collectives for r, p in end.profiles.items()}
    assert max(outside, key=outside.get) == n - 1
    for rank in range(n - 1):  # they spent most of the cell waiting in all_reduce
        assert end.profiles[rank].collectives > 0.5 * end.profiles[rank].wall
    assert slow.collectives < 0.5 * slow.wall
    names = [name for name, _, _ in slow.top]
    if kind == "torch":
        assert any(name in ("aten::mm", "aten::tanh", "aten::matmul") for name in names), names
    else:
        assert any(name.startswith("spin (") for name in names), names
    text = profiling.report(end.profiles)
    marked = [line for line in text.splitlines() if "<- slowest" in line]
    assert len(marked) == 1
    assert marked[0].startswith(f"  rank {n - 1}: ")
    # the next cell runs unprofiled, and the dist functions are the originals again
    code = "import torch.distributed.distributed_c10d as c10d\ndist.all_reduce is c10d.all_reduce"
    _, _, end = collect(sized_pool.run(code, want_values=True))
    assert end.profiles == {}
    assert set(end.values.values()) == {True}


def test_a_failing_profiled_cell_still_reports_the_others(sized_pool):
    n = sized_pool.world_size
    _, _, end = collect(sized_pool.run("if rank == 0:\n    1 / 0\nx = 1", profile="torch"))
    assert list(end.errors) == [0]
    assert sorted(end.profiles) == list(range(1, n))


def test_the_magic_prints_the_profile_and_refuses_an_unknown_profiler(capsys):
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    try:
        assert sh.run_cell("%%ddp -n 3 --profile --text\nx = 1").success  # profiler warm
        capsys.readouterr()
        result = sh.run_cell("%%ddp --profile --text\n" + SLOW_LAST)
        assert result.success
        out = capsys.readouterr().out
        assert "profile (torch profiler, top operations by self time):" in out
        assert "  rank 2: " in out.split("<- slowest")[0].splitlines()[-1]
        result = sh.run_cell("%%ddp --profile gpu\nx = 1")
        assert not result.success
        assert "invalid choice: 'gpu'" in capsys.readouterr().err
    finally:
        sh.run_cell("%ddp stop")
        sh.run_cell("%unload_ext nbddp")


def test_a_report_for_one_rank_marks_none():
    p = P.Profile("torch", 1.0, 0.25, (("aten::mm", 3, 0.5),))
    assert profiling.report({0: p}) == (
        "profile (torch profiler, top operations by self time):\n"
        "  rank 0: 1.000 s, in collectives 0.250 s (25%)\n"
        "      aten::mm 500.0 ms x3"
    )
    assert profiling.report({}) == ""
