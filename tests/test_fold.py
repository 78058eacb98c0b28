"""Folded output: the same line from several ranks once, with its rank set; nothing lost,
every rank's lines in its own order."""

from __future__ import annotations

import random

import pytest

from nbddp import protocol as P
from nbddp.fold import Folder, Lines, fold_key, rank_set


def lines(groups):
    return [(g.label, g.text) for g in groups]


def test_rank_sets_are_written_as_ranges():
    assert rank_set([3]) == "3"
    assert rank_set([0, 1, 2, 3]) == "0-3"
    assert rank_set([5, 0, 2, 1, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_line_every_rank_prints_shows_once_when_the_last_rank_prints_it(n):
    f = Folder(range(n))
    for rank in range(n - 1):
        assert f.feed(rank, "stdout", "epoch 1 loss 0.25", 0.0) == []  # waits for the others
    assert lines(f.feed(n - 1, "stdout", "epoch 1 loss 0.25", 0.0)) == [
        (f"ranks 0-{n - 1}", "epoch 1 loss 0.25")
    ]


def test_lines_that_differ_stay_apart_and_a_rank_that_moved_on_settles_them():
    f = Folder(range(3))
    out = f.feed(0, "stdout", "rank 0 here", 0.0)
    out += f.feed(1, "stdout", "rank 1 here", 0.0)
    out += f.feed(2, "stdout", "rank 2 here", 0.0)  # ranks 1 and 2 are past rank 0's line
    assert lines(out) == [("rank 0", "rank 0 here")]
    out = f.feed(0, "stdout", "next", 0.0)  # rank 0 will not print "rank 1 here" now
    assert lines(out) == [("rank 1", "rank 1 here")]
    assert lines(f.flush()) == [("rank 2", "rank 2 here"), ("rank 0", "next")]


def test_some_ranks_fold_and_the_odd_one_keeps_its_place():
    f = Folder(range(4))
    out = []
    for rank in (0, 1, 2):
        out += f.feed(rank, "stdout", "same", 0.0)
    out += f.feed(3, "stdout", "different", 0.0)
    out += f.flush()
    assert lines(out) == [("ranks 0-2", "same"), ("rank 3", "different")]


def test_stdout_and_stderr_do_not_fold_together():
    f = Folder(range(2))
    out = f.feed(0, "stdout", "x", 0.0) + f.feed(1, "stderr", "x", 0.0) + f.flush()
    assert [(g.label, g.stream) for g in out] == [("rank 0", "stdout"), ("rank 1", "stderr")]


def test_a_line_waits_at_most_the_window_for_the_other_ranks():
    f = Folder(range(4), window=0.25)
    assert f.feed(0, "stdout", "only rank 0", 0.0) == []
    assert f.due(0.2) == []
    assert lines(f.due(0.25)) == [("rank 0", "only rank 0")]
    # a late rank's copy of it comes as its own line
    assert lines(f.feed(1, "stdout", "only rank 0", 0.3)) == []
    assert lines(f.due(0.6)) == [("rank 1", "only rank 0")]


def test_a_rank_that_ended_is_not_waited_for():
    f = Folder(range(3))
    f.feed(0, "stdout", "x", 0.0)
    f.feed(1, "stdout", "x", 0.0)
    assert lines(f.finish(2, 0.0)) == [("ranks 0-1", "x")]


def test_the_same_line_twice_from_one_rank_is_two_lines():
    f = Folder(range(2))
    out = f.feed(0, "stdout", "tick", 0.0) + f.feed(0, "stdout", "tick", 0.0)
    out += f.feed(1, "stdout", "tick", 0.0) + f.feed(1, "stdout", "tick", 0.0)
    assert lines(out) == [("ranks 0-1", "tick"), ("ranks 0-1", "tick")]


def test_tqdm_bars_fold_on_what_they_show_and_keep_the_slowest_ranks_timing():
    bar = "train: 100%|##########| 10/10 [00:0{}<00:00,  9.{}it/s]"
    assert (
        fold_key(bar.format(1, 5)) == fold_key(bar.format(2, 1)) == "train: 100%|##########| 10/10"
    )
    f, out = Folder(range(3)), []
    for rank in range(3):
        out += f.feed(rank, "stderr", bar.format(rank + 1, rank), 0.0)
    assert lines(out) == [("ranks 0-2", bar.format(3, 2))]
    assert fold_key("epoch [1/3]") == "epoch [1/3]"  # not a bar: the whole line


def test_window_zero_folds_nothing():
    f = Folder(range(2), window=0)
    assert lines(f.feed(0, "stdout", "x", 0.0)) == [("rank 0", "x")]
    assert lines(f.feed(1, "stdout", "x", 0.0)) == [("rank 1", "x")]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(25))
def test_nothing_is_lost_and_every_rank_keeps_its_order(n, seed):
    """Random interleavings of lines that often repeat across ranks: unfolding the output
    gives back each rank's lines, in order, and identical lines did fold."""
    rng = random.Random(seed)
    printed = {
        r: [rng.choice(["a", "b", "c", f"own {r}", "loss 0.1"]) for _ in range(rng.randint(0, 12))]
        for r in range(n)
    }
    pending = {r: list(lines_) for r, lines_ in printed.items()}
    f, out, now = Folder(range(n), window=0.25), [], 0.0
    while any(pending.values()):
        rank = rng.choice([r for r in pending if pending[r]])
        now += rng.choice([0.0, 0.01, 0.3])
        out += f.feed(rank, rng.choice(["stdout"]), pending[rank].pop(0), now)
        if not pending[rank]:
            out += f.finish(rank, now)
        out += f.due(now)
    out += f.flush()
    assert f.pending == 0
    seqs = [g.seq for g in out]
    assert seqs == sorted(seqs)  # groups come out in the order they were opened
    for r in range(n):
        assert [g.text for g in out if r in g.ranks] == printed[r]
    assert sum(len(g.ranks) for g in out) == sum(map(len, printed.values()))
    if all(printed[r] == ["a"] for r in range(n)):
        assert len(out) == 1


# ---------------------------------------------------------------- a cell's events in


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_text_chunks_become_whole_lines_and_a_carriage_return_rewrites_the_line():
    lines = Lines()
    assert lines.feed("a\nb") == ["a"]
    assert lines.current == "b"
    assert lines.feed(" 10%\r 50%\r") == []
    assert lines.current == " 50%"
    assert lines.feed("\r100%\n") == ["100%"]
    assert lines.flush() == []
    lines.feed("tail")
    assert lines.flush() == ["tail"]
    assert lines.current == ""


def test_output_events_fold_once_their_lines_are_whole():
    f = Folder(range(2), clock=Clock())
    assert f.output(P.Output(0, "stdout", "same\nhalf")) == []
    assert f.current(0, "stdout") == "half"
    assert f.current(1, "stdout") == ""  # printed nothing yet
    assert lines(f.output(P.Output(1, "stdout", "same\n"))) == [("ranks 0-1", "same")]


def test_a_rank_that_ends_counts_its_unfinished_line_and_is_not_waited_for():
    f = Folder((), clock=Clock())
    f.state(P.RankState(0, "running"))
    f.state(P.RankState(1, "running"))
    assert f.output(P.Output(0, "stdout", "x\n")) == []  # waits for rank 1
    assert f.output(P.Output(1, "stderr", "no newline")) == []
    # rank 1's last line is a line now, and it waits for rank 0, which may still print it
    assert lines(f.state(P.RankState(1, "failed"))) == [("rank 0", "x")]
    assert lines(f.state(P.RankState(0, "done"))) == [("rank 1", "no newline")]
    assert f.pending == 0


def test_a_result_comes_after_what_the_rank_printed_and_folds_as_out_lines():
    f = Folder(range(2), clock=Clock())
    f.output(P.Output(0, "stdout", "before"))
    out = f.result(P.RankResult(0, "tensor([1.,\n 2.])"))
    out += f.output(P.Output(1, "stdout", "before\n"))
    out += f.result(P.RankResult(1, "tensor([1.,\n 2.])"))
    assert lines(out) == [
        ("ranks 0-1", "before"),
        ("ranks 0-1", "Out: tensor([1.,"),
        ("ranks 0-1", "      2.])"),
    ]
    assert lines(Folder([0], clock=Clock()).result(P.RankResult(0, ""))) == [("rank 0", "Out: ")]


def test_due_reads_the_clock_and_flush_lets_out_open_groups_and_unfinished_lines():
    clock = Clock()
    f = Folder(range(3), clock=clock)
    f.output(P.Output(2, "stdout", "first\n"))
    f.output(P.Output(1, "stdout", "unfinished"))
    assert f.due() == []
    clock.t = 0.3  # past the window: nobody else printed it
    assert lines(f.due()) == [("rank 2", "first")]
    f.output(P.Output(0, "stdout", "open\n"))
    # the unfinished line becomes a line now: after the group opened before it
    assert lines(f.flush()) == [("rank 0", "open"), ("rank 1", "unfinished")]
    assert f.flush() == []


@pytest.mark.parametrize("seed", range(10))
def test_events_fold_as_the_same_whole_lines_do(seed):
    """Lines cut into random chunks give the groups the whole lines give."""
    rng = random.Random(seed)
    printed = {r: [rng.choice(["a", "b", f"own {r}"]) for _ in range(8)] for r in range(4)}
    by_lines, by_events = Folder(range(4)), Folder(range(4), clock=Clock())
    expected = []
    for r, lines_ in printed.items():
        expected += by_lines.feed_lines(r, "stdout", lines_, 0.0)
    expected += by_lines.flush()
    got = []
    for r, lines_ in printed.items():
        text = "".join(line + "\n" for line in lines_)
        cuts = sorted(rng.sample(range(len(text)), 3))
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            got += by_events.output(P.Output(r, "stdout", text[a:b]))
    got += by_events.flush()
    assert lines(got) == lines(expected)
