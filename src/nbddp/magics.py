"""``%%ddp`` and ``%ddp``: parse arguments, call the pool, hand events to a sink.

No process logic lives here. Bad input raises ``UsageError`` (one line in
IPython) before the pool is touched, so it leaves the pool as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import sys
import threading
import time

import torch
from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from . import capture, export, launch, profiling, stacks
from . import protocol as P
from .dashboard import Dashboard, TextSink
from .errors import (
    CaptureError,
    CellFailed,
    CellInterrupted,
    PoolClosedError,
    PoolStartError,
    RankFailed,
)
from .launch import START_METHODS
from .pool import Pool, default_pool, raise_for_end, set_default_pool

__all__ = ["DDPMagics", "launcher_hints", "load", "unload"]

TICK = 0.1  # seconds of silence after which the sink hears a Tick (folded lines wait <= 0.25 s)
SUBCOMMANDS = (
    "start",
    "attach",
    "status",
    "stacks",
    "restart",
    "stop",
    "interrupt",
    "push",
    "pull",
    "run",
    "export",
    "debug",
)


def _world_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"the world size must be a whole number, not {text!r}"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the world size must be at least 1, not {n}")
    return n


def _threads(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"threads: a whole number >= 1 or auto, not {text!r}")
    return text


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if s <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, not {text}")
    return s


# Frameworks that start processes of their own inside a rank fail obscurely; say why.
LAUNCHER_HINTS = (
    (
        ("notebook_launcher",),
        "accelerate's notebook_launcher starts processes of its own, but in %%ddp the ranks "
        "already run: call the training function directly in the cell, or run "
        "nbddp.ranch(N, fn, *args) from the notebook",
    ),
    (
        ("ddp_notebook", "ddp_spawn", "To spawn processes with the `DDPStrategy`"),
        "Lightning's spawning strategies (ddp_spawn, ddp_notebook) start processes of their "
        'own: use strategy="ddp" in %%ddp, which attaches to the running ranks',
    ),
    (
        ("torch.multiprocessing.spawn", "mp.spawn("),
        "torch.multiprocessing.spawn starts processes of its own: in %%ddp, run the function "
        "on every rank directly",
    ),
)


def launcher_hints(end: P.CellEnd) -> list[str]:
    """One line for each framework launcher found in the failed ranks' tracebacks."""
    text = "\n".join(e.traceback + e.message for e in end.errors.values())
    return [hint for needles, hint in LAUNCHER_HINTS if any(n in text for n in needles)]


