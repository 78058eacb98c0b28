"""What a re-form bound again on the ranks, and what it could not, in the note's words.

Each rank binds its DDP models to the new group as its re-form ends
(:mod:`nbddp.rank.rebind`) and says so in its Ready (``rebound``, ``stale``); the roster
keeps both per rank. :func:`words` makes the part of the re-form note that says it:

    model: DDP on the new group (every rank); still bound to the old group: pg (a
    ProcessGroup the cell made: make it again in a cell, e.g. dist.new_group(...))

The words name each object with the ranks that hold it (all ranks: ``every rank``) and
the one thing that mends it. Pure: no process, connection or rank record is touched.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..wire import protocol as P
from ..wire.stacks import rank_set

__all__ = ["SHARD_LOST", "mends", "words"]

SHARD_LOST = (
    "the dead rank's shard died with it: load a checkpoint (torch.distributed.checkpoint) "
    "on every rank, or build it again"
)


def mends(stale: P.Stale, died: bool) -> str:
    """What mends ``stale``: one command or step, in a few words."""
    if stale.kind == "sharded":
        if died:
            return f"{stale.what}, incomplete: {SHARD_LOST}"
        return f"{stale.what}, on the old group's mesh: shard it again, or load a checkpoint"
    if stale.kind == "ddp":
        return f"{stale.what}: wrap {stale.name}.module in DDP again in a cell"
    return f"{stale.what}: make it again in a cell"


def _ranks(ranks: list[int], n: int) -> str:
    return "every rank" if len(ranks) == n else rank_set(ranks)


def words(ranks: Iterable, world_size: int, died: bool = False) -> str:
    """``model: DDP on the new group (every rank); still bound to the old group: ...``
    from the roster's records (``rebound``, ``stale``); '' when nothing was bound to it.
    ``died``: a rank died in this event (a sharded object is then incomplete)."""
    again: dict[str, list[int]] = {}
    old: dict[P.Stale, list[int]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        for name in r.rebound:
            again.setdefault(name, []).append(r.rank)
        for stale in r.stale:
            old.setdefault(stale, []).append(r.rank)
    n = world_size
    said = [f"{name}: DDP on the new group ({_ranks(rs, n)})" for name, rs in again.items()]
    if old:
        items = [f"{s.name} on {_ranks(rs, n)} ({mends(s, died)})" for s, rs in old.items()]
        said.append("still bound to the old group: " + "; ".join(items))
    return "; ".join(said)
