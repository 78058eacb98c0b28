"""torchrun scripts run unchanged on the pool: by ``Pool.run_script`` (``%ddp run``) and by
a ``%%ddp`` cell calling their ``main()``, twice in a row, with a cell after them that
uses the group. The scripts are written the way tutorials write them."""

from __future__ import annotations

import textwrap

import pytest
import torch

from helpers import collect
from nbddp import Pool
from nbddp.pool.errors import CellFailed
from nbddp.pool.facade import raise_for_end
from nbddp.rank.ddp import differences, threads_for

SCRIPT = textwrap.dedent(
    '''
    """A DDP training script, as a torchrun tutorial writes it."""
    import argparse
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=3)
        parser.add_argument("--exit-early", action="store_true")
        args = parser.parse_args()
        dist.init_process_group(backend="gloo")
        rank = dist.get_rank()
        if args.exit_early:
            print(f"rank {rank} leaves early", flush=True)
            dist.destroy_process_group()
            sys.exit(0)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(args.steps):
            loss = model(torch.ones(8, 4) * (rank + 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        weight = model.module.weight.detach().clone()
        dist.all_reduce(weight)
        print(f"rank {rank}/{dist.get_world_size()} local {os.environ['LOCAL_RANK']} "
              f"steps {args.steps} name {__name__} weight {weight.sum().item():.5f}")
        dist.destroy_process_group()
        return model.module


    if __name__ == "__main__":
        trained = main()
    '''
)

SIZES = [2, 4]


@pytest.fixture(scope="module", params=SIZES, ids=[f"{n}ranks" for n in SIZES])
def sized_pool(request):
    with Pool(request.param) as pool:
        yield pool


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def lines(text: dict, n: int) -> list[str]:
    return [text.get((r, "stdout"), "").strip() for r in range(n)]


def group_works(pool: Pool) -> None:
    n = pool.world_size
    code = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    assert pool.execute(code) == [float(n)] * n


def test_a_script_runs_as_main_with_its_arguments_twice_and_the_group_is_back(sized_pool, script):
    pool, n = sized_pool, sized_pool.world_size
    pool.execute("mine = rank * 10")
    outputs = []
    for _ in range(2):
        text, _, end = collect(pool.run_script(str(script), ["--steps", "2"]))
        raise_for_end(end)
        outputs.append(lines(text, n))
    assert outputs[0] == outputs[1]  # the same result twice: a fresh group, same seed
    for r, line in enumerate(outputs[0]):
        assert line.startswith(f"rank {r}/{n} local {r} steps 2 name __main__ weight ")
    assert len({line.rsplit(" ", 1)[1] for line in outputs[0]}) == 1  # one all_reduce result
    group_works(pool)
    assert pool.execute("mine") == [r * 10 for r in range(n)]  # the namespace was kept
    assert pool.execute("'trained' in globals()") == [False] * n  # its own module


def test_keep_leaves_the_scripts_globals_in_the_ranks_namespace(sized_pool, script):
    pool, n = sized_pool, sized_pool.world_size
    _, _, end = collect(pool.run_script(str(script), keep=True))
    raise_for_end(end)
    assert pool.execute("type(trained).__name__, callable(main)") == [("Linear", True)] * n
    group_works(pool)


def test_an_early_sys_exit_0_is_a_success_and_a_nonzero_one_an_error(sized_pool, script):
    pool, n = sized_pool, sized_pool.world_size
    text, _, end = collect(pool.run_script(str(script), ["--exit-early"]))
    raise_for_end(end)
    assert lines(text, n) == [f"rank {r} leaves early" for r in range(n)]
    group_works(pool)
    _, _, end = collect(pool.run_script(str(script), ["--no-such-option"]))
    with pytest.raises(CellFailed, match=r"SystemExit: 2"):
        raise_for_end(end)
    group_works(pool)


