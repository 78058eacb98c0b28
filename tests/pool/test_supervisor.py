"""The cell supervisor's rules, with fake ranks and a fake clock (no processes)."""

from __future__ import annotations

import pytest

from nbddp.pool.supervisor import (
    SAMPLE_EVERY,
    SAMPLE_FAST,
    SETTLE,
    STUCK_AFTER,
    Action,
    CellSupervisor,
)

CELL = "<ddp-cell-1>"
IN_REDUCE = (
    (CELL, 3, "<module>", "dist.all_reduce(t)"),
    ("/site/torch/distributed/c10d_logger.py", 81, "wrapper", "return func(*a)"),
    ("/site/torch/distributed/distributed_c10d.py", 2900, "all_reduce", "work.wait()"),
)
IN_SLEEP = ((CELL, 5, "<module>", "time.sleep(60)"),)
# a DDP backward: its all_reduce runs in C++, so no torch.distributed frame names it
IN_BACKWARD = (
    (CELL, 8, "<module>", "model(x).sum().backward()"),
    ("/site/torch/_tensor.py", 630, "backward", "torch.autograd.backward("),
    ("/site/torch/autograd/graph.py", 841, "_engine_run_backward", "return Variable._exec"),
)
IN_FORWARD = (
    (CELL, 8, "<module>", "model(x).sum().backward()"),
    ("/site/torch/nn/parallel/distributed.py", 1700, "forward", "output = self._run_ddp"),
)


class FakeRanks:
    """Ranks that answer the supervisor's actions the way real ones would, on a fake clock."""

    def __init__(self, n: int, **options) -> None:
        self.now = 100.0
        self.sup = CellSupervisor(1, list(range(n)), self.now, **options)
        self.places: dict[int, tuple | None] = {r: IN_SLEEP for r in range(n)}
        self.log: list[Action] = []

    def step(self, dt: float = 0.0) -> list[Action]:
        self.now += dt
        actions = self.sup.due(self.now)
        self.log += actions
        for action in actions:
            if action.kind == "stacks":
                for r in action.ranks:
                    if self.places[r] is not None:  # (None: a rank that does not answer)
                        self.sup.stacks(r, self.places[r], self.now)
        return actions

    def finish(self, rank: int, status: str = "ok") -> None:
        self.sup.done(rank, status, self.now)
        assert self.sup.ended(rank)

    def kinds(self) -> list[str]:
        return [a.kind for a in self.log]

    def step_until(self, kind: str, dt: float = SAMPLE_FAST, steps: int = 100) -> None:
        """Step the clock by ``dt`` until the supervisor has asked for ``kind``: at most
        ``steps`` times, then fail saying what it asked for instead."""
        for _ in range(steps):
            if kind in self.kinds():
                return
            self.step(dt)
        assert kind in self.kinds(), (
            f"no {kind!r} after {steps} steps of {dt} s (asked for: {self.kinds()})"
        )


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_failure_aborts_once_every_other_rank_has_waited_settle_in_a_collective(n):
    ranks = FakeRanks(n)
    for r in range(n):
        ranks.places[r] = IN_REDUCE
    ranks.finish(n - 2, "error")
    failed_at = ranks.now
    actions = ranks.step(0.01)  # the stacks are asked for at once ...
    assert [a.kind for a in actions] == ["stacks"]
    # seen once, they may still be finishing; seen there SETTLE s later, the group is aborted
    ranks.step_until("abort", SAMPLE_FAST / 2)
    assert failed_at + SETTLE <= ranks.now < failed_at + SETTLE + 3 * SAMPLE_FAST
    assert Action("abort", tuple(r for r in range(n) if r != n - 2)) in ranks.log
    assert ranks.sup.deadline is None or ranks.sup.deadline > ranks.now


def test_a_rank_seen_once_in_a_collective_that_then_finishes_is_not_aborted():
    """Scheduled late on a busy machine, not blocked: the collective completes."""
    ranks = FakeRanks(8)
    ranks.places = {r: IN_REDUCE for r in range(8)}
    ranks.finish(6, "error")
    ranks.step(0.01)  # all seen in all_reduce, once
    assert "abort" not in [a.kind for a in ranks.step(SAMPLE_FAST / 2)]
    for r in range(8):
        if r != 6:
            ranks.finish(r)
    assert ranks.sup.finished
    assert "abort" not in ranks.kinds()


def test_ranks_still_blocked_after_the_abort_stop_the_pool_after_grace():
    """An abort that does not free a rank (a group nbddp could not reach) never hangs."""
    ranks = FakeRanks(4, grace=3.0)
    ranks.places = {r: IN_REDUCE for r in range(4)}
    ranks.finish(2, "error")
    ranks.step_until("abort")
    aborted = ranks.now
    ranks.finish(0)  # freed; 1 and 3 stay blocked
    while "stop" not in ranks.kinds():
        assert ranks.now < aborted + 3.0 + SAMPLE_FAST
        ranks.step(max(ranks.sup.deadline - ranks.now, 0.01))
    assert ranks.now >= aborted + 3.0
    assert Action("stop", (1, 3), "abort") in ranks.log
    assert ranks.sup.stopped == "abort"
    assert ranks.sup.finished


