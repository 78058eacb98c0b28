"""Attached pools: ranks started by torchrun (or by hand) connect back over TCP."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers import (
    collect,
    end_all,
    free_port,
    lone_worker_env,
    start,
    torchrun_node_cmd,
    wait_gone,
    worker_cmd,
)
from nbddp import Pool
from nbddp.dashboard.metric_store import CellMetrics
from nbddp.notebook import remote
from nbddp.pool.errors import CellFailed, PoolClosedError, PoolStartError
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "nbddp" / "token"
    remote.read_or_create_token(str(path))
    return path


def test_the_token_file_is_made_private_and_reused(tmp_path):
    path = tmp_path / "dir" / "token"
    first = remote.read_or_create_token(str(path))
    assert len(first) == 64
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert remote.read_or_create_token(str(path)) == first


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_attach_and_stop_ends_them(token_file, tmp_path):
    token = token_file.read_bytes().strip()
    pool = Pool(4, listen=("127.0.0.1", 0), token=token, start_timeout=180)
    address = pool.listen()
    master = free_port()
    logs = [open(tmp_path / f"node{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    nodes = [start(torchrun_node_cmd(i, master, address, token_file), logs[i]) for i in range(2)]
    try:
        pool.start()
        code = (
            "import os, torch.distributed as dist\n"
            "t = torch.ones(1) * rank\n"
            "dist.all_reduce(t)\n"
            "(t.item(), os.environ['GROUP_RANK'], local_rank, world_size)"
        )
        assert pool.execute(code) == [
            (6.0, "0", 0, 4),
            (6.0, "0", 1, 4),
            (6.0, "1", 0, 4),
            (6.0, "1", 1, 4),
        ]
        assert [s.host for s in pool.status()] == [socket.gethostname()] * 4
        # errors and a peer left waiting in a collective behave as on a local pool
        _, _, end = collect(
            pool.run(
                "import torch.distributed as dist\nif rank == 2:\n    raise ValueError('x')\n"
                "dist.barrier()"
            )
        )
        assert next(iter(end.errors)) == 2
        assert "re-formed" in end.notes[0]
        assert pool.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [4.0] * 4
        assert metrics_of(pool) == {r: [r * 100.0 + i for i in range(300)] for r in range(4)}
        # deadlocks through the relays (issue 37): slow ranks and a subgroup never are one
        from test_deadlock import SLOW, no_alarm

        no_alarm(collect(pool.run(SLOW))[2])
        _, _, end = collect(pool.run("if rank != 1:\n    dist.all_reduce(torch.ones(2))"))
        assert end.deadlock.startswith("deadlock: ranks 0, 2, 3 wait in all_reduce #"), end
        pool.stop()
        assert [n.wait(60) for n in nodes] == [0, 0]  # torchrun ends cleanly
    finally:
        pool.stop()
        end_all(nodes)
        for log in logs:
            log.close()


@pytest.fixture
def lone(token_file, tmp_path):
    """A pool of one rank, started by hand, attached over TCP."""
    token = token_file.read_bytes().strip()
    pool = Pool(1, listen=("127.0.0.1", 0), token=token, start_timeout=60)
    address = pool.listen()
    log = open(tmp_path / "lone.log", "wb")  # noqa: SIM115
    proc = start(worker_cmd(address, token_file), log, lone_worker_env())
    try:
        pool.start()
        yield pool, address, proc
    finally:
        pool.stop()
        end_all([proc])
        log.close()


def metrics_of(pool) -> dict[int, list[float]]:
    """Each rank logs 300 points (rank * 100 + step): what the notebook holds of them."""
    cell = CellMetrics(label="c")
    code = "import nbddp\nfor i in range(300):\n    nbddp.log_metrics({'m': rank * 100.0 + i})"
    for event in pool.run(code):
        if isinstance(event, P.RankMetrics):
            cell.add(event)
    return {r: line.values.tolist() for r, line in cell.store.lines[("c", "m")].items()}


def test_a_direct_tcp_rank_sends_its_metrics_in_frames(lone):
    pool, _address, _proc = lone
    assert metrics_of(pool) == {0: [float(i) for i in range(300)]}


def test_a_worker_with_the_wrong_token_is_refused_and_says_why(lone, tmp_path):
    pool, address, _ = lone
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    out = subprocess.run(
        worker_cmd(address, wrong),
        env=lone_worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3
    assert "refused this worker's token" in out.stderr
    _, _, end = collect(pool.run("rank", want_values=True))
    assert end.values == {0: 0}
    assert any("refused a connection" in n and "prove it holds the token" in n for n in end.notes)


def test_a_worker_without_its_token_file_fails_clearly(tmp_path):
    out = subprocess.run(
        worker_cmd("127.0.0.1:1", tmp_path / "missing"),
        env=lone_worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "cannot read the token file" in out.stderr
    assert "No such file" in out.stderr


def test_garbage_and_half_open_connections_do_not_disturb_the_pool(lone, monkeypatch):
    pool, address, _ = lone
    # a peer's handshake reads may take an hour: the half-open peer below is still waited
    # for however long the cells take (no clock decides the test)
    monkeypatch.setattr("nbddp.wire.listener.HANDSHAKE_TIMEOUT", 3600)
    host, port = address.rsplit(":", 1)
    half_open = socket.create_connection((host, int(port)))  # says nothing
    garbage = socket.create_connection((host, int(port)))
    garbage.sendall(os.urandom(4096))
    try:
        while not pool.refused:  # the garbage is refused (pytest-timeout bounds the wait)
            time.sleep(0.01)
        for _ in range(20):
            assert pool.execute("rank") == [0]
        # the half-open peer is still being waited for, beside the cells: none waited on it
        assert pool.listener.pending == 1
    finally:
        half_open.close()
        garbage.close()


def test_a_dead_remote_rank_is_reported_as_a_lost_connection(lone):
    pool, _, proc = lone
    _, _, end = collect(pool.run("import os\nos._exit(5)"))
    with pytest.raises(CellFailed, match=r"rank 0 died \(connection lost\)"):
        raise_for_end(end)
    assert proc.wait(10) == 5
    with pytest.raises(PoolClosedError, match="start torchrun again and attach again"):
        list(pool.run("1"))


def test_attach_through_the_magic(token_file, tmp_path, capsys):
    port = free_port()
    log = open(tmp_path / "w.log", "wb")  # noqa: SIM115
    proc = start(worker_cmd(f"127.0.0.1:{port}", token_file), log, lone_worker_env())
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    try:
        result = shell.run_cell(
            f"%ddp attach --world-size 1 --listen 127.0.0.1:{port} --token-file {token_file}"
        )
        assert result.success
        out = capsys.readouterr().out
        assert f"listening on 127.0.0.1:{port}; on each node run:" in out
        assert f"-m nbddp.worker --connect 127.0.0.1:{port} --token-file {token_file}" in out
        assert "1/1 ranks connected" in out
        assert "attached 1 ranks on 1 host" in out
        assert shell.run_cell("%%ddp --text\nprint('remote', rank)").success
        assert "[rank 0] remote 0" in capsys.readouterr().out
        shell.run_cell("%ddp status")
        assert socket.gethostname() in capsys.readouterr().out
        assert not shell.run_cell("%ddp restart").success
        shell.run_cell("%ddp stop")
        assert proc.wait(30) == 0
    finally:
        shell.run_cell("%unload_ext nbddp")
        end_all([proc])
        log.close()


def test_the_slurm_job_script_runs_torchrun_once_per_node():
    script = remote.slurm_script(
        "--nodes 2 --gpus-per-node 8 --partition gpu",
        16,
        "nb.example:5555",
        "~/.nbddp/token",
        python="python3",
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --nodes 2 --gpus-per-node 8 --partition gpu" in lines
    assert "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --no-kill" in lines  # a failed node does not end the others' ranks
    run = lines[-1]
    assert run.startswith("srun --no-kill --kill-on-bad-exit=0 bash -c ")  # (theirs too)
    # the static rendezvous: each node's rank, the job's first node the master
    assert 'PET_NODE_RANK="${NBDDP_NODE_RANK:-$SLURM_NODEID}" exec "$@"' in run
    assert "--rdzv" not in script
    assert 'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert 'export NBDDP_MASTER_ADDR="${NBDDP_MASTER_ADDR:-$first}"' in lines
    assert run.endswith(
        "' - python3 -m torch.distributed.run --nnodes 2 --nproc-per-node 8 "
        '--master-addr "$NBDDP_MASTER_ADDR" --master-port 29400 '
        "-m nbddp.worker --connect nb.example:5555 --token-file '~/.nbddp/token'"
    )
    with pytest.raises(ValueError, match="--nodes N"):
        remote.slurm_script("--partition gpu", 16, "h:1", "t")
    with pytest.raises(ValueError, match="does not split over 3 nodes"):
        remote.slurm_script("-N 3", 16, "h:1", "t")


def wait_connected(port: int, within: float = 120.0) -> None:
    """Until a connection to our listener on ``port`` is made (polled with a deadline):
    the worker's, or its host relay's (a process of its own, not the worker's child)."""
    import psutil

    deadline = time.monotonic() + within
    while not any(c.raddr and c.raddr.port == port for c in psutil.net_connections("tcp")):
        assert time.monotonic() < deadline, f"nothing connected to port {port}"
        time.sleep(0.05)


def test_a_wrong_world_size_is_refused(token_file, tmp_path):
    token = token_file.read_bytes().strip()
    pool = Pool(1, listen=("127.0.0.1", 0), token=token, start_timeout=8)
    address = pool.listen()
    log = open(tmp_path / "w.log", "wb")  # noqa: SIM115
    proc = start(worker_cmd(address, token_file), log, lone_worker_env(world_size=2))
    try:
        # the 8 s bound is for the refusal, not the worker's imports (slow on a busy machine)
        wait_connected(int(address.rsplit(":", 1)[1]))
        with pytest.raises(PoolStartError, match="did not start"):
            pool.start()
        assert any("this pool waits for 1 ranks" in r for r in pool.refused)
    finally:
        pool.stop()
        end_all([proc])
        log.close()
    assert wait_gone([proc.pid]) == []
