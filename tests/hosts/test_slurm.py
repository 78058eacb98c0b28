"""A real SLURM job: munge, slurmctld and slurmd on loopback, started by this test.

Skipped where Debian's slurm-wlm is not installed or the test is not root
(.ci/run installs it, as root). Where it is installed, a cluster that does not
come up is a failure that says why, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers import free_port
from nbddp.notebook import remote

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(d) is None for d in DAEMONS),
    reason="needs root and Debian's slurm-wlm (slurmctld, slurmd, munge)",
)


def slurm_conf(d: str) -> str:
    host = socket.gethostname()
    return f"""\
ClusterName=nbddptest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmdSpoolDir={d}/spool
StateSaveLocation={d}/state
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("slurm"))
    for sub in ("spool", "state"):
        os.mkdir(os.path.join(d, sub))
    key = os.path.join(d, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(1024))
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(slurm_conf(d))
    env = dict(os.environ, SLURM_CONF=conf)
    log = open(os.path.join(d, "daemons.log"), "wb")  # noqa: SIM115
    daemons = []
    try:
        daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={d}/munge.sock",
                    f"--pid-file={d}/munge.pid",
                    f"--log-file={d}/munge.log",
                    f"--seed-file={d}/munge.seed",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        time.sleep(0.5)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", conf],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True
            ).stdout.strip()
            if state == "idle":
                break
            ended = [
                f"{p.args[0]} (exit code {p.returncode})" for p in daemons if p.poll() is not None
            ]
            if ended or time.monotonic() > deadline:
                # installed but not working is a failure, not a skip: CI installs it to run this
                log.flush()
                with open(os.path.join(d, "daemons.log"), errors="replace") as f:
                    tail = f.read()[-2000:]
                pytest.fail(
                    f"SLURM is installed but did not come up: node state {state!r}"
                    + (f", {', '.join(ended)} ended" if ended else " after 60 s")
                    + f"; the daemons said:\n{tail}",
                    pytrace=False,
                )
            time.sleep(0.3)
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


@pytest.mark.timeout(240)
def test_attach_submits_a_real_slurm_job_and_uses_its_ranks(slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)  # the job's log lands here
    token_file = tmp_path / "token"
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    try:
        result = shell.run_cell(
            f"%ddp attach --world-size 2 --token-file {token_file} --timeout 120 "
            '--slurm "--nodes 1"'
        )
        out = capsys.readouterr().out
        assert result.success, out
        assert "submitted SLURM job" in out
        assert "attached 2 ranks" in out
        job = out.split("submitted SLURM job ")[1].split()[0]
        assert shell.run_cell(
            "%%ddp --quiet --out _slurm\nimport os, torch.distributed as dist\n"
            "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), os.environ['SLURM_JOB_ID'])"
        ).success
        assert shell.user_ns["_slurm"] == [(2.0, job), (2.0, job)]
        shell.run_cell("%ddp stop")
        deadline = time.monotonic() + 60
        while subprocess.run(
            ["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True
        ).stdout.strip():
            assert time.monotonic() < deadline, "the job did not end after %ddp stop"
            time.sleep(0.5)
    finally:
        shell.run_cell("%unload_ext nbddp")
    assert remote.read_or_create_token(str(token_file))  # made for the job, 0600
