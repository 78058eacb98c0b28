"""``%ddp`` commands that start, stop and inspect the pool: a part of
:class:`nbddp.magics.DDPMagics` (it inherits them), kept apart so each file does one
job. They use ``self.session``, ``self.capture``, ``self.tee``, ``self._sink`` and
``self._finish`` of the magics class; no process logic lives here either.
"""

from __future__ import annotations

import os
import time

from IPython.core.error import UsageError

from . import attaching, capture, detaching, reports
from .options import ddp_attach, ddp_connect, ddp_start, parse_argstring
from .session import say

__all__ = ["PoolCommands"]


def _heal(text: str | None, on_death: str) -> list[str] | None:
    """``--heal model,opt``: the names, checked before any pool is touched."""
    if not text:
        return None
    names = capture.split_names(text)
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"--heal: not a name: {bad[0]!r}")
    if on_death != "replace":
        raise UsageError("--heal needs --on-death replace: a pool that restarts heals no rank")
    return names


class PoolCommands:
    """``%ddp start|attach|status|stacks|restart|stop|connect|list|disconnect|interrupt``."""

    def _start(self, rest: str) -> None:
        args = parse_argstring(ddp_start, rest)
        if args.tee and not args.log_dir:
            raise UsageError("--tee needs --log-dir: the other ranks' output would go nowhere")
        auto_limit = capture.parse_size(args.auto_limit)
        try:
            gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
        except ValueError:
            raise UsageError(f"--gpus takes GPU numbers like 0,3, not {args.gpus!r}") from None
        tee = capture.parse_ranks(args.tee) if args.tee else None
        log_dir = os.path.abspath(os.path.expanduser(args.log_dir)) if args.log_dir else None
        workspace = attaching.workspace(args.workspace, make=True)
        heal = _heal(args.heal, args.on_death)  # (checked before the pool is let go)
        self.capture.on, self.capture.limit, self.tee = not args.no_auto, auto_limit, tee
        self.session.release()
        options = dict(
            backend=args.backend,
            start_method=args.start_method,
            pg_timeout=args.timeout,
            grace=args.grace,
            device=args.device,
            gpus=gpus,
            seed=args.seed,
            groups=args.groups,
            mesh=args.mesh,
            log_dir=log_dir,
            workspace=workspace,
            debug=args.debug or None,
            threads=args.threads,
            on_death=args.on_death,
            heal=heal,
        )
        if args.detached:
            self.session.use(detaching.start(args.detached, args.n, args.idle_timeout, options))
        else:
            self.session.want_pool(args.n, **options)

    def _attach(self, rest: str) -> None:
        """Wait for ranks started by torchrun elsewhere to connect, then use them."""
        args = parse_argstring(ddp_attach, rest)
        where = attaching.prepare(args)
        self.session.release()
        self.session.use(attaching.attach(args, *where))

    def _status(self, rest: str) -> None:
        """One row per rank: pid, host, device, state, uptime, memory."""
        print(reports.status(self.pool))

    def _stacks(self, rest: str) -> None:
        """Every rank's current Python stack, grouped; and where the last stuck cell was."""
        print(reports.stacks(self.pool))

    def _restart(self, rest: str) -> None:
        """New ranks with the same options (every rank's state is gone)."""
        if self.pool is None:
            raise UsageError("no pool to restart: start one with %ddp start or %%ddp")
        if self.pool.attached:
            raise UsageError("an attached pool restarts with torchrun: run it again, then attach")
        t0 = time.perf_counter()
        self.pool.restart()
        say(
            f"restarted {self.pool.world_size} ranks in {time.perf_counter() - t0:.2f} s "
            "(their state is gone)"
        )

    def _stop(self, rest: str) -> None:
        """End every rank and helper process of the pool (or of the detached pool NAME)."""
        name = rest.strip()
        if name and (self.pool is None or getattr(self.pool, "name", None) != name):
            detaching.stop(name)
        elif self.session.stop():
            say(f"stopped the pool{' ' + name if name else ''}")

    def _connect(self, rest: str) -> None:
        """Connect to a detached pool: ``%ddp connect NAME [--force]``."""
        args = parse_argstring(ddp_connect, rest)
        self.session.release()
        pool = detaching.connect(args.name, args.force)
        self.session.use(pool)
        if pool.resumed:  # a cell ran while no kernel was connected: its output and end
            self._finish(pool, pool.resume(), self._sink(pool, None, text=False, quiet=False))

    def _list(self, rest: str) -> None:
        """This user's detached pools on this machine."""
        print(detaching.table())

    def _disconnect(self, rest: str) -> None:
        """Leave the detached pool running and this kernel without a pool."""
        detaching.disconnect(self.session)

    def _interrupt(self, rest: str) -> None:
        """Interrupt the running cell on every rank (as the stop button does)."""
        if self.pool is not None:
            self.pool.interrupt()
