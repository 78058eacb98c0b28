"""tqdm bars in the folded output: a bar every rank runs comes out as one finished line
whatever order and speed the ranks run it at, one rank starting late included; a bar on
rank 0 only comes out without waiting for ranks that never run it; each occurrence of a
description is a bar of its own."""

from __future__ import annotations

import io
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbddp.dashboard.fold import Folder
from nbddp.dashboard.fold_bars import BAR_GRACE, BAR_HOLD
from nbddp.dashboard.sinks import TextSink
from nbddp.wire import protocol as P

SIZES = [2, 3, 4, 8]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def frame(n: int, total: int = 20, desc: str = "eval", end: str = "") -> str:
    """tqdm's bar at ``n`` of ``total``, as it writes it (a carriage return first)."""
    filled = "#" * (n * 10 // total)
    return f"\r{desc}: {100 * n // total:>3}%|{filled:<10}| {n}/{total} [00:01<00:01, 9.8it/s]{end}"


DONE = frame(20)[1:]


class Run:
    """A Folder on a clock the test moves; every group out, in order."""

    def __init__(self, n: int) -> None:
        self.t = 0.0
        self.f = Folder(range(n), clock=lambda: self.t)
        self.out: list = []

    def at(self, t: float) -> Run:
        self.t = max(self.t, t)
        self.out += self.f.due()
        return self

    def say(self, rank: int, line: str) -> None:
        self.out += self.f.feed(rank, "stdout", line, self.t)

    def bar(self, rank: int, text: str) -> None:
        self.out += self.f.output(P.Output(rank, "stderr", text))

    def shown(self) -> list[tuple[str, str]]:
        return [(g.label, g.text) for g in self.out]


@pytest.mark.parametrize("n", SIZES)
def test_a_bar_every_rank_runs_is_one_line_when_a_rank_starts_it_late(n):
    """The issue's notebook 06: every rank printed the line before the bar, the fast ranks
    end their bars before the last rank's first frame is read (long after the window);
    then, the bar's next occurrence, the last rank starts it seconds after the others
    ended theirs: each time one folded line."""
    r = Run(n)
    late = n - 1
    for rank in range(n):
        r.say(rank, "epoch 1 finished")
    assert r.shown() == [(f"ranks 0-{n - 1}", "epoch 1 finished")]
    for rank in range(late):
        r.bar(rank, frame(0))
        r.bar(rank, frame(20, end="\n"))
    r.at(0.8 * BAR_GRACE)  # the window passed long ago: the late rank is expected
    r.bar(late, frame(0))  # its first frame comes
    for t in (2.0, 5.0):
        r.at(t)
    assert len(r.out) == 1
    r.bar(late, frame(20, end="\n"))
    assert r.shown()[1:] == [(f"ranks 0-{n - 1}", DONE)]
    for rank in range(late):  # the next occurrence: every rank ran the bar before
        r.bar(rank, frame(20, end="\n"))
    r.at(r.t + BAR_HOLD / 2)
    assert len(r.out) == 2
    r.bar(late, frame(20, end="\n"))
    assert r.shown()[2:] == [(f"ranks 0-{n - 1}", DONE)]
    r.at(r.t + 1)
    assert r.f.pending == 0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("first", [True, False])
def test_a_bar_on_rank_zero_only_comes_out_without_waiting_for_the_others(n, first):
    """``if rank == 0: for x in tqdm(...)`` after a line every rank printed (or as the
    cell's first line): the others stand where rank 0 began, silent (in a barrier). A
    short bar waits at most BAR_GRACE after their last line, a long one not at all."""
    for length in (0.1, 3.0):
        r = Run(n)
        if not first:
            for rank in range(n):
                r.say(rank, "epoch 1 finished")
        start = r.t
        r.bar(0, frame(0))
        r.at(start + length)
        r.bar(0, frame(20, end="\n"))
        r.at(max(start + BAR_GRACE, start + length + r.f.window) + 0.01)  # (long: no wait)
        assert r.shown()[-1] == ("rank 0", DONE)
        for rank in range(n):  # the barrier: then every rank's next line
            r.say(rank, "training done")
        assert r.shown()[-1] == (f"ranks 0-{n - 1}", "training done")


def _timeline(rng: random.Random, n: int) -> list[tuple[float, int, str, str]]:
    """Every rank's prints as ``(read at, rank, kind, text)``, in the order read: its own
    line and a shared line within 0.1 s of the others', then its bar, begun up to 0.8
    BAR_GRACE later, at its own speed; after a barrier (every rank's bar ended), ``done``.
    Each print is read up to 0.1 s after it was made, each rank's in its order."""
    out, ends = [], []
    for rank in range(n):
        t = rng.uniform(0, 0.1)
        prints = [(t, "say", f"rank {rank} own"), (t + 0.01, "say", "epoch finished")]
        t += 0.01 + rng.uniform(0, 0.8 * BAR_GRACE)
        for k in (0, *sorted(rng.sample(range(1, 20), 2))):
            prints.append((t, "bar", frame(k)))
            t += rng.uniform(0.01, 0.5)
        prints.append((t, "bar", frame(20, end="\n")))
        ends.append(t)
        out.append(prints)
    barrier = max(ends)
    for rank, prints in enumerate(out):
        prints.append((barrier + 0.01, "say", "done"))
        read = 0.0
        for i, (t, kind, text) in enumerate(prints):
            read = max(read, t + rng.uniform(0, 0.1))  # in its order
            prints[i] = (read, rank, kind, text)
    return sorted((p for prints in out for p in prints), key=lambda p: (p[0], p[1]))


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from(SIZES), seed=st.integers(0, 2**32))
def test_bars_of_every_rank_fold_into_one_line_in_any_interleaving(n, seed):
    """Each rank prints its own line, a shared line, then runs the bar at its own speed,
    starting up to 0.8 BAR_GRACE after its shared line; the reads interleave at random,
    the folder asked what is due between them: the finished bar is one line of every
    rank, and every line comes out once, in each rank's order."""
    rng = random.Random(seed)
    r = Run(n)
    for read, rank, kind, text in _timeline(rng, n):
        r.at(rng.uniform(r.t, read))  # (a tick between two reads)
        r.at(read)
        if kind == "say":
            r.say(rank, text)
        else:
            r.bar(rank, text)
    r.out += r.f.flush()
    eval_lines = [g for g in r.out if "eval" in g.text]
    assert [(g.label, g.text) for g in eval_lines] == [(f"ranks 0-{n - 1}", DONE)]
    for rank in range(n):
        mine = [line for g in r.out for k, line in g.each() if k == rank]
        assert mine == [f"rank {rank} own", "epoch finished", DONE, "done"]


