"""After a re-form, the ranks' DDP models are one model again, or the note says they are not.

A cell that failed in a training step may have ended the step on some ranks only: one
rank raised between ``loss.backward()`` and ``opt.step()`` while the others stepped
and went on to wait in the next step's all_reduce; or the abort came as a slow rank
was still reading the last of an all_reduce its peers had finished. The re-form keeps
every namespace, so the survivors then hold different weights and optimizer states,
and DDP, which never compares them, would train a different model on each rank from
the next cell on: kept bytes the next training cell cannot use.

Each rank fingerprints the DDP models it binds again (:func:`nbddp.rank.rebind.
fingerprint`, in its Ready). :func:`apart` groups the ranks by fingerprint; the
largest group (on a tie, the one with the lowest rank) is the pool's model. With
``--heal`` naming the model, :func:`one_model` copies it and the optimizers over its
parameters from that group's lowest rank to the others (:func:`nbddp.pool.copying.
copy`) before the next cell, and says so; without, it says which ranks differ and
the one command that makes them one model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..wire.stacks import rank_set
from .drive import own_cells
from .errors import NbddpError

__all__ = ["Apart", "apart", "one_model"]

WHY = "the failed cell ended a training step on some ranks only"


@dataclass(frozen=True)
class Apart:
    """A DDP model the ranks no longer hold alike."""

    name: str
    src: int  # the lowest rank of the largest group that agrees
    agree: tuple[int, ...]  # the ranks that hold src's weights
    apart: tuple[int, ...]  # the others
    optimizers: tuple[str, ...]  # src's optimizers over the model's parameters


def apart(ranks: Iterable) -> list[Apart]:
    """The rebound models whose fingerprints differ across ``ranks`` (roster records;
    a rank that could not fingerprint one is not counted)."""
    seen: dict[str, dict[str, list[int]]] = {}
    optimizers: dict[tuple[str, int], str] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        for name, digest, opts in r.weights:
            if digest:
                seen.setdefault(name, {}).setdefault(digest, []).append(r.rank)
                optimizers[name, r.rank] = opts
    found = []
    for name, groups in seen.items():
        if len(groups) < 2:
            continue
        best = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
        rest = sorted(r for rs in groups.values() if rs is not best for r in rs)
        opts = tuple(o for o in optimizers[name, best[0]].split(",") if o)
        found.append(Apart(name, best[0], tuple(best), tuple(rest), opts))
    return found


def one_model(pool, new: list[int] | None = None) -> list[str]:
    """Make each model that differs one again (``--heal`` names it), or say how; the
    notes. Runs after the re-form, before the next cell and before ``--heal`` gives the
    ``new`` ranks (a dead one's new process) theirs: they get this one too, as DDP's
    wrapping again on every rank needs every rank to hold the model."""
    notes = []
    for a in apart(pool.roster.ranks.values()):
        names = [a.name, *a.optimizers]
        if a.name not in pool.heal:
            notes.append(_differs(a, names))
            continue
        t0 = time.monotonic()
        try:
            with own_cells(pool):  # (the copy's cells would take what waits for the next)
                pool.copy(names, a.src, sorted({*a.apart, *(new or ())}))
        except (NbddpError, KeyboardInterrupt) as exc:
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
            notes.append(_differs(a, names) + f" (the copy failed: {why.splitlines()[0]})")
            continue
        notes.append(
            f"{a.name} differed across the ranks after the re-form ({_who(a)}: {WHY}): "
            f"{', '.join(names)} copied from rank {a.src} to {rank_set(a.apart)} in "
            f"{time.monotonic() - t0:.2f} s, one model again"
        )
    return notes


def _who(a: Apart) -> str:
    return f"{rank_set(a.apart)} apart from {rank_set(a.agree)}"


def _differs(a: Apart, names: list[str]) -> str:
    to = ",".join(map(str, a.apart))
    return (
        f"{a.name} differs across the ranks now ({_who(a)}: {WHY}, and DDP would train a "
        f"different model on each): %ddp copy {' '.join(names)} --from {a.src} --to {to} "
        f"makes it one model (after %ddp start --heal {','.join(names)}, the pool does it itself)"
    )