def test_a_cell_calling_main_twice_in_a_row_then_a_cell_using_the_group(sized_pool):
    """The script's source as a cell defines main(); argparse sees no worker options."""
    pool, n = sized_pool, sized_pool.world_size
    pool.execute(SCRIPT.replace('if __name__ == "__main__":\n    trained = main()', ""))
    results = []
    for _ in range(2):
        text, _, end = collect(pool.run("main()"))
        raise_for_end(end)
        results.append(lines(text, n))
    assert results[0] == results[1]
    group_works(pool)


def test_init_again_in_the_same_cell_after_destroy_forms_a_new_group(sized_pool):
    pool, n = sized_pool, sized_pool.world_size
    code = (
        "import torch.distributed as dist\ndist.destroy_process_group()\n"
        "assert not dist.is_initialized()\ndist.init_process_group('gloo')\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert pool.execute(code) == [float(n)] * n
    group_works(pool)


def test_an_incompatible_init_says_what_differs_and_the_group_stays(sized_pool):
    pool, n = sized_pool, sized_pool.world_size
    code = f"import torch.distributed as dist\ndist.init_process_group('nccl', world_size={n + 1})"
    _, _, end = collect(pool.run(code))
    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    message = str(failed.value).splitlines()[0]
    assert "ValueError: init_process_group: this rank is already in the pool's" in message
    assert "backend 'nccl', but the pool's group is gloo" in message
    assert f"world_size={n + 1}, but the pool has {n} ranks" in message
    group_works(pool)


def test_what_a_script_reads_from_torchrun_gives_torchruns_answers(sized_pool):
    pool, n = sized_pool, sized_pool.world_size
    code = (
        "import os, torch.distributed as dist\n"
        "(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'],\n"
        " os.environ['OMP_NUM_THREADS'], torch.get_num_threads(),\n"
        " dist.get_default_backend_for_device(torch.device('cpu')), dist.get_backend(),\n"
        " torch.accelerator.is_available())"
    )
    got = pool.execute(code)
    accel = torch.accelerator.is_available()  # what a process on this host sees
    assert got == [(str(r), str(n), str(n), "1", 1, "gloo", "gloo", accel) for r in range(n)]


def test_threads_can_be_set_per_pool():
    with Pool(2, threads="auto") as pool:
        import os

        cores = len(os.sched_getaffinity(0))
        assert pool.execute("torch.get_num_threads()") == [max(1, cores // 2)] * 2
    with Pool(2, threads=3) as pool:
        assert pool.execute("torch.get_num_threads()") == [3, 3]


@pytest.mark.parametrize(
    ("local", "asked", "user", "want"),
    [
        (4, None, None, 1),  # as torchrun: one thread per rank when ranks share a host
        (1, None, None, None),  # one rank: torch's default
        (4, None, "3", 3),  # the user's OMP_NUM_THREADS wins
        (4, "2", "3", 2),  # --threads wins over both
        (2, "auto", None, None),  # auto: checked against the machine below
    ],
)
def test_threads_for(local, asked, user, want):
    import os

    if asked == "auto":
        want = max(1, len(os.sched_getaffinity(0)) // local)
    assert threads_for(local, asked, user) == want


@pytest.mark.parametrize(
    ("kwargs", "found"),
    [
        ({}, []),
        ({"backend": "gloo", "world_size": 4, "rank": 1}, []),
        ({"backend": "cpu:gloo,cuda:nccl"}, []),
        ({"device_id": "cpu"}, []),
        ({"backend": "nccl"}, ["backend 'nccl', but the pool's group is gloo"]),
        ({"world_size": 8}, ["world_size=8, but the pool has 4 ranks"]),
        ({"rank": 0}, ["rank=0, but this is rank 1"]),
        ({"device_id": 1}, ["device_id=cuda:1, but this rank's device is cpu"]),
    ],
)
def test_differences_of_an_init_call(kwargs, found):
    import torch

    asked = {"world_size_asked": kwargs.get("world_size", -1), "rank_asked": kwargs.get("rank", -1)}
    device_id = kwargs.get("device_id")
    device_id = torch.device(device_id) if isinstance(device_id, str) else device_id
    got = differences(
        "gloo", 4, 1, torch.device("cpu"), kwargs.get("backend"), device_id=device_id, **asked
    )
    assert got == found
