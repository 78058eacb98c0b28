"""The roster: the pool's rank table, each rank's state, and the start handshake.

A rank record holds what the notebook knows of one rank (pid, host, device, state,
the names in its namespace) and its :class:`~nbddp.pool.hub.Link`. New connections
come here from the hub (:meth:`Roster.attach`): a rank's Hello makes or completes its
record, its two StreamHellos add its streams, a relay's hello adds a relay. The
handshake (:meth:`Roster.handshake`) waits until every rank is in the group, Ready.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..wire import protocol as P
from ..wire.slurm import checked
from .errors import PoolStartError, describe_exit
from .hub import Gone, Hub, Link, Msg, RelayLink, Stream, Text

__all__ = ["Rank", "RankGone", "Roster"]

EXPLAINED_WITHIN = 1.0  # s a failed re-form waits for the death that explains it
MAX_TURNED = 256  # connections turned away kept open at most (the oldest is closed)


class RankGone(PoolStartError):
    """A rank's process ended while the ranks were starting or forming the group."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class Rank:
    rank: int
    pid: int
    host: str = ""
    link: Link = field(default_factory=Link)
    state: str = "starting"  # starting | idle | running | dead
    device: str = ""
    backend: str = ""
    started: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    names: frozenset[str] = frozenset()  # the rank's global names, as last reported
    modules: frozenset[str] = frozenset()  # which of them are modules
    held: tuple[P.Held, ...] = ()  # every global name with its kind and size (P.Held)
    rebound: tuple[str, ...] = ()  # its last re-form: the DDP models it bound again
    stale: tuple[P.Stale, ...] = ()  # its last re-form: what is still bound to the old group
    weights: tuple[tuple[str, str, str], ...] = ()  # its last re-form: P.Ready.weights
    renewable: bool = False  # attached: a holder on its host forks a new process if it dies
    slurm: P.Slurm | None = None  # attached under SLURM: its job, node rank and master
    # its namespace's number: each record is one process, so one namespace (Pool.namespaces)
    namespace: int = field(default_factory=lambda: secrets.randbits(62))

    def send(self, msg: object) -> bool:
        return self.send_bytes(P.dumps(msg))

    def send_bytes(self, data: bytes) -> bool:
        link = self.link
        if link.conn is None or self.state == "dead":
            return False
        if link.relay is not None:
            return link.relay.send((self.rank,), data)
        try:
            link.conn.send_bytes(data)
            return True
        except OSError:
            return False


TAKES_NONE = (  # why an attached pool that lost a rank turns a worker away
    "an attached pool takes no new worker (torchrun --max-restarts restarted it?): end "
    "torchrun, start it again and attach again"
)


def _version_error(who: str, version: int) -> PoolStartError:
    return PoolStartError(
        f"{who} speaks protocol {version}, the notebook {P.PROTOCOL_VERSION}: "
        "install the same nbddp version on every host"
    )


