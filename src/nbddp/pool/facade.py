"""The pool: a persistent set of ranks, supervised from the notebook process.

``Pool`` is a facade over parts that each own one thing (docs/how-it-works.md
draws them):

- :class:`~nbddp.wire.listener.Listener` accepts connections and authenticates them;
- :class:`~nbddp.pool.hub.Hub` owns every fd and turns bytes into typed items;
- :class:`~nbddp.pool.roster.Roster` owns the rank table, rank states, the handshake;
- :class:`~nbddp.pool.processes.RankProcesses` starts, kills and reaps local ranks;
- :class:`~nbddp.pool.life.PoolLife` (inherited) starts, restarts and stops them all;
- :class:`~nbddp.pool.cell.Cell` is one cell: it turns items into events and acts;
- :mod:`nbddp.pool.recovery` decides how a failure is mended, and words it;
- :class:`~nbddp.pool.repair.PoolRepair` (inherited) carries that out.

The pool's own state is one value (:attr:`Pool.state`). The pool knows no
IPython and no sink, and needs no particular thread: a front end drives a
cell's events (:mod:`nbddp.pool.drive`) and turns Ctrl-C into :meth:`Pool.interrupt`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping

from ..wire import payload
from ..wire import protocol as P
from ..wire.listener import Listener
from . import capture, copying, keeping, queries, resizing
from .calls import PoolCalls
from .cell import Cell, Requests, make_runs
from .healing import check_heal
from .hub import Hub
from .keeping import Snapshot, check_keep
from .layout import check_pool
from .life import PoolLife
from .logs import LogDir
from .outcome import failures_of, raise_for_end
from .processes import RankProcesses
from .queries import RankStatus
from .repair import PoolRepair
from .rerun import History
from .roster import Roster

__all__ = ["Pool", "RankStatus", "failures_of", "raise_for_end"]


class Pool(PoolLife, PoolRepair, PoolCalls):
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
        tls=None,
        on_join=None,
        device: str | None = None,
        gpus: list[int] | None = None,
        seed: int | None = None,
        groups: str | None = None,
        mesh: str | None = None,
        log_dir: str | None = None,
        workspace: str | None = None,
        debug: bool = False,
        threads: str | int | None = None,
        on_death: str = "replace",
        heal: list[str] | str | None = None,
        rerun: bool = True,
        keep: list[str] | str | None = None,
    ) -> None:
        check_pool(
            n,
            start_method=start_method,
            backend=backend,
            pg_timeout=pg_timeout,
            start_timeout=start_timeout,
            grace=grace,
            abort_after=abort_after,
            listen=listen,
            token=token,
            device=device,
            gpus=gpus,
            seed=seed,
            groups=groups,
            mesh=mesh,
            log_dir=log_dir,
            workspace=workspace,
            threads=threads,
            on_death=on_death,
        )
        self.world_size = n
        self.start_method, self.backend, self.pg_timeout = start_method, backend, pg_timeout
        self.start_timeout, self.grace, self.abort_after = start_timeout, grace, abort_after
        self.device, self.gpus, self.seed = device, gpus, seed
        self.groups, self.mesh = groups, mesh
        self.log_dir, self.workspace = log_dir, workspace  # workspace: copy through it
        self.debug = debug  # torch's collective checks: a mismatch fails at once
        self.threads = None if threads is None else str(threads)  # N or "auto" per rank
        self.extra_env = dict(env or {})
        self.on_death = on_death  # "replace": a dead rank gets a new process; "restart": all
        self.heal = check_heal(heal, on_death)  # names a new rank gets from a survivor
        self.rerun = bool(rerun)  # a new rank re-runs the cells it can (nbddp.pool.rerun)
        self.history = History()  # ... of those that ran cleanly on every rank
        self.keep = check_keep(keep, listen is not None)  # snapshotted after each clean cell
        self.snapshot: Snapshot | None = None  # the last one (nbddp.pool.keeping)
        # attached pools: ranks started elsewhere (torchrun) connect over TCP with ``token``
        self.listen_on, self.token, self.tls = listen, token or b"", tls  # tls: Tls
        # new -> starting -> ready (cells run) -> lost (a death: the next cell starts anew)
        # -> starting ...; stop() -> closed
        self.state = "new"
        self.notes: list[str] = []  # said once, with the next cell
        self.last_stacks: dict[int, tuple] = {}  # where the ranks were at the last interrupt
        self.last_counts: dict[int, int] = {}  # and their collective counts (default group)
        self.requests = Requests()  # interrupts, from any thread
        self.address = ""
        self.listener: Listener | None = None
        self.logs: LogDir | None = None
        self.procs = RankProcesses(start_method, local=listen is None)
        self.roster = Roster(n, attached=listen is not None)
        self.roster.on_join = on_join  # called with (connected, world size) as ranks join
        self.hub = Hub(self.roster.ranks, self.roster.attach, self.procs.sentinels)
        self.hub.exits = lambda: self.procs.exited(self.roster.pids())
        self.roster.hub = self.hub
        self._cells = itertools.count(1)
        self.last_cell: Cell | None = None  # run() made it; not read to its end yet
        # a new one at each start and each replacement: a new generation has ranks with
        # fresh namespaces (so the notebook's imports and objects go to them again); random
        # at each start, so that no two pools share one
        self.generation = 0

    def __del__(self) -> None:
        hub = getattr(self, "hub", None)
        if hub is not None:
            hub.close()

    # ------------------------------------------------------------ what it is

    @property
    def started(self) -> bool:
        return self.roster.started

    @property
    def mend_pending(self) -> bool:
        """A death read between cells (by ``%ddp status`` or ``stacks``) waits for the next
        cell's repair, which replaces that rank: the pool is not to be started again."""
        return bool(self.hub.held)

    @property
    def attached(self) -> bool:
        """The ranks were started elsewhere (torchrun) and connected over TCP."""
        return self.listen_on is not None

    @property
    def needs_restart(self) -> bool:
        """A rank died or was stopped: the next cell starts a new pool (state is lost)."""
        return self.state == "lost"

    @property
    def refused(self) -> list[str]:
        """Connections refused since the last cell (bad token, wrong world size)."""
        return [] if self.listener is None else self.listener.refusals()

    @property
    def backend_in_use(self) -> str:
        """The process group's backend, as the ranks reported it."""
        return self.roster.backend() or self.backend or ""

    @property
    def hosts(self) -> dict[int, str]:
        """Each rank's host, when the ranks are on more than one host (else empty)."""
        return self.roster.hosts()

    def names_on(self, ranks: list[int] | None = None) -> frozenset[str]:
        """Global names every one of ``ranks`` (all by default) has, as last reported."""
        return self.roster.names_on(ranks)

    def shipped_on(self, ranks: list[int] | None = None) -> frozenset[str]:
        """Names every one of ``ranks`` holds still bound to what a notebook shipped
        (this kernel, or one before it on a detached pool), as last reported."""
        chosen = [self.roster[r] for r in (ranks if ranks is not None else self.roster.ranks)]
        each = [frozenset(h.name for h in r.held if h.shipped) for r in chosen]
        return frozenset.intersection(*each) if each else frozenset()

    @property
    def shm_folder(self) -> str | None:
        """Where tensors shipped to the ranks go: the pool's private shared-memory folder
        (removed with the pool), or None for ranks on other hosts (inside the pickle)."""
        return None if self.attached else self.procs.shm

    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.roster.ranks.values()]

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.roster.ranks.values()]

    @property
    def namespaces(self) -> dict[int, int]:
        """Each rank's namespace, as a number: a new one whenever the rank has a fresh
        namespace (a start, a replacement, a resize up, a lost host's rejoin), the same
        while it keeps its own. A front end replays the notebook's imports only where
        it changed (:mod:`nbddp.notebook.autocapture`)."""
        return {r.rank: r.namespace for r in self.roster.ranks.values()}

    # ------------------------------------------------------------ cells

    def take_notes(self) -> list[str]:
        """Notes, connections closed for a bad frame, and refusals for the next cell, once."""
        notes = self.notes + self.hub.closed + self.procs.spill_notes()
        self.notes, self.hub.closed = [], []
        return notes + (self.listener.refusals(take=True) if self.listener else [])

    def send(self, ranks, msg: object) -> None:
        self.hub.deliver(ranks, P.dumps(msg))

    def drain(self, rank: int):
        for item in self.hub.drain(rank):
            yield P.Output(item.rank, item.stream, item.text)

    def ready(self) -> None:
        """Make the pool ready for a cell now: a rank that died since the last cell is
        replaced, a pool that lost its state started anew (said with the next cell). A
        front end calls it before it decides what to ship, so that a new rank gets it."""
        self.mend()

    def run(
        self,
        code: str,
        *,
        ranks: list[int] | None = None,
        needs: dict[str, object] | payload.Shipment | None = None,
        auto: payload.Shipment | None = None,
        versions: dict[str, int] | None = None,
        imports: str | Mapping[int, str] = "",
        want_values: bool = False,
        timeout: float | None = None,
        display_ranks: list[int] | None = None,
        tick: float | None = None,
        script: P.Script | None = None,
        post_mortem: bool = False,
        profile: str | None = None,
        raw_values: bool = False,
        label: str = "",
    ) -> Iterator[object]:
        """Run ``code`` on ``ranks`` (all by default); a :class:`~nbddp.pool.cell.Cell`: its
        events, ending with ``CellEnd``.

        ``imports``: statements run first on every target, or each rank's own (a
        mapping: a rank it leaves out runs none).
        ``needs`` maps names to objects bound on the ranks before the cell
        (or is a shipment made by :func:`nbddp.pool.capture.pack`); ``auto`` is
        bound only on ranks that lack the name. ``versions`` names the notebook's version of
        each shipped object: a rank that holds that version keeps its copy (trained in
        place, maybe), and an object without one is the rank's own. Interrupt with
        :meth:`interrupt` (or a KeyboardInterrupt while waiting); ``timeout`` seconds
        behave the same.
        Rich output (``display``, figures) comes from ``display_ranks`` (rank 0
        by default). With ``tick``, a ``Tick`` is yielded after that many
        seconds without any other event. With ``script``, that file runs as
        ``__main__`` instead of ``code`` (see :meth:`run_script`). With
        ``post_mortem``, pdb opens where each rank's last failed cell raised. With
        ``profile`` ("torch" or "python"), the cell runs under that profiler and
        ``CellEnd.profiles`` holds each rank's (see :mod:`nbddp.rank.profiling`). With
        ``raw_values``, ``CellEnd.values`` holds each value unloaded (``RawValue``).
        ``label`` names the cell in the notes (the notebook's ``In [N]``; else ``cell N``).

        A rank in pdb (``breakpoint()``) yields ``RankDebug`` each time it wants a
        line; answer with :meth:`debug_reply`.
        """
        previous = self.last_cell
        nested = previous is not None and previous.running  # (a heal's copy, in a cell)
        if previous is not None and not nested:  # left before its end: ended first (a note)
            self.last_cell = None
            previous.finish()
        self.mend()
        targets = sorted(set(range(self.world_size) if ranks is None else ranks))
        bad = [r for r in targets if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"no rank {bad[0]} in a pool of {self.world_size}")
        if isinstance(needs, dict):
            needs = capture.pack(needs, self.shm_folder)
        cell = next(self._cells)
        runs = make_runs(
            targets,
            {0} if display_ranks is None else set(display_ranks),
            cell=cell,
            code=code,
            imports=imports,
            needs=needs and needs.data,
            auto=auto and auto.data,
            versions=tuple(sorted((versions or {}).items())),
            want_value=want_values,
            shm=not self.attached,
            script=script,
            post_mortem=post_mortem,
            profile=profile,
        )
        self.requests.pending = cell  # an interrupt from now on is for this cell
        shipments = [s for s in (needs, auto) if s]
        self.last_cell = Cell(self, cell, runs, timeout, tick, shipments, raw_values)
        self.last_cell.outer = previous if nested else None
        self.last_cell.label = label
        return self.last_cell

    def interrupt(self) -> None:
        """Interrupt the cell that runs, or is about to run, on every rank running it.

        From any thread. An interrupt is never lost: it holds until its cell has
        acted on it, and ranks that have not started the cell yet raise it as they
        start. Without a cell, there is nothing to interrupt. While the group is
        re-formed after a cell, it ends the wait (the pool is then stopped).
        """
        if self.requests.ask(time.monotonic()):
            self.hub.wake()

    def interrupt_stuck(self) -> bool:
        """An interrupt has waited past the grace period and 5 s more: the pool itself
        does not answer (a front end may then raise KeyboardInterrupt as usual)."""
        request = self.requests.request
        return request is not None and time.monotonic() - request[1] > self.grace + 5.0

    def status(self, timeout: float = 2.0) -> list[RankStatus]:
        """One row per rank: pid, host, device, state, uptime, resident memory."""
        return queries.status(self, timeout)

    def stacks(self, timeout: float = 2.0, counts: bool = False) -> dict[int, tuple]:
        """Where each rank's main thread is now (between cells: empty, they are idle);
        with ``counts``, (frames, its collective count on the default group) each."""
        return queries.stacks(self, timeout, counts)

    def copy(self, names: list[str], src: int, dst: list[int] | None = None) -> copying.Copied:
        """Bind rank ``src``'s ``names`` on ``dst`` (all others): :mod:`nbddp.pool.copying`."""
        with self.history.pause():  # (its cells are the pool's own: never re-run)
            return copying.copy(self, names, src, dst)

    def rollback(self) -> str:
        """Every rank's ``keep`` objects back as the last snapshot has them, on every rank at
        once (:mod:`nbddp.pool.keeping`); the line that says so."""
        return keeping.rollback(self)

    def resize(self, n: int) -> resizing.Resized:
        """``n`` ranks: those that stay keep their namespaces, new ones start fresh, the
        group is formed again (:mod:`nbddp.pool.resizing`); for a local pool whose ranks are up."""
        return resizing.resize(self, n)

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None:
        """Answer a rank's pdb (a ``RankDebug`` event) with ``line``; None ends its session."""
        self.roster[prompt.rank].send(P.DebugInput(line, prompt.seq))