def parse_argstring(magic, line: str) -> argparse.Namespace:
    """Like IPython's, but shell-like quoting: ``--imports "import a; import b"``."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse the arguments: {exc}") from None
    return magic.parser.parse_args(argv)


def default_world_size() -> int:
    """One rank per visible GPU, else 2."""
    return torch.cuda.device_count() or 2


# ---------------------------------------------------------------- argument parsers
# (their docstrings and help are what %%ddp? and %ddp? show)


@magic_arguments()
@argument("-n", type=_world_size, help="world size (starts or resizes the pool)")
@argument("--need", nargs="+", default=[], help="notebook names to ship to the ranks: 'a,b c'")
@argument("--no-auto", action="store_true", help="ship only --need names; replay no imports")
@argument("--imports", default="", help="import statements run on the ranks first")
@argument("--ranks", help="run only on these ranks: '0,2-3'")
@argument("--out", help="notebook variable that receives each rank's last value, by rank")
@argument("--timeout", type=_seconds, help="seconds before the cell is interrupted")
@argument("--display", default="0", help="ranks whose display() and figures are shown ('0')")
@argument("--text", action="store_true", help="print lines as '[rank N] line', no widgets")
@argument("--quiet", action="store_true", help="show nothing unless a rank fails")
@argument(
    "--profile",
    nargs="?",
    const="torch",
    choices=("torch", "python"),
    help="profile every rank (torch's profiler, or cProfile with 'python'): time in "
    "collectives, top operations, the slowest rank",
)
@argument(
    "--no-fold",
    action="store_true",
    help="every rank's lines apart (by default a line several ranks print shows once)",
)
def ddp_cell(line, cell):
    """Run the cell on every rank of the pool (``%%ddp``)."""


@magic_arguments()
@argument("-n", type=_world_size, help="world size (default: one per GPU, else 2)")
@argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
@argument("--start-method", choices=START_METHODS, default="forkserver")
@argument("--timeout", type=_seconds, help="process-group timeout in seconds")
@argument("--grace", type=_seconds, help="seconds an interrupted rank gets before a restart (3)")
@argument("--no-auto", action="store_true", help="no automatic capture for this pool")
@argument("--auto-limit", default="100MB", help="largest object captured automatically (100MB)")
@argument("--device", choices=("cpu", "gpu", "mps"), help="default: gpu when CUDA is visible")
@argument("--gpus", help="which GPUs the ranks use, in order: '0,3'")
@argument("--seed", type=int, help="seed random, numpy and torch on every rank (and restarts)")
@argument("--groups", help="process subgroups, bound as `group` on each rank: '0,2;1,3'")
@argument("--mesh", help="a DeviceMesh bound as `mesh`: 'dp=2,tp=2' (product = world size)")
@argument("--log-dir", help="every rank's output to DIR/{rank}/stdout.log, stderr.log")
@argument("--tee", help="ranks whose output the notebook shows (all): the rest only in --log-dir")
@argument(
    "--debug",
    action="store_true",
    help="torch's collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL): a mismatch fails at once",
)
@argument(
    "--threads",
    type=_threads,
    help="intra-op threads per rank: N, or auto (cores / ranks); default as torchrun (1)",
)
def ddp_start(line):
    """Start the pool (restarting it with these options if one runs)."""


@magic_arguments()
@argument("--world-size", type=_world_size, required=True, help="how many ranks will connect")
@argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback by default)")
@argument("--token-file", default=launch.DEFAULT_TOKEN_FILE, help="shared secret (made if missing)")
@argument("--timeout", type=_seconds, default=600.0, help="seconds to wait for every rank")
@argument("--slurm", help="sbatch options: submit the torchrun job too ('--nodes 2 ...')")
def ddp_attach(line):
    """Wait for ranks started by torchrun elsewhere to connect, then use them as the pool."""


@magic_arguments()
@argument("names", nargs="+", help="notebook names to ship")
@argument("--ranks", help="only these ranks: '0,2-3'")
def ddp_push(line):
    """Bind notebook objects on the ranks."""


@magic_arguments()
@argument("--ranks", help="only these ranks: '0,2-3'")
@argument("--keep", action="store_true", help="keep the script's globals in each rank's namespace")
@argument("script", help="a torchrun script, run unchanged as __main__ on every rank")
@argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv)")
def ddp_run(line):
    """Run a torchrun script on the pool: ``%ddp run [--ranks R] [--keep] train.py --lr 0.1``."""


@magic_arguments()
@argument("file", help="the script to write, e.g. train.py")
@argument("-n", type=_world_size, help="the torchrun command's --nproc-per-node (the pool's)")
def ddp_export(line):
    """Write this session's %%ddp cells, and what they used from the notebook, as a torchrun
    script."""


@magic_arguments()
@argument("name", help="a name or expression on the ranks")
@argument("--rank", type=int, default=0, help="which rank (default 0)")
@argument("--all", action="store_true", help="a list with every rank's value")
def ddp_pull(line):
    """Return a rank's value (``x = %ddp pull NAME``)."""


@magic_arguments()
@argument("--rank", type=int, help="which rank (default: the first that failed)")
def ddp_debug(line):
    """pdb where a rank's last failed cell raised, in its live namespace (post-mortem)."""


# ---------------------------------------------------------------- the magics


