"""Options a running pool takes as it is: ``%ddp start --heal model,opt`` on a trained pool
changes the pool, not its processes, so no command throws a pool away unasked.

``heal``, ``on_death``, ``grace`` and ``keep`` are the pool's own attributes, read where
they act (a death's repair, the next cell's interrupt, its end), so setting them is
enough. ``threads`` is each rank's ``torch.set_num_threads``: a small cell sets it on every rank
(:func:`nbddp.rank.ddp.set_threads`), and a rank started later (a replacement, a resize)
reads it from its environment, as at a start. Every other option is fixed in each rank's
process or in its process group when it starts (the backend, the start method, the
device, the group's timeout, the seed, subgroups, ...): :func:`needs_new` names them.
"""

from __future__ import annotations

from .drive import drive, own_cells
from .healing import check_heal
from .keeping import check_keep
from .outcome import raise_for_end

__all__ = ["IN_PLACE", "apply", "needs_new"]

IN_PLACE = ("heal", "on_death", "grace", "threads", "keep")


def needs_new(old: dict, new: dict) -> list[str]:
    """The options that differ from ``old`` to ``new`` (both without the unset and default
    ones) and need new processes for every rank."""
    return sorted(k for k in {*old, *new} if k not in IN_PLACE and old.get(k) != new.get(k))


def apply(
    pool, heal=None, on_death: str = "replace", grace: float = 3.0, threads=None, keep=None
) -> None:
    """Give the running local ``pool`` these in-place options; every rank keeps its process
    and namespace. The names are checked before anything changes (ValueError)."""
    names = check_heal(heal, on_death)
    kept = check_keep(keep, pool.attached)
    if kept != pool.keep:  # (the next clean cell takes the new names' first snapshot)
        pool.keep, pool.snapshot = kept, None
    threads = None if threads is None else str(threads)
    if threads != pool.threads:
        _threads_on_ranks(pool, threads)
        pool.threads = threads  # (a rank started later reads it from its environment)
    pool.heal, pool.on_death, pool.grace = names, on_death, grace
    if names:  # a new rank's heal wraps a DDP model: its imports, ahead (nbddp.pool.launch)
        pool.procs.warm()


def _threads_on_ranks(pool, threads: str | None) -> None:
    """Every rank's threads now; the notes and output that wait for the next cell stay
    (as a heal's copy keeps them: nbddp.pool.healing), with this cell's own (a rank dead
    since the last cell is replaced first, and that is said with the next cell)."""
    call = f"__import__('nbddp.rank.ddp', fromlist=['set_threads']).set_threads({threads!r})"
    with own_cells(pool):
        end = drive(pool, pool.run(call))
        pool.notes += end.notes
    raise_for_end(end, pool.hosts)
