"""``keep``: a snapshot of named objects at the end of every clean cell, and rollback.

``Pool(keep=["fmodel", "fopt"])``: after each cell that ran cleanly on every rank, every
rank copies the local state of those objects (an FSDP2 or tensor-parallel module's
shards, an optimizer's state, tensors, plain values) into a file of its own in the pool's
shared-memory folder (:mod:`nbddp.rank.keep`), which outlives the rank's process.
``pool.rollback()`` (``%ddp rollback``) puts every rank's objects back as they were at
the end of that cell, on every rank at once, so they stay one consistent state: a
training cell that went wrong (a loss that diverged, a step on bad data) is undone.

This is the first part of issue 48: the snapshot and the rollback on demand, on a local
pool. The snapshot is taken between cells (not yet overlapped with the next one), and a
rank's death does not yet restore it by itself; an attached pool refuses ``keep``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .drive import drive, own_cells
from .errors import NbddpError
from .healing import option_names
from .outcome import failures_of

__all__ = ["Snapshot", "check_keep", "rollback", "take"]

_RANK_KEEP = "__import__('nbddp.rank.keep', fromlist=['here'])"


@dataclass
class Snapshot:
    """The last snapshot: the cell it ends, when, and per rank its bytes and what it lacks."""

    label: str
    at: float
    nbytes: dict[int, int] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # name -> why (the lowest rank's)
    seconds: float = 0.0


def check_keep(keep, attached: bool) -> tuple[str, ...]:
    """The names ``keep`` gives (:func:`nbddp.pool.healing.option_names`); ValueError for
    a name that is not one, or an attached pool (its snapshots are not built yet)."""
    names = option_names(keep, "keep")
    if names and attached:
        raise ValueError(
            "keep: an attached pool's snapshots are not built yet (a local pool's are)"
        )
    return names


def take(pool, label: str) -> Snapshot | None:
    """After a cell that ran cleanly on every rank (the caller checks): every rank keeps
    ``pool.keep``. None when nothing is kept; a failure of the snapshot itself is said in a
    note and the last snapshot stays."""
    names = list(pool.keep)
    if not names or pool.needs_restart:
        return None
    t0 = time.monotonic()
    code = f"_k = {_RANK_KEEP}.take_here(globals(), {names!r})\n(_k.nbytes, _k.missing)"
    with own_cells(pool), pool.history.pause():
        end = drive(pool, pool.run(code, want_values=True))
    failures = failures_of(end, pool.hosts)
    if failures or len(end.values) != pool.world_size:
        why = failures[0].summary if failures else "not every rank answered"
        pool.notes.append(f"keep: the snapshot after {label} failed ({why}); the last one stays")
        return None
    lowest = end.values[min(end.values)]
    snap = Snapshot(label, time.time(), {r: v[0] for r, v in end.values.items()}, lowest[1])
    snap.seconds = time.monotonic() - t0
    if snap.missing and (pool.snapshot is None or pool.snapshot.missing != snap.missing):
        said = "; ".join(f"{n}: {why}" for n, why in snap.missing.items())
        pool.notes.append(f"keep: not kept ({said})")
    pool.snapshot = snap
    return snap


def rollback(pool) -> str:
    """Every rank's kept objects back as they were at the last snapshot; the line that
    says so. NbddpError (one line) when there is none, or a rank cannot put it back."""
    snap = pool.snapshot
    if not pool.keep:
        raise NbddpError("nothing is kept: start the pool with --keep NAMES (keep=[...])")
    if snap is None:
        raise NbddpError("no snapshot yet: one is taken at the end of each clean cell")
    code = f"{_RANK_KEEP}.restore_here(globals())"
    with own_cells(pool), pool.history.pause():
        end = drive(pool, pool.run(code, want_values=True))
    failures = failures_of(end, pool.hosts)
    if failures:
        raise NbddpError(f"rollback: {failures[0].summary}")
    names = end.values.get(min(end.values, default=0), [])
    return f"{', '.join(names)} rolled back to the end of {snap.label} on every rank"