def test_each_occurrence_of_a_description_is_a_bar_of_its_own():
    """Two ``tqdm(desc="train")`` loops one after the other: rank 0 in its second while
    rank 1 is still in its first are two bars, each with its own identity (a toggle of its
    own in the dashboard); --no-fold: each rank's bar its own identity too."""
    f = Folder(range(2))
    f.output(P.Output(0, "stderr", frame(20, desc="train", end="\n") + frame(3, desc="train")))
    f.output(P.Output(1, "stderr", frame(15, desc="train")))
    first, second = sorted(f.bars(), key=lambda g: g.nth)
    assert (first.ranks, second.ranks) == ([0, 1], [0])
    assert "15/20" in first.text
    assert "(slowest: rank 1; the others up to 20)" in first.text
    assert "3/20" in second.text
    assert first.tag != second.tag
    f.output(P.Output(1, "stderr", frame(20, desc="train", end="\n") + frame(1, desc="train")))
    (both,) = f.bars()
    assert both.ranks == [0, 1]
    assert both.tag == second.tag  # the same bar: the same toggle
    f = Folder(range(2), window=0)
    for rank in range(2):
        f.output(P.Output(rank, "stderr", frame(5, desc="train")))
    tags = {g.tag for g in f.bars()}
    assert len(tags) == 2
    f.output(P.Output(0, "stderr", frame(20, desc="train", end="\n") + frame(1, desc="train")))
    assert len(tags | {g.tag for g in f.bars()}) == 3  # rank 0's second bar: its own


