"""One rank: ``python -m nbddp.worker --connect ADDRESS [--token-file F]``.

However it was launched (by a pool on this machine, or by torchrun elsewhere),
a worker connects back to the notebook, joins the process group, and runs
cells in one namespace that lives until the worker ends. Its file descriptors
1 and 2 are sockets to the notebook, so everything it prints (Python or C++)
reaches the notebook even if the process dies the next instant.

Threads: the main thread runs cells; a receiver thread reads the control
connection, turning ``Interrupt`` into SIGINT for the main thread, answering
``Query`` and ``StackQuery`` (the main thread's stack, even while it is blocked
in C), aborting the process group under a blocked collective on
``AbortGroup``, and ending the process on ``Shutdown`` or when the notebook is
gone.
"""

from __future__ import annotations

import argparse
import ast
import bdb
import builtins
import contextlib
import ctypes
import dataclasses
import faulthandler
import io
import linecache
import os
import pdb
import queue
import shutil
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import types
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import psutil
import torch
import torch.distributed as dist

from . import debugger, payload, profiling, relay, rich
from . import protocol as P
from . import stacks as S
from .ddp import DDPContext, default_backend, differences, threads_for

__all__ = ["Worker", "main", "run_code"]

CELL_PREFIX = S.CELL_PREFIX
_libc = ctypes.CDLL(None)


# ---------------------------------------------------------------- pure helpers


def run_code(code: str, filename: str, namespace: dict) -> object:
    """Run ``code`` in ``namespace``; return the value of a final expression, else None."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:  # kept in the same code object, so pdb's `n` steps onto it
        store = ast.Assign([ast.Name(_LAST_VALUE, ast.Store())], last.value)
        tree.body[-1] = ast.fix_missing_locations(ast.copy_location(store, last))
    namespace.pop(_LAST_VALUE, None)
    exec(compile(tree, filename, "exec"), namespace)
    return namespace.pop(_LAST_VALUE, None)


_LAST_VALUE = "__nbddp_last_value__"
_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


def error_info(exc: BaseException, entry: str | None = None) -> P.ErrorInfo:
    """The exception as data, its traceback cut to the frames of the user's code.

    The user's code starts at a cell's frame, or at the script file ``entry``.
    """
    tb = exc.__traceback__

    def users(filename: str) -> bool:
        return filename.startswith(CELL_PREFIX) or filename == entry

    while tb is not None and not users(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    try:
        message = str(exc)
    except Exception as err:  # an exception whose __str__ fails still gets reported
        message = f"<str() of the exception failed: {type(err).__name__}: {err}>"
    if isinstance(exc, bdb.BdbQuit) and not message:
        message = "quit from the debugger"
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = f"{type(exc).__qualname__}: {message}\n"
    where = S.frames_of(None) if tb is None else _traceback_frames(tb)
    return P.ErrorInfo(
        type(exc).__qualname__, message, text, time.time(), S.collective(where) or ""
    )


def run_script(script: P.Script, namespace: dict) -> None:
    """Run a torchrun script as ``__main__`` in a module of its own, ``sys.argv`` set.

    ``sys.exit(0)`` (or ``None``) ends it as a success, as under torchrun. With
    ``keep``, its globals join ``namespace`` afterwards, even when it failed.
    """
    path = os.path.abspath(script.path)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    linecache.cache[path] = (len(script.source), None, script.source.splitlines(True), path)
    saved = sys.argv, sys.modules["__main__"], list(sys.path)
    sys.argv, sys.modules["__main__"] = [path, *script.argv], module
    sys.path.insert(0, os.path.dirname(path))  # as python does for a script
    try:
        exec(compile(script.source, path, "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.argv, sys.modules["__main__"], sys.path[:] = saved
        if script.keep:
            namespace.update((k, v) for k, v in module.__dict__.items() if not k.startswith("__"))


def _traceback_frames(tb: types.TracebackType) -> tuple[S.Frame, ...]:
    return tuple(
        (f.filename, f.lineno or 0, f.name, "") for f in traceback.extract_tb(tb, limit=50)
    )


def _open_sockets() -> dict[int, int]:
    """This process's socket fds, with their inodes."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(int(name))
            if stat.S_ISSOCK(st.st_mode):
                found[int(name)] = st.st_ino
    return found


