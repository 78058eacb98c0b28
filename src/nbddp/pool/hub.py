"""The hub: every connection of every rank, read in one place and turned into typed items.

One selector holds, for the pool's whole life, each rank's control connection
and its two output streams, each host relay's connection, the launcher's exit
sentinels and a wake pipe (other threads write to it to end a wait).
:meth:`Hub.pump` waits on all of them at once and returns what happened as
items, in the order it was read:

=================================  =============================================
``Text(rank, stream, text)``       output a rank wrote
``Mark(rank, stream, cell)``       the end marker of ``cell`` on that stream
``Closed(rank, stream)``           the stream ended (the rank closed it, or went)
``Msg(rank, msg)``                 a control message
``Dones(ranks, msg)``              the same Done from each of ``ranks`` (a relay)
``Gone(rank, why)``                its control connection closed or its process ended
                                   (``why``: a frame failed its check, in words)
=================================  =============================================

The hub knows connections, not what ranks are doing: a rank table it is given
(``ranks``: rank -> an object with ``state`` and ``link``) says which ranks are
still wanted. New connections are handed to ``on_hello`` as they come.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field

from ..wire import protocol as P
from ..wire.frames import Channel, FrameError
from ..wire.streams import Stream

__all__ = ["Closed", "Dones", "Gone", "Hub", "Link", "Mark", "Msg", "RelayLink", "Text"]

INLINE = 1 << 16  # messages to ranks behind a relay up to this size travel in the frame


@dataclass(frozen=True, slots=True)
class Text:
    rank: int
    stream: str
    text: str


@dataclass(frozen=True, slots=True)
class Mark:
    rank: int
    stream: str
    cell: int


@dataclass(frozen=True, slots=True)
class Closed:
    rank: int
    stream: str


@dataclass(frozen=True, slots=True)
class Msg:
    rank: int
    msg: object


@dataclass(frozen=True, slots=True)
class Dones:
    ranks: tuple[int, ...]
    msg: P.Done


@dataclass(frozen=True, slots=True)
class Gone:
    rank: int
    why: str = ""  # the connection was closed for this (a frame failed its check)


Item = Text | Mark | Closed | Msg | Dones | Gone


class RelayLink:
    """A host's relay (nbddp.hosts.relay): one connection carries all its ranks' traffic."""

    def __init__(self, conn: Channel, hello: P.RelayHello) -> None:
        self.conn, self.host, self.pid = conn, hello.host, hello.pid
        self.ranks: set[int] = set()
        self.ended = False  # its connection closed: its host's ranks cannot come back

    def send(self, ranks: tuple[int, ...], data: bytes, cell: int = 0) -> bool:
        """``data`` for each of ``ranks`` (``cell``: it is that cell's Run), in one frame;
        a big message follows its frame as it is, not copied into a pickle."""
        big = len(data) > INLINE
        frame = pickle.dumps((ranks, cell, None if big else data), pickle.HIGHEST_PROTOCOL)
        try:
            self.conn.send_bytes(frame)
            if big:
                self.conn.send_bytes(data)
            return True
        except OSError:
            return False


@dataclass
class Link:
    """How the notebook reaches one rank: its control connection (behind a relay, the
    relay's) and its output streams."""

    conn: Channel | None = None
    relay: RelayLink | None = None
    streams: dict[str, Stream] = field(default_factory=dict)

    @property
    def connected(self) -> bool:
        return self.conn is not None and len(self.streams) == 2

    def open_streams(self) -> set[str]:
        """The streams still open: an end marker can come only on those."""
        return {name for name, s in self.streams.items() if not s.eof}

    def connections(self) -> list[Channel]:
        return [c for c in [self.conn, *(s.conn for s in self.streams.values())] if c]


class Hub:
    """Owns the selector over every fd of the pool; reads bytes, returns items."""

    _SENTINEL = ("sentinel",)

    def __init__(self, ranks: dict, on_hello: Callable, sentinels: Callable[[], list]) -> None:
        self.ranks = ranks  # rank -> an object with .state and .link (the roster's table)
        self.on_hello = on_hello  # (conn, hello, relay) for each new connection
        self.sentinels = sentinels  # the launcher's exit sentinels, now
        self.exits: Callable[[], list[int]] = list  # ranks whose process ended, now
        self.log: Callable[[int, str, str], None] | None = None  # every text read, as read
        self.before_wait: Callable[[], None] | None = None  # called before pump may block
        self.relays: list[RelayLink] = []
        self.closed: list[str] = []  # connections closed for what they sent, in words
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()  # (conn, hello), authenticated
        self.held: list[Item] = []  # read by a question between cells, for the next cell
        self._selector: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = -1
        self._sentinel_fds: set[int] = set()
        self.open()

    def open(self) -> None:
        """The selector and its wake pipe; made again after :meth:`close` (a stopped pool
        started again). One selector for a pool's run: registering thousands of
        connections at every wait made a cell's cost grow with the square of the ranks."""
        if self._selector is not None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(r, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = r, w

    def close(self) -> None:
        """Give the selector and the wake pipe back: a stopped pool holds no descriptor
        (a session that starts and stops pools would otherwise gather three a pool)."""
        selector, self._selector = self._selector, None
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        self._sentinel_fds = set()
        if selector is not None:
            selector.close()
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def wake(self) -> None:
        """End a wait in :meth:`pump` (from any thread)."""
        fd = self._wake_w
        if fd >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(fd, b"!")

    def arrive(self, conn: Channel, hello: object, _raw: bytes = b"") -> None:
        """A connection the listener authenticated (from its thread): attached at the
        next pump, in the pump's thread (its first message's bytes are not needed here)."""
        self.arrived.put((conn, hello))
        self.wake()

    # ------------------------------------------------------------ watching fds

    def watch(self, fd: int, data: object) -> None:
        self.open()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)  # a number reused after a close
        self._selector.register(fd, selectors.EVENT_READ, data)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError, AttributeError):  # (None: closed)
            self._selector.unregister(fd)

    def unwatch_conn(self, conn: Channel) -> None:
        if not conn.closed:
            self.unwatch(conn.fileno())

    def add_relay(self, relay: RelayLink) -> None:
        self.relays.append(relay)
        self.watch(relay.conn.fileno(), relay)

    def close_relays(self) -> None:
        for relay in self.relays:
            self.unwatch_conn(relay.conn)
            relay.conn.close()
        self.relays.clear()

    def forget_sentinels(self) -> None:
        """The launcher's ranks were reaped (their pidfds closed): the next ranks' sentinels
        may reuse those fd numbers, and must be registered anew."""
        for fd in self._sentinel_fds:
            self.unwatch(fd)
        self._sentinel_fds = set()

    def _watch_sentinels(self) -> None:
        """Keep the launcher's exit sentinels registered."""
        fds = {o if isinstance(o, int) else o.fileno() for o in self.sentinels()}
        for fd in self._sentinel_fds - fds:
            self.unwatch(fd)
        for fd in fds - self._sentinel_fds:
            self.watch(fd, self._SENTINEL)
        self._sentinel_fds = fds

    # ------------------------------------------------------------ reading

    def pump(self, timeout: float | None) -> list[Item]:
        """Wait for anything on any connection, stream or sentinel; return what happened."""
        if timeout != 0 and self.before_wait is not None:
            self.before_wait()  # (a detached pool's supervisor: what it holds for the kernel)
        self.open()
        self._watch_sentinels()
        items, self.held = self.held, []
        ended = False
        for key, _ in self._selector.select(timeout):
            what = key.data
            if what is None:  # the wake pipe
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif what is self._SENTINEL:
                ended = True
            elif isinstance(what, RelayLink):
                items += self._service_relay(what)
            else:
                items += self._service(key.fd, *what)
        while not self.arrived.empty():
            self.on_hello(*self.arrived.get(), None)
        if ended:
            gone = {i.rank for i in items if type(i) is Gone}
            items += [Gone(rank) for rank in self.exits() if rank not in gone]
        return items

    def _closed(self, rank: int, why: str) -> Gone:
        """The rank's connection was closed for what came on it: said with the next cell."""
        r = self.ranks.get(rank)
        host = getattr(r, "host", "")
        self.closed.append(
            f"rank {rank}'s connection was closed{f' (host {host})' if host else ''}: {why}"
        )
        return Gone(rank, why)

    def live(self, rank: int) -> bool:
        r = self.ranks.get(rank)
        return r is not None and r.state != "dead"

    def _service(self, fd: int, rank: int, s: Stream | None) -> list[Item]:
        """What came on one connection: a message, stream text, or the end of it."""
        r = self.ranks.get(rank)
        if r is None or r.state == "dead" or r.link.conn is None:  # nothing more is wanted
            self.unwatch(fd)
            return []
        if s is None:
            conn, items = r.link.conn, []
            try:
                while True:
                    items.append(Msg(rank, P.loads(conn.recv_bytes(ready=True))))
                    if not conn.pending():  # (TLS: more already read and decrypted)
                        return items
            except FrameError as exc:
                return [*items, self._closed(rank, f"a frame failed its check: {exc}")]
            except TimeoutError as exc:
                return [*items, self._closed(rank, f"a frame stalled ({exc})")]
            except (EOFError, OSError):
                return [*items, Gone(rank)]
            except Exception as exc:  # a message this side cannot decode
                conn.close()
                return [*items, self._closed(rank, f"it sent what is not a message ({exc})")]
        items = self._stream_items(rank, s, s.read(ready=True))
        if s.eof:
            self.unwatch(fd)
        if s.failed:  # its rank cannot be trusted with the rest: it is gone
            items.append(self._closed(rank, f"its {s.name} failed a check: {s.failed}"))
            s.failed = ""
        return items

    def _service_relay(self, relay: RelayLink) -> list[Item]:
        """What came from a host's relay: the same items as from its ranks, one frame."""
        items: list[Item] = []
        why = ""
        try:
            while True:
                for item in P.loads_plain(relay.conn.recv_bytes(ready=True)):
                    items += self._RELAYED[item[0]](self, relay, item)
                if not relay.conn.pending():  # (TLS: more already read and decrypted)
                    return items
        except Exception as exc:  # the relay ended, or must
            if not isinstance(exc, (EOFError, OSError)) or isinstance(exc, FrameError):
                why = f"what it sent failed a check: {exc}"
        self.unwatch_conn(relay.conn)  # its ranks' connections ended with it
        relay.conn.close()
        relay.ended = True
        if relay in self.relays:
            self.relays.remove(relay)
        ranks = [rank for rank in sorted(relay.ranks) if self.live(rank)]
        if why:
            self.closed.append(f"the connection of host {relay.host}'s relay was closed: {why}")
        return items + [Gone(rank, why) for rank in ranks]

    def _relayed_out(self, _relay: RelayLink, item: tuple) -> list[Item]:
        rank = item[1]
        s = self.ranks[rank].link.streams.get(item[2]) if self.live(rank) else None
        return [] if s is None else self._stream_items(rank, s, s.feed(item[3]))

    def _relayed_done(self, _relay: RelayLink, item: tuple) -> list[Item]:
        # equal for every one of the ranks: decoded once
        return [Dones(tuple(r for r in item[1] if self.live(r)), P.loads(item[2]))]

    def _relayed_msg(self, _relay: RelayLink, item: tuple) -> list[Item]:
        return [Msg(item[1], P.loads(item[2]))] if self.live(item[1]) else []

    def _relayed_gone(self, _relay: RelayLink, item: tuple) -> list[Item]:
        return [Gone(item[1])] if self.live(item[1]) else []

    def _relayed_hello(self, relay: RelayLink, item: tuple) -> list[Item]:
        self.on_hello(relay.conn, P.loads(item[2]), relay)
        return []

    _RELAYED = {
        "out": _relayed_out,
        "done": _relayed_done,
        "msg": _relayed_msg,
        "gone": _relayed_gone,
        "hello": _relayed_hello,
    }

    # ------------------------------------------------------------ sending

    def deliver(self, ranks, data: bytes, cell: int = 0) -> None:
        """Send one message to each of ``ranks``: one frame per relay, not one per rank.
        ``cell``: the message is that cell's Run."""
        via: dict[RelayLink, list[int]] = {}
        for rank in ranks:
            r = self.ranks[rank]
            if r.link.relay is None:
                r.send_bytes(data)
            elif r.state != "dead":
                via.setdefault(r.link.relay, []).append(rank)
        for relay, some in via.items():
            relay.send(tuple(some), data, cell)

    def drain(self, rank: int) -> list[Item]:
        """What a rank had already written (it ended, or is about to be stopped)."""
        items: list[Item] = []
        for s in self.ranks[rank].link.streams.values():
            items += self._stream_items(rank, s, s.read_available())
        return [i for i in items if type(i) is Text]

    def _stream_items(self, rank: int, s: Stream, pieces: list[str | int]) -> list[Item]:
        if self.log is not None:
            for p in pieces:
                if isinstance(p, str):
                    self.log(rank, s.name, p)
        return stream_items(rank, s, pieces)


def stream_items(rank: int, s: Stream, pieces: list[str | int]) -> list[Item]:
    items: list[Item] = [
        Mark(rank, s.name, p) if isinstance(p, int) else Text(rank, s.name, p) for p in pieces
    ]
    if s.eof:
        items.append(Closed(rank, s.name))
    return items