class Roster:
    """The rank table of one pool and how ranks join it."""

    def __init__(self, world_size: int, attached: bool) -> None:
        self.world_size = world_size
        self.attached = attached  # ranks started elsewhere join by their Hello
        self.ranks: dict[int, Rank] = {}
        self.hub: Hub | None = None
        self.store_port: int | None = None  # the group's store, as rank 0 reported it
        self.reforms = 0  # re-forms of the group (generations), each named in the store
        self.deaths: dict[int, list[float]] = {}  # rank -> when its processes died
        self._reform_failed: tuple[float, str] | None = None  # (when, why), this generation
        self.backlog: list[P.Output] = []  # output between cells, said with the next
        self.on_join: Callable[[int, int], None] | None = None
        self.refuse: Callable[[str], None] = lambda _line: None
        self._early: dict[int, list] = {}  # attached: streams that came before their rank
        # attached, stopped: why it takes no rank now (each one that comes is turned away)
        self.closed_to: str | None = None
        self.renewing: P.Reform | None = None  # attached: the re-form new processes join
        self.missing: dict[int, str] = {}  # attached: ranks of lost hosts -> their host
        # connections turned away, closed with the pool (not at once: a close with the
        self._turned: list = []  # peer's bytes unread resets it before it reads why)

    # ------------------------------------------------------------ the table

    def __getitem__(self, rank: int) -> Rank:
        return self.ranks[rank]

    def live(self) -> list[Rank]:
        return [r for r in self.ranks.values() if r.state != "dead"]

    @property
    def started(self) -> bool:
        return bool(self.ranks) and all(r.state in ("idle", "running") for r in self.ranks.values())

    def pids(self) -> dict[int, int]:
        return {r.rank: r.pid for r in self.ranks.values() if r.state != "dead"}

    def names_on(self, ranks: list[int] | None = None) -> frozenset[str]:
        chosen = [self.ranks[r] for r in (ranks if ranks is not None else self.ranks)]
        return frozenset.intersection(*(r.names for r in chosen)) if chosen else frozenset()

    def hosts(self) -> dict[int, str]:
        hosts = {r.rank: r.host for r in self.ranks.values()}
        return hosts if len(set(hosts.values())) > 1 else {}

    def backend(self) -> str:
        return next((r.backend for r in self.ranks.values() if r.backend), "")

    def add(self, rank: int, pid: int) -> None:
        self.ranks[rank] = Rank(rank, pid)

    def clear(self) -> list[Rank]:
        """Forget every rank and early stream; the connections to close."""
        ranks = list(self.ranks.values())
        for conn in self._turned:
            conn.close()
        self._turned.clear()
        for early in self._early.values():
            for conn, _, relay in early:
                if relay is None:
                    conn.close()
        self._early.clear()
        self.ranks.clear()
        self.store_port = None
        self.reforms = 0  # (a new pool has a new store)
        self.deaths.clear()
        self.missing.clear()
        return ranks

    def forget(self, rank: int) -> None:
        """Close a dead rank's connections: a new process is about to take its place (behind
        a relay, the connection is the relay's: its other ranks keep it)."""
        link = self.ranks[rank].link
        if link.relay is not None:
            link.relay.ranks.discard(rank)
            return
        for conn in link.connections():
            self.hub.unwatch_conn(conn)
            conn.close()

    # ------------------------------------------------------------ joining

    def arrive(self, conn, hello: object, raw: bytes = b"") -> None:
        """A connection the listener authenticated (from its thread): to the hub; or, when
        this pool takes no rank now, turned away at once with the reason (no one may read
        the hub before the next cell, and the worker would wait for it)."""
        why = self.closed_to
        if why is None or not isinstance(hello, (P.Hello, P.RelayHello, P.StreamHello)):
            self.hub.arrive(conn, hello, raw)
        else:
            self.turn_away(conn, hello, None, why)

    def turn_away(self, conn, hello, relay: RelayLink | None, why: str) -> None:
        """Tell a rank (a relay: each of its ranks) that connected why this pool does not
        take it, and count the refusal (said in the notebook). Its streams just close."""
        if isinstance(hello, P.StreamHello):
            if relay is None:
                conn.close()
            return
        data = P.dumps(P.Refused(why))
        if relay is not None:
            relay.send((hello.rank,), data)
        else:
            if isinstance(hello, P.RelayHello):
                RelayLink(conn, hello).send((), data)  # (): each of its ranks, now and later
            else:
                with contextlib.suppress(OSError):
                    conn.send_bytes(data)
            self._turned.append(conn)
            while len(self._turned) > MAX_TURNED:
                self._turned.pop(0).close()
        who = "the relay" if isinstance(hello, P.RelayHello) else f"rank {hello.rank}"
        self.refuse(f"turned away {who} of {hello.host}: {why}")

    def attach(self, conn, hello: object, relay: RelayLink | None = None) -> None:
        """A connection that proved it holds the token, and its first message."""
        if isinstance(hello, P.RelayHello):
            if hello.version != P.PROTOCOL_VERSION:
                conn.close()
                raise _version_error(f"the relay of {hello.host}", hello.version)
            self.hub.add_relay(RelayLink(conn, hello))
            return
        rank = getattr(hello, "rank", -1)
        joins = self.attached and isinstance(hello, P.Hello) and rank not in self.ranks
        if joins and not self._admit(conn, hello):
            return
        r = self.ranks.get(rank)
        if r is None and self.attached and isinstance(hello, P.StreamHello):
            # its stream finished the handshake before its control connection did
            self._early.setdefault(rank, []).append((conn, hello, relay))
            return
        if self.attached and r is not None and r.state == "dead" and self._renews(r, hello):
            self._early.setdefault(rank, []).append((conn, hello, relay))  # (see renew)
            return
        if self.attached and r is not None and r.state == "dead" and isinstance(hello, P.Hello):
            self.turn_away(conn, hello, relay, f"rank {rank} died and {TAKES_NONE}")
            return
        if r is None or r.state == "dead" or not isinstance(hello, (P.Hello, P.StreamHello)):
            if relay is None:
                conn.close()
            return
        if isinstance(hello, P.Hello):
            self._hello(r, conn, hello, relay)
        else:
            self._stream(r, conn, hello, relay)

    def _renews(self, r: Rank, hello) -> bool:
        """A new process of a dead rank its host's holder forked: kept until the re-form
        that takes it in (:meth:`renew`)."""
        return (
            r.renewable
            and self.closed_to is None
            and isinstance(hello, (P.Hello, P.StreamHello))
            and (not isinstance(hello, P.Hello) or hello.held)
        )

    def parked(self, rank: int) -> P.Hello | None:
        """The Hello of a new process held back for dead ``rank`` (:meth:`renew`), if any."""
        return next((h for _, h, _ in self._early.get(rank, ()) if isinstance(h, P.Hello)), None)

    def renew(self, rank: int) -> None:
        """Attached: a new record for ``rank``, which died; its holder's new process joins
        it (its connections, if they came already, are taken now; else as they come)."""
        self.ranks[rank] = Rank(rank, 0)
        early = self._early.pop(rank, [])
        early.sort(key=lambda item: not isinstance(item[1], P.Hello))  # its Hello first
        for item in early:
            self.attach(*item)

    def _admit(self, conn, hello: P.Hello) -> bool:
        if hello.world_size != self.world_size or not 0 <= hello.rank < self.world_size:
            conn.close()
            self.refuse(
                f"refused rank {hello.rank} of a world of {hello.world_size}: "
                f"this pool waits for {self.world_size} ranks"
            )
            return False
        self.ranks[hello.rank] = Rank(hello.rank, hello.pid)
        return True

    def _hello(self, r: Rank, conn, hello: P.Hello, relay: RelayLink | None) -> None:
        if hello.version != P.PROTOCOL_VERSION:
            if relay is None:
                conn.close()
            raise _version_error(f"rank {hello.rank}", hello.version)
        if r.link.conn is not None:  # its control connection is there: this one is not it
            if relay is None:
                conn.close()
            self.refuse(f"refused a second connection for rank {r.rank}: it is connected")
            return
        r.link.conn, r.link.relay, r.pid, r.host = conn, relay, hello.pid, hello.host
        r.renewable = hello.held
        r.slurm = checked(hello.slurm)  # (shown in a command: never as it came)
        if relay is None:
            self.hub.watch(conn.fileno(), (r.rank, None))
        else:
            relay.ranks.add(r.rank)
        for early in self._early.pop(r.rank, ()):
            self.attach(*early)
        if self.store_port is not None and r.rank != 0:
            r.send(P.JoinGroup(self.store_port))
        if self.renewing is not None:  # a new process of a dead rank: the re-form it joins
            r.send(replace(self.renewing, new=True))
        elif hello.held:  # a held rank waits for the word to join: the first group
            r.send(P.Reform(0, new=True))
        if self.on_join is not None:
            self.on_join(len(self.ranks), self.world_size)

    def _stream(self, r: Rank, conn, hello: P.StreamHello, relay: RelayLink | None) -> None:
        if relay is not None:
            r.link.streams[hello.stream] = Stream(None, hello.stream)
            return
        stream = r.link.streams[hello.stream] = Stream(conn, hello.stream)
        self.hub.watch(stream.fd, (r.rank, stream))

    def set_store_port(self, port: int) -> None:
        """Rank 0 formed the group's store: the others join it."""
        self.store_port = port
        others = [r for r in self.ranks.values() if r.rank != 0 and r.link.conn is not None]
        self.hub.deliver([r.rank for r in others], P.dumps(P.JoinGroup(port)))

    # ------------------------------------------------------------ the handshake

    def ready(self) -> bool:
        return len(self.ranks) == self.world_size and all(
            r.state == "idle" and r.link.connected for r in self.ranks.values()
        )

    def handshake(
        self,
        timeout: float,
        exit_code: Callable[[Rank], int | None],
        log_tail: Callable[[int], str],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Wait until every rank is in the group and idle; PoolStartError otherwise."""
        deadline = time.monotonic() + timeout
        self._reform_failed = None
        while not self.ready():
            left = deadline - time.monotonic()
            failed = self._reform_failed
            if failed is not None and time.monotonic() > failed[0] + EXPLAINED_WITHIN:
                raise PoolStartError(failed[1])  # no death explains it
            if cancelled():
                raise PoolStartError("interrupted while waiting for the ranks")
            if left <= 0:
                waiting = [
                    r
                    for r in range(self.world_size)
                    if r not in self.ranks or self.ranks[r].state != "idle"
                ]
                raise PoolStartError(
                    f"ranks {waiting} did not start within {timeout:g} s" + log_tail(waiting[0])
                )
            for item in self.hub.pump(min(left, 0.25 if failed else 1.0)):
                self._handshake_item(item, exit_code, log_tail)
        joined = sorted(self.ranks.items())  # ranks joined in any order
        self.ranks.clear()  # (the same dict: the hub reads it)
        self.ranks.update(joined)

    def keep_output(self, items: list) -> None:
        """Output that came outside a cell: said at the start of the next one."""
        self.backlog += [P.Output(i.rank, i.stream, i.text) for i in items if type(i) is Text]

    def _handshake_item(self, item, exit_code, log_tail) -> None:
        kind = type(item)
        if kind is Text:
            self.keep_output([item])
        elif kind is Gone:
            code = exit_code(self.ranks[item.rank])
            raise RankGone(
                item.rank,
                f"rank {item.rank} exited while starting ({describe_exit(code)})"
                + log_tail(item.rank),
            )
        elif kind is Msg:
            handler = self._STARTING.get(type(item.msg))
            if handler is not None:
                handler(self, self.ranks[item.rank], item.msg)

    def _store_port(self, _r: Rank, msg: P.StorePort) -> None:
        self.set_store_port(msg.port)

    def _ready(self, r: Rank, msg: P.Ready) -> None:
        if msg.generation != self.reforms:
            return  # it joined a re-form a death made the pool give up on
        r.state, r.backend, r.device = "idle", msg.backend, msg.device
        r.rebound, r.stale, r.weights = msg.rebound, msg.stale, msg.weights
        if msg.names:
            r.names, r.modules = frozenset(msg.names), frozenset(msg.modules)
        if msg.held:
            r.held = msg.held

    def _failed_reform(self, r: Rank, msg: P.ReformFailed) -> None:
        if msg.generation == self.reforms and self._reform_failed is None:
            error = msg.error
            self._reform_failed = (
                time.monotonic(),
                f"rank {r.rank} could not join the re-formed group: "
                f"{error.exc_type}: {error.message}",
            )

    def _fatal(self, r: Rank, msg: P.Fatal) -> None:
        raise PoolStartError(f"rank {r.rank} failed to start:\n{msg.error.traceback}")

    # what a starting rank's messages do (others wait for its first cell, or are late)
    _STARTING = {
        P.StorePort: _store_port,
        P.Ready: _ready,
        P.ReformFailed: _failed_reform,
        P.Fatal: _fatal,
    }
