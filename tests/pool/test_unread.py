"""A cell whose events were not read to the end, on a pool of the kernel's own (issue 35).

A loop over ``pool.run()`` left early, or Ctrl-C between ``pool.run`` and the sink, left
the cell to the garbage collector, which stopped the pool mid-cell: every rank's state
was gone. Now the next ``run`` ends it first (interrupted if it still runs, read to its
end, its output dropped) and says so; a cell never read never ran. Real pools at 2, 4
and 8 ranks; every rank's namespace digest is compared, not spot-checked.
"""

from __future__ import annotations

import gc

import pytest

from helpers import collect, healthy, namespace_digests
from nbddp.wire import protocol as P
from tiers import sizes

SIZES = [2, 4, 8]
SLEEPER = "import time\nprint('go', flush=True)\ntime.sleep(60)\nlate = 1"


@pytest.fixture
def ready(pool_of_size):
    return healthy(pool_of_size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_of_size", sizes(*SIZES), indirect=True)
def test_a_loop_left_early_keeps_every_rank_and_the_next_cell_ends_the_old_one(ready):
    pool, n = ready, ready.world_size
    pool.execute("import time\nkept = rank * 5 + 2\nw = torch.arange(4.0) * rank")
    before, pids = namespace_digests(pool), list(pool.pids)
    for event in pool.run(SLEEPER):
        if isinstance(event, P.Output):
            break  # the cell sleeps on; nothing refers to its events any more
    gc.collect()
    _text, _seen, end = collect(pool.run("kept", want_values=True))
    assert end.values == {r: r * 5 + 2 for r in range(n)}
    assert pool.pids == pids
    assert namespace_digests(pool) == before  # (the old cell's `late = 1` never ran)
    assert end.notes[0] == (
        "the previous cell's events were not read to its end: it was interrupted (every "
        "rank's state kept); its output was dropped"
    ), end.notes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_of_size", sizes(*SIZES), indirect=True)
def test_a_cell_whose_events_were_never_read_never_runs(ready):
    """(Ctrl-C between pool.run and the sink.)"""
    pool, n = ready, ready.world_size
    pool.execute("kept = rank + 9")
    before, pids = namespace_digests(pool), list(pool.pids)
    pool.run("kept = -1")  # never iterated
    gc.collect()
    _text, _seen, end = collect(pool.run("kept", want_values=True))
    assert end.values == {r: r + 9 for r in range(n)}
    assert pool.pids == pids
    assert namespace_digests(pool) == before
    assert end.notes[0] == "the previous cell's events were never read: it did not run"
