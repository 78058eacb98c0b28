"""A rank's process group: join, form again, abort, and free a blocked collective.

:class:`GroupKeeper` forms the default group through the notebook (rank 0 opens
the store and says its port; the others are told it), forms it again on a
re-form under a new prefix of the same store, and aborts it. Two threads may
abort at once (the receiver on ``AbortGroup``, the main thread at a cell's end
or a re-form): a lock makes the group aborted once. The sockets a group opens
are remembered, so a collective blocked on them can be freed from the receiver
thread (:meth:`GroupKeeper.free_blocked`).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import queue
import socket
import stat
import threading
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist

from ..wire import protocol as P
from .ddp import DDPContext
from .rebind import Rebound, rebind
from .seq import positions

__all__ = ["GroupKeeper", "layout", "open_sockets", "shut_down_sockets"]


def open_sockets() -> dict[int, int]:
    """This process's socket fds, with their inodes."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(int(name))
            if stat.S_ISSOCK(st.st_mode):
                found[int(name)] = st.st_ino
    return found


def shut_down_sockets(
    sockets: dict[int, int], keep_port: int | None, only_port: int | None = None
) -> int:
    """Shut down the connected sockets among ``sockets`` (fd -> inode) that are still those
    sockets; a collective blocked on one of them returns at once with an error.

    Connections to or from ``keep_port`` (the store) are left alone; with ``only_port``,
    only connections to or from it are shut down. Returns how many.
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
            count += _shut_down(sock, keep_port, only_port)
    return count


def _shut_down(sock: socket.socket, keep_port: int | None, only_port: int | None) -> int:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return 0  # the notebook's connections (a Unix socket) are not the group's
    try:
        ports = {sock.getsockname()[1], sock.getpeername()[1]}
    except (OSError, IndexError, TypeError):
        return 0  # a listener
    if keep_port in ports or (only_port is not None and only_port not in ports):
        return 0
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return 0
    return 1


def layout(ctx: DDPContext) -> dict:
    """``group`` and ``mesh`` for the namespace, when the pool was started with them."""
    bound = {}
    if ctx.group_spec:
        bound["group"] = ctx.group
    if ctx.mesh_spec:
        bound["mesh"] = ctx.mesh
    return bound


def _default_store() -> dist.Store | None:
    """The store the default group was formed on (torch keeps it; no public accessor)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _store_port() -> int | None:
    port = os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


