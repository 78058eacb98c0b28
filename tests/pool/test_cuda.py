"""The GPU paths (NCCL, CUDA tensors). Skipped without CUDA; run them on a GPU machine
(``bash scripts/gpu_check.sh``). On one GPU the NCCL tests run at one rank; ranks sharing
a GPU are in test_cuda_shared.py, a real kernel's in test_cuda_kernel.py."""

from __future__ import annotations

import pytest
import torch

from helpers import collect
from nbddp import Pool
from nbddp.pool.capture import pack
from nbddp.pool.facade import raise_for_end

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_pool():
    n = min(torch.cuda.device_count(), 2)
    with Pool(n) as pool:
        yield pool


def test_ranks_use_nccl_and_their_own_gpu(gpu_pool):
    code = (
        "import os, torch.distributed as dist\n"
        "t = torch.ones(1, device=device) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "(dist.get_backend(), str(device), torch.cuda.current_device(),\n"
        " int(os.environ['LOCAL_RANK']), t.item())"
    )
    n = gpu_pool.world_size
    total = float(n * (n + 1) // 2)
    assert gpu_pool.execute(code) == [("nccl", f"cuda:{r}", r, r, total) for r in range(n)]


def test_cuda_tensors_arrive_on_each_ranks_own_device(gpu_pool):
    t = torch.arange(2**20, dtype=torch.float32, device="cuda:0")
    values = gpu_pool.execute("(str(x.device), float(x.sum()))", needs=pack({"x": t}))
    assert values == [(f"cuda:{r}", float(t.sum())) for r in range(gpu_pool.world_size)]


def test_a_rank_error_in_a_nccl_collective_does_not_hang(gpu_pool):
    code = (
        "import torch.distributed as dist\n"
        "t = torch.ones(1, device=device)\n"
        "if rank == 0:\n    raise ValueError('before')\n"
        "dist.all_reduce(t)\nt.item()"
    )
    events = list(gpu_pool.run(code))
    end = events[-1]
    assert "ValueError" in end.errors[0].exc_type
    assert gpu_pool.execute("rank") == list(range(gpu_pool.world_size))


@pytest.mark.timeout(180)
def test_a_rank_killed_in_a_nccl_collective_is_replaced_on_its_own_gpu(gpu_pool):
    """The survivors' communicators are aborted and their processes live on (NCCL's
    watchdog in CleanUpOnly mode); the new rank takes the same GPU; NCCL works after."""
    n = gpu_pool.world_size
    bad = n - 1
    gpu_pool.execute(
        "import torch.distributed as dist\nkept = torch.full((4,), float(rank), device=device)"
    )
    pids = list(gpu_pool.pids)
    code = (
        "import os, signal\nt = torch.ones(1, device=device)\ndist.all_reduce(t)\n"
        f"if rank == {bad}:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)\ntorch.cuda.synchronize()"
    )
    _, _, end = collect(gpu_pool.run(code))
    with pytest.raises(Exception, match=rf"rank {bad} died \(killed by SIGKILL\)"):
        raise_for_end(end)
    assert [p for r, p in enumerate(gpu_pool.pids) if r != bad] == pids[:bad] + pids[bad + 1 :]
    assert gpu_pool.pids[bad] != pids[bad]
    check = (
        "import os, torch.distributed as dist\nt = torch.ones(1, device=device)\n"
        "dist.all_reduce(t)\n"
        "(str(device), torch.cuda.current_device(), t.item(),\n"
        " kept.sum().item() if 'kept' in globals() else None,\n"
        " os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'))"
    )
    assert gpu_pool.execute(check) == [
        (f"cuda:{r}", r, float(n), 4.0 * r, "2")
        for r in range(n)  # (rank bad re-ran kept's cell)
    ]


def test_gathers_of_cuda_tensors_land_on_the_first_listed_ranks_gpu(gpu_pool, tmp_path):
    if gpu_pool.world_size < 2:
        pytest.skip("needs 2 GPUs")
    ws = str(tmp_path / "ws")
    code = (
        "from nbddp import gather_objects, gather_tensors\n"
        "t = torch.full((300_000,), float(rank), device=device)\n"
        "got = [gather_tensors(t, ranks=[1, 0]),\n"  # NCCL's gather
        f"       gather_tensors(t, ranks=[1, 0], workspace={ws!r}),\n"
        "       [o['t'] for o in gather_objects({'t': t}, ranks=[1, 0])],\n"  # shared memory
        f"       [o['t'] for o in gather_objects({{'t': t}}, ranks=[1, 0], workspace={ws!r})]]\n"
        "[[(str(x.device), x[0].item(), x[-1].item()) for x in out] for out in got]"
    )
    values = gpu_pool.execute(code)
    assert values[1] == [[("cuda:1", 1.0, 1.0), ("cuda:1", 0.0, 0.0)]] * 4
    assert values[0] == [[]] * 4


@pytest.mark.timeout(180)
def test_more_ranks_than_gpus_share_them_and_the_running_pool_keeps_its_state(capsys):
    """Issue 36 on a one-GPU machine: `%ddp start -n G+1` resizes the pool, the ranks now
    sharing the GPUs over gloo (said in one line): rank 0 keeps its process, its CUDA
    tensor and its optimizer state; the new rank is on cuda:(G % G). `--backend nccl -n
    G+1` is refused in one line before the running pool is touched."""
    from IPython.core.interactiveshell import InteractiveShell

    from helpers import namespace_digests
    from nbddp.notebook.session import SESSION

    g = torch.cuda.device_count()
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    try:
        assert sh.run_cell("import torch\nw = torch.zeros(4)").success
        cell = (
            f"%%ddp -n {g} --quiet\nw = w.to(device) + rank + 1\n"
            "model = torch.nn.Linear(4, 2).to(device)\n"
            "opt = torch.optim.Adam(model.parameters())\n"
            "model(w).sum().backward()\nopt.step()"
        )
        assert sh.run_cell(cell).success
        pool = SESSION.pool
        pids, before = list(pool.pids), namespace_digests(pool)
        assert pool.execute("str(w.device)") == [f"cuda:{r}" for r in range(g)]
        capsys.readouterr()
        assert sh.run_cell(f"%ddp start -n {g + 1}").success
        said = capsys.readouterr().out
        assert SESSION.pool is pool
        assert pool.pids[:g] == pids
        resized = namespace_digests(pool)
        assert [without_size(d) for d in resized[:g]] == [without_size(d) for d in before]
        assert f"nbddp: {g + 1} ranks share {g} GPU" in said, said
        assert said.count("since NCCL needs a GPU per rank") == 1, said
        where = (
            "import torch.distributed as dist\n"
            "(dist.get_backend(), str(device), torch.cuda.current_device())"
        )
        assert pool.execute(where) == [("gloo", f"cuda:{r % g}", r % g) for r in range(g + 1)]
        pids, resized = list(pool.pids), namespace_digests(pool)  # (the cell bound `dist`)
        result = sh.run_cell(f"%ddp start -n {g + 1} --backend nccl")
        assert not result.success
        assert "--backend nccl needs a GPU per rank" in str(result.error_in_exec)
        assert "\n" not in str(result.error_in_exec), result.error_in_exec
        assert SESSION.pool is pool
        assert pool.pids == pids
        assert namespace_digests(pool) == resized
    finally:
        sh.run_cell("%ddp stop")
        sh.run_cell("%unload_ext nbddp")


def without_size(digest: dict) -> dict:
    """A rank's digest but ``world_size``, which follows a resize."""
    return {k: v for k, v in digest.items() if k != "world_size"}
