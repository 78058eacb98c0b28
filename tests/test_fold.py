"""Folded output: the same line from several ranks once, with its rank set; nothing lost,
every rank's lines in its own order."""

from __future__ import annotations

import random

import pytest

from nbddp.fold import Folder, fold_key, rank_set


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