def _agent_store() -> bool:
    """torchrun's agent holds the group's store (no rank does), at MASTER_PORT."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and _store_port() is not None
        and not os.environ.get("NBDDP_STORE_PORT")
    )


JOIN_TIMEOUT = 300.0  # seconds a rank waits for the store's address (the pool's own is 120)
POSITIONS_WAIT = 1.0  # seconds a read of the positions waits for an abort, or another read


class GroupKeeper:
    """The default process group of one rank, and the sockets it opened."""

    def __init__(
        self, rank: int, world_size: int, send: Callable[[object], None], inbox: queue.Queue
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.salt = b""  # the pool's token: re-form prefixes no one without it can guess
        self.needs_port = "MASTER_PORT" not in os.environ
        self._send, self._inbox = send, inbox
        self.sockets: dict[int, int] = {}  # the default group's sockets: fd -> inode
        self.joining = False  # nbddp itself is forming the group (the shims step aside)
        self.base_store: dist.Store | None = None  # the first group's store, kept for re-forms
        self.agent_store: dist.Store | None = None  # torchrun's agent's, once a re-form needs it
        self.ctx: DDPContext | None = None
        self.backend = ""
        self.device = "cpu"
        self.namespace: dict = {}  # the rank's namespace: a re-form rebinds group and mesh
        self._before_join: dict[int, int] = {}  # the sockets open when the join began
        self._abort_lock = threading.Lock()  # one abort at a time: the second finds it done
        # the groups an abort ended (groups) that no re-form has bound anew yet
        self.old_groups: list = []

    def join(self, fresh: bool = False, generation: int | None = None) -> DDPContext:
        """Join the default group; ``fresh``: on a new store even under torchrun.

        With ``generation`` (a re-form the pool asked for), the group is formed under
        that prefix in the store the first group used: no new connection, so no
        reverse DNS lookup (torch does one per store connection, and a lost DNS
        reply costs 5 s). The sockets the group opens are remembered, so that a
        collective blocked on them can be freed from another thread
        (:meth:`free_blocked`).
        """
        before = self._before_join = open_sockets()
        self.joining = True
        try:
            ctx = self._form(fresh, generation)
        finally:
            self.joining = False
        self.sockets = {fd: ino for fd, ino in open_sockets().items() if before.get(fd) != ino}
        return ctx

    def reform(self, generation: int) -> Rebound:
        """A new default group; the namespace stays, its DDP models bound again to the new
        group (:func:`nbddp.rank.rebind.rebind`: what was, and what could not be).

        Should it fail (a peer died while the group formed, and the pool freed this
        rank, see :meth:`free_blocked`), the rank lives on without a group, and the
        next re-form connects to the store again.
        """
        self.abort()
        old = self.old_groups  # (kept should this join fail: the next re-form maps them)
        # what still uses the old group (an object nbddp cannot bind again) fails at once,
        # not waits for a peer that left it: its sockets go (the store's connection stays)
        shut_down_sockets(self.sockets, _store_port())
        try:
            self.join(fresh=True, generation=generation)
        except BaseException:
            self.abort()
            self.base_store = self.agent_store = None  # (its connection may be shut down)
            raise
        self.old_groups = []
        return rebind(self.namespace, dict(zip(old, self.groups(), strict=False)))

    def groups(self) -> list:
        """The default group, then the pool's own subgroups (``--groups``), of this rank:
        a re-form maps each old one to its new one, for :func:`nbddp.rank.rebind.rebind`."""
        groups = [dist.distributed_c10d._get_default_group()]  # (the caller saw it up)
        return groups + (list(self.ctx.groups) if self.ctx is not None else [])

    def positions(self) -> tuple:
        """This rank's place in each group's collectives (:func:`nbddp.rank.seq.positions`),
        or none while the group is formed or aborted: the backend's count is read with the
        GIL released, so never while a thread aborts the group. The main thread waits for
        another reader (a few microseconds) or an abort, up to POSITIONS_WAIT: the sampler
        thread's read must not make the cell's Done say nothing, which leaves the cell
        unjudged for being in step. The receiver thread never waits (a sample may say
        nothing; an interrupt behind it must not wait)."""
        main = threading.current_thread() is threading.main_thread()
        if self.joining or not self._abort_lock.acquire(timeout=POSITIONS_WAIT if main else 0):
            return ()
        try:
            return positions()
        finally:
            self._abort_lock.release()

    def abort(self) -> None:
        """Abort the default group, once however many threads ask at the same time:
        peers blocked in a collective with this rank are freed."""
        with self._abort_lock:
            try:
                if dist.is_initialized():
                    if not self.old_groups:  # (for the re-form to bind their objects anew)
                        with contextlib.suppress(Exception):
                            self.old_groups = self.groups()
                    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                    abort() if abort is not None else dist.destroy_process_group()
            except Exception:
                traceback.print_exc()

    def free_blocked(self) -> None:
        """Free the main thread from a collective, from the receiver thread.

        NCCL's abort is made for this. gloo's ``abort()`` does not wake a thread
        blocked in a collective, but shutting down the group's own sockets does,
        at once, for this rank and the peers it talks to. A group being formed
        (a re-form waiting for a peer that died) is freed the same way, with the
        connection to the store it waits on.
        """
        if self.joining:
            opened = {
                fd: ino for fd, ino in open_sockets().items() if self._before_join.get(fd) != ino
            }
            shut_down_sockets(opened, None)
            shut_down_sockets(open_sockets(), None, only_port=_store_port())
        elif self.backend == "nccl":
            self.abort()
        else:
            shut_down_sockets(dict(self.sockets), _store_port())

    def _form(self, fresh: bool, generation: int | None) -> DDPContext:
        dist.set_debug_level_from_env()  # torch read it when the fork server imported it
        if not dist.is_initialized():
            # the default group is named by a counter that destroying it resets; a join
            # that failed (a peer died) counted too: a new rank's group must be named the
            # same as the survivors' (else they wait under different names for ever)
            dist.distributed_c10d._world.group_count = 0
        store = self._store(fresh, generation)
        ctx = self._context(store, fresh)
        ctx.__enter__()
        self.ctx = ctx
        if self.base_store is None:
            self.base_store = store if store is not None else _default_store()
        self.backend, self.device = ctx.backend, str(ctx.device)
        if ctx.device.type == "cpu":  # as `accelerate launch --cpu` says: CPU ranks, not one
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        if self.namespace:  # a re-form: the new group's subgroups and mesh replace the old
            self.namespace.update(layout(ctx))
        return ctx

    def _store(self, fresh: bool, generation: int | None) -> dist.Store | None:
        addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        shared = os.environ.get("NBDDP_STORE_PORT", "")
        if shared and self.base_store is None and (generation is not None or not fresh):
            # a local pool's store, in a process of its own: the first join, a rank that
            # takes a dead one's place (in the re-form the pool says), or a re-form after
            # a failed one (its connection may have been shut down)
            self.base_store = dist.TCPStore(addr, int(shared), self.world_size, False)
            os.environ["MASTER_PORT"] = shared
            if generation is None:
                generation = int(os.environ.get("NBDDP_GENERATION") or 0) or None
            if generation is None:
                return self.base_store
        if generation is not None and _agent_store():
            # torchrun's agent holds the store (MASTER_PORT): it outlives any rank, so each
            # re-form, and a rank taking a dead one's place, meets there under its prefix
            if self.agent_store is None:
                port = _store_port()
                self.agent_store = dist.TCPStore(addr, port, self.world_size, False)
            return dist.PrefixStore(self._prefix(generation), self.agent_store)
        if generation is not None and self.base_store is not None:
            return dist.PrefixStore(self._prefix(generation), self.base_store)
        if not (self.needs_port or fresh):
            return None  # torchrun's MASTER_PORT: the env:// store
        if self.rank == 0:
            store = self._open_store(addr)
            self._send(P.StorePort(store.port))
        else:
            store = dist.TCPStore(addr, self._store_port(), self.world_size, False)
        os.environ["MASTER_PORT"] = str(store.port)
        return store

    def _prefix(self, generation: int) -> str:
        """Where re-form ``generation`` meets in the store. The store takes any local
        connection: a predictable prefix would let another user of the host write keys
        there first and make the re-form fail; this one is keyed by the pool's token."""
        tag = hmac.new(self.salt, f"reform-{generation}".encode(), "sha256").hexdigest()[:32]
        return f"nbddp-reform-{generation}-{tag}"

    def _store_port(self) -> int:
        """The port of rank 0's store, which the pool sends (``JoinGroup``), waited for
        until JOIN_TIMEOUT. Other messages that come meanwhile wait their turn."""
        deadline, early = time.monotonic() + JOIN_TIMEOUT, []
        try:
            while True:
                try:
                    msg = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"rank {self.rank} waited {JOIN_TIMEOUT:g} s for rank 0's store "
                        "address, which the pool did not send"
                    ) from None
                if isinstance(msg, P.JoinGroup):
                    return msg.port
                if isinstance(msg, P.AbortGroup):
                    raise RuntimeError("the pool gave up forming the group (AbortGroup)")
                early.append(msg)
        finally:
            with self._inbox.mutex:  # back at the front, in the order they came
                self._inbox.queue.extendleft(reversed(early))
                self._inbox.not_empty.notify(len(early))

    def _open_store(self, addr: str) -> dist.TCPStore:
        # bound here, on MASTER_ADDR only: TCPStore alone would listen on every
        # interface. The store owns the socket from now on (and closes it).
        listening = socket.create_server((addr, 0), backlog=1024)
        port = listening.getsockname()[1]
        return dist.TCPStore(
            addr,
            port,
            self.world_size,
            True,
            wait_for_workers=False,
            master_listen_fd=listening.detach(),
        )

    def _context(self, store: dist.Store | None, fresh: bool) -> DDPContext:
        env = os.environ
        timeout, seed = env.get("NBDDP_PG_TIMEOUT"), env.get("NBDDP_SEED")
        gpu = env.get("NBDDP_GPU")
        return DDPContext(  # backend and GPU as the notebook chose them (gpus.pool_plan)
            env.get("NBDDP_BACKEND") or None,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=float(timeout) if timeout else None,
            device=env.get("NBDDP_DEVICE"),
            seed=int(seed) if seed and not fresh else None,  # seeded at start, not re-forms
            groups=env.get("NBDDP_GROUPS"),
            mesh=env.get("NBDDP_MESH"),
            gpu=int(gpu) if gpu else None,
        )