def shut_down_sockets(sockets: dict[int, int], keep_port: int | None) -> int:
    """Shut down the connected sockets among ``sockets`` (fd -> inode) that are still those
    sockets; a collective blocked on one of them returns at once with an error.

    Connections to or from ``keep_port`` (the store) are left alone. Returns how many.
    """
    count = 0
    for fd, inode in sockets.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # closed since, and the number reused
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
            except (OSError, IndexError, TypeError):
                continue  # a listener, or not an internet socket
            if keep_port in ports:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


def adopt(obj: object, namespace: dict) -> object:
    """Make a function or class shipped from the notebook resolve its globals in ``namespace``.

    cloudpickle rebuilds notebook functions with a private globals dict; here
    they are rebuilt over the rank's namespace, so ``--imports`` and the
    rank's own state are visible to them. Names only the private dict holds
    are added to the namespace, never overwriting the rank's own.
    """
    if isinstance(obj, types.FunctionType) and obj.__globals__ is not namespace:
        for name, value in obj.__globals__.items():
            if not name.startswith("__"):
                namespace.setdefault(name, value)
        fn = types.FunctionType(
            obj.__code__, namespace, obj.__name__, obj.__defaults__, obj.__closure__
        )
        fn.__kwdefaults__ = obj.__kwdefaults__
        fn.__dict__.update(obj.__dict__)
        fn.__qualname__, fn.__doc__ = obj.__qualname__, obj.__doc__
        fn.__module__, fn.__annotations__ = obj.__module__, obj.__annotations__
        return fn
    if isinstance(obj, type) and obj.__module__ == "__main__":
        for name, member in list(vars(obj).items()):
            if isinstance(member, types.FunctionType):
                setattr(obj, name, adopt(member, namespace))
    return obj


def _open_figure_managers() -> list:
    if "matplotlib.pyplot" not in sys.modules:
        return []
    from matplotlib._pylab_helpers import Gcf

    return Gcf.get_all_fig_managers()


def _layout(ctx: DDPContext) -> dict:
    """``group`` and ``mesh`` for the namespace, when the pool was started with them."""
    bound = {}
    if ctx.group_spec:
        bound["group"] = ctx.group
    if ctx.mesh_spec:
        bound["mesh"] = ctx.mesh
    return bound


def _unwrap(value: object) -> object:
    """A model trained under DDP comes back as the plain module it wraps."""
    ddp = sys.modules.get("torch.nn.parallel")
    if ddp is not None and isinstance(value, ddp.DistributedDataParallel):
        return value.module
    return value


def parse_address(address: str) -> tuple[str | tuple[str, int], str]:
    """``/path/sock`` or ``unix:/path`` -> AF_UNIX; ``host:port`` -> AF_INET."""
    if address.startswith("unix:"):
        return address[5:], "AF_UNIX"
    if "/" in address:
        return address, "AF_UNIX"
    host, _, port = address.rpartition(":")
    return (host or "127.0.0.1", int(port)), "AF_INET"


def connect(address: str, token: bytes, timeout: float = 60.0) -> Connection:
    """Connect and authenticate, retrying until the listener is up or ``timeout`` passes."""
    addr, family = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(addr, family, authkey=token)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _LineWriter(io.TextIOWrapper):
    """stdout/stderr over a raw fd: flushed at every newline and every explicit flush."""

    def __init__(self, fd: int, name: str) -> None:
        raw = io.FileIO(fd, "w", closefd=False)
        super().__init__(
            io.BufferedWriter(raw),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )
        self.mode = "w"
        self._name = name

    @property
    def name(self) -> str:  # what print(sys.stdout) and loggers show
        return self._name


# ---------------------------------------------------------------- the worker


