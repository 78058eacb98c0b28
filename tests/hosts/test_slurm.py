"""A real SLURM cluster, started by this test: munged and slurmctld here, and three
nodes, node-a to node-c, each a slurmd in a network namespace of its own (tests/netns.py),
with its hostname and an /etc/hosts that names the nodes.

Jobs of the script ``%ddp attach --slurm`` submits (torchrun's static rendezvous,
--no-kill): a detached pool across a kernel restart; a rank SIGKILLed, replaced on its
node; a node lost (every process of its namespace, its slurmd too) and its ranks brought
back by the same script submitted again for node-c. The last two at 2 and 4 ranks a node
(4 and 8 ranks; node-b's slurmd started again between the two).

Skipped where Debian's slurm-wlm is not installed or the test is not root
(.ci/run installs it, as root). Where it is installed, a cluster that does not
come up is a failure that says why, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest
from test_detached_kernel import BUILD, digest, notebook_value
from test_kernel import execute, kernels, restarted  # noqa: F401

from helpers import collect, detached_family, free_port, namespace_digests, wait_rejoined
from nbddp import Pool
from nbddp.notebook import remote
from nbddp.pool.hosts_lost import HostsMissing
from nbddp.wire.stacks import rank_set
from netns import NOTEBOOK_IP, kill_host, make_nodes, needs_netns, on_node
from tiers import slow

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or any(shutil.which(d) is None for d in DAEMONS),
        reason="needs root and Debian's slurm-wlm (slurmctld, slurmd, munge)",
    ),
    needs_netns,
]
SLURM_NODES = 3  # node-a, node-b; node-c the replacement


def slurm_conf(d: str, nodes) -> str:
    lines = "".join(
        f"NodeName={name} NodeAddr={ip} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
        for _, name, ip in nodes
    )
    return f"""\
ClusterName=nbddptest
SlurmctldHost={socket.gethostname()}({NOTEBOOK_IP})
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=5
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmdSpoolDir={d}/spool-%n
StateSaveLocation={d}/state
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def netns_nodes():
    with make_nodes() as made:
        yield made


