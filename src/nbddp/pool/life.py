"""A pool's life cycle: open its listener, start its ranks, shake hands, stop them.

:class:`PoolLife` is the part of :class:`~nbddp.pool.facade.Pool` that starts ranks (local ones
through :class:`~nbddp.pool.processes.RankProcesses`, attached ones by waiting for them on the
listener), shakes hands with them (:class:`~nbddp.pool.roster.Roster`), and ends them: asked
first, then reaped, then killed. Every pool started is stopped at the interpreter's exit.
It needs what :class:`~nbddp.pool.facade.Pool` sets up in its ``__init__``.
"""

from __future__ import annotations

import atexit
import os
import secrets
import time
import weakref
from typing import TYPE_CHECKING

from ..rank.gpus import gpu_notes
from ..wire import protocol as P
from ..wire.listener import Listener, bind_tcp, bind_unix
from .errors import NbddpError
from .logs import LogDir
from .processes import enough_open_files, rank_env

if TYPE_CHECKING:
    from .facade import Pool

__all__ = ["PoolLife"]

_LIVE_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _stop_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.stop()


class PoolLife:
    """Start, restart, stop: the pool's ranks from their first process to their last."""

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Pool:
        """Start the ranks and return once every one has joined the group (a handshake)."""
        if self.started:
            return self
        _LIVE_POOLS.add(self)
        enough_open_files(self.world_size)
        self.state = "starting"
        try:
            self.listen()
            if self.log_dir is not None and self.logs is None:
                self.logs = LogDir(self.log_dir, lambda line: self.notes.append(line))
                self.hub.log = self.logs.text
            self.roster.store_port = None
            if not self.attached:  # else the ranks come to us
                for rank in range(self.world_size):
                    pid = self.procs.start(rank, self.address, rank_env(self, rank))
                    self.roster.add(rank, pid)
            self.handshake(self.start_timeout)
            if self.heal:  # a new rank's heal wraps a DDP model: its imports, ahead
                self.procs.warm()
            self.generation = secrets.randbits(48) << 16
            self.history.clear()  # every namespace is new: no cell of theirs to re-run
            self.notes += gpu_notes(self)  # ranks that share a GPU: said once
            self.state = "ready"
        except BaseException:
            self._teardown(keep_launcher=False)
            self.state = "new"
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
        self.hub.close()
        self.state = "closed"
        _LIVE_POOLS.discard(self)

    def listen(self) -> str:
        """Open the listener (if not yet) and return the address workers connect to.

        A local pool: a Unix socket in a private 0700 directory. An attached
        pool: TCP on ``listen`` (port 0: a free one).
        """
        if self.listener is not None and self.listener.open:
            return self.address
        self.procs.make_folders()
        if self.attached:
            host, port = self.listen_on
            sock = bind_tcp(host, port)
            self.address = f"{host}:{sock.getsockname()[1]}"
        else:
            self.address = os.path.join(self.procs.dir, "pool.sock")
            self.token = secrets.token_hex(32).encode()
            sock = bind_unix(self.address)
        self.listener = Listener(sock, self.token, self.roster.arrive, tls=self.tls)
        self.roster.refuse = self.listener.refuse_line
        self.listener.start()
        return self.address

    def lose(self) -> None:
        """The ranks' state is gone (a rank died, the group broke): end them now; the
        next cell starts a new pool."""
        self._teardown(keep_launcher=True)
        self.state = "lost"

    def _teardown(self, *, keep_launcher: bool, timeout: float = 5.0) -> None:
        ranks = list(self.roster.ranks.values())
        for r in ranks:
            r.send(P.Shutdown())
        self.reap(ranks, time.monotonic() + timeout)
        self.hub.forget_sentinels()  # reaped: their fd numbers may come back for others
        for r in ranks:
            for conn in r.link.connections():
                self.hub.unwatch_conn(conn)
                conn.close()
        self.roster.clear()
        self.procs.stop_store()
        self.hub.close_relays()
        if self.logs is not None:
            self.logs.close()
            self.logs = None
            self.hub.log = None
        if not keep_launcher:
            if self.listener is not None:
                self.listener.close()
            self.procs.close()

    def reap(self, ranks: list, deadline: float) -> None:
        """Wait for the ranks to end until ``deadline``, then SIGKILL them (local ranks)."""
        self.procs.reap_ranks(ranks, deadline)

    def exit_code(self, r) -> int | None:
        return self.procs.returncode(r.pid, timeout=2.0)

    def handshake(self, timeout: float, cancelled=lambda: False) -> None:
        self.roster.handshake(timeout, self.exit_code, self.procs.log_tail, cancelled)
