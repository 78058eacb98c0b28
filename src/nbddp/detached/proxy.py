"""A kernel's side of a detached pool, once connected (:mod:`nbddp.detached.client`
starts one, connects, lists and stops them by name).

:class:`DetachedPool` stands for the pool in the kernel: it has what the front
end uses of a :class:`~nbddp.pool.facade.Pool` (``run`` gives the same events, ``--out``
values are loaded here, ``interrupt`` and pdb answers go out at once), and
each reply brings the pool's state along. Big tensors still go through the
pool's shared-memory folder, written here and read by the ranks: nothing big
passes through the supervisor.

Each request has an id, and what comes back is routed by it: a request's answer
is never another's. A cell whose events were not read to the end (a loop left
early, Ctrl-C before the events were shown) is interrupted and read to its end
before the next request, its events dropped and a note said; a cell that ran
while no kernel was connected is kept for :meth:`DetachedPool.resume`, whatever
is asked meanwhile.
"""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator

from ..pool import capture
from ..pool import errors as E
from ..pool.calls import PoolCalls
from ..pool.cell import left_unread
from ..pool.outcome import RawValue, load_value
from ..wire import payload
from ..wire import protocol as P
from . import folder as F
from . import messages as W

__all__ = ["DetachedPool"]

REPLY_TIMEOUT = 120.0  # s a call may go without a word (a restart, a copy of a big model)
BYE_TIMEOUT = 10.0  # s a disconnect waits for the supervisor to say it sends no more
STUCK_AFTER = 10.0  # s past the grace period an interrupt may go unanswered