@magics_class
class DDPMagics(Magics):
    """``%%ddp`` runs a cell on the pool; ``%ddp start|status|restart|stop|interrupt|push|pull``."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.options: dict = {}
        self.auto = True
        self.auto_limit = 100 * 2**20
        self.tee: list[int] | None = None  # ranks whose output is shown (None: all)
        self.import_log: list[str] = []  # the notebook's import statements, in order
        self._replayed = (-1, 0)  # (pool generation, imports replayed to all its ranks)
        self._shipped = capture.Shipped()
        self._failed_ranks: list[int] = []  # the last failed cell's, the root cause first
        shell.events.register("post_run_cell", self._record_imports)

    @property
    def pool(self) -> Pool | None:
        """The pool this notebook uses, shared with ``nbddp.ranch``."""
        return default_pool()

    @pool.setter
    def pool(self, pool: Pool | None) -> None:
        set_default_pool(pool)

    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None):
        # its docstring, what %ddp? and %%ddp? show, is help_text(): made from the parsers
        if cell is not None:
            return self._cell(line, cell)
        command, _, rest = line.strip().partition(" ")
        if command not in SUBCOMMANDS:
            raise UsageError(
                f"unknown %ddp command {command!r}: use one of {', '.join(SUBCOMMANDS)}"
                if command
                else f"%ddp needs a command: {', '.join(SUBCOMMANDS)} (or use %%ddp on a cell)"
            )
        try:
            return getattr(self, f"_{command}")(rest)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None

    # -- pool management

    def _want_pool(self, n: int | None, **options) -> Pool:
        """The pool to use, started, at size ``n`` when given (restarting it if need be)."""
        options = {**self.options, **{k: v for k, v in options.items() if v is not None}}
        pool = self.pool
        size = n or (pool.world_size if pool else None) or default_world_size()
        if pool is not None and (size != pool.world_size or options != self.options):
            if pool.started:
                print(f"nbddp: restarting the pool with {size} rank{'s' * (size > 1)}")
            pool.stop()
            pool = None
        if pool is None:
            try:
                self.pool, self.options = Pool(size, **options), options
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            pool = self.pool
        if not pool.started and not pool.needs_restart:
            t0 = time.perf_counter()
            try:
                pool.start()
            except PoolStartError as exc:
                self.pool = None
                raise UsageError(f"the pool did not start: {exc}") from None
            self._say(f"started {size} rank{'s' * (size > 1)} in {time.perf_counter() - t0:.1f} s")
        return pool

    @staticmethod
    def _say(text: str) -> None:
        print(f"nbddp: {text}")

    def _start(self, rest: str) -> None:
        args = parse_argstring(ddp_start, rest)
        self.auto_limit = capture.parse_size(args.auto_limit)
        self.auto = not args.no_auto
        try:
            gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
        except ValueError:
            raise UsageError(f"--gpus takes GPU numbers like 0,3, not {args.gpus!r}") from None
        self.tee = capture.parse_ranks(args.tee) if args.tee else None
        options = {
            "backend": args.backend,
            "start_method": args.start_method,
            "pg_timeout": args.timeout,
            "grace": args.grace,
            "device": args.device,
            "gpus": gpus,
            "seed": args.seed,
            "groups": args.groups,
            "mesh": args.mesh,
            "log_dir": os.path.abspath(os.path.expanduser(args.log_dir)) if args.log_dir else None,
            "debug": args.debug or None,
            "threads": args.threads,
        }
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        self.options = {}
        self._want_pool(args.n, **options)

    def _attach(self, rest: str) -> None:
        args = parse_argstring(ddp_attach, rest)
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--listen takes HOST:PORT, not {args.listen!r}")
        token = launch.read_or_create_token(args.token_file)
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        pool = Pool(
            args.world_size,
            listen=(host, int(port)),
            token=token,
            start_timeout=args.timeout,
            on_join=self._joined,
        )
        address = pool.listen()
        reachable = (
            address
            if host not in ("0.0.0.0", "::")
            else f"{socket.getfqdn()}:{address.rsplit(':', 1)[1]}"
        )
        if args.slurm:
            try:
                script = launch.slurm_script(
                    args.slurm, args.world_size, reachable, args.token_file, python=sys.executable
                )
            except ValueError as exc:
                pool.stop()
                raise UsageError(str(exc)) from None
            self._say(f"submitted SLURM job {launch.submit_slurm(script)}")
        else:
            self._say(
                f"listening on {address}; on each node run:\n"
                + launch.torchrun_command(reachable, args.token_file, args.world_size)
            )
        t0 = time.perf_counter()
        try:
            pool.start()
        except (PoolStartError, KeyboardInterrupt) as exc:
            pool.stop()
            raise UsageError(f"attach ended: {exc or 'interrupted'}") from None
        print()
        hosts = sorted({s.host for s in pool.status()})
        self.pool, self.options = pool, {}
        self._say(
            f"attached {args.world_size} ranks on {len(hosts)} host"
            f"{'s' * (len(hosts) > 1)} ({', '.join(hosts)}) in "
            f"{time.perf_counter() - t0:.1f} s"
        )

    @staticmethod
    def _joined(connected: int, world_size: int) -> None:
        print(f"\rnbddp: {connected}/{world_size} ranks connected", end="", flush=True)

    def _status(self, rest: str) -> None:
        """One row per rank: pid, host, device, state, uptime, memory."""
        if self.pool is None or not self.pool.started:
            print("nbddp: no pool is running")
            return
        rows = [("rank", "pid", "host", "device", "state", "uptime", "rss")]
        for s in self.pool.status():
            rss = "-" if s.rss is None else f"{s.rss / 2**20:.0f} MiB"
            rows.append(
                (str(s.rank), str(s.pid), s.host, s.device, s.state, f"{s.uptime:.0f} s", rss)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())

    def _stacks(self, rest: str) -> None:
        """Every rank's current Python stack, grouped; and where the last stuck cell was."""
        if self.pool is None or not self.pool.started:
            print("nbddp: no pool is running")
            return
        now = self.pool.stacks()
        busy = {rank: frames for rank, frames in now.items() if frames}
        if busy:
            print("\n".join(stacks.format_groups(busy)))
        else:
            print(f"nbddp: every rank is idle ({stacks.rank_set(sorted(now))})")
        if self.pool.last_stacks:
            print("where the ranks were when the last cell was interrupted or timed out:")
            print("\n".join(stacks.format_groups(self.pool.last_stacks)))

    def _restart(self, rest: str) -> None:
        """New ranks with the same options (every rank's state is gone)."""
        if self.pool is None:
            raise UsageError("no pool to restart: start one with %ddp start or %%ddp")
        if self.pool.attached:
            raise UsageError("an attached pool restarts with torchrun: run it again, then attach")
        t0 = time.perf_counter()
        self.pool.restart()
        self._say(
            f"restarted {self.pool.world_size} ranks in {time.perf_counter() - t0:.2f} s "
            "(their state is gone)"
        )

    def _stop(self, rest: str) -> None:
        """End every rank and helper process of the pool."""
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
            self._say("stopped the pool")

    def _interrupt(self, rest: str) -> None:
        """Interrupt the running cell on every rank (as the stop button does)."""
        if self.pool is not None:
            self.pool.interrupt()

    def _push(self, rest: str) -> None:
        args = parse_argstring(ddp_push, rest)
        names = capture.split_names(" ".join(args.names))
        objects = capture.collect(names, self.shell.user_ns)
        pool = self._want_pool(None)
        payload = capture.pack(objects, pool.shm_folder)
        ranks = capture.parse_ranks(args.ranks, pool.world_size)
        self._finish(pool.run("", ranks=ranks, needs=payload), TextSink())

    def _pull(self, rest: str):
        args = parse_argstring(ddp_pull, rest)
        pool = self._want_pool(None)
        if not 0 <= args.rank < pool.world_size:
            raise UsageError(f"--rank: no rank {args.rank} in a pool of {pool.world_size}")
        ranks = None if args.all else [args.rank]
        end = self._finish(pool.run(args.name, ranks=ranks, want_values=True), TextSink(quiet=True))
        if args.all:
            return [end.values.get(r) for r in range(pool.world_size)]
        return end.values.get(args.rank)

    def _run(self, rest: str) -> None:
        args = parse_argstring(ddp_run, rest)
        if not os.path.isfile(args.script):
            raise UsageError(f"no such script: {args.script}")
        pool = self._want_pool(None)
        try:
            ranks = capture.parse_ranks(args.ranks, pool.world_size)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        events = pool.run_script(args.script, args.args, keep=args.keep, ranks=ranks, tick=TICK)
        self._finish(events, self._sink(pool, ranks, text=False, quiet=False))

    def _export(self, rest: str) -> None:
        args = parse_argstring(ddp_export, rest)
        cells = [c for c in self.shell.history_manager.input_hist_raw if c.strip()]
        cells = [c for c in cells if not c.lstrip().startswith("%ddp export")]
        n = args.n or (self.pool.world_size if self.pool else None)
        result = export.export(cells, n, source="this notebook", target=args.file)
        with open(args.file, "w", encoding="utf-8") as f:
            f.write(result.script)
        self._say(f"wrote {args.file}: run it with {result.command(args.file)}")
        for note in result.notes:
            self._say(note)

    # -- cells

    def _cell(self, line: str, cell: str) -> None:
        args = parse_argstring(ddp_cell, line)
        try:
            explicit = capture.split_names(" ".join(args.need))
            named = capture.collect(explicit, self.shell.user_ns)  # missing: said before a start
            imports = capture.check_imports(args.imports)
            size = args.n or (self.pool and self.pool.world_size)
            ranks = capture.parse_ranks(args.ranks, size)
            display_ranks = capture.parse_ranks(args.display, size)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out takes a variable name, not {args.out!r}")
        pool = self._want_pool(args.n)
        if ranks and max(ranks) >= pool.world_size:
            raise UsageError(f"--ranks: no rank {max(ranks)} in a pool of {pool.world_size}")
        try:
            needs = capture.pack(named, pool.shm_folder)
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        auto = None
        if self.auto and not args.no_auto:
            auto, imports = self._capture(pool, cell, ranks, explicit, needs, imports)
        try:
            events = pool.run(
                cell,
                ranks=ranks,
                needs=needs,
                auto=auto,
                imports=imports,
                want_values=args.out is not None,
                timeout=args.timeout,
                display_ranks=display_ranks,
                tick=TICK,
                profile=args.profile,
            )
        except PoolClosedError as exc:  # an attached pool that lost a rank
            raise UsageError(str(exc)) from None
        sink = self._sink(pool, ranks, text=args.text, quiet=args.quiet, fold=not args.no_fold)
        self._finish(events, sink, out=args.out)

    # -- automatic capture

    def _record_imports(self, result) -> None:
        """After each notebook cell: remember the import statements it ran."""
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        if result.error_in_exec is not None or result.error_before_exec is not None:
            return
        if raw.lstrip().startswith("%%"):  # %%ddp cells (and other cell magics) are not ours
            return
        for stmt in capture.import_statements(self.shell.transform_cell(raw)):
            if stmt not in self.import_log:
                self.import_log.append(stmt)

    def _capture(self, pool: Pool, cell: str, ranks, explicit, needs, imports: str):
        """Names the cell reads that only the notebook has, and imports to replay; said once."""
        try:
            objects, sizes, notes = capture.select_auto(
                self.shell.transform_cell(cell),  # what the ranks compile: magics made calls
                self.shell.user_ns,
                pool.names_on(ranks),
                explicit,
                self.auto_limit,
                capture.names_imported(self.import_log),
                lambda name, obj: self._shipped.unchanged(pool.generation, name, obj),
            )
            auto = capture.pack(objects, pool.shm_folder)
            for name, obj in objects.items():
                self._shipped.sent(name, obj)
        except CaptureError as exc:
            objects, sizes, notes, auto = {}, {}, [str(exc)], None
        generation, done = self._replayed
        replay = self.import_log[done if generation == pool.generation else 0 :]
        if ranks is None:
            self._replayed = (pool.generation, len(self.import_log))
        said = [f"{n} ({capture.human(sizes[n])})" for n in objects]
        if replay:
            said.append(f"replayed {len(replay)} import{'s' * (len(replay) > 1)}")
        if said:
            self._say("shipped " + ", ".join(said) if objects else ", ".join(said))
        for note in notes:
            self._say(note)
        return auto, "\n".join([*replay, imports] if imports else replay)

    def _sink(
        self, pool: Pool, ranks: list[int] | None, *, text: bool, quiet: bool, fold: bool = True
    ):
        """The widget dashboard in a front end with widgets, else ``[rank N]`` lines."""
        if quiet or text or getattr(self.shell, "kernel", None) is None:
            return TextSink(quiet=quiet, hosts=pool.hosts, fold=fold)
        devices = sorted(set(pool.devices))
        return Dashboard(
            list(range(pool.world_size)) if ranks is None else ranks,
            world_size=pool.world_size,
            backend=pool.backend_in_use,
            devices=", ".join(devices) if len(devices) <= 2 else f"{len(devices)} devices",
            hosts=pool.hosts,
            fold=fold,
        ).show()

    def _finish(self, events, sink, out: str | None = None, cell: bool = True) -> P.CellEnd:
        """Drive events into the sink (passing Ctrl-C on to the ranks); raise on failure."""
        end = None
        closed: set[int] = set()  # ranks whose pdb session was closed here
        while True:
            try:
                for event in events:
                    if isinstance(event, P.CellEnd):
                        end = event
                    if self._teed(event):
                        sink.handle(event)
                    if isinstance(event, P.RankDebug):
                        self._debug_prompt(event, closed)
                break
            except KeyboardInterrupt:
                if self.pool is not None:
                    self.pool.interrupt()
        sink.close(end)
        if end is None:
            raise CellInterrupted("interrupt", notes=["the pool was stopped"])
        if end.profiles:
            print(profiling.report(end.profiles))
        if out is not None:
            self.shell.user_ns[out] = [end.values.get(r) for r in range(self.pool.world_size)]
        try:
            raise_for_end(end, self.pool.hosts if self.pool is not None else None)
        except CellFailed as exc:  # the error carries the notes: say only the hints beside it
            for hint in launcher_hints(end):
                self._say(hint)
            failed = [f.rank for f in exc.failures if isinstance(f, RankFailed)]
            if cell:  # (not a post-mortem session's own failure)
                self._failed_ranks = failed
            if cell and failed and self.pool is not None and not self.pool.needs_restart:
                self._say(
                    f"%ddp debug opens pdb where rank {self._failed_ranks[0]} failed "
                    "(--rank R for another)"
                )
            raise
        for note in end.notes:
            self._say(note)
        return end

    def _debug_prompt(self, event: P.RankDebug, closed: set[int]) -> None:
        """A rank's pdb wants a line: show what it said, ask in the input box, answer.

        No input box (nbclient, papermill), a closed input or the stop button end that
        rank's session (pdb quits) for the rest of the cell; nothing waits for a line
        that cannot come.
        """
        if event.rank in closed:
            self.pool.debug_reply(event, None)
            return
        if event.output:
            sys.stdout.write(event.output if event.output.endswith("\n") else event.output + "\n")
            sys.stdout.flush()
        try:
            with _ctrl_c_raises():  # (during a cell the pool turns Ctrl-C into a request)
                line = input(event.prompt)
        except StdinNotImplementedError:
            line = None
            self._say(
                f"rank {event.rank} stopped in pdb, but this front end has no input box "
                "(stdin): its debugger was closed"
            )
        except EOFError:
            line = None
        except KeyboardInterrupt:
            closed.add(event.rank)
            self.pool.debug_reply(event, None)
            raise
        if line is None:
            closed.add(event.rank)
        self.pool.debug_reply(event, line)

    def _debug(self, rest: str) -> None:
        """pdb where a rank's last failed cell raised, in its live namespace."""
        args = parse_argstring(ddp_debug, rest)
        if self.pool is None or not self.pool.started:
            raise UsageError("no pool is running: nothing to debug")
        rank = args.rank if args.rank is not None else next(iter(self._failed_ranks), None)
        if rank is None:
            raise UsageError("no cell has failed on a rank: %ddp debug --rank R names one")
        if not 0 <= rank < self.pool.world_size:
            raise UsageError(f"--rank: no rank {rank} in a pool of {self.pool.world_size}")
        events = self.pool.run("", ranks=[rank], post_mortem=True, tick=TICK)
        try:
            self._finish(events, TextSink(hosts=self.pool.hosts), cell=False)
        except CellFailed as exc:  # nothing to debug there: one line
            failure = exc.failures[0]
            if isinstance(failure, RankFailed) and failure.exc_type == "LookupError":
                raise UsageError(f"%ddp debug: {failure.message}") from None
            raise

    def _teed(self, event: object) -> bool:
        """With ``--tee``, output of the other ranks goes only to the log directory."""
        return self.tee is None or not isinstance(event, P.Output) or event.rank in self.tee

    def close(self) -> None:
        self.shell.events.unregister("post_run_cell", self._record_imports)
        if self.pool is not None:
            self.pool.stop()
            self.pool = None


