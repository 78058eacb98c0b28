"""An interrupt is never lost: whenever it comes, the cell it was for ends interrupted
and every rank keeps its state; one for a cell that has ended does nothing."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from helpers import namespace_digests
from nbddp import Pool
from nbddp.rank.worker import CellInterrupts
from nbddp.wire import protocol as P
from tiers import sizes

# ---------------------------------------------------------------- one rank's bookkeeping


def test_an_interrupt_while_the_cell_runs_interrupts_it_now():
    c = CellInterrupts()
    assert not c.start(1)
    assert c.request(1)


def test_an_interrupt_before_its_cell_starts_is_raised_as_it_starts():
    c = CellInterrupts()
    assert not c.request(1)  # Run is still queued: nothing to signal yet
    assert c.start(1)


def test_an_interrupt_for_an_ended_cell_is_dropped():
    c = CellInterrupts()
    c.start(1)
    c.end(1)
    assert not c.request(1)
    assert not c.start(2)  # and it does not hit the next cell


def test_an_interrupt_for_the_next_cell_waits_for_it_not_for_this_one():
    c = CellInterrupts()
    c.start(1)
    assert not c.request(2)
    c.end(1)
    assert c.start(2)


def test_an_interrupt_for_a_cell_that_never_ran_here_does_not_hit_a_later_one():
    c = CellInterrupts()
    assert not c.request(3)  # cell 3 ran on other ranks only (--ranks)
    assert not c.start(4)


@pytest.mark.parametrize("order", ["request start end", "start request end", "start end request"])
def test_every_order_of_run_interrupt_and_done(order):
    c = CellInterrupts()
    signalled = raised = False
    for step in order.split():
        if step == "request":
            signalled = c.request(5)
        elif step == "start":
            raised = c.start(5)
        else:
            c.end(5)
    interrupted = signalled or raised
    assert interrupted == (order != "start end request")
    assert c.pending is None
    assert c.running is None


# ---------------------------------------------------------------- real ranks

LOOP = "import time\nwhile True:\n    time.sleep(0.001)"


@pytest.fixture(scope="module", params=sizes(2, 4, 8, ids="{}"))
def ranks(request):
    with Pool(request.param, grace=3.0) as pool:
        pool.execute(
            "import time\nimport torch.distributed as dist\nkept = rank * 10\n"
            "model = torch.nn.Linear(3, rank + 1)"
        )
        pool.digests = namespace_digests(pool)  # every rank's names and values, as they were
        yield pool


def assert_kept(pool: Pool, *cells_own: str) -> None:
    """Every rank's namespace is as it was, but for names the interrupted cells bound."""
    now = namespace_digests(pool)
    for r in range(pool.world_size):
        assert {k: v for k, v in now[r].items() if k not in cells_own} == pool.digests[r], r


def repeats(pool: Pool, times: int) -> range:
    return range(times if pool.world_size < 8 else max(1, times // 4))


def until_the_end(pool: Pool, events) -> P.CellEnd:
    """Consume a cell's events as the magics do: a KeyboardInterrupt that lands here
    (before the cell took Ctrl-C over) is passed on as an interrupt."""
    while True:
        try:
            for event in events:
                if isinstance(event, P.CellEnd):
                    return event
            raise AssertionError("the events ended without a CellEnd")
        except KeyboardInterrupt:
            pool.interrupt()


def interrupted_cell(pool: Pool, after: float, how, **run) -> P.CellEnd:
    timer = threading.Timer(after, how)
    events = pool.run(LOOP, **run)
    try:
        timer.start()  # the clock starts as run() returns, before the cell is sent
    except KeyboardInterrupt:  # Ctrl-C at once: it lands here, as it would in the magics
        pool.interrupt()
    try:
        return until_the_end(pool, events)
    finally:
        timer.cancel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("after_ms", [0, 1, 5, 20, 100])
def test_an_interrupt_at_any_moment_ends_the_cell_and_keeps_state(ranks, after_ms):
    for _ in repeats(ranks, 20):
        end = interrupted_cell(ranks, after_ms / 1000, ranks.interrupt)
        assert end.interrupted == "interrupt", end
        assert not end.errors
        assert not end.exits
        assert not ranks.needs_restart
    assert_kept(ranks)


@pytest.mark.timeout(120)
def test_an_interrupt_just_before_a_blocking_call_is_never_lost(ranks):
    """A SIGINT that reached a rank after its last check between bytecodes and before a
    blocking C call began (``time.sleep``) was not handled until the call returned: the
    rank slept on and was stopped with the pool after the grace period, every rank's
    state lost (3 of 15 at 8 ranks). The rank now sends it again until it is handled."""
    for _ in range(15):
        events = ranks.run("time.sleep(15)\nslept = True")
        ranks.interrupt()
        end = until_the_end(ranks, events)
        assert end.interrupted == "interrupt", end
        assert not end.exits, end.notes
        assert not ranks.needs_restart
    assert_kept(ranks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_ms", [0, 5, 50])
def test_ctrl_c_at_any_moment_interrupts_the_cell_and_raises_nothing(ranks, after_ms):
    # Python's own handler, as in a notebook's kernel before nbddp (whatever ran before)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_cells(ranks, after_ms)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_cells(ranks, after_ms: int) -> None:
    for _ in repeats(ranks, 5):
        end = interrupted_cell(ranks, after_ms / 1000, lambda: os.kill(os.getpid(), signal.SIGINT))
        assert end.interrupted == "interrupt"
        assert not ranks.needs_restart
    assert_kept(ranks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [0.001, 0.005, 0.02])
def test_a_timeout_shorter_than_the_start_of_the_cell_still_ends_it(ranks, timeout):
    for _ in repeats(ranks, 5):
        end = until_the_end(ranks, ranks.run(LOOP, timeout=timeout))
        assert end.interrupted == "timeout"
        assert not ranks.needs_restart
    assert_kept(ranks)


def test_an_interrupt_between_cells_does_nothing(ranks):
    ranks.interrupt()
    assert_kept(ranks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_ms", [50, 300])
def test_an_interrupt_while_rank_0_waits_in_a_collective_re_forms_and_keeps_state(ranks, after_ms):
    """Rank 0 waits in all_reduce for ranks still in their loop: the interrupt frees it,
    the group is re-formed, and every rank's namespace is as it was."""
    wait = "if rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
    for _ in repeats(ranks, 2):
        timer = threading.Timer(after_ms / 1000, ranks.interrupt)
        events = ranks.run(wait + "else:\n" + "\n".join("    " + x for x in LOOP.splitlines()))
        timer.start()
        end = until_the_end(ranks, events)
        assert end.interrupted == "interrupt", end
        assert not ranks.needs_restart
    assert_kept(ranks)
    assert (
        ranks.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
        == [float(ranks.world_size)] * ranks.world_size
    )
    ranks.execute("del t")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_ms", [0, 2, 10])
def test_an_interrupt_while_the_ranks_load_shipped_data_ends_the_cell(ranks, after_ms):
    import torch

    needs = {"big": torch.ones(25_000_000)}  # 100 MB through shared memory
    for _ in repeats(ranks, 3):
        end = interrupted_cell(ranks, after_ms / 1000, ranks.interrupt, needs=needs)
        assert end.interrupted == "interrupt"
        assert not ranks.needs_restart
    assert_kept(ranks, "big")
    ranks.execute("globals().pop('big', None)")
