"""``%ddp attach --detached NAME`` through real kernels (issue 39, item 3): an attached pool
whose listener and core run in a detached supervisor keeps every rank torchrun started,
with its namespace, across a kernel restart and a kernel crash (SIGKILL mid-cell); and an
attached pool of the kernel's own, whose kernel crashes, ends every process it had.

torchrun runs one node of N ranks on loopback (through its relay, under its holders), as
in tests/hosts/test_relay.py; the kernels are real (jupyter_client), as in
tests/detached/test_detached_kernel.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_detached_kernel import BUILD, LAST, digest, killed_in, notebook_value
from test_kernel import execute, kernels, restarted  # noqa: F401

from helpers import detached_family, end_all, free_port, wait_gone
from nbddp.hosts import relay
from nbddp.notebook import remote
from tiers import sizes

pytestmark = pytest.mark.kernel

REDUCE = (
    "%%ddp --text\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)\nprint('sum', _t.item())"
)


def torchrun(tmp_path, n: int, port: int) -> tuple[subprocess.Popen, str]:
    """One torchrun node of ``n`` ranks that attach to 127.0.0.1:``port`` (they retry
    until it listens); its process, in a session of its own, and its token file."""
    token_file = str(tmp_path / "token")
    remote.read_or_create_token(token_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += ["-m", "nbddp.worker", "--connect", f"127.0.0.1:{port}", "--token-file", token_file]
    cmd += ["--connect-timeout", "120"]
    log = open(tmp_path / "node.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    log.close()
    return proc, token_file


def attach(kc, n: int, port: int, token_file: str, more: str = "") -> str:
    r = execute(
        kc,
        f"%ddp attach --world-size {n} --listen 127.0.0.1:{port} --token-file {token_file} "
        f"--timeout 240 {more}",
        timeout=300,
    )
    assert r.error is None, r.text
    assert "UsageError" not in r.text, r.text
    return r.stdout


def sums(kc, n: int) -> str:
    r = execute(kc, REDUCE)
    assert r.error is None, r.text
    assert "Error" not in r.text, r.text
    return r.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", sizes(2, 4, ids="{}"))
def test_an_attached_detached_pool_outlives_a_kernel_restart_and_a_crash(
    kernels,  # noqa: F811
    tmp_path,
    n,
):
    """Restart, then SIGKILL mid-cell: every rank's namespace digest is kept, the cell
    that ran meanwhile comes back with its end, a collective works; a rank that dies
    while detached is replaced by its holder; ``%ddp stop NAME`` ends torchrun with 0."""
    name, port = f"at{n}", free_port()
    km, k = kernels()
    assert execute(k, "%load_ext nbddp").error is None
    proc, token_file = torchrun(tmp_path, n, port)
    try:
        said = attach(k, n, port, token_file, f"--detached {name}")
        assert f"the detached pool {name} outlives this kernel" in said, said
        with detached_family(name) as family:
            assert execute(k, BUILD + "\nimport torch.distributed as dist").error is None
            before = digest(k)

            k = restarted(km, k)  # a kernel restart
            assert execute(k, "%load_ext nbddp").error is None
            assert f"connected to the detached pool {name} ({n} ranks)" in connected(k, name)
            assert digest(k) == before
            assert f"sum {n * (n + 1) // 2:.1f}" in sums(k, n)
            listed = execute(k, "%ddp list").stdout  # (its ranks' memory is on their hosts)
            assert name in listed, listed
            assert "elsewhere" in listed, listed

            killed_in(km, k, LAST, n)  # a kernel crash, mid-cell: the cell runs on
            _, k = kernels()
            assert execute(k, "%load_ext nbddp").error is None
            r = execute(k, f"%ddp connect {name}")
            assert "a cell ran meanwhile" in r.stdout, r.text
            after = digest(k)
            for r_ in range(n):
                unchanged = {key for key in before[r_] if key != "w"}
                assert {key: after[r_][key] for key in unchanged} == {
                    key: before[r_][key] for key in unchanged
                }
            assert notebook_value(k, "(torch.equal(w, w0 + 1), late)", "wl_") == [
                (True, r_ * 3) for r_ in range(n)
            ]
            assert f"sum {n * (n + 1) // 2:.1f}" in sums(k, n)

            # a rank that dies while detached: its holder's new process takes its place
            kept = digest(k)
            r = execute(k, "%%ddp --text\nif rank == 1:\n    import os; os._exit(7)")
            assert r.error is not None, r.text  # (a death fails the cell: CellFailed)
            assert "rank 1: a new process took its place" in r.error["evalue"], r.error
            again = digest(k)
            assert [kept[r_] for r_ in range(n) if r_ != 1] == [
                again[r_] for r_ in range(n) if r_ != 1
            ]
            assert proc.poll() is None  # torchrun saw no death

            family.stopped_by(lambda: execute(k, f"%ddp stop {name}"))
            assert proc.wait(60) == 0  # every worker exited with 0
    finally:
        end_all([proc])


def connected(kc, name: str) -> str:
    r = execute(kc, f"%ddp connect {name}")
    assert r.error is None, r.text
    assert "UsageError" not in r.text, r.text
    return r.stdout


@pytest.mark.timeout(300)
def test_an_attached_pool_of_a_crashed_kernel_ends_every_process_it_had(kernels, tmp_path):  # noqa: F811
    """Without --detached, the kernel's SIGKILL ends the pool: the relay sees the
    notebook's connection close and ends, the ranks exit, their holders' new processes
    find no relay and end, torchrun ends; no process and no relay folder is left, and
    torchrun's log says why in the workers' own line."""
    n, port = 2, free_port()
    km, k = kernels()
    assert execute(k, "%load_ext nbddp").error is None
    proc, token_file = torchrun(tmp_path, n, port)
    try:
        attach(k, n, port, token_file)
        assert execute(k, "%%ddp --text\nx = rank").error is None
        family = psutil.Process(proc.pid).children(recursive=True)
        holder = next(p for p in family if "nbddp.worker" in p.cmdline())
        token = remote.read_or_create_token(token_file)
        relay_folder = os.path.dirname(
            relay.socket_path(f"127.0.0.1:{port}", token, holder.environ())
        )
        assert os.path.isdir(relay_folder)
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert proc.wait(90) != 0  # torchrun ended: its workers did
        assert wait_gone([proc.pid, *(p.pid for p in family)]) == []
        deadline = time.monotonic() + 30  # (the relay removes it as it ends)
        while os.path.exists(relay_folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(relay_folder)
        log = (tmp_path / "node.log").read_text()
        for rank in range(n):  # each holder's new process says why it ends, in one line
            assert (
                f"the pool rank {rank} served is gone (the notebook's kernel ended, or its "
                "connection dropped); its state is lost, and this worker ends" in log
            ), log
    finally:
        end_all([proc])


def test_a_detached_attach_given_up_or_timed_out_leaves_nothing(tmp_path, monkeypatch):
    """No rank comes: Ctrl-C in the kernel while it waits (here: its watch raises it) ends
    the supervisor, and so does --timeout, said in one line; no process or folder is left."""
    from nbddp.detached import client
    from nbddp.detached import messages as W
    from nbddp.pool.errors import PoolStartError

    monkeypatch.setenv("NBDDP_HOME", str(tmp_path / "h"))
    token_file = str(tmp_path / "token")
    seen: dict[str, psutil.Process] = {}

    def ctrl_c(folder: str) -> None:
        if os.path.exists(os.path.join(folder, W.ADDRESS)):  # it listens: the kernel gives up
            (seen["supervisor"],) = [
                p for p in psutil.Process().children() if "nbddp.detached.server" in p.cmdline()
            ]
            raise KeyboardInterrupt

    attach = {"token_file": token_file, "tls": False}
    options = dict(attach=attach, listen=("127.0.0.1", 0))
    with pytest.raises(KeyboardInterrupt):
        client.start("gu", 2, start_timeout=60, watch=ctrl_c, **options)
    assert wait_gone([seen["supervisor"].pid]) == []
    assert not os.path.exists(W.folder_of("gu"))
    with pytest.raises(PoolStartError, match=r"did not start: ranks \[0, 1\] did not start"):
        client.start("to", 2, start_timeout=1, **options)
    assert not os.path.exists(W.folder_of("to"))
