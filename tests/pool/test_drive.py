"""The event driver (nbddp.pool.drive) against fake events and a recording sink: no process."""

from __future__ import annotations

import pytest

from nbddp import CellInterrupted
from nbddp.pool.drive import drive
from nbddp.wire import protocol as P


class Sink:
    def __init__(self) -> None:
        self.handled: list[object] = []
        self.closed: list[object] = []

    def handle(self, event: object) -> None:
        self.handled.append(event)

    def close(self, end) -> None:
        self.closed.append(end)


class Pool:
    def __init__(self) -> None:
        self.interrupts = 0
        self.replies: list[tuple[int, str | None]] = []

    def interrupt(self) -> None:
        self.interrupts += 1

    def debug_reply(self, prompt: P.RankDebug, line: str | None) -> None:
        self.replies.append((prompt.rank, line))


END = P.CellEnd(1, (0, 1))


def events(*items):
    """A cell's events; an exception among them is raised there."""
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def test_every_event_reaches_the_sink_and_the_end_is_returned():
    sink = Sink()
    out = P.Output(0, "stdout", "hi\n")
    assert drive(Pool(), events(out, END), sink) is END
    assert sink.handled == [out, END]
    assert sink.closed == [END]


def test_the_sink_is_closed_when_driving_breaks_down():
    sink = Sink()
    with pytest.raises(RuntimeError, match="broke"):
        drive(Pool(), events(P.Output(0, "stdout", "hi\n"), RuntimeError("broke")), sink)
    assert sink.closed == [None]


def test_the_sink_is_closed_when_the_sink_itself_fails():
    class Failing(Sink):
        def handle(self, event: object) -> None:
            raise ValueError("cannot show it")

    sink = Failing()
    with pytest.raises(ValueError, match="cannot show it"):
        drive(Pool(), events(P.Output(0, "stdout", "hi\n"), END), sink)
    assert sink.closed == [None]


def test_ctrl_c_interrupts_the_ranks_and_driving_goes_on():
    pool = Pool()

    class OnceInterrupted(Sink):
        def handle(self, event: object) -> None:
            super().handle(event)
            if len(self.handled) == 1:
                raise KeyboardInterrupt

    sink = OnceInterrupted()
    assert drive(pool, events(P.Output(0, "stdout", "a\n"), END), sink) is END
    assert pool.interrupts == 1
    assert sink.closed == [END]


def test_pdb_without_a_prompt_is_closed_at_once():
    pool = Pool()
    ask = P.RankDebug(1, "> cell(2)", "(Pdb rank 1) ")
    assert drive(pool, events(ask, END), None) is END
    assert pool.replies == [(1, None)]


def test_pdb_gets_the_prompts_lines_until_it_gives_none_then_is_closed():
    pool = Pool()
    asks = [P.RankDebug(0, "", "(Pdb) ", seq) for seq in range(4)]
    answers = iter(["p x", None, "never asked"])
    drive(pool, events(*asks, END), None, prompt=lambda event: next(answers))
    assert pool.replies == [(0, "p x"), (0, None), (0, None), (0, None)]


def test_ctrl_c_at_the_prompt_closes_that_ranks_pdb_and_interrupts():
    pool = Pool()
    asks = [P.RankDebug(0, "", "(Pdb) ", seq) for seq in range(2)]

    def stop_button(event):
        raise KeyboardInterrupt

    assert drive(pool, events(*asks, END), Sink(), prompt=stop_button) is END
    assert pool.replies == [(0, None), (0, None)]  # the second is not asked
    assert pool.interrupts == 1


def test_shown_chooses_what_the_sink_sees():
    sink = Sink()
    out = [P.Output(r, "stdout", "x\n") for r in (0, 1)]
    drive(Pool(), events(*out, END), sink, shown=lambda e: getattr(e, "rank", 0) == 0)
    assert sink.handled == [out[0], END]


def test_no_end_is_an_interrupted_cell_and_the_sink_is_still_closed():
    sink = Sink()
    with pytest.raises(CellInterrupted):
        drive(Pool(), events(P.Output(0, "stdout", "x\n")), sink)
    assert sink.closed == [None]
