"""How ranks on this machine come to be: fork server (default), spawn, or fork.

Every launcher starts ``nbddp.rank.worker.main(argv)`` (or the group's store,
:mod:`nbddp.pool.store`) in a new session (so the
kernel's process group, and Jupyter's interrupts to it, never reach the
workers directly) and reports exits. The pool waits on :meth:`Launcher.sentinels`
together with the workers' connections, so a death is seen at once.

- ``forkserver``: one helper process imports torch once and never touches
  CUDA; each rank is a fork of it, so a (re)start costs a fork, not a Python
  and torch start, and is safe when the notebook has CUDA initialised.
- ``spawn``: ``python -m nbddp.worker`` per rank.
- ``fork``: fork the notebook itself (refused when CUDA is initialised there).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait

from .errors import PoolStartError

__all__ = ["START_METHODS", "Launcher", "make_launcher"]

START_METHODS = ("forkserver", "spawn", "fork")
# what building a rank's first DDP wrapper imports (torch imports torch._dynamo for it:
# about 1 s per process, most of a heal's time): imported ahead in a fork server on ask
WARM = ("torch._dynamo",)


class Launcher:
    """Starts worker processes and tells when they end."""

    def __init__(self) -> None:
        self.returncodes: dict[int, int] = {}  # pid -> returncode (negative: signal)

    def start(self, argv: list[str], env: dict[str, str], log: str, cwd: str) -> int:
        """Start one worker; return its pid."""
        return self._start("worker", argv, env, log, cwd, None)

    def start_store(self, log: str, cwd: str) -> tuple[int, int]:
        """Start the group's store (:mod:`nbddp.pool.store`) on a port of 127.0.0.1 bound here;
        (its pid, the port)."""
        sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
        with sock:
            env = {k: v for k, v in os.environ.items() if not k.startswith("NBDDP_")}
            pid = self._start("pool.store", [], env, log, cwd, sock.fileno())
            return pid, sock.getsockname()[1]

    def _start(self, module, argv, env, log, cwd, fd: int | None) -> int:
        """Start ``nbddp.<module>.main(argv)``; with ``fd``, it gets that file (its number
        first in argv)."""
        raise NotImplementedError

    def warm(self) -> None:
        """Have the workers started from now on find :data:`WARM` imported (a fork server
        imports them once, between forks); nothing for the other launchers."""

    def sentinels(self) -> list:
        """Objects for ``multiprocessing.connection.wait`` that become ready when a worker ends."""
        raise NotImplementedError

    def poll(self) -> None:
        """Record the return codes of workers that have ended (never blocks)."""
        raise NotImplementedError

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """The worker's return code, waiting up to ``timeout`` for it to be known."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if pid in self.returncodes or time.monotonic() >= deadline:
                return self.returncodes.get(pid)
            wait(self.sentinels(), timeout=max(0.0, min(0.05, deadline - time.monotonic())))

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal the worker's whole session (its own children too)."""
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        """Release helpers. Workers must already be gone."""


