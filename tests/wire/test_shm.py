"""Shared memory has one owner: every folder nbddp makes there is private (mkdtemp, 0700),
lives under the pool's folder or carries its maker's pid, and goes away with it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import psutil
import pytest

from nbddp import Pool
from nbddp.wire import protocol as P
from nbddp.wire.payload import private_dir

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def maker(name: str) -> int | None:
    """The pid a folder's name carries (``nbddp-<pid>-...``), if any."""
    pid = name.split("-")[1] if name.count("-") else ""
    return int(pid) if pid.isdigit() else None


def _theirs(pid: int | None) -> bool:
    """``pid`` lives and is not this process's descendant (a kernel another xdist worker
    started, with a pool of its own: its folder is not this test's doing)."""
    try:
        return pid is not None and os.getpid() not in {p.pid for p in psutil.Process(pid).parents()}
    except psutil.Error:  # gone: counted (a dead maker's folder left behind is a leak)
        return False


class Made:
    """The nbddp folders in shared memory that a test's own processes made: those that
    appeared while it ran and whose maker was born during it. The folders of processes
    alive before (this test process's other pools, another test run beside this one) are
    not the test's doing, and are never counted; nor are those of a live process that is
    not this one's descendant (under ``pytest -n 2``, the other worker's kernels)."""

    def __init__(self) -> None:
        self.names = self.now()
        self.pids = set(psutil.pids())

    @staticmethod
    def now() -> set[str]:
        return {n for n in os.listdir(SHM) if n.startswith("nbddp")}

    def since(self) -> set[str]:
        return {
            n
            for n in self.now() - self.names
            if maker(n) not in self.pids and not _theirs(maker(n))
        }


KILLED_IN_GATHER = (
    "import os, signal, nbddp.rank.collectives as C\n"
    "real = C.dist.gather_object\n"
    "def gather_object(*args, **kwargs):  # after this rank wrote its tensor, before a read\n"
    "    if rank == world_size - 1:\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(*args, **kwargs)\n"
    "C.dist.gather_object = gather_object\n"
    "C.gather_tensors(torch.ones(300_000))\n"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
def test_a_rank_killed_inside_gather_tensors_leaves_nothing_once_the_pool_stops(n):
    made = Made()
    with Pool(n) as pool:
        pool.execute("import torch")
        folder = pool.procs.shm  # the pool's one folder (it carries this process's pid)
        assert os.path.dirname(folder) == SHM
        assert made.since() == set()  # nothing of the ranks' own
        end = next(e for e in pool.run(KILLED_IN_GATHER) if isinstance(e, P.CellEnd))
        assert n - 1 in end.exits
        assert not end.exits[n - 1].stopped_by_pool
        written = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
        assert written, "the killed rank wrote its tensor inside the pool's folder"
    assert not os.path.exists(folder)
    assert made.since() == set()


def test_gathers_under_torchrun_without_a_pool_leave_nothing(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from nbddp import gather_objects, gather_tensors\n"
        "dist.init_process_group('gloo')\n"
        "out = gather_tensors(torch.full((4,), float(dist.get_rank())))\n"
        "if dist.get_rank() == 0:\n"
        "    print('GOT', [t.tolist()[0] for t in out])\n"
        "big = {'r': dist.get_rank(), 'w': torch.full((2**19,), float(dist.get_rank()))}\n"
        "out = gather_objects(big, ranks=[2, 0])\n"
        "if dist.get_rank() == 2:\n"
        "    print('OBJ', [(o['r'], o['w'][-1].item()) for o in out])\n"
        "dist.destroy_process_group()\n"
    )
    made = Made()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "NBDDP_SHM_DIR"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GOT [0.0, 1.0, 2.0]" in proc.stdout
    assert "OBJ [(2, 2.0), (0, 0.0)]" in proc.stdout  # rank 0's 2 MB through its own folder
    assert made.since() == set()  # torchrun's ranks were born during the test


def test_a_folder_another_user_made_or_can_enter_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert private_dir(str(mine)) == str(mine)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match=r"refusing to write into .*shared: not a private"):
        private_dir(str(shared))
    if os.getuid() == 0:  # a folder another user owns, even 0700
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(RuntimeError, match="owner uid 65534"):
            private_dir(str(theirs))


def test_a_rank_refuses_a_pool_folder_that_is_not_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with Pool(2, env={"NBDDP_SHM_DIR": str(shared)}) as pool:
        pool.start()
        end = next(
            e for e in pool.run("torch.ones(1 << 20)", want_values=True) if isinstance(e, P.CellEnd)
        )
        assert set(end.errors) == {0, 1}
        assert "refusing to write into" in end.errors[0].message
    assert os.listdir(shared) == []
