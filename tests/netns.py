"""Hosts simulated on one machine: network namespaces of their own (node-a to node-d),
bridged to the notebook at NOTEBOOK_IP, each process in one with its own hostname.

Shared by tests/hosts/test_netns.py (torchrun nodes) and tests/hosts/test_slurm.py (a
slurmd in each). Needs root and iproute2; :func:`make_nodes` skips with the reason where
namespaces cannot be made. Every address used lives in the namespaces and the bridge made.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

# a subnet of this process's own: two test processes at once (pytest-xdist, two
# checkouts) make bridges that never share addresses
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
NOTEBOOK_IP = f"{SUBNET}.1"
NAMES = ("node-a", "node-b", "node-c", "node-d")  # up to three hosts and a replacement
_made = itertools.count()

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="network namespaces need root, iproute2 and unshare",
)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def make_nodes() -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, hostname, ip)] of node-a to node-d, on a bridge to NOTEBOOK_IP."""
    tag = f"{os.getpid() % 10000}{next(_made)}"
    bridge = f"nbbr{tag}"
    made: list[str] = []

    def remove() -> None:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)

    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{NOTEBOOK_IP}/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        result = []
        for i, name in enumerate(NAMES):
            ns, veth, ip = f"nb{tag}{name[-1]}", f"nbv{tag}{name[-1]}", f"{SUBNET}.{2 + i}"
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
        remove()
        pytest.skip(f"cannot make network namespaces here: {getattr(exc, 'stderr', exc)}")
    try:
        yield result
    finally:
        remove()


def on_node(node: tuple[str, str, str], command: str, hosts_file: str | None = None) -> list:
    """argv that runs the shell ``command`` on ``node``: in its namespace, with its
    hostname (and ``hosts_file`` as its /etc/hosts, in a mount namespace of its own, this
    machine's /sys kept: slurmd needs its cgroup folder)."""
    ns, hostname, _ = node
    shell = f"hostname {hostname} && exec {command}"
    if hosts_file is None:
        return ["ip", "netns", "exec", ns, "unshare", "-u", "sh", "-c", shell]
    shell = f"mount --bind {hosts_file} /etc/hosts && {shell}"
    return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "-u", "-m", "sh", "-c", shell]


def kill_host(ns: str, spare: tuple[int, ...] = ()) -> None:
    """SIGKILL every process of a namespace: all that ran on that host (but ``spare``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True)
    for pid in set(map(int, out.stdout.split())) - set(spare):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
