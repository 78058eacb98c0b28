"""Cells on a rank: the namespace, one cell's run from ``Run`` to ``Done``, interrupts.

The main thread runs :meth:`CellRunner.run`; the receiver thread calls the
``on_*`` handlers (an interrupt, a stack query, an abort for the running cell).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import os
import pdb
import sys
import threading
import traceback
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..wire import payload
from ..wire import protocol as P
from ..wire import stacks as S
from . import held as worker_held
from . import metrics, profiling, rich
from .control import flush_streams, write_marker
from .ddp import DDPContext
from .group import GroupKeeper, layout
from .interrupts import CellInterrupts, MainSigint
from .seq import call_group, call_shape, thread_ops
from .user_code import OUT_OF_MEMORY, adopt, error_info, run_code, run_script, unwrap

__all__ = ["CellInterrupts", "CellRunner"]

CELL_PREFIX = S.CELL_PREFIX


@dataclasses.dataclass
class _Outcome:
    status: str = "ok"
    value: object = None
    error: P.ErrorInfo | None = None
    profile: object = None


class CellRunner:
    """The rank's namespace and the cells run in it."""

    def __init__(
        self,
        rank: int,
        send: Callable[[object], None],
        group: GroupKeeper,
        relayed: bool = False,
    ) -> None:
        self.rank, self.send, self.group = rank, send, group
        self.relayed = relayed  # behind this host's relay (nbddp.hosts.relay): no end markers
        self.running = False
        self.in_code = False  # the user's code runs: only then does SIGINT interrupt
        self.cell: int | None = None  # the cell the main thread runs
        self.interrupts = CellInterrupts()
        self.abort_cell: int | None = None  # the group was aborted during this cell
        self.main_ident = threading.get_ident()
        self.ship_dir: str | None = None  # where big values go back to the notebook
        self._reported_names: frozenset[str] = frozenset()
        self.reported_held: tuple[P.Held, ...] | None = None
        self.shipped: dict[str, object] = {}  # name -> the object the notebook sent
        self.versions: dict[str, int] = {}  # name -> the notebook's version of that object
        self.failed: types.TracebackType | None = None  # where the last failed cell raised
        self.failed_oom = False  # ... and it ran out of memory (its frames were let go)
        self.namespace: dict = {}
        self.places_before: tuple = ()  # each group's count as the running cell started
        self.thread_ops_before = 0  # (and other threads' operations then)
        self.sigint = MainSigint()  # SIGINT to the main thread, sent until it is handled

    def make_namespace(self, ctx: DDPContext) -> None:
        """The rank's persistent namespace: it is ``__main__``, so pickle finds cell classes."""
        main = types.ModuleType("__main__")
        main.__dict__.update(
            __builtins__=builtins,
            display=rich.display,
            torch=torch,
            rank=ctx.rank,
            local_rank=ctx.local_rank,
            world_size=ctx.world_size,
            device=ctx.device,
            **layout(ctx),
        )
        sys.modules["__main__"] = main
        self.namespace = self.group.namespace = main.__dict__

    # -- from the receiver thread

    def on_sigint(self, _signum: int, _frame: object) -> None:
        """Interrupt the user's code, never the rank's own work around it (the error being
        formatted, Done being sent): a KeyboardInterrupt there would end the rank."""
        self.sigint.handled += 1
        if self.in_code:
            raise KeyboardInterrupt

    def on_interrupt(self, msg: P.Interrupt) -> None:
        """Interrupt the cell running now. Where it was is already said: the notebook sends
        a StackQuery just before each Interrupt, and this thread answers them in order
        (sending the stack again here made an interrupt of a busy loop 3-4 ms slower)."""
        if self.interrupts.request(msg.cell):
            self.sigint.send(lambda: self.interrupts.running == msg.cell)

    def on_stack_query(self, _msg: P.StackQuery) -> None:
        """Where the main thread is, and its place in each group's collectives: final
        for the last cell it ran when it was idle before and after they were read."""
        idle, cell = not self.running, self.cell
        frame = None if idle else sys._current_frames().get(self.main_ident)
        frames = S.frames_of(frame) if frame is not None else ()
        places, on, shape = self.group.positions(), call_group(frame), call_shape(frame)
        after = (cell or 0) if idle and not self.running and self.cell == cell else None
        del frame
        said = (after, places, on, shape)
        self.send(P.Stacks(frames, self.cell if self.running else None, said))

    def on_abort_group(self, msg: P.AbortGroup, inbox_put: Callable[[object], None]) -> None:
        if self.running and msg.cell == self.cell:
            self.abort_cell = msg.cell  # and again when the cell ends: the cascade
            self.group.free_blocked()
        elif self.group.joining and not self.running:  # a re-form waits for a dead peer
            self.group.free_blocked()
        elif not self.running:
            inbox_put(msg)  # between cells: the main thread aborts
        # else: for a cell that has ended here already

    # -- on the main thread

    def abort_between_cells(self, msg: P.AbortGroup) -> None:
        self.abort_cell = msg.cell
        self.group.abort()

    def run(self, msg: P.Run) -> None:
        rich.set_displaying(msg.display)
        metrics.new_cell()
        self.cell, self.running = msg.cell, True
        # (did the cell issue a collective, or a thread while it ran?)
        self.places_before, self.thread_ops_before = self.group.positions(), thread_ops()
        try:
            out = self._execute(msg)
        finally:
            self.running = False
            self.interrupts.end(msg.cell)
        try:
            self._finish(msg, out)
        except KeyboardInterrupt:  # raised by the user's own code, a __repr__ say: Done still
            metrics.flush()
            self._end_streams(msg.cell)  # (a second end marker for a cell is ignored)
            places = self.group.positions()
            self.send(P.Done(msg.cell, "interrupted", places=places, **self.changed_names()))

    def _finish(self, msg: P.Run, out: _Outcome) -> None:
        """After the cell's code: abort if asked to, show its value, flush, send Done."""
        freed = self.abort_cell == msg.cell
        if freed:  # freed from a collective, or done meanwhile:
            self.group.abort()  # close this rank's side too, so peers it talks to are freed
        self._show(out.value if out.status == "ok" else None)
        metrics.flush()  # every point the cell logged, before its Done
        self._end_streams(msg.cell)
        done = self._done(msg, out.status, out.value, out.error)
        lost = not dist.is_initialized()  # the cell destroyed it: the pool forms a new one
        places = self.group.positions()  # the pool checks that the ranks are in step
        done = dataclasses.replace(
            done,
            freed=freed,
            needs_group=lost,
            profile=out.profile,
            places=places,
            issued=lost or (places, thread_ops()) != (self.places_before, self.thread_ops_before),
        )
        self.send(dataclasses.replace(done, **self.changed_names()))

    def _execute(self, msg: P.Run) -> _Outcome:
        out = _Outcome()
        try:
            self.in_code = True
            try:
                out.value, out.profile = self._body(msg)
            finally:
                self.in_code = False
        except KeyboardInterrupt:
            out.status = "interrupted"
        except BaseException as exc:  # SystemExit too: as in IPython, the process stays
            entry = msg.script and os.path.abspath(msg.script.path)
            out.status, out.error = "error", error_info(exc, entry)
            if not msg.post_mortem:  # kept for %ddp debug, frames and all; not after running
                # out of memory: those frames hold what filled it, and the next cell needs it
                self.failed = None if isinstance(exc, OUT_OF_MEMORY) else exc.__traceback__
                self.failed_oom = self.failed is None
        return out

    def _body(self, msg: P.Run) -> tuple[object, object]:
        """The cell's own work: (its value, its profile)."""
        if self.interrupts.start(msg.cell):  # it came before the cell did
            raise KeyboardInterrupt
        if msg.imports:
            run_code(msg.imports, f"{CELL_PREFIX}imports>", self.namespace)
        versions = dict(msg.versions)
        if msg.needs:
            self._bind(payload.loads(msg.needs), versions, overwrite=True)
        if msg.auto:
            self._bind(payload.loads(msg.auto), versions, overwrite=False)
        filename = f"{CELL_PREFIX}cell-{msg.cell}>"
        if msg.post_mortem:
            self._post_mortem()
        elif msg.script is not None:
            run_script(msg.script, self.namespace)
        elif msg.profile:
            return profiling.profiled(
                msg.profile, lambda: run_code(msg.code, filename, self.namespace)
            )
        else:
            return run_code(msg.code, filename, self.namespace), None
        return None, None

    def _post_mortem(self) -> None:
        """pdb in the frame where this rank's last failed cell raised (``%ddp debug``)."""
        tb = self.failed
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
            tb = tb.tb_next  # from the cell's own frame, as its traceback shows it
        if tb is None and self.failed_oom:
            raise LookupError(
                f"rank {self.rank}'s last failed cell ran out of memory: its frames were let "
                "go to free it, so there is nothing to debug"
            )
        if tb is None:
            raise LookupError(f"rank {self.rank} has no failed cell to debug")
        pdb.post_mortem(tb)

    def changed_names(self) -> dict:
        """``names``, ``modules`` and ``held`` for a Done or Ready, each None when it did not
        change (the notebook's record stands): the rank's own names (not those still bound
        to notebook objects), which of them are modules, and every name with its kind and
        size, the notebook's included (what a death loses, :mod:`nbddp.rank.held`)."""
        for name in [n for n in self.shipped if not self._from_notebook(n)]:
            del self.shipped[name]  # the rank rebound it: it is the rank's own now
            self.versions.pop(name, None)
        held = worker_held.held(self.namespace, self.shipped)
        changed = {"held": None if held == self.reported_held else held}
        self.reported_held = held
        names = frozenset(h.name for h in held if not h.shipped)
        if names == self._reported_names and names:
            return {"names": None, "modules": None, **changed}
        self._reported_names = names
        modules = [h.name for h in held if h.kind == "import" and not h.shipped]
        return {"names": tuple(sorted(names)), "modules": tuple(modules), **changed}

    def _show(self, value: object) -> None:
        """Like IPython's inline backend: a rich last value, then open figures, are shown."""
        try:
            bundle = rich.rich_bundle(value) if value is not None else None
            if bundle is not None and rich._displaying:
                figures = [m.canvas.figure for m in _open_figure_managers()]
                if value not in figures:
                    self.send(P.Display(*bundle))
            rich.show_figures()
        except Exception:
            traceback.print_exc()

    def _bind(self, objects: dict, versions: dict[str, int], overwrite: bool) -> None:
        """Bind shipped objects; automatic capture never overwrites the rank's own.

        An object with a version is the notebook's: a name still bound to it stays
        the notebook's, and a newer version of the same notebook replaces it; the same
        version is kept as the rank holds it (a model it trained in place). What
        another notebook (kernel) sent is the rank's own once a new one would ship it.
        An object without a version (``%ddp copy``) is the rank's own from now on.
        """
        for name, obj in objects.items():
            version = versions.get(name)
            if not overwrite and not self._notebook_may_bind(name, version):
                continue
            self.namespace[name] = obj = adopt(obj, self.namespace)
            if version is None:
                self.shipped.pop(name, None)
                self.versions.pop(name, None)
            else:
                self.shipped[name], self.versions[name] = obj, version

    def _notebook_may_bind(self, name: str, version: int | None) -> bool:
        if name not in self.namespace:
            return True
        held = self.versions.get(name)
        if held is None or version is None or P.kernel_of(held) != P.kernel_of(version):
            self.shipped.pop(name, None)  # another notebook's: the rank's own from now on
            self.versions.pop(name, None)
            return False
        return self._from_notebook(name) and held != version

    def _from_notebook(self, name: str) -> bool:
        return name in self.shipped and self.namespace.get(name) is self.shipped[name]

    def _done(self, msg: P.Run, status: str, value: object, error: P.ErrorInfo | None) -> P.Done:
        if status != "ok" or value is None:
            return P.Done(msg.cell, status, error=error)
        try:
            value_repr = repr(value)
        except Exception as exc:
            value_repr = f"<repr failed: {type(exc).__name__}: {exc}>"
        if len(value_repr) > 10_000:
            value_repr = value_repr[:10_000] + " ..."
        packed, files = None, ()
        if msg.want_value:
            try:
                shipment = payload.dumps(unwrap(value), self._shm_dir() if msg.shm else None)
                packed, files = shipment.data, tuple(shipment.files)
            except Exception as exc:
                return P.Done(msg.cell, "error", error=_unpicklable(value, exc))
        return P.Done(msg.cell, "ok", packed, value_repr, files=files)

    def _shm_dir(self) -> str:
        """The pool's shared-memory directory (the notebook removes it), else one of ours."""
        if self.ship_dir is None:
            pool_dir = os.environ.get("NBDDP_SHM_DIR")
            self.ship_dir = payload.private_dir(pool_dir) if pool_dir else payload.shm_dir()
        return self.ship_dir

    def _end_streams(self, cell: int) -> None:
        """Flush Python and C buffers, then mark the end of this cell in both streams."""
        flush_streams()
        if self.relayed:  # the relay has all it wrote when Done comes (Unix sockets)
            return
        marker = P.end_marker(cell)
        for fd, other in ((1, 2), (2, 1)):
            _mark(fd, other, marker)


def _mark(fd: int, other: int, marker: bytes) -> None:
    """The end marker on ``fd``; a cell that closed it (``os.close(1)``) gets ``other``'s
    stream there from now on (said once), and the rank lives on."""
    try:
        write_marker(fd, marker)
        return
    except OSError:
        pass
    try:
        os.dup2(other, fd)
    except OSError:  # both closed: nothing can be said any more
        return
    name = {1: "stdout", 2: "stderr"}
    note = f"nbddp: the cell closed this rank's {name[fd]}; it goes to {name[other]} now\n"
    with contextlib.suppress(OSError):
        os.write(other, note.encode())


def _unpicklable(value: object, exc: Exception) -> P.ErrorInfo:
    what = f"the cell's value ({type(value).__name__}) cannot be pickled: {exc}"
    return P.ErrorInfo("PicklingError", what, f"PicklingError: {what}\n")


def _open_figure_managers() -> list:
    if "matplotlib.pyplot" not in sys.modules:
        return []
    from matplotlib._pylab_helpers import Gcf

    return Gcf.get_all_fig_managers()
