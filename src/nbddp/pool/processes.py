"""The rank processes of a local pool: folders, environment, start, kill and reap.

A local pool's ranks are started through a launcher (by default a fork server
that has imported torch, see :mod:`nbddp.pool.launch`), each with torchrun's
environment, in its own session, writing its early output to a log file in
the pool's private folder. The group's store runs in a process of its own
(:mod:`nbddp.pool.store`), so that no rank's death takes it down. Ranks started
elsewhere (torchrun on other hosts) have no processes here:
:class:`RankProcesses` then has no launcher, and reaping waits for their
connections to close instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time

from ..rank.gpus import pool_plan
from ..wire import carriers, payload
from .launch import Launcher, make_launcher
from .sizes import human

__all__ = ["RankProcesses"]


class RankProcesses:
    """The pool's private folders and, for a local pool, its ranks' processes."""

    def __init__(self, start_method: str, local: bool) -> None:
        self.start_method = start_method
        self.local = local
        self.launcher: Launcher | None = None
        self.dir: str | None = None  # private (0700): the socket, the ranks' start logs
        self.shm: str | None = None  # the pool's private shared-memory folder
        self.store: tuple[int, int] | None = None  # the group's store: (pid, port)
        self.spill_said = False  # the note that values went past shared memory, said once

    def make_folders(self) -> None:
        if self.dir is None:
            self.spill_said = False
            # mode 0700, removed by the next nbddp process if this one is SIGKILLed
            self.dir = payload.locked_dir(tempfile.gettempdir())
            self.shm = payload.shm_dir()  # where ranks write big values for the notebook

    def spill_notes(self) -> list[str]:
        """Once per pool, when a value first went past the pool's shared-memory folder
        (too small or full): how big /dev/shm is here, and where such values go."""
        how = [] if self.spill_said or self.shm is None else carriers.spilled(self.shm)
        if not how:
            return []
        self.spill_said = True
        st = os.statvfs(self.shm)
        total, free = human(st.f_blocks * st.f_frsize), human(st.f_bavail * st.f_frsize)
        disk = f"through a private folder on disk ({carriers.twin(self.shm)}), read, not mapped"
        ways = [disk if "disk" in how else "", "inside the messages" if "message" in how else ""]
        return [
            f"{carriers.SHM} holds {total} here ({free} free): values that do not fit in it "
            f"go {', or when that is full, '.join(w for w in ways if w)}"
        ]

    def start(self, rank: int, address: str, env: dict[str, str]) -> int:
        """Start ``rank``'s process, connecting to ``address``; its pid."""
        return self._launcher().start(["--connect", address], env, self.log_path(rank), os.getcwd())

    def warm(self) -> None:
        """Ranks started from now on (replacements, a resize's) build their first DDP
        wrapper without importing torch._dynamo first (:meth:`Launcher.warm`)."""
        if self.launcher is not None:
            self.launcher.warm()

    def _launcher(self) -> Launcher:
        if self.launcher is None:
            self.launcher = make_launcher(self.start_method)
        return self.launcher

    def store_port(self) -> int:
        """The port of the group's store, started now if it is not running."""
        if self.store is None:
            log = os.path.join(self.dir or "", "store.log")
            self.store = self._launcher().start_store(log, os.getcwd())
        return self.store[1]

    def stop_store(self) -> None:
        if self.store is not None and self.launcher is not None:
            pid, self.store = self.store[0], None
            self.launcher.kill(pid)
            self.launcher.returncode(pid, timeout=2.0)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.dir or "", f"rank{rank}.log")

    def log_tail(self, rank: int, lines: int = 20) -> str:
        """The last lines a rank wrote before it connected its streams (for errors)."""
        try:
            with open(self.log_path(rank), errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return ""
        return ("\n" + "".join(tail).rstrip()) if tail else ""

    # ------------------------------------------------------------ exits

    def sentinels(self) -> list:
        return [] if self.launcher is None else self.launcher.sentinels()

    def exited(self, pids: dict[int, int]) -> list[int]:
        """Which of ``pids`` (rank -> pid) have ended, as far as the launcher knows now."""
        if self.launcher is None:
            return []
        self.launcher.poll()
        return [rank for rank, pid in pids.items() if pid in self.launcher.returncodes]

    def returncode(self, pid: int, timeout: float = 2.0) -> int | None:
        return None if self.launcher is None else self.launcher.returncode(pid, timeout=timeout)

    def kill(self, pid: int) -> bool:
        """SIGKILL a rank's session; False for ranks started elsewhere (not ours to kill)."""
        if self.launcher is None:
            return False
        self.launcher.kill(pid, signal.SIGKILL)
        return True

    def reap(self, pids: list[int], deadline: float) -> dict[int, int | None]:
        """Wait for processes until ``deadline``, then SIGKILL their sessions; pid -> code."""
        codes: dict[int, int | None] = {}
        launcher = self.launcher
        if launcher is None:
            return dict.fromkeys(pids)
        for pid in pids:
            code = launcher.returncode(pid, timeout=max(0.0, deadline - time.monotonic()))
            if code is None:
                launcher.kill(pid, signal.SIGKILL)
                code = launcher.returncode(pid, timeout=5.0)
            launcher.kill(pid, signal.SIGKILL)  # whatever it started, too
            codes[pid] = code
        return codes

    def reap_ranks(self, ranks: list, deadline: float) -> None:
        """:meth:`reap` for rank records (their ``returncode`` and ``state`` set); ranks
        started elsewhere cannot be signalled: wait for their connections to close."""
        if self.launcher is None:
            for r in ranks:
                _wait_closed(r.link.conn, deadline)
                r.state = "dead"
            return
        codes = self.reap([r.pid for r in ranks], deadline)
        for r in ranks:
            r.returncode, r.state = codes[r.pid], "dead"

    def close(self) -> None:
        """End the store and the launcher, and remove the folders."""
        self.stop_store()
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        if self.dir is not None:
            payload.remove_locked_dir(self.dir)
            payload.remove_locked_dir(self.shm)
            self.dir = None


def rank_env(pool, rank: int, generation: int = 0) -> dict[str, str]:
    """Rank ``rank``'s environment in a local pool started with ``pool``'s options; a rank
    that takes a dead one's place joins the group's re-form ``generation``."""
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)  # rank 0 binds a free port and reports it
    n = str(pool.world_size)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=n,
        LOCAL_WORLD_SIZE=n,
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        NBDDP_SYS_PATH=os.pathsep.join(p for p in sys.path if p),  # what it can import
        NBDDP_TOKEN=pool.token.decode(),
        NBDDP_SHM_DIR=pool.procs.shm,
        NBDDP_STORE_PORT=str(pool.procs.store_port()),
        NBDDP_GENERATION=str(generation),
        MPLBACKEND="module://nbddp.rank.mpl_backend",
    )
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # a local pool stays local
        env.setdefault(var, "lo")
    # NCCL's watchdog, on a collective's error or timeout, aborts the communicators and
    # leaves the process alone (2, CleanUpOnly), where torch's default (3) ends the
    # process: a survivor of a peer's death must live on with its namespace
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    chosen = pool_plan(pool)  # decided here, once: which backend, which GPU
    for var, value in (
        ("NBDDP_BACKEND", chosen.backend),
        ("NBDDP_GPU", chosen.gpu(rank)),
        ("NBDDP_PG_TIMEOUT", pool.pg_timeout or None),
        ("NBDDP_DEVICE", pool.device),
        ("NBDDP_SEED", pool.seed),
        ("NBDDP_GROUPS", pool.groups),
        ("NBDDP_MESH", pool.mesh),
        ("NBDDP_THREADS", pool.threads),
        ("TORCH_DISTRIBUTED_DEBUG", "DETAIL" if pool.debug else None),
        ("CUDA_VISIBLE_DEVICES", chosen.visible),
    ):
        if value is not None and value != "":
            env[var] = str(value)
    env.update(pool.extra_env)
    return env


def enough_open_files(ranks: int) -> None:
    """Raise this process's soft limit on open files, if needed, to fit ``ranks`` more.

    Each rank holds 3 connections to the notebook (control, stdout, stderr): with
    the usual soft limit of 1024, a pool of about 340 ranks would not fit. Raised
    toward the hard limit only as far as needed, as torchrun users raise it by hand.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + 4 * ranks + 64
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _wait_closed(conn, deadline: float) -> None:
    """Read ``conn`` until its peer closes it or ``deadline`` passes."""
    if conn is None or conn.closed:
        return
    try:
        while conn.poll(max(0.0, deadline - time.monotonic())):
            conn.recv_bytes()
    except (OSError, EOFError):
        pass
