"""The pool: a persistent set of ranks, supervised from the notebook process.

``Pool`` knows no IPython. A local pool starts its ranks through a launcher;
an attached pool waits for ranks that torchrun started elsewhere. Either way
the ranks connect to the pool's listener (a Unix socket in a 0700 directory,
or TCP for an attached pool) and prove they hold its key; a thread accepts
and authenticates them, so no peer can stall the pool.

:meth:`Pool._pump` waits on every connection, output stream and process
sentinel at once, so output, results and deaths are all seen as they happen.
:meth:`Pool.run` turns that into a stream of events for a sink and ends with
a :class:`~nbddp.protocol.CellEnd`.

What to do when a cell goes wrong is decided by a
:class:`~nbddp.supervisor.CellSupervisor` (a state machine with no I/O); the
pool carries it out. Least costly first: a rank that fails while others wait
for it in a collective has the group aborted on every rank, then every rank
re-forms the group and keeps its namespace; a rank that does not come back
from an interrupt, or dies, breaks the group for good, so the others are
stopped and the next cell starts a new pool and says that state was lost.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import gc
import itertools
import json
import math
import os
import pickle
import queue
import secrets
import select
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from . import capture, payload
from . import protocol as P
from . import stacks as S
from .ddp import check_device, parse_groups, parse_mesh
from .errors import (
    CellFailed,
    CellInterrupted,
    NbddpError,
    PoolClosedError,
    PoolStartError,
    RankDied,
    RankFailed,
    describe_exit,
    root_causes,
)
from .launch import START_METHODS, Launcher, make_launcher
from .supervisor import CellSupervisor

__all__ = ["Pool", "RankStatus"]

_LIVE_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()
_default: Pool | None = None  # the pool %%ddp and nbddp.ranch share


def default_pool() -> Pool | None:
    return _default


def set_default_pool(pool: Pool | None) -> None:
    global _default
    _default = pool


@atexit.register
def _stop_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.stop()


@dataclass(frozen=True)
class RankStatus:
    rank: int
    pid: int
    host: str
    device: str
    state: str
    uptime: float
    rss: int | None


class _Stream:
    """One rank's stdout or stderr: raw bytes in, text pieces and end markers out.

    ``conn`` is None for a rank behind a relay: the relay feeds its bytes (such a
    rank writes no end markers; its Done comes after all it wrote).
    """

    def __init__(self, conn: Connection | None, name: str) -> None:
        self.conn = conn
        self.fd = None if conn is None else conn.fileno()
        self.name = name
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""
        self.eof = False

    def read(self) -> list[str | int]:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        return self.feed(data)

    def feed(self, data: bytes) -> list[str | int]:
        """Text pieces and end markers in ``data``; no data is the end of the stream."""
        if not data:
            self.eof = True
            text = self._held + self._decoder.decode(b"", final=True)
            self._held = ""
            return [text] if text else []
        pieces, self._held = P.split_markers(self._held + self._decoder.decode(data))
        return pieces

    def read_available(self) -> list[str | int]:
        """Everything already written, without waiting (used when the writer died)."""
        if self.fd is None:  # a relay sent all there was before the rank's end
            return [] if self.eof else self.feed(b"")
        os.set_blocking(self.fd, False)
        pieces: list[str | int] = []
        while not self.eof:
            got = self.read()
            if not got and not self.eof:
                break
            pieces += got
        return pieces


class _Relay:
    """A host's relay (nbddp.relay): one connection carries all its ranks' traffic."""

    def __init__(self, conn: Connection, hello: P.RelayHello) -> None:
        self.conn, self.host, self.pid = conn, hello.host, hello.pid
        self.ranks: set[int] = set()

    def send(self, ranks: tuple[int, ...], data: bytes, cell: int = 0) -> bool:
        """``data`` for each of ``ranks`` (``cell``: it is that cell's Run), in one frame;
        a big message follows its frame as it is, not copied into a pickle."""
        big = len(data) > _INLINE
        frame = pickle.dumps((ranks, cell, None if big else data), pickle.HIGHEST_PROTOCOL)
        try:
            self.conn.send_bytes(frame)
            if big:
                self.conn.send_bytes(data)
            return True
        except OSError:
            return False


_INLINE = 1 << 16  # messages to ranks behind a relay up to this size travel in the frame


@dataclass
class _Rank:
    rank: int
    pid: int
    host: str = ""
    conn: Connection | None = None  # behind a relay: the relay's connection
    relay: _Relay | None = None
    streams: dict[str, _Stream] = field(default_factory=dict)
    state: str = "starting"  # starting | idle | running | dead
    device: str = ""
    backend: str = ""
    started: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    names: frozenset[str] = frozenset()  # the rank's global names, as last reported

    def send(self, msg: object) -> bool:
        return self.send_bytes(P.dumps(msg))

    def send_bytes(self, data: bytes) -> bool:
        if self.conn is None or self.state == "dead":
            return False
        if self.relay is not None:
            return self.relay.send((self.rank,), data)
        try:
            self.conn.send_bytes(data)
            return True
        except OSError:
            return False

    @property
    def connected(self) -> bool:
        return self.conn is not None and len(self.streams) == 2


# items the pump returns: what happened, on which rank
_Text = tuple  # ("text", rank, stream, text)
_Mark = tuple  # ("mark", rank, stream, cell)
_Msg = tuple  # ("msg", rank, message)
_Gone = tuple  # ("gone", rank)       the control connection closed or the process ended


class Pool:
    """A persistent pool of ``n`` ranks forming one torch.distributed process group.

    >>> with Pool(2) as pool:
    ...     pool.execute("import torch.distributed as dist; dist.get_rank()")
    [0, 1]
    """

    def __init__(
        self,
        n: int = 2,
        *,
        start_method: str = "forkserver",
        backend: str | None = None,
        pg_timeout: float | None = None,
        start_timeout: float = 120.0,
        grace: float = 3.0,
        abort_after: float = 1.0,
        env: dict[str, str] | None = None,
        listen: tuple[str, int] | None = None,
        token: bytes | None = None,
        on_join=None,
        device: str | None = None,
        gpus: list[int] | None = None,
        seed: int | None = None,
        groups: str | None = None,
        mesh: str | None = None,
        log_dir: str | None = None,
        debug: bool = False,
        threads: str | int | None = None,
    ) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"the world size must be a whole number >= 1, not {n!r}")
        if start_method not in START_METHODS:
            raise ValueError(
                f"unknown start method {start_method!r} (choose from {', '.join(START_METHODS)})"
            )
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"unknown backend {backend!r} (choose gloo or nccl)")
        self._check_layout(n, device, gpus, groups, mesh)
        self.device, self.gpus, self.seed = device, gpus, seed
        self.groups, self.mesh = groups, mesh
        self.log_dir = log_dir
        self.debug = debug  # torch's collective checks: a mismatch fails at once
        self.threads = None if threads is None else str(threads)  # N or "auto" per rank
        if self.threads is not None and self.threads != "auto" and not self.threads.isdigit():
            raise ValueError(f"threads: a number or 'auto', not {threads!r}")
        self._logs: dict[tuple[int, str], object] = {}  # (rank, stream) -> open log file
        self.world_size = n
        self.start_method = start_method
        self.backend = backend
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.grace = grace
        self.abort_after = abort_after
        self.extra_env = dict(env or {})
        # attached pools: ranks started elsewhere (torchrun) connect over TCP with ``token``
        self.listen_on = listen
        self.on_join = on_join  # called with (connected, world size) as ranks join
        if listen is not None and not token:
            raise ValueError("a pool that listens on TCP needs a token")
        self.notes: list[str] = []  # said once, with the next cell
        self.refused: list[str] = []  # connections refused (bad token, wrong world size)
        self._launcher: Launcher | None = None
        self._dir: str | None = None
        self._shm: str | None = None  # the pool's private shared-memory folder (listen())
        self._listener: socket.socket | None = None
        self._token = token or b""
        self._authed: queue.SimpleQueue = queue.SimpleQueue()  # (conn, hello) from handshakes
        self._early: dict[int, list] = {}  # attached: streams that came before their rank
        self._ranks: dict[int, _Rank] = {}
        self._relays: list[_Relay] = []  # attached: one per host with several ranks
        self._store_port: int | None = None
        self._reforms = 0  # re-forms of the group, each named in the ranks' shared store
        self._backlog: list[P.Output] = []
        self._cells = itertools.count(1)
        self._lost = False  # a rank died: the next use restarts and says state was lost
        self._active: CellSupervisor | None = None  # the cell running now
        # interrupt() from any thread: (cell, when), kept until that cell has acted on it
        self._interrupt_request: tuple[int, float] | None = None
        self._pending_cell: int | None = None  # run() made it; it has not ended yet
        self.last_stacks: dict[int, tuple] = {}  # where the ranks were at the last interrupt
        self._closed = False
        self._generation = 0
        # interrupt() from another thread writes here to wake the pump
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()  # every connection of every rank
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._sentinel_fds: set[int] = set()

    @staticmethod
    def _check_layout(n, device, gpus, groups, mesh) -> None:
        """Refuse, before anything starts, options that cannot fit ``n`` ranks."""
        check_device(device)
        if gpus is not None and len(gpus) < n:
            raise ValueError(f"--gpus names {len(gpus)} GPUs for {n} ranks")
        for group in parse_groups(groups):
            if not group or any(not 0 <= r < n for r in group):
                raise ValueError(f"--groups: every group needs ranks 0..{n - 1}, not {group}")
        names, sizes = parse_mesh(mesh)
        if names and math.prod(sizes) != n:
            raise ValueError(
                f"--mesh {mesh}: {' x '.join(map(str, sizes))} = {math.prod(sizes)} ranks, "
                f"but the world size is {n}"
            )

    def __del__(self) -> None:
        if getattr(self, "_selector", None) is not None:
            self._selector.close()  # the epoll descriptor
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # ------------------------------------------------------------ life cycle

    @property
    def started(self) -> bool:
        return bool(self._ranks) and all(
            r.state in ("idle", "running") for r in self._ranks.values()
        )

    @property
    def attached(self) -> bool:
        """The ranks were started elsewhere (torchrun) and connected over TCP."""
        return self.listen_on is not None

    @property
    def needs_restart(self) -> bool:
        """A rank died or was stopped: the next cell starts a new pool (state is lost)."""
        return self._lost

    @property
    def backend_in_use(self) -> str:
        """The process group's backend, as the ranks reported it."""
        return next((r.backend for r in self._ranks.values() if r.backend), self.backend or "")

    @property
    def hosts(self) -> dict[int, str]:
        """Each rank's host, when the ranks are on more than one host (else empty)."""
        hosts = {r.rank: r.host for r in self._ranks.values()}
        return hosts if len(set(hosts.values())) > 1 else {}

    def names_on(self, ranks: list[int] | None = None) -> frozenset[str]:
        """Global names every one of ``ranks`` (all by default) has, as last reported."""
        chosen = [self._ranks[r] for r in (ranks if ranks is not None else self._ranks)]
        return frozenset.intersection(*(r.names for r in chosen)) if chosen else frozenset()

    @property
    def shm_folder(self) -> str | None:
        """Where tensors shipped to the ranks go: the pool's private shared-memory folder
        (removed with the pool), or None for ranks on other hosts (inside the pickle)."""
        return None if self.attached else self._shm

    @property
    def generation(self) -> int:
        """Counts starts: a new generation has ranks with fresh namespaces."""
        return self._generation

    @property
    def devices(self) -> list[str]:
        return [r.device for r in self._ranks.values()]

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._ranks.values()]

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Pool:
        """Start the ranks and return once every one has joined the group (a handshake)."""
        if self.started:
            return self
        self._closed = False
        _LIVE_POOLS.add(self)
        _enough_open_files(self.world_size)
        try:
            self.listen()
            self._lost = False
            self._store_port = None
            if self.attached:  # the ranks come to us
                self._handshake(time.monotonic() + self.start_timeout)
                self._generation += 1
                return self
            if self._launcher is None:
                self._launcher = make_launcher(self.start_method)
            for rank in range(self.world_size):
                pid = self._launcher.start(
                    ["--connect", self._address],
                    self._rank_env(rank),
                    os.path.join(self._dir, f"rank{rank}.log"),
                    os.getcwd(),
                )
                self._ranks[rank] = _Rank(rank, pid)
            self._handshake(time.monotonic() + self.start_timeout)
            self._generation += 1
        except BaseException:
            self._teardown(keep_launcher=False)
            raise
        return self

    def restart(self) -> Pool:
        """A new set of ranks (through the same fork server): every rank's state is gone."""
        if self.attached:
            raise NbddpError(
                "an attached pool cannot be restarted from the notebook: start torchrun "
                "again and attach again"
            )
        self._teardown(keep_launcher=True)
        return self.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End every rank and helper: ask, wait up to ``timeout`` together, then SIGKILL."""
        self._teardown(keep_launcher=False, timeout=timeout)
        self._closed = True
        _LIVE_POOLS.discard(self)

    def listen(self) -> str:
        """Open the listener (if not yet) and return the address workers connect to.

        A local pool: a Unix socket in a private 0700 directory. An attached
        pool: TCP on ``listen`` (port 0: a free one).
        """
        if self._listener is not None:
            return self._address
        self._dir = tempfile.mkdtemp(prefix="nbddp-")  # mode 0700
        self._shm = payload.shm_dir()  # where ranks write big values for the notebook
        if self.attached:
            host, port = self.listen_on
            self._listener = socket.create_server((host, port), backlog=1024)
            bound = self._listener.getsockname()[1]
            self._address = f"{host}:{bound}"
        else:
            self._address = os.path.join(self._dir, "pool.sock")
            self._token = secrets.token_hex(32).encode()
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self._address)
            self._listener.listen(256)
        threading.Thread(
            target=self._accept_loop, args=(self._listener,), name="nbddp-accept", daemon=True
        ).start()
        return self._address

    def _rank_env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("MASTER_PORT", None)  # rank 0 binds a free port and reports it
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            NBDDP_SYS_PATH=os.pathsep.join(p for p in sys.path if p),  # what it can import
            NBDDP_TOKEN=self._token.decode(),
            NBDDP_SHM_DIR=self._shm,
            MPLBACKEND="module://nbddp.mpl_backend",
        )
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # a local pool stays local
            env.setdefault(var, "lo")
        if self.backend:
            env["NBDDP_BACKEND"] = self.backend
        if self.pg_timeout:
            env["NBDDP_PG_TIMEOUT"] = str(self.pg_timeout)
        for var, value in (
            ("NBDDP_DEVICE", self.device),
            ("NBDDP_SEED", self.seed),
            ("NBDDP_GROUPS", self.groups),
            ("NBDDP_MESH", self.mesh),
        ):
            if value is not None:
                env[var] = str(value)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        if self.debug:
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        if self.threads is not None:
            env["NBDDP_THREADS"] = self.threads
        env.update(self.extra_env)
        return env

    def _teardown(self, *, keep_launcher: bool, timeout: float = 5.0) -> None:
        ranks = list(self._ranks.values())
        for r in ranks:
            r.send(P.Shutdown())
        self._reap(ranks, time.monotonic() + timeout)
        for r in ranks:
            for conn in [r.conn, *(s.conn for s in r.streams.values())]:
                if conn is not None:
                    self._unwatch_conn(conn)
                    conn.close()
        self._ranks.clear()
        for early in self._early.values():
            for conn, _, relay in early:
                if relay is None:
                    conn.close()
        self._early.clear()
        for relay in self._relays:
            self._unwatch_conn(relay.conn)
            relay.conn.close()
        self._relays.clear()
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if not keep_launcher:
            if self._launcher is not None:
                self._launcher.close()
                self._launcher = None
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                shutil.rmtree(self._shm, ignore_errors=True)
                self._dir = None

    def _reap(self, ranks: list[_Rank], deadline: float) -> None:
        """Wait for the ranks' processes until ``deadline``, then SIGKILL their sessions.

        Ranks started elsewhere cannot be signalled: wait for their connections to close.
        """
        launcher = self._launcher
        if launcher is None:
            for r in ranks:
                if r.conn is not None and not r.conn.closed:
                    with contextlib.suppress(OSError, EOFError):
                        while r.conn.poll(max(0.0, deadline - time.monotonic())):
                            r.conn.recv_bytes()
                r.state = "dead"
            return
        for r in ranks:
            code = launcher.returncode(r.pid, timeout=max(0.0, deadline - time.monotonic()))
            if code is None:
                launcher.kill(r.pid, signal.SIGKILL)
                code = launcher.returncode(r.pid, timeout=5.0)
            launcher.kill(r.pid, signal.SIGKILL)  # whatever it started, too
            r.returncode, r.state = code, "dead"

    # ------------------------------------------------------------ the pump

    def _pump(self, timeout: float | None) -> list[tuple]:
        """Wait for anything on any connection, stream or sentinel; return what happened."""
        sentinels = self._watch_sentinels()
        items: list[tuple] = []
        ended = False
        for key, _ in self._selector.select(timeout):
            what = key.data
            if what is None:  # the wake pipe
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif what is sentinels:
                ended = True
            elif isinstance(what, _Relay):
                items += self._service_relay(what)
            else:
                items += self._service(key.fd, *what)
        while not self._authed.empty():
            self._attach(*self._authed.get())
        if ended:
            gone = {i[1] for i in items if i[0] == "gone"}
            items += [i for i in self._exits() if i[1] not in gone]
        return items

    def _service(self, fd: int, r: _Rank, s: _Stream | None) -> list[tuple]:
        """What came on one connection: a message, stream text, or the end of it."""
        if r.state == "dead" or r.conn is None:  # nothing more is wanted from it
            self._unwatch(fd)
            return []
        if s is None:
            try:
                return [("msg", r.rank, P.loads(r.conn.recv_bytes()))]
            except (EOFError, OSError):
                return [("gone", r.rank)]
        items = self._stream_items(r, s, s.read())
        if s.eof:
            self._unwatch(fd)
        return items

    def _service_relay(self, relay: _Relay) -> list[tuple]:
        """What came from a host's relay: the same items as from its ranks, one frame."""
        try:
            frame = pickle.loads(relay.conn.recv_bytes())
        except (EOFError, OSError):  # the relay ended: so did its ranks' connections
            self._unwatch_conn(relay.conn)
            relay.conn.close()
            return [("gone", rank) for rank in sorted(relay.ranks) if self._live(rank)]
        items: list[tuple] = []
        for item in frame:
            kind, who = item[0], item[1]
            if kind == "out":
                r = self._ranks.get(who)
                s = r.streams.get(item[2]) if self._live(who) else None
                if s is not None:
                    items += self._stream_items(r, s, s.feed(item[3]))
            elif kind == "done":  # equal for every one of the ranks: decoded once
                live = tuple(r for r in who if self._live(r))
                items.append(("dones", live, P.loads(item[2])))
            elif kind == "msg":
                if self._live(who):
                    items.append(("msg", who, P.loads(item[2])))
            elif kind == "gone":
                if self._live(who):
                    items.append(("gone", who))
            elif kind == "hello":
                self._attach(relay.conn, P.loads(item[2]), relay)
        return items

    def _live(self, rank: int) -> bool:
        r = self._ranks.get(rank)
        return r is not None and r.state != "dead"

    def _deliver(self, ranks, data: bytes, cell: int = 0) -> None:
        """Send one message to each of ``ranks``: one frame per relay, not one per rank.
        ``cell``: the message is that cell's Run."""
        via: dict[_Relay, list[int]] = {}
        for rank in ranks:
            r = self._ranks[rank]
            if r.relay is None:
                r.send_bytes(data)
            elif r.state != "dead":
                via.setdefault(r.relay, []).append(rank)
        for relay, some in via.items():
            relay.send(tuple(some), data, cell)

    # one selector for the pool's life: registering thousands of connections at every
    # wait made a cell's cost grow with the square of the ranks

    def _watch(self, fd: int, data: object) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)  # a number reused after a close
        self._selector.register(fd, selectors.EVENT_READ, data)

    def _unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)

    def _unwatch_conn(self, conn: Connection) -> None:
        if not conn.closed:
            self._unwatch(conn.fileno())

    def _watch_sentinels(self) -> tuple:
        """Keep the launcher's exit sentinels registered; the marker their keys carry."""
        fds = set()
        if self._launcher is not None:
            fds = {o if isinstance(o, int) else o.fileno() for o in self._launcher.sentinels()}
        for fd in self._sentinel_fds - fds:
            self._unwatch(fd)
        for fd in fds - self._sentinel_fds:
            self._watch(fd, self._SENTINEL)
        self._sentinel_fds = fds
        return self._SENTINEL

    _SENTINEL = ("sentinel",)

    def _log_text(self, rank: int, stream: str, text: str) -> None:
        """With ``log_dir``: ``DIR/{rank}/{stream}.log``, written as output arrives."""
        key = (rank, stream)
        if key not in self._logs:
            os.makedirs(os.path.join(self.log_dir, str(rank)), exist_ok=True)
            path = os.path.join(self.log_dir, str(rank), f"{stream}.log")
            self._logs[key] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._logs[key].write(text)

    def _log_error(self, rank: int, error: P.ErrorInfo) -> None:
        """With ``log_dir``: ``DIR/{rank}/error.json`` for a rank whose cell failed."""
        os.makedirs(os.path.join(self.log_dir, str(rank)), exist_ok=True)
        record = {
            "rank": rank,
            "pid": self._ranks[rank].pid,
            "exc_type": error.exc_type,
            "message": error.message,
            "traceback": error.traceback,
            "timestamp": time.time(),
        }
        with open(os.path.join(self.log_dir, str(rank), "error.json"), "w") as f:
            json.dump(record, f, indent=2)

    def _stream_items(self, r: _Rank, s: _Stream, pieces: list[str | int]) -> list[tuple]:
        if self.log_dir is not None:
            for p in pieces:
                if isinstance(p, str):
                    self._log_text(r.rank, s.name, p)
        return [
            ("mark", r.rank, s.name, p) if isinstance(p, int) else ("text", r.rank, s.name, p)
            for p in pieces
        ]

    def _exits(self) -> list[tuple]:
        self._launcher.poll()
        return [
            ("gone", r.rank)
            for r in self._ranks.values()
            if r.state != "dead" and r.pid in self._launcher.returncodes
        ]

    def _accept_loop(self, listener: socket.socket) -> None:
        """Take connections as they come, even while the notebook is idle; each peer
        proves it holds the token in a thread of its own.

        Nothing is unpickled before the HMAC challenge succeeds, and a peer that
        sends garbage or nothing never stalls the pool (it is dropped after 5 s).
        """
        while listener is self._listener:
            try:
                ready, _, _ = select.select([listener], [], [], 0.5)
                if not ready:
                    continue
                sock, peer = listener.accept()
            except (OSError, ValueError):  # the listener was closed
                return
            threading.Thread(
                target=self._authenticate, args=(sock, peer), name="nbddp-auth", daemon=True
            ).start()

    def _authenticate(self, sock: socket.socket, peer) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 5, 0))
        if sock.family != socket.AF_UNIX:  # a relay's frames, and a rank's messages, go
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # out without delay
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self._token)
            answer_challenge(conn, self._token)
            hello = P.loads(conn.recv_bytes(1 << 16))
            s = socket.socket(fileno=os.dup(conn.fileno()))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            s.close()
        except (
            AuthenticationError,
            EOFError,
            OSError,
            TypeError,
            ValueError,
            pickle.UnpicklingError,
        ) as exc:
            conn.close()
            who = f" from {peer[0]}" if isinstance(peer, tuple) else ""
            self.refused.append(f"refused a connection{who}: {type(exc).__name__}: {exc}")
            return
        self._authed.put((conn, hello))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

    def _attach(self, conn: Connection, hello: object, relay: _Relay | None = None) -> None:
        """A connection that proved it holds the token, and its first message."""
        if isinstance(hello, P.RelayHello):
            if hello.version != P.PROTOCOL_VERSION:
                conn.close()
                raise PoolStartError(
                    f"the relay of {hello.host} speaks protocol {hello.version}, the notebook "
                    f"{P.PROTOCOL_VERSION}: install the same nbddp version on every host"
                )
            relay = _Relay(conn, hello)
            self._relays.append(relay)
            self._watch(conn.fileno(), relay)
            return
        rank = getattr(hello, "rank", -1)
        if self.attached and isinstance(hello, P.Hello) and rank not in self._ranks:
            if hello.world_size != self.world_size or not 0 <= rank < self.world_size:
                conn.close()
                self.refused.append(
                    f"refused rank {rank} of a world of {hello.world_size}: "
                    f"this pool waits for {self.world_size} ranks"
                )
                return
            self._ranks[rank] = _Rank(rank, hello.pid)
        r = self._ranks.get(rank)
        if r is None and self.attached and isinstance(hello, P.StreamHello):
            # its stream finished the handshake before its control connection did
            self._early.setdefault(rank, []).append((conn, hello, relay))
            return
        if r is None or r.state == "dead":
            if relay is None:
                conn.close()
            return
        if isinstance(hello, P.Hello):
            if hello.version != P.PROTOCOL_VERSION:
                if relay is None:
                    conn.close()
                raise PoolStartError(
                    f"rank {hello.rank} speaks protocol {hello.version}, the notebook "
                    f"{P.PROTOCOL_VERSION}: install the same nbddp version on every host"
                )
            r.conn, r.pid, r.host, r.relay = conn, hello.pid, hello.host, relay
            if relay is None:
                self._watch(conn.fileno(), (r, None))
            else:
                relay.ranks.add(rank)
            for early in self._early.pop(rank, ()):
                self._attach(*early)
            if self._store_port is not None and r.rank != 0:
                r.send(P.JoinGroup(self._store_port))
            if self.on_join is not None:
                self.on_join(len(self._ranks), self.world_size)
        elif isinstance(hello, P.StreamHello) and relay is not None:
            r.streams[hello.stream] = _Stream(None, hello.stream)
        elif isinstance(hello, P.StreamHello):
            stream = r.streams[hello.stream] = _Stream(conn, hello.stream)
            self._watch(stream.fd, (r, stream))
        elif relay is None:
            conn.close()

    # ------------------------------------------------------------ start handshake

    def _handshake(self, deadline: float) -> None:
        while len(self._ranks) < self.world_size or not all(
            r.state == "idle" and r.connected for r in self._ranks.values()
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [
                    r
                    for r in range(self.world_size)
                    if r not in self._ranks or self._ranks[r].state != "idle"
                ]
                raise PoolStartError(
                    f"ranks {waiting} did not start within {self.start_timeout:g} s"
                    + self._log_tail(waiting[0])
                )
            for item in self._pump(min(left, 1.0)):
                self._handshake_item(item)
        self._ranks = dict(sorted(self._ranks.items()))  # ranks joined in any order

    def _handshake_item(self, item: tuple) -> None:
        kind, rank = item[0], item[1]
        if kind == "dones":  # late, for a cell that has ended
            return
        r = self._ranks[rank]
        if kind == "text":
            self._backlog.append(P.Output(rank, item[2], item[3]))
        elif kind == "gone":
            code = self._launcher_code(r)
            raise PoolStartError(
                f"rank {rank} exited while starting ({describe_exit(code)})" + self._log_tail(rank)
            )
        elif kind == "msg":
            msg = item[2]
            if isinstance(msg, P.StorePort):
                self._store_port = msg.port
                for other in self._ranks.values():
                    if other.rank != 0 and other.conn is not None:
                        other.send(P.JoinGroup(msg.port))
            elif isinstance(msg, P.Ready):
                r.state, r.backend, r.device = "idle", msg.backend, msg.device
                r.names = frozenset(msg.names) or r.names
            elif isinstance(msg, P.Fatal):
                raise PoolStartError(f"rank {rank} failed to start:\n{msg.error.traceback}")

    def _log_tail(self, rank: int, lines: int = 20) -> str:
        path = os.path.join(self._dir or "", f"rank{rank}.log")
        try:
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return ""
        return ("\n" + "".join(tail).rstrip()) if tail else ""

    # ------------------------------------------------------------ cells

    def _ensure_running(self) -> None:
        if self._closed and not self._ranks:
            raise PoolClosedError("the pool was stopped; start it again")
        if self.attached and (self._lost or not self.started):
            raise PoolClosedError(
                "the attached pool lost a rank: start torchrun again and attach again"
            )
        gone = [i for i in self._poll_idle() if i[0] == "gone"]
        if gone or self._lost:
            dead = [self._ranks[i[1]] for i in gone]
            why = ", ".join(RankDied(r.rank, self._launcher_code(r)).summary for r in dead)
            self._teardown(keep_launcher=True)
            self.notes.append(
                (f"{why} since the last cell; " if why else "")
                + "started a new pool: the ranks' state was lost"
            )
        if not self.started:
            self.start()

    def _poll_idle(self) -> list[tuple]:
        """Take in whatever arrived between cells (output goes to the backlog)."""
        if not self._ranks:
            return []
        items = self._pump(0)
        for item in items:
            if item[0] == "text":
                self._backlog.append(P.Output(item[1], item[2], item[3]))
        return items

    def run(
        self,
        code: str,
        *,
        ranks: list[int] | None = None,
        needs: dict[str, object] | payload.Shipment | None = None,
        auto: payload.Shipment | None = None,
        imports: str = "",
        want_values: bool = False,
        timeout: float | None = None,
        display_ranks: list[int] | None = None,
        tick: float | None = None,
        script: P.Script | None = None,
        post_mortem: bool = False,
        profile: str | None = None,
    ) -> Iterator[object]:
        """Run ``code`` on ``ranks`` (all by default); yield events, ending with ``CellEnd``.

        ``needs`` maps names to objects bound on the ranks before the cell
        (or is a shipment made by :func:`nbddp.capture.pack`); ``auto`` is
        bound only on ranks that lack the name. Interrupt with :meth:`interrupt` (or a
        KeyboardInterrupt while waiting); ``timeout`` seconds behave the same.
        Rich output (``display``, figures) comes from ``display_ranks`` (rank 0
        by default). With ``tick``, a ``Tick`` is yielded after that many
        seconds without any other event. With ``script``, that file runs as
        ``__main__`` instead of ``code`` (see :meth:`run_script`). With
        ``post_mortem``, pdb opens where each rank's last failed cell raised. With
        ``profile`` ("torch" or "python"), the cell runs under that profiler and
        ``CellEnd.profiles`` holds each rank's (see :mod:`nbddp.profiling`).

        A rank in pdb (``breakpoint()``) yields ``RankDebug`` each time it wants a
        line; answer with :meth:`debug_reply`.
        """
        self._ensure_running()
        targets = sorted(set(range(self.world_size) if ranks is None else ranks))
        bad = [r for r in targets if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"no rank {bad[0]} in a pool of {self.world_size}")
        if isinstance(needs, dict):
            needs = capture.pack(needs, self.shm_folder)
        cell = next(self._cells)
        shown = {0} if display_ranks is None else set(display_ranks)
        run = {  # two messages at most, each pickled once for every rank
            display: P.Run(
                cell,
                code,
                imports,
                needs and needs.data,
                auto and auto.data,
                want_values,
                display,
                shm=not self.attached,
                script=script,
                post_mortem=post_mortem,
                profile=profile,
            )
            for display in (False, True)
        }
        runs = {r: run[r in shown] for r in targets}
        self._pending_cell = cell  # an interrupt from now on is for this cell
        return self._cell(cell, runs, timeout, tick, [s for s in (needs, auto) if s])

    def _cell(self, cell: int, *args):
        sigint = self._catch_sigint(cell)  # first: from here Ctrl-C is an interrupt request
        try:
            yield from self._cell_body(cell, *args)
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)

    def _cell_body(
        self,
        cell: int,
        runs: dict[int, P.Run],
        timeout: float | None,
        tick: float | None,
        shipments: list[payload.Shipment],
    ):
        notes, self.notes = self.notes, []
        backlog, self._backlog = self._backlog, []
        yield from backlog
        targets = sorted(runs)
        sup = CellSupervisor(
            cell,
            targets,
            time.monotonic(),
            abort_after=self.abort_after,
            grace=self.grace,
            timeout=timeout,
        )
        # a relay forwards a rank's Done after all it printed: no end markers to wait for
        out = _Outcome(cell, targets, {r for r in targets if self._ranks[r].relay is not None})
        self._active = sup
        # while a cell runs, the notebook does little but read the ranks' output, and the
        # collector's full passes over the kernel's heap (torch and all) cost more than the
        # reading: 400,000 lines took 3.7 s of notebook CPU, 1.5 s with the heap frozen
        froze = gc.get_freeze_count() == 0  # a freeze of the user's own is left alone
        if froze:
            gc.freeze()
        try:
            by_message: dict[int, list[int]] = {}  # one pickle per message, one write per relay
            for rank in targets:
                by_message.setdefault(id(runs[rank]), []).append(rank)
            for some in by_message.values():
                for rank in some:
                    self._ranks[rank].state = "running"
                self._deliver(some, P.dumps(runs[some[0]]), cell)
            yield P.RankStates(tuple(targets), "running")
            while not sup.finished:
                yield from self._cell_step(sup, out, tick)
        finally:
            if froze:
                gc.unfreeze()
            self._active = None
            if self._pending_cell == cell:
                self._pending_cell = None
            if self._interrupt_request is not None and self._interrupt_request[0] == cell:
                self._interrupt_request = None  # the cell ended: it was answered
            for shipment in shipments:  # every rank has loaded them by now
                shipment.remove()
            if not sup.finished:  # the consumer gave up on us: leave nothing running
                self._lost = True
                self._teardown(keep_launcher=True)
        if sup.aborted_at is not None and not self._lost:
            yield from self._reform(sup, out)
        elif any(d.needs_group for d in out.done.values()) and not self._lost:
            yield from self._reform(sup, out, quiet=True)  # the cell destroyed the group
        if sup.stacks_at_interrupt:
            self.last_stacks = dict(sup.stacks_at_interrupt)
        end = out.end(sup, notes + self._take_notes())
        if not end.interrupted:  # a rank a peer's failure broke shows as freed, not red
            _, consequences = root_causes(failures_of(end))
            for f in consequences:
                if f.rank not in end.freed:
                    yield P.RankState(f.rank, "freed")
        yield end

    def _take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        refused, self.refused = self.refused, []
        return notes + refused

    def _cell_step(self, sup: CellSupervisor, out: _Outcome, tick: float | None):
        """Wait for what comes next (or the supervisor's next deadline) and handle it."""
        yield from self._act(sup, out)
        if sup.finished:
            return
        now = time.monotonic()
        tick_at = None if tick is None else now + tick
        limits = [t for t in (sup.deadline, tick_at) if t is not None]
        try:
            items = self._pump(max(0.0, min(limits) - now) if limits else None)
        except KeyboardInterrupt:
            self.interrupt()
            return
        if not items and tick_at is not None and time.monotonic() >= tick_at:
            yield P.Tick()
        for item in items:
            if item[0] == "dones":  # a relay's ranks that ended the cell the same way
                yield from self._dones(sup, out, item[1], item[2])
            else:
                yield from self._cell_item(sup, out, item)
        yield from self._act(sup, out)

    def _act(self, sup: CellSupervisor, out: _Outcome):
        """Carry out what the supervisor says is due (and an interrupt asked for)."""
        now = time.monotonic()
        actions = []
        request = self._interrupt_request
        if request is not None and request[0] == sup.cell and sup.interrupted is None:
            actions += sup.interrupt("interrupt", now)
        for action in actions + sup.due(now):
            if action.kind == "stacks":
                self._send(action.ranks, P.StackQuery())
            elif action.kind == "interrupt":
                self._send(action.ranks, P.Interrupt(sup.cell))
            elif action.kind == "abort":
                live = [r.rank for r in self._ranks.values() if r.state in ("idle", "running")]
                self._send(live, P.AbortGroup(sup.cell))
            elif action.kind == "stop":
                yield from self._stop_pool(sup, out, action)

    def _send(self, ranks, msg: object) -> None:
        self._deliver(ranks, P.dumps(msg))

    def _cell_item(self, sup: CellSupervisor, out: _Outcome, item: tuple):
        kind, rank = item[0], item[1]
        r = self._ranks[rank]
        msg = item[2] if kind == "msg" else None
        if kind == "text":
            yield P.Output(rank, item[2], item[3])
        elif kind == "mark":
            if item[3] == sup.cell:
                out.marks[rank].discard(item[2])
                yield from self._maybe_finish(sup, out, rank)
        elif isinstance(msg, P.Done):
            yield from self._dones(sup, out, (rank,), msg)
        elif isinstance(msg, P.Stacks):
            place = sup.stacks(rank, msg.frames, time.monotonic())
            if place is not None:
                yield P.RankWhere(rank, S.summary(place.frames), sup.waiting_in(rank), place.since)
        elif isinstance(msg, P.StorePort):  # a script formed the group again, mid-cell
            self._store_port = msg.port
            self._send([o for o in self._ranks if o != 0], P.JoinGroup(msg.port))
        elif isinstance(msg, P.Display):
            yield P.RankDisplay(rank, msg.data, msg.metadata)
        elif isinstance(msg, P.Progress):
            yield P.RankProgress(rank, msg.done, msg.total, msg.desc)
        elif isinstance(msg, P.DebugPrompt):
            yield P.RankDebug(rank, msg.output, msg.prompt, msg.seq)
        elif kind == "gone" and r.state != "dead":
            yield from self._rank_died(sup, out, r)

    def _dones(
        self, sup: CellSupervisor, out: _Outcome, ranks: tuple[int, ...], msg: P.Done
    ) -> list:
        """The same Done from each of ``ranks`` (one rank, or a relay's group of them); the
        events it makes (a list: at scale, a thousand events a cell pass through here)."""
        if msg.cell != sup.cell:
            return []
        names = None if msg.names is None else frozenset(msg.names)
        for rank in ranks:
            r = self._ranks[rank]
            r.state = "idle"
            if names is not None:
                r.names = names
        out.done.update(dict.fromkeys(ranks, msg))
        now = time.monotonic()
        if any(out.marks[rank] for rank in ranks):  # direct: finished by its end markers
            events = []
            for rank in ranks:
                sup.done(rank, msg.status, now)
                events += self._maybe_finish(sup, out, rank)
            return events
        # behind a relay, the output is in: done and finished at once, a group in one step
        finished = sup.ended_together(ranks, msg.status, now)
        if msg.status == "ok" and msg.value is None and msg.value_repr is None:
            return [P.RankStates(tuple(finished), "done")] if finished else []  # as finish
        return [event for rank in finished for event in self._finish(out, rank)]

    def _maybe_finish(self, sup: CellSupervisor, out: _Outcome, rank: int):
        if rank in out.done and not out.marks[rank] and sup.ended(rank):
            yield from self._finish(out, rank)

    def _finish(self, out: _Outcome, rank: int):
        if out.done[rank].error is not None and self.log_dir is not None:
            self._log_error(rank, out.done[rank].error)
        yield from out.finish(rank)

    # ------------------------------------------------------------ failures

    def _reform(self, sup: CellSupervisor, out: _Outcome, quiet: bool = False):
        """Every rank joins a new group; namespaces stay. Fall back to a restart."""
        t0 = time.monotonic()
        self._store_port = None
        self._reforms += 1
        for r in self._ranks.values():
            r.state = "starting"
            r.send(P.Reform(self._reforms))
        try:
            self._handshake(t0 + 60.0)
        except PoolStartError as exc:
            self._lost = True
            self._teardown(keep_launcher=True)
            self.notes.append(
                f"re-forming the process group failed ({exc}): the pool "
                "was stopped and the next cell starts a new one (the ranks' state is lost)"
            )
            return
        backlog, self._backlog = self._backlog, []
        yield from backlog
        if quiet:
            return
        stopped = [r for r in out.done if r not in sup.aborted_running]
        waits = sorted({w for r in sup.aborted_running if (w := sup.waiting_in(r))})
        how = f"waiting in {', '.join(waits)}" if waits else "maybe in a collective"
        what = (
            f"{S.rank_set(stopped)} had stopped while {S.rank_set(sup.aborted_running)} "
            f"still ran ({how})"
            if stopped
            else f"every rank still ran after the {sup.interrupted or 'failure'} ({how})"
        )
        self.notes.append(
            f"{what}: the process group was aborted and re-formed in "
            f"{time.monotonic() - t0:.2f} s. "
            "Every rank kept its namespace; objects bound to the old group (DDP models, "
            "device meshes, subgroups) must be rebuilt"
            + (" (nbddp rebuilt `mesh` and `group`)" if self.mesh or self.groups else "")
        )

    def _rank_died(self, sup: CellSupervisor, out: _Outcome, r: _Rank):
        """One rank died: its group is broken, so the supervisor stops every other rank."""
        yield from self._drain(r)
        r.state, r.returncode = "dead", self._launcher_code(r)
        out.exits[r.rank] = exit_event = P.RankExit(r.rank, r.returncode, when=time.time())
        yield exit_event
        yield P.RankState(r.rank, "dead")
        sup.died(r.rank, time.monotonic())
        if r.returncode == -signal.SIGKILL:
            self.notes.append(
                f"nothing in nbddp sent rank {r.rank} SIGKILL: the usual sender is the "
                "kernel's out-of-memory killer (see `dmesg`)"
            )

    def _drain(self, r: _Rank):
        """What a rank had already written (it ended, or is about to be stopped)."""
        for s in r.streams.values():
            for item in self._stream_items(r, s, s.read_available()):
                if item[0] == "text":
                    yield P.Output(r.rank, item[2], item[3])

    def _launcher_code(self, r: _Rank) -> int | None:
        return None if self._launcher is None else self._launcher.returncode(r.pid, timeout=2.0)

    def _stop_pool(self, sup: CellSupervisor, out: _Outcome, action):
        """The last resort: stop every live rank; the next cell starts a new pool."""
        if action.reason == "death":
            self.notes.append(
                "the process group lost a member, so the pool was stopped; "
                "the next cell starts a new one (the ranks' state is lost)"
            )
        elif action.reason == "abort":
            stuck = list(action.ranks)
            self.notes.append(
                f"{S.rank_set(stuck)} still ran {self.grace:g} s after the process group was "
                "aborted (blocked in a collective the abort did not reach) and "
                f"{'were' if len(stuck) > 1 else 'was'} stopped with the rest of the pool; "
                "the next cell starts a new one (the ranks' state is lost)"
            )
        else:
            stuck = list(action.ranks)
            self.notes.append(
                f"{S.rank_set(stuck)} did not stop within {self.grace:g} s of the "
                f"{action.reason} and {'were' if len(stuck) > 1 else 'was'} stopped with the "
                "rest of the pool; the next cell starts a new one (the ranks' state is lost)"
            )
        others = [o for o in self._ranks.values() if o.state != "dead"]
        for o in others:
            if self._launcher is not None:
                self._launcher.kill(o.pid, signal.SIGKILL)
            else:
                o.send(P.Shutdown())
        self._reap(others, time.monotonic() + 2.0)
        for o in others:
            yield from self._drain(o)
            if o.rank in action.ranks:
                out.exits[o.rank] = P.RankExit(o.rank, o.returncode, True, time.time())
                yield P.RankState(o.rank, "dead")
        self._lost = True

    def interrupt(self) -> None:
        """Interrupt the cell that runs, or is about to run, on every rank running it.

        From any thread. An interrupt is never lost: it holds until its cell has
        acted on it, and ranks that have not started the cell yet raise it as they
        start. Without a cell, there is nothing to interrupt.
        """
        cell = self._active.cell if self._active is not None else self._pending_cell
        if cell is None:
            return
        if self._interrupt_request is None or self._interrupt_request[0] != cell:
            self._interrupt_request = (cell, time.monotonic())
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None:
        """Answer a rank's pdb (a ``RankDebug`` event) with ``line``; None ends its session."""
        self._ranks[prompt.rank].send(P.DebugInput(line, prompt.seq))

    def _catch_sigint(self, cell: int):
        """While ``cell`` runs, Ctrl-C and the stop button interrupt it instead of raising
        KeyboardInterrupt wherever the notebook happens to be (a half-handled message,
        a half-sent Run). Returns the handler to restore (None: not the main thread).

        If the pool itself does not answer (the cell still runs ``grace`` + 5 s after
        an interrupt), the next Ctrl-C raises KeyboardInterrupt as usual.
        """
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(_signum, _frame) -> None:
            request = self._interrupt_request
            stuck = request is not None and time.monotonic() - request[1] > self.grace + 5.0
            if stuck and request[0] == cell:
                raise KeyboardInterrupt
            self.interrupt()

        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler not set from Python: leave it alone
            return None
        signal.signal(signal.SIGINT, on_sigint)
        return previous

    def run_script(
        self, path: str, argv: list[str] | tuple[str, ...] = (), *, keep: bool = False, **kwargs
    ) -> Iterator[object]:
        """Run a torchrun script unchanged on the ranks, as :meth:`run` runs a cell.

        The file is read here and runs as ``__main__`` in a module of its own, with
        ``sys.argv`` set; with ``keep``, its globals stay in each rank's namespace.
        """
        with open(path, encoding="utf-8") as f:
            source = f.read()
        script = P.Script(os.path.abspath(path), source, tuple(argv), keep)
        return self.run("", script=script, **kwargs)

    def execute(self, code: str, **kwargs) -> list[object]:
        """Run ``code`` and return the last expression's value by rank; raise on failure.

        Output is discarded; use :meth:`run` to see it. A rank's pdb (``breakpoint()``)
        gets no commands here: its session is closed at once, not waited for.
        """
        end = None
        for event in self.run(code, want_values=True, **kwargs):
            if isinstance(event, P.CellEnd):
                end = event
            elif isinstance(event, P.RankDebug):
                self.debug_reply(event, None)
        raise_for_end(end, self.hosts)
        return [end.values.get(r) for r in range(self.world_size)]

    # ------------------------------------------------------------ status

    def _ask(self, msg: object, reply: type, timeout: float) -> dict[int, object]:
        """Send ``msg`` to every live rank between cells; their replies of type ``reply``."""
        live = [r for r in self._ranks.values() if r.state != "dead" and r.send(msg)]
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(live) and time.monotonic() < deadline:
            for item in self._pump(max(0.0, deadline - time.monotonic())):
                if item[0] == "msg" and isinstance(item[2], reply):
                    replies[item[1]] = item[2]
                elif item[0] == "text":
                    self._backlog.append(P.Output(item[1], item[2], item[3]))
                elif item[0] == "gone":
                    self._ranks[item[1]].state = "dead"
                    self._lost = True
        return replies

    def status(self, timeout: float = 2.0) -> list[RankStatus]:
        """One row per rank: pid, host, device, state, uptime, resident memory."""
        replies = self._ask(P.Query(), P.StatusReply, timeout)
        now = time.monotonic()
        return [
            RankStatus(
                r.rank,
                r.pid,
                r.host,
                r.device,
                r.state if r.state == "dead" or r.rank in replies else "unresponsive",
                now - r.started,
                replies[r.rank].rss if r.rank in replies else None,
            )
            for r in self._ranks.values()
        ]

    def stacks(self, timeout: float = 2.0) -> dict[int, tuple]:
        """Where each rank's main thread is now (between cells: empty, they are idle)."""
        replies = self._ask(P.StackQuery(), P.Stacks, timeout)
        return {rank: reply.frames for rank, reply in sorted(replies.items())}


