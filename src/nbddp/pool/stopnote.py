"""The note for the supervisor's last resort: ranks still running past the grace period
(stuck in C code that neither an interrupt nor an abort reaches), stopped alone and given
new processes, or stopped with the whole pool; and the words every note that says the
ranks' state was lost ends with (:func:`state_lost`), so they all say it the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..wire import stacks as S

if TYPE_CHECKING:
    from .recovery import Facts

__all__ = ["state_lost", "stop_note"]


def state_lost(what: str) -> str:
    """A note for the next cell: ``what`` happened, so the pool was stopped."""
    return f"{what}; the next cell starts a new one (the ranks' state is lost)"


def _were(ranks) -> str:
    return "were" if len(ranks) > 1 else "was"


def _last_seen(action) -> str:
    """``rank 3 last seen at loss.backward(), cell line 7``, each stopped rank's."""
    seen = action.seen or ((),) * len(action.ranks)
    return "; ".join(
        f"rank {r} last seen at {S.summary(f)}" if f else f"rank {r} answered no sample"
        for r, f in zip(action.ranks, seen, strict=False)
    )


def stop_note(facts: Facts, action, only: bool = False) -> str:
    """Why the supervisor stopped ranks (``action``: a ``stop``, its reason, the stuck
    ranks and where each was last seen); ``only``: the stuck ranks alone."""
    stuck = list(action.ranks)
    if only:
        return _restarted_note(facts, action)
    if action.reason == "death" and facts.attached:
        why = facts.store_lost or (
            "the process group lost a member that cannot come back (a rank without a "
            "holder, NBDDP_HOLD=0)"
        )
        return (
            f"{why}, so the pool was stopped: start torchrun again and attach again (the "
            "ranks' state is lost)"
        )
    if action.reason == "death":
        return state_lost(
            "the process group lost a member (on_death='restart'), so the pool was stopped"
        )
    if action.reason == "abort":
        return state_lost(
            f"{S.rank_set(stuck)} still ran {max(action.seconds, facts.grace):.0f} s after "
            "the process group was aborted (blocked where the abort did not reach: a "
            f"collective, or a DDP step's in torch's code; {_last_seen(action)}) and "
            f"{_were(stuck)} stopped with the rest of the pool"
        )
    return state_lost(
        f"{S.rank_set(stuck)} did not stop within {facts.grace:g} s of the "
        f"{action.reason} and {_were(stuck)} stopped with the rest of the pool"
    )


def _restarted_note(facts: Facts, action) -> str:
    """The stuck ranks alone were stopped: the replaced notes that follow say what each
    held (and what a re-run or ``--heal`` gave back); the others kept their state."""
    stuck = list(action.ranks)
    if action.reason == "abort":
        what = (
            f"still ran {max(action.seconds, facts.grace):.0f} s after the process group "
            "was aborted (blocked where the abort did not reach: a collective, or a DDP "
            f"step's in torch's code; {_last_seen(action)})"
        )
    else:
        what = f"did not stop within {facts.grace:g} s of the {action.reason}"
    given = (
        "it was stopped and given a new process (what it held is said below)"
        if len(stuck) == 1
        else "they were stopped and given new processes (what each held is said below)"
    )
    return f"{S.rank_set(stuck)} {what}, so {given}; every other rank kept its namespace"