@pytest.mark.parametrize("n", [2, 3, 8])
def test_text_says_running_tqdm_bars_folded_at_nbddp_progress_pace_and_the_end_once(n):
    """--text: a tqdm bar every rank runs (the last rank slowest, 2 s) is said while it
    runs, folded, as nbddp.progress is: when the slowest rank's whole percent moved and
    a second passed (the first a second after it began), never at 100%; then the
    finished bar once. --no-fold: each rank's own."""
    for fold in (True, False):
        clock, err = Clock(), io.StringIO()
        sink = TextSink(stdout=io.StringIO(), stderr=err, clock=clock, fold=fold)
        for rank in range(n):
            sink.handle(P.RankState(rank, "running"))
        at = dict.fromkeys(range(n), -1)
        for step in range(201):  # 2 s for the last rank, 1 s for rank 0
            clock.t = step / 100
            for rank in range(n):
                done = min(100, round(step / (1 + rank / (n - 1))))
                if done > at[rank]:
                    at[rank] = done
                    end = "\n" if done == 100 and rank < n - 1 else ""
                    sink.handle(P.Output(rank, "stderr", frame(done, 100, end=end)))
        clock.t = 3.5  # the slowest rank's bar at 100%, its newline not read yet: no line
        sink.handle(P.Output(0, "stderr", ""))
        sink.handle(P.Output(n - 1, "stderr", "\n"))
        sink.close(P.CellEnd(1, tuple(range(n))))
        said = err.getvalue().splitlines()
        if not fold:
            assert all(re.match(r"\[rank \d+\] eval: ", line) for line in said), said
            assert {line.split("]")[0] for line in said} == {f"[rank {r}" for r in range(n)}
            continue
        *live, last = said
        assert last == f"[ranks 0-{n - 1}] eval: 100%|##########| 100/100 [00:01<00:01, 9.8it/s]"
        assert len(live) == 1, said  # at 1 s (at 2 s the slowest is at its end)
        assert re.fullmatch(
            rf"\[ranks 0-{n - 1}\] eval:  50%\|#####     \| 50/100 .*"
            rf"\(slowest: rank {n - 1}; the others up to 100\)",
            live[0],
        ), said


@pytest.mark.parametrize("n", [3, 8])
def test_a_line_with_a_percent_and_bars_that_is_no_tqdm_bar_folds_as_text(n):
    """Issue 47, item 8: ``acc 12%| train | ./data/x.csv`` looked like a bar whose count
    was ``.``: two ranks printing it crashed the sink (``could not convert string to
    float: '.'``), and the cell's output and values were dropped."""
    clock, out = Clock(), io.StringIO()
    sink = TextSink(stdout=out, stderr=io.StringIO(), clock=clock)
    for rank in range(n):
        sink.handle(P.RankState(rank, "running"))
    for rank in range(n):
        sink.handle(P.Output(rank, "stdout", f"acc {10 + rank}%| train | ./data/x.csv\n"))
    clock.t = 5.0
    sink.close(P.CellEnd(1, tuple(range(n))))
    said = out.getvalue().splitlines()
    assert said == [f"[ranks 0-{n - 1}] acc {{10-{9 + n}}}%| train | ./data/x.csv"], said


@pytest.mark.timeout(20)
def test_long_lines_are_read_in_linear_time():
    """Issue 47, item 9: the bar patterns were quadratic: 5.2 s for one 16 KB line of
    digits, at every output event. 64 KB lines of digits (and of what a bar is made of)
    would take minutes so; here they take milliseconds (the timeout is the test)."""
    from nbddp.dashboard import fold_shape

    for line in (
        "1" * 65536,
        "1" * 65536 + "%|",
        "a 1%|" + "|" * 65536 + " 1/2",
        "1" * 65536 + "it [1it/s]",
        "[" * 65536 + "1it [1it/s]",
    ):
        for _ in range(20):
            assert not fold_shape.is_progress(line)
            fold_shape.shape(line)
            assert fold_shape.bar_count(line) is None
            assert fold_shape.bar_percent(line) is None


def test_tqdm_layouts_are_read_as_before():
    from nbddp.dashboard import fold_shape

    assert fold_shape.bar_count("eval:  45%|####5     | 45/100 [00:01<00:02, 30.1it/s]") == "45/100"
    assert fold_shape.bar_percent("x: 50%|#####     | 1.5k/3.0k [00:01<00:01, 1.0kit/s]") == 50
    assert fold_shape.bar_count("45it [00:01, 30.12it/s]") == "45it"
    assert fold_shape.bar_count("train 1.5kit [00:03,  2.1s/it]") == "1.5kit"
    assert fold_shape.is_progress("100%|##########| 10/10 [00:00<00:00, 99.1it/s]")
    assert not fold_shape.is_progress("it [is not a bar]")
    assert fold_shape.shape("eval:  45%|####5     | 45/100 [00:01<00:02]") == (
        "\x01bar eval:",
        None,
    )
