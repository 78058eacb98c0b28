from __future__ import annotations

import io

from nbddp import protocol as P
from nbddp.dashboard import TextSink


def make(**kw):
    out, err = io.StringIO(), io.StringIO()
    return TextSink(stdout=out, stderr=err, **kw), out, err


def end(errors=()):
    return P.CellEnd(1, (0, 1), errors={r: P.ErrorInfo("E", "m", "tb") for r in errors})


def test_lines_are_prefixed_by_rank_and_streams_kept_apart():
    sink, out, err = make()
    sink.handle(P.Output(0, "stdout", "a\nb"))
    sink.handle(P.Output(1, "stderr", "warn\n"))
    assert out.getvalue() == "[rank 0] a\n"  # "b" waits for its newline
    sink.handle(P.Output(0, "stdout", "c\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] a\n[rank 0] bc\n"
    assert err.getvalue() == "[rank 1] warn\n"


def test_a_partial_last_line_is_printed_at_the_end():
    sink, out, _ = make()
    sink.handle(P.Output(0, "stdout", "no newline"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] no newline\n"


def test_carriage_returns_keep_the_last_state_of_a_progress_line():
    sink, out, _ = make()
    sink.handle(P.Output(0, "stdout", " 10%\r 50%\r100%\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] 100%\n"


def test_output_is_bounded_keeping_the_tail_and_counting_the_rest():
    sink, out, err = make(head=3, tail=2)
    sink.handle(P.Output(0, "stdout", "".join(f"{i}\n" for i in range(10))))
    sink.close(end())
    assert out.getvalue().splitlines() == [
        "[rank 0] 0",
        "[rank 0] 1",
        "[rank 0] 2",
        "[rank 0] 8",
        "[rank 0] 9",
    ]
    assert err.getvalue() == "[rank 0] ... 5 lines not shown ...\n"


def test_results_show_as_out():
    sink, out, _ = make()
    sink.handle(P.RankResult(1, "tensor([1.,\n 2.])"))
    assert out.getvalue() == "[rank 1] Out: tensor([1.,\n[rank 1]       2.])\n"


def test_quiet_shows_nothing_when_all_ranks_succeed():
    sink, out, err = make(quiet=True)
    sink.handle(P.Output(0, "stdout", "hello\n"))
    sink.handle(P.RankResult(0, "1"))
    sink.close(end())
    assert out.getvalue() == err.getvalue() == ""


def test_quiet_shows_the_failed_ranks_output():
    sink, out, _ = make(quiet=True)
    sink.handle(P.Output(0, "stdout", "fine\n"))
    sink.handle(P.Output(1, "stdout", "before the error\n"))
    sink.close(end(errors=[1]))
    assert out.getvalue() == "[rank 1] before the error\n"
