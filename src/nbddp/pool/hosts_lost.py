"""A lost host of an attached pool: its ranks are missing until a replacement host rejoins.

A host is lost when its relay's connection ends with its ranks (the host died, or its
relay, holders and ranks were killed): nothing is left there to fork new processes.
The pool is not stopped. The host's ranks are *missing*: every other rank keeps its
namespace and waits, ``%ddp status`` shows them, and a cell asked for meanwhile is
refused at once in one line (nothing runs, nothing is lost).

The same launch command started on a replacement host (its torchrun node rank, the
same ``--master-addr``/``--master-port``) starts a relay and holders there; their
ranks connect with the same ``RANK`` values, authenticated as the first ones, and are
held back as a holder's new process is (:meth:`nbddp.pool.roster.Roster.parked`): only a
missing rank is taken so. Once every missing rank came, the next cell re-forms the
group at full size with them (:func:`nbddp.pool.recovery.replace`: the same notes,
``%ddp copy`` and ``--heal`` as for a rank replaced on its host).

The ranks meet for a re-form in torchrun's store, which its agent on the first node
(node rank 0, the host of rank 0) holds: lost with that host, the others cannot meet
again, so the pool is stopped, and says why (:func:`why_not`).
"""

from __future__ import annotations

import shlex

from ..wire import protocol as P
from ..wire import stacks as S
from .errors import HostsMissing, PoolStartError

__all__ = [
    "HostsLostInReform",
    "HostsMissing",
    "arrived",
    "defer",
    "missing",
    "missing_line",
    "recipe",
    "seen",
    "store_lost",
    "take_gone",
    "vanished",
    "why_not",
]

STORE_RANK = 0  # torchrun's agent store is on the node of global rank 0


def seen(pool) -> tuple[dict[int, str], tuple[int, ...]]:
    """(the ranks of ``pool``'s lost hosts -> their host, those of them back already from a
    replacement host). A detached pool's client has no roster: as its supervisor said with
    its last answer (``pool.missing``, ``pool.missing_back``: nbddp.detached.server)."""
    roster = getattr(pool, "roster", None)
    if roster is None:
        return dict(getattr(pool, "missing", None) or {}), tuple(getattr(pool, "missing_back", ()))
    back = tuple(sorted(n for n in roster.missing if roster.parked(n) is not None))
    return dict(roster.missing), back


def missing(pool) -> dict[int, str]:
    """The ranks of ``pool``'s lost hosts -> their host (empty: none). The pool runs
    meanwhile: its other ranks wait."""
    return seen(pool)[0]


def host_lost(r) -> bool:
    """``r``'s host relay ended: nothing is left on its host to reach the notebook."""
    relay = r.link.relay
    return relay is not None and relay.ended


def store_lost(pool) -> bool:
    """The host of torchrun's store (rank 0's) was lost: the ranks cannot meet again."""
    r0 = pool.roster.ranks.get(STORE_RANK)
    return STORE_RANK in pool.roster.missing or (r0 is not None and host_lost(r0))


def _by_host(table: dict[int, str]) -> dict[str, str]:
    """{host: ``ranks 2, 3``}, in rank order."""
    by_host: dict[str, list[int]] = {}
    for rank, host in sorted(table.items()):
        by_host.setdefault(host, []).append(rank)
    return {h: S.rank_set(rs) for h, rs in by_host.items()}


def _hosts(table: dict[int, str]) -> str:
    """``host node-b (ranks 2, 3)``, for each host."""
    return ", ".join(f"host {h} ({rs})" for h, rs in _by_host(table).items())


def _of_hosts(table: dict[int, str]) -> str:
    """``ranks 2, 3 of host node-b``, for each host."""
    return ", ".join(f"{rs} of host {h}" for h, rs in _by_host(table).items())


def _lost_ranks(pool) -> dict[int, str]:
    return {n: r.host for n, r in pool.roster.ranks.items() if host_lost(r)}


def why_not(pool) -> str:
    """Why an attached pool that lost ranks was stopped, when a lost host held the store."""
    if not store_lost(pool):
        return ""
    lost = {**_lost_ranks(pool), **pool.roster.missing}
    return (
        f"{_hosts(lost)} was lost with torchrun's store (its agent on node rank 0 held it, "
        "where the ranks meet to re-form), so the others cannot meet again"
    )


