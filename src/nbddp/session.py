"""Which pool the notebook uses: one for ``%%ddp``/``%ddp`` and ``nbddp.ranch`` alike.

The session holds the pool (:func:`default_pool`) and the options it was made with,
and :meth:`Session.want_pool` is the one place that starts it, resizes it or restarts
it with other options. No IPython here: refusals raise :class:`Refused`, which the
magics show as one line.
"""

from __future__ import annotations

import time

import torch

from .errors import NbddpError, PoolStartError
from .metric_store import MetricStore
from .pool import Pool

__all__ = ["SESSION", "Refused", "Session", "default_pool", "default_world_size"]


class Refused(NbddpError, ValueError):
    """A request the session does not carry out (one line says why); nothing changed."""


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

    def want_pool(self, n: int | None = None, **options) -> Pool:
        """The pool, started, with ``n`` ranks when given and ``options`` (None: as before).

        A local pool of another size or other options is replaced (every rank's state is
        lost, and that is said); an attached pool is never replaced: :class:`Refused`.
        A pool that cannot start raises :class:`~nbddp.PoolStartError` and is let go.
        """
        options = {**self.options, **{k: v for k, v in options.items() if v is not None}}
        pool = self.pool
        if getattr(pool, "closed", False):  # a detached pool gone or taken over (said once)
            self.use(None)
            pool = None
        size = n or (pool.world_size if pool else None) or default_world_size()
        if pool is not None and (size != pool.world_size or options != self.options):
            self._let_go(pool, size)
            pool = None
        if pool is None:
            try:
                pool = Pool(size, **options)
            except ValueError as exc:
                raise Refused(str(exc)) from None
            self.use(pool, options)
        if not pool.started and not pool.needs_restart:
            self._start(pool)
        return pool

    def _let_go(self, pool: Pool, size: int) -> None:
        """Stop ``pool`` to make way for one of ``size`` ranks (refused when attached)."""
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
        if pool.started:
            say(f"restarting the pool with {_ranks(size)}: every rank's state is lost")
        self.use(None)

    def _start(self, pool: Pool) -> None:
        t0 = time.perf_counter()
        try:
            pool.start()
        except PoolStartError:
            self.use(None)
            raise
        say(f"started {_ranks(pool.world_size)} in {time.perf_counter() - t0:.1f} s")


SESSION = Session()


def default_pool() -> Pool | None:
    """The pool ``%%ddp`` and ``nbddp.ranch`` share (None: none yet)."""
    return SESSION.pool
