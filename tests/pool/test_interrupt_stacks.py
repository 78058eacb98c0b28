"""Where each rank was when its cell was interrupted: every rank, moved since the last
sample or not (defect 16; found again while mending test_kernel)."""

from __future__ import annotations

from nbddp.pool.supervisor import CellSupervisor

IN_REDUCE = (
    ("<ddp-cell-1>", 3, "<module>", "dist.all_reduce(t)"),
    ("/site/torch/distributed/distributed_c10d.py", 2900, "all_reduce", "work.wait()"),
)


def test_a_rank_that_has_not_moved_since_the_last_sample_is_still_said_where_it_was():
    sup = CellSupervisor(1, [0, 1], now=100.0)
    sup.stacks(0, IN_REDUCE, 102.0)  # a periodic sample: rank 0 waits in all_reduce
    sup.interrupt("interrupt", 103.0)
    sup.stacks(0, IN_REDUCE, 103.1)  # the sample the interrupt asked for: the same place
    assert 0 in sup.stacks_at_interrupt
