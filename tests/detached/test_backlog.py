"""What a detached supervisor keeps for a kernel that does not read is bounded in count and
bytes, and what it dropped is said (issue 47, item 5).

Before, only output events were bounded: with no kernel connected, the supervisor kept a
Tick every 0.1 s, every stack sample and every metrics point of every cell (about 145 MB a
day). A day of a 4-rank training loop's events is fed here, as the pool gives them.
"""

from __future__ import annotations

from array import array

from nbddp.detached import messages as W
from nbddp.wire import protocol as P

END = P.CellEnd(1, (0, 1), {}, {}, {}, None, ())


def _metrics(rank: int, step: int) -> P.RankMetrics:
    steps, values = array("q", [step]).tobytes(), array("d", [0.5]).tobytes()
    return P.RankMetrics(rank, ((None, "loss", steps, values),))


def _day_of_events(seconds: int = 86_400):
    """One second at a time: 10 Ticks, a stack sample and a metrics point per rank, a line
    printed by rank 0; a cell's end every hour."""
    for s in range(seconds):
        batch = [W.Event(P.Tick(), 1) for _ in range(10)]
        for rank in range(4):
            batch.append(W.Event(P.RankWhere(rank, "cell line 3: step()", None, s), 1))
            batch.append(W.Event(_metrics(rank, s), 1))
        batch.append(W.Event(P.Output(0, "stdout", f"step {s} loss 0.5\n"), 1))
        if s % 3600 == 3599:
            batch.append(W.Event(END, 1))
            batch.append(W.Reply(None, None, 1))
        yield W.Batch(tuple(batch))


def test_a_day_without_a_kernel_keeps_a_bounded_backlog_and_every_cells_end():
    backlog = W.Backlog()
    for batch in _day_of_events():
        backlog.extend([batch])
    kept = backlog.take()
    assert len(kept) <= W.BACKLOG * 1.25 + 2 * 24
    assert not any(isinstance(i, W.Event) and isinstance(i.event, P.Tick) for i in kept)
    ends = [i for i in kept if isinstance(i, W.Event) and isinstance(i.event, P.CellEnd)]
    assert len(ends) == 24  # every cell's end and reply, whatever was dropped
    assert sum(isinstance(i, W.Reply) for i in kept) == 24
    lines = [i.event.text for i in kept if isinstance(i, W.Event) and isinstance(i.event, P.Output)]
    assert lines[-1] == "step 86399 loss 0.5\n"  # the newest kept, in order
    steps = [int(t.split()[1]) for t in lines]
    assert steps == sorted(steps)
    said = backlog.said_dropped()
    assert said.startswith(f"{backlog.dropped[P.Output]:,} lines printed, "), said
    assert f"{backlog.dropped[P.RankMetrics]:,} metrics points and " in said, said
    assert said.endswith("other events (progress, places, displays)"), said
    assert sum(backlog.dropped.values()) == 86_400 * 9 - (len(kept) - 2 * 24)


def test_big_lines_are_bounded_in_bytes():
    backlog = W.Backlog()
    line = "x" * (1 << 20)
    for i in range(200):  # 200 MB of output
        backlog.extend([W.Event(P.Output(1, "stdout", f"{i} {line}\n"), 1)])
    assert backlog.bytes <= W.BACKLOG_BYTES
    kept = backlog.take()
    assert 32 <= len(kept) <= 64
    assert kept[-1].event.text.startswith("199 ")
    assert backlog.said_dropped() == f"{200 - len(kept)} lines printed"


def test_what_a_kernel_did_not_read_goes_back_first_and_is_counted_once():
    backlog = W.Backlog(limit=4)
    backlog.extend([W.Event(P.Output(0, "stdout", f"{i}\n"), 1) for i in range(4)])
    backlog.extend([W.Event(P.Output(0, "stdout", "early\n"), 1)], front=True)
    assert [backlog.pop().event.text for _ in range(len(backlog))] == [
        "early\n",
        "0\n",
        "1\n",
        "2\n",
        "3\n",
    ]
    assert backlog.bulk == backlog.bytes == 0
    assert backlog.said_dropped() == ""