_NO_MARKS: frozenset[str] = frozenset()


class _Outcome:
    """What came back from one cell's ranks: output ends, results, errors, exits."""

    def __init__(self, cell: int, targets: list[int], relayed: set[int] = frozenset()) -> None:
        self.cell = cell
        self.targets = targets
        # the end markers still to come, by rank (none behind a relay: it reads them)
        self.marks = {r: _NO_MARKS if r in relayed else {"stdout", "stderr"} for r in targets}
        self.done: dict[int, P.Done] = {}
        self.values: dict[int, object] = {}
        self.errors: dict[int, P.ErrorInfo] = {}
        self.exits: dict[int, P.RankExit] = {}

    def finish(self, rank: int):
        done = self.done[rank]
        if done.status == "error":
            self.errors[rank] = done.error
            yield P.RankState(rank, "freed" if done.freed else "failed")
            return
        if done.status == "ok" and done.value is not None:
            try:
                self.values[rank] = payload.loads(done.value)
            finally:
                payload.Shipment(b"", list(done.files)).remove()
        if done.value_repr is not None:
            yield P.RankResult(rank, done.value_repr)
        yield P.RankState(rank, "done" if done.status == "ok" else "interrupted")

    def end(self, sup: CellSupervisor, notes: list[str]) -> P.CellEnd:
        for rank, done in self.done.items():  # a rank stopped before its output was all in
            if done.status == "error" and rank not in self.errors:
                self.errors[rank] = done.error
        return P.CellEnd(
            self.cell,
            tuple(self.targets),
            self.values,
            self.errors,
            self.exits,
            sup.interrupted,
            tuple(notes),
            dict(sup.stacks_at_interrupt),
            tuple(sorted(r for r, d in self.done.items() if d.freed)),
            {r: d.profile for r, d in self.done.items() if d.profile is not None},
        )


def _enough_open_files(ranks: int) -> None:
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


def failures_of(end: P.CellEnd, hosts: dict[int, str] | None = None) -> list:
    """Every rank's error and unexpected exit in a cell's end, as error objects."""
    host = (hosts or {}).get
    failures: list = [RankFailed.from_info(r, e, host(r, "")) for r, e in end.errors.items()]
    failures += [
        RankDied(r, x.returncode, host(r, ""), x.when)
        for r, x in end.exits.items()
        if not x.stopped_by_pool
    ]
    return failures


def raise_for_end(end: P.CellEnd, hosts: dict[int, str] | None = None) -> None:
    """Raise the one error that says how the cell failed, if it did: the root cause first.

    With ``hosts`` (a pool on several hosts), each rank is named with its host.
    """
    failures = failures_of(end, hosts)
    if end.interrupted:
        raise CellInterrupted(end.interrupted, failures, list(end.notes), end.stacks)
    if failures:
        raise CellFailed(failures, list(end.notes), freed=end.freed)
