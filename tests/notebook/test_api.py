"""The seed systems' features in nbddp: ranch/in_torchddp (mpify), DDPContext,
log dirs and tee (torch elastic), seed/device/gpus/groups (ddpw), mesh and
all_to_all (ml.utils), gather_tensors (modelopt) — through real pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

import nbddp
from nbddp import CellFailed, Pool
from nbddp.notebook.session import default_pool


@pytest.fixture(scope="module", autouse=True)
def stop_the_shared_pool():
    yield
    pool = default_pool()
    if pool is not None:
        pool.stop()


# ---------------------------------------------------------------- mpify: ranch


def scale_by(x, factor=1):
    import torch.distributed as dist

    return (x + dist.get_rank()) * factor


def test_ranch_runs_a_function_on_every_rank_and_gathers():
    assert nbddp.ranch(2, scale_by, 1, factor=10) == [10, 20]


def log_steps(n):
    import nbddp

    for i in range(n):
        nbddp.log_metrics({"ranch_metric": i + 0.5})
    return n


def test_ranch_keeps_what_the_function_logged_for_percent_ddp_metrics(capsys, monkeypatch):
    import IPython

    from nbddp.notebook.session import SESSION

    # outside IPython (a test before this one may have started a shell in this process)
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)

    assert nbddp.ranch(2, log_steps, 7) == [7, 7]
    frame = SESSION.metrics.frame("ranch_metric")
    assert sorted(zip(frame["rank"], frame["step"], frame["value"], strict=True)) == [
        (r, i, i + 0.5) for r in range(2) for i in range(7)
    ]
    assert set(frame["run"]) == {"ranch"}  # (outside IPython: no In [N])
    assert "ranch_metric @ step 6" in capsys.readouterr().out  # the summary line


def test_ranch_ships_needed_names_and_runs_multi_line_imports():
    global ranch_data
    ranch_data = [1, 2, 3]

    def uses_them():
        return (sum(ranch_data), ospath.sep, jdumps([1]))  # noqa: F821  (shipped/imported)

    values = nbddp.ranch(
        2,
        uses_them,
        need="ranch_data",
        imports=(
            "import math\nfrom os import (path as ospath,\n    sep)\n"
            "from json import dumps as jdumps"
        ),
    )
    assert values == [(6, "/", "[1]")] * 2


def test_ranch_enters_a_context_around_the_call_and_returns_one_rank_on_request():
    class Marker:
        def __enter__(self):
            import builtins

            builtins._nbddp_test_inside = True
            return self

        def __exit__(self, *exc):
            import builtins

            del builtins._nbddp_test_inside

    def inside():
        import builtins

        import torch.distributed as dist

        return (getattr(builtins, "_nbddp_test_inside", False), dist.get_rank())

    assert nbddp.ranch(2, inside, ctx=Marker()) == [(True, 0), (True, 1)]
    assert nbddp.ranch(2, inside, ctx=Marker(), gather=False, caller_rank=1) == (True, 1)
    assert nbddp.in_torchddp(2, inside) == (False, 0)


def test_ranch_resizes_the_shared_pool_and_raises_rank_errors(capsys):
    def world():
        import torch.distributed as dist

        return dist.get_world_size()

    assert nbddp.ranch(1, world) == [1]
    assert "resized the pool 2 -> 1 rank in" in capsys.readouterr().out  # rank 0 kept

    def fail():
        import torch.distributed as dist

        print("before the error")
        if dist.get_rank() == 1:
            raise KeyError("nope")

    with pytest.raises(CellFailed, match="rank 1: KeyError: 'nope'"):
        nbddp.ranch(2, fail)
    assert "[ranks 0-1] before the error" in capsys.readouterr().out


def test_ranch_and_the_magics_share_one_pool():
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    try:
        shell.run_cell("%%ddp -n 2 --quiet\nshared_marker = rank + 7")

        def read():
            return shared_marker  # noqa: F821  (the ranks' own variable)

        assert nbddp.ranch(2, read) == [7, 8]
    finally:
        shell.run_cell("%unload_ext nbddp")


def test_ddpcontext_sets_up_a_script_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from nbddp import DDPContext\n"
        "with DDPContext(seed=3, mesh='dp=2') as ddp:\n"
        "    t = torch.ones(1) * (ddp.rank + 1)\n"
        "    dist.all_reduce(t)\n"
        "    line = ('RESULT', ddp.rank, ddp.world_size, str(ddp.device), t.item(),\n"
        "            tuple(ddp.mesh.shape), round(torch.rand(1).item(), 6))\n"
        f"    with open(f'{tmp_path}/out{{ddp.rank}}.txt', 'w') as f:\n"
        "        print(*line, file=f)\n"
        "assert not dist.is_initialized()\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # leave no worker behind, whatever happened
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    lines = [(tmp_path / f"out{r}.txt").read_text().strip() for r in (0, 1)]
    torch.manual_seed(3)
    expected = round(torch.rand(1).item(), 6)
    assert lines == [f"RESULT {r} 2 cpu 3.0 (2,) {expected}" for r in (0, 1)]


# ---------------------------------------------------------------- pool options


def test_seed_every_rank_at_start_and_after_a_restart():
    torch.manual_seed(5)
    expected = torch.rand(2).tolist()
    with Pool(2, seed=5) as pool:
        code = (
            "import random, numpy\n(torch.rand(2).tolist(), random.random(), numpy.random.rand())"
        )
        first = pool.execute(code)
        assert first[0] == first[1]
        assert first[0][0] == expected
        pool.restart()
        assert pool.execute(code) == first


def test_devices_that_are_not_there_are_clear_errors():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device gpu: no CUDA GPU is visible here"):
            Pool(2, device="gpu")
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        with pytest.raises(ValueError, match=r"--device mps: Apple's Metal \(MPS\) is not"):
            Pool(2, device="mps")
    with pytest.raises(ValueError, match="--gpus names 1 GPU for 2 ranks"):
        Pool(2, gpus=[0])
    with pytest.raises(
        ValueError, match="--mesh dp=2,tp=3: 2 x 3 = 6 ranks, but the world size is 4"
    ):
        Pool(4, mesh="dp=2,tp=3")
    with pytest.raises(ValueError, match=r"every group needs ranks 0\.\.1"):
        Pool(2, groups="0,5")
    with Pool(2, device="cpu") as pool:
        assert pool.execute("str(device)") == ["cpu", "cpu"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpus_choose_the_devices_in_order():
    with Pool(1, gpus=[1]) as pool:
        assert pool.execute("torch.cuda.get_device_properties(device).uuid") == [
            torch.cuda.get_device_properties(1).uuid
        ]


@pytest.fixture(scope="module")
def pool4():
    with Pool(4, groups="0,2;1,3", mesh="dp=2,tp=2") as pool:
        yield pool


def test_groups_bind_each_ranks_own_subgroup(pool4):
    code = (
        "import torch.distributed as dist\nt = torch.ones(1) * rank\n"
        "dist.all_reduce(t, group=group)\n(t.item(), dist.get_process_group_ranks(group))"
    )
    assert pool4.execute(code) == [(2.0, [0, 2]), (4.0, [1, 3]), (2.0, [0, 2]), (4.0, [1, 3])]


def test_mesh_is_a_device_mesh_with_named_dims(pool4):
    code = (
        "import torch.distributed as dist\nt = torch.ones(1) * rank\n"
        "dist.all_reduce(t, group=mesh['tp'].get_group())\n"
        "(tuple(mesh.shape), mesh.mesh_dim_names, mesh['tp'].size(), t.item())"
    )
    assert pool4.execute(code) == [
        ((2, 2), ("dp", "tp"), 2, 1.0),
        ((2, 2), ("dp", "tp"), 2, 1.0),
        ((2, 2), ("dp", "tp"), 2, 5.0),
        ((2, 2), ("dp", "tp"), 2, 5.0),
    ]


def test_all_to_all_sends_chunk_i_to_rank_i(pool4):
    code = "from nbddp import all_to_all\nall_to_all(torch.arange(4.) + 10 * rank).tolist()"
    assert pool4.execute(code) == [
        [0.0, 10.0, 20.0, 30.0],
        [1.0, 11.0, 21.0, 31.0],
        [2.0, 12.0, 22.0, 32.0],
        [3.0, 13.0, 23.0, 33.0],
    ]


@pytest.mark.parametrize("path", ["shared memory", "process group"])
def test_gather_tensors_collects_on_the_first_listed_rank(pool4, path):
    # a pool that does not look like one host gathers through the process group
    pretend = path == "process group"
    code = "\n".join(
        [
            "import os",
            "os.environ['LOCAL_WORLD_SIZE'] = '1'" if pretend else "",
            "from nbddp import gather_tensors",
            "out = gather_tensors(torch.full((3,), float(rank)), ranks=[2, 1, 3])",
            "os.environ['LOCAL_WORLD_SIZE'] = str(world_size)",
            "[t.tolist() for t in out]",
        ]
    )
    assert pool4.execute(code) == [[], [], [[2.0] * 3, [1.0] * 3, [3.0] * 3], []]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("nbddp-gather")]


# ---------------------------------------------------------------- torch elastic: logs, tee


def test_log_dir_tee_and_error_files_through_the_magics(tmp_path, capsys):
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    logs = tmp_path / "logs"
    try:
        assert shell.run_cell(f"%ddp start -n 2 --log-dir {logs} --tee 0").success
        capsys.readouterr()
        result = shell.run_cell(
            "%%ddp --text --no-fold\nimport sys\nprint('hello from', rank)\n"
            "print('warn', rank, file=sys.stderr)\nif rank == 1:\n    raise ValueError('boom')"
        )
        shown = capsys.readouterr()
        assert not result.success
        assert "[rank 0] hello from 0" in shown.out
        assert "hello from 1" not in shown.out
        for rank in (0, 1):
            assert (logs / str(rank) / "stdout.log").read_text() == f"hello from {rank}\n"
            assert (logs / str(rank) / "stderr.log").read_text() == f"warn {rank}\n"
        error = json.loads((logs / "1" / "error.json").read_text())
        assert set(error) == {"rank", "pid", "exc_type", "message", "traceback", "timestamp"}
        assert (error["rank"], error["exc_type"], error["message"]) == (1, "ValueError", "boom")
        assert error["pid"] == default_pool().pids[1]
        assert not (logs / "0" / "error.json").exists()
    finally:
        shell.run_cell("%ddp stop")
        shell.run_cell("%unload_ext nbddp")
