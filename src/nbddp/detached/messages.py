"""The messages between a kernel and a detached pool's supervisor, and where pools live.

A detached pool (``%ddp start --detached NAME``) is a :class:`~nbddp.pool.facade.Pool`
run by a supervisor process of its own (:mod:`nbddp.detached.server`); a kernel is
its client (:mod:`nbddp.detached.client`) over one Unix socket in the pool's
private folder, ``~/.nbddp/pools/NAME/`` (0700), authenticated with the
token in ``token`` (0600) by :mod:`nbddp.wire.handshake`'s SHA-256 challenge, both ways,
before anything is unpickled. These messages carry the user's own values (a
call's arguments, a cell's results) and are unpickled whole: both ends are
processes of the same user, on a socket only that user can reach::

    kernel                                   supervisor
    Hello(pid, force) ---------------------->
                   <------------------------ Welcome(state, resumed) | Refused(reason)
                   <------------------------ Event(.., resumed) ... (a cell that ran meanwhile)
    Call(method, args, kwargs, request) ---->
                   <------------------------ Reply(value, state, request) | Failed(...)
    RunCell(kwargs, request) --------------->
                   <------------------------ Event(.., request) ... (CellEnd), then Reply
    Interrupt(request) | DebugReply -------->   (any time)
                   <------------------------ TakenOver(pid)   (another kernel connected)
    Leave() -------------------------------->   (%ddp disconnect)
                   <------------------------ ... Bye()   (nothing more comes)
    Unread(items) -------------------------->   (what it got but did not read: kept)

A kernel always leaves by Leave, Bye and Unread: one that only closes crashed, and what
was being written to it when it went is kept for the next kernel (it may not have come).

Every request carries an id of the kernel's choosing (random at each connect, so two
kernels' ids never meet), and everything the supervisor answers carries the id of the
request it answers: a kernel routes what comes by id, and never takes one cell's (or a
killed kernel's cell's) events or reply for another request's.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from ..wire import protocol as P
from ..wire.frames import Channel

__all__ = [
    "ADDRESS",
    "BACKLOG",
    "BACKLOG_BYTES",
    "IDLE_TIMEOUT",
    "JOINED",
    "SOCKET",
    "Backlog",
    "Batch",
    "Bye",
    "Call",
    "DebugReply",
    "Event",
    "Failed",
    "Hello",
    "Interrupt",
    "Leave",
    "Link",
    "PoolState",
    "Refused",
    "Reply",
    "RunCell",
    "TakenOver",
    "Unread",
    "Welcome",
    "flat",
    "folder_of",
    "is_tick",
    "pools_folder",
]

VERSION = 2  # 2: requests and answers carry an id
BACKLOG = 10_000  # bulk events (output, metrics...) kept for a kernel that does not read
BACKLOG_BYTES = 64 * 2**20  # and their size at most
IDLE_TIMEOUT = 3600.0  # s without a kernel before the pool stops itself (0: never)
# an attached pool's start (``%ddp attach --detached``), in its folder: where its supervisor
# listens for the ranks (written once it listens), and how many have joined so far
ADDRESS, JOINED = "address", "joined"


class Link:
    """One kernel's connection to a supervisor: whole objects each way."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._lock = threading.Lock()  # several threads send

    def send(self, msg: object) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.channel.send_bytes(data)

    def recv(self) -> object:
        return pickle.loads(self.channel.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.channel.poll(timeout)

    def close(self) -> None:
        self.channel.close()


def pools_folder() -> str:
    """Where this user's detached pools live (``$NBDDP_HOME/pools``, ``~/.nbddp/pools``)."""
    home = os.environ.get("NBDDP_HOME") or os.path.expanduser("~/.nbddp")
    return os.path.join(home, "pools")


SOCKET = "sock"  # in a pool's folder: where its supervisor listens for kernels
UNIX_PATH_MAX = 107  # bytes a Unix socket's path may have (sun_path, less its NUL)


def folder_of(name: str) -> str:
    """The folder of the detached pool ``name``; a name that could not be one (not
    letters, digits, - and _, or its socket's path too long) is refused."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a detached pool's name is letters, digits, - and _, not {name!r}")
    folder = os.path.join(pools_folder(), name)
    length = len(os.fsencode(os.path.join(folder, SOCKET)))
    if length > UNIX_PATH_MAX:
        raise ValueError(
            f"the detached pool {name}'s socket path would be {length} bytes, over the "
            f"{UNIX_PATH_MAX} a socket path may have: use a name {length - UNIX_PATH_MAX} "
            "characters shorter, or a shorter $NBDDP_HOME"
        )
    return folder


@dataclass(frozen=True)
class PoolState:
    """What a kernel reads of the pool without asking: sent with every reply."""

    name: str
    world_size: int
    started: bool
    needs_restart: bool
    hosts: dict[int, str]
    shm_folder: str | None
    generation: int
    devices: list[str]
    pids: list[int]
    backend: str
    last_stacks: dict = field(default_factory=dict)
    grace: float = 3.0  # s the ranks have to come back from an interrupt
    attached: bool = False  # its ranks were started elsewhere (torchrun) and connected in
    # attached: the ranks of lost hosts -> their host, and those of them back already
    # (nbddp.pool.hosts_lost.seen: what %ddp status and a refusal say of them)
    missing: dict[int, str] = field(default_factory=dict)
    missing_back: tuple[int, ...] = ()
    namespaces: dict[int, int] = field(default_factory=dict)  # Pool.namespaces


@dataclass(frozen=True)
class Hello:
    pid: int
    force: bool = False  # take over from a kernel that is connected
    peek: bool = False  # only ask what the pool is (%ddp list): a Reply, then goodbye
    version: int = VERSION


@dataclass(frozen=True)
class Welcome:
    state: PoolState
    resumed: int | None  # the request id of a cell that ran meanwhile: its events follow


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class TakenOver:
    pid: int  # the kernel that took the pool over


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    request: int | None = None


@dataclass(frozen=True)
class Reply:
    value: object
    state: PoolState
    request: int | None = None  # the request it answers (None: a peek)


@dataclass(frozen=True)
class Failed:
    exc_type: str  # the name of an nbddp error class, or of a builtin one
    message: str
    state: PoolState
    request: int | None = None


@dataclass(frozen=True)
class RunCell:
    kwargs: dict  # Pool.run's; shipments as (data, files)
    request: int | None = None


@dataclass(frozen=True)
class Event:
    event: object  # an nbddp.wire.events event
    request: int | None = None  # the RunCell whose cell gave it


@dataclass(frozen=True)
class Batch:
    """Events (and the reply that ends a cell) sent together: the supervisor holds what
    comes while it works and sends it before it waits, so a cell costs one message, not
    one per event, and no event waits."""

    items: tuple


@dataclass(frozen=True)
class Interrupt:
    request: int | None = None  # the cell to interrupt (None: whichever runs)


@dataclass(frozen=True)
class Leave:
    """The kernel disconnects: send nothing more (then Bye)."""


@dataclass(frozen=True)
class Bye:
    """Nothing more comes on this connection."""


@dataclass(frozen=True)
class Unread:
    """What the kernel received and did not read (a cell's rest): kept for the next one."""

    items: tuple


@dataclass(frozen=True)
class DebugReply:
    prompt: object  # the RankDebug it answers
    line: str | None


def flat(items) -> list:
    """``items`` with each Batch opened into its own."""
    return [x for i in items for x in (i.items if isinstance(i, Batch) else (i,))]


def is_tick(item: object) -> bool:
    return isinstance(item, Event) and isinstance(item.event, P.Tick)


# what a backlog bounds (the rest, a cell's end, replies, exits, states, prompts, are a
# few per cell and always kept); Ticks are not kept at all: they only refresh clocks
_BULK = (P.Output, P.RankWhere, P.RankProgress, P.RankMetrics, P.RankDisplay)
_WORDS = {P.Output: "lines printed", P.RankMetrics: "metrics points"}


def _bulk(item: object) -> type | None:
    event = item.event if isinstance(item, Event) else None
    return type(event) if isinstance(event, _BULK) else None


def _size(item: object) -> int:
    """About what ``item`` holds in memory, cheaply: its text or payload, plus a header."""
    event = item.event
    if isinstance(event, P.Output):
        return 100 + len(event.text)
    if isinstance(event, P.RankDisplay):
        return 100 + sum(len(v) for v in event.data.values() if isinstance(v, str | bytes))
    return 300


class Backlog:
    """What waits for a kernel to read it, in order, bounded: at most ``limit`` bulk
    events (output, metrics, progress, places, displays) of at most ``max_bytes``
    together; the oldest go first, counted by kind in :attr:`dropped` and said by
    :meth:`said_dropped`. Ticks are not kept; every other event is.

    Before, only output was bounded: a supervisor with no kernel kept a Tick every
    0.1 s, every stack sample and every metrics point (about 145 MB a day)."""

    def __init__(self, limit: int = BACKLOG, max_bytes: int = BACKLOG_BYTES) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.items: deque = deque()
        self.bulk = 0  # bulk events held
        self.bytes = 0  # their size (:func:`_size`)
        self.dropped: Counter = Counter()  # kind -> bulk events dropped so far

    def __len__(self) -> int:
        return len(self.items)

    def extend(self, items, front: bool = False) -> None:
        items = [i for i in flat(items) if not is_tick(i)]
        if front:
            self.items.extendleft(reversed(items))
        else:
            self.items.extend(items)
        for item in items:
            if _bulk(item):
                self.bulk += 1
                self.bytes += _size(item)
        if self.bulk > self.limit * 1.25 or self.bytes > self.max_bytes:  # (amortized)
            self._drop()

    def pop(self) -> object:
        item = self.items.popleft()
        if _bulk(item):
            self.bulk -= 1
            self.bytes -= _size(item)
        return item

    def take(self) -> tuple:
        items, self.items, self.bulk, self.bytes = tuple(self.items), deque(), 0, 0
        return items

    def said_dropped(self) -> str:
        """``1,200 lines printed, 300 metrics points and 40 other events`` ("" if none)."""
        other = sum(n for kind, n in self.dropped.items() if kind not in _WORDS)
        parts = [f"{self.dropped[k]:,} {w}" for k, w in _WORDS.items() if self.dropped[k]]
        parts += [f"{other:,} other events (progress, places, displays)"] if other else []
        return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)

    def _drop(self) -> None:
        count = max(0, self.bulk - self.limit)
        excess = max(0, self.bytes - self.max_bytes * 3 // 4)  # (then room for a while)
        kept: deque = deque()
        for item in self.items:
            kind = _bulk(item)
            if kind and (count > 0 or excess > 0):
                size = _size(item)
                count, excess = count - 1, excess - size
                self.bulk, self.bytes = self.bulk - 1, self.bytes - size
                self.dropped[kind] += 1
            else:
                kept.append(item)
        self.items = kept