class DetachedPool(PoolCalls):
    """A detached pool, as this kernel sees it."""

    detached = True

    def __init__(self, conn: W.Link, welcome: W.Welcome) -> None:
        self.conn = conn
        self._state: W.PoolState = welcome.state
        self._send_lock = threading.Lock()
        self.notes: list[str] = []  # said with the next cell's end
        self.closed = False
        self.why_closed = ""  # what ended this kernel's connection, for the next cell
        self.gone = False  # the supervisor ended (not a disconnect, not a takeover)
        self._inbox: deque = deque()  # the rest of a Batch, in order
        self._ids = itertools.count(secrets.randbits(48))  # no other kernel's ids
        self._resumed = welcome.resumed  # a cell that ran meanwhile: resume() reads it
        self._kept: dict[int, W.Backlog] = {}  # what came for it while we read another
        if self._resumed is not None:
            self._kept[self._resumed] = W.Backlog()
        self._open: int | None = None  # our cell whose events were not read to the end
        self._reading: int | None = None  # the cell whose events are being read
        self._asked: float | None = None  # when it was asked to stop (interrupt)
        self._end_read: int | None = None  # the cell whose CellEnd was read

    # -- what it is (as of the last reply)

    name = property(lambda self: self._state.name)
    world_size = property(lambda self: self._state.world_size)
    started = property(lambda self: self._state.started and not self.closed)
    needs_restart = property(lambda self: self._state.needs_restart)
    hosts = property(lambda self: self._state.hosts)
    shm_folder = property(lambda self: self._state.shm_folder)
    generation = property(lambda self: self._state.generation)
    devices = property(lambda self: self._state.devices)
    pids = property(lambda self: self._state.pids)
    namespaces = property(lambda self: self._state.namespaces)  # (fresh ones: new numbers)
    backend_in_use = property(lambda self: self._state.backend)
    last_stacks = property(lambda self: self._state.last_stacks)
    attached = property(lambda self: self._state.attached)  # ranks torchrun started
    missing = property(lambda self: self._state.missing)  # (nbddp.pool.hosts_lost.seen)
    missing_back = property(lambda self: self._state.missing_back)

    @property
    def resumed(self) -> bool:
        """A cell ran while no kernel was connected, and :meth:`resume` has not read it."""
        return self._resumed is not None

    def names_on(self, ranks=None) -> frozenset[str]:
        return self._call("names_on", ranks)

    def shipped_on(self, ranks=None) -> frozenset[str]:
        return self._call("shipped_on", ranks)

    def ready(self) -> None:
        """The supervisor's pool, ready for a cell (a dead rank replaced) before this
        kernel decides what to ship."""
        self._call("ready")

    # -- the wire

    def _put(self, msg: object) -> None:
        if self.closed:
            raise E.PoolClosedError(
                self.why_closed or f"disconnected from the detached pool {self.name}"
            )
        with self._send_lock:
            try:
                self.conn.send(msg)
            except OSError:
                self._gone()

    def _receive(self, timeout: float | None) -> object:
        """The next message from the supervisor (a Batch's, one by one)."""
        while not self._inbox:
            msg = self._recv(timeout)
            if isinstance(msg, W.Batch):
                self._inbox.extend(msg.items)
            else:
                self._inbox.append(msg)
        msg = self._inbox.popleft()
        if isinstance(msg, W.TakenOver):
            self._close(
                f"another kernel (pid {msg.pid}) took the detached pool {self.name} over: "
                f"`%ddp connect {self.name} --force` takes it back"
            )
        if isinstance(msg, (W.Reply, W.Failed)):
            self._state = msg.state
        return msg

    def _recv(self, timeout: float | None) -> object:
        if self.closed:
            raise E.PoolClosedError(self.why_closed)
        reading = False
        try:  # (Ctrl-C mostly lands in the wait, where nothing was read yet)
            if not self.conn.poll(timeout):
                raise E.NbddpError(f"the detached pool {self.name} did not answer in {timeout:g} s")
            reading = True
            return self.conn.recv()
        except (EOFError, OSError):
            self._gone()
        except KeyboardInterrupt:
            if not reading:
                raise
            self._close(  # a frame cut in two: this connection cannot go on
                f"interrupted while reading from the detached pool {self.name}: it runs on "
                f"(`%ddp connect {self.name}` again)"
            )

    def _get(self, request: int, timeout: float | None = None) -> object:
        """The next message for ``request``; what comes for a cell read later is kept,
        the rest (a cell left unread, a killed kernel's call) dropped."""
        kept = self._kept.get(request)
        if kept:
            return kept.pop()
        while True:
            msg = self._receive(timeout)
            other = getattr(msg, "request", None)
            if other == request:
                return msg
            if other in self._kept:
                self._kept[other].extend((msg,))
            else:
                _discard(msg)

    def _gone(self):
        """The connection ended: the pool ended with it, or only the connection did (its
        supervisor lives on, holding its folder): the truth either way."""
        if F.held(W.folder_of(self.name)):
            self._close(
                f"the connection to the detached pool {self.name} was cut (it broke, or this "
                "kernel did not read in time); the pool runs on, every rank's state kept: "
                f"`%ddp connect {self.name}` again"
            )
        self.gone = True
        self._close(
            f"the detached pool {self.name} is gone (its supervisor ended): its ranks' state "
            "is lost"
        )

    def _close(self, why: str):
        self.closed, self.why_closed = True, why
        self.conn.close()
        raise E.PoolClosedError(why)

    def _call(self, method: str, *args, **kwargs):
        self._settle()
        request = next(self._ids)
        self._put(W.Call(method, args, kwargs, request))
        reply = self._get(request, REPLY_TIMEOUT)
        if isinstance(reply, W.Failed):
            raise _error(reply)
        return reply.value

    # -- cells

    def run(self, code: str, **kwargs) -> Iterator[object]:
        self._settle()
        for key in ("needs", "auto"):
            shipment = kwargs.get(key)
            if isinstance(shipment, dict):
                shipment = capture.pack(shipment, self.shm_folder)
            if shipment is not None:
                kwargs[key] = (shipment.data, shipment.files)
        request = next(self._ids)
        self._put(W.RunCell({"code": code, **kwargs}, request))
        self._open = request
        return self._events(request)

    def resume(self) -> Iterator[object]:
        """The events of a cell that ran while no kernel was connected (then nothing)."""
        if self._resumed is None:
            return iter(())
        return self._events(self._resumed)

    def _events(self, request: int) -> Iterator[object]:
        self._reading = request
        try:
            while request in (self._open, self._resumed):  # (else: read to its end already)
                msg = self._get(request)
                if isinstance(msg, W.Event):
                    event = msg.event
                    if isinstance(event, P.CellEnd):
                        event = self._with_notes(_load_values(event))
                        self._end_read = request  # (what follows is only the reply)
                    yield event
                    continue
                self._ended(request)
                if isinstance(msg, W.Failed):
                    raise _error(msg)
                return
        finally:
            if self._reading == request:
                self._reading = self._asked = None

    def _ended(self, request: int) -> None:
        if self._open == request:
            self._open = None
        if self._resumed == request:
            self._resumed = None
            self._kept.pop(request, None)

    def _with_notes(self, end: P.CellEnd) -> P.CellEnd:
        notes, self.notes = self.notes, []
        return dataclasses.replace(end, notes=(*notes, *end.notes)) if notes else end

    def _settle(self) -> None:
        """Our last cell, if its events were not read to the end: interrupted if it still
        runs, read to its end here (its output dropped), and said with the next cell."""
        request = self._open
        if request is None:
            return
        quiet = self._end_read == request  # its end was read: only its reply is left
        if not quiet:
            self._put(W.Interrupt(request))
        end = None
        while True:
            msg = self._get(request, REPLY_TIMEOUT)
            if isinstance(msg, W.Event) and isinstance(msg.event, P.CellEnd):
                end = msg.event
            _discard(msg)
            if not isinstance(msg, W.Event):
                break
        self._ended(request)
        if quiet:
            return
        self.notes.append(left_unread(end))

    def interrupt(self) -> None:
        """From any thread, or a SIGINT handler that may have cut into a send of this
        thread's: sent by a thread of its own, once the wire is free."""
        if not self.closed:
            target = self._reading if self._reading is not None else self._open
            if target is not None and self._asked is None:
                self._asked = time.monotonic()
            threading.Thread(target=self._put_quietly, args=(W.Interrupt(target),)).start()

    def _put_quietly(self, msg: object) -> None:
        try:
            self._put(msg)
        except E.PoolClosedError:
            pass

    def interrupt_stuck(self) -> bool:
        """An interrupt has gone unanswered past the pool's grace period and STUCK_AFTER s
        more (the supervisor ends a cell itself by then): a front end may give up on it,
        and the next request reads it to its end."""
        asked = self._asked
        return asked is not None and time.monotonic() - asked > self._state.grace + STUCK_AFTER

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None:
        self._put(W.DebugReply(prompt, line))

    # -- the pool

    def status(self, timeout: float = 2.0):
        return self._call("status", timeout)

    def stacks(self, timeout: float = 2.0, counts: bool = False):
        return self._call("stacks", timeout, counts)

    def copy(self, names, src, dst=None):
        return self._call("copy", names, src, dst)

    def restart(self) -> DetachedPool:
        self._call("restart")
        return self

    def start(self) -> DetachedPool:
        return self

    def stop(self) -> str | None:
        """End the detached pool: its ranks, its store, its folder. What became of a cell
        that ran (interrupted, killed), in words, or None."""
        said = None
        try:
            said = self._call("stop")
        except E.PoolClosedError:
            if not self.gone:  # taken over (or disconnected): it runs on, and that is said
                raise
        self._hang_up([])  # (the supervisor ends: nothing to hand back, no Bye to wait for)
        return said

    def disconnect(self) -> None:
        """Leave the pool running; another kernel (or this one) may connect again. What
        came for a cell not read to its end (ours, or one that ran meanwhile) goes back to
        the supervisor, for the next kernel that connects.

        It always leaves by Leave, Bye and Unread, never by closing alone: a kernel that
        just closes is one that crashed, to the supervisor, whose message being written
        then is kept for the next kernel (it may not have arrived), and so a cell this
        kernel had read to its end would be offered again."""
        if self.closed:
            return
        wanted = {self._open, self._resumed} - {None}
        unread = [m for kept in self._kept.values() for m in kept.take()]
        try:
            self._put(W.Leave())
            unread += self._until_bye()
            self._put(W.Unread(tuple(m for m in unread if m.request in wanted)))
            unread = [m for m in unread if m.request not in wanted]
        except E.NbddpError:  # (gone, or too slow: what it had is dropped with it)
            pass
        self._hang_up(unread)

    def _hang_up(self, unread: list) -> None:
        """Close this kernel's end; what it holds (``unread`` too) is dropped."""
        if not self.closed:
            self.closed = True
            self.conn.close()
        unread += [m for kept in self._kept.values() for m in kept.take()]
        for msg in [*unread, *self._inbox]:
            _discard(msg)
        self._inbox.clear()

    def _until_bye(self) -> list:
        """Everything that comes until the supervisor's Bye."""
        got = []
        while not isinstance(msg := self._receive(BYE_TIMEOUT), W.Bye):
            got.append(msg)
        return got


def _error(failed: W.Failed) -> Exception:
    cls = getattr(E, failed.exc_type, None) or getattr(builtins, failed.exc_type, None)
    return (cls if isinstance(cls, type) else E.NbddpError)(failed.message)


def _load_values(end: P.CellEnd) -> P.CellEnd:
    values, errors = dict(end.values), dict(end.errors)
    for rank, value in end.values.items():
        if isinstance(value, RawValue):
            values[rank], error = load_value(rank, value.data, value.files)
            if error is not None:
                errors[rank] = error
    return dataclasses.replace(end, values=values, errors=errors)


def _discard(msg: object) -> None:
    """A message no one will read: a cell's values' files (in the pool's shared-memory
    folder) are removed with it."""
    event = getattr(msg, "event", None)
    if isinstance(event, P.CellEnd):
        for value in event.values.values():
            if isinstance(value, RawValue):
                payload.Shipment(b"", list(value.files)).remove()
