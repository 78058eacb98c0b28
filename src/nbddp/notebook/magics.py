"""``%%ddp`` and ``%ddp``: parse arguments, ask the session for the pool, drive the events.

No process logic lives here. Bad input raises ``UsageError`` (one line in
IPython) before the pool is touched, so it leaves the pool as it was; so does a
pool that cannot start or was closed (:func:`one_line`).
"""

from __future__ import annotations

import contextlib
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..dashboard.metric_store import CellMetrics
from ..dashboard.view import Dashboard, TextSink
from ..pool import capture, copying
from ..pool.drive import drive
from ..pool.errors import (
    CaptureError,
    CellFailed,
    NbddpError,
    PoolClosedError,
    PoolStartError,
    RankFailed,
)
from ..pool.facade import Pool, failures_of, raise_for_end
from ..pool.sizes import human
from ..rank import profiling
from ..rank.gpus import devices_line
from ..wire import protocol as P
from ..wire import stacks
from . import export
from .autocapture import AutoCapture
from .magics_pool import PoolCommands
from .options import (
    PARSERS,
    SUBCOMMANDS,
    ddp_attach,
    ddp_cell,
    ddp_connect,
    ddp_copy,
    ddp_debug,
    ddp_export,
    ddp_metrics,
    ddp_pull,
    ddp_push,
    ddp_run,
    ddp_start,
    help_text,
    parse_argstring,
)
from .prompts import debug_prompt, launcher_hints
from .session import SESSION, Refused, running, say

__all__ = [  # (the parsers too: the docs' magics reference is made from them)
    "PARSERS",
    "SUBCOMMANDS",
    "DDPMagics",
    "ddp_attach",
    "ddp_cell",
    "ddp_connect",
    "ddp_copy",
    "ddp_debug",
    "ddp_export",
    "ddp_metrics",
    "ddp_pull",
    "ddp_push",
    "ddp_run",
    "ddp_start",
    "load",
    "unload",
]

TICK = 0.1  # seconds of silence after which the sink hears a Tick (folded lines wait <= 0.25 s)


@contextlib.contextmanager
def one_line():
    """What the pool refuses, or cannot do, is one line (a UsageError), never a traceback."""
    try:
        yield
    except PoolStartError as exc:
        raise UsageError(f"the pool did not start: {exc}") from None
    except (CaptureError, PoolClosedError, Refused) as exc:
        raise UsageError(str(exc)) from None