class CellInterrupts:
    """Which cell an interrupt is for, in whatever order Run, Interrupt and the cell's end
    come: the receiver thread calls :meth:`request`, the main thread :meth:`start` and
    :meth:`end`. An interrupt for a cell not started yet waits for it; one for a cell
    that has ended is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running: int | None = None  # the cell the main thread runs
        self.ended = 0  # the newest cell that has ended here
        self.pending: int | None = None  # an interrupt for a cell still to come

    def request(self, cell: int) -> bool:
        """True: the main thread runs ``cell`` now; interrupt it."""
        with self._lock:
            if cell == self.running:
                return True
            if cell > self.ended:
                self.pending = max(self.pending or 0, cell)
            return False

    def start(self, cell: int) -> bool:
        """The main thread starts ``cell``; True when it was interrupted already."""
        with self._lock:
            self.running = cell
            hit = self.pending == cell
            if self.pending is not None and self.pending <= cell:
                self.pending = None
            return hit

    def end(self, cell: int) -> None:
        with self._lock:
            self.running = None
            self.ended = max(self.ended, cell)


class Worker:
    """A rank's life: handshake, process group, then cells until told to stop."""

    def __init__(
        self, control: Connection, address: str, token: bytes, relayed: bool = False
    ) -> None:
        env = os.environ
        self.control = control
        self.relayed = relayed  # behind this host's relay (nbddp.relay): no end markers
        self.address, self.token = address, token
        self.rank = int(env.get("RANK", 0))
        self.world_size = int(env.get("WORLD_SIZE", 1))
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        self.needs_port = "MASTER_PORT" not in env
        self.inbox: queue.Queue = queue.Queue()
        self.send_lock = threading.Lock()
        self.running = False
        self.cell: int | None = None  # the cell the main thread runs
        self.interrupts = CellInterrupts()
        self.abort_cell: int | None = None  # the group was aborted during this cell
        self.group_sockets: dict[int, int] = {}  # the default group's sockets: fd -> inode
        self.joining = False  # nbddp itself is forming the group (the shims step aside)
        self.base_store: dist.Store | None = None  # the first group's store, kept for re-forms
        self.ctx: DDPContext | None = None
        self.main_ident = threading.get_ident()
        self.ship_dir: str | None = None  # where big values go back to the notebook
        self._reported_names: frozenset[str] = frozenset()
        self.shipped: dict[str, object] = {}  # name -> the object the notebook sent
        self.failed: types.TracebackType | None = None  # where the last failed cell raised
        self.failed_oom = False  # ... and it ran out of memory (its frames were let go)
        self.debug: debugger.Remote | None = None
        self.backend = ""
        self.device = "cpu"
        self.namespace: dict = {}

    # -- messaging

    def send(self, msg: object) -> None:
        data = P.dumps(msg)
        with self.send_lock:
            self.control.send_bytes(data)

    def _receive_loop(self) -> None:
        try:
            self._receive()
        except BaseException:
            traceback.print_exc()
            self._exit(1)

    def _receive(self) -> None:
        while True:
            try:
                msg = P.loads(self.control.recv_bytes())
            except (EOFError, OSError):
                self._exit(1)  # the notebook went away
            if isinstance(msg, P.Interrupt):
                if self.interrupts.request(msg.cell):
                    os.kill(os.getpid(), signal.SIGINT)
            elif isinstance(msg, P.DebugInput):
                self.debug.answer(msg)
            elif isinstance(msg, P.Query):
                self.send(P.StatusReply(psutil.Process().memory_info().rss, self.device))
            elif isinstance(msg, P.StackQuery):
                frames = S.main_thread_frames(self.main_ident) if self.running else ()
                self.send(P.Stacks(frames, self.cell if self.running else None))
            elif isinstance(msg, P.Shutdown):
                self._exit(0)
            elif isinstance(msg, P.AbortGroup) and self.running and msg.cell == self.cell:
                self.abort_cell = msg.cell  # and again when the cell ends: the cascade
                self._abort_running()
            elif isinstance(msg, P.AbortGroup) and self.running:
                pass  # for a cell that has ended here already
            else:
                self.inbox.put(msg)

    def _abort_running(self) -> None:
        """Free the main thread from a collective, from the receiver thread.

        NCCL's abort is made for this. gloo's ``abort()`` does not wake a thread
        blocked in a collective, but shutting down the group's own sockets does,
        at once, for this rank and the peers it talks to.
        """
        if self.backend == "nccl":
            self._abort_group()
        else:
            shut_down_sockets(dict(self.group_sockets), _store_port())

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        if self.running:
            raise KeyboardInterrupt

    def _exit(self, code: int) -> None:
        """End now, from any thread, with every process this rank started."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            _libc.fflush(None)
        except Exception:
            pass
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        if self.ship_dir is not None and not os.environ.get("NBDDP_SHM_DIR"):
            shutil.rmtree(self.ship_dir, ignore_errors=True)
        os._exit(code)

    # -- start

    def _hello(self) -> None:
        self.send(
            P.Hello(
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                pid=os.getpid(),
                host=socket.gethostname(),
                needs_port=self.needs_port,
            )
        )

    def _connect_streams(self) -> None:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            conn = connect(self.address, self.token, timeout=10)
            conn.send_bytes(P.dumps(P.StreamHello(self.rank, os.getpid(), stream)))
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(conn.fileno(), fd)
            conn.close()
        sys.stdout = _LineWriter(1, "<stdout>")
        sys.stderr = _LineWriter(2, "<stderr>")

    def _join_group(self, fresh: bool = False, generation: int | None = None) -> DDPContext:
        """Join the default group; ``fresh``: on a new store even under torchrun.

        With ``generation`` (a re-form the pool asked for), the group is formed under
        that prefix in the store the first group used: no new connection, so no
        reverse DNS lookup (torch does one per store connection, and a lost DNS
        reply costs 5 s). The sockets the group opens are remembered, so that a
        collective blocked on them can be freed from another thread
        (:meth:`_abort_running`).
        """
        before = _open_sockets()
        ctx = self._init_group(fresh, generation)
        self.group_sockets = {
            fd: ino for fd, ino in _open_sockets().items() if before.get(fd) != ino
        }
        return ctx

    def _init_group(self, fresh: bool, generation: int | None) -> DDPContext:
        self.joining = True
        try:
            return self._form_group(fresh, generation)
        finally:
            self.joining = False

    def _form_group(self, fresh: bool, generation: int | None) -> DDPContext:
        dist.set_debug_level_from_env()  # torch read it when the fork server imported it
        addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = None
        if generation is not None and self.base_store is not None:
            store = dist.PrefixStore(f"nbddp-reform-{generation}", self.base_store)
        elif self.needs_port or fresh:
            if self.rank == 0:
                # bound here, on MASTER_ADDR only: TCPStore alone would listen on every
                # interface. The store owns the socket from now on (and closes it).
                listening = socket.create_server((addr, 0), backlog=1024)
                port = listening.getsockname()[1]
                store = dist.TCPStore(
                    addr,
                    port,
                    self.world_size,
                    True,
                    wait_for_workers=False,
                    master_listen_fd=listening.detach(),
                )
                self.send(P.StorePort(store.port))
            else:
                msg = self.inbox.get()
                assert isinstance(msg, P.JoinGroup), msg
                store = dist.TCPStore(addr, msg.port, self.world_size, False)
            os.environ["MASTER_PORT"] = str(store.port)
        env = os.environ
        timeout, seed = env.get("NBDDP_PG_TIMEOUT"), env.get("NBDDP_SEED")
        ctx = DDPContext(
            env.get("NBDDP_BACKEND") or default_backend(env.get("NBDDP_DEVICE")),
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=float(timeout) if timeout else None,
            device=env.get("NBDDP_DEVICE"),
            seed=int(seed) if seed and not fresh else None,  # seeded at start, not re-forms
            groups=env.get("NBDDP_GROUPS"),
            mesh=env.get("NBDDP_MESH"),
        )
        ctx.__enter__()
        self.ctx = ctx
        if self.base_store is None:
            self.base_store = store if store is not None else _default_store()
        self.backend, self.device = ctx.backend, str(ctx.device)
        if ctx.device.type == "cpu":  # as `accelerate launch --cpu` says: CPU ranks, not one
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        if self.namespace:  # a re-form: the new group's subgroups and mesh replace the old
            self.namespace.update(_layout(ctx))
        return ctx

    # -- torchrun scripts, unchanged

    def _install_shims(self) -> None:
        """``init_process_group`` as a torchrun script expects it.

        With the pool's group up, a compatible call goes on with it and an
        incompatible one says what differs; after the script destroyed the group
        (``destroy_process_group``), it is formed again, through the notebook, on a
        new store. A cell that ends with the group destroyed gets
        it re-formed by the pool (``Done.needs_group``).
        """
        c10d = dist.distributed_c10d
        real_init = c10d.init_process_group

        def init_process_group(
            backend=None,
            init_method=None,
            timeout=None,
            world_size=-1,
            rank=-1,
            store=None,
            group_name="",
            pg_options=None,
            device_id=None,
            **kwargs,
        ):
            if self.joining:
                return real_init(
                    backend,
                    init_method,
                    timeout,
                    world_size,
                    rank,
                    store,
                    group_name,
                    pg_options,
                    device_id,
                    **kwargs,
                )
            if not dist.is_initialized():
                self._join_group(fresh=True)
                return None
            ctx = self.ctx
            found = differences(
                ctx.backend,
                ctx.world_size,
                ctx.rank,
                ctx.device,
                backend,
                world_size,
                rank,
                device_id,
            )
            if found:
                raise ValueError(
                    "init_process_group: this rank is already in the pool's process group, "
                    f"and the call asks for {'; '.join(found)} (restart the pool to match: "
                    "%ddp start ...)"
                )
            return None

        real_destroy = c10d.destroy_process_group

        def destroy_process_group(group=None):
            # gloo's worker threads drop finished work under the GIL; a group freed later
            # (with its DDP model) joins them while holding the GIL, and would wait forever
            # for one still dropping work (torch; under torchrun the process exits instead).
            time.sleep(0.05)  # releases the GIL: they finish now
            return real_destroy(group)

        init_process_group.__doc__ = real_init.__doc__
        destroy_process_group.__doc__ = real_destroy.__doc__
        for module in (dist, c10d):
            module.init_process_group = init_process_group
            module.destroy_process_group = destroy_process_group

        # Subgroups a cell makes (new_group, init_device_mesh) open sockets of their
        # own: remembered too, so an abort frees a collective blocked on them.
        real_helper = c10d._new_process_group_helper

        def _new_process_group_helper(*args, **kwargs):
            before = _open_sockets()
            try:
                return real_helper(*args, **kwargs)
            finally:
                self.group_sockets.update(
                    (fd, ino) for fd, ino in _open_sockets().items() if before.get(fd) != ino
                )

        c10d._new_process_group_helper = _new_process_group_helper

    def _abort_group(self) -> None:
        """Abort the default group: peers blocked in a collective with this rank are freed."""
        try:
            if dist.is_initialized():
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                abort() if abort is not None else dist.destroy_process_group()
        except Exception:
            traceback.print_exc()

    def _reform(self, generation: int) -> None:
        """A new default group; the namespace (and its stale objects) stays."""
        self._abort_group()
        try:
            self._join_group(fresh=True, generation=generation)
        except BaseException as exc:
            self.send(P.Fatal(error_info(exc)))
            self._exit(1)
        self.send(P.Ready(self.backend, self.device, self._changed_names() or ()))

    def _make_namespace(self, ctx: DDPContext) -> None:
        """The rank's persistent namespace: it is ``__main__``, so pickle finds cell classes."""
        main = types.ModuleType("__main__")
        main.__dict__.update(
            __builtins__=builtins,
            display=rich.display,
            torch=torch,
            rank=ctx.rank,
            local_rank=ctx.local_rank,
            world_size=ctx.world_size,
            device=ctx.device,
            **_layout(ctx),
        )
        sys.modules["__main__"] = main
        self.namespace = main.__dict__

    # -- cells

    def _run(self, msg: P.Run) -> None:
        filename = f"{CELL_PREFIX}cell-{msg.cell}>"
        status, value, error, profile = "ok", None, None, None
        rich.set_displaying(msg.display)
        self.cell, self.running = msg.cell, True
        try:
            if self.interrupts.start(msg.cell):  # it came before the cell did
                raise KeyboardInterrupt
            if msg.imports:
                run_code(msg.imports, f"{CELL_PREFIX}imports>", self.namespace)
            if msg.needs:
                self._bind(payload.loads(msg.needs), overwrite=True)
            if msg.auto:
                self._bind(payload.loads(msg.auto), overwrite=False)
            if msg.post_mortem:
                self._post_mortem()
            elif msg.script is not None:
                run_script(msg.script, self.namespace)
            elif msg.profile:
                value, profile = profiling.profiled(
                    msg.profile, lambda: run_code(msg.code, filename, self.namespace)
                )
            else:
                value = run_code(msg.code, filename, self.namespace)
        except KeyboardInterrupt:
            status = "interrupted"
        except BaseException as exc:  # SystemExit too: as in IPython, the process stays
            status, error = (
                "error",
                error_info(exc, msg.script and os.path.abspath(msg.script.path)),
            )
            if not msg.post_mortem:  # kept for %ddp debug, frames and all; not after running
                # out of memory: those frames hold what filled it, and the next cell needs it
                self.failed = None if isinstance(exc, _OUT_OF_MEMORY) else exc.__traceback__
                self.failed_oom = self.failed is None
        finally:
            self.running = False
            self.interrupts.end(msg.cell)
        if self.abort_cell == msg.cell:  # freed from a collective, or done meanwhile:
            self._abort_group()  # close this rank's side too, so peers it talks to are freed
        self._show(value if status == "ok" else None)
        self._end_streams(msg.cell)
        done = self._done(msg, status, value, error)
        freed = self.abort_cell == msg.cell
        lost = not dist.is_initialized()  # the cell destroyed it: the pool forms a new one
        done = dataclasses.replace(done, freed=freed, needs_group=lost, profile=profile)
        self.send(dataclasses.replace(done, names=self._changed_names()))

    def _post_mortem(self) -> None:
        """pdb in the frame where this rank's last failed cell raised (``%ddp debug``)."""
        tb = self.failed
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
            tb = tb.tb_next  # from the cell's own frame, as its traceback shows it
        if tb is None and self.failed_oom:
            raise LookupError(
                f"rank {self.rank}'s last failed cell ran out of memory: its frames were let "
                "go to free it, so there is nothing to debug"
            )
        if tb is None:
            raise LookupError(f"rank {self.rank} has no failed cell to debug")
        pdb.post_mortem(tb)

    def _changed_names(self) -> tuple[str, ...] | None:
        """The rank's own names (not those still bound to notebook objects), if changed."""
        for name in [n for n in self.shipped if not self._from_notebook(n)]:
            del self.shipped[name]  # the rank rebound it: it is the rank's own now
        names = frozenset(
            k for k in self.namespace if not k.startswith("__") and k not in self.shipped
        )
        if names == self._reported_names and names:
            return None
        self._reported_names = names
        return tuple(sorted(names))

    def _show(self, value: object) -> None:
        """Like IPython's inline backend: a rich last value, then open figures, are shown."""
        try:
            bundle = rich.rich_bundle(value) if value is not None else None
            if bundle is not None and rich._displaying:
                figures = [m.canvas.figure for m in _open_figure_managers()]
                if value not in figures:
                    self.send(P.Display(*bundle))
            rich.show_figures()
        except Exception:
            traceback.print_exc()

    def _bind(self, objects: dict, overwrite: bool) -> None:
        """Bind shipped objects; automatic capture never overwrites the rank's own.

        A name still bound to what the notebook shipped is the notebook's, not
        the rank's: a newer version from the notebook replaces it.
        """
        for name, obj in objects.items():
            if overwrite or name not in self.namespace or self._from_notebook(name):
                self.namespace[name] = self.shipped[name] = adopt(obj, self.namespace)

    def _from_notebook(self, name: str) -> bool:
        return name in self.shipped and self.namespace.get(name) is self.shipped[name]

    def _done(self, msg: P.Run, status: str, value: object, error: P.ErrorInfo | None) -> P.Done:
        if status != "ok" or value is None:
            return P.Done(msg.cell, status, error=error)
        try:
            value_repr = repr(value)
        except Exception as exc:
            value_repr = f"<repr failed: {type(exc).__name__}: {exc}>"
        if len(value_repr) > 10_000:
            value_repr = value_repr[:10_000] + " ..."
        packed, files = None, ()
        if msg.want_value:
            try:
                shipment = payload.dumps(_unwrap(value), self._shm_dir() if msg.shm else None)
                packed, files = shipment.data, tuple(shipment.files)
            except Exception as exc:
                info = P.ErrorInfo(
                    "PicklingError",
                    f"the cell's value ({type(value).__name__}) cannot be pickled: {exc}",
                    f"PicklingError: the cell's value ({type(value).__name__}) "
                    f"cannot be pickled: {exc}\n",
                )
                return P.Done(msg.cell, "error", error=info)
        return P.Done(msg.cell, "ok", packed, value_repr, files=files)

    def _shm_dir(self) -> str:
        """The pool's shared-memory directory (the notebook removes it), else one of ours."""
        if self.ship_dir is None:
            pool_dir = os.environ.get("NBDDP_SHM_DIR")
            self.ship_dir = payload.private_dir(pool_dir) if pool_dir else payload.shm_dir()
        return self.ship_dir

    def _end_streams(self, cell: int) -> None:
        """Flush Python and C buffers, then mark the end of this cell in both streams."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _libc.fflush(None)
        if self.relayed:  # the relay has all it wrote when Done comes (Unix sockets)
            return
        marker = P.end_marker(cell)
        os.write(1, marker)
        os.write(2, marker)

    def _apply_threads(self) -> None:
        """Intra-op threads as torchrun sets them (torch was imported before the env var)."""
        n = threads_for(
            self.local_world_size,
            os.environ.get("NBDDP_THREADS"),
            os.environ.get("OMP_NUM_THREADS"),
        )
        if n is not None:
            os.environ["OMP_NUM_THREADS"] = str(n)
            torch.set_num_threads(n)

    def serve(self) -> int:
        self.main_ident = threading.get_ident()
        self._apply_threads()
        self._install_shims()
        signal.signal(signal.SIGINT, self._on_sigint)
        rich.attach(self.send)
        self.debug = debugger.install(self.send, self.rank)
        self._hello()
        threading.Thread(target=self._receive_loop, name="nbddp-receiver", daemon=True).start()
        self._connect_streams()
        faulthandler.enable()  # a crash prints the Python stack to the notebook before dying
        try:
            self._make_namespace(self._join_group())
        except BaseException as exc:
            self.send(P.Fatal(error_info(exc)))
            self._exit(1)
        self.send(P.Ready(self.backend, self.device, self._changed_names() or ()))
        while True:
            msg = self.inbox.get()
            if isinstance(msg, P.Run):
                self._run(msg)
            elif isinstance(msg, P.AbortGroup):
                self.abort_cell = msg.cell
                self._abort_group()
            elif isinstance(msg, P.Reform):
                self._reform(msg.generation)


# ---------------------------------------------------------------- entry point


def _default_store() -> dist.Store | None:
    """The store the default group was formed on (torch keeps it; no public accessor)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _store_port() -> int | None:
    port = os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


