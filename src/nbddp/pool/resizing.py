"""Resizing a local pool: the ranks that stay keep their processes and namespaces.

``%%ddp -n 6`` on a pool of 4 starts ranks 4-5 fresh, and the group is formed again
at 6 ranks by the machinery that replaces a dead rank
(:meth:`nbddp.pool.repair.PoolRepair.form_again`:
new processes join a re-form of the survivors under a new prefix of the store they
share). ``-n 2`` stops ranks 2-3 first, then the same re-form at 2. Each rank's
``world_size``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` follow (the re-form says the new
size), as do the pool's and its roster's. Attached and detached pools are never
resized here: torchrun started their ranks, or another process holds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..rank.gpus import gpu_notes
from ..wire import protocol as P
from ..wire.stacks import rank_set
from . import healing, rebinding
from .deathnote import Healed, healed_words
from .errors import NbddpError, PoolStartError
from .layout import check_backend, check_layout, check_log_dir
from .processes import enough_open_files

__all__ = ["Resized", "can_resize", "held", "resize"]

# what every rank's namespace holds from its start (worker_cell.make_namespace): not
# the user's, so not said as lost
STARTING_NAMES = frozenset(
    {"display", "torch", "rank", "local_rank", "world_size", "device", "group", "mesh"}
)
NAMES_SAID = 6  # names said per group of ranks, then "and N more"


@dataclass(frozen=True)
class Resized:
    """What a resize did: sizes, time, and the names the stopped ranks held."""

    old: int
    new: int
    seconds: float
    stopped: dict[int, frozenset[str]]  # rank -> the names it held (its own)
    bound: str = ""  # what the re-form bound to the new group again (nbddp.pool.rebinding)
    healed: Healed | None = None  # what ``--heal`` copied to the new ranks

    def line(self) -> str:
        """``resized the pool 4 -> 2 ranks in 0.31 s: ranks 2, 3 stopped (they held ...)``,
        then what was bound to the new group again."""
        ranks = f"rank{'s' * (self.new > 1)}"
        head = f"resized the pool {self.old} -> {self.new} {ranks} in {self.seconds:.2f} s: "
        bound = f"; {self.bound}" if self.bound else ""
        if self.new > self.old:
            added = rank_set(list(range(self.old, self.new)))
            are = "are" if self.new - self.old > 1 else "is"
            kept = rank_set(list(range(self.old)))
            healed = f"; {healed_words(added, self.healed)}" if self.healed else ""
            fresh = f"{added} {are} new (fresh namespaces){healed}; {kept} kept theirs"
            return head + fresh + bound
        they = "they" if len(self.stopped) > 1 else "it"
        gone = held_words(self.stopped, they)
        return head + f"{rank_set(list(self.stopped))} stopped ({gone})" + bound


def held_words(names: dict[int, frozenset[str]], they: str = "they") -> str:
    """``they held model, opt`` / ``rank 2 held a; rank 3 held b`` / ``... nothing``."""
    groups: dict[frozenset[str], list[int]] = {}
    nothing = f"{they} held nothing of {'its' if they == 'it' else 'their'} own"
    if not names:
        return nothing
    for rank, held_names in sorted(names.items()):
        groups.setdefault(held_names, []).append(rank)
    if len(groups) == 1:
        only = next(iter(groups))
        return f"{they} held {_said(only)}" if only else nothing
    parts = [f"{rank_set(ranks)} held {_said(n) or 'nothing'}" for n, ranks in groups.items()]
    return "; ".join(parts)


def _said(names: frozenset[str]) -> str:
    ordered = sorted(names)
    more = len(ordered) - NAMES_SAID
    return ", ".join(ordered[:NAMES_SAID]) + (f" and {more} more" if more > 0 else "")


def held(pool, ranks=None) -> dict[int, frozenset[str]]:
    """The names each of ``ranks`` (all by default) held of its own, as last reported
    (imported modules, and objects still as the notebook shipped them, left out)."""
    roster = getattr(pool, "roster", None)  # (a detached pool's client has none)
    if roster is None:
        return {}
    return {
        r: roster[r].names - roster[r].modules - STARTING_NAMES
        for r in (roster.ranks if ranks is None else ranks)
        if r in roster.ranks
    }


def can_resize(pool) -> bool:
    """A local pool whose ranks are up: the ranks that stay keep their namespaces."""
    return (
        not pool.attached
        and not getattr(pool, "detached", False)
        and getattr(pool, "state", None) == "ready"
        and pool.started
    )


def check(pool, n: int) -> None:
    """Refuse (ValueError) a size the pool's own options cannot have (mesh, groups, GPUs)."""
    check_layout(n, pool.device, pool.gpus, pool.groups, pool.mesh)
    check_backend(n, pool.backend, pool.device, pool.gpus)
    if pool.log_dir is not None:
        check_log_dir(pool.log_dir, n)


def resize(pool, n: int) -> Resized:
    """Ranks ``n..`` stop, or ranks up to ``n - 1`` start fresh; the group is formed again
    at ``n``. A re-form that fails stops the pool (PoolStartError says so)."""
    old = pool.world_size
    if not can_resize(pool):
        raise NbddpError("only a running local pool can be resized")
    check(pool, n)
    t0 = time.monotonic()
    if n == old:
        return Resized(old, n, 0.0, {})
    shared_before = gpu_notes(pool)
    stopped = _stop_ranks(pool, list(range(n, old)))
    pool.world_size = pool.roster.world_size = n
    new = tuple(range(old, n))
    for rank in new:  # a record without a process: the re-form starts one
        pool.roster.add(rank, 0)
        pool.roster[rank].state = "dead"
    enough_open_files(len(new))
    pool.state = "starting"
    try:
        pool.form_again([], new=new)
    except (PoolStartError, KeyboardInterrupt) as exc:
        pool.lose()
        raise PoolStartError(
            f"resizing the pool {old} -> {n} ranks failed ({exc or 'interrupted'}), so it "
            "was stopped; the next cell starts a new one (the ranks' state is lost)"
        ) from None
    pool.state = "ready"
    if gpu_notes(pool) != shared_before:
        pool.notes += gpu_notes(pool)  # ranks that now share a GPU: said once
    if new:
        pool.generation += 1  # fresh namespaces: the notebook's imports are replayed
    bound = rebinding.words(pool.roster.ranks.values(), n)
    healed, reran = healing.renew(pool, list(new))  # (its cells set pool.notes meanwhile)
    pool.notes += reran
    return Resized(old, n, time.monotonic() - t0, stopped, bound, healed)


def _stop_ranks(pool, ranks: list[int]) -> dict[int, frozenset[str]]:
    """Stop ``ranks`` (what they printed is said with the next cell) and forget them."""
    names = held(pool, ranks)
    gone = [pool.roster[r] for r in ranks]
    for r in gone:
        r.send(P.Shutdown())
    pool.reap(gone, time.monotonic() + 5.0)
    pool.hub.forget_sentinels()  # reaped: their fd numbers may come back for others
    for r in gone:
        pool.roster.backlog += pool.drain(r.rank)
        pool.roster.forget(r.rank)
        del pool.roster.ranks[r.rank]
        pool.roster.deaths.pop(r.rank, None)
    return names
