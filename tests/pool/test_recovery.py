"""The supervisor's last resort, decided as a table (nbddp.pool.recovery.stop): which
ranks a stuck cell costs. The real processes' side is in test_failures.py."""

from __future__ import annotations

import dataclasses

import pytest

from nbddp.pool import recovery
from nbddp.pool.supervisor import Action

LOCAL = recovery.Facts(
    world_size=4,
    on_death="replace",
    attached=False,
    renewable=True,
    lost=False,
    rebuilt=False,
    grace=1.0,
)


def _facts(**changes) -> recovery.Facts:
    return dataclasses.replace(LOCAL, **changes)


# (facts, reason, stuck ranks, live ranks) -> only the stuck ranks are stopped
CASES = [
    (LOCAL, "abort", (0, 1, 3), (0, 1, 2, 3), True),
    (LOCAL, "interrupt", (2,), (0, 1, 2, 3), True),
    (LOCAL, "timeout", (1,), (0, 1), True),
    (LOCAL, "abort", (0, 1, 2, 3), (0, 1, 2, 3), False),  # no one left to keep a state
    (LOCAL, "death", (0,), (0, 1), False),  # on_death="restart": everything, as asked
    (_facts(on_death="restart"), "abort", (1,), (0, 1), False),
    (_facts(attached=True), "abort", (1,), (0, 1), False),  # torchrun's: not ours to kill
    (_facts(lost=True), "abort", (1,), (0, 1), False),
]


@pytest.mark.parametrize(("facts", "reason", "stuck", "live", "only"), CASES)
def test_only_the_stuck_ranks_are_stopped_where_they_can_come_back(
    facts, reason, stuck, live, only
):
    decision = recovery.stop(facts, Action("stop", stuck, reason, seconds=31.0), list(live))
    assert (decision.only, decision.ranks) == (only, stuck)
    assert ("state is lost" in decision.note) != only, decision.note
    if only:
        assert decision.note.endswith("; every other rank kept its namespace"), decision.note


def test_the_stopped_ranks_are_replaced_after_the_cell_without_a_killer_named():
    class Out:
        code = "x = 1"

    decision = recovery.after_cell(LOCAL, [2], None, Out(), stopped=[0, 1])
    assert decision == recovery.Replace((0, 1, 2), "x = 1", stopped=(0, 1))
    had = {r: recovery.Dead((), -9) for r in (0, 1, 2)}
    fresh = dict.fromkeys(had, frozenset())
    notes = recovery.replaced_notes(LOCAL, had, 0.5, fresh, None, "x = 1", "", (0, 1))
    hints = [n for n in notes if n.startswith("nothing in nbddp sent")]
    assert hints == [
        "nothing in nbddp sent rank 2 SIGKILL: the usual sender is the kernel's "
        "out-of-memory killer (see `dmesg`)"
    ]