@magics_class
class DDPMagics(PoolCommands, Magics):
    """``%%ddp`` runs a cell on the pool; ``%ddp start|status|restart|stop|interrupt|push|pull``."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.session = SESSION
        self.capture = AutoCapture(shell)
        self.tee: list[int] | None = None  # ranks whose output is shown (None: all)
        self._failed_ranks: list[int] = []  # the last failed cell's, the root cause first
        shell.events.register("post_run_cell", self.capture.record_imports)

    @property
    def pool(self) -> Pool | None:
        """The pool this notebook uses, shared with ``nbddp.ranch``."""
        return self.session.pool

    @pool.setter
    def pool(self, pool: Pool | None) -> None:
        self.session.pool = pool

    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None):
        # its docstring, what %ddp? and %%ddp? show, is help_text(): made from the parsers
        with one_line():
            if cell is not None:
                return self._cell(line, cell)
            command, _, rest = line.strip().partition(" ")
            if command not in SUBCOMMANDS:
                raise UsageError(
                    f"unknown %ddp command {command!r}: use one of {', '.join(SUBCOMMANDS)}"
                    if command
                    else f"%ddp needs a command: {', '.join(SUBCOMMANDS)} (or use %%ddp on a cell)"
                )
            return getattr(self, f"_{command}")(rest)

    # -- objects and scripts

    def _push(self, rest: str) -> None:
        args = parse_argstring(ddp_push, rest)
        names = capture.split_names(" ".join(args.names))
        objects = capture.collect(names, self.shell.user_ns)
        capture.parse_ranks(args.ranks)  # its form, before a pool is started for it
        pool = self.session.want_pool()
        ranks = capture.parse_ranks(args.ranks, pool.world_size)  # before /dev/shm is written
        pool.ready()
        payload = capture.pack(objects, pool.shm_folder)
        versions = self.capture.versions(pool, objects, ranks)
        self._finish(pool, pool.run("", ranks=ranks, needs=payload, versions=versions), TextSink())

    def _pull(self, rest: str):
        args = parse_argstring(ddp_pull, rest)
        pool = self.session.want_pool()
        if not 0 <= args.rank < pool.world_size:
            raise UsageError(f"--rank: no rank {args.rank} in a pool of {pool.world_size}")
        ranks = None if args.all else [args.rank]
        events = pool.run(args.name, ranks=ranks, want_values=True)
        end = self._finish(pool, events, TextSink(quiet=True))
        if args.all:
            return [end.values.get(r) for r in range(pool.world_size)]
        return end.values.get(args.rank)

    def _copy(self, rest: str) -> None:
        args = parse_argstring(ddp_copy, rest)
        copying.check_names(" ".join(args.names).replace(",", " ").split())  # (model.module)
        names = capture.split_names(" ".join(args.names))
        pool = self._running("there is nothing to copy")
        if not 0 <= args.src < pool.world_size:
            raise UsageError(f"--from: no rank {args.src} in a pool of {pool.world_size}")
        to = capture.parse_ranks(args.to, pool.world_size) if args.to else None
        done = pool.copy(names, args.src, to)
        say(
            f"copied {', '.join(done.names)} from rank {done.src} to "
            f"{stacks.rank_set(list(done.dst))} ({human(done.nbytes)} {done.via}, "
            f"{done.seconds:.2f} s)"
            + (
                f"; {', '.join(done.rewrapped)} wrapped again in DDP on every rank"
                if done.rewrapped
                else ""
            )
        )
        for note in done.notes:
            say(note)

    def _rollback(self, rest: str) -> None:
        """Put every rank's --keep objects back as they were at the end of the last clean
        cell, on every rank at once."""
        if rest.strip():
            raise UsageError(f"%ddp rollback takes no arguments, not {rest.strip()!r}")
        pool = self._running("there is nothing to roll back")
        if not hasattr(pool, "rollback"):
            raise UsageError("%ddp rollback: a detached pool's snapshots are not built yet")
        try:
            say(pool.rollback())
        except NbddpError as exc:
            raise UsageError(f"%ddp rollback: {exc}") from None

    def _run(self, rest: str) -> None:
        args = parse_argstring(ddp_run, rest)
        if not os.path.isfile(args.script):
            raise UsageError(f"no such script: {args.script}")
        pool = self.session.want_pool()
        ranks = capture.parse_ranks(args.ranks, pool.world_size)
        events = pool.run_script(args.script, args.args, keep=args.keep, ranks=ranks, tick=TICK)
        self._finish(pool, events, self._sink(pool, ranks, text=False, quiet=False))

    def _metrics(self, rest: str):
        args = parse_argstring(ddp_metrics, rest)
        store = self.session.metrics
        if args.clear:
            store.clear()
            return None
        if args.name is not None and args.name not in store.names():
            known = ", ".join(store.names()) or "none yet: nbddp.log_metrics in a %%ddp cell"
            raise UsageError(f"no metric {args.name!r} was logged (logged: {known})")
        return store.frame(args.name, args.run)

    def _export(self, rest: str) -> None:
        args = parse_argstring(ddp_export, rest)
        try:
            export.check_target(args.file, force=args.force)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        cells = [c for c in self.shell.history_manager.input_hist_raw if c.strip()]
        cells = [c for c in cells if not c.lstrip().startswith("%ddp export")]
        n = args.n or (self.pool.world_size if self.pool else None)
        result = export.export(cells, n, source="this notebook", target=args.file)
        with open(args.file, "w", encoding="utf-8") as f:
            f.write(result.script)
        say(f"wrote {args.file}: run it with {result.command(args.file)}")
        for note in result.notes:
            say(note)

    # -- cells

    def _cell(self, line: str, cell: str) -> None:
        args = parse_argstring(ddp_cell, line)
        explicit = capture.split_names(" ".join(args.need))
        named = capture.collect(explicit, self.shell.user_ns)  # missing: said before a start
        imports = capture.check_imports(args.imports)
        size = args.n or (self.pool and self.pool.world_size)
        ranks = capture.parse_ranks(args.ranks, size)
        display_ranks = capture.parse_ranks(args.display, size)
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out takes a variable name, not {args.out!r}")
        pool = self.session.want_pool(args.n)
        pool.ready()  # a rank replaced now gets what is shipped below
        if ranks and max(ranks) >= pool.world_size:
            raise UsageError(f"--ranks: no rank {max(ranks)} in a pool of {pool.world_size}")
        needs = capture.pack(named, pool.shm_folder)
        auto, versions = None, self.capture.versions(pool, named, ranks)
        if self.capture.on and not args.no_auto:
            auto, more, imports = self.capture.ship(pool, cell, ranks, explicit, imports)
            versions.update(more)
        events = pool.run(
            "\n" + cell,  # the %%ddp line is line 1: line numbers read as the cell shows them
            ranks=ranks,
            needs=needs,
            auto=auto,
            versions=versions,
            imports=imports,
            want_values=args.out is not None,
            timeout=args.timeout,
            display_ranks=display_ranks,
            tick=TICK,
            profile=args.profile,
            label=f"In [{self.shell.execution_count}]",  # (a new rank's re-runs say it)
        )
        sink = self._sink(pool, ranks, text=args.text, quiet=args.quiet, fold=not args.no_fold)
        failed = True
        try:
            self._finish(pool, events, sink, out=args.out)
            failed = False
        finally:
            if ranks is None and self.capture.on and not args.no_auto:
                self.capture.record_cell_imports(pool, cell, failed)

    def _sink(
        self, pool: Pool, ranks: list[int] | None, *, text: bool, quiet: bool, fold: bool = True
    ):
        """The widget dashboard in a front end with widgets, else ``[rank N]`` lines; either
        records the cell's metrics (labelled with the cell's ``In [N]``)."""
        metrics = CellMetrics(self.session.metrics, f"In [{self.shell.execution_count}]")
        if quiet or text or getattr(self.shell, "kernel", None) is None:
            return TextSink(quiet=quiet, hosts=pool.hosts, fold=fold, metrics=metrics)
        return Dashboard(
            list(range(pool.world_size)) if ranks is None else ranks,
            world_size=pool.world_size,
            backend=pool.backend_in_use,
            devices=devices_line(pool.devices),
            hosts=pool.hosts,
            fold=fold,
            metrics=metrics,
        ).show()

    def _finish(self, pool: Pool, events, sink, out: str | None = None, cell: bool = True):
        """Drive the events into the sink (pdb in the input box); raise on failure."""
        end = drive(pool, events, sink, prompt=debug_prompt, shown=self._teed)
        if end.profiles:
            print(profiling.report(end.profiles))
        if out is not None and failures_of(end, pool.hosts):  # as `x = f()` when f raises
            say(f"--out {out}: the cell failed, so {out} was left as it was")
        elif out is not None:
            self.shell.user_ns[out] = [end.values.get(r) for r in range(pool.world_size)]
        try:
            raise_for_end(end, pool.hosts, f"In [{self.shell.execution_count}]" if cell else "")
        except CellFailed as exc:  # the error carries the notes: say only the hints beside it
            for hint in launcher_hints(end):
                say(hint)
            if cell:  # (not a post-mortem session's own failure)
                self._failed(pool, exc)
            raise
        for note in end.notes:
            say(note)
        return end

    def _failed(self, pool: Pool, exc: CellFailed) -> None:
        """Remember which ranks failed (for %ddp debug), and say so."""
        self._failed_ranks = [f.rank for f in exc.failures if isinstance(f, RankFailed)]
        if self._failed_ranks and not pool.needs_restart:
            say(
                f"%ddp debug opens pdb where rank {self._failed_ranks[0]} failed "
                "(--rank R for another)"
            )

    def _running(self, else_: str) -> Pool:
        """The running pool, made ready (a rank that died replaced, a lost host's ranks
        taken back); ``no pool is running: {else_}`` without one. While a lost host's
        ranks are missing, HostsMissing says which, one line: nothing was done or lost."""
        pool = self.pool
        if not running(pool):
            raise UsageError(f"no pool is running: {else_}")
        pool.ready()
        return pool

    def _teed(self, event: object) -> bool:
        """With ``--tee``, output of the other ranks goes only to the log directory."""
        return self.tee is None or not isinstance(event, P.Output) or event.rank in self.tee

    def _debug(self, rest: str) -> None:
        """pdb where a rank's last failed cell raised, in its live namespace."""
        args = parse_argstring(ddp_debug, rest)
        pool = self._running("nothing to debug")
        rank = args.rank if args.rank is not None else next(iter(self._failed_ranks), None)
        if rank is None:
            raise UsageError("no cell has failed on a rank: %ddp debug --rank R names one")
        if not 0 <= rank < pool.world_size:
            raise UsageError(f"--rank: no rank {rank} in a pool of {pool.world_size}")
        events = pool.run("", ranks=[rank], post_mortem=True, tick=TICK)
        try:
            self._finish(pool, events, TextSink(hosts=pool.hosts), cell=False)
        except CellFailed as exc:  # nothing to debug there: one line
            failure = exc.failures[0]
            if isinstance(failure, RankFailed) and failure.exc_type == "LookupError":
                raise UsageError(f"%ddp debug: {failure.message}") from None
            raise

    def close(self) -> None:
        self.shell.events.unregister("post_run_cell", self.capture.record_imports)
        self.session.release()  # a detached pool runs on


DDPMagics.ddp.__doc__ = help_text(lambda command: getattr(DDPMagics, f"_{command}").__doc__)

_MAGICS: dict[int, DDPMagics] = {}


def load(ipython) -> None:
    magics = DDPMagics(ipython)
    ipython.register_magics(magics)
    _MAGICS[id(ipython)] = magics


def unload(ipython) -> None:
    magics = _MAGICS.pop(id(ipython), None)
    if magics is not None:
        magics.close()
        ipython.magics_manager.magics["line"].pop("ddp", None)
        ipython.magics_manager.magics["cell"].pop("ddp", None)