def _run_by_deadlines(ranks: FakeRanks, until: float) -> None:
    """Step the clock as the pool does, from one deadline to the next: each deadline
    is in the future once :meth:`due` has run (else the pool would ask again at once,
    for ever, a core spinning while the cell never ends)."""
    while ranks.now < until and "stop" not in ranks.kinds():
        deadline = ranks.sup.deadline
        assert deadline is not None
        assert deadline > ranks.now, (deadline, ranks.now)
        ranks.step(deadline - ranks.now)


@pytest.mark.parametrize("n", [3, 8])
def test_ranks_computing_after_the_abort_are_left_alone(n):
    ranks = FakeRanks(n, grace=3.0)
    ranks.places = {r: IN_REDUCE for r in range(n)}
    ranks.finish(1, "error")
    ranks.step_until("abort")
    # freed, they went on with other work (at one cell line, or moving through torch's)
    ranks.places = {r: IN_SLEEP if r % 2 else IN_FORWARD for r in range(n) if r != 1}
    moving = [r for r in ranks.places if not r % 2]
    for _ in range(60):
        ranks.step(SAMPLE_FAST)
        for r in moving:
            ranks.places[r] = IN_BACKWARD if ranks.places[r] is IN_FORWARD else IN_FORWARD
    ranks.places.update(dict.fromkeys(moving, IN_BACKWARD))  # a long backward, a big load
    _run_by_deadlines(ranks, ranks.now + STUCK_AFTER / 2)  # (a long backward, a big load)
    assert "stop" not in ranks.kinds()
    assert ranks.sup.stopped is None


@pytest.mark.parametrize("n", [3, 8])
def test_ranks_left_in_a_ddp_backward_after_the_abort_are_stopped_in_the_end(n):
    """A DDP backward's all_reduce runs in C++: a rank the abort did not free waits in
    torch's autograd code, with no torch.distributed frame. It is stopped like a rank
    left in a collective (before, the cell waited for it for ever, asking at once
    again and again: the 8-rank hang of issue 46)."""
    ranks = FakeRanks(n, grace=1.0, replace_dead=True)
    ranks.places = {r: IN_BACKWARD for r in range(n)}
    ranks.sup.died(1, ranks.now)
    ranks.places[1] = None
    ranks.step()
    assert "abort" in ranks.kinds()
    aborted = ranks.now
    for r in range(n):
        if r not in (1, 2):
            ranks.finish(r, "error")  # freed; rank 2 stays in the backward
    _run_by_deadlines(ranks, aborted + 2 * STUCK_AFTER)
    assert Action("stop", (2,), "abort") in ranks.log
    assert aborted + STUCK_AFTER <= ranks.now < aborted + STUCK_AFTER + SAMPLE_EVERY + SAMPLE_FAST


def test_a_rank_silent_since_the_abort_is_stopped_in_the_end():
    """C code that holds the GIL: the rank cannot even say where it is."""
    ranks = FakeRanks(3, grace=1.0)
    ranks.places = {r: IN_REDUCE for r in range(3)}
    ranks.finish(1, "error")
    ranks.places[2] = None  # answers no sample from now on
    ranks.step_until("abort")
    aborted = ranks.now
    ranks.finish(0, "error")
    _run_by_deadlines(ranks, aborted + STUCK_AFTER - SAMPLE_EVERY)
    assert "stop" not in ranks.kinds()  # (answers may be slow on a busy machine)
    _run_by_deadlines(ranks, aborted + 2 * STUCK_AFTER)
    assert Action("stop", (2,), "abort") in ranks.log
    assert ranks.now < aborted + STUCK_AFTER + 2 * SAMPLE_EVERY


def test_a_failure_waits_abort_after_when_a_rank_is_still_computing():
    ranks = FakeRanks(4, abort_after=1.0)
    ranks.places.update({0: IN_REDUCE, 1: IN_REDUCE, 3: IN_SLEEP})
    ranks.finish(2, "error")
    for _ in range(9):
        assert "abort" not in [a.kind for a in ranks.step(0.1)]
    assert "abort" in [a.kind for a in ranks.step(0.11)]
    assert ranks.kinds().count("abort") == 1  # once per cell


def test_no_abort_when_the_others_finish_by_themselves():
    ranks = FakeRanks(3)
    ranks.finish(1, "error")
    ranks.finish(0)
    ranks.finish(2)
    assert ranks.sup.finished
    assert "abort" not in [a.kind for a in ranks.step(5.0)]
    assert ranks.sup.deadline is None


