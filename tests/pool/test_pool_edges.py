"""Edges of a cell's life that once lost state or hung (issue 23's defects 1, 5, 6, 16),
at several world sizes, on real ranks."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import healthy
from nbddp import CellFailed, Pool
from nbddp.pool.drive import drive
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P
from tiers import sizes

SIZES = [2, 3, 4]


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized(request):
    with Pool(request.param) as pool:
        yield pool


@pytest.fixture
def ready(sized):
    return healthy(sized)


def events_of(pool: Pool, code: str, **kwargs) -> tuple[list, P.CellEnd]:
    """A cell's events and its end, driven as the magics drive them (Ctrl-C, pdb)."""
    events: list = []
    end = drive(pool, pool.run(code, **kwargs), _Keep(events))
    return events, end


class _Keep:
    """A sink that keeps every event."""

    def __init__(self, events: list) -> None:
        self.handle = events.append

    def close(self, _end) -> None:
        pass


# ---------------------------------------------------------------- defect 1: --out

ONLY_ON_THE_RANKS = (
    "import sys, types\n"
    "mod = types.ModuleType('only_on_the_ranks')\n"
    "exec('class Thing:\\n    pass', mod.__dict__)\n"
    "sys.modules['only_on_the_ranks'] = mod\n"
    "kept = rank * 10\n"
    "mod.Thing()"
)


@pytest.mark.timeout(120)
def test_a_value_the_notebook_cannot_load_is_that_ranks_error_and_the_pool_goes_on(ready):
    pool = ready
    n = pool.world_size
    events, end = events_of(pool, ONLY_ON_THE_RANKS, want_values=True)
    assert sorted(end.errors) == list(range(n))
    assert all("could not be loaded in the notebook" in e.message for e in end.errors.values())
    assert all("only_on_the_ranks" in e.message for e in end.errors.values())
    failed = {e.rank for e in events if isinstance(e, P.RankState) and e.state == "failed"}
    assert failed == set(range(n))
    said = r"ranks? 0[-, \d]*: ModuleNotFoundError: its value could not"  # (one line for all)
    with pytest.raises(CellFailed, match=said):
        raise_for_end(end)
    assert pool.execute("kept") == [r * 10 for r in range(n)]  # the pool and state kept


@pytest.mark.timeout(120)
def test_a_value_some_ranks_cannot_send_back_fails_only_those(ready):
    pool = ready
    last = pool.world_size - 1
    code = ONLY_ON_THE_RANKS.replace("mod.Thing()", f"mod.Thing() if rank == {last} else rank")
    _, end = events_of(pool, code, want_values=True)
    assert list(end.errors) == [last]
    assert end.values == {r: r for r in range(last)}


# ---------------------------------------------------------------- defect 6: streams


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "close",
    ["import os\nos.dup2(2, 1)\nprint('after', rank, flush=True)", "import os\nos.close(1)"],
    ids=["dup2", "close"],
)
def test_a_cell_that_closes_its_stdout_ends_and_the_next_cells_run(ready, close):
    pool = ready
    n = pool.world_size
    events, end = events_of(pool, close)
    assert not end.errors
    assert not end.exits
    assert pool.execute("rank") == list(range(n))
    events, end = events_of(
        pool, "import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)"
    )
    said = "".join(e.text for e in events if isinstance(e, P.Output))
    assert all(f"out {r}" in said and f"err {r}" in said for r in range(n)), said
    pool.restart()  # the next test gets ranks with both streams


# ---------------------------------------------------------------- defect 16: every place

HELD_UP = (
    "import time, torch, torch.distributed as dist\n"
    "if rank == world_size - 1:\n"
    "    time.sleep(60)\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
)


@pytest.mark.timeout(120)
def test_an_interrupt_says_where_every_rank_was_the_one_that_held_the_others_up_too(ready):
    pool = ready
    last = pool.world_size - 1
    events: list = []
    end = None
    for event in pool.run(HELD_UP):
        events.append(event)
        if isinstance(event, P.RankWhere) and event.rank == last and "sleep" in event.where:
            pool.interrupt()  # after a sample saw it there: the place has not moved since
        if isinstance(event, P.CellEnd):
            end = event
    assert end.interrupted == "interrupt"
    assert sorted(end.stacks) == list(range(last + 1))
    assert "time.sleep(60)" in str(end.stacks[last])
    assert all("all_reduce" in str(end.stacks[r]) for r in range(last))
    assert pool.execute("rank") == list(range(last + 1))  # and the ranks kept their state


# ---------------------------------------------------------------- defect 5: re-form wait

STUCK_IN_REFORM = (
    "import time, torch, torch.distributed as dist\n"
    "import nbddp.rank.group as G\n"
    "if rank == world_size - 1:\n"
    "    G.GroupKeeper.reform = lambda self, generation: time.sleep(3600)\n"
    "if rank == 0:\n"
    "    raise RuntimeError('before the all_reduce')\n"
    "dist.all_reduce(torch.ones(1))\n"
)


@pytest.mark.timeout(50)  # the re-form waits 60 s for a rank: the stop button must end it
def test_the_stop_button_ends_a_re_form_that_waits_for_a_rank(ready):
    pool = ready

    def press_stop_once_it_waits() -> None:
        while not pool.requests.reforming:
            time.sleep(0.01)
        pool.interrupt()

    presser = threading.Thread(target=press_stop_once_it_waits, daemon=True)
    presser.start()
    _, end = events_of(pool, STUCK_IN_REFORM)
    presser.join()
    assert 0 in end.errors
    assert any(
        "re-forming the process group failed (interrupted while waiting" in note
        and "state is lost" in note
        for note in end.notes
    ), end.notes
    assert pool.needs_restart
    assert pool.execute("rank") == list(range(pool.world_size))  # a new pool, said so
