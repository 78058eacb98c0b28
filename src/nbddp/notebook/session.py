"""Which pool the notebook uses: one for ``%%ddp``/``%ddp`` and ``nbddp.ranch`` alike.

The session holds the pool (:func:`default_pool`) and the options it was made with,
and :meth:`Session.want_pool` is the one place that starts it, resizes it or restarts
it with other options. No IPython here: refusals raise :class:`Refused`, which the
magics show as one line.
"""

from __future__ import annotations

import inspect
import time

import torch

from ..dashboard.metric_store import MetricStore
from ..pool import hosts_lost, inplace, resizing
from ..pool.errors import NbddpError, PoolStartError
from ..pool.facade import Pool
from ..pool.layout import check_pool
from ..rank.gpus import gpu_notes

__all__ = [
    "SESSION",
    "Refused",
    "Session",
    "default_pool",
    "default_world_size",
    "merged",
    "running",
    "what_it_held",
]


class Refused(NbddpError, ValueError):
    """A request the session does not carry out (one line says why); nothing changed."""


def running(pool) -> bool:
    """``pool`` runs: started, or an attached pool whose lost host's ranks are missing
    (nbddp.pool.hosts_lost: the others keep their state and wait, so it is not to be
    started again, and what needs every rank says which ranks are missing), or a pool
    whose rank's death ``%ddp status`` read waits for the next cell to replace that rank
    (started again, every rank's state would be lost)."""
    return pool is not None and (
        pool.started or bool(hosts_lost.missing(pool)) or getattr(pool, "mend_pending", False)
    )


def default_world_size() -> int:
    """One rank per visible GPU, else 2."""
    return torch.cuda.device_count() or 2


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n > 1)}"


def say(text: str) -> None:
    print(f"nbddp: {text}")


class Session:
    """The notebook's pool, the options it was started with, and every metric logged."""

    def __init__(self) -> None:
        self.options: dict = {}
        self.pool: Pool | None = None
        self.metrics = MetricStore()  # kept across pools: a restart loses no chart

    def use(self, pool: Pool | None, options: dict | None = None) -> None:
        """From now on ``pool`` (made with ``options``) is the one; the old one is stopped
        (a detached one is left running: this kernel disconnects)."""
        old = self.pool
        if old is not None and old is not pool:
            if getattr(old, "detached", False):
                old.disconnect()
            else:
                old.stop()
        self.pool = pool
        self.options = dict(options or {})

    def stop(self) -> bool:
        """Stop the pool, if there is one (a detached one too); whether there was."""
        had = self.pool is not None
        if had:
            self.pool.stop()
        self.use(None)
        return had

    def release(self) -> None:
        """This kernel lets the pool go: a local one stops, a detached one runs on."""
        self.use(None)

    def want_pool(self, n: int | None = None, *, exact: bool = False, **options) -> Pool:
        """The pool, started, with ``n`` ranks when given and ``options`` (None: as before).

        Everything is checked first: a refusal (:class:`Refused`) leaves the running pool
        as it was. A running local pool of another size with the same options is resized
        (the ranks that stay keep their namespaces); other options restart it (every
        rank's state is lost, and that is said); an attached or detached pool is never
        replaced. A pool that cannot start raises :class:`~nbddp.PoolStartError`, which
        says what the pool it replaced held, and is let go. ``exact`` (``%ddp start``):
        options left unset are the defaults, not as before.
        """
        options = effective(options) if exact else merged(self.options, options)
        pool = self.pool
        if getattr(pool, "closed", False):  # a detached pool gone or taken over (said once)
            self.use(None)
            pool = None
        size = n or (pool.world_size if pool else None) or default_world_size()
        lost = ""
        if pool is not None and (size != pool.world_size or options != self.options):
            self._may_change(pool, size)
            self.check(size, **options)
            if options == self.options and resizing.can_resize(pool):
                self._resize(pool, size)
                return pool
            lost = self._let_go(pool, size)
            pool = None
        if pool is None:
            try:
                pool = Pool(size, **options)
            except ValueError as exc:
                raise Refused(str(exc)) from None
            self.use(pool, options)
        # (a detached pool's supervisor starts or mends its own pool as the cell comes)
        detached = getattr(pool, "detached", False)
        if not running(pool) and not pool.needs_restart and not detached:
            self._start(pool, lost)
        return pool

    def unchanged(self, n: int | None = None, **options) -> bool:
        """The pool runs with ``n`` ranks (None: as it has) and exactly these options (unset:
        the defaults) already: ``%ddp start`` has nothing to do."""
        pool = self.pool
        if pool is None or getattr(pool, "closed", False) or not pool.started:
            return False
        if pool.attached or getattr(pool, "detached", False):
            return False  # not a pool `%ddp start` makes
        same = effective(options) == self.options
        return same and n in (None, pool.world_size)

    def changes(self, **options) -> tuple[list[str], list[str]]:
        """What ``%ddp start`` with ``options`` (unset: the defaults) changes on the running
        pool: (the options needing new processes for every rank, as flags; those it takes
        in place, as they would be said)."""
        new = effective(options)
        fresh = inplace.needs_new(self.options, new)
        moved = [k for k in inplace.IN_PLACE if new.get(k) != self.options.get(k)]
        return [_flag(k) for k in fresh], [_said_as(k, new.get(k)) for k in moved]

    def holds_state(self) -> bool:
        """The pool runs here and a rank holds names of its own (a restart would lose them)."""
        pool = self.pool
        if pool is None or getattr(pool, "detached", False) or not running(pool):
            return False
        return any(resizing.held(pool).values())

    def refuse_restart(self, why: str, forced: str) -> None:
        """Refuse (:class:`Refused`) to let a pool that holds state go: one line with ``why``
        (what needs new processes), what would be lost, and ``forced``, the command that
        does it anyway."""
        if self.holds_state():
            raise Refused(
                f"{why}: every rank's state would be lost ({what_it_held(self.pool)}); "
                f"the pool is as it was: `{forced}` does it anyway"
            )

    def apply(self, **options) -> None:
        """The running local pool takes ``options`` (unset: the defaults), which
        :meth:`changes` found it can take in place: its processes and namespaces stay."""
        new = effective(options)
        inplace.apply(self.pool, **{k: new.get(k, _DEFAULTS.get(k)) for k in inplace.IN_PLACE})
        self.options = new

    @staticmethod
    def check(n: int, **options) -> None:
        """Refuse (:class:`Refused`) a pool of ``n`` ranks with ``options``: before the
        running pool is touched."""
        try:
            check_pool(n, **options)
        except ValueError as exc:
            raise Refused(str(exc)) from None

    def let_go(self) -> str:
        """Let the pool go for another (a local one stops, a detached one runs on); what
        was lost, for a message should the other not start ("" when nothing was)."""
        pool, lost = self.pool, ""
        if pool is not None and not getattr(pool, "detached", False) and running(pool):
            lost = _lost(pool)
            say(f"stopped the pool of {_ranks(pool.world_size)}: {what_it_held(pool)}")
        self.use(None)
        return lost

    def _may_change(self, pool: Pool, size: int) -> None:
        """Refuse to replace a pool this kernel did not start (attached, detached)."""
        if getattr(pool, "detached", False):
            raise Refused(
                f"the pool is the detached pool {pool.name} ({_ranks(pool.world_size)}): "
                f"-n {size} would stop it; `%ddp stop {pool.name}` first, or start another"
            )
        if pool.attached:
            raise Refused(
                f"the pool is attached ({_ranks(pool.world_size)} started by torchrun): "
                f"-n {size} would stop them; %ddp stop first for a local pool of "
                f"{_ranks(size)}, or run torchrun with {size} and %ddp attach again"
            )

    def _resize(self, pool: Pool, size: int) -> None:
        before = _lost(pool)
        try:
            done = pool.resize(size)
        except PoolStartError as exc:
            raise PoolStartError(f"{exc}; {before}") from None
        say(done.line())
        say_gpu_notes(pool)

    def _let_go(self, pool: Pool, size: int) -> str:
        """Stop ``pool`` to make way for one of ``size`` ranks; what it held."""
        lost = ""
        if running(pool):  # (a rank dead since the last cell: the others' state is said)
            lost = _lost(pool)
            say(
                f"restarting the pool with {_ranks(size)}: every rank's state is lost "
                f"({what_it_held(pool)})"
            )
        self.use(None)
        return lost

    def _start(self, pool: Pool, lost: str = "") -> None:
        t0 = time.perf_counter()
        try:
            pool.start()
        except PoolStartError as exc:
            self.use(None)
            if lost:
                raise PoolStartError(f"{lost}; the new one failed: {exc}") from None
            raise
        say(f"started {_ranks(pool.world_size)} in {time.perf_counter() - t0:.1f} s")
        say_gpu_notes(pool)