def test_an_interrupt_takes_stacks_before_the_signal_then_aborts_then_stops():
    ranks = FakeRanks(2, grace=3.0)
    actions = ranks.sup.interrupt("interrupt", ranks.now)
    assert actions == [Action("stacks", (0, 1)), Action("interrupt", (0, 1), "interrupt")]
    assert ranks.sup.interrupt("interrupt", ranks.now) == []  # a second press: nothing new
    ranks.sup.stacks(0, IN_SLEEP, ranks.now)
    assert ranks.sup.stacks_at_interrupt == {0: IN_SLEEP}
    assert "abort" not in ranks.kinds() + [a.kind for a in ranks.step(1.4)]
    assert "abort" in [a.kind for a in ranks.step(0.2)]  # halfway through the grace period
    assert [a.kind for a in ranks.step(1.5)] == ["stop"]  # still not back: stuck in C
    assert ranks.sup.stopped == "interrupt"
    assert ranks.sup.finished


def test_an_interrupted_rank_with_the_others_in_a_collective_aborts_early():
    ranks = FakeRanks(4)
    ranks.places.update({0: IN_REDUCE, 1: IN_REDUCE, 3: IN_REDUCE})
    ranks.sup.interrupt("interrupt", ranks.now)
    ranks.finish(2, "interrupted")
    ranks.step_until("abort")
    assert ranks.now < 100.0 + SETTLE + 3 * SAMPLE_FAST  # well before grace / 2


def test_every_rank_blocked_waits_half_the_grace_before_aborting():
    """Mismatched collectives: no rank ended, so a collective might still complete."""
    ranks = FakeRanks(4, grace=2.0)
    ranks.places = {r: IN_REDUCE for r in range(4)}
    ranks.sup.interrupt("interrupt", ranks.now)
    assert "abort" not in [a.kind for a in ranks.step(0.5)]
    assert "abort" in [a.kind for a in ranks.step(0.6)]


def test_the_timeout_interrupts_like_the_stop_button():
    ranks = FakeRanks(2, timeout=5.0)
    assert ranks.sup.deadline == pytest.approx(100.0 + min(5.0, SAMPLE_EVERY))
    ranks.step(4.9)
    assert "interrupt" not in ranks.kinds()
    assert Action("interrupt", (0, 1), "timeout") in ranks.step(0.2)
    assert ranks.sup.interrupted == "timeout"


def test_a_death_stops_the_others_at_once_and_keeps_what_finished():
    ranks = FakeRanks(4)
    ranks.finish(0)
    ranks.sup.done(1, "error", ranks.now)  # its output not yet all in
    ranks.sup.died(2, ranks.now)
    assert ranks.step() == [Action("stop", (3,), "death")]
    assert ranks.sup.phase == {0: "ok", 1: "failed", 2: "dead", 3: "stopped"}
    assert ranks.sup.finished
    assert ranks.sup.first_failure == (100.0, 1)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_death_with_replacing_aborts_the_group_at_once_and_stops_no_one(n):
    ranks = FakeRanks(n, replace_dead=True)
    ranks.finish(0)
    ranks.sup.died(1, ranks.now)
    running = tuple(range(2, n))
    # no waiting for samples or abort_after (nothing at all when no rank still runs)
    assert ranks.sup.deadline == (ranks.now if running else None)
    actions = ranks.step()
    assert (Action("abort", running) in actions) == bool(running), actions
    assert not any(a.kind == "stop" for a in actions)
    assert ranks.sup.stopped is None
    assert ranks.sup.phase[1] == "dead"
    for r in running:  # freed by the abort, they end as any rank does
        ranks.finish(r, "error")
    assert ranks.sup.finished


def test_long_cells_are_sampled_and_a_place_is_reported_once_with_its_start():
    ranks = FakeRanks(2)
    ranks.places = {0: IN_REDUCE, 1: IN_SLEEP}
    assert ranks.step(SAMPLE_EVERY - 0.1) == []
    assert ranks.step(0.1) == [Action("stacks", (0, 1))]
    first_seen = ranks.sup.where[0].since
    assert ranks.sup.waiting_in(0) == "all_reduce"
    assert ranks.sup.waiting_in(1) is None
    ranks.step(SAMPLE_EVERY)
    assert ranks.sup.where[0].since == first_seen  # the same place: waiting since then
    assert ranks.sup.stacks(0, IN_REDUCE, ranks.now) is None  # nothing new to report


def test_reports_from_ranks_outside_the_cell_or_after_they_ended_are_ignored():
    ranks = FakeRanks(2)
    ranks.finish(0)
    ranks.sup.done(0, "error", ranks.now)  # a second Done changes nothing
    assert ranks.sup.phase[0] == "ok"
    assert ranks.sup.first_failure is None
    assert ranks.sup.stacks(5, IN_SLEEP, ranks.now) is None
    assert not ranks.sup.ended(1)  # no Done yet