def _read_token(path: str | None) -> bytes:
    if path:
        try:
            with open(os.path.expanduser(path), "rb") as f:
                token = f.read().strip()
        except OSError as exc:
            msg = f"nbddp.worker: cannot read the token file {path}: {exc.strerror}"
            raise SystemExit(msg) from None
        if not token:
            raise SystemExit(f"nbddp.worker: the token file {path} is empty")
        return token
    token = os.environ.pop("NBDDP_TOKEN", "")
    if not token:
        raise SystemExit("nbddp.worker: no token: pass --token-file or set NBDDP_TOKEN")
    return token.encode()


def _extend_sys_path() -> None:
    """Whatever the notebook can import, its ranks can import too (local pools)."""
    for path in reversed(os.environ.get("NBDDP_SYS_PATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(1, path)


def _through_relay(address: str, token: bytes) -> str:
    """The address of this host's relay; local rank 0 starts it (see nbddp.relay)."""
    path = relay.socket_path(address, token, os.environ)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        relay.start(path, parse_address(address), token)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbddp.worker", description=__doc__)
    parser.add_argument(
        "--connect", required=True, help="the notebook's listener: PATH or HOST:PORT"
    )
    parser.add_argument("--token-file", help="file holding the pool's token (else $NBDDP_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    sys.argv = [sys.argv[0]]  # a cell calling a script's main() parses no worker options
    _extend_sys_path()
    token = _read_token(args.token_file)
    address = args.connect
    where = f"the notebook at {args.connect}"
    if relay.wanted(parse_address(address)[1] == "AF_INET", os.environ):
        where = f"this host's relay to {args.connect}"
        try:
            address = _through_relay(address, token)
        except OSError as exc:
            print(f"nbddp.worker: cannot start {where}: {exc}", file=sys.stderr)
            return 2
    try:
        control = connect(address, token, args.connect_timeout)
    except AuthenticationError:
        print(
            f"nbddp.worker: {where} refused this worker's token (is --token-file the notebook's?)",
            file=sys.stderr,
        )
        return 3
    except (OSError, EOFError) as exc:
        print(f"nbddp.worker: cannot reach {where}: {exc}", file=sys.stderr)
        return 2
    return Worker(control, address, token, relayed=address != args.connect).serve()


if __name__ == "__main__":
    sys.exit(main())
