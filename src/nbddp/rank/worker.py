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

The parts: :mod:`~nbddp.rank.control` (the control channel and the streams),
:mod:`~nbddp.rank.group` and :mod:`~nbddp.rank.shims` (the process group),
:mod:`~nbddp.rank.cell` and :mod:`~nbddp.rank.user_code` (cells). This module
puts them together (:class:`Worker`) and is the entry point (:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import shutil
import signal
import socket
import sys
import threading
import traceback

import psutil
import torch

from ..hosts import holder, relay
from ..wire import frames, handshake
from ..wire import protocol as P
from ..wire.private import UnsafeFile, read_token_file
from ..wire.tls import Tls
from . import debugger, metrics, rich, seq, shims
from .cell import CellRunner
from .control import Control, connect, connect_streams, flush_streams, parse_address
from .ddp import threads_for
from .group import GroupKeeper
from .interrupts import CellInterrupts
from .rebind import Rebound
from .user_code import adopt, error_info, run_code

# s a rank taking a dead one's place tries to connect (its notebook may be gone); a test
# that waits for it to give up shortens it (NBDDP_RENEWED_CONNECT, seconds)
RENEWED_CONNECT = float(os.environ.get("NBDDP_RENEWED_CONNECT") or 10.0)

# Worker and main, and (from the parts) what tests and older callers import from here
__all__ = ["CellInterrupts", "Worker", "adopt", "error_info", "main", "parse_address", "run_code"]


class Worker:
    """A rank's life: handshake, process group, then cells until told to stop."""

    def __init__(
        self,
        control: frames.Channel,
        address: str,
        token: bytes,
        relayed: bool = False,
        tls: Tls | None = None,
    ) -> None:
        env = os.environ
        self.address, self.token, self.tls = address, token, tls
        self.rank = int(env.get("RANK", 0))
        self.world_size = int(env.get("WORLD_SIZE", 1))
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        self.control = Control(control, self._exit)
        self.send = self.control.send
        self.group = GroupKeeper(self.rank, self.world_size, self.send, self.control.inbox)
        self.group.salt = token
        self.cells = CellRunner(self.rank, self.send, self.group, relayed)
        self.debug: debugger.Remote | None = None
        # the user's own, kept for a resize and for %ddp start --threads (ddp.set_threads)
        env.setdefault("NBDDP_USER_OMP", env.get("OMP_NUM_THREADS") or "")
        self.launcher_stderr = os.dup(2)  # (torchrun's log: fd 2 goes to the notebook)

    def serve(self, renewed: bool = False) -> int:
        """``renewed``: this process takes a dead rank's place (its holder forked it: see
        nbddp.hosts.holder); it joins the group the notebook re-forms with it."""
        self._start()
        generation = int(os.environ.get("NBDDP_GENERATION") or 0)
        try:
            if renewed or os.environ.get("NBDDP_HELD") == "1":
                # a held rank joins the group the notebook says: the first (Reform 0),
                # or, a new host's in a running pool, the re-form that takes it in
                generation = self._await_reform()
            self.cells.make_namespace(self.group.join(generation=generation or None))
        except BaseException as exc:
            self.send(P.Fatal(error_info(exc)))
            self._exit(1)
        self._ready(generation)
        holder.taken_in()  # (its holder, if any, counts the new ranks never taken in)
        work = {
            P.Run: self.cells.run,
            P.AbortGroup: self.cells.abort_between_cells,
            P.Reform: self._reform,
        }
        while True:
            msg = self.control.inbox.get()
            if type(msg) in work:
                self._survive_interrupts(work[type(msg)], msg)

    def _await_reform(self) -> int:
        """The re-form the notebook takes this new rank into: its generation (a Reform
        not sent to it as a new process was meant for the dead one: a relay's)."""
        while True:
            msg = self.control.inbox.get()
            if isinstance(msg, P.Reform) and msg.new:
                if msg.backend:
                    os.environ["NBDDP_BACKEND"] = msg.backend
                return msg.generation

    @staticmethod
    def _survive_interrupts(handle, msg: object) -> None:
        """SIGINT interrupts only the user's code (:meth:`CellRunner.on_sigint`); should a
        KeyboardInterrupt get out anyway, the rank goes on: it would die with its state."""
        try:
            handle(msg)
        except KeyboardInterrupt:
            traceback.print_exc()

    def _start(self) -> None:
        """Everything before the group: threads, shims, handlers, the handshake, streams."""
        self.cells.main_ident = threading.get_ident()
        self._apply_threads()
        shims.install(self.group)
        seq.install()
        signal.signal(signal.SIGINT, self.cells.on_sigint)
        rich.attach(self.send)
        metrics.attach(self.send)
        self.debug = debugger.install(self.send, self.rank)
        self._hello()
        self.control.handle(self._handlers())
        self.control.start()
        connect_streams(self.address, self.token, self.rank, self.tls)
        faulthandler.enable()  # a crash prints the Python stack to the notebook before dying

    def _handlers(self) -> dict:
        """What the receiver thread does itself; the rest waits for the main thread."""
        cells = self.cells
        return {
            P.Interrupt: cells.on_interrupt,
            P.DebugInput: self.debug.answer,
            P.Query: self._status,
            P.StackQuery: cells.on_stack_query,
            P.Shutdown: lambda _msg: self._exit(0),
            P.Refused: self._refused,
            P.AbortGroup: lambda msg: cells.on_abort_group(msg, self.control.inbox.put),
        }

    def _refused(self, msg: P.Refused) -> None:
        """The notebook does not take this rank (a worker torchrun restarted): said in one
        line where its launcher logs, and the rank ends (4)."""
        line = f"nbddp.worker: rank {self.rank}: the notebook refused this worker: {msg.reason}\n"
        with contextlib.suppress(OSError):
            os.write(self.launcher_stderr, line.encode())
        self._exit(4)

    def _status(self, _msg: P.Query) -> None:
        self.send(P.StatusReply(psutil.Process().memory_info().rss, self.group.device))

    def _reform(self, msg: P.Reform) -> None:
        """A new default group; the namespace (and its stale objects) stays, also when the
        re-form fails (the pool then tries the next one, or stops the pool). A resized
        pool's re-form says its new size."""
        if msg.world_size and msg.world_size != self.world_size:
            self._resize(msg.world_size)
        if msg.backend:  # the notebook's choice at this size (gpus.pool_plan)
            os.environ["NBDDP_BACKEND"] = msg.backend
        try:
            rebound = self.group.reform(msg.generation)
        except Exception as exc:
            self.send(P.ReformFailed(msg.generation, error_info(exc)))
            return
        self._ready(msg.generation, rebound)

    def _resize(self, n: int) -> None:
        """The pool now has ``n`` ranks (all on this host: a resize is for local pools):
        what torchrun would have set for ``n``, in the env, the namespace and the group."""
        self.world_size = self.local_world_size = self.group.world_size = n
        os.environ.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
        self.cells.namespace["world_size"] = n
        self._apply_threads()

    def _ready(self, generation: int, rebound: Rebound | None = None) -> None:
        named = self.cells.changed_names()
        names, modules = named["names"] or (), named["modules"] or ()
        held = self.cells.reported_held or ()  # (changed_names just set it)
        self.send(
            P.Ready(
                self.group.backend,
                self.group.device,
                names,
                generation,
                modules,
                held,
                rebound=tuple(rebound.names) if rebound else (),
                stale=tuple(rebound.stale) if rebound else (),
                weights=tuple(rebound.weights) if rebound else (),
            )
        )

    def _hello(self) -> None:
        self.send(
            P.Hello(
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                pid=os.getpid(),
                host=socket.gethostname(),
                needs_port=self.group.needs_port,
                held=os.environ.get("NBDDP_HELD") == "1",
                slurm=P.slurm_of(os.environ),
            )
        )

    def _apply_threads(self) -> None:
        """Intra-op threads as torchrun sets them (torch was imported before the env var)."""
        env = os.environ
        n = threads_for(self.local_world_size, env.get("NBDDP_THREADS"), env.get("NBDDP_USER_OMP"))
        if n is not None:
            os.environ["OMP_NUM_THREADS"] = str(n)
            torch.set_num_threads(n)

    def _exit(self, code: int) -> None:
        """End now, from any thread, with every process this rank started."""
        with contextlib.suppress(Exception):
            flush_streams()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        ship_dir = self.cells.ship_dir
        if ship_dir is not None and not os.environ.get("NBDDP_SHM_DIR"):
            shutil.rmtree(ship_dir, ignore_errors=True)
        os._exit(code)


# ---------------------------------------------------------------- entry point


def _read_token(path: str | None, address: str = "") -> tuple[bytes, Tls | None]:
    """The token, and TLS pinned to the notebook's certificate when the file names one
    (the pin of the pool listening on ``address``'s port, if the file has it)."""
    if path:
        try:
            held = read_token_file(path)
        except UnsafeFile as exc:
            raise SystemExit(f"nbddp.worker: {exc}") from None
        except OSError as exc:
            msg = f"nbddp.worker: cannot read the token file {path}: {exc.strerror}"
            raise SystemExit(msg) from None
        if not held.token:
            raise SystemExit(f"nbddp.worker: the token file {path} is empty")
        port = address.rsplit(":", 1)[-1]
        pin = held.pin_for(int(port) if port.isdigit() else None)
        return held.token, Tls(pin=pin) if pin else None
    token = os.environ.pop("NBDDP_TOKEN", "")
    if not token:
        raise SystemExit("nbddp.worker: no token: pass --token-file or set NBDDP_TOKEN")
    return token.encode(), None


def _extend_sys_path() -> None:
    """Whatever the notebook can import, its ranks can import too (local pools)."""
    for path in reversed(os.environ.get("NBDDP_SYS_PATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(1, path)


def _through_relay(address: str, token: bytes, tls: Tls | None) -> str:
    """The address of this host's relay; local rank 0 starts it (see nbddp.hosts.relay)."""
    path = relay.socket_path(address, token, os.environ)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        relay.start(path, parse_address(address), token, tls=tls)
    return path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nbddp.worker", description=__doc__)
    parser.add_argument(
        "--connect", required=True, help="the notebook's listener: PATH or HOST:PORT"
    )
    parser.add_argument("--token-file", help="file holding the pool's token (else $NBDDP_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sys.argv = [sys.argv[0]]  # a cell calling a script's main() parses no worker options
    _extend_sys_path()
    token, tls = args.token, args.tls = _read_token(args.token_file, args.connect)
    address = args.connect
    where = f"the notebook at {args.connect}"
    tcp = parse_address(address)[1] == "AF_INET"
    if relay.wanted(tcp, os.environ):
        where = f"this host's relay to {args.connect}"
        try:
            address = _through_relay(address, token, tls)
        except OSError as exc:
            print(f"nbddp.worker: cannot start {where}: {exc}", file=sys.stderr)
            return 2
    if holder.wanted(tcp, os.environ):  # under torchrun: a dead rank is replaced
        os.environ["NBDDP_HELD"] = "1"
        return holder.hold(lambda renewed: _rank(args, address, where, renewed))
    return _rank(args, address, where, False)


def _rank(args: argparse.Namespace, address: str, where: str, renewed: bool) -> int:
    """Connect (a renewed rank: briefly, its notebook may be gone) and serve."""
    token, tls = args.token, args.tls
    timeout = min(args.connect_timeout, RENEWED_CONNECT) if renewed else args.connect_timeout
    try:
        control = connect(address, token, timeout, tls)
    except handshake.Refused:
        print(
            f"nbddp.worker: {where} refused this worker's token (is --token-file the notebook's?)",
            file=sys.stderr,
        )
        return 3
    except (OSError, EOFError) as exc:
        gone = (  # (its rank ended with the notebook's connection, most likely: said so)
            f": the pool rank {os.environ.get('RANK', '?')} served is gone (the notebook's "
            "kernel ended, or its connection dropped); its state is lost, and this worker ends"
            if renewed
            else ""
        )
        print(f"nbddp.worker: cannot reach {where}: {exc}{gone}", file=sys.stderr)
        return 2
    relayed = address != args.connect
    return Worker(control, address, token, relayed, None if relayed else tls).serve(renewed)


if __name__ == "__main__":
    sys.exit(main())