def _started(d: str, log, cmd: list[str], env=None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _munged(d: str, log, key: str) -> subprocess.Popen:
    return _started(d, log, [
        "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={d}/munge.sock",
        f"--pid-file={d}/munge.pid", f"--log-file={d}/munge.log", f"--seed-file={d}/munge.seed",
    ])  # fmt: skip


def _wait_idle(d: str, env: dict, daemons: list, log) -> None:
    """Until every node is idle; a cluster that does not come up fails and says why."""
    deadline = time.monotonic() + 60
    while True:
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True
        ).stdout.split()
        if states == ["idle"] * SLURM_NODES:
            return
        ended = [f"{p.args[0]} (exit code {p.returncode})" for p in daemons if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            # installed but not working is a failure, not a skip: CI installs it to run this
            log.flush()
            with open(os.path.join(d, "daemons.log"), errors="replace") as f:
                tail = f.read()[-2000:]
            pytest.fail(
                f"SLURM is installed but did not come up: node states {states!r}"
                + (f", {', '.join(ended)} ended" if ended else " after 60 s")
                + f"; the daemons said:\n{tail}",
                pytrace=False,
            )
        time.sleep(0.3)


@pytest.fixture(scope="module")
def slurm(netns_nodes, tmp_path_factory):
    """A SLURM cluster of three nodes, node-a to node-c: a slurmd in each one's network
    namespace (its hostname, its /etc/hosts naming the nodes), munged and slurmctld here.
    Yields the environment its commands need (SLURM_CONF)."""
    d = str(tmp_path_factory.mktemp("slurm"))
    nodes = netns_nodes[:SLURM_NODES]
    for sub in ["state"] + [f"spool-{name}" for _, name, _ in nodes]:
        os.mkdir(os.path.join(d, sub))
    key = os.path.join(d, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(1024))
    conf, hosts = os.path.join(d, "slurm.conf"), os.path.join(d, "hosts")
    with open(conf, "w") as f:
        f.write(slurm_conf(d, nodes))
    with open(hosts, "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for _, name, ip in nodes))
    env = dict(os.environ, SLURM_CONF=conf)
    log = open(os.path.join(d, "daemons.log"), "wb")  # noqa: SIM115
    daemons = []
    try:
        daemons.append(_munged(d, log, key))
        time.sleep(0.5)
        daemons.append(_started(d, log, ["slurmctld", "-D", "-f", conf], env))
        time.sleep(0.5)
        for node in nodes:
            slurmd = f"slurmd -D -N {node[1]} -f {conf}"
            daemons.append(_started(d, log, on_node(node, slurmd, hosts), env))
        _wait_idle(d, env, daemons, log)
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for node in nodes:  # what a step left (slurmstepd, torchrun, ranks): nothing stays
            kill_host(node[0])
        log.close()


# ------------------------------------ a detached pool of a SLURM job, across a kernel restart

ON_RANKS = (
    "import os, socket\n_t = torch.ones(1)\ntorch.distributed.all_reduce(_t)\n"
    "(socket.gethostname(), os.environ['SLURM_JOB_ID'], _t.item())"
)


@slow
@pytest.mark.kernel
@pytest.mark.timeout(420)
def test_a_detached_pool_of_a_slurm_job_outlives_a_kernel_restart(
    slurm,
    kernels,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """``%ddp attach --slurm ... --detached NAME`` submits the job script (2 nodes x 2
    ranks) and makes its token file; then the kernel restarts: ``%ddp connect NAME`` from
    the new kernel finds all 4 ranks of the job on node-a and node-b, their namespaces
    unchanged, and they all-reduce; ``%ddp stop NAME`` ends the job."""
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])  # (the kernel's, so the job's)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.chdir(tmp_path)  # the job's log lands here
    name, token_file = "slurm1", tmp_path / "token"
    km, k = kernels()
    assert execute(k, "%load_ext nbddp").error is None
    r = execute(
        k,
        f"%ddp attach --world-size 4 --listen {NOTEBOOK_IP}:{free_port()} --token-file "
        f'{token_file} --timeout 240 --slurm "--nodes 2 --nodelist node-a,node-b" '
        f"--detached {name}",
        timeout=300,
    )
    assert r.error is None, r.text
    assert "UsageError" not in r.text, r.text
    assert f"the detached pool {name} outlives this kernel" in r.stdout, r.text
    job = r.stdout.split("submitted SLURM job ")[1].split()[0]
    try:
        with detached_family(name) as family:
            assert execute(k, BUILD).error is None
            before = digest(k)
            k = restarted(km, k)
            assert execute(k, "%load_ext nbddp").error is None
            r = execute(k, f"%ddp connect {name}")
            assert f"connected to the detached pool {name} (4 ranks)" in r.stdout, r.text
            assert digest(k) == before
            where = notebook_value(k, ON_RANKS, "where_")
            assert where == [(h, job, 4.0) for h in ("node-a", "node-a", "node-b", "node-b")]
            family.stopped_by(lambda: execute(k, f"%ddp stop {name}"))
            assert ended(slurm, [job], 60) == [], "the job did not end after %ddp stop"
    finally:
        subprocess.run(["scancel", job], env=slurm, capture_output=True)
    assert remote.read_or_create_token(str(token_file))  # made for the job, 0600


# ------------------------------ two SLURM nodes of two and of four ranks: a death, a lost node

HOLDERS = "(__import__('socket').gethostname(), __import__('os').getppid())"
REDUCE = "_t = torch.ones(1) * (rank + 1)\ntorch.distributed.all_reduce(_t)\n_t.item()"


def squeue(env: dict, *args: str) -> str:
    return subprocess.run(["squeue", "-h", *args], env=env, capture_output=True, text=True).stdout


def sbatch(env: dict, folder, script: str, *options: str) -> str:
    """The job id of ``script`` submitted from ``folder`` (its log lands there), as
    ``%ddp attach --slurm`` submits it (remote.submit_slurm), with ``options`` first."""
    with contextlib.chdir(folder), mock.patch.dict(os.environ, env):
        if not options:
            return remote.submit_slurm(script)
        path = os.path.join(folder, "again.sh")
        with open(path, "w") as f:
            f.write(script)
        out = subprocess.run(["sbatch", "--parsable", *options, path], capture_output=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.decode().strip().split(";")[0]


def ended(env: dict, jobs: list[str], timeout: float) -> list[str]:
    """The jobs still queued or running after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = [j for j in jobs if squeue(env, "-j", j).strip()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def node_state(env: dict, name: str) -> str:
    return subprocess.run(
        ["sinfo", "-h", "-n", name, "-o", "%t"], env=env, capture_output=True, text=True
    ).stdout.strip()


def revive(env: dict, node) -> None:
    """A node a test killed (every process of its namespace) back in service: its slurmd
    started again (ReturnToService=2 takes it back); the cluster's teardown ends it."""
    conf = env["SLURM_CONF"]
    hosts = os.path.join(os.path.dirname(conf), "hosts")
    log = os.path.join(os.path.dirname(conf), f"revived-{node[1]}.log")
    with open(log, "ab") as f:
        _started(
            os.path.dirname(conf), f, on_node(node, f"slurmd -D -N {node[1]} -f {conf}", hosts), env
        )
    deadline = time.monotonic() + 60
    while node_state(env, node[1]) != "idle":
        assert time.monotonic() < deadline, f"{node[1]} is {node_state(env, node[1])}"
        time.sleep(0.3)


@pytest.fixture(scope="module", params=[2, 4], ids=["2x2", "2x4"])
def slurm_pool(request, slurm, netns_nodes, tmp_path_factory):
    """(pool, the SLURM environment, [job ids], folder): a Pool of 2 x ``per_node`` ranks (4
    and 8) that listens on the bridge, and the job script ``%ddp attach --slurm`` writes,
    submitted for node-a and node-b (``per_node`` ranks each)."""
    per_node = request.param
    world = 2 * per_node
    for node in netns_nodes[:SLURM_NODES]:  # (an earlier size's lost node-b: back up)
        if node_state(slurm, node[1]).startswith("down"):
            revive(slurm, node)
    folder = tmp_path_factory.mktemp(f"slurmjob{world}")
    token_file = str(folder / "token")
    env = dict(slurm, GLOO_SOCKET_IFNAME="eth0")  # (the job's environment is this one)
    token = remote.read_or_create_token(token_file)
    pool = Pool(world, listen=(NOTEBOOK_IP, 0), token=token, start_timeout=240)
    script = remote.slurm_script(
        "--nodes 2 --nodelist node-a,node-b",
        world,
        pool.listen(),
        token_file,
        python=sys.executable,
    )
    jobs = [sbatch(env, folder, script)]
    try:
        pool.start()
        yield pool, env, jobs, folder
    finally:
        pool.stop()
        left = ended(env, jobs, 30)
        subprocess.run(["scancel", *left], env=env, capture_output=True)
        assert not left, f"jobs {left} did not end after the pool stopped"


def _summed(world: int) -> list[float]:
    """REDUCE's value on every rank of ``world``."""
    return [float(world * (world + 1) // 2)] * world


@pytest.mark.timeout(300)
def test_a_dead_rank_in_a_slurm_job_is_replaced_on_its_node(slurm_pool):
    """SIGKILL the last rank (node-b) in a job slurmd started: its holder forks a new one on
    node-b, every other rank keeps its namespace (node-b's others too), the job runs on."""
    pool, env, jobs, _ = slurm_pool
    world = pool.world_size
    per_node, last = world // 2, world - 1
    assert pool.hosts == {r: "node-a" if r < per_node else "node-b" for r in range(world)}
    pool.execute("w = torch.full((1000,), float(rank))")
    holders, before = pool.execute(HOLDERS), namespace_digests(pool)
    os.kill(pool.roster[last].pid, signal.SIGKILL)  # (node-b's pid: only its network is own)
    _, _, end = collect(pool.run("rank"))
    said = " ".join(end.notes)
    print(next((n for n in end.notes if "re-formed" in n), said))
    assert f"rank {last}: a new process took its place" in said, said
    assert "every other rank kept its namespace" in said, said
    assert pool.execute(HOLDERS) == holders  # on node-b, under the same holder
    assert namespace_digests(pool)[:last] == before[:last]
    assert pool.execute(REDUCE) == _summed(world)
    assert squeue(env, "-j", jobs[0], "-o", "%T").split() == ["RUNNING"]


@pytest.mark.timeout(420)
def test_a_lost_slurm_node_rejoins_from_a_replacement_node(slurm_pool, netns_nodes):
    """node-b crashes (its slurmd, the step's slurmstepd, torchrun, holders, ranks and
    relay: every process of its namespace). SLURM marks it down and the job runs on
    (--no-kill), ranks 0 and 1 keep their namespaces; the same job script, submitted again
    for node-c with NBDDP_NODE_RANK=1 and NBDDP_MASTER_ADDR, brings ranks 2 and 3 back."""
    pool, env, jobs, folder = slurm_pool
    world = pool.world_size
    per_node = world // 2
    lost = list(range(per_node, world))
    pool.execute("w = torch.full((1000,), float(rank))")
    before = namespace_digests(pool)
    kill_host(netns_nodes[1][0])
    deadline = time.monotonic() + 60
    while node_state(env, "node-b") not in ("down*", "down"):  # (SlurmdTimeout=5)
        assert time.monotonic() < deadline, f"node-b is {node_state(env, 'node-b')}"
        time.sleep(0.5)
    missing = rf"{rank_set(lost)} of host node-b are missing"
    with pytest.raises(HostsMissing, match=missing) as no:
        pool.execute("w = None")  # refused at once: nothing runs
    recipe = (  # the real job id, node rank and master: what brings node-b's ranks back
        f"`scontrol write batch_script {jobs[0]} nbddp.sh` then `sbatch --nodes 1 "
        "--export=ALL,NBDDP_NODE_RANK=1,NBDDP_MASTER_ADDR=node-a nbddp.sh`"
    )
    assert recipe in str(no.value), no.value
    assert recipe in " ".join(pool.take_notes())
    assert squeue(env, "-j", jobs[0], "-o", "%T").split() == ["RUNNING"], "--no-kill"
    assert [s.state for s in pool.status()] == ["idle"] * per_node + ["missing"] * per_node
    script = subprocess.run(
        ["scontrol", "write", "batch_script", jobs[0], "-"], env=env, capture_output=True
    ).stdout.decode()
    t0 = time.monotonic()
    jobs.append(
        sbatch(env, folder, script, "--nodes", "1", "--nodelist", "node-c",
               "--export=ALL,NBDDP_NODE_RANK=1,NBDDP_MASTER_ADDR=node-a")
    )  # fmt: skip
    wait_rejoined(pool, 240, "the replacement node's ranks never came")
    _, _, end = collect(pool.run("1"))
    print(f"a replacement SLURM node: sbatch to a ready group in {time.monotonic() - t0:.1f} s")
    said = " ".join(end.notes)
    assert "rejoined from node-c" in said, said
    assert "every other rank kept its namespace" in said, said
    after = namespace_digests(pool)
    assert after[:per_node] == before[:per_node]
    own = pool.execute("w[0].item()", ranks=lost)  # (re-ran w's cell)
    assert [own[r] for r in lost] == [float(r) for r in lost], "their own w"
    assert pool.execute(REDUCE) == _summed(world)
