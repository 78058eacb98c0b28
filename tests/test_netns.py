"""Two real "hosts": torchrun nodes in network namespaces of their own, with their own
hostnames, attached to a notebook in the root namespace over a bridge.

Needs root and iproute2; skipped with the reason where namespaces cannot be made.
Every address used lives in the namespaces and the bridge this test makes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from nbddp import Pool, remote
from nbddp.tls import make_server_tls

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="network namespaces need root, iproute2 and unshare",
)

NOTEBOOK_IP = "10.213.77.1"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def nodes():
    tag = str(os.getpid() % 100000)
    bridge = f"nbbr{tag}"
    made: list[str] = []
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{NOTEBOOK_IP}/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        result = []
        for i, name in enumerate(("node-a", "node-b")):
            ns, veth, ip = f"nb{tag}{name[-1]}", f"nbv{tag}{name[-1]}", f"10.213.77.{2 + i}"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            result.append((ns, name, ip))
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {getattr(exc, 'stderr', exc)}")
    try:
        yield result
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tls", [False, True], ids=["mac", "tls"])
def test_ranks_on_two_hosts_attach_reduce_and_stop(nodes, tmp_path, tls):
    token_file = tmp_path / "token"
    server, pin = make_server_tls() if tls else (None, "")
    token = remote.read_or_create_token(str(token_file), pin)
    pool = Pool(2, listen=(NOTEBOOK_IP, 0), token=token, tls=server, start_timeout=180)
    address = pool.listen()
    master_ip = nodes[0][2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    procs, logs = [], []
    for node_rank, (ns, hostname, _) in enumerate(nodes):
        torchrun = (
            f"hostname {hostname} && exec {sys.executable} -m torch.distributed.run "
            f"--nnodes 2 --node-rank {node_rank} --nproc-per-node 1 --master-addr {master_ip} "
            f"--master-port {master_port} -m nbddp.worker --connect {address} "
            f"--token-file {token_file}"
        )
        log = open(tmp_path / f"{hostname}.log", "wb")  # noqa: SIM115
        logs.append(log)
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "-u", "sh", "-c", torchrun],
                env=dict(os.environ, GLOO_SOCKET_IFNAME="eth0"),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        pool.start()
        assert [s.host for s in pool.status()] == ["node-a", "node-b"]
        assert pool.hosts == {0: "node-a", 1: "node-b"}
        modes = {r.link.conn.mode for r in pool.roster.ranks.values()}
        assert modes == {"tls" if tls else "mac"}
        code = (
            "import socket, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
            "dist.all_reduce(t)\n(socket.gethostname(), t.item())"
        )
        assert pool.execute(code) == [("node-a", 3.0), ("node-b", 3.0)]
        with pytest.raises(Exception, match=r"rank 1 \(node-b\): ValueError: far away"):
            pool.execute("if rank == 1:\n    raise ValueError('far away')")
        pool.stop()
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        pool.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
