"""``--heal``: a rank that took a dead one's place gets the named objects from a survivor.

``%ddp start --heal model,opt`` (``Pool(heal=["model", "opt"])``): once a dead
rank's new process has joined the re-formed group, and before the next cell, the
pool copies those names from the lowest live survivor to every new rank with
:func:`nbddp.pool.copying.copy` (DDP wrappers are wrapped again on every rank, which
the re-formed group needs anyway: the survivors' old wrappers were bound to the
old group). So a training loop goes on in the next cell. The replaced rank's note
says what was healed, from which rank, and how long it took
(:mod:`nbddp.pool.deathnote`); what could not be healed is said there too, and the
pool goes on.
"""

from __future__ import annotations

import time

from . import rerun
from .deathnote import Healed
from .drive import own_cells
from .errors import NbddpError

__all__ = ["check_heal", "heal", "option_names", "renew"]


def option_names(value, option: str) -> tuple[str, ...]:
    """The names an option gives (``heal``, ``keep``: a list, or a comma/space separated
    string), each once; ValueError for one that is not a name."""
    if not value:
        return ()
    names = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    bad = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if bad:
        raise ValueError(f"{option}: not a name: {bad[0]!r}")
    return tuple(dict.fromkeys(names))


def check_heal(heal, on_death: str) -> tuple[str, ...]:
    """The names ``heal`` gives (:func:`option_names`); ValueError for a name that is not
    one, or a pool that restarts instead of replacing."""
    names = option_names(heal, "heal")
    if names and on_death != "replace":
        raise ValueError("heal: a pool with on_death='restart' replaces no rank to heal")
    return names


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def renew(pool, new: list[int]) -> tuple[Healed | None, list[str]]:
    """New ranks (a dead rank's new process, a resize's): ``--heal`` first, then the cells
    they can re-run alone (:func:`nbddp.pool.rerun.replay`); what the heal did, and the
    re-runs' notes (for the caller to say after its own)."""
    healed = heal(pool, new)
    return healed, rerun.replay(pool, new, healed)


def heal(pool, new: list[int]) -> Healed | None:
    """Copy ``pool.heal`` from the lowest survivor to the ``new`` ranks; what it did (None:
    nothing to heal). The notes the copy's own cells make stay the pool's."""
    names = list(getattr(pool, "heal", ()) or ())
    if not names or not new or pool.needs_restart:
        return None
    live = [r for r in sorted(pool.roster.ranks) if r not in new]
    if not live:
        return Healed(tuple(names), -1, 0.0, "every rank is new: no survivor to copy from")
    src = live[0]
    source = pool.roster[src]
    has = source.names | {h.name for h in source.held}
    missing = [n for n in names if n not in has]
    names = [n for n in names if n in has]
    if not names:
        return Healed(tuple(missing), src, 0.0, f"rank {src} has none of them")
    t0 = time.monotonic()
    try:
        with own_cells(pool):  # (the copy's cells would take what waits for the next cell)
            done = pool.copy(names, src, new)
    except (NbddpError, KeyboardInterrupt) as exc:
        error = "interrupted" if isinstance(exc, KeyboardInterrupt) else _one_line(exc)
        return Healed(tuple(names), src, time.monotonic() - t0, error)
    return Healed(done.names, src, time.monotonic() - t0, "", done.rewrapped, tuple(missing))
