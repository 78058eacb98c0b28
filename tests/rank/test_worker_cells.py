"""A rank's cell runner and process group keeper, each alone: interrupts and aborts
that come at awkward moments, from the receiver thread or in the middle of a cell's end."""

from __future__ import annotations

import queue
import threading

import pytest
import torch.distributed as dist

from helpers import collect
from nbddp.pool.errors import CellFailed
from nbddp.rank.cell import CellRunner
from nbddp.rank.group import GroupKeeper
from nbddp.wire import protocol as P

# ---------------------------------------------------------------- an interrupt's report


def test_an_interrupt_for_the_running_cell_signals_the_main_thread_and_sends_nothing():
    """Where the rank was is the StackQuery's answer, sent just before (test_cell)."""
    events: list = []
    runner = CellRunner(0, events.append, group=None)
    runner.sigint.send = lambda wanted: events.append("SIGINT")
    runner.interrupts.start(7)
    runner.on_interrupt(P.Interrupt(7))
    assert events == ["SIGINT"]


def test_an_interrupt_for_a_cell_not_running_here_sends_nothing():
    events: list = []
    runner = CellRunner(0, events.append, group=None)
    runner.sigint.send = lambda wanted: events.append("SIGINT")
    runner.on_interrupt(P.Interrupt(3))  # not started yet: raised as it starts
    assert events == []


# ---------------------------------------------------------------- aborts from two threads


def test_two_threads_aborting_at_once_abort_the_group_once(monkeypatch):
    """The receiver (AbortGroup) and the main thread (a cell's end) abort together."""
    keeper = GroupKeeper(0, 1, lambda msg: None, queue.Queue())
    both_checked = threading.Barrier(2)
    aborts: list[str] = []

    def is_initialized() -> bool:
        up = not aborts
        try:  # both threads see the group up before either aborts it, unless serialized
            both_checked.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass
        return up

    monkeypatch.setattr(dist, "is_initialized", is_initialized)
    monkeypatch.setattr(
        dist.distributed_c10d,
        "_abort_process_group",
        lambda: aborts.append(threading.current_thread().name),
    )
    threads = [threading.Thread(target=keeper.abort, name=f"t{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(aborts) == 1, aborts


# ---------------------------------------------------------------- an interrupt at a cell's end


SLOW_ERROR = """\
import signal
class SlowToSay(Exception):
    def __str__(self):
        signal.raise_signal(signal.SIGINT)  # the stop button, as the rank formats its error
        return "slow to say"
kept = 41
if rank == 1:
    raise SlowToSay()
"""


def test_an_interrupt_while_a_rank_formats_its_error_leaves_it_alive(pool):
    """It used to raise KeyboardInterrupt in the worker's serve loop: "rank 1 died"."""
    generation = pool.generation
    with pytest.raises(CellFailed) as failed:
        pool.execute(SLOW_ERROR)
    assert str(failed.value).startswith("rank 1: SlowToSay: slow to say"), str(failed.value)
    assert pool.execute("kept + 1") == [42, 42]  # every rank kept its state
    assert pool.generation == generation


def test_a_keyboard_interrupt_from_a_values_repr_still_ends_the_cell(pool):
    """The rank's own work after the cell runs user code too (repr of the value)."""
    code = "class Stubborn:\n    def __repr__(self):\n        raise KeyboardInterrupt\n"
    code += "kept = 5\nStubborn()"
    _, _, end = collect(pool.run(code))
    assert not end.exits, end.exits  # no rank died
    assert pool.execute("kept") == [5, 5]


def test_a_sigint_the_main_thread_did_not_handle_is_sent_again_until_it_is(monkeypatch):
    """A SIGINT that lands just before a blocking C call is not seen until the call ends:
    it is sent again every RESEND_EVERY s while the cell still runs and the handler has not
    run since (and no more once it has)."""
    import time

    from nbddp.rank import interrupts

    sent: list[float] = []
    monkeypatch.setattr(interrupts, "_to_main", lambda: sent.append(time.monotonic()))
    lost = interrupts.MainSigint()
    lost.send(lambda: len(sent) < 4)  # the cell runs until the fourth
    deadline = time.monotonic() + 5
    while len(sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3 * interrupts.RESEND_EVERY)
    assert len(sent) == 4
    handled = interrupts.MainSigint()
    sent.clear()
    handled.send(lambda: True)
    handled.handled += 1  # the handler ran: no second one
    time.sleep(3 * interrupts.RESEND_EVERY)
    assert len(sent) == 1
