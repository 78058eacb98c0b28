"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil

from nbddp import protocol as P


def healthy(pool):
    """``pool`` ready for a test: restarted if a death or a stop left it so, no old notes."""
    if pool.needs_restart or not pool.started:
        pool.restart()
    pool.notes.clear()
    pool.roster.deaths.clear()  # a test's deaths are its own (3 in a minute stop the pool)
    return pool


def collect(events):
    """Run a cell's events to the end: (text by (rank, stream), all events, CellEnd)."""
    text: dict[tuple[int, str], str] = {}
    seen = []
    end = None
    for ev in events:
        seen.append(ev)
        if isinstance(ev, P.Output):
            text[ev.rank, ev.stream] = text.get((ev.rank, ev.stream), "") + ev.text
        if isinstance(ev, P.CellEnd):
            end = ev
    return text, seen, end


def wait_gone(pids, timeout=10.0, zombies=True):
    """Pids still alive after waiting up to ``timeout`` (zombies count as gone if ``zombies``)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                status = psutil.Process(pid).status()
                if not zombies or status != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def start(cmd: list[str], log, env=None) -> subprocess.Popen:
    """A process in a session of its own (``end_all`` ends its whole group)."""
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def worker_cmd(connect: str, token_file, timeout: float = 60) -> list[str]:
    """A rank started by hand, as the printed torchrun command runs it."""
    return [
        sys.executable,
        "-m",
        "nbddp.worker",
        "--connect",
        connect,
        "--token-file",
        str(token_file),
        "--connect-timeout",
        f"{timeout:g}",
    ]


def torchrun_node_cmd(
    node: int, master: int, connect: str, token_file, nodes: int = 2, per_node: int = 2
) -> list[str]:
    """Node ``node`` of a torchrun job of ``nodes`` x ``per_node`` ranks that attach."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(per_node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master),
        "-m",
        "nbddp.worker",
        "--connect",
        connect,
        "--token-file",
        str(token_file),
    ]


def lone_worker_env(world_size: int = 1, rank: int = 0) -> dict:
    """torchrun's variables for a rank started by hand (rank 0 opens the group's store)."""
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    env.pop("MASTER_PORT", None)
    return env


def end_all(procs) -> None:
    """SIGKILL the process groups of ``procs`` still running."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DetachedFamily:
    """What a detached pool runs and holds: its supervisor and every process under it (the
    fork server, the store, the ranks), and its folders (the pool's folder in
    ``$NBDDP_HOME/pools``, its shared-memory folder, its private temp folder).

    :meth:`record` adds what runs now (call it again after a rank was replaced);
    :meth:`left` says what is still there; :meth:`clean` ends and removes it (the
    processes only if they are the very ones recorded: pids are not reused by mistake).
    """

    def __init__(self, name: str) -> None:
        from nbddp import detached_wire

        self.name = name
        self.folder = detached_wire.folder_of(name)
        with open(os.path.join(self.folder, "info.json")) as f:
            self.supervisor = psutil.Process(json.load(f)["pid"])
        self.procs: dict[int, psutil.Process] = {}
        self.folders: set[str] = {self.folder}
        self.record()

    def record(self) -> None:
        try:
            procs = [self.supervisor, *self.supervisor.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            self.procs.setdefault(proc.pid, proc)
            try:
                shm = proc.environ().get("NBDDP_SHM_DIR")
                opened = [f.path for f in proc.open_files()]
            except psutil.Error:
                continue
            if shm:
                self.folders.add(shm)
            for path in opened:  # the pool's private temp folder holds the store's log
                folder = os.path.dirname(path)
                if os.path.basename(folder).startswith("nbddp-"):
                    self.folders.add(folder)

    @property
    def pids(self) -> list[int]:
        return list(self.procs)

    def alive(self, timeout: float = 10.0) -> list[int]:
        """The recorded processes still running after waiting up to ``timeout``."""
        left = wait_gone(self.pids, timeout)
        return [pid for pid in left if self.procs[pid].is_running()]

    def folders_left(self) -> list[str]:
        return sorted(f for f in self.folders if os.path.exists(f))

    def clean(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    proc.kill()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
