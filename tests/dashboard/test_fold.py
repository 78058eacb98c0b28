"""Folded output: the same line from several ranks once, with its rank set; lines that
differ only in numbers folded with their values; nothing lost, every rank's lines in its
own order, whatever order the ranks print in."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbddp.dashboard.fold import Folder, Lines, fold_key, rank_set
from nbddp.wire import protocol as P


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


@pytest.mark.parametrize("arrival", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
def test_the_training_cell_folds_its_shared_lines_after_each_ranks_own(arrival):
    """Each rank prints its own loss line, then a shared line (the issue's cell): the shared
    lines fold whatever order the ranks print in, and the own lines read in rank order."""
    f, out = Folder(range(4)), []
    words = {0: "zero", 1: "one", 2: "two", 3: "three"}
    for epoch in range(2):
        for rank in arrival:  # each rank's two lines in one read, or one by one
            own = f"rank {words[rank]} says hi"
            out += f.feed_lines(rank, "stdout", [own, f"epoch {epoch} finished"], 0.0)
    for rank in arrival:
        out += f.feed(rank, "stdout", "training done", 0.0)
    assert f.pending == 0
    own = [("rank 0", "rank zero says hi"), ("rank 1", "rank one says hi")]
    own += [("rank 2", "rank two says hi"), ("rank 3", "rank three says hi")]
    assert lines(out) == [
        *own,
        ("ranks 0-3", "epoch 0 finished"),
        *own,
        ("ranks 0-3", "epoch 1 finished"),
        ("ranks 0-3", "training done"),
    ]


def test_lines_that_differ_only_in_numbers_fold_with_their_values():
    f, out = Folder(range(4)), []
    for rank, loss in [(2, "0.9633"), (0, "0.3333"), (3, "0.5"), (1, "0.4")]:
        out += f.feed(rank, "stdout", f"rank {rank} epoch 2 loss {loss}", 0.0)
    assert lines(out) == [("ranks 0-3", "rank {0-3} epoch 2 loss {0.3333..0.9633, max rank 2}")]
    detail = out[0].detail.splitlines()
    assert detail[0] == "loss lowest 0.3333 on rank 0, highest 0.9633 on rank 2"
    assert detail[1:] == [
        "rank 0: 0 2 0.3333",
        "rank 1: 1 2 0.4",
        "rank 2: 2 2 0.9633",
        "rank 3: 3 2 0.5",
    ]
    assert dict(out[0].each())[2] == "rank 2 epoch 2 loss 0.9633"  # each rank's line kept


def test_integers_that_differ_show_as_their_set_and_many_as_their_range():
    f, out = Folder(range(4)), []
    for rank, n in enumerate([10, 11, 12, 20]):
        out += f.feed(rank, "stdout", f"batch {n}", 0.0)
    assert lines(out) == [("ranks 0-3", "batch {10-12,20}")]
    f, out = Folder(range(64)), []
    for rank in range(64):
        out += f.feed(rank, "stdout", f"seen {rank * 7}", 0.0)
    assert lines(out) == [("ranks 0-63", "seen {0..441, max rank 63}")]


def test_lines_that_differ_stay_apart_and_come_out_in_rank_order():
    f = Folder(range(3))
    out = f.feed(2, "stdout", "gamma", 0.0)
    out += f.feed(1, "stdout", "beta", 0.0)
    out += f.feed(0, "stdout", "alpha", 0.0)
    assert out == []  # any rank may still print any of them, for the window
    assert lines(f.due(0.25)) == [("rank 0", "alpha"), ("rank 1", "beta"), ("rank 2", "gamma")]


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


def test_tqdm_bars_of_ranks_at_different_speeds_fold_into_the_slowest_ranks_bar():
    bar = "train: {:>3}%|{}| {}/10 [00:0{}<00:00,  9.{}it/s]"
    shown = [bar.format(100, "#" * 10, 10, 1, 5), bar.format(40, "####      ", 4, 2, 1)]
    assert fold_key(shown[0]) == fold_key(shown[1])
    assert fold_key("epoch [1/3]") != fold_key("train: [1/3]")  # not bars: text and numbers
    f, out = Folder(range(3)), []
    out += f.feed(0, "stderr", shown[0], 0.0)
    out += f.feed(2, "stderr", shown[1], 0.0)
    out += f.feed(1, "stderr", shown[0], 0.0)
    assert lines(out) == [("ranks 0-2", f"{shown[1]}  (slowest: rank 2; the others up to 10)")]
    f, out = Folder(range(2)), []
    for rank in range(2):
        out += f.feed(rank, "stderr", shown[0], 0.0)
    assert lines(out) == [("ranks 0-1", shown[0])]  # all at one place: the bar as it reads


@pytest.mark.parametrize("n", [3, 8, 64])
def test_a_range_names_the_rank_at_its_outlying_end_and_no_fold_keeps_each_value(n):
    """The rank far from the others is named in the line itself (the outlier end: the
    one further from the median), low or high."""
    for odd, value, named in [(n - 1, "0.10", "min"), (n // 2, "9.90", "max")]:
        f, out = Folder(range(n)), []
        for rank in range(n):
            loss = value if rank == odd else f"0.5{rank % 10}"
            out += f.feed(rank, "stdout", f"loss {loss}", 0.0)
        others = [f"0.5{r % 10}" for r in range(n) if r != odd]
        low, high = ("0.10", max(others)) if named == "min" else (min(others), "9.90")
        assert lines(out) == [(f"ranks 0-{n - 1}", f"loss {{{low}..{high}, {named} rank {odd}}}")]
    f, out = Folder(range(2)), []  # two ranks: as far from their mean, the max is named
    for rank in range(2):
        out += f.feed(rank, "stdout", f"loss 0.{rank + 1}", 0.0)
    assert lines(out) == [("ranks 0-1", "loss {0.1..0.2, max rank 1}")]
    f = Folder(range(n), window=0)  # --no-fold: every line as printed
    out = [g for rank in range(n) for g in f.feed(rank, "stdout", f"loss 0.5{rank % 10}", 0.0)]
    assert lines(out) == [(f"rank {r}", f"loss 0.5{r % 10}") for r in range(n)]


def bar_chunk(n: int, total: int = 10, end: str = "") -> str:
    """tqdm's bar at ``n`` of ``total``, as it writes it (a carriage return first)."""
    filled = "#" * (n * 10 // total)
    return f"\rtrain: {100 * n // total:>3}%|{filled:<10}| {n}/{total} [00:01<00:01,  9.8it/s]{end}"


@pytest.mark.parametrize("n", [2, 3, 8])
def test_running_tqdm_bars_fold_live_into_the_slowest_ranks_and_finish_as_one_line(n):
    """While bars run: one folded bar, the slowest rank's, named with the spread, its
    ranks' positions one point away; a rank that finished first waits for the others'
    bars, so the finished bar is one line, not n."""
    f = Folder(range(n))
    for rank in range(n):
        assert f.output(P.Output(rank, "stderr", bar_chunk(9 - rank % 3))) == []
    (live,) = f.bars()
    slow = max(range(n), key=lambda r: (r % 3, -r))
    assert live.ranks == list(range(n))
    assert live.text.endswith(f"(slowest: rank {slow}; the others up to 9)")
    assert f"{9 - slow % 3}/10 [" in live.text
    assert live.detail.splitlines()[0] == "rank 0: 9/10"
    out = []
    for rank in range(n):  # the ranks finish one by one, long after the window
        f.clock = lambda rank=rank: 100.0 + rank
        out += f.output(P.Output(rank, "stderr", bar_chunk(10, end="\n")))
        if rank < n - 1:
            assert out == []
            assert f.bars()[0].ranks == list(range(n))
    assert lines(out) == [(f"ranks 0-{n - 1}", bar_chunk(10)[1:])]
    assert f.bars() == []
    f = Folder(range(n), window=0)  # --no-fold: each rank's bar
    for rank in range(n):
        f.output(P.Output(rank, "stderr", bar_chunk(rank % 10)))
    assert [(g.ranks, g.text) for g in f.bars()] == [([r], bar_chunk(r % 10)[1:]) for r in range(n)]


def test_window_zero_folds_nothing():
    f = Folder(range(2), window=0)
    assert lines(f.feed(0, "stdout", "x", 0.0)) == [("rank 0", "x")]
    assert lines(f.feed(1, "stdout", "x", 0.0)) == [("rank 1", "x")]
    assert lines(f.feed(1, "stdout", "loss 0.5", 0.0)) == [("rank 1", "loss 0.5")]


# ---------------------------------------------------------------- any order the ranks print in

WORDS = ["a", "b", "c", "loss 0.1", "loss 0.7", "step 3", "done"]


def _interleave(rng: random.Random, printed: dict[int, list[str]], f: Folder, jump: float):
    """Feed every rank's lines in a random interleaving, ``jump`` seconds at most between
    two reads (0: the window never passes); the groups out, in order."""
    pending = {r: list(lines_) for r, lines_ in printed.items()}
    out, now = [], 0.0
    while any(pending.values()):
        rank = rng.choice([r for r in pending if pending[r]])
        now += rng.choice([0.0, 0.01, jump]) if jump else 0.0
        take = rng.randint(1, 3)
        chunk, pending[rank] = pending[rank][:take], pending[rank][take:]
        out += f.feed_lines(rank, "stdout", chunk, now)
        if not pending[rank] and rng.random() < 0.5:
            out += f.finish(rank, now)
        out += f.due(now)
    return out + f.flush()


def _delivered(out, n):
    """Each rank's lines as the groups give them back, in order; no rank twice in a group."""
    for g in out:
        assert len(set(g.ranks)) == len(g.ranks)
    return {r: [line for g in out for rank, line in g.each() if rank == r] for r in range(n)}


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 64),
    seed=st.integers(0, 2**32),
    jump=st.sampled_from([0.0, 0.3]),
    length=st.integers(0, 8),
)
def test_every_line_is_delivered_once_per_rank_in_its_order(n, seed, jump, length):
    rng = random.Random(seed)
    printed = {
        r: [rng.choice([*WORDS, f"own {r} x{r}"]) for _ in range(rng.randint(0, length))]
        for r in range(n)
    }
    f = Folder(range(n))
    out = _interleave(rng, printed, f, jump)
    assert f.pending == 0
    assert _delivered(out, n) == printed


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 64), seed=st.integers(0, 2**32), length=st.integers(0, 5))
def test_lines_every_rank_prints_after_the_same_lines_fold(n, seed, length):
    """Ranks that print the same lines (numbers apart) in any interleaving: each line
    shows once with every rank."""
    rng = random.Random(seed)
    script = [rng.choice(WORDS) for _ in range(length)] + ["the end"]
    printed = {r: [line.replace("0.1", f"0.{r}") for line in script] for r in range(n)}
    out = _interleave(rng, printed, Folder(range(n)), 0.0)
    assert [len(g.ranks) for g in out] == [n] * len(script)
    assert _delivered(out, n) == printed


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 64), seed=st.integers(0, 2**32), length=st.integers(0, 4))
def test_a_shared_line_after_lines_of_each_ranks_own_folds(n, seed, length):
    """Each rank prints lines of its own (any number), then a line every rank prints, then
    more of its own: the shared line shows once with every rank."""
    rng = random.Random(seed)
    own = ["alpha", "beta", "gamma", "delta"]
    printed = {
        r: [f"{rng.choice(own)} {r}" for _ in range(rng.randint(0, length))]
        + ["epoch finished"]
        + [f"after {rng.choice(own)}" for _ in range(rng.randint(0, 2))]
        for r in range(n)
    }
    out = _interleave(rng, printed, Folder(range(n)), 0.0)
    shared = [g for g in out if g.text == "epoch finished"]
    assert [sorted(g.ranks) for g in shared] == [list(range(n))]
    assert _delivered(out, n) == printed


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