@contextlib.contextmanager
def _ctrl_c_raises():
    """Ctrl-C (the stop button) raises KeyboardInterrupt inside: what ends an input() that
    waits for a line (the pool's own handler only asks the ranks to stop)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if previous is not None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- help, from the parsers

PARSERS = {
    "%%ddp": ddp_cell,
    "%ddp start": ddp_start,
    "%ddp attach": ddp_attach,
    "%ddp push": ddp_push,
    "%ddp pull": ddp_pull,
    "%ddp run": ddp_run,
    "%ddp export": ddp_export,
    "%ddp debug": ddp_debug,
}
for _prog, _magic in PARSERS.items():
    # usage lines and errors say "%ddp start", not "%ddp_start" (IPython adds one "%")
    _magic.parser.prog = _prog[1:]


def help_text() -> str:
    """What ``%ddp?`` and ``%%ddp?`` show: every subcommand, each option with its help,
    made from the argument parsers and the subcommands' own docstrings."""
    parts = [
        "Run a cell on a persistent pool of torch.distributed ranks "
        "(%%ddp), and manage the pool (%ddp COMMAND).\n"
    ]
    with_parser = {prog.split()[-1] for prog in PARSERS}
    for magic in PARSERS.values():
        parts.append(magic.parser.format_help())
    for command in SUBCOMMANDS:
        if command not in with_parser:
            doc = (getattr(DDPMagics, f"_{command}").__doc__ or "").strip().splitlines()[0]
            parts.append(f"%ddp {command}\n    {doc}\n")
    return "\n".join(parts)


DDPMagics.ddp.__doc__ = help_text()

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
