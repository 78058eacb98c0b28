"""More ranks than GPUs: which GPU each rank uses and which backend the group uses,
decided once in the notebook (nbddp.rank.gpus). No GPU needed: torch.cuda's answers are
faked in this (the notebook's) process; tests/pool/test_cuda.py runs the real thing."""

from __future__ import annotations

import os
import queue
from types import SimpleNamespace

import pytest
import torch

from cpu_machine import CpuMachine, cuda_last, is_cuda
from nbddp.notebook.session import say_gpu_notes
from nbddp.pool.layout import check_pool
from nbddp.pool.processes import rank_env
from nbddp.rank.ddp import DDPContext, default_backend
from nbddp.rank.gpus import GpuPlan, devices_line, gpu_notes, plan, pool_plan
from nbddp.rank.group import GroupKeeper

SIZES = (2, 4, 8)


@pytest.fixture
def gpus(monkeypatch):
    """This process sees ``count`` CUDA GPUs (call it with the count)."""

    def see(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return see


def fake_pool(n: int, **options) -> SimpleNamespace:
    """What rank_env and pool_plan read of a local Pool."""
    fields = dict(backend=None, device=None, gpus=None, pg_timeout=None, seed=None)
    fields.update(groups=None, mesh=None, threads=None, debug=False, extra_env={})
    fields.update(options)
    procs = SimpleNamespace(shm="/nowhere", store_port=lambda: 1)
    return SimpleNamespace(world_size=n, token=b"t", procs=procs, attached=False, **fields)


@pytest.mark.parametrize("n", SIZES)
def test_ranks_share_one_gpu_over_gloo_and_say_so(gpus, n):
    gpus(1)
    chosen = plan(n, count=1)
    assert (chosen.backend, chosen.gpus, chosen.visible) == ("gloo", (0,) * n, None)
    assert chosen.note == f"{n} ranks share 1 GPU: gloo, since NCCL needs a GPU per rank"
    check_pool(n)  # no longer refused
    check_pool(n, device="gpu")
    check_pool(n, backend="gloo", device="gpu")
    assert default_backend(ranks=n) == "gloo"


@pytest.mark.parametrize("n", SIZES)
def test_ranks_take_the_gpus_round_robin(gpus, n):
    gpus(2)
    chosen = plan(n, count=2)
    assert chosen.gpus == tuple(r % 2 for r in range(n))
    assert chosen.backend == ("nccl" if n <= 2 else "gloo")
    assert chosen.note == (
        "" if n <= 2 else f"{n} ranks share 2 GPUs: gloo, since NCCL needs a GPU per rank"
    )


def test_a_gpu_per_rank_or_no_gpu_is_as_before(gpus):
    gpus(4)
    assert plan(4, count=4) == plan(4, count=4, backend="nccl")
    assert plan(4, count=4).backend == "nccl"
    assert not plan(4, count=4).shared
    assert default_backend(ranks=4) == "nccl"
    assert plan(4, count=4, backend="gloo").gpus == ()  # --backend gloo alone: CPU ranks
    assert plan(4, count=4, device="cpu").gpus == ()
    gpus(0)
    assert plan(4).backend == "gloo"
    assert plan(4).gpus == ()
    assert plan(4).note == ""
    assert default_backend(ranks=4) == "gloo"


def test_gpus_may_repeat_a_gpu(gpus):
    gpus(2)
    chosen = plan(4, gpus=[1, 1, 0, 0], count=2)
    assert (chosen.backend, chosen.gpus, chosen.visible) == ("gloo", (0, 0, 1, 1), "1,0")
    assert chosen.note == "4 ranks share 2 GPUs: gloo, since NCCL needs a GPU per rank"
    check_pool(4, gpus=[1, 1, 0, 0])
    assert plan(2, gpus=[1, 0], count=2) == plan(2, gpus=[1, 0, 0, 1], count=2)


@pytest.mark.parametrize("n", SIZES)
def test_nccl_asked_for_more_ranks_than_gpus_is_refused_in_one_line(gpus, n):
    gpus(1)
    with pytest.raises(ValueError, match=r"^--backend nccl") as refused:
        check_pool(n, backend="nccl")
    assert str(refused.value) == (
        f"--backend nccl needs a GPU per rank: {n} ranks, 1 GPU here; use -n 1, or --backend gloo"
    )
    gpus(2)
    with pytest.raises(ValueError, match="2 ranks, 1 GPU named; use -n 1, or --backend gloo"):
        check_pool(2, backend="nccl", gpus=[0, 0])
    check_pool(2, backend="nccl", gpus=[0, 1])


@pytest.mark.parametrize("n", SIZES)
def test_each_rank_gets_the_notebooks_choice_in_its_env_and_uses_it(gpus, monkeypatch, n):
    """rank_env (the notebook) and DDPContext (the rank, from that env) agree: the device,
    cuda:(local_rank % G), and the backend; the rank does not decide again."""
    gpus(2)
    pool = fake_pool(n)
    for rank in range(n):
        env = rank_env(pool, rank)
        assert env["NBDDP_BACKEND"] == ("nccl" if n <= 2 else "gloo")
        assert env["NBDDP_GPU"] == str(rank % 2)
        assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == ""
        ctx = in_rank(monkeypatch, env, rank, n)
        assert (ctx.backend, str(ctx.device)) == (env["NBDDP_BACKEND"], f"cuda:{rank % 2}")


def test_a_rank_env_names_the_gpus_asked_for_once(gpus, monkeypatch):
    gpus(4)
    pool = fake_pool(4, gpus=[3, 3, 1, 1])
    envs = [rank_env(pool, r) for r in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1"] * 4
    assert [e["NBDDP_GPU"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["NBDDP_BACKEND"] for e in envs} == {"gloo"}
    ctx = in_rank(monkeypatch, envs[2], 2, 4)
    assert str(ctx.device) == "cuda:1"


def test_cpu_ranks_get_gloo_and_no_gpu(gpus, monkeypatch):
    gpus(0)
    env = rank_env(fake_pool(4), 3)
    assert env["NBDDP_BACKEND"] == "gloo"
    assert "NBDDP_GPU" not in env
    ctx = in_rank(monkeypatch, env, 3, 4)
    assert (ctx.backend, str(ctx.device)) == ("gloo", "cpu")


def in_rank(monkeypatch, env: dict, rank: int, n: int) -> DDPContext:
    """The DDPContext a rank with ``env`` makes (nothing is joined)."""
    for var in ("NBDDP_BACKEND", "NBDDP_GPU", "NBDDP_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return GroupKeeper(rank, n, lambda _msg: None, queue.Queue())._context(None, False)


@pytest.mark.parametrize("n", SIZES)
def test_ddpcontext_under_torchrun_shares_the_gpus_too(gpus, monkeypatch, n):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))
    for local in range(n):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        ctx = DDPContext(rank=local, world_size=n)
        assert (ctx.backend, str(ctx.device)) == ("gloo", "cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert DDPContext().backend == "nccl"


def test_the_sharing_is_said_once_when_the_pool_starts(gpus, capsys):
    gpus(1)
    pool = fake_pool(4)
    pool.notes = ["log line", *gpu_notes(pool)]
    say_gpu_notes(pool)
    say_gpu_notes(pool)
    out = capsys.readouterr().out
    assert out == "nbddp: 4 ranks share 1 GPU: gloo, since NCCL needs a GPU per rank\n"
    assert pool.notes == ["log line"]
    assert gpu_notes(fake_pool(1)) == []
    assert pool_plan(SimpleNamespace(attached=True)) is None


def test_the_dashboard_header_says_each_ranks_device():
    assert devices_line(["cpu"] * 4) == "cpu"
    assert devices_line(["cuda:0", "cuda:1"]) == "cuda:0, cuda:1"
    assert devices_line(["cuda:0"] * 4) == "cuda:0 x4"
    assert devices_line([f"cuda:{r % 2}" for r in range(4)]) == "cuda:0 x2, cuda:1 x2"
    assert devices_line([f"cuda:{r % 4}" for r in range(8)]) == "4 devices, 2 ranks each"
    assert devices_line([f"cuda:{r}" for r in range(8)]) == "8 devices"


# ------------------------------------------- the suite on a GPU machine (tests/cpu_machine.py)


def test_the_tests_not_marked_cuda_run_as_on_a_cpu_machine(pool):
    """conftest hides any GPU from them, here and in every process they start."""
    assert (torch.cuda.is_available(), torch.cuda.device_count()) == (False, 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    code = (
        "import os, torch.distributed as dist\n"
        "(os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.device_count(), str(device),\n"
        " dist.get_backend())"
    )
    assert pool.execute(code) == [("", 0, "cpu", "gloo")] * pool.world_size


@pytest.mark.parametrize("n", SIZES)
def test_on_a_one_gpu_machine_the_cpu_tests_still_get_cpu_ranks(gpus, monkeypatch, n):
    """A one-GPU machine, simulated: the switch conftest uses hides the GPU (a pool plans
    CPU ranks over gloo, its ranks see no GPU, NCCL is refused) and gives it back for a
    ``cuda`` test (the ranks share it)."""
    gpus(1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine = CpuMachine()
    machine.use(cpu=True)
    try:
        assert pool_plan(fake_pool(n)) == GpuPlan("gloo")
        assert {rank_env(fake_pool(n), r)["CUDA_VISIBLE_DEVICES"] for r in range(n)} == {""}
        with pytest.raises(ValueError, match="none is visible here"):
            check_pool(n, backend="nccl")
    finally:
        machine.use(cpu=False)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert pool_plan(fake_pool(n)) == GpuPlan("gloo", (0,) * n, None, plan(n, count=1).note)


def test_the_cuda_tests_run_after_the_others(request):
    """CUDA initialised in this process by a ``cuda`` test cannot refuse a later CPU
    test's ``fork`` pool: there is none."""
    cuda = SimpleNamespace(get_closest_marker=lambda name: name == "cuda" or None)
    cpu = SimpleNamespace(get_closest_marker=lambda name: None)
    assert cuda_last([cuda, cpu, cuda, cpu]) == [cpu, cpu, cuda, cuda]
    marks = [is_cuda(item) for item in request.session.items]
    assert marks == sorted(marks)
