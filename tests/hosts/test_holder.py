"""A holder never outlives its launcher or its notebook (issue 47, item 3).

torchrun starts each worker in a session of its own, so a SIGKILL to torchrun's process
group misses the ``nbddp.worker`` holder. Before the fix, re-parented to init, a holder
forked a new rank every 10-15 s for hours (seen for 2 h 18 min). Now it ends with its
launcher (the parent-death signal), and after MISSES ranks in a row that were never
taken into the pool. The holders here are real processes running
:func:`nbddp.hosts.holder.hold` with a stand-in for the rank; the last test kills a
real torchrun node and its notebook, and finds no process of theirs left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import free_port, start, torchrun_node_cmd, wait_gone
from nbddp.hosts import holder
from tiers import sizes

# a launcher (torchrun's part) that starts a holder in a session of its own, says the
# holder's pid, and waits; the holder's rank is RANK (its body, with `renewed` and `log`)
LAUNCHER = """
import subprocess, sys, time
holder = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(holder.pid, flush=True)
holder.wait()
print("holder ended", holder.returncode, flush=True)
time.sleep(3600)
"""
HOLDER = """
import os, sys, time
from nbddp.hosts import holder
log = open({log!r}, "a")
def rank(renewed):
    print(os.getpid(), renewed, file=log, flush=True)
{body}
sys.exit(holder.hold(rank))
"""


def _launch(tmp_path, body: str) -> tuple[subprocess.Popen, int]:
    code = HOLDER.format(log=str(tmp_path / "ranks"), body=body)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, code],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return launcher, int(launcher.stdout.readline())


def _ranks(tmp_path) -> list[tuple[int, bool]]:
    path = tmp_path / "ranks"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(pid), renewed == "True") for pid, renewed in (line.split() for line in lines)]


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _end(launcher: subprocess.Popen, pids) -> None:
    for pid in [launcher.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


def test_a_holder_ends_with_its_launcher_and_its_rank_with_it(tmp_path):
    launcher, pid = _launch(tmp_path, "    time.sleep(3600)\n    return 1")
    try:
        ranks = _wait_for(lambda: _ranks(tmp_path))
        assert ranks == [(ranks[0][0], False)]
        os.kill(launcher.pid, signal.SIGKILL)  # torchrun's agent killed: its group missed us
        launcher.wait()
        assert wait_gone([pid, ranks[0][0]], timeout=10) == []
        assert _ranks(tmp_path) == ranks  # no rank forked after the launcher ended
    finally:
        _end(launcher, [pid, *(p for p, _ in _ranks(tmp_path))])


def test_ranks_never_taken_in_end_their_holder_after_misses(tmp_path):
    """The notebook is gone: each new rank ends without being taken into the pool."""
    launcher, pid = _launch(tmp_path, "    return 1  # (a lost connection's code)")
    try:
        said = _wait_for(lambda: launcher.stdout.readline(), timeout=60)
        assert said.split() == ["holder", "ended", "2"]
        ranks = _ranks(tmp_path)
        assert [renewed for _, renewed in ranks] == [False] + [True] * (holder.MISSES - 1)
    finally:
        _end(launcher, [pid])


def test_ranks_taken_in_are_renewed_for_as_long_as_they_die(tmp_path):
    """A rank the pool took in that dies is a plain death: its holder forks a new one,
    however many there were; it ends when a rank ends by the pool's word (0 here)."""
    body = (
        "    holder.taken_in()\n"
        f"    return 0 if sum(1 for _ in open({str(tmp_path / 'ranks')!r})) > 5 else 1"
    )
    launcher, pid = _launch(tmp_path, body)
    try:
        said = _wait_for(lambda: launcher.stdout.readline(), timeout=60)
        assert said.split() == ["holder", "ended", "0"]
        assert len(_ranks(tmp_path)) == 6 > holder.MISSES
    finally:
        _end(launcher, [pid])


NOTEBOOK = """
import sys, time
from nbddp import Pool
token = open(sys.argv[2], "rb").read().strip()
pool = Pool(int(sys.argv[1]), listen=("127.0.0.1", 0), token=token, start_timeout=120)
print(pool.listen(), flush=True)
pool.start()
print(pool.execute("1"), flush=True)
time.sleep(3600)
"""


def _processes_of(address: str) -> list[int]:
    """Every process whose command line names ``address``: torchrun, holders, ranks, relay."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if address in " ".join(p.info["cmdline"] or []) and p.status() != "zombie":
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", sizes(2, 4, ids="{}ranks"))
def test_a_torchrun_node_and_its_notebook_killed_leave_no_process(tmp_path, n):
    from nbddp.notebook import remote

    token_file = tmp_path / "token"
    remote.read_or_create_token(str(token_file))
    notebook = subprocess.Popen(
        [sys.executable, "-c", NOTEBOOK, str(n), str(token_file)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    address = notebook.stdout.readline().strip()
    cmd = torchrun_node_cmd(0, free_port(), address, token_file, nodes=1, per_node=n)
    with open(tmp_path / "node.log", "wb") as log:  # (a session of its own, as torchrun's)
        node = start(cmd, log, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert notebook.stdout.readline().strip() == str([1] * n)
        before = _processes_of(address)
        assert len(before) >= 2 * n + 1  # torchrun, a holder and a rank per rank (a relay)
        os.killpg(notebook.pid, signal.SIGKILL)
        os.killpg(node.pid, signal.SIGKILL)  # misses the holders: sessions of their own
        left = _wait_for(lambda: not _processes_of(address), timeout=5)
        assert left, f"still running 5 s later: {_processes_of(address)}"
    finally:
        for pid in _processes_of(address):
            os.kill(pid, signal.SIGKILL)
        for proc in (notebook, node):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