class HostsLostInReform(PoolStartError):
    """A re-form waited for the new processes of dead ranks whose host's relay then ended:
    the host was lost as its ranks died (its ranks' ends read before its relay's), so
    they are missing, not late (``ranks``: rank -> its host)."""

    def __init__(self, ranks: dict[int, str]) -> None:
        super().__init__(f"{_hosts(ranks)} was lost while its ranks were being replaced")
        self.ranks = ranks


def vanished(roster, dead: dict) -> dict[int, str]:
    """Of ``dead`` (rank -> its dead process's record), those whose host's relay has ended
    since, no new process having come: rank -> host."""
    return {
        n: r.host
        for n, r in dead.items()
        if host_lost(r) and (n not in roster.ranks or roster.ranks[n].link.conn is None)
    }


def take_gone(pool, rank: int) -> bool:
    """A rank's connection ended between cells: missing (True) if its host was lost and
    can come back, else only dead."""
    r = pool.roster[rank]
    r.state = "dead"
    if r.renewable and host_lost(r) and not store_lost(pool):
        _mark(pool, {rank: r.host})
        return True
    return False


def defer(pool, dead: list[int]) -> bool:
    """Whether the re-form for ``dead`` waits for a replacement host: some of them are on a
    lost host and have not come back (each is marked missing and said in a note), or
    ranks are missing already (the other dead ranks' new processes wait with them)."""
    roster = pool.roster
    lost = {
        n: roster[n].host
        for n in dead
        if host_lost(roster[n]) and roster.parked(n) is None and n not in roster.missing
    }
    _mark(pool, lost)
    return bool(roster.missing) and any(roster.parked(n) is None for n in roster.missing)


def _mark(pool, lost: dict[int, str]) -> None:
    if not lost:
        return
    pool.roster.missing.update(lost)
    pool.notes.append(
        f"{_hosts(lost)} was lost (its relay's connection closed with its ranks): the pool "
        f"waits for it, and every other rank keeps its namespace; {recipe(pool, lost)} to "
        "bring its ranks back (new processes: they re-run the cells they can, and `%ddp "
        "copy` or --heal gives them what a survivor holds)"
    )


def recipe(pool, ranks) -> str:
    """What brings ``ranks`` back: their node's job script resubmitted for that one node when
    they were launched under SLURM (each rank's Hello said its job, node rank and master:
    P.slurm_of), else the same launch command on a replacement host (as a detached pool's
    client, which has no roster, always says)."""
    held = getattr(getattr(pool, "roster", None), "ranks", {})
    origins = [getattr(held.get(n), "slurm", None) for n in ranks]
    if not origins or any(o is None for o in origins):
        return "start the same launch command on a replacement host"
    q = shlex.quote  # (checked on receipt too: roster; quoted all the same)
    steps = [
        f"`scontrol write batch_script {q(o.job_id)} nbddp.sh` then `sbatch --nodes 1 "
        + q(f"--export=ALL,NBDDP_NODE_RANK={o.node_rank},NBDDP_MASTER_ADDR={o.master_addr}")
        + " nbddp.sh`"
        for o in sorted(set(origins), key=lambda o: o.node_rank)
    ]
    return "resubmit the SLURM job for the lost node: " + " and ".join(steps)


def missing_line(pool, refused: bool = True) -> str:
    """One line: which ranks are missing, on which lost host, and what brings them back;
    ``refused``: for what was asked and not done (a cell, a copy), else for a report."""
    missing, came = seen(pool)
    also = f"; {S.rank_set(came)} came back already" if came else ""
    how = recipe(pool, missing)
    said = (
        f"nothing ran and every other rank keeps its namespace; {how}, then run it again"
        if refused
        else f"every other rank keeps its namespace and waits; {how} to bring them back"
    )
    are = S.is_are(missing)
    return f"{_of_hosts(missing)} {are} missing: the host was lost; {said}{also}"


def arrived(pool) -> list[int]:
    """The dead ranks to take back now that every missing rank came from a replacement
    host (a note says from where); HostsMissing, at once, while one has not."""
    roster = pool.roster
    if not roster.missing:
        return []
    hellos = {n: roster.parked(n) for n in roster.missing}
    if any(h is None for h in hellos.values()):
        raise HostsMissing(missing_line(pool))
    new_hosts = sorted({h.host for h in hellos.values() if isinstance(h, P.Hello)})
    pool.notes.append(
        f"{_hosts(roster.missing)} rejoined from {', '.join(new_hosts)}: its ranks are new "
        "processes there"
    )
    roster.missing.clear()
    return sorted(n for n, r in roster.ranks.items() if r.state == "dead")
