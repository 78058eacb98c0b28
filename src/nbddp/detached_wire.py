"""The messages between a kernel and a detached pool's supervisor, and where pools live.

A detached pool (``%ddp start --detached NAME``) is a :class:`~nbddp.pool.Pool`
run by a supervisor process of its own (:mod:`nbddp.detached`); a kernel is
its client (:mod:`nbddp.detached_client`) over one Unix socket in the pool's
private folder, ``~/.nbddp/pools/NAME/`` (0700), authenticated with the
token in ``token`` (0600) by :mod:`nbddp.handshake`'s SHA-256 challenge, both ways,
before anything is unpickled. These messages carry the user's own values (a
call's arguments, a cell's results) and are unpickled whole: both ends are
processes of the same user, on a socket only that user can reach::

    kernel                                   supervisor
    Hello(pid, force) ---------------------->
                   <------------------------ Welcome(state, resumed) | Refused(reason)
                   <------------------------ Event ... (a cell that ran meanwhile)
    Call(method, args, kwargs) ------------->
                   <------------------------ Reply(value, state) | Failed(...)
    RunCell(kwargs) ------------------------>
                   <------------------------ Event ... Event(CellEnd), then Reply
    Interrupt | DebugReply (any time) ------>
                   <------------------------ TakenOver(pid)   (another kernel connected)
"""

from __future__ import annotations

import os
import pickle
import threading
from dataclasses import dataclass, field

from .wire import Channel

__all__ = [
    "Batch",
    "Call",
    "DebugReply",
    "Event",
    "Failed",
    "Hello",
    "Interrupt",
    "Link",
    "PoolState",
    "Refused",
    "Reply",
    "RunCell",
    "TakenOver",
    "Welcome",
    "folder_of",
    "pools_folder",
]

VERSION = 1


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


def folder_of(name: str) -> str:
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a detached pool's name is letters, digits, - and _, not {name!r}")
    return os.path.join(pools_folder(), name)


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


@dataclass(frozen=True)
class Hello:
    pid: int
    force: bool = False  # take over from a kernel that is connected
    peek: bool = False  # only ask what the pool is (%ddp list): a Reply, then goodbye
    version: int = VERSION


@dataclass(frozen=True)
class Welcome:
    state: PoolState
    resumed: bool  # a cell ran while no kernel was connected: its events follow


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


@dataclass(frozen=True)
class Reply:
    value: object
    state: PoolState


@dataclass(frozen=True)
class Failed:
    exc_type: str  # the name of an nbddp error class, or of a builtin one
    message: str
    state: PoolState


@dataclass(frozen=True)
class RunCell:
    kwargs: dict  # Pool.run's; shipments as (data, files)


@dataclass(frozen=True)
class Event:
    event: object  # an nbddp.events event


@dataclass(frozen=True)
class Batch:
    """Events (and the reply that ends a cell) sent together: the supervisor holds what
    comes while it works and sends it before it waits, so a cell costs one message, not
    one per event, and no event waits."""

    items: tuple


@dataclass(frozen=True)
class Interrupt:
    pass


@dataclass(frozen=True)
class DebugReply:
    prompt: object  # the RankDebug it answers
    line: str | None
