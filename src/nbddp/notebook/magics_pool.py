"""``%ddp`` commands that start, stop and inspect the pool: a part of
:class:`nbddp.notebook.magics.DDPMagics` (it inherits them), kept apart so each file does one
job. They use ``self.session``, ``self.capture``, ``self.tee``, ``self._sink`` and
``self._finish`` of the magics class; no process logic lives here either.
"""

from __future__ import annotations

import os
import time

from IPython.core.error import UsageError

from ..pool import capture
from ..pool.errors import PoolStartError
from . import attaching, detaching, reports
from .options import ddp_attach, ddp_connect, ddp_start, parse_argstring
from .session import default_world_size, running, say, what_it_held

__all__ = ["PoolCommands"]

_KEPT = "every rank kept its state"
_NEED = (" needs new processes for every rank", " need new processes for every rank")


def _names(text: str | None) -> list[str] | None:
    """``--heal model,opt``, ``--keep fmodel``: the names (capture.split_names refuses one
    that is not a name, in one line), checked before any pool is touched."""
    return capture.split_names(text) or None


def _heal(text: str | None, on_death: str) -> list[str] | None:
    """``--heal model,opt``: the names, checked before any pool is touched."""
    names = _names(text)
    if names and on_death != "replace":
        raise UsageError("--heal needs --on-death replace: a pool that restarts heals no rank")
    return names


class PoolCommands:
    """``%ddp start|attach|status|stacks|restart|stop|connect|list|disconnect|interrupt``."""

    def _start(self, rest: str) -> None:
        """Start the pool; with one running: a no-op with the same options, a resize with
        only another -n, in place for what a live pool can change (--heal, --grace, ...),
        and for what needs new processes a refusal while the pool holds state, unless
        --force. Everything is checked before it is touched."""
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
            keep=_names(args.keep),
        )
        forced = f"%ddp start {rest.strip()}" + ("" if args.force else " --force")
        kernel_side = self._kernel_side(args.no_auto, auto_limit, args.auto_limit, tee)
        if args.detached:
            self._start_detached(args, options, forced)
        elif self.session.unchanged(args.n, **options):
            n = self.pool.world_size
            if kernel_side:
                say(f"applied to the running pool: {' '.join(kernel_side)}; {_KEPT}")
            else:
                say(
                    f"the pool already runs with these options ({n} rank{'s' * (n > 1)}); "
                    "%ddp restart starts it anew"
                )
        else:
            self._start_local(args.n, options, None if args.force else forced, kernel_side)
        self.capture.on, self.capture.limit, self.tee = not args.no_auto, auto_limit, tee

    def _kernel_side(self, no_auto: bool, limit: int, limit_text: str, tee) -> list[str]:
        """The notebook's own options that change for a running local pool, as they would be
        said (they never touch the ranks)."""
        pool = self.pool
        if pool is None or not running(pool) or pool.attached or getattr(pool, "detached", False):
            return []
        said = []
        if self.capture.on == no_auto:
            said.append("--no-auto" if no_auto else "automatic capture on")
        if self.capture.limit != limit:
            said.append(f"--auto-limit {limit_text}")
        if self.tee != tee:
            said.append(f"--tee {','.join(map(str, tee))}" if tee else "no --tee")
        return said

    def _start_local(self, n: int | None, options: dict, forced: str | None, kernel_side) -> None:
        """``%ddp start`` without --detached: checked, then a start, a change in place, a
        resize or a restart (refused while the pool holds state, unless ``forced`` is None:
        --force was given)."""
        pool = self.pool
        if pool is not None and (
            pool.attached or getattr(pool, "detached", False) or pool.needs_restart
        ):  # not a pool `%ddp start` made, or one that holds nothing: checked, let go
            size = n or default_world_size()
            self.session.check(size, **options)
            self.session.let_go()
        elif running(pool):
            fresh, in_place = self.session.changes(**options)
            self.session.check(n or pool.world_size, **options)
            if fresh:
                if forced is not None:
                    self.session.refuse_restart(", ".join(fresh) + _NEED[len(fresh) > 1], forced)
            elif in_place or kernel_side:
                self.session.apply(**options)
                say(f"applied to the running pool: {' '.join(in_place + kernel_side)}; {_KEPT}")
        self.session.want_pool(n, exact=True, **options)

    def _start_detached(self, args, options: dict, forced: str) -> None:
        """``%ddp start --detached NAME``: the options and the name checked, and a local
        pool that holds state refused unless --force, then the pool this kernel had is let
        go, then the detached one started."""
        n = args.n or default_world_size()
        self.session.check(n, **options)
        detaching.check_name(args.detached)
        if not args.force:
            held = self.pool
            why = f"--detached {args.detached} starts new processes and stops this kernel's pool"
            if held is not None and not held.attached:
                self.session.refuse_restart(why, forced)
        lost = self.session.let_go()
        try:
            pool = detaching.start(args.detached, n, args.idle_timeout, options)
        except (UsageError, PoolStartError) as exc:
            raise UsageError(f"{exc}; {lost}" if lost else str(exc)) from None
        self.session.use(pool)

    def _attach(self, rest: str) -> None:
        """Wait for ranks started by torchrun elsewhere to connect, then use them."""
        args = parse_argstring(ddp_attach, rest)
        host, port, token, _ = where = attaching.prepare(args)
        self.session.check(  # (a detached pool's own start checks these again)
            args.world_size,
            listen=(host, port),
            token=token,
            start_timeout=args.timeout,
            workspace=args.workspace,
        )
        lost = self.session.let_go()
        try:
            self.session.use(attaching.attach(args, *where))
        except UsageError as exc:
            raise UsageError(f"{exc}; {lost}" if lost else str(exc)) from None

    def _status(self, rest: str) -> None:
        """One row per rank: pid, host, device, state, uptime, memory."""
        print(reports.status(self.pool))

    def _stacks(self, rest: str) -> None:
        """Every rank's current Python stack, grouped; and where the last stuck cell was."""
        print(reports.stacks(self.pool))

    def _restart(self, rest: str) -> None:
        """New ranks with the same options (every rank's state is gone)."""
        if rest.strip():  # (other options: %ddp start's refusal names this way)
            raise UsageError(
                "%ddp restart takes no options: it keeps the pool's; "
                "`%ddp start OPTIONS --force` restarts it with others"
            )
        if self.pool is None:
            raise UsageError("no pool to restart: start one with %ddp start or %%ddp")
        if self.pool.attached:
            raise UsageError("an attached pool restarts with torchrun: run it again, then attach")
        if not getattr(self.pool, "detached", False):
            self.session.check(self.pool.world_size, **self.session.options)
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
        held = self.pool
        if getattr(held, "name", None) == args.name and not args.force and not held.closed:
            say(f"already connected to the detached pool {args.name}")
            return
        pool = detaching.connect(args.name, args.force)  # first: a wrong name changes nothing
        if held is not None and not getattr(held, "detached", False) and running(held):
            say(f"stopped the pool of this kernel: {what_it_held(held)}")
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