def say_gpu_notes(pool: Pool) -> None:
    """Say now, not with the next cell, that the ranks share GPUs (:func:`gpu_notes`)."""
    for note in gpu_notes(pool):
        if note in pool.notes:
            pool.notes.remove(note)
            say(note)


_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(Pool).parameters.items()
    if p.default is not inspect.Parameter.empty
}


def effective(options: dict) -> dict:
    """``options`` without those left unset (None) or set to Pool's default: two sets of
    options that make the same pool compare equal."""
    return {k: v for k, v in options.items() if v is not None and v != _DEFAULTS.get(k)}


def merged(old: dict, new: dict) -> dict:
    """``new`` over ``old``, where ``new`` sets them (None: as before), made effective."""
    return effective({**old, **{k: v for k, v in new.items() if v is not None}})


def _flag(option: str) -> str:
    """``pg_timeout`` -> ``--timeout``: the option as %ddp start takes it."""
    return "--timeout" if option == "pg_timeout" else "--" + option.replace("_", "-")


def _said_as(option: str, value) -> str:
    """``--heal model,opt``, ``--grace 5``, ``no --threads``: an in-place option's new value."""
    value = _DEFAULTS.get(option) if value is None else value
    if value is None or value == ():
        return f"no {_flag(option)}"
    if isinstance(value, (list, tuple)):
        value = ",".join(value)
    return f"{_flag(option)} {value:g}" if isinstance(value, float) else f"{_flag(option)} {value}"


def what_it_held(pool) -> str:
    """``they held model, opt`` (the names each rank had of its own, short)."""
    return resizing.held_words(resizing.held(pool), "they" if pool.world_size > 1 else "it")


def _lost(pool) -> str:
    """``the previous pool (4 ranks) was stopped: they held model, opt``."""
    return f"the previous pool ({_ranks(pool.world_size)}) was stopped: {what_it_held(pool)}"


SESSION = Session()


def default_pool() -> Pool | None:
    """The pool ``%%ddp`` and ``nbddp.ranch`` share (None: none yet)."""
    return SESSION.pool