def _exitcode(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def _child_main(module: str, argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """Become a worker (or the store) in a new session; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        code = importlib.import_module(f"nbddp.{module}").main(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class _PidfdLauncher(Launcher):
    """Launchers whose workers are children of this process: exits seen through pidfds."""

    def __init__(self) -> None:
        super().__init__()
        self._pidfds: dict[int, int] = {}

    def _track(self, pid: int) -> None:
        self._pidfds[pid] = os.pidfd_open(pid)

    def sentinels(self) -> list:
        return list(self._pidfds.values())

    def poll(self) -> None:
        for pid in list(self._pidfds):
            code = self._reap(pid)
            if code is not None:
                self.returncodes[pid] = code
                os.close(self._pidfds.pop(pid))

    def _reap(self, pid: int) -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return _exitcode(status) if done else None

    def close(self) -> None:
        self.poll()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()


class SpawnLauncher(_PidfdLauncher):
    def __init__(self) -> None:
        super().__init__()
        self._procs: dict[int, subprocess.Popen] = {}

    def _start(self, module, argv, env, log, cwd, fd) -> int:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"nbddp.{module}", *([str(fd)] if fd else []), *argv],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                pass_fds=[fd] if fd else [],
            )
        self._procs[proc.pid] = proc
        self._track(proc.pid)
        return proc.pid

    def _reap(self, pid: int) -> int | None:
        code = self._procs[pid].poll()
        if code is not None:
            del self._procs[pid]
        return code


class ForkLauncher(_PidfdLauncher):
    def __init__(self) -> None:
        super().__init__()
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            raise PoolStartError(
                "start method 'fork' is unsafe: CUDA is initialised in this notebook "
                "(use the default 'forkserver', or 'spawn')"
            )

    def _start(self, module, argv, env, log, cwd, fd) -> int:
        pid = os.fork()
        if pid == 0:
            _child_main(module, [str(fd), *argv] if fd else argv, env, log, cwd)
        self._track(pid)
        return pid


class ForkServerLauncher(Launcher):
    """Workers are forked by a helper that has imported torch (never CUDA) once."""

    def __init__(self) -> None:
        super().__init__()
        ours, theirs = socket.socketpair()
        code = (
            "import sys; from nbddp.pool.launch import _serve_forks; _serve_forks(int(sys.argv[1]))"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._pending: list[dict] = []
        self._warm = False  # asked to import WARM
        msg = self._recv(timeout=120)
        if msg is None or "ready" not in msg:
            self.close()
            raise PoolStartError(f"the fork server did not start (exit code {self._proc.poll()})")

    def _recv(self, timeout: float | None) -> dict | None:
        if not self._conn.poll(timeout):
            return None
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _start(self, module, argv, env, log, cwd, fd) -> int:
        request = {
            "module": module,
            "argv": argv,
            "env": env,
            "log": log,
            "cwd": cwd,
            "fd": bool(fd),
        }
        self._conn.send(request)
        if fd:
            reduction.send_handle(self._conn, fd, self._proc.pid)
        while True:
            msg = self._recv(timeout=30)
            if msg is None:
                raise PoolStartError("the fork server stopped answering")
            if "pid" in msg:
                return msg["pid"]
            self._pending.append(msg)

    def warm(self) -> None:
        if not self._warm:
            self._warm = True
            self._conn.send({"warm": WARM})  # (no answer: the next fork waits for it)

    def sentinels(self) -> list:
        return [self._conn]

    def poll(self) -> None:
        msgs, self._pending = self._pending, []
        while self._conn.poll(0):
            msg = self._recv(0)
            if msg is None:
                break
            msgs.append(msg)
        for msg in msgs:
            if "exit" in msg:
                self.returncodes[msg["exit"]] = msg["code"]

    def close(self) -> None:
        self._conn.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _serve_forks(fd: int) -> None:
    """The fork server's loop: fork a worker per request, report each exit."""
    import torch  # noqa: F401  (the point: children start with torch imported)

    import nbddp.rank.worker  # noqa: F401

    try:  # every rank patches IPython's display (nbddp.rank.rich): import it once, here
        import IPython.core.display_functions
        import IPython.display  # noqa: F401
    except ImportError:
        pass

    conn = Connection(fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send({"ready": os.getpid()})
    while True:
        ready = wait([conn, wake_r])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _report_exits(conn)
        if conn in ready:
            try:
                req = conn.recv()
            except (EOFError, OSError):
                return  # the notebook is gone: the workers notice on their own
            if "warm" in req:
                _import(req["warm"])
                continue
            argv = req["argv"]
            fd = reduction.recv_handle(conn) if req["fd"] else None
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                conn.close()
                os.close(wake_r)
                os.close(wake_w)
                _child_main(
                    req["module"],
                    [str(fd), *argv] if fd else argv,
                    req["env"],
                    req["log"],
                    req["cwd"],
                )
            if fd is not None:
                os.close(fd)
            conn.send({"pid": pid})


def _import(modules) -> None:
    """Import ``modules`` (each a dotted name of :data:`WARM`), as far as they go."""
    for name in modules:
        if name in WARM:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _report_exits(conn: Connection) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            conn.send({"exit": pid, "code": _exitcode(status)})
        except OSError:  # the notebook is gone: the next read of the loop ends it
            return


_LAUNCHERS = {"forkserver": ForkServerLauncher, "spawn": SpawnLauncher, "fork": ForkLauncher}


def make_launcher(method: str) -> Launcher:
    try:
        return _LAUNCHERS[method]()
    except KeyError:
        raise ValueError(
            f"unknown start method {method!r} (choose from {', '.join(START_METHODS)})"
        ) from None