@pytest.mark.parametrize("n", [2, 3, 8])
def test_out_shows_once_with_its_rank_set_after_lines_of_each_ranks_own(n):
    f, out = Folder(range(n), clock=Clock()), []
    for rank in reversed(range(n)):
        out += f.output(P.Output(rank, "stdout", f"{'abcdefgh'[rank]} is here\n"))
        out += f.result(P.RankResult(rank, "tensor([1., 2.])"))
    out += f.flush()
    assert lines(out)[n:] == [(f"ranks 0-{n - 1}", "Out: tensor([1., 2.])")]


def test_lines_of_long_digit_runs_fold_without_a_huge_integer():
    f, out = Folder(range(2)), []
    for rank in range(2):
        out += f.feed(rank, "stdout", str(rank + 1) * 20_000, 0.0)
    assert len(out) == 1
    assert out[0].text.startswith("{" + "1" * 24 + ".." + "2" * 24 + ", max rank 1}")
    assert out[0].detail.startswith("# lowest " + "1" * 24 + " on rank 0")


def test_like_lines_from_one_rank_search_only_what_the_rank_could_join(monkeypatch):
    """A rank printing 2,000 ``line N`` at once: each line looks at no group the rank is
    already in (before: every waiting group of the shape, a million searches, 23 s for
    1,500 lines in the dashboard)."""
    searched = []
    reaches = Folder._reaches

    def counted(self, *args):
        searched.append(1)
        assert len(searched) <= 2000, "a line searched groups its rank is already in"
        return reaches(self, *args)

    monkeypatch.setattr(Folder, "_reaches", counted)
    f = Folder([0, 1])
    for start in range(0, 2000, 500):
        f.feed_lines(0, "stdout", [f"line {i}" for i in range(start, start + 500)], 0.0)
    for start in range(0, 2000, 500):
        f.feed_lines(1, "stdout", [f"line {i}" for i in range(start, start + 500)], 0.0)
    groups = f.flush()
    assert [g.ranks for g in groups] == [[0, 1]] * 2000
